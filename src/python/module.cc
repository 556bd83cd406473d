// The `_wsync` extension: wsync's engine for Python trainers and inference workers.
// The public surface is the `wsync` package (python/wsync), which re-exports what this
// module defines; each part registers itself from its own file (bindings.h).
#include <optional>
#include <string>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "backends/descriptor.h"
#include "core/json_limits.h"
#include "core/log.h"
#include "python/bindings.h"
#include "python/errors.h"
#include "receiver/backend_mismatch.h"
#include "wsync/backend.h"
#include "wsync/trainer.h"
#ifdef WSYNC_WITH_CUDA
#include "cuda/runtime.h"
#endif

namespace {

namespace py = pybind11;

py::list OptionSchema(const std::vector<wsync::BackendOptionSpec>& schema) {
  py::list out;
  for (const wsync::BackendOptionSpec& o : schema) {
    py::dict d;
    d["key"] = std::string(o.key);
    d["type"] = std::string(o.type);
    d["default"] = std::string(o.default_value);
    d["help"] = std::string(o.help);
    d["hidden"] = o.hidden;
    out.append(d);
  }
  return out;
}

// Every backend's descriptor (src/backends/descriptor.h) as a dict, in registry order.
py::list Backends() {
  py::list out;
  for (const wsync::BackendDescriptor* b : wsync::Backends()) {
    py::dict d;
    d["name"] = std::string(b->name);
    d["summary"] = std::string(b->summary);
    d["init_info_fields"] = b->init_info_fields;
    d["shared_init_info_fields"] = b->shared_init_info_fields;
    d["update_info_fields"] = b->update_info_fields;
    d["trainer_options"] = OptionSchema(b->trainer_options);
    d["receiver_options"] = OptionSchema(b->receiver_options);
    d["model_option"] = std::string(b->model_option);
    d["single_worker_receiver"] = b->single_worker_receiver;
    d["fetches"] = b->fetches;
    out.append(d);
  }
  return out;
}

// The backend whose own init_info fields `init_info` (JSON text of an object) carries most
// of, as the backend-mismatch detector tells them; None when it carries none.
std::optional<std::string> InitInfoBackend(const std::string& init_info) {
  nlohmann::json j = wsync::python::ValueOrRaise(wsync::ParseUntrustedJson(init_info, "init_info"));
  std::optional<wsync::InitInfoGuess> guess = wsync::GuessForeignInitInfo("", j);
  if (!guess) return std::nullopt;
  return guess->backend;
}

}  // namespace

PYBIND11_MODULE(_wsync, m) {
  m.doc() = "wsync: weight sync from RL trainers into inference servers";
  wsync::log::Init("python");  // WSYNC_LOG_LEVEL, read once at import
#ifdef WSYNC_WITH_CUDA
  wsync::cuda::InstallDeviceRuntime();  // devices "cuda:N" work once the module is imported
#endif
  m.def("trainer_backends", &wsync::TrainerBackendNames,
        "Names of the trainer backends this build has, e.g. ['delta', 'ipc', 'nccl'].");
  m.def("backends", &Backends,
        "Every backend this build has, in registry order: a dict each with name, summary, init_info_fields, "
        "shared_init_info_fields, update_info_fields, trainer_options and receiver_options (lists of "
        "{key, type, default, help, hidden}), model_option, single_worker_receiver and fetches.");
  m.attr("DEFAULT_BACKEND") = wsync::kDefaultBackend;
  m.def("init_info_backend", &InitInfoBackend, py::arg("init_info"),
        "The backend an init_info (JSON text) carries the most own fields of, or None.");
  wsync::python::BindTrainer(m);
  wsync::python::BindReceiver(m);
}
