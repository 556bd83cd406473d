// The parts of the `_wsync` extension, each registered by module.cc from its own file.
#pragma once

#include <pybind11/pybind11.h>

namespace wsync::python {

void BindTrainer(pybind11::module_& m);   // trainer.cc: TrainerEngine, SyncStats, sources
void BindReceiver(pybind11::module_& m);  // receiver.cc: ReceiverEngine
void BindHostedServer(pybind11::module_& m);  // hosted_server.cc: the HTTP server over Python workers

// Whether the interpreter is gone or going: a thread other than the finalizing one that
// takes the GIL then is ended by Python (a forced unwind, fatal in a destructor).
inline bool InterpreterFinalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return !Py_IsInitialized() || Py_IsFinalizing();
#else
  return !Py_IsInitialized() || _Py_IsFinalizing();
#endif
}

// Lets go of `obj` with the GIL taken, from any thread; leaks it once the interpreter is
// finalizing, when no other thread may take the GIL.
inline void DropWithGil(pybind11::object& obj) {
  if (!obj) return;
  if (InterpreterFinalizing()) {
    obj.release();
    return;
  }
  pybind11::gil_scoped_acquire gil;
  obj = pybind11::object();
}

}  // namespace wsync::python
