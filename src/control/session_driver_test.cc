// The session driver over real HTTP on loopback: every typed call reaches its route with
// the body it promises, errors carry the server's URL and message, and the backend check
// names each mismatched server.
#include "control/session_driver.h"

#include <mutex>
#include <thread>

#include <httplib.h>

#include <fmt/format.h>

#include <gtest/gtest.h>

#include "control/http_server.h"
#include "control/tensor_list.h"

namespace wsync {
namespace {

using nlohmann::json;

class Service : public ControlService {
 public:
  explicit Service(std::string backend) : backend_(std::move(backend)) {}
  Status InitWeightTransfer(const json& info, const std::string&) override {
    std::lock_guard lock(mu);
    init = info;
    return Status::Ok();
  }
  Status StartWeightUpdate() override {
    std::lock_guard lock(mu);
    if (active) return FailedPrecondition("a session is active");
    active = true;
    return Status::Ok();
  }
  Status StartLoraWeightUpdate(const json& spec, bool) override {
    {
      std::lock_guard lock(mu);
      lora = spec;
    }
    return StartWeightUpdate();
  }
  Status UpdateWeights(std::shared_ptr<const json> body) override {
    std::lock_guard lock(mu);
    update = *body;
    if (!active) return FailedPrecondition("no session");
    return Status::Ok();
  }
  Status FinishWeightUpdate(const std::optional<std::string>& v) override {
    std::lock_guard lock(mu);
    if (!active) return FailedPrecondition("finish outside a session");
    active = false;
    if (v) version = *v;
    return Status::Ok();
  }
  Result<json> FetchWeights(const json& body) override { return json{{"fetched", body["target_version"]}}; }
  int WorldSize(bool include_dp) const override { return include_dp ? 4 : 2; }
  std::string WeightVersion() const override { return version; }
  void SetWeightVersion(std::string v) override { version = std::move(v); }
  Status Pause(std::string_view mode, bool clear_cache) override {
    std::lock_guard lock(mu);
    pause = fmt::format("{}/{}", mode, clear_cache);
    return Status::Ok();
  }
  Status Resume() override {
    std::lock_guard lock(mu);
    pause = "resumed";
    return Status::Ok();
  }
  bool IsPaused() const override { return false; }
  Result<bool> ResetPrefixCache(bool) override { return true; }
  Result<std::map<std::string, std::string>> Checksums(DigestAlgorithm a) override {
    return std::map<std::string, std::string>{{"w", std::string(DigestAlgorithmName(a))}};
  }
  json Health() const override {
    json h = {{"status", "ok"}, {"server", "wsync"}, {"tp", 2}, {"dp", 1}};
    if (!backend_.empty()) h["backend"] = backend_;
    return h;
  }

  std::mutex mu;
  json init, update, lora;
  bool active = false;
  std::string version, pause;

