#include "wsync/receiver.h"

#include <mutex>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include <fmt/format.h>

#include "backends/descriptor.h"
#include "core/log.h"
#include "model/config.h"
#include "model/dropped_names.h"
#include "model/sharding.h"
#include "model/worker_sink.h"
#include "receiver/admission.h"
#include "receiver/backend.h"
#include "receiver/session.h"
#include "receiver/worker_thread.h"
#include "wsync/device_runtime.h"

namespace wsync {
namespace {

using nlohmann::json;

// The ReceiverEngine's WorkerSink: collects the views of one chunk (whole tensors, or the
// slices of its sharding table's pieces) and hands them to the callbacks of the receive in
// progress: whole tensors in batches as they arrive (at least `batch_bytes`, whole modules)
// and at the end of the chunk, slices when the backend says the chunk is complete. Names
// model/dropped_names.h drops are not lent unless the worker's metadata lists them.
class LendingSink final : public WorkerSink {
 public:
  LendingSink(std::vector<TensorMeta> expected, std::optional<ShardingTable> table, size_t batch_bytes)
      : expected_(std::move(expected)), table_(std::move(table)), batch_bytes_(batch_bytes) {
    for (const TensorMeta& m : expected_) names_.insert(m.name);
    // A worker that lists embed_tokens without lm_head.weight reads lm_head from embed_tokens.
    tied_ = names_.contains("model.embed_tokens.weight") && !names_.contains("lm_head.weight");
  }

  const std::vector<TensorMeta>& hf_tensors() const override { return expected_; }

  // Why the worker drops `name` (the rule's phrase), or empty when it is lent.
  std::string_view DropReason(std::string_view name) const {
    if (names_.contains(name)) return {};
    return DroppedNameReason(name, tied_);
  }

  Status Load(const TensorRef& hf) override {
    if (on_chunk_ == nullptr) return Internal(fmt::format("tensor {} arrived outside a receive", hf.name));
    if (!DropReason(hf.name).empty()) return Status::Ok();
    size_t want = static_cast<size_t>(NumElements(hf.shape)) * ItemSize(hf.dtype);
    if (hf.bytes.size() != want) {
      return Internal(fmt::format("tensor {} arrived with {} bytes, its dtype and shape need {}", hf.name,
                                  hf.bytes.size(), want));
    }
    // A module boundary after a batch's worth of bytes: lend what arrived so far, so that
    // the callback loads it while the rest of the chunk is still on the wire.
    if (!chunk_.empty() && chunk_bytes_ >= batch_bytes_ && ModuleOf(hf.name) != ModuleOf(chunk_.back().name)) {
      WSYNC_RETURN_IF_ERROR(LendTensors());
    }
    chunk_.push_back(hf);
    chunk_bytes_ += hf.bytes.size();
    return Status::Ok();
  }

  const ShardingTable* sharding() const override { return table_ ? &*table_ : nullptr; }

  Status LoadPiece(int param, int piece, std::span<const std::byte> packed, const Device& where) override {
    if (on_chunk_ == nullptr) return Internal(fmt::format("a slice of parameter {} arrived outside a receive", param));
    if (!table_ || param < 0 || static_cast<size_t>(param) >= table_->params().size() || piece < 0 ||
        static_cast<size_t>(piece) >= table_->params()[param].pieces.size()) {
      return InvalidArgument(fmt::format("no piece {} of parameter {} in this worker's sharding table", piece, param));
    }
    const WorkerParam& p = table_->params()[param];
    const ShardPiece& sp = p.pieces[piece];
    const PieceRuns r = table_->Runs(param, piece);
    if (static_cast<int64_t>(packed.size()) != r.count * r.run_bytes) {
      return InvalidArgument(fmt::format("piece {} of {} ({}) is {} bytes, {} arrived", piece, p.meta.name,
                                         sp.hf_name, r.count * r.run_bytes, packed.size()));
    }
    Shape shape = table_->hf_tensors()[table_->PieceHf(param, piece)].shape;
    shape[sp.dim] = sp.length;
    slices_.push_back(SliceRef{param, piece, sp.hf_name, p.meta.dtype, std::move(shape), packed, where});
    return Status::Ok();
  }

