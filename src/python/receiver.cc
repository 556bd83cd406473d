// _wsync._ReceiverEngine: the native half of wsync.ReceiverEngine (python/wsync/receiver.py
// holds the Pythonic layer: keyword options, dicts, the context manager, docstrings).
//
// Payloads cross as JSON text (the Python layer dumps the dicts); tensors cross as torch
// tensors made by torch.utils.dlpack.from_dlpack over wsync's receive buffers (Lend).
// Every call releases the GIL while the engine works; load_weights runs on the engine's
// worker thread with the GIL taken for the call.
#include <atomic>
#include <optional>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "python/bindings.h"
#include "python/dlpack.h"
#include "python/errors.h"
#include "control/http_routes.h"
#include "control/route_table.h"
#include "core/digest.h"
#include "core/json_limits.h"
#include "core/parallel.h"
#include "engine/device_digests.h"
#include "model/config.h"
#include "model/sharding.h"
#include "receiver/backend.h"
#include "wsync/dtype.h"
#include "wsync/receiver.h"

namespace py = pybind11;

namespace wsync::python {
namespace {

using nlohmann::json;

// Payloads come from a Python front, which may pass on what a request carried: parsed
// depth-bounded (core/json_limits.h).
json ParseJson(const std::string& text, const char* what) {
  json j = ValueOrRaise(ParseUntrustedJson(text, what));
  if (!j.is_object()) RaiseStatus(InvalidArgument(fmt::format("{} must be a JSON object", what)));
  return j;
}

// One (name, dtype name, shape) entry of a metadata list.
using MetaEntry = std::tuple<std::string, std::string, std::vector<int64_t>>;

class PyReceiverEngine {
 public:
  PyReceiverEngine(const std::string& backend, int worker_rank, const std::string& device, double timeout,
                   const std::string& settings, const std::vector<MetaEntry>& metadata,
                   std::optional<uint64_t> max_update_bytes, const std::string& label, const std::string& model,
                   int tp_size, bool mtp_drafter) {
    ReceiverEngineOptions o;
    o.model = model;
    o.tp_size = tp_size;
    o.mtp_drafter = mtp_drafter;
    o.backend = backend;
    o.worker_rank = worker_rank;
    o.device = ValueOrRaise(Device::Parse(device));
    o.timeout_seconds = timeout;
    o.backend_config = ParseJson(settings, "backend settings");
    for (const auto& [name, dtype, shape] : metadata) {
      Result<DType> d = DTypeFromTorchName(dtype);
      if (!d.ok()) RaiseStatus(InvalidArgument(fmt::format("metadata of {}: {}", name, d.status().message())));
      o.metadata.push_back(TensorMeta{name, *d, Shape(shape.begin(), shape.end())});
    }
    if (max_update_bytes) o.max_update_bytes = *max_update_bytes;
    if (!label.empty()) o.label = label;
    Result<std::unique_ptr<ReceiverEngine>> made = Internal("not run");
    {
      py::gil_scoped_release release;
      made = ReceiverEngine::Create(o);
    }
    engine_ = ValueOrRaise(std::move(made));
  }

  void Init(const std::string& init_info, const std::string& peer_address) {
    json info = ParseJson(init_info, "init_info");
    WithoutGil([&] { return engine_->Init(info, peer_address); });
  }

  // Calls load_weights([(name, tensor), ...]) per chunk, and load_slices([(param, piece,
  // tensor), ...]) per chunk of slices (sharded; None: whole tensors only). An exception
  // either raises fails the receive (the trainer is told its text) and is raised here as it was.
  void Receive(const std::string& update_info, py::object load_weights, py::object load_slices) {
    ReceiveWith(update_info, std::move(load_weights), std::move(load_slices), /*in_session=*/false);
  }

  // The session routes (ReceiverEngine::StartWeightUpdate ...): the engine keeps the
  // session rules, a front only hands it each route's payload.
  void StartWeightUpdate() {
    WithoutGil([&] { return engine_->StartWeightUpdate(); });
  }
  void UpdateWeights(const std::string& update_info, py::object load_weights, py::object load_slices) {
    ReceiveWith(update_info, std::move(load_weights), std::move(load_slices), /*in_session=*/true);
  }
  void FinishWeightUpdate() {
    WithoutGil([&] { return engine_->FinishWeightUpdate(); });
  }
  py::dict Session() const {
    ReceiverEngineSession look = engine_->Session();
    py::dict d;
    d["active"] = look.active;
    d["weights_consistent"] = look.weights_consistent;
    d["inconsistent"] = look.inconsistent;
    d["busy_with"] = look.busy_with;
    d["expired_sessions"] = look.expired_sessions;
    d["taken_over_sessions"] = look.taken_over_sessions;
    return d;
  }

