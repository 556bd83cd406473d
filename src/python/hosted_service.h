// HostedService: the ControlService of a server whose workers hold their own models (a
// Python worker's model behind a ReceiverEngine), served by the same HTTP server and
// router as `wsync serve` (control/http_server.h, control/http_routes.h).
//
// The routes, body admission, the Status -> HTTP map and the hostile-input limits are
// the router's and the HTTP server's; the session rules (start -> update* -> finish,
// busy, lease, takeover, weights_consistent) are ReceiverSession's (receiver/session.h).
// What this class adds is the fan-out: each weight call runs on every worker at once
// through that worker's HostedWorker calls, and the first failure (in worker order) is
// the answer. A worker call that has not returned `timeout_seconds + 30` s after it began
// is answered DeadlineExceeded naming the worker (the call itself keeps running; the
// worker's own engine refuses a new call while it does).
//
// It has no generation, sleep mode, KV cache or runtime-parameter checker: those routes
// answer Unimplemented naming what is missing. Pause and resume only flip /is_paused.
// Thread-safe, as ControlService requires.
#pragma once

#include <functional>
#include <map>
#include <mutex>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "control/control_service.h"
#include "receiver/session.h"

namespace wsync {

// One worker's calls. Each may block (a rendezvous, a receive) up to its own deadline;
// the service calls each worker's functions from one thread at a time.
struct HostedWorker {
  // init_info of /init_weight_transfer_engine and the HTTP peer's address.
  std::function<Status(const nlohmann::json& init_info, const std::string& peer)> init;
  // The worker's update_info of /update_weights (its entry of vLLM's list form); returns
  // once the update has landed in the worker's model.
  std::function<Status(const nlohmann::json& update_info)> receive;
  // The body of /fetch_weights; the worker's reply.
  std::function<Result<nlohmann::json>(const nlohmann::json& body)> fetch;
  // Releases the worker's data plane (/shutdown_weight_transfer_engine).
  std::function<Status()> shutdown;
  // {HF name: hex digest} of every tensor the worker's model holds.
  std::function<Result<std::map<std::string, std::string>>(DigestAlgorithm algorithm)> checksums;
};

struct HostedServiceOptions {
  std::string model;    // the model's name in /health and /server_info
  std::string backend;  // the weight-transfer backend's name
  std::string device;   // the first worker's device, "cpu" or "cuda:N"
  double timeout_seconds = 300;  // bound on every wait (see the class comment)
  // A session with no call for this long expires; unset: timeout_seconds; <= 0: never.
  std::optional<double> session_lease_seconds;
  // Names the server in its Unimplemented answers ("wsync.worker_server").
  std::string frontend_name = "this server";
};

class HostedService : public ControlService {
 public:
  HostedService(HostedServiceOptions options, std::vector<HostedWorker> workers);

  Status InitWeightTransfer(const nlohmann::json& init_info, const std::string& peer_address) override;
  Status ShutdownWeightTransfer() override;
  Status StartWeightUpdate() override;
  Status UpdateWeights(std::shared_ptr<const nlohmann::json> update_info) override;
  Status FinishWeightUpdate(const std::optional<std::string>& weight_version) override;
  Result<nlohmann::json> FetchWeights(const nlohmann::json& body) override;
  int WorldSize(bool include_dp) const override;
  std::string WeightVersion() const override;
  void SetWeightVersion(std::string version) override;
  // Pause and resume flip /is_paused (nothing generates); `mode` must be vLLM's.
  Status Pause(std::string_view mode, bool clear_cache) override;
  Status Resume() override;
  bool IsPaused() const override;
  Result<bool> ResetPrefixCache(bool reset_running_requests) override;
  // Every worker's digests; workers that differ are DataLoss naming the tensors.
  Result<std::map<std::string, std::string>> Checksums(DigestAlgorithm algorithm) override;
  Result<nlohmann::json> CheckRuntimeWeights(std::string_view action, const nlohmann::json* baseline) override;
  Status Sleep(int level, std::string_view mode) override;
  Status WakeUp(const std::vector<std::string>& tags) override;
  Status ReleaseKvCacheMemory() override;
  Result<int> AbortRequests(const std::vector<std::string>& request_ids) override;
  Result<nlohmann::json> Complete(const nlohmann::json& request) override;
  nlohmann::json ServerInfo() const override;
  nlohmann::json Health() const override;

 private:
  // Runs every task (one per worker, each owning what it reads) at once; the first
  // failure in worker order.
  Status OnEveryWorker(const char* what, std::vector<std::function<Status()>> tasks) const;
  Status Missing(std::string_view route, std::string_view what) const;

  const HostedServiceOptions options_;
  const std::vector<HostedWorker> workers_;
  ReceiverSession session_;
  mutable std::mutex mu_;
  std::string weight_version_ = "default";  // GUARDED_BY(mu_)
  int syncs_ = 0;                           // GUARDED_BY(mu_)
  bool paused_ = false;                     // GUARDED_BY(mu_)
};

}  // namespace wsync
