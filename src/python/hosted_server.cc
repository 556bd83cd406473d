// _wsync._HostedServer: `wsync serve`'s HTTP server and router over Python workers
// (python/wsync/worker_server.py builds them: a ReceiverEngine and the model it lands
// into, per worker). The routes, the session rules and the error map are C++
// (hosted_service.h); a worker's calls go back into Python, and only they take the GIL.
// A Python exception a worker call raises becomes the Status of its wsync.errors class,
// or Internal naming the worker and the call ("worker 0: load_weights raised ...").
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "control/http_server.h"
#include "core/digest.h"
#include "core/json_limits.h"
#include "python/bindings.h"
#include "python/errors.h"
#include "python/hosted_service.h"

namespace py = pybind11;

namespace wsync::python {
namespace {

using nlohmann::json;

// A Python object shared by C++ threads: copies cost no GIL, the last one releases the
// object with the GIL taken (DropWithGil).
struct PyRef {
  py::object object;
  explicit PyRef(py::object o) : object(std::move(o)) {}
  ~PyRef() { DropWithGil(object); }
};

// The Status of the Python exception being handled in a call of worker `index`'s
// `what`: a wsync.errors class keeps its code and text, anything else is Internal.
Status StatusOfPythonError(const py::error_already_set& e, size_t index, const char* what) {
  py::object base = py::module_::import("wsync.errors").attr("Error");
  if (py::isinstance(e.value(), base)) {
    const std::string code = py::str(e.value().attr("code"));
    for (StatusCode c : {StatusCode::kInvalidArgument, StatusCode::kUnauthenticated, StatusCode::kNotFound,
                         StatusCode::kFailedPrecondition, StatusCode::kPayloadTooLarge, StatusCode::kDeadlineExceeded,
                         StatusCode::kUnavailable, StatusCode::kDataLoss, StatusCode::kAborted,
                         StatusCode::kUnimplemented, StatusCode::kInternal}) {
      if (StatusCodeName(c) == code) return Status(c, py::str(e.value()));
    }
  }
  return Internal(fmt::format("worker {}: {} raised {}", index, what, DescribePythonError(e)));
}

// Calls method `name` of worker `index` with the GIL taken; `use` reads its result.
template <typename F>
Status CallWorker(const std::shared_ptr<PyRef>& worker, size_t index, const char* name, const char* what,
                  F&& call) {
  py::gil_scoped_acquire gil;
  try {
    return call(worker->object.attr(name));
  } catch (py::error_already_set& e) {
    return StatusOfPythonError(e, index, what);
  } catch (const py::cast_error& e) {
    return Internal(fmt::format("worker {}: {} returned the wrong type: {}", index, what, e.what()));
  }
}

py::bytes JsonBytes(const json& j) { return py::bytes(j.dump(-1, ' ', false, json::error_handler_t::replace)); }

// The calls of a worker object with methods init(info, peer), receive(info),
// fetch(body) -> JSON text, shutdown(), checksums(algorithm) -> {name: hex}; JSON goes
// to it as bytes.
HostedWorker WorkerOf(py::object object, size_t i) {
  auto w = std::make_shared<PyRef>(std::move(object));
  HostedWorker out;
  out.init = [w, i](const json& info, const std::string& peer) {
    return CallWorker(w, i, "init", "init", [&](py::object f) {
      f(JsonBytes(info), peer);
      return Status::Ok();
    });
  };
  out.receive = [w, i](const json& info) {
    return CallWorker(w, i, "receive", "load_weights", [&](py::object f) {
      f(JsonBytes(info));
      return Status::Ok();
    });
  };
  out.fetch = [w, i](const json& body) -> Result<json> {
    std::string text;
    WSYNC_RETURN_IF_ERROR(CallWorker(w, i, "fetch", "fetch_weights", [&](py::object f) {
      text = f(JsonBytes(body)).cast<std::string>();
      return Status::Ok();
    }));
    return ParseUntrustedJson(text, "a worker's fetch_weights reply");
  };
  out.shutdown = [w, i] {
    return CallWorker(w, i, "shutdown", "shutdown", [](py::object f) {
      f();
      return Status::Ok();
    });
  };
  out.checksums = [w, i](DigestAlgorithm algorithm) -> Result<std::map<std::string, std::string>> {
    std::map<std::string, std::string> sums;
    WSYNC_RETURN_IF_ERROR(CallWorker(w, i, "checksums", "checksums", [&](py::object f) {
      sums = f(std::string(DigestAlgorithmName(algorithm))).cast<std::map<std::string, std::string>>();
      return Status::Ok();
    }));
    return sums;
  };
  return out;
}

class PyHostedServer {
 public:
  PyHostedServer(const std::vector<py::object>& workers, const std::string& model, const std::string& backend,
                 const std::string& device, double timeout, std::optional<double> session_lease,
                 const std::string& host, int port, const std::string& api_key, uint64_t max_body_bytes,
                 double header_timeout, double body_timeout, int max_connections, uint64_t body_budget_bytes,
                 uint64_t discard_bytes) {
    HostedServiceOptions o;
    o.model = model;
    o.backend = backend;
    o.device = device;
    o.timeout_seconds = timeout;
    o.session_lease_seconds = session_lease;
    o.frontend_name = "wsync.worker_server";
    std::vector<HostedWorker> hosted;
    for (size_t i = 0; i < workers.size(); ++i) hosted.push_back(WorkerOf(workers[i], i));
    service_ = std::make_unique<HostedService>(std::move(o), std::move(hosted));
    HttpServerOptions h;
    h.host = host;
    h.port = port;
    h.api_key = api_key;
    h.max_body_bytes = max_body_bytes;
    h.header_timeout_seconds = header_timeout;
    h.body_timeout_seconds = body_timeout;
    h.max_connections = max_connections;
    h.body_budget_bytes = body_budget_bytes;
    h.discard_bytes = discard_bytes;
    h.worker_threads = 4;  // the generation lane: only /pause?mode=wait runs there
    Result<std::unique_ptr<HttpControlServer>> started = Internal("not run");
    {
      py::gil_scoped_release release;
      started = HttpControlServer::Start(h, service_.get());
    }
    http_ = ValueOrRaise(std::move(started));
  }

