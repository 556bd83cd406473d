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

#include <cstring>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <pybind11/stl.h>

#include "backends/descriptor.h"
#include "engine/rank_outcomes.h"
#include "comm/store.h"
#include "python/dlpack.h"
#include "sources/groups.h"
#include "sources/layout.h"
#include "sources/sources.h"
#include "sources/trainer_ranks.h"
#include "engine/verify.h"
#include "model/config.h"
#include "model/dropped_names.h"
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

// A source that lives in C++ (a Megatron-style rank's parameters laid out by the engine's
// own table, src/sources/layout.h), built on a TrainerEngine's trainer group. Its passes
// are collectives on that group; a group rebuilt after a failed sync needs a new one
// (`generation` says which group it was built on).
class PyNativeSource {
 public:
  PyNativeSource(std::unique_ptr<MegatronSource> source, int generation)
      : source_(std::move(source)), generation_(generation) {
    for (size_t i = 0; i < source_->params().size(); ++i) index_.emplace(source_->params()[i].meta.name, i);
  }
  WeightSource& source() { return *source_; }
  int generation() const { return generation_; }

  // The rank's parameters as (megatron_name, dtype_name, shape), in the table's order.
  py::list params() const {
    py::list out;
    for (const HostTensor& t : source_->params()) {
      out.append(py::make_tuple(t.meta.name, std::string(TorchName(t.meta.dtype)), py::tuple(py::cast(t.meta.shape))));
    }
    return out;
  }
  py::object held_names() const {
    auto held = source_->HeldNames();
    if (!held) return py::none();
    return py::cast(*held);
  }
  // Copies `tensor` (a CPU tensor of the parameter's dtype and shape) into parameter `name`.
  void Load(const std::string& name, py::handle tensor) {
    auto it = index_.find(name);
    if (it == index_.end()) {
      RaiseStatus(InvalidArgument(fmt::format("{} is not a parameter of this rank's layout ({}); "
                                              "params() lists them", name, Describe())));
    }
    HostTensor& param = source_->params()[it->second];
    BorrowedTensor b = ValueOrRaise(Borrow(tensor, name, param.meta.dtype));
    if (!b.device.is_cpu()) {
      RaiseStatus(InvalidArgument(fmt::format("parameter {} is on {}; give a CPU tensor", name, b.device.ToString())));
    }
    if (b.meta.dtype != param.meta.dtype || b.meta.shape != param.meta.shape) {
      RaiseStatus(InvalidArgument(fmt::format("parameter {} of {}: the layout holds {} {}, the tensor given is {} {}",
                                              name, Describe(), TorchName(param.meta.dtype),
                                              fmt::join(param.meta.shape, "x"), TorchName(b.meta.dtype),
                                              fmt::join(b.meta.shape, "x"))));
    }
    std::memcpy(param.storage.data(), b.data, b.nbytes);
  }
  // Lays the full HF tensors `pairs` ([(name, tensor)], every tensor of the model, CPU)
  // out into this rank's parameters (LayOutMegatronInto): a checkpoint's conversion.
  void LoadHf(py::iterable pairs) {
    std::vector<HostTensor> hf;
    for (py::handle item : pairs) {
      auto pair = py::reinterpret_borrow<py::sequence>(item);
      const std::string name = pair[0].cast<std::string>();
      BorrowedTensor b = ValueOrRaise(Borrow(pair[1], name));
      if (!b.device.is_cpu()) {
        RaiseStatus(InvalidArgument(fmt::format("{} is on {}; give a CPU tensor", name, b.device.ToString())));
      }
      TensorMeta meta = b.meta;
      meta.name = name;
      HostTensor t = ValueOrRaise(HostTensor::Zeros(meta));
      std::memcpy(t.storage.data(), b.data, b.nbytes);
      hf.push_back(std::move(t));
    }
    OkOrRaise(LayOutMegatronInto(source_->layout(), source_->rank(), hf, source_->params()));
  }
  size_t peak_buffer_bytes() const { return source_->peak_buffer_bytes(); }
  std::string Describe() const { return source_->layout().layout().Describe(source_->rank()); }

 private:
  std::unique_ptr<MegatronSource> source_;
  int generation_;
  std::map<std::string, size_t> index_;
};

