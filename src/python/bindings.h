// The parts of the `_wsync` extension, each registered by module.cc from its own file.
#pragma once

#include <pybind11/pybind11.h>

namespace wsync::python {

void BindTrainer(pybind11::module_& m);   // trainer.cc: TrainerEngine, SyncStats, sources
void BindReceiver(pybind11::module_& m);  // receiver.cc: ReceiverEngine
void BindHostedServer(pybind11::module_& m);  // hosted_server.cc: the HTTP server over Python workers

}  // namespace wsync::python
