#include "control/session_driver.h"

#include <algorithm>
#include <optional>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "control/init_payloads.h"
#include "control/routes.h"
#include "control/tensor_list.h"
#include "core/json_int.h"

namespace wsync {

using nlohmann::json;

namespace {

std::string Path(std::string_view route) { return std::string(route); }

json WrapInit(json init_info) { return json{{"init_info", std::move(init_info)}}; }

}  // namespace

double DeadlinePolicy::server_timeout() const { return std::max(0.5, timeout_seconds * 0.9 - 0.25); }

SessionDriver::SessionDriver(std::vector<std::string> servers, std::string api_key, double timeout_seconds)
    : client_(std::move(servers), ClientOptions{api_key, 10}), api_key_(std::move(api_key)) {
  policy_.timeout_seconds = timeout_seconds;
}

std::optional<json> VllmWsyncHealth(const json& server_info) {
  if (!server_info.is_object()) return std::nullopt;
  auto config = server_info.find("vllm_config");
  if (config == server_info.end() || !config->is_object()) return std::nullopt;
  auto transfer = config->find("weight_transfer_config");
  if (transfer == config->end() || !transfer->is_object() || transfer->value("backend", json()) != "wsync") {
    return std::nullopt;
  }
  // The server's workers: TP x PP of each of its DP ranks (vLLM's parallel_config).
  auto size = [&](const char* field) {
    auto parallel = config->find("parallel_config");
    if (parallel == config->end() || !parallel->is_object()) return 1;
    auto it = parallel->find(field);
    return it != parallel->end() && it->is_number_integer() && *it >= 1 && *it <= kMaxBroadcastWorldSize
               ? it->get<int>()
               : 1;
  };
  // vLLM's quantization method (model_config.quantization: "fp8", ...; null: none).
  std::string quantization = "none";
  if (auto model = config->find("model_config"); model != config->end() && model->is_object()) {
    if (auto q = model->find("quantization"); q != model->end() && q->is_string() && !q->get_ref<const std::string&>().empty()) {
      quantization = q->get<std::string>();
    }
  }
  return json{{"server", "wsync"},
              {"frontend", "vllm"},
              {"quantization", quantization},
              {"tp", size("tensor_parallel_size")},
              {"pp", size("pipeline_parallel_size")},
              {"dp", size("data_parallel_size")},
              {"dp_rank", -1},
              {"inline_verification", "xxh3_128"}};
}

Result<Fleet> SessionDriver::Discover() const {
  Fleet fleet;
  WSYNC_ASSIGN_OR_RETURN(fleet.health, client_.Get(Path(route::kHealth), policy_.Call()));
  // A vLLM server runs wsync's receiving core when its weight-transfer engine is wsync's
  // plugin: its /health is empty, its /server_info (dev mode) names the engine.
  for (size_t i = 0; i < fleet.health.size() && i < urls().size(); ++i) {
    const json& h = fleet.health[i];
    if (h.is_object() && h.contains("server")) continue;
    FanOutClient one({urls()[i]}, ClientOptions{api_key_, 10});
    Result<std::vector<json>> info = one.Get(Path(route::kServerInfo) + "?config_format=json", policy_.Call());
    if (!info.ok() || info->empty()) continue;
    if (std::optional<json> health = VllmWsyncHealth(info->front())) fleet.health[i] = *std::move(health);
  }
  for (const json& h : fleet.health) {
    fleet.inline_verification.push_back(h.is_object() && h.value("inline_verification", json()) == "xxh3_128");
  }
  for (size_t i = 0; i < fleet.health.size(); ++i) {
    const json& h = fleet.health[i];
    if (!h.is_object() || h.value("server", "") != "wsync") {
      fleet.wsync = false;
      fleet.other = urls()[i];
      break;
    }
  }
  return fleet;
}

Status SessionDriver::WorldSizes(Fleet* fleet) const {
  WSYNC_ASSIGN_OR_RETURN(std::vector<json> sizes,
                         client_.Get(Path(route::kGetWorldSize) + "?include_dp=true", policy_.Call()));
  fleet->world_sizes.clear();
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (!sizes[i].is_object() || !sizes[i].contains("world_size")) {
      return Internal(fmt::format("{}: {} answered {}", urls()[i], route::kGetWorldSize,
                                  sizes[i].dump(-1, ' ', true, json::error_handler_t::replace).substr(0, 200)));
    }
    // Exact: a reply of 4294967298 is not 2.
    Result<int64_t> size = JsonIntInRange(sizes[i]["world_size"],
                                          fmt::format("{}: {} world_size", urls()[i], route::kGetWorldSize), 1,
                                          kMaxBroadcastWorldSize);
    if (!size.ok()) return Internal(size.status().message());
    fleet->world_sizes.push_back(static_cast<int>(*size));
  }
  return Status::Ok();
}

