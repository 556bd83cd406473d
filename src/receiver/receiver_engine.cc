#include "wsync/receiver.h"

#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include <fmt/format.h>

#include "backends/descriptor.h"
#include "core/log.h"
#include "model/dropped_names.h"
#include "model/worker_sink.h"
#include "receiver/admission.h"
#include "receiver/backend.h"
#include "receiver/session.h"
#include "receiver/worker_thread.h"
#include "wsync/device_runtime.h"

namespace wsync {
namespace {

using nlohmann::json;

// The ReceiverEngine's WorkerSink: collects the views of one chunk and hands them to the
// callback of the receive in progress when the backend says the chunk is complete.
// Names model/dropped_names.h drops are not lent unless the worker's metadata lists them.
class LendingSink final : public WorkerSink {
 public:
  explicit LendingSink(std::vector<TensorMeta> expected) : expected_(std::move(expected)) {
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
    chunk_.push_back(hf);
    return Status::Ok();
  }

  Status ChunkLanded() override {
    if (on_chunk_ == nullptr) return Internal("a chunk landed outside a receive");
    std::vector<TensorRef> chunk = std::move(chunk_);
    chunk_.clear();
    if (chunk.empty()) return Status::Ok();
    return (*on_chunk_)(chunk);
  }

  // The callback of the receive that is about to run; null after it.
  void Arm(const ChunkCallback* on_chunk) {
    on_chunk_ = on_chunk;
    chunk_.clear();
  }

 private:
  const std::vector<TensorMeta> expected_;
  std::unordered_set<std::string_view> names_;  // into expected_
  bool tied_ = false;
  const ChunkCallback* on_chunk_ = nullptr;
  std::vector<TensorRef> chunk_;  // the current chunk's views
};

// The tensors a ReceiverEngine's worker holds, as admission asks: any tensor when the
// worker named none, else one of its metadata with the same dtype and shape; names the
// sink drops are dropped.
class EngineTensors final : public HeldTensors {
 public:
  EngineTensors(const LendingSink* sink, const std::vector<TensorMeta>& metadata, std::string label)
      : sink_(sink), label_(std::move(label)) {
    for (const TensorMeta& m : metadata) by_name_.emplace(m.name, &m);
  }
  std::string_view DropReason(std::string_view name) const override { return sink_->DropReason(name); }
  Status Check(const TensorMeta& t) const override {
    if (by_name_.empty()) return Status::Ok();
    auto it = by_name_.find(t.name);
    if (it == by_name_.end()) {
      return InvalidArgument(fmt::format("update_info names tensor {}, which {} does not hold", t.name, label_));
    }
    return CheckSameMeta(*it->second, t);
  }

 private:
  const LendingSink* sink_;
  const std::string label_;
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
  Status Update(Status reject, const json& update_info, const ChunkCallback& on_chunk) {
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
    sink->Arm(&on_chunk);
    Status out = backend->Update(req);
    sink->Arm(nullptr);
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
  s->sink = std::make_unique<LendingSink>(s->options.metadata);
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
  s->held = std::make_unique<EngineTensors>(s->sink.get(), s->options.metadata, options.label);
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

Status ReceiverEngine::Receive(const json& update_info, const ChunkCallback& on_chunk) {
  Result<ReceiverSession::Call> call = state_->session->BeginExclusive("update_weights");
  if (!call.ok()) return call.status().WithContext(state_->options.label);
  Status s = state_->Update(Status::Ok(), update_info, on_chunk);
  call->Done(s, false);
  return s;
}

Status ReceiverEngine::StartWeightUpdate() {
  return state_->session->Start([&] { return state_->backend->Start(); }).WithContext(state_->options.label);
}

Status ReceiverEngine::UpdateWeights(const json& update_info, const ChunkCallback& on_chunk) {
  Status outside;
  Result<ReceiverSession::Call> call = state_->session->BeginUpdate(&outside);
  if (!call.ok()) return call.status().WithContext(state_->options.label);
  Status s = state_->Update(std::move(outside), update_info, on_chunk);
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

void ReceiverEngine::Shutdown() {
  Result<ReceiverSession::Call> call = state_->session->BeginExclusive("shutdown_weight_transfer_engine");
  if (!call.ok()) return;  // the call in flight ends at its own deadline
  state_->backend->Shutdown();
  call->Done(Status::Ok(), false);
}

}  // namespace wsync
