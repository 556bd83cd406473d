#include "python/errors.h"

#include <string_view>

namespace py = pybind11;

namespace wsync::python {

void RaiseStatus(const Status& status) { RaiseStatus(status, py::none()); }

void RaiseStatus(const Status& status, py::handle cause) {
  py::module_ errors = py::module_::import("wsync.errors");
  py::object by_code = errors.attr("BY_CODE");
  py::str name(std::string(StatusCodeName(status.code())));
  py::object cls = by_code.contains(name) ? py::object(by_code[name]) : py::object(errors.attr("Error"));
  py::object exc = cls(py::str(status.message()));
  if (cause && !cause.is_none()) PyException_SetCause(exc.ptr(), cause.inc_ref().ptr());
  PyErr_SetObject(cls.ptr(), exc.ptr());
  throw py::error_already_set();
}

std::string DescribePythonError(const py::error_already_set& error) {
  std::string type = py::str(error.type().attr("__name__"));
  std::string text = py::str(error.value());
  return text.empty() ? type : type + ": " + text;
}

}  // namespace wsync::python