Status SessionDriver::CheckBackend(const Fleet& fleet, std::string_view wanted) const {
  std::vector<std::string> wrong;
  for (size_t i = 0; i < fleet.health.size() && i < urls().size(); ++i) {
    const json& h = fleet.health[i];
    if (!h.is_object()) continue;
    auto it = h.find("backend");
    if (it == h.end() || !it->is_string()) continue;  // a server that does not say: no check
    if (it->get<std::string>() != wanted) {
      wrong.push_back(fmt::format("{} runs backend '{}'", urls()[i], it->get<std::string>()));
    }
  }
  if (wrong.empty()) return Status::Ok();
  return FailedPrecondition(fmt::format("the trainer asked for backend '{}', but {}: start the servers with "
                                        "--backend {} or push with the servers' backend",
                                        wanted, fmt::join(wrong, ", "), wanted));
}

std::vector<std::string> SessionDriver::WorkerLabels(const Fleet& fleet, int count,
                                                     const std::vector<int>& offsets) const {
  std::vector<std::string> labels(count);
  for (size_t i = 0; i < offsets.size() && i < urls().size(); ++i) {
    const std::string& url = urls()[i];
    json h = i < fleet.health.size() && fleet.health[i].is_object() ? fleet.health[i] : json::object();
    int tp = h.value("tp", 0), dp = h.value("dp", 0), dp_rank = h.value("dp_rank", -1);
    if (tp <= 0 || dp <= 0) {
      for (int r = offsets[i]; r < count; ++r) {
        if (labels[r].empty()) labels[r] = fmt::format("a worker of {} or a later server", url);
      }
      continue;
    }
    int first = dp_rank < 0 ? 0 : dp_rank, end = dp_rank < 0 ? dp : dp_rank + 1;
    for (int d = first; d < end; ++d) {
      for (int t = 0; t < tp; ++t) {
        int r = offsets[i] + d * tp + t;
        if (r >= 0 && r < count) labels[r] = fmt::format("{} worker dp{}/tp{}", url, d, t);
      }
    }
  }
  return labels;
}

std::shared_ptr<SessionDriver::Pending> SessionDriver::InitAsync(std::vector<json> init_infos) const {
  for (json& info : init_infos) info = WrapInit(std::move(info));
  return client_.PostAsync(Path(route::kInitWeightTransfer), std::move(init_infos), policy_.Http());
}

Status SessionDriver::Init(std::vector<json> init_infos) const {
  if (init_infos.size() != size()) {
    return Internal(fmt::format("{} init payloads for {} servers", init_infos.size(), size()));
  }
  Deadline deadline = policy_.Http();
  return InitAsync(std::move(init_infos))->Wait(deadline).status();
}

Status SessionDriver::InitAll(const json& init_info) const {
  return client_.Post(Path(route::kInitWeightTransfer), WrapInit(init_info), policy_.Http()).status();
}

bool SessionDriver::LoraByRpc(size_t i) const {
  return InVllm(i) && !draft_sessions_ && start_fields_.contains("wsync_lora");
}

FanOutClient SessionDriver::Subset(const std::vector<size_t>& which) const {
  if (which.size() == size()) return client_;  // every server: the kept-alive connections
  std::vector<std::string> urls;
  for (size_t i : which) urls.push_back(this->urls()[i]);
  return FanOutClient(std::move(urls), ClientOptions{api_key_, 10});
}

