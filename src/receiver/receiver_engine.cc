#include "wsync/receiver.h"

#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include <fmt/format.h>

#include "backends/descriptor.h"
#include "control/tensor_list.h"
#include "core/checked_math.h"
#include "core/log.h"
#include "model/dropped_names.h"
#include "model/worker_sink.h"
#include "receiver/backend.h"
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

}  // namespace

struct ReceiverEngine::State {
  ReceiverEngineOptions options;
  std::unique_ptr<LendingSink> sink;
  std::unique_ptr<WorkerThread> thread;
  ReceiverContext context;
  std::unique_ptr<ReceiverBackend> backend;
  std::unordered_map<std::string_view, const TensorMeta*> expected_by_name;  // into options.metadata

  std::mutex mu;
  const char* busy_with = nullptr;  // GUARDED_BY(mu): the call in flight

  // The last update that passed the checks: a byte-identical update_info is handed to
  // the backend as the same objects (UpdateRequest's contract), so backends keep what
  // they derived from it. Touched only by the call in flight.
  std::shared_ptr<const json> last_info;
  std::shared_ptr<const std::vector<TensorMeta>> last_tensors;

  // Holds the engine for one call; FailedPrecondition naming the call in flight.
  class Call {
   public:
    explicit Call(State* s) : s_(s) {}
    Call(Call&& o) noexcept : s_(o.s_) { o.s_ = nullptr; }
    ~Call() {
      if (s_ == nullptr) return;
      std::lock_guard lock(s_->mu);
      s_->busy_with = nullptr;
    }

   private:
    State* s_;
  };
  Result<Call> Begin(const char* what) {
    std::lock_guard lock(mu);
    if (busy_with != nullptr) {
      return FailedPrecondition(fmt::format("{}: {} is in progress on {}", what, busy_with, options.label));
    }
    busy_with = what;
    return Call(this);
  }

  // The update's tensor list, checked: unique names, a bounded byte total, and each
  // tensor one of `metadata` when the worker named its tensors, or one the sink drops.
  Status Check(const std::vector<TensorMeta>& tensors) const {
    std::unordered_set<std::string_view> seen;
    uint64_t total = 0;
    for (const TensorMeta& t : tensors) {
      if (!seen.insert(t.name).second) {
        return InvalidArgument(fmt::format("update_info names tensor {} twice", t.name));
      }
      std::optional<uint64_t> sum = CheckedAdd<uint64_t>(total, t.nbytes());
      if (!sum || *sum > options.max_update_bytes) {
        return InvalidArgument(fmt::format("update_info's tensors add up to more than {} bytes (at {}), the limit of {} "
                                           "(max_update_bytes)", options.max_update_bytes, t.name, options.label));
      }
      total = *sum;
      if (std::string_view reason = sink->DropReason(t.name); !reason.empty()) {
        WSYNC_LOG_DEBUG("{}: update_info: dropping {} ({})", options.label, t.name, reason);
        continue;
      }
      if (!expected_by_name.empty()) {
        auto it = expected_by_name.find(t.name);
        if (it == expected_by_name.end()) {
          return InvalidArgument(fmt::format("update_info names tensor {}, which {} does not hold", t.name,
                                             options.label));
        }
        WSYNC_RETURN_IF_ERROR(CheckSameMeta(*it->second, t));
      }
    }
    return Status::Ok();
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
  for (const TensorMeta& m : s->options.metadata) {
    if (!s->expected_by_name.emplace(m.name, &m).second) {
      return InvalidArgument(fmt::format("metadata names tensor {} twice", m.name));
    }
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
  return std::unique_ptr<ReceiverEngine>(new ReceiverEngine(std::move(s)));
}

const ReceiverEngineOptions& ReceiverEngine::options() const { return state_->options; }

Status ReceiverEngine::Init(const json& init_info, const std::string& peer_address) {
  WSYNC_ASSIGN_OR_RETURN(State::Call call, state_->Begin("init"));
  if (!init_info.is_object()) return InvalidArgument("init_info must be a JSON object");
  return state_->backend->InitFromPeer(init_info, peer_address).WithContext(state_->options.label);
}

Status ReceiverEngine::Receive(const json& update_info, const ChunkCallback& on_chunk) {
  WSYNC_ASSIGN_OR_RETURN(State::Call call, state_->Begin("receive"));
  State& s = *state_;
  static const auto kNoTensors = std::make_shared<const std::vector<TensorMeta>>();
  UpdateRequest req;
  req.tensors = kNoTensors;
  if (s.last_info != nullptr && *s.last_info == update_info) {
    req.update_info = s.last_info;
    req.tensors = s.last_tensors;
  } else {
    req.update_info = std::make_shared<const json>(update_info);
    if (!update_info.is_object()) {
      req.reject = InvalidArgument("update_info must be a JSON object");
    } else if (!s.backend->ParsesOwnUpdateInfo()) {
      Result<std::vector<TensorMeta>> parsed = ParseTensorList(update_info);
      if (!parsed.ok()) {
        req.reject = parsed.status();
      } else {
        req.reject = s.Check(*parsed);
        req.tensors = std::make_shared<const std::vector<TensorMeta>>(std::move(*parsed));
      }
    }
    if (req.reject.ok()) {
      s.last_info = req.update_info;
      s.last_tensors = req.tensors;
    }
  }
  s.sink->Arm(&on_chunk);
  Status out = s.backend->Update(req);
  s.sink->Arm(nullptr);
  if (!req.reject.ok()) return req.reject.WithContext(s.options.label);
  return out;
}

Result<json> ReceiverEngine::Fetch(const json& body) {
  WSYNC_ASSIGN_OR_RETURN(State::Call call, state_->Begin("fetch"));
  if (!body.is_object()) return InvalidArgument("the fetch_weights body must be a JSON object");
  return state_->backend->Fetch(body);
}

void ReceiverEngine::Shutdown() {
  Result<State::Call> call = state_->Begin("shutdown");
  if (!call.ok()) return;  // the call in flight ends at its own deadline
  state_->backend->Shutdown();
}

}  // namespace wsync
