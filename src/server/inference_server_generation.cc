// InferenceServer's toy generation: the Generator it owns, the weights it reads, and the
// routes that drive it (pause, resume, /abort_requests, /reset_prefix_cache,
// /v1/completions).
#include <chrono>
#include <future>

#include <fmt/format.h>

#include "model/worker_store.h"
#include "server/inference_server.h"
#include "server/inference_server_worker.h"
#include "receiver/worker_thread.h"
#include "wsync/device_runtime.h"

namespace wsync {

using nlohmann::json;

Status InferenceServer::CreateGenerator() {
  const ShardingTable& table = GenerationStore(0).table();
  embed_param_ = table.FindParam("model.embed_tokens.weight");
  norm_param_ = table.FindParam("model.norm.weight");
  if (embed_param_ < 0 || norm_param_ < 0) {
    return Internal(fmt::format("model {} has no model.embed_tokens.weight or model.norm.weight", model_.name));
  }
  GeneratorOptions g;
  g.limits.model = model_.name;
  g.limits.vocab_size = model_.vocab_size;
  if (options_.max_loras > 0) {
    g.limits.is_adapter = [this](std::string_view name) { return workers_.front()->lora->Find(name) != nullptr; };
    g.adapter = [this](const std::string& name) { return AdapterForGeneration(name); };
  }
  g.token_interval_ms = options_.token_interval_ms;
  g.timeout_seconds = options_.timeout_seconds;
  g.kv_cache_bytes = options_.kv_cache_bytes;
  // What a real KV cache holds for one block: K and V of every layer's KV heads.
  g.kv_block_bytes = PrefixCache::kBlockTokens * 2 * static_cast<size_t>(model_.num_hidden_layers) *
                     static_cast<size_t>(model_.num_key_value_heads) * static_cast<size_t>(model_.head_dim) *
                     ItemSize(model_.dtype);
  auto with_weights = [this](const Generator::Step& step, std::string* why) {
    return WithWeightsForGeneration(step, why);
  };
  Result<std::unique_ptr<Generator>> gen = Generator::Create(g, with_weights);
  if (!gen.ok()) return gen.status();
  generator_ = std::move(*gen);
  return Status::Ok();
}

std::unique_lock<std::shared_mutex> InferenceServer::ExcludeGeneration() {
  ++weights_writers_waiting_;
  std::unique_lock lock(weights_read_mu_);
  --weights_writers_waiting_;
  return lock;
}

bool InferenceServer::WithWeightsForGeneration(const Generator::Step& step, std::string* why) {
  if (weights_writers_waiting_.load() > 0) {
    *why = "the weight session to finish";
    return false;
  }
  std::shared_lock hold(weights_read_mu_);
  if (session_->Look().active) {
    *why = "the weight session to finish";
    return false;
  }
  if (!WeightsAwakeForGeneration()) {
    *why = "the weights to wake up";
    return false;
  }
  step([this](int64_t token) { return ProbeWeights(token); }, WeightVersion());
  return true;
}

Result<uint64_t> InferenceServer::ProbeWeights(int64_t token) {
  if (token < 0 || token >= model_.vocab_size) {
    return InvalidArgument(fmt::format("token {} is outside the vocabulary of {}", token, model_.vocab_size));
  }
  const int64_t per_rank = ShardingTable::PaddedVocab(model_.vocab_size) / options_.tp;
  const size_t worker = static_cast<size_t>(token / per_rank);  // the first replica's workers come first
  const WorkerStore& store = GenerationStore(worker);
  const WorkerParam& embed = store.table().params()[embed_param_];
  const WorkerParam& norm = store.table().params()[norm_param_];
  const size_t row_bytes = embed.meta.nbytes() / static_cast<size_t>(embed.meta.shape[0]);
  const std::byte* row = store.param_data(embed_param_) + static_cast<size_t>(token % per_rank) * row_bytes;
  const std::byte* norm_data = store.param_data(norm_param_);
  const size_t norm_bytes = norm.meta.nbytes();
  if (store.device().is_cpu()) return WeightProbe({row, row_bytes}, {norm_data, norm_bytes});

  // A CUDA store: copy both to host on the worker's thread (its device is current there).
  auto host = std::make_shared<std::vector<std::byte>>(row_bytes + norm_bytes);
  Device device = store.device();
  auto copy = [host, row, row_bytes, norm_data, norm_bytes, device]() -> Status {
    WSYNC_ASSIGN_OR_RETURN(DeviceRuntime * rt, CudaRuntimeFor(device));
    WSYNC_RETURN_IF_ERROR(rt->Copy2D(host->data(), row_bytes, row, row_bytes, row_bytes, 1));
    WSYNC_RETURN_IF_ERROR(rt->Copy2D(host->data() + row_bytes, norm_bytes, norm_data, norm_bytes, norm_bytes, 1));
    return rt->Synchronize();
  };
  std::future<Status> copied = GenerationThread(worker).Post(copy);
  if (copied.wait_for(std::chrono::duration<double>(options_.timeout_seconds)) != std::future_status::ready) {
    return DeadlineExceeded(fmt::format("worker tp{} on {} did not copy the weights of token {} to host within {} s",
                                        store.tp_rank(), device.ToString(), token, options_.timeout_seconds));
  }
  Status s = copied.get();
  if (!s.ok()) {
    return s.WithContext(fmt::format("worker tp{} on {}: copying the weights of token {} to host", store.tp_rank(),
                                     device.ToString(), token));
  }
  return WeightProbe({host->data(), row_bytes}, {host->data() + row_bytes, norm_bytes});
}

Status InferenceServer::Pause(std::string_view mode, bool clear_cache) { return generator_->Pause(mode, clear_cache); }

Status InferenceServer::Resume() { return generator_->Resume(); }

bool InferenceServer::IsPaused() const { return generator_->IsPaused(); }

Result<bool> InferenceServer::ResetPrefixCache(bool reset_running_requests) {
  return generator_->ResetPrefixCache(reset_running_requests);
}

Result<json> InferenceServer::Complete(const json& request) {
  const int bound = options_.max_requests;
  if (bound <= 0) return generator_->Complete(request);
  const int now = ++completions_in_flight_;
  struct Leave {
    std::atomic<int>& n;
    ~Leave() { --n; }
  } leave{completions_in_flight_};
  if (now > bound) {
    return Unavailable(fmt::format("{} completions are in flight, the most this server takes at once: each holds an "
                                   "HTTP worker thread, and the others are kept for the weight-transfer routes; "
                                   "retry once one has finished (--http-threads raises the bound)", bound));
  }
  return generator_->Complete(request);
}

Result<int> InferenceServer::AbortRequests(const std::vector<std::string>& request_ids) {
  return generator_->Abort(request_ids);
}

}  // namespace wsync
