#include "python/errors.h"

#include <string_view>

namespace py = pybind11;

namespace wsync::python {

void RaiseStatus(const Status& status) {
  py::object by_code = py::module_::import("wsync.errors").attr("BY_CODE");
  py::str name(std::string(StatusCodeName(status.code())));
  py::object cls = by_code.contains(name) ? py::object(by_code[name]) : py::object(py::module_::import("wsync.errors").attr("Error"));
  PyErr_SetObject(cls.ptr(), py::str(status.message()).ptr());
  throw py::error_already_set();
}

std::string DescribePythonError(const py::error_already_set& error) {
  std::string type = py::str(error.type().attr("__name__"));
  std::string text = py::str(error.value());
  return text.empty() ? type : type + ": " + text;
}

}  // namespace wsync::python