// One trainer rank's engine. Every call runs the engine on a thread of its own (see
// RunWithSignals); one call at a time. With world_size > 1 and a backend that sends from
// every rank (`sharded`; `ipc` on CUDA), the ranks form wsync's own trainer group (a Gloo
// communicator through rank 0's outcome store); a failed sync marks it stale, and the
// next call of every rank builds a fresh group and engine (all ranks saw the failure:
// RankOutcomes).
class PyTrainerEngine {
 public:
  PyTrainerEngine(TrainerOptions options, int world_size, int group_port, std::string bind_host,
                  py::object progress)
      : options_(std::move(options)), world_size_(world_size), bind_host_(std::move(bind_host)),
        progress_(std::move(progress)) {
    if (world_size_ < 1) RaiseStatus(InvalidArgument(fmt::format("world_size is {}; it must be >= 1", world_size_)));
    if (options_.rank < 0 || options_.rank >= world_size_) {
      RaiseStatus(InvalidArgument(fmt::format("rank {} is outside world_size {}", options_.rank, world_size_)));
    }
    if (!progress_.is_none()) {
      options_.progress = [this](const SyncProgress& p) { ReportProgress(p); };
    }
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
    if (UsesRankGroup() && !outcomes_) {
      RaiseStatus(InvalidArgument(fmt::format(
          "backend {} with world_size {} sends from every rank: it needs the trainer group (give group_port, or "
          "leave it None with torch.distributed initialized; 0 opts out)", options_.backend, world_size_)));
    }
  }

  // Forms the trainer group (a collective of every rank, once each knows rank 0's
  // group_port) and builds the engine. Called once, right after construction.
  void Start() {
    if (engine_ || started_) return;
    started_ = true;
    Build();
  }

  ~PyTrainerEngine() {
    // The engine's threads may still take the GIL to let go of a source's tensors.
    py::gil_scoped_release release;
    engine_.reset();
    group_.reset();
    outcomes_.reset();  // rank 0 may wait here for the other ranks to read the last round
  }

  void Init(py::object source_or_metadata) {
    CheckOpen();
    Rebuild();
    const bool is_source = py::hasattr(source_or_metadata, "metadata") && py::hasattr(source_or_metadata, "__iter__");
    if (PyNativeSource* native = Native(source_or_metadata)) {
      CheckGeneration(*native);
      auto control = std::make_shared<PassControl>();
      OkOrRaise(Guard(RunWithSignals<Status>(*control, [&] { return engine_->Init(native->source()); })));
      initialized_ = true;
      return;
    }
    if (is_source) {
      auto control = std::make_shared<PassControl>();
      std::unique_ptr<PySource> adapter = ValueOrRaise(PySource::Create(source_or_metadata, control, options_.device));
      Status s = Guard(RunWithSignals<Status>(*control, [&] { return engine_->Init(*adapter); }));
      {
        py::gil_scoped_release release;
        adapter.reset();
      }
      if (!s.ok()) RaiseStatus(s, control->TakeError());
      initialized_ = true;
      return;
    }
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
    OkOrRaise(Guard(RunWithSignals<Status>(*control, [&] { return engine_->Init(metadata); })));
    initialized_ = true;
  }