Status SessionDriver::StartVllmLora(const std::vector<size_t>& vllm) const {
  const json call = {{"method", "wsync_lora_start"},
                     {"args", json::array({start_fields_.at("wsync_lora").dump(), "start"})}};
  Deadline deadline = policy_.Call();
  return Subset(vllm)
      .PostAsync(Path(route::kCollectiveRpc), std::vector<json>(vllm.size(), call), deadline)
      ->Wait(deadline)
      .status()
      .WithContext("naming the LoRA adapter to vLLM's workers and opening their session (wsync_lora_start)");
}

Status SessionDriver::Start(const std::vector<bool>* inline_verify) const {
  std::vector<size_t> vllm_lora, rest;
  for (size_t i = 0; i < size(); ++i) (LoraByRpc(i) ? vllm_lora : rest).push_back(i);
  // vLLM servers first: one refusing the adapter starts nothing anywhere.
  if (!vllm_lora.empty()) WSYNC_RETURN_IF_ERROR(StartVllmLora(vllm_lora));
  if (rest.empty()) return Status::Ok();
  auto marked = [&](size_t i) { return inline_verify != nullptr && i < inline_verify->size() && (*inline_verify)[i]; };
  const bool marks = !draft_sessions_ && std::ranges::any_of(rest, marked);
  const std::string path = Path(draft_sessions_ ? route::kStartDraftWeightUpdate : route::kStartWeightUpdate);
  if (!marks && vllm_lora.empty()) return client_.Post(path, start_fields_, policy_.Call()).status();
  json with = start_fields_;
  with["wsync_inline_verify"] = true;
  std::vector<json> bodies;
  for (size_t i : rest) bodies.push_back(marks && marked(i) ? with : start_fields_);
  Deadline deadline = policy_.Call();
  if (vllm_lora.empty()) return client_.PostAsync(path, std::move(bodies), deadline)->Wait(deadline).status();
  return Subset(rest).PostAsync(path, std::move(bodies), deadline)->Wait(deadline).status();
}

std::shared_ptr<SessionDriver::Pending> SessionDriver::UpdateAsync(std::shared_ptr<const std::string> body) const {
  return client_.PostAsync(Path(route::kUpdateWeights), std::move(body), policy_.Http());
}

Status SessionDriver::Update(const json& update_info) const {
  return client_.Post(Path(route::kUpdateWeights), json{{"update_info", update_info}}, policy_.Call()).status();
}

json SessionDriver::FinishBody(size_t i, const std::optional<std::string>& weight_version) const {
  json body = json::object();
  if (weight_version && !(InVllm(i) && start_fields_.contains("wsync_lora"))) body["weight_version"] = *weight_version;
  return body;
}

Status SessionDriver::Finish(const std::optional<std::string>& weight_version) const {
  std::vector<json> bodies;
  for (size_t i = 0; i < size(); ++i) bodies.push_back(FinishBody(i, weight_version));
  Deadline deadline = policy_.Call();
  return client_.PostAsync(Path(route::kFinishWeightUpdate), std::move(bodies), deadline)->Wait(deadline).status();
}