 private:
  // Runs an engine call without the GIL and raises its failure.
  template <typename Call>
  static void WithoutGil(const Call& call) {
    Status s;
    {
      py::gil_scoped_release release;
      s = call();
    }
    OkOrRaise(s);
  }

  void ReceiveWith(const std::string& update_info, py::object load_weights, py::object load_slices, bool in_session) {
    json info = ParseJson(update_info, "update_info");
    py::object from_dlpack = py::module_::import("torch.utils.dlpack").attr("from_dlpack");
    py::object torch = py::module_::import("torch");
    const Device device = engine_->options().device;
    std::optional<py::error_already_set> raised;  // touched with the GIL held
    // A torch tensor viewing `bytes` (the dtypes DLPack lacks are viewed as torch's own).
    auto lend = [&](std::string_view name, DType dtype, std::span<const int64_t> shape,
                    std::span<const std::byte> bytes, const Device& where) -> Result<py::object> {
      // DLPack carries no read-only flag: the views are writable, and the caller's
      // contract is to read them during the call.
      std::span<std::byte> writable(const_cast<std::byte*>(bytes.data()), bytes.size());
      py::object tensor = from_dlpack(Lend(writable, dtype, shape, where));
      if (dtype == DType::kBool || dtype == DType::kF8E4M3 || dtype == DType::kF8E5M2) {
        std::string tname = dtype == DType::kBool ? "bool" : std::string(TorchName(dtype));
        if (!py::hasattr(torch, tname.c_str())) {
          return InvalidArgument(fmt::format("tensor {} is {}, which this torch lacks", name, tname));
        }
        tensor = tensor.attr("view")(torch.attr(tname.c_str()));
      }
      return tensor;
    };
    // Calls `fn(items)`; the buffers are reused once it returns, so whatever it queued on
    // the GPU (an async copy_) must have read them by then.
    auto call = [&](const py::object& fn, const py::list& items, const char* what) -> Status {
      try {
        fn(items);
        if (!device.is_cpu()) torch.attr("cuda").attr("synchronize")(device.index);
        return Status::Ok();
      } catch (py::error_already_set& e) {
        std::string text = DescribePythonError(e);
        if (!raised) raised.emplace(std::move(e));
        return Internal(fmt::format("{} raised {}", what, text));
      }
    };
    ChunkCallback on_chunk = [&](std::span<const TensorRef> chunk) -> Status {
      py::gil_scoped_acquire gil;
      py::list items;
      for (const TensorRef& t : chunk) {
        WSYNC_ASSIGN_OR_RETURN(py::object tensor, lend(t.name, t.dtype, t.shape, t.bytes, t.device));
        items.append(py::make_tuple(py::str(t.name.data(), t.name.size()), tensor));
      }
      return call(load_weights, items, "load_weights");
    };
    SliceCallback on_slices;
    if (!load_slices.is_none()) {
      on_slices = [&](std::span<const SliceRef> slices) -> Status {
        py::gil_scoped_acquire gil;
        py::list items;
        for (const SliceRef& sl : slices) {
          WSYNC_ASSIGN_OR_RETURN(py::object tensor, lend(sl.hf_name, sl.dtype, sl.shape, sl.bytes, sl.device));
          items.append(py::make_tuple(sl.param, sl.piece, tensor));
        }
        return call(load_slices, items, "load_slices");
      };
    }
    Status s;
    {
      py::gil_scoped_release release;
      s = in_session ? engine_->UpdateWeights(info, on_chunk, on_slices) : engine_->Receive(info, on_chunk, on_slices);
    }
    if (raised) {
      py::error_already_set e = std::move(*raised);
      raised.reset();
      throw e;
    }
    OkOrRaise(s);
  }

 public:
  std::string Fetch(const std::string& body) {
    json b = ParseJson(body, "the fetch_weights body");
    Result<json> r = Internal("not run");
    {
      py::gil_scoped_release release;
      r = engine_->Fetch(b);
    }
    return ValueOrRaise(std::move(r)).dump();
  }

  void Shutdown() {
    py::gil_scoped_release release;
    engine_->Shutdown();
  }

  // {hf_name: [(begin, end), ...]}: ReceiverEngine::RowDigestRanges.
  std::map<std::string, std::vector<std::pair<int64_t, int64_t>>> RowDigestRanges() const {
    return engine_->RowDigestRanges();
  }

  std::string backend() const { return engine_->options().backend; }
  int worker_rank() const { return engine_->options().worker_rank; }
  std::string device() const { return engine_->options().device.ToString(); }