  ~PyHostedServer() {
    Stop();
    py::gil_scoped_release release;  // the workers' calls may still wait for the GIL
    service_.reset();
  }

  std::string url() const { return http_->url(); }
  std::string Health() const { return service_->Health().dump(); }

  void Stop() {
    py::gil_scoped_release release;
    http_->Stop();
  }

 private:
  std::unique_ptr<HostedService> service_;
  std::unique_ptr<HttpControlServer> http_;
};

}  // namespace

void BindHostedServer(py::module_& m) {
  py::class_<PyHostedServer>(m, "_HostedServer",
                             "wsync serve's HTTP routes over Python workers; use wsync.worker_server.WorkerServer.")
      .def(py::init<const std::vector<py::object>&, const std::string&, const std::string&, const std::string&, double,
                    std::optional<double>, const std::string&, int, const std::string&, uint64_t, double, double, int,
                    uint64_t, uint64_t>(),
           py::arg("workers"), py::arg("model"), py::arg("backend"), py::arg("device"), py::arg("timeout"),
           py::arg("session_lease"), py::arg("host"), py::arg("port"), py::arg("api_key"),
           py::arg("max_body_bytes"), py::arg("header_timeout"), py::arg("body_timeout"),
           py::arg("max_connections"), py::arg("body_budget_bytes"), py::arg("discard_bytes"))
      .def_property_readonly("url", &PyHostedServer::url)
      .def("health", &PyHostedServer::Health, "The /health body as JSON text.")
      .def("stop", &PyHostedServer::Stop, "Stops serving; idempotent.");
}

}  // namespace wsync::python