Result<std::vector<json>> SessionDriver::FinishVerified(const std::optional<std::string>& weight_version,
                                                        const json& digests,
                                                        const std::vector<bool>& verifying) const {
  auto verifies = [&](size_t i) { return i < verifying.size() && verifying[i]; };
  Deadline deadline = policy_.Call();
  // The digests as a collective RPC's argument, for vLLM's workers only (thousands of row
  // digests make a body of hundreds of KB: written once, and only where it is sent).
  std::string digests_arg;
  for (size_t i = 0; i < size() && digests_arg.empty(); ++i) {
    if (verifies(i) && InVllm(i)) digests_arg = json{{"wsync_digests", digests}, {"digest_algorithm", "xxh3_128"}}.dump();
  }
  // vLLM's /finish_weight_update passes only weight_version. In a lora session its workers
  // take the digests and finish in one collective RPC (wsync_lora_finish); otherwise they
  // take the digests by collective RPC first, and refuse the finish that follows if any
  // differ.
  std::vector<size_t> two_step;
  for (size_t i = 0; i < size(); ++i) {
    if (verifies(i) && InVllm(i) && !LoraByRpc(i)) two_step.push_back(i);
  }
  std::vector<json> rpc_replies;
  if (!two_step.empty()) {
    const json call = {{"method", "wsync_inline_digests"}, {"args", json::array({digests_arg})}};
    Result<std::vector<json>> sent =
        Subset(two_step).PostAsync(Path(route::kCollectiveRpc), std::vector<json>(two_step.size(), call), deadline)
            ->Wait(deadline);
    if (!sent.ok()) return sent.status().WithContext("sending the in-line digests to vLLM's workers");
    rpc_replies = *std::move(sent);
  }
  std::vector<std::string> paths;
  std::vector<json> bodies;
  for (size_t i = 0; i < size(); ++i) {
    if (verifies(i) && LoraByRpc(i)) {
      paths.push_back(Path(route::kCollectiveRpc));
      bodies.push_back({{"method", "wsync_lora_finish"}, {"args", json::array({digests_arg})}});
      continue;
    }
    json body = FinishBody(i, weight_version);
    if (verifies(i) && !InVllm(i)) {
      body["wsync_digests"] = digests;
      body["digest_algorithm"] = "xxh3_128";
    }
    paths.push_back(Path(route::kFinishWeightUpdate));
    bodies.push_back(std::move(body));
  }
  Result<std::vector<json>> replies = client_.PostAsync(std::move(paths), std::move(bodies), deadline)->Wait(deadline);
  // vLLM cuts a worker's error short: the merged results name the differing tensors in full.
  std::vector<std::optional<Result<json>>> merged(size());
  for (size_t v = 0; v < two_step.size(); ++v) {
    merged[two_step[v]] = MergeInlineResults(v < rpc_replies.size() ? rpc_replies[v] : json(), digests.size(),
                                             urls()[two_step[v]]);
  }
  for (size_t i = 0; replies.ok() && i < size() && i < replies->size(); ++i) {
    if (!(verifies(i) && LoraByRpc(i))) continue;
    const json& reply = (*replies)[i];
    merged[i] = MergeInlineResults(reply, digests.size(), urls()[i]);
    if (!merged[i]->ok()) continue;
    // Its workers agree before any installs: one refusing means none did.
    for (const json& r : reply["results"]) {
      if (r.is_object() && r.value("finished", true) == false) {
        merged[i] = Aborted(fmt::format("{}: a worker refused LoRA adapter {}; the previous version keeps serving",
                                        urls()[i], start_fields_["wsync_lora"].value("name", "")));
        break;
      }
    }
  }
  Status first_failed = Status::Ok();
  for (const auto& m : merged) {
    if (m && !m->ok() && first_failed.ok()) first_failed = m->status();
  }
  if (!replies.ok() || !first_failed.ok()) {
    // A vLLM worker that refused to finish leaves vLLM's session open (its engine undid the
    // update): a plain finish closes it without setting a version. A lora session's
    // workers close theirs as they refuse; one that did not answer is closed here.
    if (!two_step.empty()) {
      (void)Subset(two_step).Post(Path(route::kFinishWeightUpdate), json::object(), policy_.Close());
    }
    if (!replies.ok()) Close(/*only_lora=*/true);
    return first_failed.ok() ? replies.status() : first_failed;
  }
  for (size_t i = 0; i < size() && i < replies->size(); ++i) {
    if (merged[i]) (*replies)[i] = json{{"verified", *std::move(*merged[i])}};
  }
  return replies;
}

void SessionDriver::Close(bool only_lora) const {
  // A lora session on vLLM ends by wsync_lora_finish with abort: its workers drop what
  // they staged and close vLLM's session (a plain finish would install it).
  std::vector<size_t> which;
  std::vector<std::string> paths;
  std::vector<json> bodies;
  for (size_t i = 0; i < size(); ++i) {
    if (LoraByRpc(i)) {
      paths.push_back(Path(route::kCollectiveRpc));
      bodies.push_back({{"method", "wsync_lora_finish"}, {"args", json::array({R"({"abort": true})"})}});
    } else if (only_lora) {
      continue;
    } else {
      paths.push_back(Path(route::kFinishWeightUpdate));
      bodies.push_back(json::object());
    }
    which.push_back(i);
  }
  if (which.empty()) return;
  Deadline deadline = policy_.Close();
  if (which.size() == size()) {
    (void)client_.PostAsync(std::move(paths), std::move(bodies), deadline)->Wait(deadline);
    return;
  }
  (void)Subset(which).PostAsync(std::move(paths), std::move(bodies), deadline)->Wait(deadline);
}