 private:
  std::unique_ptr<ReceiverEngine> engine_;
};

// A contiguous buffer's bytes; TypeError-style InvalidArgument naming `what` otherwise.
std::span<std::byte> ContiguousBytes(const py::buffer_info& info, std::string_view what) {
  py::ssize_t stride = info.itemsize;
  for (py::ssize_t d = info.ndim - 1; d >= 0; --d) {
    if (info.shape[d] > 1 && info.strides[d] != stride) {
      RaiseStatus(InvalidArgument(fmt::format("{} takes a contiguous buffer", what)));
    }
    stride *= info.shape[d];
  }
  return {static_cast<std::byte*>(info.ptr), static_cast<size_t>(info.size * info.itemsize)};
}

// The hex digest of a buffer's bytes ("sha256" or "xxh3_128"), as /weight_checker gives it.
std::string BufferDigest(const std::string& algorithm, py::buffer data) {
  DigestAlgorithm alg = ValueOrRaise(ParseDigestAlgorithm(algorithm));
  py::buffer_info info = data.request();
  std::span<const std::byte> bytes = ContiguousBytes(info, "_hex_digest");
  py::gil_scoped_release release;
  return HexDigest(alg, bytes);
}

// Copies `src` into `dst` (contiguous buffers of the same byte size) and returns the hex
// digest of the bytes written, in one pass over them (core/digest.h CopyAndHash).
std::string BufferCopyDigest(const std::string& algorithm, py::buffer src, py::buffer dst) {
  DigestAlgorithm alg = ValueOrRaise(ParseDigestAlgorithm(algorithm));
  py::buffer_info from = src.request();
  py::buffer_info to = dst.request(/*writable=*/true);
  std::span<const std::byte> in = ContiguousBytes(from, "_copy_hex_digest");
  std::span<std::byte> out = ContiguousBytes(to, "_copy_hex_digest");
  if (in.size() != out.size()) {
    RaiseStatus(InvalidArgument(fmt::format("_copy_hex_digest: {} bytes into a buffer of {}", in.size(), out.size())));
  }
  if (!in.empty() && in.data() < out.data() + out.size() && out.data() < in.data() + in.size()) {
    RaiseStatus(InvalidArgument("_copy_hex_digest: src and dst overlap"));
  }
  py::gil_scoped_release release;
  auto hasher = Hasher::Create(alg);
  CopyAndHash(out.data(), in, *hasher, /*hash_destination=*/true);
  return hasher->FinishHex();
}

// The row ranges [(begin, end), ...] of dim 0 by which a trainer digesting on its device
// digests a tensor of `bytes` bytes and `rows` rows (engine/device_digests.h); [] for one
// digest of the whole tensor.
std::vector<std::pair<int64_t, int64_t>> DeviceDigestRows(int64_t rows, int64_t bytes) {
  if (rows < 0 || bytes < 0 || (rows > 0 && bytes % rows != 0)) {
    RaiseStatus(InvalidArgument(fmt::format("device_digest_rows: {} bytes are not {} whole rows", bytes, rows)));
  }
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const DeviceDigestPiece& p : DeviceDigestPieces(static_cast<size_t>(bytes), rows)) {
    if (!p.whole) out.emplace_back(p.row_begin, p.row_end);
  }
  return out;
}

// BufferCopyDigest over pairs: copies srcs[i] into dsts[i] and returns the hex digest of
// each copy, on up to `threads` threads (0: DefaultThreads()), the GIL released once.
py::list BufferCopyDigests(const std::string& algorithm, const std::vector<py::buffer>& srcs,
                           const std::vector<py::buffer>& dsts, size_t threads) {
  DigestAlgorithm alg = ValueOrRaise(ParseDigestAlgorithm(algorithm));
  if (srcs.size() != dsts.size()) {
    RaiseStatus(InvalidArgument(fmt::format("_copy_hex_digests: {} sources for {} destinations", srcs.size(),
                                            dsts.size())));
  }
  std::vector<py::buffer_info> infos;  // keeps every buffer exported while the copies run
  infos.reserve(2 * srcs.size());
  std::vector<std::pair<std::span<const std::byte>, std::span<std::byte>>> pairs;
  for (size_t i = 0; i < srcs.size(); ++i) {
    infos.push_back(srcs[i].request());
    std::span<const std::byte> in = ContiguousBytes(infos.back(), "_copy_hex_digests");
    infos.push_back(dsts[i].request(/*writable=*/true));
    std::span<std::byte> out = ContiguousBytes(infos.back(), "_copy_hex_digests");
    if (in.size() != out.size()) {
      RaiseStatus(InvalidArgument(
          fmt::format("_copy_hex_digests: pair {}: {} bytes into a buffer of {}", i, in.size(), out.size())));
    }
    if (!in.empty() && in.data() < out.data() + out.size() && out.data() < in.data() + in.size()) {
      RaiseStatus(InvalidArgument(fmt::format("_copy_hex_digests: pair {}: src and dst overlap", i)));
    }
    pairs.emplace_back(in, out);
  }
  std::vector<std::string> hex(pairs.size());
  {
    py::gil_scoped_release release;
    std::atomic<size_t> next{0};
    const size_t n = threads == 0 ? DefaultThreads() : threads;
    ParallelFor(n, n, [&](size_t, size_t) {
      for (size_t i; (i = next.fetch_add(1)) < pairs.size();) {
        auto hasher = Hasher::Create(alg);
        CopyAndHash(pairs[i].second.data(), pairs[i].first, *hasher, /*hash_destination=*/true);
        hex[i] = hasher->FinishHex();
      }
    });
  }
  py::list out;
  for (std::string& h : hex) out.append(py::str(h));
  return out;
}

// The sharding table of worker `tp_rank` of `tp_size` of `model` (a registered name or a
// config.json directory), as ReceiverEngine plans a sharded worker's slices: one dict per
// parameter, in the table's order (the `param` of a SliceRef indexes it).
py::list ShardingTableOf(const std::string& model, int tp_rank, int tp_size, bool mtp_drafter) {
  ModelConfig config = ValueOrRaise(LookupModel(model));
  ShardingTable table =
      ValueOrRaise(ShardingTable::Build(config, tp_rank, tp_size, {}, mtp_drafter ? Drafter::kMtp : Drafter::kNone));
  py::list out;
  for (size_t p = 0; p < table.params().size(); ++p) {
    const WorkerParam& param = table.params()[p];
    py::list pieces;
    for (size_t k = 0; k < param.pieces.size(); ++k) {
      const ShardPiece& sp = param.pieces[k];
      const PieceRuns r = table.Runs(static_cast<int>(p), static_cast<int>(k));
      py::dict d;
      d["hf_name"] = sp.hf_name;
      d["dim"] = sp.dim;
      d["hf_start"] = sp.hf_start;
      d["length"] = sp.length;
      d["dst_index"] = sp.dst_index;
      d["dst_start"] = sp.dst_start;
      d["primary"] = sp.primary;
      d["hf_shape"] = table.hf_tensors()[table.PieceHf(static_cast<int>(p), static_cast<int>(k))].shape;
      d["numel"] = r.count * r.run_bytes / static_cast<int64_t>(ItemSize(param.meta.dtype));
      pieces.append(d);
    }
    py::dict d;
    d["name"] = param.meta.name;
    d["dtype"] = std::string(TorchName(param.meta.dtype));
    d["shape"] = param.meta.shape;
    d["pieces"] = pieces;
    d["drafter"] = table.IsDrafterParam(static_cast<int>(p));
    out.append(d);
  }
  return out;
}

StatusCode StatusCodeNamed(const std::string& name) {
  for (int c = 0; c <= static_cast<int>(StatusCode::kInternal); ++c) {
    if (StatusCodeName(static_cast<StatusCode>(c)) == name) return static_cast<StatusCode>(c);
  }
  RaiseStatus(InvalidArgument(fmt::format("unknown status code '{}'", name)));
  return StatusCode::kInternal;
}

int HttpStatusForName(const std::string& code) { return HttpStatusFor(StatusCodeNamed(code)); }

std::pair<int, std::string> HttpErrorReply(const std::string& code, const std::string& message) {
  HttpResponse r = HttpRouter::Error(Status(StatusCodeNamed(code), message));
  return {r.status, std::move(r.body)};
}

py::list HttpRoutes() {
  py::list out;
  for (const RouteEntry& r : RouteTable()) {
    py::dict d;
    d["method"] = std::string(r.method);
    d["path"] = std::string(r.path);
    d["lane"] = std::string(r.lane);
    py::list fields;
    for (std::string_view f : r.fields) fields.append(std::string(f));
    d["fields"] = fields;
    d["all_fields"] = r.all_fields;
    out.append(d);
  }
  return out;
}

std::string HttpParseBody(const std::string& path, const std::string& body) {
  return ValueOrRaise(HttpRouter::ParseBody(path, body)).dump();
}

}  // namespace

