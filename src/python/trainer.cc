// The trainer side of `_wsync`: TrainerEngine, SyncStats and model_metadata. The Pythonic
// layer (keyword arguments, docstrings, the context manager) is python/wsync/trainer.py.
#include <Python.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <pybind11/stl.h>

#include "engine/rank_outcomes.h"
#include "engine/verify.h"
#include "model/config.h"
#include "core/log.h"
#include "python/bindings.h"
#include "python/errors.h"
#include "python/source_adapter.h"
#include "wsync/dtype.h"
#include "wsync/trainer.h"

namespace py = pybind11;

namespace wsync::python {
namespace {

// How often the waiting caller wakes to let Python run its signal handlers (Ctrl-C).
constexpr auto kSignalPoll = std::chrono::milliseconds(100);

// Runs `work` on a thread of its own while the caller waits with the GIL released, waking
// every kSignalPoll to run Python's signal handlers. A handler's exception (Ctrl-C's
// KeyboardInterrupt) cancels `control`'s pass; the wait still lasts until `work` ends
// (the engine's deadlines bound it) and then the exception is raised. Needs the GIL.
template <typename T>
T RunWithSignals(PassControl& control, std::function<T()> work) {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::optional<T> result;
  std::optional<py::error_already_set> interrupt;
  {
    py::gil_scoped_release release;
    std::thread worker([&] {
      std::optional<T> r;
      try {
        r.emplace(work());
      } catch (const std::exception& e) {
        r.emplace(Internal(fmt::format("the engine threw {}", e.what())));
      }
      std::lock_guard lock(mu);
      result.emplace(std::move(*r));
      done = true;
      cv.notify_all();
    });
    std::unique_lock lock(mu);
    while (!cv.wait_for(lock, kSignalPoll, [&] { return done; })) {
      lock.unlock();
      {
        py::gil_scoped_acquire gil;
        if (PyErr_CheckSignals() != 0) {
          if (!interrupt) {
            interrupt.emplace();
            control.Cancel("the trainer was interrupted (KeyboardInterrupt)", /*interrupt=*/true);
          } else {
            PyErr_Clear();  // a second Ctrl-C while the first one winds the sync down
          }
        }
      }
      lock.lock();
    }
    lock.unlock();
    worker.join();
  }
  control.Close();
  if (interrupt) {
    interrupt->restore();
    throw py::error_already_set();
  }
  return std::move(*result);
}

// The error a failed sync raises: the engine's, but with the class of the source's own
// failure when the source failed first (a server's reply to the broken data plane may be
// what the engine reports, while the source is the cause).
Status RootCause(const Status& engine, const std::optional<Status>& source) {
  if (!source || source->code() == engine.code()) return engine;
  if (engine.message().rfind(source->message(), 0) == 0) return Status(source->code(), engine.message());
  return Status(source->code(),
                fmt::format("{} (the sync was aborted on every server: {})", source->message(), engine.message()));
}

py::tuple MetaTuple(const TensorMeta& m) {
  return py::make_tuple(m.name, std::string(TorchName(m.dtype)), py::tuple(py::cast(m.shape)));
}

py::dict StatsDict(const SyncStats& s) {
  py::dict d;
  d["seconds"] = s.seconds;
  d["start_seconds"] = s.start_seconds;
  d["transfer_seconds"] = s.transfer_seconds;
  d["finish_seconds"] = s.finish_seconds;
  d["bytes"] = s.bytes;
  d["tensors"] = s.tensors;
  d["chunks"] = s.chunks;
  d["verified"] = s.verified;
  d["verify_seconds"] = s.verify_seconds;
  d["inline_digests"] = s.inline_digests;
  d["inline_verified_servers"] = s.inline_verified_servers;
  d["inline_unverified_servers"] = s.inline_unverified_servers;
  d["inline_verified_tensors"] = s.inline_verified_tensors;
  return d;
}

std::string StatsRepr(const SyncStats& s) {
  return fmt::format(
      "SyncStats(seconds={:.4f}, start_seconds={:.4f}, transfer_seconds={:.4f}, finish_seconds={:.4f}, "
      "bytes={}, tensors={}, chunks={}, verified={})",
      s.seconds, s.start_seconds, s.transfer_seconds, s.finish_seconds, s.bytes, s.tensors, s.chunks,
      s.verified ? "True" : "False");
}

// One trainer rank's engine. Every call runs the engine on a thread of its own (see
// RunWithSignals); one call at a time.
class PyTrainerEngine {
 public:
  PyTrainerEngine(TrainerOptions options, int world_size, int group_port, py::object progress)
      : options_(std::move(options)), world_size_(world_size), progress_(std::move(progress)) {
    if (world_size_ < 1) RaiseStatus(InvalidArgument(fmt::format("world_size is {}; it must be >= 1", world_size_)));
    if (options_.rank < 0 || options_.rank >= world_size_) {
      RaiseStatus(InvalidArgument(fmt::format("rank {} is outside world_size {}", options_.rank, world_size_)));
    }
    if (!progress_.is_none()) {
      options_.progress = [this](const SyncProgress& p) { ReportProgress(p); };
    }
    Result<std::unique_ptr<TrainerEngine>> engine = CreateTrainerEngine(options_);
    if (!engine.ok()) RaiseStatus(engine.status());
    engine_ = std::move(engine).value();
    if (world_size_ > 1 && group_port >= 0) {  // -1: no trainer group
      RankOutcomesOptions g;
      g.rank = options_.rank;
      g.world_size = world_size_;
      g.store_host = options_.store_host;
      g.store_port = group_port;
      g.timeout_seconds = options_.timeout_seconds;
      Result<std::unique_ptr<RankOutcomes>> outcomes = [&] {
        py::gil_scoped_release release;
        return RankOutcomes::Create(g);
      }();
      if (!outcomes.ok()) RaiseStatus(outcomes.status().WithContext("starting the trainer group"));
      outcomes_ = std::move(outcomes).value();
    }
  }

