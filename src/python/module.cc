// The `_wsync` extension: wsync's engine for Python trainers and inference workers.
// The public surface is the `wsync` package (python/wsync), which re-exports what this
// module defines; each part registers itself from its own file (bindings.h).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "core/log.h"
#include "python/bindings.h"
#include "wsync/trainer.h"
#ifdef WSYNC_WITH_CUDA
#include "cuda/runtime.h"
#endif

PYBIND11_MODULE(_wsync, m) {
  m.doc() = "wsync: weight sync from RL trainers into inference servers";
  wsync::log::Init("python");  // WSYNC_LOG_LEVEL, read once at import
#ifdef WSYNC_WITH_CUDA
  wsync::cuda::InstallDeviceRuntime();  // devices "cuda:N" work once the module is imported
#endif
  m.def("trainer_backends", &wsync::TrainerBackendNames,
        "Names of the trainer backends this build has, e.g. ['delta', 'ipc', 'nccl'].");
  wsync::python::BindTrainer(m);
  wsync::python::BindReceiver(m);
  wsync::python::BindHostedServer(m);
}