void BindReceiver(py::module_& m) {
  py::class_<PyReceiverEngine>(m, "_ReceiverEngine",
                               "Native receiver of one inference worker; use wsync.ReceiverEngine.")
      .def(py::init<const std::string&, int, const std::string&, double, const std::string&,
                    const std::vector<MetaEntry>&, std::optional<uint64_t>, const std::string&, const std::string&,
                    int, bool>(),
           py::arg("backend"), py::arg("worker_rank"), py::arg("device"), py::arg("timeout"), py::arg("settings"),
           py::arg("metadata"), py::arg("max_update_bytes"), py::arg("label"), py::arg("model") = "",
           py::arg("tp_size") = 1, py::arg("mtp_drafter") = false)
      .def("init", &PyReceiverEngine::Init, py::arg("init_info"), py::arg("peer_address"))
      .def("receive", &PyReceiverEngine::Receive, py::arg("update_info"), py::arg("load_weights"),
           py::arg("load_slices") = py::none())
      .def("start_weight_update", &PyReceiverEngine::StartWeightUpdate)
      .def("update_weights", &PyReceiverEngine::UpdateWeights, py::arg("update_info"), py::arg("load_weights"),
           py::arg("load_slices") = py::none())
      .def("finish_weight_update", &PyReceiverEngine::FinishWeightUpdate)
      .def("session", &PyReceiverEngine::Session)
      .def("fetch", &PyReceiverEngine::Fetch, py::arg("body"))
      .def("shutdown", &PyReceiverEngine::Shutdown)
      .def("row_digest_ranges", &PyReceiverEngine::RowDigestRanges,
           "{hf_name: [(begin, end), ...]}: the row ranges the trainer digests tensors no rank holds whole by "
           "(sharded, from the last init); empty for other backends.")
      .def_property_readonly("backend", &PyReceiverEngine::backend)
      .def_property_readonly("worker_rank", &PyReceiverEngine::worker_rank)
      .def_property_readonly("device", &PyReceiverEngine::device);
  m.def("_hex_digest", &BufferDigest, py::arg("algorithm"), py::arg("data"),
        "Hex digest ('sha256' or 'xxh3_128') of a contiguous buffer's bytes.");
  m.def("_copy_hex_digest", &BufferCopyDigest, py::arg("algorithm"), py::arg("src"), py::arg("dst"),
        "Copies contiguous buffer src into dst (the same byte size) and returns the hex digest of the bytes "
        "written, in one pass.");
  m.def("_copy_hex_digests", &BufferCopyDigests, py::arg("algorithm"), py::arg("srcs"), py::arg("dsts"),
        py::arg("threads") = 0,
        "_copy_hex_digest over lists of buffers: copies srcs[i] into dsts[i] and returns each copy's hex digest, "
        "on up to `threads` threads (0: as many as this process may use).");
  m.def("device_digest_rows", &DeviceDigestRows, py::arg("rows"), py::arg("bytes"),
        "[(begin, end), ...]: the row ranges of dim 0 by which a trainer that digests on its device (init_info "
        "wsync_device_digests) digests a tensor of `rows` rows and `bytes` bytes; [] when it digests it whole.");
  m.def("http_status_for", &HttpStatusForName, py::arg("code"),
        "The HTTP status of a Status code name ('FAILED_PRECONDITION' -> 409), as every wsync HTTP front answers it.");
  m.def("http_error", &HttpErrorReply, py::arg("code"), py::arg("message"),
        "(HTTP status, JSON body text) of the error reply for a Status code name and message.");
  m.def("http_routes", &HttpRoutes,
        "The routes every wsync HTTP front answers: [{'method', 'path', 'lane', 'fields', 'all_fields'}, ...].");
  m.def("http_parse_body", &HttpParseBody, py::arg("path"), py::arg("body"),
        "A POST body as the route at `path` reads it (JSON text of the fields it reads); raises InvalidArgument "
        "naming 'body of PATH' for a body the router refuses.");
  m.def("http_target_refusal", &HttpRouter::TargetRefusal, py::arg("target"),
        "Why a request target (path and query, still percent-encoded) is refused with a 400, or ''.");
  m.def("sharding_table", &ShardingTableOf, py::arg("model"), py::arg("tp_rank"), py::arg("tp_size"),
        py::arg("mtp_drafter") = false,
        "The parameters of worker tp_rank of tp_size of `model` (a registered name or config.json directory) as "
        "the sharded backend lands them: [{'name', 'dtype', 'shape', 'drafter', 'pieces': [{'hf_name', 'dim', "
        "'hf_start', 'length', 'dst_index', 'dst_start', 'primary', 'hf_shape', 'numel'}, ...]}, ...].");
  m.def("receiver_backends", &ReceiverBackendNames,
        "Names of the receiver backends this build has, e.g. ['delta', 'ipc', 'nccl'].");
}

}  // namespace wsync::python
