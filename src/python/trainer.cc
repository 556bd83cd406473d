#include "python/bindings.h"

namespace wsync::python {

void BindTrainer(pybind11::module_& m) {}

}  // namespace wsync::python
