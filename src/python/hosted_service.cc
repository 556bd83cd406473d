#include "python/hosted_service.h"

#include <chrono>
#include <condition_variable>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "control/routes.h"
#include "control/tensor_list.h"
#include "core/log.h"

namespace wsync {

using nlohmann::json;

HostedService::HostedService(HostedServiceOptions options, std::vector<HostedWorker> workers)
    : options_(std::move(options)),
      workers_(std::move(workers)),
      session_(options_.session_lease_seconds.value_or(options_.timeout_seconds),
               [] { return ReceiverSession::Clock::now(); }, options_.timeout_seconds) {}

Status HostedService::OnEveryWorker(const char* what, std::vector<std::function<Status()>> tasks) const {
  // Shared with the tasks' threads, which may outlive this call (see the class comment).
  struct Fanout {
    std::mutex mu;
    std::condition_variable done_cv;
    size_t left = 0;             // GUARDED_BY(mu)
    std::vector<Status> out;     // GUARDED_BY(mu)
    std::vector<bool> finished;  // GUARDED_BY(mu)
  };
  auto fanout = std::make_shared<Fanout>();
  fanout->left = tasks.size();
  fanout->out.resize(tasks.size());
  fanout->finished.resize(tasks.size());
  for (size_t i = 0; i < tasks.size(); ++i) {
    std::thread([fanout, i, task = std::move(tasks[i])]() mutable {
      Status s;
      try {
        s = task();
      } catch (const std::exception& e) {
        s = Internal(fmt::format("worker {} failed: {}", i, e.what()));
      }
      // What the task holds (a worker's Python objects) goes before the caller may
      // return: past that, this thread can outlive the service and the interpreter.
      task = nullptr;
      std::lock_guard lock(fanout->mu);
      fanout->out[i] = std::move(s);
      fanout->finished[i] = true;
      if (--fanout->left == 0) fanout->done_cv.notify_all();
    }).detach();
  }
  const double bound = options_.timeout_seconds + 30;
  std::unique_lock lock(fanout->mu);
  if (!fanout->done_cv.wait_for(lock, std::chrono::duration<double>(bound), [&] { return fanout->left == 0; })) {
    for (size_t i = 0; i < fanout->finished.size(); ++i) {
      if (!fanout->finished[i]) {
        return DeadlineExceeded(fmt::format("{}: worker {} did not finish within {:.0f} s", what, i, bound));
      }
    }
  }
  for (Status& s : fanout->out) {
    if (!s.ok()) return s;
  }
  return Status::Ok();
}

Status HostedService::InitWeightTransfer(const json& init_info, const std::string& peer_address) {
  bool took_over = false;
  WSYNC_ASSIGN_OR_RETURN(ReceiverSession::Call call, session_.BeginInit(peer_address, &took_over));
  auto info = std::make_shared<const json>(init_info);
  std::vector<std::function<Status()>> tasks;
  for (const HostedWorker& w : workers_) tasks.push_back([f = w.init, info, peer_address] { return f(*info, peer_address); });
  Status s = OnEveryWorker("init_weight_transfer_engine", std::move(tasks));
  call.Done(s);
  if (!s.ok()) WSYNC_LOG_WARN("init_weight_transfer_engine failed: {}", s.ToString());
  return s;
}

Status HostedService::ShutdownWeightTransfer() {
  // vLLM's Worker.shutdown_weight_transfer_engine refuses inside a session in these words.
  if (session_.Look().active) return FailedPrecondition("Cannot release a trainer connection during a weight update");
  WSYNC_ASSIGN_OR_RETURN(ReceiverSession::Call call, session_.BeginExclusive("shutdown_weight_transfer_engine"));
  std::vector<std::function<Status()>> tasks;
  for (const HostedWorker& w : workers_) tasks.push_back(w.shutdown);
  Status s = OnEveryWorker("shutdown_weight_transfer_engine", std::move(tasks));
  call.Done(s, false);
  return s;
}

Status HostedService::StartWeightUpdate() { return session_.Start(); }

Status HostedService::UpdateWeights(std::shared_ptr<const json> update_info) {
  if (update_info == nullptr) return InvalidArgument("update_info is missing");
  Status outside;
  WSYNC_ASSIGN_OR_RETURN(ReceiverSession::Call call, session_.BeginUpdate(&outside));
  if (!outside.ok()) {
    call.Done(outside, false);
    return outside;
  }
  // vLLM's list form: worker i takes entry i (each worker is its own engine, so entries
  // may differ); SelectUpdateInfo checks the list against the world size.
  const int n = static_cast<int>(workers_.size());
  if (Result<std::shared_ptr<const json>> checked = SelectUpdateInfo(update_info, n, {0}); !checked.ok()) {
    call.Done(checked.status(), false);
    return checked.status();
  }
  std::vector<std::function<Status()>> tasks;
  for (int i = 0; i < n; ++i) {
    const json* mine = update_info->is_array() ? &(*update_info)[static_cast<size_t>(i)] : update_info.get();
    tasks.push_back([f = workers_[i].receive, update_info, mine] { return f(*mine); });
  }
  Status s = OnEveryWorker("update_weights", std::move(tasks));
  // Refusals (a bad tensor list, the wrong state) land nothing.
  const bool refused = s.code() == StatusCode::kInvalidArgument || s.code() == StatusCode::kFailedPrecondition ||
                       s.code() == StatusCode::kAborted;
  call.Done(s, !refused);
  if (!s.ok()) WSYNC_LOG_WARN("update_weights failed: {}", s.ToString());
  return s;
}

Status HostedService::FinishWeightUpdate(const std::optional<std::string>& weight_version) {
  WSYNC_ASSIGN_OR_RETURN(ReceiverSession::Call call, session_.BeginFinish());
  {
    std::lock_guard lock(mu_);
    if (weight_version) weight_version_ = *weight_version;
    ++syncs_;
  }
  call.Done(Status::Ok());
  return Status::Ok();
}

Result<json> HostedService::FetchWeights(const json& body) {
  WSYNC_ASSIGN_OR_RETURN(ReceiverSession::Call call, session_.BeginExclusive("fetch_weights"));
  auto request = std::make_shared<const json>(body);
  auto replies = std::make_shared<std::vector<json>>(workers_.size());
  std::vector<std::function<Status()>> tasks;
  for (size_t i = 0; i < workers_.size(); ++i) {
    tasks.push_back([f = workers_[i].fetch, request, replies, i]() -> Status {
      WSYNC_ASSIGN_OR_RETURN((*replies)[i], f(*request));
      return Status::Ok();
    });
  }
  Status s = OnEveryWorker("fetch_weights", std::move(tasks));
  call.Done(s);
  WSYNC_RETURN_IF_ERROR(s);
  json reply = replies->front().is_object() ? replies->front() : json::object();
  int64_t applied = 0;
  for (const json& r : *replies) {
    if (r.is_object()) applied += r.value("applied_by_workers", int64_t{0});
  }
  reply["applied_by_workers"] = applied;
  reply["workers"] = replies->size();
  return reply;
}

int HostedService::WorldSize(bool) const { return static_cast<int>(workers_.size()); }

std::string HostedService::WeightVersion() const {
  std::lock_guard lock(mu_);
  return weight_version_;
}

void HostedService::SetWeightVersion(std::string version) {
  std::lock_guard lock(mu_);
  weight_version_ = std::move(version);
}

Status HostedService::Pause(std::string_view mode, bool) {
  if (mode != "abort" && mode != "wait" && mode != "keep") {
    return InvalidArgument(fmt::format("unknown pause mode '{}': use abort, wait or keep (query parameter 'mode')",
                                       mode));
  }
  std::lock_guard lock(mu_);
  paused_ = true;
  return Status::Ok();
}

Status HostedService::Resume() {
  std::lock_guard lock(mu_);
  paused_ = false;
  return Status::Ok();
}

bool HostedService::IsPaused() const {
  std::lock_guard lock(mu_);
  return paused_;
}

Result<bool> HostedService::ResetPrefixCache(bool) { return true; }  // no prefix cache to reset

Result<std::map<std::string, std::string>> HostedService::Checksums(DigestAlgorithm algorithm) {
  WSYNC_ASSIGN_OR_RETURN(ReceiverSession::Call call,
                         session_.BeginExclusive("weight_checker", /*refuse_in_session=*/true));
  using Sums = std::map<std::string, std::string>;
  auto sums = std::make_shared<std::vector<Sums>>(workers_.size());
  std::vector<std::function<Status()>> tasks;
  for (size_t i = 0; i < workers_.size(); ++i) {
    tasks.push_back([f = workers_[i].checksums, sums, i, algorithm]() -> Status {
      WSYNC_ASSIGN_OR_RETURN((*sums)[i], f(algorithm));
      return Status::Ok();
    });
  }
  Status s = OnEveryWorker("weight_checker", std::move(tasks));
  for (size_t i = 1; s.ok() && i < sums->size(); ++i) {
    const Sums& first = sums->front();
    const Sums& other = (*sums)[i];
    if (other == first) continue;
    std::vector<std::string> differ;
    for (const auto& [name, hex] : first) {
      auto it = other.find(name);
      if (it == other.end() || it->second != hex) differ.push_back(name);
    }
    for (const auto& [name, hex] : other) {
      if (!first.count(name)) differ.push_back(name);
    }
    std::sort(differ.begin(), differ.end());
    differ.resize(std::min<size_t>(differ.size(), 3));
    s = DataLoss(fmt::format("worker {} differs from worker 0 in {}", i, fmt::join(differ, ", ")));
  }
  call.Done(s, false);
  WSYNC_RETURN_IF_ERROR(s);
  return std::move(sums->front());
}

Status HostedService::Missing(std::string_view route, std::string_view what) const {
  return Unimplemented(fmt::format("{}: {} has no {}", route, options_.frontend_name, what));
}

Result<json> HostedService::CheckRuntimeWeights(std::string_view action, const json*) {
  return Unimplemented(fmt::format(
      "weight_checker '{}' without an 'algorithm' is vLLM's runtime-parameter checker, which {} does not have; "
      "name an 'algorithm' (sha256 or xxh3_128) for digests of the model's parameters by HF name",
      action, options_.frontend_name));
}

Status HostedService::Sleep(int, std::string_view) {
  return Missing(route::kSleep, "sleep mode (its models' memory is their own)");
}

Status HostedService::WakeUp(const std::vector<std::string>&) {
  return Missing(route::kWakeUp, "sleep mode (its models' memory is their own)");
}

Status HostedService::ReleaseKvCacheMemory() {
  return Missing(route::kReleaseKvCacheMemory, "KV cache (it does not generate)");
}

Result<int> HostedService::AbortRequests(const std::vector<std::string>&) {
  return Missing(route::kAbortRequests, "requests to abort (it does not generate)");
}

Result<json> HostedService::Complete(const json&) { return Missing(route::kCompletions, "generation"); }

json HostedService::ServerInfo() const {
  return json{{"server", "wsync"},
              {"frontend", "python"},
              {"model", options_.model},
              {"capabilities",
               {{"weight_transfer_backend", options_.backend},
                {"sleep_mode", false},
                {"generation", false},
                {"prefix_caching", false},
                {"runtime_weight_checker", false},
                {"draft_weight_updates", false}}}};
}

json HostedService::Health() const {
  ReceiverSession::Snapshot session = session_.Look();
  std::lock_guard lock(mu_);
  return json{{"status", "ok"},
              {"server", "wsync"},
              {"frontend", "python"},
              {"model", options_.model},
              {"backend", options_.backend},
              {"tp", workers_.size()},
              {"dp", 1},
              {"dp_rank", -1},
              {"device", options_.device},
              {"weight_version", weight_version_},
              {"syncs", syncs_},
              {"weights_consistent", session.consistent},
              {"session_active", session.active},
              {"expired_sessions", session.expired_sessions},
              {"taken_over_sessions", session.taken_over_sessions}};
}

}  // namespace wsync
