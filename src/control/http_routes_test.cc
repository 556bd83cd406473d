// Route handling over real HTTP on loopback: a recording ControlService stands in for
// the receiver so that these tests pin the HTTP contract (bodies, codes, auth) alone.
#include <httplib.h>

#include <chrono>
#include <thread>

#include <fmt/format.h>

#include <gtest/gtest.h>

#include "control/client.h"
#include "control/http_server.h"

namespace wsync {
namespace {

using nlohmann::json;

class RecordingService : public ControlService {
 public:
  Status InitWeightTransfer(const json& info, const std::string& peer) override {
    last_init = info;
    last_peer = peer;
    return Status::Ok();
  }
  Status StartWeightUpdate() override {
    if (active) return FailedPrecondition("start_weight_update called while a weight update is already active");
    active = true;
    return Status::Ok();
  }
  Status UpdateWeights(std::shared_ptr<const json> body) override {
    const json& info = *body;
    last_update = info;
    if (!active) return FailedPrecondition("start_weight_update must be called before update_weights");
    if (!info.contains("names")) return InvalidArgument("update_info is missing 'names'");
    return Status::Ok();
  }
  Status FinishWeightUpdate(const std::optional<std::string>& v) override {
    if (!active) return FailedPrecondition("finish outside a session");
    active = false;
    if (v) version = *v;
    return Status::Ok();
  }
  int WorldSize(bool include_dp) const override { return include_dp ? 4 : 2; }
  std::string WeightVersion() const override { return version; }
  void SetWeightVersion(std::string v) override { version = std::move(v); }
  Status Pause(std::string_view mode, bool) override {
    if (mode != "abort" && mode != "wait" && mode != "keep") return InvalidArgument("bad mode");
    paused = true;
    return Status::Ok();
  }
  Status Resume() override {
    paused = false;
    return Status::Ok();
  }
  bool IsPaused() const override { return paused; }
  Status ResetPrefixCache() override { return Status::Ok(); }
  Result<std::map<std::string, std::string>> Checksums(DigestAlgorithm a) override {
    return std::map<std::string, std::string>{{"w", std::string(DigestAlgorithmName(a))}};
  }
  json Health() const override { return {{"status", "ok"}}; }

  json last_init;
  std::string last_peer;
  json last_update;
  bool active = false;
  bool paused = false;
  std::string version = "default";
};

class HttpRoutes : public ::testing::Test {
 protected:
  void SetUp() override { Serve(""); }
  void Serve(std::string key) {
    server_.reset();
    HttpServerOptions o;
    o.api_key = std::move(key);
    o.max_body_bytes = 1 << 20;
    server_ = std::move(*HttpControlServer::Start(o, &svc_));
  }
  httplib::Client Cli() { return httplib::Client("127.0.0.1", server_->port()); }

