// RecordingService: a ControlService for trainer-side tests that records every call the
// servers get, in order, as text ("init", "fetch", "pause keep clear_cache=false",
// "reset_prefix_cache running=true", "start", "update", "finish v1", "resume"), and keeps
// the last init_info, update_info and fetch body. It moves no weights; its /health and
// /server_info bodies are the test's (a wsync server's, or a vLLM server's without
// "server": "wsync"). Serve it with HttpControlServer to give a trainer a real fleet.
// Thread-safe: the HTTP server calls it from its worker threads.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "control/control_service.h"

namespace wsync {

class RecordingService : public ControlService {
 public:
  // `reset_ok`: what /reset_prefix_cache answers in "success".
  RecordingService(nlohmann::json health, nlohmann::json server_info, bool reset_ok = true)
      : health_(std::move(health)), server_info_(std::move(server_info)), reset_ok_(reset_ok) {}

  Status InitWeightTransfer(const nlohmann::json& info, const std::string&) override {
    std::lock_guard lock(mu_);
    init_ = info;
    calls_.push_back("init");
    return Status::Ok();
  }
  Status StartWeightUpdate() override { return Log("start"); }
  Status UpdateWeights(std::shared_ptr<const nlohmann::json> info) override {
    std::lock_guard lock(mu_);
    update_ = *info;
    calls_.push_back("update");
    return Status::Ok();
  }
  Status FinishWeightUpdate(const std::optional<std::string>& v) override { return Log("finish " + v.value_or("-")); }
  Result<nlohmann::json> FetchWeights(const nlohmann::json& body) override {
    std::lock_guard lock(mu_);
    fetch_ = body;
    calls_.push_back("fetch");
    return nlohmann::json{{"status", "ok"}, {"target_version", body.value("target_version", nlohmann::json())}};
  }
  int WorldSize(bool) const override { return 1; }
  std::string WeightVersion() const override { return "default"; }
  void SetWeightVersion(std::string) override {}
  Status Pause(std::string_view mode, bool clear) override {
    return Log(fmt::format("pause {} clear_cache={}", mode, clear));
  }
  Status Resume() override { return Log("resume"); }
  bool IsPaused() const override { return false; }
  Result<bool> ResetPrefixCache(bool running) override {
    Log(fmt::format("reset_prefix_cache running={}", running));
    return reset_ok_;
  }
  Result<std::map<std::string, std::string>> Checksums(DigestAlgorithm) override {
    return std::map<std::string, std::string>{};
  }
  nlohmann::json Health() const override { return health_; }
  nlohmann::json ServerInfo() const override { return server_info_; }

  std::vector<std::string> calls() const {
    std::lock_guard lock(mu_);
    return calls_;
  }
  void ClearCalls() {
    std::lock_guard lock(mu_);
    calls_.clear();
  }
  nlohmann::json init() const {
    std::lock_guard lock(mu_);
    return init_;
  }
  nlohmann::json update() const {
    std::lock_guard lock(mu_);
    return update_;
  }
  nlohmann::json fetch() const {
    std::lock_guard lock(mu_);
    return fetch_;
  }

 private:
  Status Log(std::string call) {
    std::lock_guard lock(mu_);
    calls_.push_back(std::move(call));
    return Status::Ok();
  }

  const nlohmann::json health_;
  const nlohmann::json server_info_;
  const bool reset_ok_;
  mutable std::mutex mu_;
  std::vector<std::string> calls_;               // GUARDED_BY(mu_)
  nlohmann::json init_, update_, fetch_;         // GUARDED_BY(mu_)
};

}  // namespace wsync