 private:
  std::string backend_;
};

struct Fixture {
  explicit Fixture(std::vector<std::string> backends) {
    for (const std::string& b : backends) {
      services.push_back(std::make_unique<Service>(b));
      servers.push_back(std::move(*HttpControlServer::Start(HttpServerOptions{}, services.back().get())));
      urls.push_back(servers.back()->url());
    }
  }
  std::vector<std::unique_ptr<Service>> services;
  std::vector<std::unique_ptr<HttpControlServer>> servers;
  std::vector<std::string> urls;
};

TEST(SessionDriver, DiscoversTheFleet) {
  Fixture f({"nccl", ""});
  SessionDriver driver(f.urls, "", 10);
  Result<Fleet> fleet = driver.Discover();
  ASSERT_TRUE(fleet.ok()) << fleet.status().ToString();
  EXPECT_TRUE(fleet->wsync);
  ASSERT_TRUE(driver.WorldSizes(&*fleet).ok());
  EXPECT_EQ(fleet->world_sizes, (std::vector<int>{4, 4}));
  EXPECT_TRUE(driver.CheckBackend(*fleet, "nccl").ok());  // the second does not say
  std::vector<std::string> labels = driver.WorkerLabels(*fleet, 5, {1, 3});
  EXPECT_EQ(labels[1], f.urls[0] + " worker dp0/tp0");
  EXPECT_EQ(labels[4], f.urls[1] + " worker dp0/tp1");
}

TEST(SessionDriver, BackendMismatchNamesServerAndBothBackends) {
  Fixture f({"nccl", "ipc"});
  SessionDriver driver(f.urls, "", 10);
  Result<Fleet> fleet = driver.Discover();
  ASSERT_TRUE(fleet.ok());
  Status s = driver.CheckBackend(*fleet, "ipc");
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("asked for backend 'ipc'"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(f.urls[0] + " runs backend 'nccl'"), std::string::npos) << s.message();
  EXPECT_EQ(s.message().find(f.urls[1] + " runs"), std::string::npos) << s.message();
}

TEST(SessionDriver, OneSyncReachesEveryRoute) {
  Fixture f({"delta", "delta"});
  SessionDriver driver(f.urls, "", 10);
  ASSERT_TRUE(driver.Init({json{{"rank_offset", 1}}, json{{"rank_offset", 3}}}).ok());
  EXPECT_EQ(f.services[1]->init["rank_offset"], 3);
  ASSERT_TRUE(driver.Pause("keep", false).ok());
  EXPECT_EQ(f.services[0]->pause, "keep/false");
  ASSERT_TRUE(driver.Start().ok());
  std::vector<TensorMeta> meta = {{"w", DType::kBF16, {2, 3}}};
  UpdateBodyCache cache;
  auto body = cache.Get(meta);
  EXPECT_EQ(cache.Get(meta), body);  // the same bytes while the list is unchanged
  ASSERT_TRUE(driver.UpdateAsync(body)->Wait(driver.deadlines().Http()).ok());
  EXPECT_EQ(*ParseTensorList(f.services[0]->update), meta);
  ASSERT_TRUE(driver.Finish("v7").ok());
  EXPECT_EQ(f.services[1]->version, "v7");
  ASSERT_TRUE(driver.Resume().ok());
  EXPECT_EQ(f.services[1]->pause, "resumed");
  Result<std::vector<json>> fetched = driver.Fetch(json{{"target_version", 4}});
  ASSERT_TRUE(fetched.ok());
  EXPECT_EQ((*fetched)[1]["fetched"], 4);
  auto sums = driver.ChecksumsAsync("sha256")->Wait(driver.deadlines().Call());
  ASSERT_TRUE(sums.ok());
  EXPECT_EQ((*sums)[0]["checksums"]["w"], "sha256");
}

TEST(SessionDriver, ErrorsNameTheServerAndCloseEndsSessions) {
  Fixture f({"nccl", "nccl"});
  SessionDriver driver(f.urls, "", 10);
  ASSERT_TRUE(driver.Start().ok());
  Status again = driver.Start();
  EXPECT_EQ(again.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(again.message().find(f.urls[0]), std::string::npos) << again.message();
  EXPECT_NE(again.message().find("a session is active"), std::string::npos) << again.message();
  driver.Close();
  EXPECT_FALSE(f.services[0]->active);
  EXPECT_FALSE(f.services[1]->active);
  EXPECT_NEAR(driver.deadlines().server_timeout(), 8.75, 1e-9);
}

TEST(SessionDriver, AVllmServerRunningTheWsyncEngineCountsAsAWsyncServer) {
  json info = {{"vllm_config",
                {{"weight_transfer_config", {{"backend", "wsync"}}},
                 {"parallel_config", {{"tensor_parallel_size", 2}, {"pipeline_parallel_size", 1},
                                      {"data_parallel_size", 1}}}}}};
  std::optional<json> health = VllmWsyncHealth(info);
  ASSERT_TRUE(health.has_value());
  EXPECT_EQ((*health)["server"], "wsync");
  EXPECT_EQ((*health)["frontend"], "vllm");
  EXPECT_EQ((*health)["tp"], 2);
  EXPECT_EQ((*health)["dp"], 1);
  EXPECT_FALSE(health->contains("backend"));  // any wsync backend, chosen by each init
  EXPECT_EQ((*health)["inline_verification"], "xxh3_128");  // digests by collective RPC
  EXPECT_EQ((*health)["quantization"], "none");
  info["vllm_config"]["model_config"] = {{"quantization", "fp8"}};
  EXPECT_EQ((*VllmWsyncHealth(info))["quantization"], "fp8");
  info["vllm_config"]["model_config"] = {{"quantization", nullptr}};
  EXPECT_EQ((*VllmWsyncHealth(info))["quantization"], "none");
  info["vllm_config"]["weight_transfer_config"]["backend"] = "nccl";
  EXPECT_FALSE(VllmWsyncHealth(info).has_value());
  EXPECT_FALSE(VllmWsyncHealth(json{{"vllm_config", "text form"}}).has_value());
  // A size from the network outside [1, kMaxBroadcastWorldSize] reads as 1.
  info["vllm_config"]["weight_transfer_config"]["backend"] = "wsync";
  info["vllm_config"]["parallel_config"]["tensor_parallel_size"] = 4294967298;
  EXPECT_EQ((*VllmWsyncHealth(info))["tp"], 1);
}

TEST(SessionDriver, InlineResultsOfVllmWorkersMergeAndDifferencesAreNamed) {
  // Two pipeline stages: each worker lands half; "c" reached neither.
  json reply = {{"results",
                 {{{"tensors", 1}, {"not_landed", {"b", "c"}}, {"differing", 0}, {"differ", json::array()}},
                  {{"tensors", 1}, {"not_landed", {"a", "c"}}, {"differing", 0}, {"differ", json::array()}}}}};
  Result<json> merged = MergeInlineResults(reply, 3, "http://s");
  ASSERT_TRUE(merged.ok()) << merged.status().message();
  EXPECT_EQ((*merged)["tensors"], 2);
  EXPECT_EQ((*merged)["unverifiable"].size(), 1u);
  EXPECT_TRUE((*merged)["unverifiable"].contains("c"));
  reply["results"][1]["differing"] = 1;
  reply["results"][1]["differ"] = {"b (worker 1 landed 00, the trainer read ff)"};
  merged = MergeInlineResults(reply, 3, "http://s");
  ASSERT_FALSE(merged.ok());
  EXPECT_EQ(merged.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(merged.status().message().find("b (worker 1 landed 00"), std::string::npos);
  // A worker's reason for a tensor no worker could check is kept.
  json rows = {{"results",
                {{{"tensors", 1}, {"not_landed", {"r"}}, {"unverifiable", {{"r", "digested by row ranges"}}}},
                 {{"tensors", 1}, {"not_landed", {"r"}}}}}};
  merged = MergeInlineResults(rows, 2, "http://s");
  ASSERT_TRUE(merged.ok()) << merged.status().ToString();
  EXPECT_EQ((*merged)["tensors"], 1);
  EXPECT_EQ((*merged)["unverifiable"], (json{{"r", "digested by row ranges"}}));
  EXPECT_EQ(MergeInlineResults(json{{"results", json::array()}}, 3, "http://s").status().code(),
            StatusCode::kInternal);
  EXPECT_EQ(MergeInlineResults(json{{"results", {{{"x", 1}}}}}, 3, "http://s").status().code(),
            StatusCode::kInternal);
}

TEST(SessionDriver, WorkerChecksumsMergeAndDisagreementsAreNamed) {
  json reply = {{"results",
                 {{{"checksums", {{"a", "1"}, {"b", "2"}}}, {"not_held", {"c"}}},
                  {{"checksums", {{"a", "1"}, {"c", "3"}}}, {"not_held", json::array()}}}}};
  Result<json> merged = MergeWorkerChecksums(reply, "http://s");
  ASSERT_TRUE(merged.ok()) << merged.status().ToString();
  EXPECT_EQ((*merged)["checksums"], (json{{"a", "1"}, {"b", "2"}, {"c", "3"}}));
  EXPECT_EQ((*merged)["not_held"], json::array());  // worker 1 holds c
  reply["results"][1]["checksums"]["a"] = "9";
  Result<json> bad = MergeWorkerChecksums(reply, "http://s");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("http://s: workers disagree about a"), std::string::npos);
  EXPECT_FALSE(MergeWorkerChecksums(json{{"results", json::array()}}, "http://s").ok());
  EXPECT_FALSE(MergeWorkerChecksums(json{{"results", {{{"no", 1}}}}}, "http://s").ok());
}

// A vLLM server as wsync's plugin answers: every body it is sent, by route; its
// collective RPC answers `rpc_status`, with `rpc_reply` when that is 200.
struct VllmFront {
  explicit VllmFront(int rpc_status) {
    for (const char* route : {"/collective_rpc", "/start_weight_update", "/finish_weight_update"}) {
      srv.Post(route, [this, route, rpc_status](const httplib::Request& req, httplib::Response& res) {
        std::lock_guard lock(mu);
        bodies[route].push_back(req.body.empty() ? json::object() : json::parse(req.body));
        const bool rpc = std::string_view(route) == "/collective_rpc";
        res.status = rpc ? rpc_status : 200;
        res.set_content(rpc && rpc_status != 200 ? R"({"error": "max_lora_rank is 8"})"
                        : rpc                     ? rpc_reply.dump()
                                                  : R"({"results": [{}]})",
                        "application/json");
      });
    }
    port = srv.bind_to_any_port("127.0.0.1");
    serving = std::thread([this] { srv.listen_after_bind(); });
  }
  ~VllmFront() {
    srv.stop();
    serving.join();
  }
  std::string url() const { return fmt::format("http://127.0.0.1:{}", port); }
  std::vector<json> Sent(const std::string& route) {
    std::lock_guard lock(mu);
    return bodies[route];
  }

  httplib::Server srv;
  int port = 0;
  std::thread serving;
  std::mutex mu;
  std::map<std::string, std::vector<json>> bodies;
  json rpc_reply = {{"results", json::array({json::object()})}};
};

TEST(SessionDriver, ALoraSessionNamesTheAdapterToVllmAndLeavesItsVersion) {
  Fixture f({"nccl"});
  VllmFront vllm(200);
  SessionDriver driver({f.urls[0], vllm.url()}, "", 10);
  driver.set_vllm_servers({false, true});
  const json spec = {{"format", 1}, {"name", "math"}, {"version", "step-1"}, {"r", 8}, {"alpha", 16.0}};
  driver.set_start_fields(json{{"wsync_lora", spec}});
  ASSERT_TRUE(driver.Start().ok());
  std::vector<json> rpcs = vllm.Sent("/collective_rpc");
  ASSERT_EQ(rpcs.size(), 1u);
  EXPECT_EQ(rpcs[0]["method"], "wsync_lora_start");
  EXPECT_EQ(json::parse(rpcs[0]["args"][0].get<std::string>()), spec);
  EXPECT_EQ(rpcs[0]["args"][1], "start");  // the RPC opens vLLM's session itself
  EXPECT_TRUE(vllm.Sent("/start_weight_update").empty());
  EXPECT_EQ(f.services[0]->lora, spec);  // wsync serve takes it in the start body
  ASSERT_TRUE(driver.Finish("step-1").ok());
  EXPECT_EQ(f.services[0]->version, "step-1");
  // vLLM's weight_version names its base weights: a lora finish leaves it alone.
  EXPECT_EQ(vllm.Sent("/finish_weight_update").back(), json::object());

  // A full-weight session: no RPC, and the version reaches vLLM.
  driver.set_start_fields(json::object());
  ASSERT_TRUE(driver.Start().ok());
  EXPECT_EQ(vllm.Sent("/collective_rpc").size(), 1u);
  EXPECT_EQ(vllm.Sent("/start_weight_update").size(), 1u);
  ASSERT_TRUE(driver.Finish("v2").ok());
  EXPECT_EQ(vllm.Sent("/finish_weight_update").back(), (json{{"weight_version", "v2"}}));
}

TEST(SessionDriver, AVerifiedLoraFinishIsOneRpcToVllmAndAnAbortDropsTheStaging) {
  Fixture f({"nccl"});
  VllmFront vllm(200);
  SessionDriver driver({f.urls[0], vllm.url()}, "", 10);
  driver.set_vllm_servers({false, true});
  driver.set_start_fields(json{{"wsync_lora", {{"name", "math"}, {"version", "v1"}}}});
  ASSERT_TRUE(driver.Start().ok());
  const json digests = {{"a", "00ff"}, {"b", "11ee"}};
  vllm.rpc_reply = {{"results", json::array({json{{"tensors", 2}, {"differing", 0}, {"finished", true}}})}};
  Result<std::vector<json>> replies = driver.FinishVerified("v1", digests, {false, true});
  ASSERT_TRUE(replies.ok()) << replies.status().ToString();
  EXPECT_EQ((*replies)[1]["verified"]["tensors"], 2);
  std::vector<json> rpcs = vllm.Sent("/collective_rpc");
  ASSERT_EQ(rpcs.size(), 2u);  // wsync_lora_start, wsync_lora_finish: no finish route
  EXPECT_EQ(rpcs[1]["method"], "wsync_lora_finish");
  EXPECT_EQ(json::parse(rpcs[1]["args"][0].get<std::string>()),
            (json{{"wsync_digests", digests}, {"digest_algorithm", "xxh3_128"}}));
  EXPECT_TRUE(vllm.Sent("/finish_weight_update").empty());
  EXPECT_EQ(f.services[0]->version, "v1");

  // A worker of the group refused: the sync fails naming the server.
  ASSERT_TRUE(driver.Start().ok());
  vllm.rpc_reply = {{"results", json::array({json{{"tensors", 2}, {"differing", 0}, {"finished", true}},
                                             json{{"tensors", 2}, {"differing", 0}, {"finished", false}}})}};
  replies = driver.FinishVerified("v2", digests, {false, true});
  ASSERT_FALSE(replies.ok());
  EXPECT_NE(replies.status().message().find(vllm.url() + ": a worker refused LoRA adapter math"), std::string::npos)
      << replies.status().message();

  // Close after a failed sync: the abort RPC, not the finish route (which would install).
  ASSERT_TRUE(driver.Start().ok());
  driver.Close();
  rpcs = vllm.Sent("/collective_rpc");
  EXPECT_EQ(rpcs.back()["method"], "wsync_lora_finish");
  EXPECT_EQ(json::parse(rpcs.back()["args"][0].get<std::string>()), (json{{"abort", true}}));
  EXPECT_TRUE(vllm.Sent("/finish_weight_update").empty());
  EXPECT_FALSE(f.services[0]->active);
}

TEST(SessionDriver, AnAdapterVllmRefusesFailsTheStartBeforeAnyServerStarts) {
  Fixture f({"nccl"});
  VllmFront vllm(500);
  SessionDriver driver({f.urls[0], vllm.url()}, "", 10);
  driver.set_vllm_servers({false, true});
  driver.set_start_fields(json{{"wsync_lora", {{"name", "big"}, {"r", 64}}}});
  Status s = driver.Start();
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("wsync_lora_start"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(vllm.url()), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("max_lora_rank is 8"), std::string::npos) << s.message();
  EXPECT_TRUE(vllm.Sent("/start_weight_update").empty());
  EXPECT_FALSE(f.services[0]->active);
}

}  // namespace
}  // namespace wsync