  // One sync. With world_size > 1 it is a round of the trainer group (RunRound).
  SyncStats SendWeights(py::object source, std::optional<std::string> weight_version, bool verify) {
    CheckOpen();
    Rebuild();
    ++syncs_;
    SyncStats stats;
    RunRound(fmt::format("{}/send", syncs_), source, [&](WeightSource& adapter) -> Status {
      if (!initialized_) {
        WSYNC_RETURN_IF_ERROR(engine_->Init(adapter));
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
    RunRound(fmt::format("{}/verify", syncs_), source, [&](WeightSource& adapter) -> Status {
      if (options_.rank == 0) return VerifyServers(options_, adapter, DigestAlgorithm::kXxh3_128);
      return DrainChecked(adapter);
    });
    stats->verified = options_.rank == 0;
    stats->verify_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  // A Megatron-style source of this rank's parameters over the trainer group (collective:
  // every rank calls it at once). `model`: a registered name or a config.json directory;
  // `layout`: "tpXppYepZ[etpW]" over world_size ranks.
  std::unique_ptr<PyNativeSource> MegatronSourceOf(const std::string& model, const std::string& layout_text) {
    CheckOpen();
    Rebuild();
    if (world_size_ > 1 && !group_) {
      RaiseStatus(FailedPrecondition(fmt::format(
          "a Megatron source runs its passes on wsync's trainer group, which backend {} does not form; use "
          "backend='sharded'", options_.backend)));
    }
    ModelConfig config = ValueOrRaise(LookupModel(model));
    ParallelLayout layout = ValueOrRaise(ParallelLayout::Parse(layout_text, world_size_));
    MegatronLayout table = ValueOrRaise(MegatronLayout::Build(config, layout));
    auto shared = std::make_shared<const MegatronLayout>(std::move(table));
    std::vector<HostTensor> params;
    for (const WorkerParam& p : shared->params(options_.rank)) {
      params.push_back(ValueOrRaise(HostTensor::Zeros(p.meta)));
    }
    std::shared_ptr<Communicator> comm = group_ ? group_->comm() : SoloComm();
    SourceOptions o;
    o.timeout_seconds = options_.timeout_seconds;
    o.describe_rank = [layout](int r) { return layout.Describe(r); };
    if (group_) o.peer_stopped = group_->PeerStoppedFn();
    Result<std::unique_ptr<MegatronSource>> made = [&] {
      py::gil_scoped_release release;
      return MegatronSource::Create(comm, shared, std::move(params), o);
    }();
    if (!made.ok()) {
      stale_ = group_ != nullptr;
      RaiseStatus(made.status());
    }
    return std::make_unique<PyNativeSource>(std::move(made).value(), generation_);
  }

  void Shutdown() {
    if (!engine_) return;
    py::gil_scoped_release release;
    engine_->Shutdown();
    engine_.reset();
    group_.reset();
    outcomes_.reset();
  }

  bool closed() const { return started_ && engine_ == nullptr; }
  int group_port() const { return outcomes_ ? outcomes_->port() : 0; }
  int generation() const { return generation_; }
  bool stale() const { return stale_; }

 private:
  void CheckOpen() const {
    if (!engine_) RaiseStatus(FailedPrecondition(started_ ? "this TrainerEngine was shut down"
                                                          : "this TrainerEngine was not started"));
  }

  bool UsesRankGroup() const {
    const BackendDescriptor* backend = FindBackend(options_.backend);
    return world_size_ > 1 && backend != nullptr && UsesTrainerGroup(*backend, options_.device);
  }

  // The trainer group (when the backend uses one) and the engine on it.
  void Build() {
    TrainerOptions o = options_;
    if (UsesRankGroup()) {
      TrainerGroupOptions g;
      g.store_host = options_.store_host;
      g.store_port = outcomes_->port();
      g.bind_host = bind_host_;
      g.prefix = fmt::format("wsync-trainer-group/{}", generation_);
      g.timeout_seconds = options_.timeout_seconds;
      ParallelLayout layout = ValueOrRaise(ParallelLayout::Parse("fsdp", world_size_));
      Result<std::shared_ptr<TrainerGroup>> joined = [&] {
        py::gil_scoped_release release;
        return TrainerGroup::Connect(g, layout, options_.rank);
      }();
      if (!joined.ok()) {
        stale_ = true;
        RaiseStatus(
            joined.status().WithContext(fmt::format("trainer rank {} joining the trainer group", options_.rank)));
      }
      group_ = std::move(joined).value();
      o.comm = group_->comm();
    }
    Result<std::unique_ptr<TrainerEngine>> engine = CreateTrainerEngine(o);
    if (!engine.ok()) RaiseStatus(engine.status());
    engine_ = std::move(engine).value();
    initialized_ = false;
    stale_ = false;
  }

  // After a failed call, every rank builds a fresh trainer group and engine (a new
  // generation), as every rank of the group saw the failure.
  void Rebuild() {
    if (!stale_ || !UsesRankGroup()) {
      stale_ = false;
      return;
    }
    {
      py::gil_scoped_release release;
      if (engine_) engine_->Shutdown();
      engine_.reset();
      group_.reset();
    }
    ++generation_;
    WSYNC_LOG_INFO("trainer rank {}: forming trainer group #{} after a failed sync", options_.rank, generation_);
    Build();
  }

  // Marks the group stale when `s` failed.
  Status Guard(Status s) {
    if (!s.ok()) stale_ = true;
    return s;
  }

  void CheckGeneration(const PyNativeSource& native) const {
    if (native.generation() != generation_) {
      RaiseStatus(FailedPrecondition(fmt::format(
          "this source was built on trainer group #{}, which a failed sync replaced by #{}; build it again "
          "(wsync.MegatronSource does so itself)", native.generation(), generation_)));
    }
  }

  static PyNativeSource* Native(py::handle source) {
    if (!py::isinstance<PyNativeSource>(source)) return nullptr;
    return source.cast<PyNativeSource*>();
  }

  // A communicator of one rank, for a one-rank Megatron source.
  std::shared_ptr<Communicator> SoloComm() {
    if (!solo_) {
      TrainerGroupOptions g;
      solo_store_ = ValueOrRaise(StoreServer::Start("127.0.0.1", 0));
      g.store_port = solo_store_->port();
      g.prefix = "wsync-solo";
      g.timeout_seconds = options_.timeout_seconds;
      ParallelLayout layout = ValueOrRaise(ParallelLayout::Parse("fsdp", 1));
      py::gil_scoped_release release;
      solo_ = ValueOrRaise(TrainerGroup::Connect(g, layout, 0));
    }
    return solo_->comm();
  }

  // Runs `work` over one pass of `source` and raises its failure. With world_size > 1 the
  // pass is a round of the trainer group: a rank that fails posts its cause at once, then
  // keeps pulling its source to the end (discarding, bounded by the timeout) so that other
  // ranks whose iterators are collectives can finish theirs; every rank then exchanges
  // its outcome, and one rank's failure raises on every rank (RankOutcomes::End). A
  // source that lives in C++ is not drained: its stream, dropped mid-pass, aborts the
  // trainer group, which ends the other ranks' passes at once.
  void RunRound(const std::string& round, py::object source, const std::function<Status(WeightSource&)>& work) {
    auto control = std::make_shared<PassControl>();
    if (outcomes_) outcomes_->Begin(round);
    Status s;
    std::optional<py::error_already_set> interrupt;
    PyNativeSource* native = Native(source);
    std::unique_ptr<PySource> adapter;
    if (native != nullptr && native->generation() != generation_) {
      s = FailedPrecondition(fmt::format("this source was built on trainer group #{}, replaced by #{} after a "
                                         "failed sync; build it again", native->generation(), generation_));
    } else if (native == nullptr) {
      Result<std::unique_ptr<PySource>> created = PySource::Create(source, control, options_.device);
      if (!created.ok()) {
        s = created.status();
      } else {
        adapter = std::move(created).value();
      }
    }
    if (s.ok()) {
      WeightSource& pass = native != nullptr ? native->source() : static_cast<WeightSource&>(*adapter);
      {
        std::lock_guard lock(progress_mu_);
        current_ = control;
      }
      try {
        s = RunWithSignals<Status>(*control, [&]() -> Status {
          Status r = work(pass);
          if (!r.ok() && outcomes_) {
            r = NameGoneRanks(round, r);
            const Status cause = RootCause(r, control->source_status());
            outcomes_->Fail(round, cause);
            if (adapter) {
              Status drained = adapter->DrainRest(Deadline::InSeconds(options_.timeout_seconds));
              if (!drained.ok()) WSYNC_LOG_WARN("trainer rank {}: after the failed sync, {}", options_.rank, drained.ToString());
            }
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
    if (!s.ok() || interrupt) stale_ = true;
    if (outcomes_) {
      Status all;
      {
        py::gil_scoped_release release;
        all = outcomes_->End(round, s);
      }
      if (!all.ok()) stale_ = true;
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

  // A connection that failed (kUnavailable) may mean another rank's process is gone:
  // such ranks stop beating, and `failed` then names them.
  Status NameGoneRanks(const std::string& round, const Status& failed) {
    if (failed.code() != StatusCode::kUnavailable || !outcomes_) return failed;
    const std::vector<int> gone = outcomes_->Silent(round, kGoneAfterSeconds);
    if (gone.empty()) return failed;
    return Unavailable(fmt::format("trainer rank{} {} left the trainer group (no heartbeat for {:.1f} s after a "
                                   "connection failed; its process is gone?): {}",
                                   gone.size() > 1 ? "s" : "", fmt::join(gone, ", "), kGoneAfterSeconds,
                                   failed.message()));
  }
  static constexpr double kGoneAfterSeconds = 2.5;

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

  TrainerOptions options_;  // as built; comm is set per generation on the engine's copy
  int world_size_ = 1;
  std::string bind_host_;  // where this rank's trainer-group connections listen
  py::object progress_;
  std::unique_ptr<TrainerEngine> engine_;
  bool initialized_ = false;
  std::mutex progress_mu_;
  std::shared_ptr<PassControl> current_;  // GUARDED_BY(progress_mu_): the sync running now
  std::unique_ptr<RankOutcomes> outcomes_;  // world_size > 1: the trainer group's outcome board
  std::shared_ptr<TrainerGroup> group_;     // wsync's trainer group, when the backend uses one
  int generation_ = 0;                      // trainer groups formed before this one
  bool stale_ = false;                      // a call failed: the next one forms a new group
  std::unique_ptr<StoreServer> solo_store_;  // a one-rank Megatron source's group
  std::shared_ptr<TrainerGroup> solo_;
  int syncs_ = 0;                           // send_weights calls, which name the group's rounds
  bool started_ = false;                    // Start() ran
};

std::unique_ptr<PyTrainerEngine> MakeEngine(std::string backend, std::vector<std::string> servers,
                                            int data_parallel_size, double bucket_gb, double timeout,
                                            std::optional<std::string> api_key, std::string device, int rank,
                                            int world_size, bool packed, int num_buffers, std::string store_host,
                                            int group_port, std::string bind_host, py::object progress,
                                            bool inline_verify, std::map<std::string, std::string> backend_options,
                                            py::object lora) {
  TrainerOptions o;
  if (!lora.is_none()) {
    // wsync.LoraSource.spec: {"name", "r", "alpha", "use_rslora", "target_modules", "dtype"}.
    py::dict d = lora.cast<py::dict>();
    LoraAdapterOptions a;
    a.name = d["name"].cast<std::string>();
    a.r = d["r"].cast<int64_t>();
    a.alpha = d["alpha"].cast<double>();
    a.use_rslora = d.contains("use_rslora") && d["use_rslora"].cast<bool>();
    a.target_modules = d["target_modules"].cast<std::vector<std::string>>();
    if (d.contains("dtype") && !d["dtype"].is_none()) a.dtype = d["dtype"].cast<std::string>();
    o.lora = std::move(a);
  }
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
  if (bind_host.empty()) bind_host = o.store_host;
  return std::make_unique<PyTrainerEngine>(std::move(o), world_size, group_port, std::move(bind_host),
                                           std::move(progress));
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
           py::arg("group_port"), py::arg("bind_host"), py::arg("progress"), py::arg("inline_verify"),
           py::arg("backend_options"), py::arg("lora") = py::none())
      .def("init", &PyTrainerEngine::Init, py::arg("source_or_metadata"))
      .def("send_weights", &PyTrainerEngine::SendWeights, py::arg("source"), py::arg("weight_version") = py::none(),
           py::arg("verify") = false)
      .def("start", &PyTrainerEngine::Start)
      .def("shutdown", &PyTrainerEngine::Shutdown)
      .def_property_readonly("closed", &PyTrainerEngine::closed)
      .def_property_readonly("group_port", &PyTrainerEngine::group_port)
      .def_property_readonly("generation", &PyTrainerEngine::generation)
      .def_property_readonly("stale", &PyTrainerEngine::stale)
      .def("megatron_source", &PyTrainerEngine::MegatronSourceOf, py::arg("model"), py::arg("layout"));

  py::class_<PyNativeSource>(m, "_MegatronSource",
                             "A Megatron-style rank's parameters, laid out by the engine's table.")
      .def("params", &PyNativeSource::params)
      .def("held_names", &PyNativeSource::held_names)
      .def("load", &PyNativeSource::Load, py::arg("name"), py::arg("tensor"))
      .def("load_hf", &PyNativeSource::LoadHf, py::arg("pairs"))
      .def_property_readonly("generation", &PyNativeSource::generation)
      .def_property_readonly("peak_buffer_bytes", &PyNativeSource::peak_buffer_bytes)
      .def("describe", &PyNativeSource::Describe);

  m.def("dropped_names", [](const std::vector<std::string>& names, const std::string& model) {
        ModelConfig config = ValueOrRaise(LookupModel(model));
        std::vector<std::string> out;
        for (const std::string& n : names) {
          if (!DroppedNameReason(n, config).empty()) out.push_back(n);
        }
        return out;
      }, py::arg("names"), py::arg("model"),
      "The names of `names` that servers of `model` hold no tensor for and drop, as vLLM does\n"
      "(a tied lm_head.weight, rotary buffers, an MTP layer's copies; src/model/dropped_names.h).");
  m.def("layer_groups", [](const std::vector<std::string>& names) {
        std::vector<std::pair<size_t, size_t>> out;
        for (const LayerGroup& g : ValueOrRaise(LayerGroups(names))) out.emplace_back(g.begin, g.end);
        return out;
      }, py::arg("names"),
      "The layer groups of tensor names in metadata order, as [(begin, end), ...] index ranges:\n"
      "what wsync gathers, sends and frees together (src/sources/groups.h).");

  m.def("model_metadata", &ModelMetadata, py::arg("name_or_config_dir"),
        "The Hugging Face tensors of a registered model ('qwen3-tiny', 'qwen3-0.6b', ...) or of a\n"
        "directory holding a config.json, as [(name, dtype_name, shape), ...] in checkpoint order.");
  m.def("registered_models", &RegisteredModelNames, "Names model_metadata() knows without a config.json.");
}

}  // namespace wsync::python