  ~PyTrainerEngine() {
    // The engine's threads may still take the GIL to let go of a source's tensors.
    py::gil_scoped_release release;
    engine_.reset();
  }

  void Init(py::object source_or_metadata) {
    CheckOpen();
    py::object entries = source_or_metadata;
    if (py::hasattr(source_or_metadata, "metadata")) {
      try {
        entries = source_or_metadata.attr("metadata")();
      } catch (py::error_already_set& e) {
        RaiseStatus(InvalidArgument(fmt::format("the source's metadata() raised {}", DescribePythonError(e))),
                    e.value());
      }
    }
    std::vector<TensorMeta> metadata = ValueOrRaise(ParseMetadata(entries));
    auto control = std::make_shared<PassControl>();
    Status s = RunWithSignals<Status>(*control, [&] { return engine_->Init(metadata); });
    OkOrRaise(s);
    initialized_ = true;
  }

  // One sync. With world_size > 1 it is a round of the trainer group (RunRound).
  SyncStats SendWeights(py::object source, std::optional<std::string> weight_version, bool verify) {
    CheckOpen();
    ++syncs_;
    SyncStats stats;
    RunRound(fmt::format("{}/send", syncs_), source, [&](PySource& adapter) -> Status {
      if (!initialized_) {
        WSYNC_RETURN_IF_ERROR(engine_->Init(adapter.metadata()));
        initialized_ = true;
      }
      Result<SyncStats> r = engine_->SendWeights(adapter, weight_version);
      if (r.ok()) stats = *r;
      return r.status();
    });
    if (verify) Verify(source, &stats);
    return stats;
  }