  Status ChunkLanded() override {
    if (on_chunk_ == nullptr) return Internal("a chunk landed outside a receive");
    std::vector<SliceRef> slices = std::move(slices_);
    slices_.clear();
    if (!slices.empty()) {
      if (on_slices_ == nullptr || *on_slices_ == nullptr) {
        return FailedPrecondition(fmt::format("the update lands slices ({} of {}), and this receive takes whole "
                                              "tensors only: pass a slice callback",
                                              slices.front().hf_name, table_->params()[slices.front().param].meta.name));
      }
      WSYNC_RETURN_IF_ERROR((*on_slices_)(slices));
    }
    return LendTensors();
  }

  // The callbacks of the receive that is about to run; null after it.
  void Arm(const ChunkCallback* on_chunk, const SliceCallback* on_slices) {
    on_chunk_ = on_chunk;
    on_slices_ = on_slices;
    chunk_.clear();
    chunk_bytes_ = 0;
    slices_.clear();
  }

 private:
  // The module a tensor belongs to: its name up to the decoder layer's index
  // ("model.layers.3."), else up to its last dot ("model.embed_tokens"). A batch ends only
  // between modules, so a model's loader sees each layer's tensors in one call.
  static std::string_view ModuleOf(std::string_view name) {
    for (size_t at = name.find("layers."); at != std::string_view::npos; at = name.find("layers.", at + 1)) {
      size_t end = at + 7;
      while (end < name.size() && name[end] >= '0' && name[end] <= '9') ++end;
      if (end > at + 7 && end < name.size() && name[end] == '.') return name.substr(0, end + 1);
    }
    size_t dot = name.rfind('.');
    return dot == std::string_view::npos ? name : name.substr(0, dot);
  }

  // Hands the tensors gathered so far to the chunk callback.
  Status LendTensors() {
    std::vector<TensorRef> batch = std::move(chunk_);
    chunk_.clear();
    chunk_bytes_ = 0;
    if (batch.empty()) return Status::Ok();
    return (*on_chunk_)(batch);
  }

  const std::vector<TensorMeta> expected_;
  std::unordered_set<std::string_view> names_;  // into expected_
  bool tied_ = false;
  const std::optional<ShardingTable> table_;  // the worker's slices, when it lands them
  const size_t batch_bytes_;
  const ChunkCallback* on_chunk_ = nullptr;
  const SliceCallback* on_slices_ = nullptr;
  std::vector<TensorRef> chunk_;  // the current batch's views
  size_t chunk_bytes_ = 0;        // their bytes
  std::vector<SliceRef> slices_;  // the current chunk's slices
};

// The tensors a ReceiverEngine's worker holds, as admission asks: any tensor when the
// worker named none, else its metadata; names the sink drops are dropped.
class EngineTensors final : public HeldTensors {
 public:
  EngineTensors(const LendingSink* sink, const std::vector<TensorMeta>& metadata) : sink_(sink) {
    for (const TensorMeta& m : metadata) by_name_.emplace(m.name, &m);
  }
  std::string_view DropReason(std::string_view name) const override { return sink_->DropReason(name); }
  const TensorMeta* Find(std::string_view name) const override {
    auto it = by_name_.find(name);
    return it == by_name_.end() ? nullptr : it->second;
  }
  bool TakesAny() const override { return by_name_.empty(); }

 private:
  const LendingSink* sink_;
  std::unordered_map<std::string_view, const TensorMeta*> by_name_;  // into the metadata
};

}  // namespace

struct ReceiverEngine::State {
  ReceiverEngineOptions options;
  std::unique_ptr<LendingSink> sink;
  std::unique_ptr<WorkerThread> thread;
  ReceiverContext context;
  std::unique_ptr<ReceiverBackend> backend;
  // The same session rules as `wsync serve` (session.h): one call at a time, and the
  // session of StartWeightUpdate .. FinishWeightUpdate for a front that keeps them here.
  std::unique_ptr<ReceiverSession> session;
  std::unique_ptr<EngineTensors> held;
  // Touched only by the call in flight.
  std::unique_ptr<UpdateAdmission> admission;

