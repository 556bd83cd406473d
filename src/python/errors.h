// wsync statuses as Python exceptions (python/wsync/errors.py: one class per status code).
#pragma once

#include <string>

#include <pybind11/pybind11.h>

#include "wsync/status.h"

namespace wsync::python {

// Raises `status` (not OK) as its wsync.errors class, carrying its message. Needs the GIL.
[[noreturn]] void RaiseStatus(const Status& status);
// The same, with `cause` (an exception object, or None) as the raised one's __cause__.
[[noreturn]] void RaiseStatus(const Status& status, pybind11::handle cause);

// Returns the value of `result`, or raises its status.
template <typename T>
T ValueOrRaise(Result<T> result) {
  if (!result.ok()) RaiseStatus(result.status());
  return std::move(result).value();
}
inline void OkOrRaise(const Status& status) {
  if (!status.ok()) RaiseStatus(status);
}

// The Python exception now being handled, as text for a wsync Status ("ValueError: ...");
// for errors raised by user code (a source's iterator, a load_weights callback) that must
// travel through the engine to the servers. Needs the GIL.
std::string DescribePythonError(const pybind11::error_already_set& error);

}  // namespace wsync::python