Result<std::vector<json>> SessionDriver::Fetch(const json& body) const {
  return client_.Post(Path(route::kFetchWeights), body, policy_.Call());
}

Result<std::vector<json>> SessionDriver::Fetch(const json& body, const std::vector<bool>& vllm) const {
  std::vector<std::string> plain_urls, vllm_urls;
  for (size_t i = 0; i < size(); ++i) (i < vllm.size() && vllm[i] ? vllm_urls : plain_urls).push_back(urls()[i]);
  if (vllm_urls.empty()) return Fetch(body);
  Deadline deadline = policy_.Call();
  std::shared_ptr<Pending> plain, rpc;
  std::optional<FanOutClient> plain_client, vllm_client;
  if (!plain_urls.empty()) {
    plain_client.emplace(plain_urls, ClientOptions{api_key_, 10});
    plain = plain_client->PostAsync(Path(route::kFetchWeights), std::vector<json>(plain_urls.size(), body), deadline);
  }
  vllm_client.emplace(vllm_urls, ClientOptions{api_key_, 10});
  json call = {{"method", "wsync_fetch_weights"}, {"args", json::array({body.dump()})}};
  rpc = vllm_client->PostAsync(Path(route::kCollectiveRpc), std::vector<json>(vllm_urls.size(), call), deadline);
  std::vector<json> plain_replies;
  if (plain) {
    WSYNC_ASSIGN_OR_RETURN(plain_replies, plain->Wait(deadline));
  }
  WSYNC_ASSIGN_OR_RETURN(std::vector<json> rpc_replies, rpc->Wait(deadline));
  std::vector<json> out;
  for (size_t i = 0, p = 0, v = 0; i < size(); ++i) {
    if (!(i < vllm.size() && vllm[i])) {
      out.push_back(p < plain_replies.size() ? plain_replies[p++] : json::object());
      continue;
    }
    const json& reply = v < rpc_replies.size() ? rpc_replies[v++] : json();
    auto results = reply.is_object() ? reply.find("results") : reply.end();
    if (results == reply.end() || !results->is_array() || results->empty() || !results->front().is_object()) {
      return Internal(fmt::format("{}: {} wsync_fetch_weights answered no per-worker results", urls()[i],
                                  route::kCollectiveRpc));
    }
    json merged = results->front();
    int64_t applied = 0;
    for (const json& r : *results) {
      if (r.is_object() && r.contains("applied_by_workers") && r["applied_by_workers"].is_number_integer()) {
        applied += r["applied_by_workers"].get<int64_t>();
      }
    }
    merged["applied_by_workers"] = applied;
    merged["workers"] = results->size();
    out.push_back(std::move(merged));
  }
  return out;
}

Status SessionDriver::Pause(std::string_view mode, bool clear_cache) const {
  return client_
      .Post(fmt::format("{}?mode={}&clear_cache={}", route::kPause, mode, clear_cache ? "true" : "false"),
            json::object(), policy_.Call())
      .status();
}

Status SessionDriver::Resume() const {
  return client_.Post(Path(route::kResume), json::object(), policy_.Call()).status();
}

namespace {

// vLLM's enable_prefix_caching anywhere within `depth` levels of `j`.
std::optional<bool> FindPrefixCachingFlag(const json& j, int depth) {
  if (j.is_string()) {
    const std::string& text = j.get_ref<const std::string&>();
    if (text.find("enable_prefix_caching=True") != std::string::npos) return true;
    if (text.find("enable_prefix_caching=False") != std::string::npos) return false;
    return std::nullopt;
  }
  if (depth <= 0 || !j.is_structured()) return std::nullopt;
  if (j.is_object()) {
    if (auto it = j.find("enable_prefix_caching"); it != j.end() && it->is_boolean()) return it->get<bool>();
  }
  for (const json& child : j) {
    if (std::optional<bool> found = FindPrefixCachingFlag(child, depth - 1)) return found;
  }
  return std::nullopt;
}

}  // namespace

