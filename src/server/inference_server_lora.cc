// InferenceServer's LoRA adapters (--max-loras, docs/lora.md): lora sessions, their
// admission and atomic install, /v1/models, /v1/unload_lora_adapter, the adapters'
// checksums and the generation's view of them.
#include <ctime>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/digest.h"
#include "core/log.h"
#include "receiver/lora_store.h"
#include "receiver/row_digests.h"
#include "server/inference_server.h"
#include "server/inference_server_worker.h"

namespace wsync {

using nlohmann::json;

void InferenceServer::UseWeightSinks() {
  for (size_t i = 0; i < workers_.size() && i < context_.workers.size(); ++i) {
    context_.workers[i].sink = workers_[i]->sink();
  }
}

void InferenceServer::UseLoraSinks() {
  for (size_t i = 0; i < workers_.size() && i < context_.workers.size(); ++i) {
    context_.workers[i].sink = workers_[i]->lora->staging_sink();
  }
}

void InferenceServer::EndLoraSession() {
  {
    std::lock_guard lock(mu_);
    if (!lora_session_) return;
    WSYNC_LOG_WARN("the lora session for adapter {} version {} ended without its finish; version {} keeps serving",
                   lora_session_->name, lora_session_->version,
                   [&] {
                     auto a = workers_.front()->lora->Find(lora_session_->name);
                     return a ? a->spec.version : std::string("(none)");
                   }());
    lora_session_.reset();
  }
  for (auto& w : workers_) w->lora->Discard();
  UseWeightSinks();
}

bool InferenceServer::InLoraSession() const {
  std::lock_guard lock(mu_);
  return lora_session_.has_value();
}

Status InferenceServer::StartLoraWeightUpdate(const json& lora, bool inline_verify) {
  return Measured(WeightOperation::kStart, [&]() -> Status {
    if (options_.max_loras <= 0) {
      return InvalidArgument("this server holds no LoRA adapters (start it with --max-loras N)");
    }
    if (!backend_->CarriesAdapters()) {
      return InvalidArgument(fmt::format("backend {} carries the model's own tensors only; LoRA adapters sync over "
                                         "nccl, ipc or sharded", backend_->name()));
    }
    WSYNC_ASSIGN_OR_RETURN(LoraSpec spec, ParseLoraSpec(lora, model_));
    WSYNC_ASSIGN_OR_RETURN(std::vector<TensorMeta> tensors,
                           LoraTensors(spec, model_, std::min<uint64_t>(options_.max_update_bytes, uint64_t{1} << 36)));
    const LoraStore& first = *workers_.front()->lora;
    if (first.Find(spec.name) == nullptr && first.size() >= static_cast<size_t>(options_.max_loras)) {
      std::vector<std::string> held;
      for (const auto& a : first.List()) held.push_back(a->spec.name);
      return FailedPrecondition(fmt::format(
          "LoRA adapter {}: this server holds {} adapter(s) ({}), its --max-loras; unload one (POST "
          "/v1/unload_lora_adapter {{\"lora_name\": ...}}) or start it with a larger --max-loras",
          spec.name, held.size(), fmt::join(held, ", ")));
    }
    (void)inline_verify;  // adapters are always digested as they land
    bool began = false;  // the staging is this call's (not an active session's)
    Status s = session_->Start(
        [&]() -> Status {
          began = true;
          return CatchAll("start_weight_update", [&]() -> Status {
            for (auto& w : workers_) WSYNC_RETURN_IF_ERROR(w->lora->Begin(spec, tensors));
            return backend_->Start();
          });
        },
        /*side=*/true);
    if (!s.ok()) {
      if (began) {
        for (auto& w : workers_) w->lora->Discard();
      }
      return s;
    }
    lora_admission_ = std::make_unique<UpdateAdmission>(
        workers_.front()->lora->staging_tensors(),
        AdmissionOptions{.max_update_bytes = options_.max_update_bytes, .label = "this server"});
    UseLoraSinks();
    WSYNC_LOG_INFO("lora session: staging adapter {} version {} (r {}, alpha {:g}, modules {}, {} tensors)",
                   spec.name, spec.version, spec.r, spec.alpha, fmt::join(spec.target_modules, ","),
                   tensors.size());
    std::lock_guard lock(mu_);
    lora_session_ = std::move(spec);
    draft_session_ = false;
    return Status::Ok();
  });
}

AdmittedUpdate InferenceServer::AdmitLora(std::shared_ptr<const json> update_info) {
  return lora_admission_->Admit(std::move(update_info), /*parse=*/true);
}

Status InferenceServer::FinishLora(const std::optional<std::string>& weight_version, const json* digests,
                                   std::string_view algorithm, json* verified) {
  LoraSpec spec;
  {
    std::lock_guard lock(mu_);
    spec = *lora_session_;
    lora_session_.reset();
  }
  Status s = weight_version ? CheckLoraVersion(*weight_version).WithContext("finish_weight_update's weight_version")
                           : Status::Ok();
  if (s.ok() && weight_version) spec.version = *weight_version;
  if (s.ok()) s = CatchAll("finish_weight_update", [&] { return backend_->Finish(); });
  for (size_t i = 0; s.ok() && i < workers_.size(); ++i) {
    s = workers_[i]->lora->CheckStaged().WithContext(context_.workers[i].label);
  }
  // Every worker landed the same bytes.
  std::map<std::string, std::string> held;
  if (s.ok()) held = workers_.front()->lora->StagedDigests();
  for (size_t i = 1; s.ok() && i < workers_.size(); ++i) {
    if (workers_[i]->lora->StagedDigests() != held) {
      s = DataLoss(fmt::format("adapter {}: {} landed other bytes than {}", spec.name, context_.workers[i].label,
                               context_.workers[0].label));
    }
  }
  if (s.ok() && digests != nullptr) {
    if (algorithm != DigestAlgorithmName(DigestAlgorithm::kXxh3_128)) {
      s = InvalidArgument(fmt::format("digest_algorithm '{}': adapters verify in-line with '{}' only", algorithm,
                                      DigestAlgorithmName(DigestAlgorithm::kXxh3_128)));
    } else if (digests->size() > held.size() + 16) {
      s = InvalidArgument(fmt::format("wsync_digests names {} tensors; adapter {} has {}", digests->size(),
                                      spec.name, held.size()));
    }
    json unverifiable = json::object();
    std::vector<std::string> differ;
    size_t checked = 0;
    static const json kNone = json::object();
    for (const auto& [name, hex] : (s.ok() ? *digests : kNone).items()) {
      const bool whole = hex.is_string() && hex.get_ref<const std::string&>().size() <= kMaxDigestHexBytes;
      if (!whole && !hex.is_object()) {
        s = InvalidArgument(fmt::format("wsync_digests[{}] must be a hex string or {{\"rows\": [[begin, end, hex], "
                                        "...]}}", name.substr(0, 200)));
        break;
      }
      auto it = held.find(name);
      if (it == held.end()) {
        unverifiable[name.substr(0, 200)] = fmt::format("not a tensor of adapter {}", spec.name);
        continue;
      }
      // A tensor the trainer digested by row ranges (a large one on its GPU) is compared
      // range by range with what worker 0 staged; every worker staged the same bytes.
      std::string have = it->second, want;
      if (whole) {
        want = hex.get<std::string>();
      } else {
        // Held: staged and landed, so the staging has its metadata.
        const TensorMeta& meta = *workers_.front()->lora->staging_tensors()->Find(name);
        Result<RowDigests> rows = ParseRowDigests(hex, name, meta.shape.empty() ? 0 : meta.shape[0]);
        if (!rows.ok()) {
          s = rows.status();
          break;
        }
        Result<std::string> ranges = workers_.front()->lora->StagedRowsDigest(name, rows->ranges);
        if (!ranges.ok()) {
          s = ranges.status();
          break;
        }
        have = std::move(*ranges);
        want = std::move(rows->joined);
      }
      ++checked;
      if (have != want && differ.size() < 5) differ.push_back(name);
    }
    if (s.ok() && !differ.empty()) {
      s = DataLoss(fmt::format("in-line verification of adapter {} version {}: tensor(s) held differ from the "
                               "trainer's digests: {}", spec.name, spec.version, fmt::join(differ, ", ")));
    }
    if (s.ok()) {
      *verified = json{{"tensors", checked},
                       {"algorithm", algorithm},
                       {"unverifiable", std::move(unverifiable)},
                       {"hashed_at_landing", checked},
                       {"lora", spec.name}};
    }
  }
  if (!s.ok()) {
    for (auto& w : workers_) w->lora->Discard();
    UseWeightSinks();
    WSYNC_LOG_WARN("lora session for adapter {} failed; the previous version keeps serving: {}", spec.name,
                   s.ToString());
    return s;
  }
  // Install everywhere at once: no generation step reads an adapter meanwhile.
  std::shared_ptr<const LoraAdapter> live;
  {
    auto no_generation_step = ExcludeGeneration();
    for (auto& w : workers_) live = w->lora->Commit(spec.version);
  }
  UseWeightSinks();
  WSYNC_LOG_INFO("adapter {} version {} installed ({} tensors, load {})", spec.name, spec.version,
                 live->tensors.size(), live->loads);
  return Status::Ok();
}

Result<json> InferenceServer::Models() const {
  const int64_t created = static_cast<int64_t>(std::time(nullptr));
  json data = json::array();
  data.push_back(json{{"id", model_.name},
                      {"object", "model"},
                      {"created", created},
                      {"owned_by", "wsync"},
                      {"root", model_.name},
                      {"parent", nullptr}});
  if (options_.max_loras > 0) {
    for (const auto& a : workers_.front()->lora->List()) {
      data.push_back(json{{"id", a->spec.name},
                          {"object", "model"},
                          {"created", created},
                          {"owned_by", "wsync"},
                          {"root", a->spec.name},
                          {"parent", model_.name},
                          {"lora_version", a->spec.version}});
    }
  }
  return json{{"object", "list"}, {"data", std::move(data)}};
}

Status InferenceServer::UnloadLoraAdapter(const std::string& name) {
  if (options_.max_loras <= 0) return NotFound(fmt::format("no LoRA adapter named {} is loaded", name));
  WSYNC_ASSIGN_OR_RETURN(ReceiverSession::Call call,
                         session_->BeginExclusive("unload_lora_adapter", /*refuse_in_session=*/true));
  Status s;
  {
    auto no_generation_step = ExcludeGeneration();
    for (auto& w : workers_) {
      Status u = w->lora->Unload(name);
      if (s.ok()) s = u;
    }
  }
  call.Done(s, false);
  if (s.ok()) WSYNC_LOG_INFO("adapter {} unloaded", name);
  return s;
}

Result<json> InferenceServer::LoraChecksums(const std::string& name, DigestAlgorithm algorithm) {
  WSYNC_ASSIGN_OR_RETURN(ReceiverSession::Call call,
                         session_->BeginExclusive("weight_checker", /*refuse_in_session=*/true));
  Result<json> r = [&]() -> Result<json> {
    std::shared_ptr<const LoraAdapter> first;
    json sums = json::object();
    for (size_t i = 0; i < workers_.size(); ++i) {
      std::shared_ptr<const LoraAdapter> a =
          options_.max_loras > 0 ? workers_[i]->lora->Find(name) : nullptr;
      if (a == nullptr) return NotFound(fmt::format("no LoRA adapter named {} is loaded", name));
      if (first && a->spec.version != first->spec.version) {
        return DataLoss(fmt::format("adapter {}: {} holds version {}, {} holds {}", name, context_.workers[i].label,
                                    a->spec.version, context_.workers[0].label, first->spec.version));
      }
      for (size_t t = 0; t < a->tensors.size(); ++t) {
        std::string hex = HexDigest(algorithm, a->bytes[t]);
        if (!first) {
          sums[a->tensors[t].name] = std::move(hex);
        } else if (sums[a->tensors[t].name] != hex) {
          return DataLoss(fmt::format("adapter {}: {} differs between {} and {}", name, a->tensors[t].name,
                                      context_.workers[0].label, context_.workers[i].label));
        }
      }
      if (!first) first = a;
    }
    return json{{"lora", name},
                {"version", first->spec.version},
                {"algorithm", DigestAlgorithmName(algorithm)},
                {"checksums", std::move(sums)}};
  }();
  call.Done(r.status(), false);
  if (r.status().code() == StatusCode::kDataLoss) metrics_->VerificationFailed(ServerMetrics::Check::kReplicas);
  return r;
}

json InferenceServer::Loras() const {
  if (options_.max_loras <= 0) return nullptr;
  json adapters = json::array();
  for (const auto& a : workers_.front()->lora->List()) {
    size_t bytes = 0;
    for (const TensorMeta& t : a->tensors) bytes += t.nbytes();
    adapters.push_back(json{{"name", a->spec.name},
                            {"version", a->spec.version},
                            {"r", a->spec.r},
                            {"alpha", a->spec.alpha},
                            {"use_rslora", a->spec.use_rslora},
                            {"scaling", a->spec.scaling()},
                            {"target_modules", a->spec.target_modules},
                            {"dtype", std::string(TorchName(a->spec.dtype))},
                            {"tensors", a->tensors.size()},
                            {"bytes", bytes},
                            {"loads", a->loads}});
  }
  const bool active = session_->Look().active;
  std::lock_guard lock(mu_);
  return json{{"max_loras", options_.max_loras},
              {"policy", "refuse"},
              {"adapters", std::move(adapters)},
              {"staging", active && lora_session_ ? json{{"name", lora_session_->name}, {"version", lora_session_->version}}
                                        : json(nullptr)}};
}

Result<std::pair<uint64_t, std::string>> InferenceServer::AdapterForGeneration(const std::string& name) const {
  std::shared_ptr<const LoraAdapter> a = options_.max_loras > 0 ? workers_.front()->lora->Find(name) : nullptr;
  if (a == nullptr) return NotFound(fmt::format("LoRA adapter {} is no longer loaded", name));
  return std::make_pair(a->key, a->spec.version);
}

}  // namespace wsync
