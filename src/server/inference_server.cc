#include "server/inference_server.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "control/tensor_list.h"
#include "core/log.h"
#include "core/parallel.h"
#include "core/stopwatch.h"
#include "wsync/device_runtime.h"
#include "model/dropped_names.h"
#include "model/worker_store.h"
#include "receiver/backend_mismatch.h"
#include "receiver/row_digests.h"
#include "server/runtime_checker.h"
#include "server/inference_server_worker.h"
#include "receiver/worker_thread.h"

namespace wsync {

using nlohmann::json;

Result<std::unique_ptr<InferenceServer>> InferenceServer::Create(const InferenceServerOptions& o,
                                                                 const BackendMaker& make_backend) {
  if (o.tp < 1 || o.dp < 1) return InvalidArgument(fmt::format("--tp {} and --dp {} must be >= 1", o.tp, o.dp));
  if (o.dp_rank >= o.dp) {
    return InvalidArgument(fmt::format("--dp-rank {} must be below --dp {}", o.dp_rank, o.dp));
  }
  if (o.quantization != "none" && o.quantization != "fp8") {
    return InvalidArgument(fmt::format("--quantization {}: expected none or fp8", o.quantization));
  }
  if (o.max_loras < 0) return InvalidArgument(fmt::format("--max-loras {} must be >= 0", o.max_loras));
  if (o.speculative != "none" && o.speculative != "mtp") {
    return InvalidArgument(fmt::format("--speculative {}: expected none or mtp", o.speculative));
  }
  const Drafter drafter = o.speculative == "mtp" ? Drafter::kMtp : Drafter::kNone;
  int workers = (o.dp_rank < 0 ? o.dp : 1) * o.tp;
  if (!o.device.is_cpu()) {
    WSYNC_ASSIGN_OR_RETURN(DeviceRuntime * rt, CudaRuntimeFor(o.device));
    int count = rt->DeviceCount();
    if (o.device.index + workers > count) {
      return InvalidArgument(fmt::format(
          "--device {} with {} worker(s) needs cuda:{}..cuda:{}, but this process sees {} CUDA device(s)",
          o.device.ToString(), workers, o.device.index, o.device.index + workers - 1, count));
    }
  }
  std::unique_ptr<InferenceServer> s(new InferenceServer());
  s->options_ = o;
  WSYNC_ASSIGN_OR_RETURN(s->model_, LookupModel(o.model));
  if (drafter == Drafter::kMtp && s->model_.num_nextn_predict_layers == 0) {
    return InvalidArgument(fmt::format("--speculative mtp: model {} has no MTP layers (num_nextn_predict_layers is 0)",
                                       s->model_.name));
  }
  int first_dp = o.dp_rank < 0 ? 0 : o.dp_rank;
  int end_dp = o.dp_rank < 0 ? o.dp : o.dp_rank + 1;
  for (int dp = first_dp; dp < end_dp; ++dp) {
    for (int tp = 0; tp < o.tp; ++tp) {
      auto w = std::make_unique<Worker>();
      w->device = o.device;
      if (!o.device.is_cpu()) w->device.index += static_cast<int>(s->workers_.size());
      WSYNC_ASSIGN_OR_RETURN(w->store, WorkerStore::Create(s->model_, tp, o.tp, w->device, drafter));
      if (o.fault_corrupt_landed && s->workers_.empty()) {
        WSYNC_LOG_WARN("fault injection (--fault corrupt-landed): every landing of model.embed_tokens.weight in "
                       "dp{}/tp{} writes one wrong bit", dp, tp);
        w->store->set_fault_corrupt_landing("model.embed_tokens.weight");
      }
      if (o.quantization == "fp8") {
        // The host quantization pool of each worker shares the process's threads.
        const size_t threads = std::max<size_t>(1, DefaultThreads() / static_cast<size_t>(workers));
        Result<std::unique_ptr<Fp8WorkerSink>> fp8 = Fp8WorkerSink::Create(w->store.get(), threads);
        if (!fp8.ok()) return fp8.status().WithContext("--quantization fp8");
        w->fp8 = std::move(fp8).value();
      }
      w->lora = std::make_unique<LoraStore>();
      w->thread = std::make_unique<WorkerThread>(fmt::format("dp{}/tp{}", dp, tp));
      // Every task of the worker runs with its device current (CUDA's is per thread).
      WSYNC_RETURN_IF_ERROR(w->thread->Post([d = w->device] { return UseDeviceOnThisThread(d); }).get());
      w->dp_index = dp;
      w->tp_rank = tp;
      s->workers_.push_back(std::move(w));
    }
  }
  s->held_ = std::make_unique<StoreTensors>(s->workers_.front()->store.get());
  s->admission_ = std::make_unique<UpdateAdmission>(
      s->held_.get(), AdmissionOptions{.max_update_bytes = o.max_update_bytes, .label = "this server"});
  s->context_.model = &s->model_;
  s->context_.tp_size = o.tp;
  s->context_.timeout_seconds = o.timeout_seconds;
  s->context_.backend_config = o.backend_config;
  s->session_ = std::make_unique<ReceiverSession>(o.session_lease_seconds.value_or(o.timeout_seconds),
                                                 [] { return ReceiverSession::Clock::now(); }, o.timeout_seconds);
  s->set_url("");
  WSYNC_RETURN_IF_ERROR(s->FillWeightsAtStart());
  if (o.quantization == "fp8") {
    for (Status& st : s->OnEachWorker("quantizing the weights at start-up", [](Worker& w) { return w.fp8->QuantizeAll(); })) {
      WSYNC_RETURN_IF_ERROR(st);
    }
  }
  WSYNC_ASSIGN_OR_RETURN(s->backend_, make_backend(o.backend, &s->context_));
  s->metrics_ = std::make_unique<ServerMetrics>(std::string(s->backend_->name()), s->model_.name);
  WSYNC_RETURN_IF_ERROR(s->CreateGenerator());
  s->watchdog_ = std::thread([p = s.get()] { p->WatchSessions(); });
  return s;
}

InferenceServer::~InferenceServer() {
  if (generator_) generator_->Shutdown();
  {
    std::lock_guard lock(mu_);
    shutting_down_ = true;
  }
  shutdown_cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  if (backend_) backend_->Shutdown();
}

void InferenceServer::WatchSessions() {
  std::unique_lock lock(mu_);
  while (!shutting_down_) {
    shutdown_cv_.wait_for(lock, std::chrono::seconds(1));
    if (shutting_down_) break;
    lock.unlock();
    if (session_->ExpireIfIdle()) ResumeAfterLostTrainer("its session expired");
    lock.lock();
  }
}

void InferenceServer::ResumeAfterLostTrainer(const char* why) {
  if (!IsPaused()) return;
  Status s = Resume();
  if (s.ok()) {
    WSYNC_LOG_WARN("generation was paused by a trainer that is gone ({}): resumed", why);
  } else {
    WSYNC_LOG_WARN("generation was paused by a trainer that is gone ({}), and resuming failed: {}", why,
                   s.ToString());
  }
}

void InferenceServer::set_url(const std::string& url) {
  context_.server_url = url;
  context_.workers.clear();
  for (auto& w : workers_) {
    context_.workers.push_back(ReceiverWorker{
        w->sink(), w->thread.get(), w->dp_index, w->tp_rank, w->device,
        fmt::format("{} worker dp{}/tp{}", url.empty() ? "server" : url, w->dp_index, w->tp_rank)});
  }
}


Status InferenceServer::Measured(WeightOperation op, const std::function<Status()>& call) {
  Status s = metrics_->Measure(op, call);
  if (s.code() == StatusCode::kDataLoss) metrics_->VerificationFailed(ServerMetrics::Check::kData);
  return s;
}

Status InferenceServer::InitWeightTransfer(const json& init_info, const std::string& peer_address) {
  return Measured(WeightOperation::kInit, [&] { return InitNow(init_info, peer_address); });
}

Status InferenceServer::ShutdownWeightTransfer() {
  // vLLM's Worker.shutdown_weight_transfer_engine refuses inside a session in these words.
  if (session_->Look().active) return FailedPrecondition("Cannot release a trainer connection during a weight update");
  WSYNC_ASSIGN_OR_RETURN(ReceiverSession::Call call, session_->BeginExclusive("shutdown_weight_transfer_engine"));
  Status s = CatchAll("shutdown_weight_transfer_engine", [&] {
    backend_->Shutdown();
    return Status::Ok();
  });
  call.Done(s, false);
  if (s.ok()) WSYNC_LOG_INFO("shutdown_weight_transfer_engine: the data plane is released until the next init");
  return s;
}

Status InferenceServer::UpdateWeights(std::shared_ptr<const json> update_info) {
  return Measured(WeightOperation::kUpdate, [&] { return UpdateNow(std::move(update_info)); });
}

Status InferenceServer::FinishWeightUpdate(const std::optional<std::string>& weight_version) {
  return Measured(WeightOperation::kFinish, [&] { return FinishNow(weight_version); });
}

Result<json> InferenceServer::FinishWeightUpdateVerified(const std::optional<std::string>& weight_version,
                                                         const json& digests, std::string_view algorithm) {
  json verified;
  // Not Measured(): a DataLoss here is the in-line check's, not a payload's.
  Status s = metrics_->Measure(WeightOperation::kFinish,
                               [&] { return FinishNow(weight_version, &digests, algorithm, &verified); });
  if (s.code() == StatusCode::kDataLoss) metrics_->VerificationFailed(ServerMetrics::Check::kInline);
  WSYNC_RETURN_IF_ERROR(s);
  return json{{"verified", std::move(verified)}};
}

std::string_view InferenceServer::InlineVerification() const {
  return options_.quantization == "none" ? DigestAlgorithmName(DigestAlgorithm::kXxh3_128) : std::string_view();
}

Status InferenceServer::VerifyInline(const json& digests, std::string_view algorithm_name, json* verified) {
  if (InlineVerification().empty() || algorithm_name != InlineVerification()) {
    return InvalidArgument(fmt::format("digest_algorithm '{}': this server verifies in-line with '{}' only",
                                       algorithm_name, InlineVerification().empty() ? "none" : InlineVerification()));
  }
  const DigestAlgorithm algorithm = DigestAlgorithm::kXxh3_128;
  const ShardingTable& table = workers_.front()->store->table();
  // Names the server drops (model/dropped_names.h: a rotary buffer per layer, MTP copies,
  // a tied head) come on top of the model's own tensors, at most one or two per layer.
  if (digests.size() > 2 * table.hf_tensors().size() + 16) {
    return InvalidArgument(fmt::format("wsync_digests names {} tensors; model {} has {}", digests.size(),
                                       model_.name, table.hf_tensors().size()));
  }
  std::map<std::string_view, const TensorMeta*> by_name;
  for (const TensorMeta& m : table.hf_tensors()) by_name.emplace(m.name, &m);
  std::vector<TensorMeta> check;
  std::vector<std::string> want;
  // Tensors the trainer digested by row ranges (no trainer rank held them whole): their
  // ranges, compared joined (ranges ascending, digests joined by ',').
  std::map<std::string, std::vector<std::pair<int64_t, int64_t>>> row_ranges;
  json unverifiable = json::object();
  for (const auto& [name, hex] : digests.items()) {
    auto it = by_name.find(name);
    std::string expected;
    std::vector<std::pair<int64_t, int64_t>> ranges;
    if (hex.is_object()) {
      // A name outside the model is named unverifiable below, its ranges unread.
      if (it != by_name.end()) {
        const std::vector<int64_t>& shape = it->second->shape;
        WSYNC_ASSIGN_OR_RETURN(RowDigests rows, ParseRowDigests(hex, name, shape.empty() ? 0 : shape[0]));
        ranges = std::move(rows.ranges);
        expected = std::move(rows.joined);
      }
    } else if (hex.is_string() && hex.get_ref<const std::string&>().size() <= kMaxDigestHexBytes) {
      expected = hex.get<std::string>();
    } else {
      return InvalidArgument(fmt::format("wsync_digests[{}] must be a hex string or {{\"rows\": [[begin, end, hex], "
                                         "...]}}", name.substr(0, 200)));
    }
    if (it == by_name.end()) {
      std::string_view dropped = DroppedNameReason(name, model_);
      unverifiable[name.substr(0, 200)] = dropped.empty() ? fmt::format("not a tensor of model {}", model_.name)
                                                          : fmt::format("dropped: {}", dropped);
    } else if (!table.Serves(name)) {
      unverifiable[name] = "not held by this server";
    } else {
      check.push_back(*it->second);
      want.push_back(std::move(expected));
      if (!ranges.empty()) row_ranges.emplace(name, std::move(ranges));
    }
  }
  const size_t threads = options_.digest_threads ? options_.digest_threads : DefaultThreads();
  std::vector<std::string> differ;
  size_t differing = 0;
  size_t at_landing = 0;  // (replica, tensor) digests taken as the bytes landed
  for (size_t begin = 0; begin < workers_.size(); begin += options_.tp) {
    std::vector<const WorkerStore*> group;
    for (int t = 0; t < options_.tp; ++t) group.push_back(workers_[begin + t]->store.get());
    const std::string replica = fmt::format("{} dp replica {}", context_.server_url.empty() ? "server"
                                                                                           : context_.server_url,
                                            workers_[begin]->dp_index);
    Status replicas = CheckReplicas(group);
    if (!replicas.ok()) return replicas.WithContext(fmt::format("in-line verification on {}", replica));
    // What a worker hashed as it landed (WorkerStore::LandedDigest); the rest (tensors
    // split across the TP group, tensors this session did not land) read at finish.
    std::vector<TensorMeta> at_finish;
    std::map<std::string, std::string> sums;
    // What the group digested as it came whole (GroupLandingDigests), if this session
    // tracked it: whole, or by the row ranges the backend announced.
    const size_t g = begin / options_.tp;
    std::map<std::string, GroupLandingDigests::Digest> group_sums;
    if (g < group_landing_.size() && group_landing_[g] && group.front()->group_landing() == group_landing_[g].get()) {
      group_sums = group_landing_[g]->Digests();
    }
    for (const TensorMeta& m : check) {
      auto rows = row_ranges.find(m.name);
      const GroupLandingDigests::RowRanges whole;
      const GroupLandingDigests::RowRanges& want_ranges = rows == row_ranges.end() ? whole : rows->second;
      std::optional<std::string> landed;
      // A worker's landing digest is of the whole tensor.
      for (size_t t = 0; t < group.size() && !landed && want_ranges.empty(); ++t) landed = group[t]->LandedDigest(m.name);
      if (!landed) {
        auto it = group_sums.find(m.name);
        if (it != group_sums.end() && it->second.ranges == want_ranges) landed = it->second.hex;
      }
      if (landed) {
        sums.emplace(m.name, std::move(*landed));
      } else {
        at_finish.push_back(m);
      }
    }
    const size_t landed = check.size() - at_finish.size();
    at_landing += landed;
    // A device group's tensors held in contiguous runs are digested on the device.
    Stopwatch device_watch;
    size_t on_device_count = 0;
    if (!group.front()->device().is_cpu() && !at_finish.empty()) {
      WSYNC_ASSIGN_OR_RETURN(auto on_device, DeviceHeldDigests(group, at_finish, row_ranges));
      std::erase_if(at_finish, [&](const TensorMeta& m) { return on_device.contains(m.name); });
      on_device_count = on_device.size();
      sums.merge(on_device);
    }
    const double device_ms = device_watch.milliseconds();
    Stopwatch read_watch;
    WSYNC_ASSIGN_OR_RETURN(auto read, DigestEach(at_finish, threads, [&](const TensorMeta& m,
                                                                         std::vector<std::byte>* scratch) {
                             auto rows = row_ranges.find(m.name);
                             if (rows == row_ranges.end()) return HfDigest(group, m.name, algorithm);
                             return HfRangesDigest(group, m.name, rows->second, algorithm, scratch);
                           }));
    sums.merge(read);
    WSYNC_LOG_DEBUG("in-line verification of {}: {} tensor(s) hashed at landing, {} digested on the device in "
                    "{:.1f} ms, {} read back in {:.1f} ms", replica, landed,
                    on_device_count, device_ms, at_finish.size(), read_watch.milliseconds());
    for (size_t i = 0; i < check.size(); ++i) {
      const std::string& held = sums.at(check[i].name);
      if (held == want[i]) continue;
      ++differing;
      if (differ.size() < 5) {
        differ.push_back(fmt::format("{} ({} holds {}, the trainer read {})", check[i].name, replica, held,
                                     want[i].substr(0, 64)));
      }
    }
  }
  if (differing > 0) {
    return DataLoss(fmt::format("in-line verification: {} tensor(s) held differ from the trainer's {} digests: {}{}",
                                differing, algorithm_name, fmt::join(differ, "; "),
                                differing > differ.size() ? "; ..." : ""));
  }
  *verified = json{{"tensors", check.size()},
                   {"algorithm", algorithm_name},
                   {"unverifiable", std::move(unverifiable)},
                   {"hashed_at_landing", at_landing}};
  return Status::Ok();
}

Status InferenceServer::InitNow(const json& init_info, const std::string& peer_address) {
  bool took_over = false;
  WSYNC_ASSIGN_OR_RETURN(ReceiverSession::Call call, session_->BeginInit(peer_address, &took_over));
  // A dead trainer's pause ends with its session.
  if (took_over) ResumeAfterLostTrainer("its session was taken over by a new trainer's init");
  EndLoraSession();
  // Another backend's init_info is named as such before this backend's parser sees it.
  if (Status mismatch = CheckInitInfoBackend(backend_->name(), init_info); !mismatch.ok()) {
    WSYNC_LOG_WARN("init_weight_transfer_engine refused: {}", mismatch.message());
    call.Done(mismatch, false);
    return mismatch;
  }
  if (options_.fault_never_join) {
    double timeout = options_.timeout_seconds;
    if (auto it = init_info.find("timeout_seconds"); it != init_info.end() && it->is_number()) {
      timeout = std::min(timeout, it->get<double>());
    }
    std::unique_lock lock(mu_);
    shutdown_cv_.wait_for(lock, std::chrono::duration<double>(timeout), [&] { return shutting_down_; });
    Status s = DeadlineExceeded(fmt::format(
        "fault injection (--fault never-join): this server's workers never joined the data plane "
        "and gave up after {} s", timeout));
    call.Done(s);
    return s;
  }
  Status s = CatchAll("init_weight_transfer_engine",
                      [&] { return backend_->InitFromPeer(init_info, peer_address); });
  call.Done(s);
  if (!s.ok()) WSYNC_LOG_WARN("init_weight_transfer_engine failed: {}", s.ToString());
  return s;
}

Status InferenceServer::StartWeightUpdate() {
  return Measured(WeightOperation::kStart, [&] { return StartSession(/*draft=*/false); });
}

Status InferenceServer::StartWeightUpdateInlineVerified() {
  return Measured(WeightOperation::kStart, [&] { return StartSession(/*draft=*/false, /*inline_verify=*/true); });
}

Status InferenceServer::StartDraftWeightUpdate() {
  return Measured(WeightOperation::kStartDraft, [&] {
    if (options_.speculative == "none") {
      return InvalidArgument("this server has no draft model (start it with --speculative mtp)");
    }
    return StartSession(/*draft=*/true);
  });
}

Status InferenceServer::StartSession(bool draft, bool inline_verify) {
  auto no_generation_step = ExcludeGeneration();
  Status s = session_->Start([&] { return CatchAll("start_weight_update", [&] { return backend_->Start(); }); });
  if (s.ok()) {
    EndLoraSession();
    // Landing digests: what a host worker lands in this session is hashed as it lands.
    const bool hash = inline_verify && !InlineVerification().empty();
    (void)OnEachWorker("starting an update's landing digests", [hash](Worker& w) {
      w.store->BeginLandingDigests(hash);
      w.store->set_group_landing(nullptr);
      return Status::Ok();
    });
    // Tensors split across a TP group of host stores, or landed as slices, are digested
    // as soon as the group holds them whole, beside the landings of later chunks.
    const bool on_host = std::ranges::all_of(workers_, [](const auto& w) { return w->device.is_cpu(); });
    if (hash && (options_.tp > 1 || backend_->LandsSlices()) && on_host) {
      group_landing_.resize(workers_.size() / options_.tp);
      const auto row_ranges = backend_->RowDigestRanges();
      const size_t threads = std::max<size_t>(1, DefaultThreads() / 2);
      for (size_t g = 0; g < group_landing_.size(); ++g) {
        std::vector<const WorkerStore*> group;
        for (int t = 0; t < options_.tp; ++t) group.push_back(workers_[g * options_.tp + t]->store.get());
        if (!group_landing_[g]) group_landing_[g] = std::make_unique<GroupLandingDigests>(group, threads);
        group_landing_[g]->Begin(row_ranges);
        for (int t = 0; t < options_.tp; ++t) workers_[g * options_.tp + t]->store->set_group_landing(group_landing_[g].get());
      }
    }
    // Marks of an update that failed before its finish are forgotten.
    if (options_.quantization == "fp8" || options_.speculative != "none") {
      (void)OnEachWorker("starting an update's layer tracking", [](Worker& w) {
        if (w.fp8) w.fp8->BeginUpdate();
        w.store->BeginDrafterUpdate();
        return Status::Ok();
      });
    }
    std::lock_guard lock(mu_);
    sync_window_.emplace();
    draft_session_ = draft;
  }
  return s;
}

Status InferenceServer::UpdateNow(std::shared_ptr<const json> update_info) {
  if (update_info == nullptr) return InvalidArgument("update_info is missing");
  static const auto kNoTensors = std::make_shared<const std::vector<TensorMeta>>();
  static const auto kNoInfo = std::make_shared<const json>(json::object());
  UpdateRequest req;
  WSYNC_ASSIGN_OR_RETURN(ReceiverSession::Call call, session_->BeginUpdate(&req.reject));
  if (update_info->is_array()) {
    // A refused list goes the way of any refused payload: the backend votes no, the
    // session ends.
    std::vector<int> ranks;
    for (const auto& w : workers_) ranks.push_back(w->dp_index * options_.tp + w->tp_rank);
    Result<std::shared_ptr<const json>> mine = SelectUpdateInfo(update_info, WorldSize(true), ranks);
    if (mine.ok()) {
      update_info = std::move(*mine);
    } else {
      if (req.reject.ok()) req.reject = mine.status();
      update_info = kNoInfo;
    }
  }
  req.update_info = update_info;
  req.tensors = kNoTensors;
  const bool lora = InLoraSession();
  req.lora = lora;
  Status s = CatchAll("update_weights", [&]() -> Status {
    if (req.reject.ok() && lora) {
      AdmittedUpdate admitted = AdmitLora(update_info);
      req.update_info = std::move(admitted.update_info);
      req.tensors = std::move(admitted.tensors);
      req.reject = std::move(admitted.reject);
    } else if (req.reject.ok()) {
      AdmittedUpdate admitted = admission_->Admit(update_info, !backend_->ParsesOwnUpdateInfo());
      req.update_info = std::move(admitted.update_info);
      req.tensors = std::move(admitted.tensors);
      req.reject = std::move(admitted.reject);
      // A draft session carries the drafter's tensors only, however the list was checked.
      bool draft;
      {
        std::lock_guard lock(mu_);
        draft = draft_session_;
      }
      for (size_t i = 0; draft && req.reject.ok() && i < req.tensors->size(); ++i) {
        const std::string& name = (*req.tensors)[i].name;
        // A dropped name (model/dropped_names.h) lands nothing, in any session.
        const bool dropped =
            workers_.front()->store->table().FindHf(name) < 0 && !DroppedNameReason(name, model_).empty();
        if (!dropped && MtpLayerOf(model_, name) < 0) {
          req.reject = InvalidArgument(fmt::format(
              "draft session: tensor {} (update_info entry {}) is not one of the MTP drafter's; the target's "
              "tensors go in a /start_weight_update session",
              name, i));
        }
      }
    }
    return backend_->Update(req);
  });
  // Bytes may have landed before a data-phase failure: say so until a sync completes.
  // A lora session's bytes land in the adapter's staging, never in the weights.
  call.Done(s, !lora && req.reject.ok() && ReceiverSession::MayHaveLanded(s));
  if (!s.ok()) WSYNC_LOG_WARN("update_weights failed: {}", s.ToString());
  if (s.ok() && !req.tensors->empty()) {
    uint64_t bytes = 0;
    for (const TensorMeta& t : *req.tensors) bytes += t.nbytes();
    metrics_->AddReceived(req.tensors->size(), bytes);
  }
  return s;
}

Status InferenceServer::FinishNow(const std::optional<std::string>& weight_version, const json* digests,
                                  std::string_view algorithm, json* verified) {
  WSYNC_ASSIGN_OR_RETURN(ReceiverSession::Call call, session_->BeginFinish());
  if (InLoraSession()) {
    Status s = FinishLora(weight_version, digests, algorithm, verified);
    if (s.ok()) {
      std::lock_guard lock(mu_);
      sync_window_.reset();
    }
    call.Done(s, false);
    return s;
  }
  Status s = CatchAll("finish_weight_update", [&] { return backend_->Finish(); });
  if (s.ok() && digests != nullptr) {
    s = CatchAll("finish_weight_update", [&] { return VerifyInline(*digests, algorithm, verified); });
  }
  if (options_.quantization == "fp8") {
    // Every layer the update touched must have landed whole and been quantized; the
    // quantization in flight is waited for either way.
    for (Status& q : OnEachWorker("finishing fp8 quantization", [](Worker& w) { return w.fp8->FinishUpdate(); })) {
      if (s.ok() && !q.ok()) s = q;
    }
  }
  // --speculative mtp: a drafter layer the update touched must have landed whole.
  std::atomic<bool> all_whole{options_.speculative != "none"};
  if (all_whole) {
    for (Status& q : OnEachWorker("checking the drafter's layers", [&](Worker& w) -> Status {
           WSYNC_ASSIGN_OR_RETURN(bool whole, w.store->FinishDrafterUpdate());
           if (!whole) all_whole = false;
           return Status::Ok();
         })) {
      if (s.ok() && !q.ok()) s = q;
    }
  }
  const bool drafter_whole = all_whole;
  bool draft;
  {
    std::lock_guard lock(mu_);
    draft = draft_session_;
    draft_session_ = false;
  }
  if (s.ok() && draft && !drafter_whole) {
    s = FailedPrecondition("draft session: finish_weight_update before every MTP drafter layer landed");
  }
  if (!s.ok()) WSYNC_LOG_WARN("finish_weight_update failed: {}", s.ToString());
  if (s.ok()) {
    std::lock_guard lock(mu_);
    if (weight_version && !draft) weight_version_ = *weight_version;
    if (drafter_whole) {
      drafter_version_ = weight_version ? *weight_version : weight_version_;
      ++drafter_reloads_;
    } else if (options_.speculative != "none") {
      WSYNC_LOG_WARN("sync finished without the MTP drafter's layers: the drafter still holds weight version '{}'",
                     drafter_version_);
    }
    if (draft) {
      sync_window_.reset();
      WSYNC_LOG_INFO("draft session finished: the MTP drafter holds weight version '{}'", drafter_version_);
      call.Done(s);
      return s;
    }
    ++syncs_;
    if (sync_window_) {
      last_sync_memory_ = sync_window_->Peak();
      sync_window_.reset();
      WSYNC_LOG_INFO("sync {} finished (weight version {}): peak extra memory host {:.1f} MB, device {:.1f} MB",
                     syncs_, weight_version_, last_sync_memory_->host_bytes / 1e6,
                     last_sync_memory_->device_bytes / 1e6);
    }
  }
  call.Done(s);
  return s;
}

Result<json> InferenceServer::FetchWeights(const json& body) {
  WSYNC_ASSIGN_OR_RETURN(ReceiverSession::Call call, session_->BeginExclusive("fetch_weights"));
  Result<json> r = CatchAll("fetch_weights", [&] { return backend_->Fetch(body); });
  call.Done(r.status());
  if (r.status().code() == StatusCode::kDataLoss) metrics_->VerificationFailed(ServerMetrics::Check::kData);
  return r;
}

int InferenceServer::WorldSize(bool include_dp) const {
  return include_dp ? options_.tp * options_.dp : options_.tp;
}

std::string InferenceServer::WeightVersion() const {
  std::lock_guard lock(mu_);
  return weight_version_;
}

void InferenceServer::SetWeightVersion(std::string version) {
  std::lock_guard lock(mu_);
  weight_version_ = std::move(version);
}

Result<std::map<std::string, std::string>> InferenceServer::Checksums(DigestAlgorithm algorithm) {
  WSYNC_ASSIGN_OR_RETURN(ReceiverSession::Call call,
                         session_->BeginExclusive("weight_checker", /*refuse_in_session=*/true));
  WSYNC_RETURN_IF_ERROR(CheckWeightsReadable("weight_checker"));
  const MemoryWindow window;
  auto r = CatchAll("weight_checker", [&] { return ChecksumsHeld(algorithm); });
  if (r.status().code() == StatusCode::kDataLoss) metrics_->VerificationFailed(ServerMetrics::Check::kReplicas);
  {
    std::lock_guard lock(mu_);
    last_checksum_memory_ = window.Peak();
  }
  call.Done(r.status(), false);
  return r;
}

std::vector<std::string> InferenceServer::TensorsNotHeld() const {
  std::vector<std::string> out;
  if (workers_.empty()) return out;
  const ShardingTable& table = workers_.front()->store->table();
  for (const TensorMeta& m : table.hf_tensors()) {
    if (!table.Serves(m.name)) out.push_back(m.name);
  }
  return out;
}

void InferenceServer::SettleFp8() {
  if (options_.quantization != "fp8") return;
  (void)OnEachWorker("settling fp8 quantization", [](Worker& w) {
    w.fp8->Settle();
    return Status::Ok();
  });
}

Result<std::map<std::string, std::string>> InferenceServer::ChecksumsHeld(DigestAlgorithm algorithm) {
  SettleFp8();  // nothing writes the fp8 weights while they are read
  size_t threads = options_.digest_threads ? options_.digest_threads : DefaultThreads();
  std::map<std::string, std::string> first;
  int first_dp = -1;
  for (size_t begin = 0; begin < workers_.size(); begin += options_.tp) {
    // CUDA shards are read back in bounded blocks as they are hashed (worker_store.h).
    std::vector<const WorkerStore*> group;
    for (int t = 0; t < options_.tp; ++t) group.push_back(workers_[begin + t]->store.get());
    int dp = workers_[begin]->dp_index;
    Status replicas = CheckReplicas(group);
    if (!replicas.ok()) return replicas.WithContext(fmt::format("dp replica {}", dp));
    std::map<std::string, std::string> sums;
    if (options_.quantization == "fp8") {
      std::vector<const Fp8WorkerSink*> fp8;
      for (int t = 0; t < options_.tp; ++t) fp8.push_back(workers_[begin + t]->fp8.get());
      WSYNC_ASSIGN_OR_RETURN(sums, AllFp8HfDigests(fp8, algorithm, threads));
    } else {
      WSYNC_ASSIGN_OR_RETURN(sums, AllHfDigests(group, algorithm, threads));
    }
    if (first_dp < 0) {
      first = std::move(sums);
      first_dp = dp;
      continue;
    }
    for (const auto& [name, hex] : sums) {
      if (first[name] != hex) {
        return DataLoss(fmt::format("{} differs between dp replica {} and dp replica {}", name,
                                    first_dp, dp));
      }
    }
  }
  return first;
}

// ---- Generation: what its probe reads (inference_server_generation.cc) ----
const WorkerStore& InferenceServer::GenerationStore(size_t worker) const { return *workers_[worker]->store; }
WorkerThread& InferenceServer::GenerationThread(size_t worker) const { return *workers_[worker]->thread; }

json InferenceServer::Health() const {
  ReceiverSession::Snapshot session = session_->Look();
  json generation = generator_->Health();
  json memory = Memory();
  json speculative = Speculative();
  json lora = Loras();
  std::lock_guard lock(mu_);
  json out{{"status", "ok"},          {"server", "wsync"},
              {"model", model_.name},    {"backend", std::string(backend_->name())},
              {"tp", options_.tp},       {"dp", options_.dp},
              {"dp_rank", options_.dp_rank},
              {"device", options_.device.ToString()},
              {"quantization", options_.quantization},
              {"speculative", speculative},
              {"lora", lora},
              {"weight_version", weight_version_},
              {"syncs", syncs_},
              {"weights_consistent", session.consistent},
              {"inline_verification", InlineVerification().empty() ? json(nullptr) : json(InlineVerification())},
              {"session_active", session.active},
              {"expired_sessions", session.expired_sessions},
              {"taken_over_sessions", session.taken_over_sessions}};
  auto peak = [](const std::optional<MemoryPeak>& p) -> json {
    if (!p) return nullptr;
    return json{{"host_peak_extra_bytes", p->host_bytes},
                {"device_peak_extra_bytes", p->device_bytes},
                {"host_exact", p->host_exact}};
  };
  memory["last_sync"] = peak(last_sync_memory_);
  memory["last_checksum"] = peak(last_checksum_memory_);
  out["generation"] = std::move(generation);
  out["memory"] = std::move(memory);
  return out;
}

json InferenceServer::Speculative() const {
  if (options_.speculative == "none") return nullptr;
  // The first replica's workers: what the drafter holds of its own, and the target
  // memory its aliases read (the same address as the target parameter, or a copy).
  size_t own_bytes = 0, own_params = 0;
  json aliases = json::array();
  for (int t = 0; t < options_.tp && t < static_cast<int>(workers_.size()); ++t) {
    const WorkerStore& store = *workers_[t]->store;
    for (const WorkerStore::DrafterParam& p : store.drafter_params()) {
      if (p.shares < 0) {
        own_bytes += p.bytes;
        if (t == 0) ++own_params;
        continue;
      }
      if (t != 0) continue;
      aliases.push_back(json{{"drafter", p.name},
                             {"target", store.table().params()[p.shares].meta.name},
                             {"same_memory", p.data == store.param_data(static_cast<size_t>(p.shares))},
                             {"bytes", p.bytes}});
    }
  }
  std::vector<int64_t> layers;
  for (int64_t l = model_.num_hidden_layers; l < model_.total_layers(); ++l) layers.push_back(l);
  std::lock_guard lock(mu_);
  return json{{"method", options_.speculative},
              {"layers", layers},
              {"own_parameters", own_params},
              {"own_bytes", own_bytes},
              {"shared_with_target", std::move(aliases)},
              {"weight_version", drafter_version_.empty() ? json(nullptr) : json(drafter_version_)},
              {"reloads", drafter_reloads_},
              {"stale", drafter_version_ != weight_version_}};
}

// --- vLLM's runtime weight checker (conf) ---

Result<json> InferenceServer::CheckRuntimeWeights(std::string_view action, const json* baseline) {
  // Paused is fine (nothing changes the weights outside a session, which BeginExclusive
  // refuses); asleep is not: the weights are offloaded or gone.
  if (IsSleeping()) {
    return FailedPrecondition(fmt::format("weight_checker '{}': the engine is sleeping (POST /wake_up first); "
                                          "its weights are not resident", action));
  }
  WSYNC_ASSIGN_OR_RETURN(ReceiverSession::Call call,
                         session_->BeginExclusive("weight_checker", /*refuse_in_session=*/true));
  const MemoryWindow window;
  Result<json> r = CatchAll("weight_checker", [&] { return CheckRuntimeWeightsHeld(action, baseline); });
  {
    std::lock_guard lock(mu_);
    last_checksum_memory_ = window.Peak();
  }
  call.Done(r.status(), false);
  return r;
}

Result<json> InferenceServer::CheckRuntimeWeightsHeld(std::string_view action, const json* baseline) {
  const size_t threads = options_.digest_threads ? options_.digest_threads : DefaultThreads();
  SettleFp8();
  std::vector<RuntimeWorker> workers;
  for (const auto& w : workers_) workers.push_back({w->store.get(), w->dp_index, w->tp_rank, w->fp8.get()});
  if (action == "reset") {
    uint64_t seed;
    {
      std::lock_guard lock(mu_);
      seed = 0x5EED0000ull + ++runtime_resets_;
    }
    // Marked first: a reset that fails half-way has changed weights too. No generation
    // step reads them meanwhile.
    std::unique_lock<std::shared_mutex> no_readers = ExcludeGeneration();
    session_->MarkOverwritten("weight_checker 'reset' overwrote the runtime parameters with random values");
    WSYNC_RETURN_IF_ERROR(RandomizeRuntimeParams(workers, seed, threads));
    WSYNC_LOG_INFO("weight_checker: reset every runtime parameter of {} worker(s) to random values", workers.size());
    return json{{"status", "reset"}};
  }
  if (action != "checksum" && action != "compare") {
    return InvalidArgument(fmt::format("unknown weight_checker action '{}' (checksum, reset or compare)", action));
  }
  if (action == "compare" && baseline == nullptr) {
    return InvalidArgument("action='compare' requires a 'baseline' object");
  }
  WSYNC_ASSIGN_OR_RETURN(auto sums, RuntimeParamDigests(workers, threads));
  if (action == "checksum") {
    // One object per DP engine, as vLLM lists its engines.
    std::map<int, json> by_dp;
    for (const RuntimeWorker& w : workers) {
      json& engine = by_dp.try_emplace(w.dp_rank, json::object()).first->second;
      for (const std::string& name : RuntimeParamNames(w)) {
        std::string key = RuntimeParamKey(w.dp_rank, w.tp_rank, name);
        engine[key] = sums.at(key);
      }
    }
    json engines = json::array();
    for (auto& [dp, engine] : by_dp) engines.push_back(std::move(engine));
    return json{{"checksums", sums}, {"engines", std::move(engines)}};
  }
  std::vector<std::string> mismatches = DigestMismatches(sums, *baseline);
  if (!mismatches.empty()) metrics_->VerificationFailed(ServerMetrics::Check::kCompare);
  return json{{"match", mismatches.empty()}, {"mismatches", mismatches}};
}

Result<std::string> InferenceServer::Metrics() const {
  ServerMetrics::State state;
  state.session = session_->Look();
  json generation = generator_->Health();
  state.paused = generation.value("paused", false);
  state.requests_running = generation.value("running", int64_t{0});
  state.requests_waiting = generation.value("waiting", int64_t{0});
  state.weight_version = WeightVersion();
  return metrics_->Text(state);
}

}  // namespace wsync