bool ServerInfoSaysPrefixCaching(const json& info) {
  if (!info.is_object()) return false;
  if (auto caps = info.find("capabilities"); caps != info.end() && caps->is_object()) {
    if (auto it = caps->find("prefix_caching"); it != caps->end() && it->is_boolean()) return it->get<bool>();
  }
  return FindPrefixCachingFlag(info, 6).value_or(false);
}

std::vector<bool> SessionDriver::PrefixCaching() const {
  const std::string path = Path(route::kServerInfo) + "?config_format=json";
  std::vector<bool> out(size(), false);
  // One fan-out; when a server fails it (no /server_info), each server alone.
  if (Result<std::vector<json>> all = client_.Get(path, policy_.Call()); all.ok()) {
    for (size_t i = 0; i < all->size() && i < out.size(); ++i) out[i] = ServerInfoSaysPrefixCaching((*all)[i]);
    return out;
  }
  for (size_t i = 0; i < size(); ++i) {
    FanOutClient one({urls()[i]}, ClientOptions{api_key_, 10});
    Result<std::vector<json>> info = one.Get(path, policy_.Call());
    out[i] = info.ok() && !info->empty() && ServerInfoSaysPrefixCaching(info->front());
  }
  return out;
}

Status SessionDriver::ResetPrefixCache(const std::vector<bool>& which) const {
  std::vector<size_t> indices;
  for (size_t i = 0; i < which.size() && i < size(); ++i) {
    if (which[i]) indices.push_back(i);
  }
  if (indices.empty()) return Status::Ok();
  FanOutClient some = Subset(indices);
  const std::vector<std::string>& chosen = some.urls();
  WSYNC_ASSIGN_OR_RETURN(std::vector<json> replies,
                         some.Post(Path(route::kResetPrefixCache) + "?reset_running_requests=true", json::object(),
                                   policy_.Call()));
  for (size_t i = 0; i < replies.size(); ++i) {
    // vLLM answers {"success": bool}; a reply without the field reports no failure.
    auto it = replies[i].is_object() ? replies[i].find("success") : replies[i].end();
    const bool failed = !replies[i].is_object() || (it != replies[i].end() && *it != json(true));
    if (failed) {
      return FailedPrecondition(fmt::format(
          "{}: {} answered {}: its prefix cache may still hold entries computed with the old weights", chosen[i],
          route::kResetPrefixCache, replies[i].dump(-1, ' ', true, json::error_handler_t::replace).substr(0, 200)));
    }
  }
  return Status::Ok();
}

std::shared_ptr<SessionDriver::Pending> SessionDriver::ChecksumsAsync(std::string_view algorithm,
                                                                     std::string_view lora) const {
  json body{{"action", "checksum"}, {"algorithm", algorithm}};
  if (!lora.empty()) body["lora"] = lora;
  return client_.PostAsync(Path(route::kWeightChecker), std::vector<json>(size(), body), policy_.Call());
}

std::shared_ptr<SessionDriver::Pending> SessionDriver::WorkerChecksumsAsync(std::string_view algorithm,
                                                                          std::string_view lora) const {
  json body = lora.empty() ? json{{"method", "wsync_weight_digests"}, {"args", json::array({algorithm})}}
                           : json{{"method", "wsync_lora_digests"}, {"args", json::array({lora, algorithm})}};
  return client_.PostAsync(Path(route::kCollectiveRpc), std::vector<json>(size(), body), policy_.Call());
}