  RecordingService svc_;
  std::unique_ptr<HttpControlServer> server_;
};

TEST_F(HttpRoutes, LifecycleAndCodes) {
  auto cli = Cli();
  auto r = cli.Post("/init_weight_transfer_engine", R"({"init_info":{"rank_offset":1}})", "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(svc_.last_init["rank_offset"], 1);
  EXPECT_EQ(svc_.last_peer, "127.0.0.1");  // the TCP peer's address reaches the service
  EXPECT_EQ(cli.Post("/update_weights", R"({"update_info":{"names":[]}})", "application/json")->status, 409);
  EXPECT_EQ(cli.Post("/start_weight_update")->status, 200);
  EXPECT_EQ(cli.Post("/start_weight_update")->status, 409);
  EXPECT_EQ(cli.Post("/update_weights", R"({"update_info":{"names":[]}})", "application/json")->status, 200);
  EXPECT_EQ(cli.Post("/finish_weight_update", R"({"weight_version":"v7"})", "application/json")->status, 200);
  auto info = cli.Get("/weight_info");
  EXPECT_EQ(json::parse(info->body)["weight_version"], "v7");
  EXPECT_EQ(cli.Post("/finish_weight_update")->status, 409);
}

// Large bodies are parsed once and reused while byte-identical: the same tensor list sent
// every sync must reach the service intact each time, and any change must be seen.
TEST_F(HttpRoutes, RepeatedLargeUpdateBodiesReachTheServiceExactly) {
  auto cli = Cli();
  json names = json::array();
  for (int i = 0; i < 400; ++i) names.push_back("model.layers." + std::to_string(i) + ".mlp.up_proj.weight");
  json a{{"update_info", {{"names", names}, {"sync", 1}}}};
  json b = a;
  b["update_info"]["names"][399] = "model.layers.399.mlp.down_proj.weight";
  ASSERT_GE(a.dump().size(), 4096u);
  for (const json* body : {&a, &a, &b, &a, &b}) {
    ASSERT_EQ(cli.Post("/start_weight_update")->status, 200);
    auto r = cli.Post("/update_weights", body->dump(), "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 200) << r->body;
    EXPECT_EQ(svc_.last_update, (*body)["update_info"]);
    ASSERT_EQ(cli.Post("/finish_weight_update")->status, 200);
  }
  // A malformed body of the same size as a cached one is still a 400.
  std::string broken = a.dump();
  broken.back() = ' ';  // the closing brace: same size, unterminated object
  EXPECT_EQ(cli.Post("/update_weights", broken, "application/json")->status, 400);
}

TEST_F(HttpRoutes, BadBodiesAre400WithMessages) {
  auto cli = Cli();
  auto r = cli.Post("/init_weight_transfer_engine", "{not json", "application/json");
  EXPECT_EQ(r->status, 400);
  EXPECT_NE(json::parse(r->body)["error"]["message"].get<std::string>().find("malformed JSON"), std::string::npos);
  r = cli.Post("/init_weight_transfer_engine", "{}", "application/json");
  EXPECT_EQ(r->status, 400);
  EXPECT_NE(r->body.find("missing field 'init_info'"), std::string::npos);
  r = cli.Post("/update_weights", R"({"update_info":5})", "application/json");
  EXPECT_EQ(r->status, 400);
  EXPECT_EQ(cli.Post("/pause?mode=sideways")->status, 400);
  EXPECT_EQ(cli.Get("/get_world_size?include_dp=maybe")->status, 400);
  EXPECT_EQ(cli.Post("/weight_checker", R"({"algorithm":"md5"})", "application/json")->status, 400);
}

TEST_F(HttpRoutes, OversizedBodyIs413) {
  auto cli = Cli();
  std::string big(2 << 20, 'x');
  auto r = cli.Post("/update_weights", big, "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 413);
}

TEST_F(HttpRoutes, QueriesAndChecker) {
  auto cli = Cli();
  EXPECT_EQ(json::parse(cli.Get("/get_world_size?include_dp=true")->body)["world_size"], 4);
  EXPECT_EQ(json::parse(cli.Get("/get_world_size?include_dp=false")->body)["world_size"], 2);
  EXPECT_EQ(json::parse(cli.Get("/get_world_size")->body)["world_size"], 4);
  EXPECT_EQ(cli.Post("/pause?mode=keep")->status, 200);
  EXPECT_EQ(json::parse(cli.Get("/is_paused")->body)["is_paused"], true);
  EXPECT_EQ(cli.Post("/resume")->status, 200);
  EXPECT_EQ(json::parse(cli.Get("/is_paused")->body)["is_paused"], false);
  auto r = cli.Post("/weight_checker", R"({"action":"checksum","algorithm":"xxh3_128"})", "application/json");
  EXPECT_EQ(json::parse(r->body)["checksums"]["w"], "xxh3_128");
  r = cli.Post("/weight_checker", R"({"action":"compare","baseline":{"w":"sha256"}})", "application/json");
  EXPECT_EQ(json::parse(r->body)["match"], true);
  EXPECT_EQ(cli.Get("/nope")->status, 404);
}

TEST_F(HttpRoutes, ApiKeyGuardsAllButHealth) {
  Serve("s3cret");
  auto cli = Cli();
  EXPECT_EQ(cli.Get("/health")->status, 200);
  auto r = cli.Get("/get_world_size");
  EXPECT_EQ(r->status, 401);
  EXPECT_NE(r->body.find("Bearer"), std::string::npos);
  EXPECT_EQ(cli.Get("/get_world_size", {{"Authorization", "Bearer wrong"}})->status, 401);
  EXPECT_EQ(cli.Get("/get_world_size", {{"Authorization", "Bearer s3cret"}})->status, 200);
}

TEST_F(HttpRoutes, FanOutClientCarriesServerMessages) {
  RecordingService other;
  auto second = std::move(*HttpControlServer::Start(HttpServerOptions{}, &other));
  FanOutClient client({server_->url(), second->url()}, {});
  auto sizes = client.Get("/get_world_size?include_dp=true", Deadline::InSeconds(10));
  ASSERT_TRUE(sizes.ok()) << sizes.status().ToString();
  EXPECT_EQ((*sizes)[1]["world_size"], 4);
  ASSERT_TRUE(client.Post("/start_weight_update", json::object(), Deadline::InSeconds(10)).ok());
  auto again = client.Post("/start_weight_update", json::object(), Deadline::InSeconds(10));
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(again.status().message().find(server_->url() + ": POST /start_weight_update -> 409: start_weight_update called while"),
            std::string::npos) << again.status().message();
  std::vector<json> bodies = {json{{"init_info", {{"rank_offset", 1}}}}, json{{"init_info", {{"rank_offset", 5}}}}};
  ASSERT_TRUE(client.PostEach("/init_weight_transfer_engine", bodies, Deadline::InSeconds(10)).ok());
  EXPECT_EQ(other.last_init["rank_offset"], 5);
}

// A plain HTTP server that answers every POST with the port the request came from, so a
// test sees which requests shared a connection; it closes connections idle `idle_seconds`.
class PortEcho {
 public:
  explicit PortEcho(time_t idle_seconds) {
    srv_.set_keep_alive_timeout(idle_seconds);
    srv_.Post("/port", [](const httplib::Request& req, httplib::Response& res) {
      res.set_content(json{{"port", req.remote_port}}.dump(), "application/json");
    });
    port_ = srv_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { srv_.listen_after_bind(); });
  }
  ~PortEcho() {
    srv_.stop();
    thread_.join();
  }
  std::string url() const { return fmt::format("http://127.0.0.1:{}", port_); }

 private:
  httplib::Server srv_;
  int port_ = 0;
  std::thread thread_;
};

int PortOf(const FanOutClient& client) {
  auto r = client.Post("/port", json::object(), Deadline::InSeconds(10));
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? (*r)[0]["port"].get<int>() : -1;
}

TEST(FanOutClient, TheCallsOfASyncShareOneConnectionAndAnIdleOneIsReplaced) {
  PortEcho server(5);
  FanOutClient client({server.url()}, {});
  int first = PortOf(client);
  EXPECT_EQ(PortOf(client), first);  // start, update, finish: one connection
  auto pending = client.PostAsync("/port", std::make_shared<const std::string>("{}"), Deadline::InSeconds(10));
  auto r = pending->Wait(Deadline::InSeconds(10));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ((*r)[0]["port"].get<int>(), first);
  std::this_thread::sleep_for(std::chrono::duration<double>(kReuseIdleSeconds + 0.3));
  EXPECT_NE(PortOf(client), first);  // idle over a "training step": a fresh connection
}

TEST(FanOutClient, AConnectionTheServerClosedWhileIdleIsNotAnError) {
  PortEcho server(1);  // shorter than kReuseIdleSeconds
  FanOutClient client({server.url()}, {});
  int first = PortOf(client);
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  int second = PortOf(client);
  EXPECT_GT(second, 0);
  EXPECT_NE(second, first);
}

TEST(FanOutClient, UnreachableServerIsUnavailable) {
  FanOutClient client({"http://127.0.0.1:1"}, {});
  auto r = client.Get("/health", Deadline::InSeconds(5));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(r.status().message().find("http://127.0.0.1:1: GET /health"), std::string::npos);
}

}  // namespace
}  // namespace wsync