  // Runs one update: admission (unless `reject` already refuses it), then the backend,
  // which hears of a refusal too (a collective data plane tells the trainer "no").
  Status Update(Status reject, const json& update_info, const ChunkCallback& on_chunk,
                const SliceCallback& on_slices) {
    static const auto kNoTensors = std::make_shared<const std::vector<TensorMeta>>();
    UpdateRequest req;
    req.reject = std::move(reject);
    req.tensors = kNoTensors;
    if (req.reject.ok()) {
      AdmittedUpdate admitted = admission->Admit(update_info, !backend->ParsesOwnUpdateInfo());
      req.update_info = std::move(admitted.update_info);
      req.tensors = std::move(admitted.tensors);
      req.reject = std::move(admitted.reject);
    } else {
      req.update_info = std::make_shared<const json>(update_info);
    }
    sink->Arm(&on_chunk, &on_slices);
    Status out = backend->Update(req);
    sink->Arm(nullptr, nullptr);
    if (!req.reject.ok()) return req.reject.WithContext(options.label);
    return out;
  }
};

ReceiverEngine::ReceiverEngine(std::unique_ptr<State> state) : state_(std::move(state)) {}

ReceiverEngine::~ReceiverEngine() {
  if (state_ && state_->backend) state_->backend->Shutdown();
}

Result<std::unique_ptr<ReceiverEngine>> ReceiverEngine::Create(const ReceiverEngineOptions& options) {
  if (options.worker_rank < 0) {
    return InvalidArgument(fmt::format("worker_rank {} is negative", options.worker_rank));
  }
  if (!(options.timeout_seconds > 0)) {
    return InvalidArgument(fmt::format("timeout {} s must be positive", options.timeout_seconds));
  }
  if (!options.backend_config.is_object()) return InvalidArgument("backend settings must be a JSON object");
  WSYNC_RETURN_IF_ERROR(CheckReceiverOptionKeys(options.backend, options.backend_config));
  auto s = std::make_unique<State>();
  s->options = options;
  std::unordered_set<std::string_view> named;
  for (const TensorMeta& m : s->options.metadata) {
    if (!named.insert(m.name).second) return InvalidArgument(fmt::format("metadata names tensor {} twice", m.name));
  }
  if (!options.device.is_cpu()) WSYNC_RETURN_IF_ERROR(CudaRuntimeFor(options.device).status());
  std::optional<ShardingTable> table;
  if (!options.model.empty()) {
    if (options.tp_size < 1) return InvalidArgument(fmt::format("tp_size {} must be at least 1", options.tp_size));
    WSYNC_ASSIGN_OR_RETURN(ModelConfig config, LookupModel(options.model));
    Result<ShardingTable> built = ShardingTable::Build(config, options.worker_rank % options.tp_size, options.tp_size,
                                                       {}, options.mtp_drafter ? Drafter::kMtp : Drafter::kNone);
    if (!built.ok()) return built.status().WithContext(fmt::format("{}: the sharding table of {}", options.label, options.model));
    table = std::move(*built);
  }
  s->sink = std::make_unique<LendingSink>(s->options.metadata, std::move(table), s->options.lend_batch_bytes);
  s->thread = std::make_unique<WorkerThread>(options.label);
  // Every task of the worker runs with its device current (CUDA's is per thread).
  WSYNC_RETURN_IF_ERROR(s->thread->Post([d = options.device] { return UseDeviceOnThisThread(d); }).get());
  s->context.tp_size = 1;  // a worker's place in the deployment is its worker_rank
  s->context.timeout_seconds = options.timeout_seconds;
  s->context.backend_config = options.backend_config;
  s->context.server_url = options.label;
  s->context.workers.push_back(
      ReceiverWorker{s->sink.get(), s->thread.get(), options.worker_rank, 0, options.device, options.label});
  WSYNC_ASSIGN_OR_RETURN(s->backend, CreateReceiverBackend(options.backend, &s->context));
  s->session = std::make_unique<ReceiverSession>(options.timeout_seconds, [] { return ReceiverSession::Clock::now(); },
                                                 options.timeout_seconds);
  s->held = std::make_unique<EngineTensors>(s->sink.get(), s->options.metadata);
  s->admission = std::make_unique<UpdateAdmission>(
      s->held.get(),
      AdmissionOptions{.max_update_bytes = options.max_update_bytes, .label = options.label, .compare_values = true});
  return std::unique_ptr<ReceiverEngine>(new ReceiverEngine(std::move(s)));
}

const ReceiverEngineOptions& ReceiverEngine::options() const { return state_->options; }

Status ReceiverEngine::Init(const json& init_info, const std::string& peer_address) {
  bool took_over = false;
  Result<ReceiverSession::Call> call = state_->session->BeginInit(peer_address, &took_over);
  if (!call.ok()) return call.status().WithContext(state_->options.label);
  Status s = init_info.is_object() ? state_->backend->InitFromPeer(init_info, peer_address).WithContext(state_->options.label)
                                   : InvalidArgument("init_info must be a JSON object");
  call->Done(s);
  return s;
}

Status ReceiverEngine::Receive(const json& update_info, const ChunkCallback& on_chunk,
                               const SliceCallback& on_slices) {
  Result<ReceiverSession::Call> call = state_->session->BeginExclusive("update_weights");
  if (!call.ok()) return call.status().WithContext(state_->options.label);
  Status s = state_->Update(Status::Ok(), update_info, on_chunk, on_slices);
  call->Done(s, false);
  return s;
}

Status ReceiverEngine::StartWeightUpdate() {
  return state_->session->Start([&] { return state_->backend->Start(); }).WithContext(state_->options.label);
}

Status ReceiverEngine::UpdateWeights(const json& update_info, const ChunkCallback& on_chunk,
                                     const SliceCallback& on_slices) {
  Status outside;
  Result<ReceiverSession::Call> call = state_->session->BeginUpdate(&outside);
  if (!call.ok()) return call.status().WithContext(state_->options.label);
  Status s = state_->Update(std::move(outside), update_info, on_chunk, on_slices);
  call->Done(s, ReceiverSession::MayHaveLanded(s));
  return s;
}

Status ReceiverEngine::FinishWeightUpdate() {
  Result<ReceiverSession::Call> call = state_->session->BeginFinish();
  if (!call.ok()) return call.status().WithContext(state_->options.label);
  Status s = state_->backend->Finish().WithContext(state_->options.label);
  call->Done(s);
  return s;
}

ReceiverEngineSession ReceiverEngine::Session() const {
  ReceiverSession::Snapshot look = state_->session->Look();
  ReceiverEngineSession out;
  out.active = look.active;
  out.weights_consistent = look.consistent;
  out.inconsistent = std::move(look.inconsistent);
  out.busy_with = std::move(look.busy_with);
  out.expired_sessions = look.expired_sessions;
  out.taken_over_sessions = look.taken_over_sessions;
  return out;
}

Result<json> ReceiverEngine::Fetch(const json& body) {
  WSYNC_ASSIGN_OR_RETURN(ReceiverSession::Call call, state_->session->BeginExclusive("fetch_weights"));
  Result<json> r = body.is_object() ? state_->backend->Fetch(body)
                                    : Result<json>(InvalidArgument("the fetch_weights body must be a JSON object"));
  call.Done(r.status(), false);
  return r;
}

std::map<std::string, std::vector<std::pair<int64_t, int64_t>>> ReceiverEngine::RowDigestRanges() const {
  return state_->backend->RowDigestRanges();
}

void ReceiverEngine::Shutdown() {
  Result<ReceiverSession::Call> call = state_->session->BeginExclusive("shutdown_weight_transfer_engine");
  if (!call.ok()) return;  // the call in flight ends at its own deadline
  state_->backend->Shutdown();
  call->Done(Status::Ok(), false);
}

}  // namespace wsync
