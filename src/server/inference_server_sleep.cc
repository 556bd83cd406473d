// InferenceServer: sleep and wake (vLLM's /sleep, /wake_up, /is_sleeping), the memory
// report of /health and /server_info, and the weights every worker holds from start-up.
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>

#include <fmt/format.h>

#include "core/log.h"
#include "core/parallel.h"
#include "core/process_memory.h"
#include "core/stopwatch.h"
#include "format/safetensors.h"
#include "model/worker_store.h"
#include "server/inference_server.h"
#include "server/inference_server_worker.h"
#include "receiver/update_info.h"
#include "receiver/worker_fanout.h"
#include "synthetic/synthetic.h"
#include "wsync/device_runtime.h"

namespace wsync {

using nlohmann::json;

namespace {

constexpr std::string_view kWakeWeights = "POST /wake_up?tags=weights first";

std::string OffloadDir(const std::string& flag) {
  if (!flag.empty()) return flag;
  const char* tmp = std::getenv("TMPDIR");
  return tmp != nullptr && *tmp != '\0' ? tmp : "/tmp";
}

const char* WeightsName(int state) {
  static const char* kNames[] = {"awake", "offloaded", "discarded"};
  return kNames[state];
}

}  // namespace

std::vector<Status> InferenceServer::OnEachWorker(std::string_view what, const std::function<Status(Worker&)>& fn) {
  // The fan-out every backend uses; each worker's own outcome is kept (a failed sleep puts
  // back what the other workers released).
  std::vector<Status> out(workers_.size());
  (void)RunOnEveryWorker(context_.workers, what, Deadline::InSeconds(options_.timeout_seconds),
                         [&](size_t i, const ReceiverWorker& w) {
                           Status s = fn(*workers_[i]);
                           out[i] = s.ok() ? std::move(s) : s.WithContext(w.label);
                           return Status::Ok();
                         });
  return out;
}

// ---- The weights at start-up ----

Status InferenceServer::FillWeightsAtStart() {
  Stopwatch elapsed;
  const bool checkpoint = !options_.checkpoint.empty();
  WSYNC_RETURN_IF_ERROR(checkpoint ? LoadCheckpointAtStart() : FillSyntheticAtStart());
  WSYNC_LOG_INFO("weights of {} ({:.3f} GB per replica) {} in {:.3f} s", model_.name,
                 static_cast<double>(ModelBytes(model_)) / 1e9,
                 checkpoint ? fmt::format("loaded from {}", options_.checkpoint)
                            : fmt::format("synthetic, seed {}", options_.init_seed),
                 elapsed.seconds());
  return Status::Ok();
}

Status InferenceServer::LoadOnEveryWorker(const TensorRef& hf) {
  for (Status& s : OnEachWorker("loading weights at start-up", [&](Worker& w) { return w.store->Load(hf); })) WSYNC_RETURN_IF_ERROR(s);
  return Status::Ok();
}

Status InferenceServer::FillSyntheticAtStart() {
  if (workers_.empty()) return Status::Ok();
  const std::vector<TensorMeta> tensors = workers_.front()->store->table().served_hf_tensors();
  size_t largest = 0, total = 0;
  for (const TensorMeta& t : tensors) {
    largest = std::max(largest, t.nbytes());
    total += t.nbytes();
  }
  WSYNC_ASSIGN_OR_RETURN(HostBuffer scratch, HostBuffer::Allocate(largest));
  const size_t threads = DefaultThreads();
  Stopwatch since_log;
  size_t done = 0;
  for (const TensorMeta& t : tensors) {
    std::span<std::byte> bytes = scratch.span().first(t.nbytes());
    GenerateInitial(options_.init_seed, t, bytes, threads);
    WSYNC_RETURN_IF_ERROR(LoadOnEveryWorker(TensorRef{t.name, t.dtype, t.shape, bytes, Device{}}));
    done += t.nbytes();
    if (since_log.seconds() > 5) {
      WSYNC_LOG_INFO("synthetic weights: {:.2f} of {:.2f} GB filled", done / 1e9, total / 1e9);
      since_log.Restart();
    }
  }
  return Status::Ok();
}

Status InferenceServer::LoadCheckpointAtStart() {
  const std::string& dir = options_.checkpoint;
  Result<CheckpointDir> opened = CheckpointDir::Open(dir);
  if (!opened.ok()) return opened.status().WithContext(fmt::format("--checkpoint {}", dir));
  const CheckpointDir& ckpt = *opened;
  if (workers_.empty()) return Status::Ok();
  const std::vector<TensorMeta> want = workers_.front()->store->table().served_hf_tensors();
  for (const TensorMeta& t : ckpt.tensors()) {
    // What the model has no tensor of and the rule drops (MTP layers' copies of
    // embed_tokens and lm_head, rotary buffers, a tied lm_head) is skipped.
    if (IsDroppedBy(*workers_.front()->store, t.name)) continue;
    if (workers_.front()->store->table().FindHf(t.name) < 0) {
      WSYNC_ASSIGN_OR_RETURN(const SafetensorsFile* file, ckpt.FileOf(t.name));
      return InvalidArgument(fmt::format("--checkpoint {}: {} holds tensor {}, which model {} does not have", dir,
                                         file->path(), t.name, model_.name));
    }
  }
  Stopwatch since_log;
  size_t done = 0, total = static_cast<size_t>(ModelBytes(model_));
  for (const TensorMeta& t : want) {
    Result<TensorRef> ref = ckpt.Ref(t.name);
    if (!ref.ok()) {
      return NotFound(fmt::format("--checkpoint {} has no tensor {}, which model {} needs", dir, t.name, model_.name));
    }
    WSYNC_ASSIGN_OR_RETURN(const SafetensorsFile* file, ckpt.FileOf(t.name));
    if (ref->dtype != t.dtype) {
      return InvalidArgument(fmt::format("--checkpoint {}: dtype of {} in {} is {}, model {} has {}", dir, t.name,
                                         file->path(), TorchName(ref->dtype), model_.name, TorchName(t.dtype)));
    }
    if (!std::ranges::equal(ref->shape, t.shape)) {
      return InvalidArgument(fmt::format("--checkpoint {}: shape of {} in {} is {}, model {} has {}", dir, t.name,
                                         file->path(), ShapeString(ref->shape), model_.name, ShapeString(t.shape)));
    }
    WSYNC_RETURN_IF_ERROR(LoadOnEveryWorker(*ref).WithContext(fmt::format("loading {} from {}", t.name, file->path())));
    done += t.nbytes();
    if (since_log.seconds() > 5) {
      WSYNC_LOG_INFO("checkpoint {}: {:.2f} of {:.2f} GB loaded", dir, done / 1e9, total / 1e9);
      since_log.Restart();
    }
  }
  return Status::Ok();
}

// ---- Sleep and wake ----

Status InferenceServer::CheckWeightsReadable(std::string_view what) const {
  {
    std::lock_guard lock(mu_);
    if (weights_sleep_ != WeightsSleep::kAwake) {
      return FailedPrecondition(fmt::format("{} refused: the weights sleep ({}); {}", what,
                                            WeightsName(static_cast<int>(weights_sleep_)), kWakeWeights));
    }
  }
  ReceiverSession::Snapshot session = session_->Look();
  if (!session.discarded.empty()) {
    return FailedPrecondition(fmt::format("{} refused: {}; they hold no trainer's weights until a weight update "
                                          "finishes", what, session.discarded));
  }
  return Status::Ok();
}

Status InferenceServer::SleepWeights(int level) {
  WeightsSleep before;
  {
    std::lock_guard lock(mu_);
    before = weights_sleep_;
  }
  const WeightsSleep after = level == 1 && before == WeightsSleep::kAwake ? WeightsSleep::kOffloaded
                             : level == 2                                 ? WeightsSleep::kDiscarded
                                                                          : before;
  if (after == before) return Status::Ok();
  // No generation step reads the weights while their memory goes.
  std::unique_lock<std::shared_mutex> no_readers = ExcludeGeneration();
  SettleFp8();
  const std::string dir = OffloadDir(options_.offload_dir);
  const size_t threads = std::max<size_t>(1, DefaultThreads() / std::max<size_t>(1, workers_.size()));
  std::vector<Status> outcomes = OnEachWorker("sleep", [&](Worker& w) {
    return after == WeightsSleep::kOffloaded ? w.store->Offload(dir, threads) : w.store->Discard();
  });
  auto failed = std::ranges::find_if(outcomes, [](const Status& s) { return !s.ok(); });
  if (failed == outcomes.end()) {
    std::lock_guard lock(mu_);
    weights_sleep_ = after;
    return Status::Ok();
  }
  Status first = *failed;
  if (after == WeightsSleep::kOffloaded) {
    // Put back what was offloaded: the sleep leaves the weights as they were.
    std::vector<Status> back = OnEachWorker("sleep rollback", [&](Worker& w) { return w.store->Restore(threads); });
    for (const Status& s : back) {
      if (!s.ok()) {
        session_->MarkDiscarded("the weights could not be read back after a failed sleep");
        return first.WithContext(fmt::format(
            "sleep level 1 failed and the weights that were offloaded could not be restored ({}); the weights are "
            "awake but not consistent until a weight update finishes", s.ToString()));
      }
    }
    return first.WithContext("sleep level 1 failed; the weights are awake as before");
  }
  // Memory that was discarded cannot come back: the weights count as discarded.
  std::lock_guard lock(mu_);
  weights_sleep_ = WeightsSleep::kDiscarded;
  return first.WithContext("sleep level 2 failed on this worker; the other workers' weights are discarded and the "
                           "weights count as discarded");
}

Status InferenceServer::WakeWeights() {
  WeightsSleep from;
  {
    std::lock_guard lock(mu_);
    from = weights_sleep_;
  }
  if (from == WeightsSleep::kAwake) return Status::Ok();
  std::unique_lock<std::shared_mutex> no_readers = ExcludeGeneration();
  const size_t threads = std::max<size_t>(1, DefaultThreads() / std::max<size_t>(1, workers_.size()));
  std::vector<Status> outcomes = OnEachWorker("wake_up", [&](Worker& w) { return w.store->Restore(threads); });
  Status lost, other;
  for (const Status& s : outcomes) {
    if (s.code() == StatusCode::kDataLoss && lost.ok()) lost = s;
    if (!s.ok() && s.code() != StatusCode::kDataLoss && other.ok()) other = s;
  }
  if (!other.ok()) {
    return other.WithContext("wake_up: the weights still sleep on this worker; POST /wake_up?tags=weights again");
  }
  if (from == WeightsSleep::kDiscarded) {
    session_->MarkDiscarded("the weights were discarded by POST /sleep?level=2 and woken without their bytes");
  } else if (!lost.ok()) {
    session_->MarkDiscarded("the offloaded weights could not be read back on wake");
  }
  {
    std::lock_guard lock(mu_);
    weights_sleep_ = WeightsSleep::kAwake;
    // The drafter's layers were discarded with the target's: no trainer's bytes until a
    // sync reloads them whole.
    if (from == WeightsSleep::kDiscarded || !lost.ok()) drafter_version_.clear();
  }
  WSYNC_RETURN_IF_ERROR(session_->SetWeightsAsleep(""));
  return lost;
}

Status InferenceServer::Sleep(int level, std::string_view mode) {
  if (level < 0 || level > 2) return InvalidArgument(fmt::format("sleep level {} must be 0, 1 or 2", level));
  std::lock_guard call_lock(sleep_call_mu_);
  std::optional<ReceiverSession::Call> call;
  bool weights_were_awake = false;
  if (level >= 1) {
    WSYNC_ASSIGN_OR_RETURN(ReceiverSession::Call c, session_->BeginExclusive("sleep"));
    call.emplace(std::move(c));
    {
      std::lock_guard lock(mu_);
      weights_were_awake = weights_sleep_ == WeightsSleep::kAwake;
    }
    // 409 while a weight update is active; from here no session can start.
    WSYNC_RETURN_IF_ERROR(session_->SetWeightsAsleep(fmt::format("the weights sleep (POST /sleep); {}", kWakeWeights)));
  }
  auto undo_refusal = [&] {
    if (weights_were_awake) (void)session_->SetWeightsAsleep("");
  };
  bool paused_before = IsPaused();
  if (Status s = Pause(mode, /*clear_cache=*/level >= 1); !s.ok()) {
    undo_refusal();
    return s;
  }
  auto undo_pause = [&] {
    std::lock_guard lock(mu_);
    return !paused_before && !scheduling_asleep_;
  };
  if (level >= 1) {
    if (Status s = SleepWeights(level); !s.ok()) {
      bool weights_awake;
      {
        std::lock_guard lock(mu_);
        weights_awake = weights_sleep_ == WeightsSleep::kAwake;
      }
      if (weights_awake) {
        undo_refusal();
        if (undo_pause()) (void)Resume();
      } else {
        std::lock_guard lock(mu_);
        scheduling_asleep_ = true;
        sleep_paused_ = true;
      }
      call->Done(s, false);
      return s;
    }
    bool kv_awake;
    {
      std::lock_guard lock(mu_);
      kv_awake = !kv_asleep_;
    }
    if (kv_awake) {
      if (Status s = DropKvCache(); !s.ok()) {
        std::lock_guard lock(mu_);
        scheduling_asleep_ = true;
        sleep_paused_ = true;
        call->Done(s, false);
        return s.WithContext(fmt::format("sleep level {}: the weights sleep ({}) but the KV cache could not be "
                                         "dropped; POST /wake_up brings the weights back", level,
                                         WeightsName(static_cast<int>(weights_sleep_))));
      }
    }
  }
  std::lock_guard lock(mu_);
  if (level >= 1) kv_asleep_ = true;
  scheduling_asleep_ = true;
  sleep_paused_ = true;
  WSYNC_LOG_INFO("asleep at level {} (weights {}, kv cache {}, scheduling asleep)", level,
                 WeightsName(static_cast<int>(weights_sleep_)), kv_asleep_ ? "discarded" : "awake");
  if (call) call->Done(Status::Ok(), false);
  return Status::Ok();
}

Status InferenceServer::WakeUp(const std::vector<std::string>& tags) {
  bool weights = tags.empty(), kv = tags.empty(), scheduling = tags.empty();
  for (const std::string& t : tags) {
    if (t == "weights") {
      weights = true;
    } else if (t == "kv_cache") {
      kv = true;
    } else if (t == "scheduling") {
      scheduling = true;
    } else {
      return InvalidArgument(fmt::format("unknown wake_up tag '{}' (query parameter tags): use weights, kv_cache or "
                                         "scheduling", t));
    }
  }
  std::lock_guard call_lock(sleep_call_mu_);
  bool weights_asleep, kv_asleep;
  {
    std::lock_guard lock(mu_);
    weights_asleep = weights_sleep_ != WeightsSleep::kAwake;
    kv_asleep = kv_asleep_;
  }
  if (weights && weights_asleep) {
    WSYNC_ASSIGN_OR_RETURN(ReceiverSession::Call call, session_->BeginExclusive("wake_up"));
    Status s = WakeWeights();
    call.Done(s, false);
    if (!s.ok()) return s;
  }
  if (kv && kv_asleep) {
    WSYNC_RETURN_IF_ERROR(RestoreKvCache().WithContext("wake_up: the KV cache still sleeps"));
    std::lock_guard lock(mu_);
    kv_asleep_ = false;
  }
  bool resume = false;
  {
    std::lock_guard lock(mu_);
    // Scheduling wakes when named, and whenever no memory sleeps any more.
    if (scheduling || (weights_sleep_ == WeightsSleep::kAwake && !kv_asleep_)) scheduling_asleep_ = false;
    const bool sleeping = weights_sleep_ != WeightsSleep::kAwake || kv_asleep_ || scheduling_asleep_;
    resume = !sleeping && sleep_paused_;
    if (resume) sleep_paused_ = false;
  }
  if (resume) WSYNC_RETURN_IF_ERROR(Resume());
  return Status::Ok();
}

Status InferenceServer::ReleaseKvCacheMemory() {
  std::lock_guard call_lock(sleep_call_mu_);
  // vLLM's EngineCore.release_kv_cache_memory: a completed pause, everything resident.
  json generation = generator_->Health();
  if (!IsPaused() || generation.value("running", int64_t{0}) != 0 || generation.value("waiting", int64_t{0}) != 0) {
    return FailedPrecondition(fmt::format(
        "release_kv_cache_memory() requires a completed pause first (POST /pause?mode=abort or mode=wait; "
        "paused: {}, requests running: {}, waiting: {})",
        IsPaused(), generation.value("running", int64_t{0}), generation.value("waiting", int64_t{0})));
  }
  {
    std::lock_guard lock(mu_);
    if (weights_sleep_ != WeightsSleep::kAwake || kv_asleep_) {
      return FailedPrecondition(fmt::format(
          "release_kv_cache_memory() requires all executor memory to be resident (weights {}, kv cache {}); "
          "POST /wake_up first",
          WeightsName(static_cast<int>(weights_sleep_)), kv_asleep_ ? "discarded" : "awake"));
    }
  }
  generator_->ResetPrefixCache(/*reset_running_requests=*/true);
  WSYNC_RETURN_IF_ERROR(DropKvCache().WithContext("release_kv_cache_memory"));
  std::lock_guard lock(mu_);
  kv_asleep_ = true;
  sleep_paused_ = true;  // the wake that brings the cache back resumes scheduling, as vLLM's
  WSYNC_LOG_INFO("release_kv_cache_memory: the KV cache is discarded until /wake_up");
  return Status::Ok();
}

bool InferenceServer::IsSleeping() const {
  std::lock_guard lock(mu_);
  return weights_sleep_ != WeightsSleep::kAwake || kv_asleep_ || scheduling_asleep_;
}

// ---- The KV cache hooks: the toy generation's cache is wired here ----

Status InferenceServer::DropKvCache() { return generator_->DropKvCache(); }
Status InferenceServer::RestoreKvCache() { return generator_->RestoreKvCache(); }
size_t InferenceServer::KvCacheBytes() const { return generator_ ? generator_->kv_cache_bytes_resident() : 0; }
bool InferenceServer::PrefixCaching() const { return generator_ && generator_->prefix_caching(); }

bool InferenceServer::WeightsAwakeForGeneration() const {
  {
    std::lock_guard lock(mu_);
    if (weights_sleep_ != WeightsSleep::kAwake || kv_asleep_ || scheduling_asleep_) return false;
  }
  return session_->Look().discarded.empty();
}

// ---- Memory and server info ----

json InferenceServer::Memory() const {
  size_t weights = 0, resident = 0, offloaded = 0, fp8 = 0;
  for (const auto& w : workers_) {
    weights += w->store->param_bytes();
    if (w->fp8) fp8 += w->fp8->fp8_bytes();
    resident += w->store->resident_bytes();
    offloaded += w->store->offloaded_bytes();
  }
  json m{{"host_rss_bytes", HostRssBytes()},
         {"weights_bytes", weights},
         {"weights_resident_bytes", resident},
         {"weights_offloaded_bytes", offloaded},
         {"kv_cache_bytes", KvCacheBytes()}};
  // --quantization fp8: the float8 weights and scales, held beside the model-dtype
  // parameters (whose quantized landing buffers a host worker releases between syncs).
  if (options_.quantization == "fp8") m["fp8_weights_bytes"] = fp8;
  if (!options_.device.is_cpu()) {
    json used = json::object(), total = json::object();
    if (Result<DeviceRuntime*> rt = CudaRuntimeFor(options_.device); rt.ok()) {
      for (const auto& w : workers_) {
        Result<DeviceRuntime::MemoryInfo> info = (*rt)->GetMemoryInfo(w->device.index);
        if (!info.ok()) continue;
        used[w->device.ToString()] = info->total_bytes - info->free_bytes;
        total[w->device.ToString()] = info->total_bytes;
      }
    }
    m["device_used_bytes"] = std::move(used);
    m["device_total_bytes"] = std::move(total);
  }
  std::lock_guard lock(mu_);
  m["sleep"] = json{{"weights", WeightsName(static_cast<int>(weights_sleep_))},
                    {"kv_cache", kv_asleep_ ? "discarded" : "awake"},
                    {"scheduling", scheduling_asleep_ ? "asleep" : "awake"}};
  return m;
}

json InferenceServer::ServerInfo() const {
  json config{{"model", options_.model},
              {"tp", options_.tp},
              {"dp", options_.dp},
              {"dp_rank", options_.dp_rank},
              {"device", options_.device.ToString()},
              {"backend", options_.backend},
              {"timeout_seconds", options_.timeout_seconds},
              {"session_lease_seconds", options_.session_lease_seconds.value_or(options_.timeout_seconds)},
              {"weights", options_.checkpoint.empty() ? "synthetic" : "checkpoint"},
              {"offload_dir", OffloadDir(options_.offload_dir)}};
  if (options_.checkpoint.empty()) {
    config["init_seed"] = options_.init_seed;
  } else {
    config["checkpoint"] = options_.checkpoint;
  }
  const std::string backend(backend_->name());
  json info{{"server", "wsync"},
            {"model", model_.name},
            {"backend", backend},
            {"tp", options_.tp},
            {"dp", options_.dp},
            {"device", options_.device.ToString()},
            {"config", std::move(config)},
            {"capabilities",
             {{"weight_transfer_backend", backend},
              {"sleep_mode", true},
              {"generation", true},
              {"prefix_caching", PrefixCaching()},
              {"runtime_weight_checker", true},
              {"draft_weight_updates", options_.speculative != "none"}}},
            {"memory", Memory()}};
  info["weight_version"] = WeightVersion();
  return info;
}

}  // namespace wsync