  // Read-back verification of the sync just made: rank 0 compares every server's digests
  // with its own of a second pass over `source`; every other rank makes that pass too
  // (its iterator may be a collective) and discards it.
  void Verify(py::object source, SyncStats* stats) {
    const auto t0 = std::chrono::steady_clock::now();
    RunRound(fmt::format("{}/verify", syncs_), source, [&](PySource& adapter) -> Status {
      if (options_.rank == 0) return VerifyServers(options_, adapter, DigestAlgorithm::kXxh3_128);
      return adapter.DrainRest(Deadline::InSeconds(options_.timeout_seconds));
    });
    stats->verified = options_.rank == 0;
    stats->verify_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  void Shutdown() {
    if (!engine_) return;
    py::gil_scoped_release release;
    engine_->Shutdown();
    engine_.reset();
    outcomes_.reset();
  }

  bool closed() const { return engine_ == nullptr; }
  int group_port() const { return outcomes_ ? outcomes_->port() : 0; }

 private:
  void CheckOpen() const {
    if (!engine_) RaiseStatus(FailedPrecondition("this TrainerEngine was shut down"));
  }

  // Runs `work` over one pass of `source` and raises its failure. With world_size > 1 the
  // pass is a round of the trainer group: a rank that fails posts its cause at once, then
  // keeps pulling its source to the end (discarding, bounded by the timeout) so that other
  // ranks whose iterators are collectives can finish theirs; every rank then exchanges
  // its outcome, and one rank's failure raises on every rank (RankOutcomes::End).
  void RunRound(const std::string& round, py::object source, const std::function<Status(PySource&)>& work) {
    auto control = std::make_shared<PassControl>();
    if (outcomes_) outcomes_->Begin(round);
    Status s;
    std::optional<py::error_already_set> interrupt;
    Result<std::unique_ptr<PySource>> created = PySource::Create(source, control, options_.device);
    if (!created.ok()) {
      s = created.status();
    } else {
      std::unique_ptr<PySource> adapter = std::move(created).value();
      {
        std::lock_guard lock(progress_mu_);
        current_ = control;
      }
      try {
        s = RunWithSignals<Status>(*control, [&]() -> Status {
          Status r = work(*adapter);
          if (!r.ok() && outcomes_) {
            const Status cause = RootCause(r, control->source_status());
            outcomes_->Fail(round, cause);
            Status drained = adapter->DrainRest(Deadline::InSeconds(options_.timeout_seconds));
            if (!drained.ok()) WSYNC_LOG_WARN("trainer rank {}: after the failed sync, {}", options_.rank, drained.ToString());
          }
          return r;
        });
      } catch (py::error_already_set& e) {
        interrupt.emplace(std::move(e));
        s = Aborted("the trainer was interrupted (KeyboardInterrupt)");
      }
      {
        std::lock_guard lock(progress_mu_);
        current_.reset();
      }
      {
        // A data plane's thread may still hold the pass; it lets go of Python objects with the GIL.
        py::gil_scoped_release release;
        adapter.reset();
      }
      if (!s.ok()) {
        s = RootCause(s, control->source_status());
      } else if (control->cancelled()) {
        // The progress callback raised after the last tensor had been read: the sync landed.
        s = Aborted(fmt::format("{} (after the sync had completed)", control->cancel_reason()));
      }
    }
    if (outcomes_) {
      Status all;
      {
        py::gil_scoped_release release;
        all = outcomes_->End(round, s);
      }
      if (interrupt) {
        interrupt->restore();
        throw py::error_already_set();
      }
      if (!all.ok() && (s.ok() || all.message() != s.message())) RaiseStatus(all, control->TakeError());
    }
    if (interrupt) {
      interrupt->restore();
      throw py::error_already_set();
    }
    if (!s.ok()) RaiseStatus(s, control->TakeError());
  }

  // From the engine's sending thread: calls the user's callback with the GIL; an exception
  // it raises is kept as the sync's error and cancels the pass.
  void ReportProgress(const SyncProgress& p) {
    std::shared_ptr<PassControl> control;
    {
      std::lock_guard lock(progress_mu_);
      control = current_;
    }
    if (!control || control->closed()) return;
    py::gil_scoped_acquire gil;
    try {
      py::dict d;
      d["bytes_done"] = p.bytes_done;
      d["bytes_total"] = p.bytes_total;
      d["chunks_done"] = p.chunks_done;
      d["chunks_total"] = p.chunks_total;
      progress_(d);
    } catch (py::error_already_set& e) {
      control->RecordError(e);
      control->Cancel(fmt::format("the progress callback raised {}", DescribePythonError(e)));
    }
  }

  TrainerOptions options_;
  int world_size_ = 1;
  py::object progress_;
  std::unique_ptr<TrainerEngine> engine_;
  bool initialized_ = false;
  std::mutex progress_mu_;
  std::shared_ptr<PassControl> current_;  // GUARDED_BY(progress_mu_): the sync running now
  std::unique_ptr<RankOutcomes> outcomes_;  // world_size > 1: the trainer group's outcome board
  int syncs_ = 0;                           // send_weights calls, which name the group's rounds
};

std::unique_ptr<PyTrainerEngine> MakeEngine(std::string backend, std::vector<std::string> servers,
                                            int data_parallel_size, double bucket_gb, double timeout,
                                            std::optional<std::string> api_key, std::string device, int rank,
                                            int world_size, bool packed, int num_buffers, std::string store_host,
                                            int group_port, py::object progress, bool inline_verify,
                                            std::map<std::string, std::string> backend_options) {
  TrainerOptions o;
  o.backend = std::move(backend);
  o.servers = std::move(servers);
  o.data_parallel_size = data_parallel_size;
  o.bucket_gb = bucket_gb;
  o.timeout_seconds = timeout;
  o.api_key = api_key.value_or("");
  o.device = ValueOrRaise(Device::Parse(device));
  o.rank = rank;
  o.packed = packed;
  o.num_buffers = num_buffers;
  o.store_host = std::move(store_host);
  o.inline_verify = inline_verify;
  o.backend_options = std::move(backend_options);
  return std::make_unique<PyTrainerEngine>(std::move(o), world_size, group_port, std::move(progress));
}

py::list ModelMetadata(const std::string& name_or_dir) {
  ModelConfig config = ValueOrRaise(LookupModel(name_or_dir));
  py::list out;
  for (const TensorMeta& m : HfTensors(config)) out.append(MetaTuple(m));
  return out;
}

}  // namespace

void BindTrainer(py::module_& m) {
  py::class_<SyncStats>(m, "SyncStats",
                        "Timings and sizes of one sync (TrainerEngine.send_weights).\n\n"
                        "seconds: start_weight_update until finish_weight_update answered; start_seconds, "
                        "transfer_seconds (update_weights + data plane), finish_seconds: its phases; bytes, "
                        "tensors, chunks: what moved (0 on ranks other than 0).")
      .def_readonly("seconds", &SyncStats::seconds, "Whole sync, in seconds.")
      .def_readonly("start_seconds", &SyncStats::start_seconds, "POST /start_weight_update, in seconds.")
      .def_readonly("transfer_seconds", &SyncStats::transfer_seconds, "update_weights + data plane, in seconds.")
      .def_readonly("finish_seconds", &SyncStats::finish_seconds, "POST /finish_weight_update, in seconds.")
      .def_readonly("bytes", &SyncStats::bytes, "Model bytes sent.")
      .def_readonly("tensors", &SyncStats::tensors, "Tensors sent.")
      .def_readonly("chunks", &SyncStats::chunks, "Packed chunks (or payload files) sent.")
      .def_readonly("verified", &SyncStats::verified,
                    "Every server's read-back digests matched the source's (send_weights(verify=True) on rank 0).")
      .def_readonly("verify_seconds", &SyncStats::verify_seconds, "The read-back verification, in seconds.")
      .def_readonly("inline_digests", &SyncStats::inline_digests,
                    "Tensors this rank hashed in the sync's pass and sent with finish (in-line verification).")
      .def_readonly("inline_verified_servers", &SyncStats::inline_verified_servers,
                    "Servers that checked the digests against what their shards hold, and matched.")
      .def_readonly("inline_unverified_servers", &SyncStats::inline_unverified_servers,
                    "Servers that do not declare in-line verification (a vLLM server): not checked in-line.")
      .def_readonly("inline_verified_tensors", &SyncStats::inline_verified_tensors,
                    "Tensors the first verified server matched.")
      .def("as_dict", &StatsDict, "The fields as a dict.")
      .def("__repr__", &StatsRepr);

  py::class_<PyTrainerEngine>(m, "_TrainerEngine", "The native engine behind wsync.TrainerEngine.")
      .def(py::init(&MakeEngine), py::arg("backend"), py::arg("servers"), py::arg("data_parallel_size"),
           py::arg("bucket_gb"), py::arg("timeout"), py::arg("api_key"), py::arg("device"), py::arg("rank"),
           py::arg("world_size"), py::arg("packed"), py::arg("num_buffers"), py::arg("store_host"),
           py::arg("group_port"), py::arg("progress"), py::arg("inline_verify"), py::arg("backend_options"))
      .def("init", &PyTrainerEngine::Init, py::arg("source_or_metadata"))
      .def("send_weights", &PyTrainerEngine::SendWeights, py::arg("source"), py::arg("weight_version") = py::none(),
           py::arg("verify") = false)
      .def("shutdown", &PyTrainerEngine::Shutdown)
      .def_property_readonly("closed", &PyTrainerEngine::closed)
      .def_property_readonly("group_port", &PyTrainerEngine::group_port);

  m.def("model_metadata", &ModelMetadata, py::arg("name_or_config_dir"),
        "The Hugging Face tensors of a registered model ('qwen3-tiny', 'qwen3-0.6b', ...) or of a\n"
        "directory holding a config.json, as [(name, dtype_name, shape), ...] in checkpoint order.");
  m.def("registered_models", &RegisteredModelNames, "Names model_metadata() knows without a config.json.");
}

}  // namespace wsync::python