Result<json> MergeWorkerChecksums(const json& reply, std::string_view server) {
  auto results = reply.is_object() ? reply.find("results") : reply.end();
  if (results == reply.end() || !results->is_array() || results->empty()) {
    return Internal(fmt::format("{}: {} wsync_weight_digests answered no per-worker results", server,
                                route::kCollectiveRpc));
  }
  json merged = json::object();
  std::set<std::string> not_held;
  for (size_t w = 0; w < results->size(); ++w) {
    const json& r = (*results)[w];
    auto sums = r.is_object() ? r.find("checksums") : r.end();
    if (sums == r.end() || !sums->is_object()) {
      return Internal(fmt::format("{}: worker {} answered wsync_weight_digests without 'checksums'", server, w));
    }
    for (const auto& [name, hex] : sums->items()) {
      auto it = merged.find(name);
      if (it != merged.end() && *it != hex) {
        return Internal(fmt::format("{}: workers disagree about {} (worker {} differs from an earlier one)", server,
                                    name, w));
      }
      merged[name] = hex;
    }
    if (auto it = r.find("not_held"); it != r.end() && it->is_array()) {
      for (const json& n : *it) {
        if (n.is_string()) not_held.insert(n.get<std::string>());
      }
    }
  }
  for (const auto& [name, _] : merged.items()) not_held.erase(name);
  return json{{"checksums", std::move(merged)}, {"not_held", not_held}};
}

Result<json> MergeInlineResults(const json& reply, size_t digests, std::string_view server) {
  auto results = reply.is_object() ? reply.find("results") : reply.end();
  if (results == reply.end() || !results->is_array() || results->empty()) {
    return Internal(fmt::format("{}: {} wsync_inline_digests answered no per-worker results", server,
                                route::kCollectiveRpc));
  }
  std::optional<std::set<std::string>> not_landed;  // by every worker so far
  std::map<std::string, std::string> reasons;        // a worker's why, where it gave one
  std::vector<std::string> differ;
  for (size_t w = 0; w < results->size(); ++w) {
    const json& r = (*results)[w];
    if (!r.is_object() || !r.contains("tensors") || !r["tensors"].is_number_integer() ||
        r["tensors"].get<int64_t>() < 0) {
      return Internal(fmt::format("{}: worker {} answered wsync_inline_digests without 'tensors'", server, w));
    }
    std::set<std::string> mine;
    if (auto it = r.find("not_landed"); it != r.end() && it->is_array()) {
      for (const json& n : *it) {
        if (n.is_string()) mine.insert(n.get<std::string>());
      }
    }
    if (auto it = r.find("unverifiable"); it != r.end() && it->is_object()) {
      for (const auto& [name, why] : it->items()) {
        if (why.is_string() && mine.contains(name)) reasons.emplace(name, why.get<std::string>().substr(0, 200));
      }
    }
    if (!not_landed) {
      not_landed = std::move(mine);
    } else {
      std::erase_if(*not_landed, [&](const std::string& n) { return !mine.contains(n); });
    }
    if (auto it = r.find("differ"); it != r.end() && it->is_array()) {
      for (const json& d : *it) {
        if (d.is_string() && differ.size() < 5) differ.push_back(d.get<std::string>().substr(0, 400));
      }
    }
    auto count = r.find("differing");
    const bool differs = count != r.end() && (!count->is_number_integer() || count->get<int64_t>() != 0);
    if (differs && differ.empty()) differ.push_back(fmt::format("worker {}: differing tensors unnamed", w));
  }
  if (!differ.empty()) {
    return DataLoss(fmt::format("{}: in-line verification found tensors that differ from what the trainer read: {}",
                                server, fmt::join(differ, "; ")));
  }
  // A tensor is verified where some worker landed it: each worker checked all it landed.
  const size_t tensors = digests - std::min(digests, not_landed->size());
  json unverifiable = json::object();
  for (const std::string& n : *not_landed) {
    auto why = reasons.find(n);
    unverifiable[n.substr(0, 200)] = why != reasons.end() ? why->second : "landed by no worker of this server";
  }
  return json{{"tensors", tensors}, {"algorithm", "xxh3_128"}, {"unverifiable", std::move(unverifiable)}};
}

std::shared_ptr<const std::string> UpdateBody(const std::vector<TensorMeta>& tensors, const json& extra) {
  json info = TensorListJson(tensors);
  for (const auto& [k, v] : extra.items()) info[k] = v;
  return std::make_shared<const std::string>(json{{"update_info", std::move(info)}}.dump());
}

std::shared_ptr<const std::string> UpdateBodyCache::Get(const std::vector<TensorMeta>& tensors) {
  if (!bytes_ || tensors != tensors_) {
    tensors_ = tensors;
    bytes_ = UpdateBody(tensors);
  }
  return bytes_;
}

}  // namespace wsync
