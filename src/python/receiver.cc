#include "python/bindings.h"

namespace wsync::python {

void BindReceiver(pybind11::module_& m) {}

}  // namespace wsync::python
