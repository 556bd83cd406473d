// Route handling, through HttpRouter alone and over real HTTP on loopback: a recording
// ControlService stands in for the receiver so that these tests pin the HTTP contract
// (bodies, codes, auth, limits, the guard) alone.
#include <arpa/inet.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <errno.h>

#include <chrono>
#include <condition_variable>
#include <future>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include <gtest/gtest.h>

#include "control/client.h"
#include "control/route_table.h"
#include "control/http_routes.h"
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
    last_update_ptr = body;
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
  Status Pause(std::string_view mode, bool clear) override {
    if (mode != "abort" && mode != "wait" && mode != "keep") return InvalidArgument("bad mode");
    paused = true;
    clear_cache = clear;
    return Status::Ok();
  }
  Status Resume() override {
    paused = false;
    return Status::Ok();
  }
  bool IsPaused() const override { return paused; }
  Result<bool> ResetPrefixCache(bool) override { return true; }
  Result<std::map<std::string, std::string>> Checksums(DigestAlgorithm a) override {
    return std::map<std::string, std::string>{{"w", std::string(DigestAlgorithmName(a))}};
  }
  // vLLM's checker: records what the router passed and answers with the call's shape.
  Result<json> CheckRuntimeWeights(std::string_view action, const json* baseline) override {
    runtime_action = std::string(action);
    runtime_baseline = baseline ? *baseline : json();
    if (paused) return FailedPrecondition("weight_checker: the engine is paused");
    if (action == "reset") return json{{"status", "reset"}};
    if (action == "checksum") return json{{"checksums", {{"dp0:pp0:pcp0:tp0:w", "00"}}}};
    return json{{"match", true}, {"mismatches", json::array()}};
  }
  json Health() const override { return {{"status", "ok"}}; }
  Result<std::string> Metrics() const override { return metrics; }

  std::string metrics =
      "# HELP wsync_weight_update_sessions_started_total Sessions started.\n"
      "# TYPE wsync_weight_update_sessions_started_total counter\n"
      "wsync_weight_update_sessions_started_total{backend=\"nccl\",model=\"toy\"} 2\n"
      "# HELP wsync_weight_version_info The weight version.\n"
      "# TYPE wsync_weight_version_info gauge\n"
      "wsync_weight_version_info{version=\"a\\\"b\"} 1\n";
  std::string runtime_action;
  json runtime_baseline;
  json last_init;
  std::string last_peer;
  json last_update;
  std::shared_ptr<const json> last_update_ptr;
  bool active = false;
  bool paused = false;
  bool clear_cache = false;
  std::string version = "default";
};

httplib::Client Cli1(int port) {
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(10, 0);
  return c;
}

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
  EXPECT_EQ(cli.Post("/weight_checker", R"({"action":"checksum","algorithm":"md5"})", "application/json")->status, 400);
}

TEST_F(HttpRoutes, PauseAndResumeAnswerAsVllm) {
  auto cli = Cli();
  auto r = cli.Post("/pause");  // no body
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(json::parse(r->body), json({{"status", "paused"}}));
  EXPECT_TRUE(svc_.clear_cache);  // vLLM's default
  r = cli.Post("/pause?mode=keep&clear_cache=false");
  EXPECT_EQ(json::parse(r->body), json({{"status", "paused"}}));
  EXPECT_FALSE(svc_.clear_cache);
  r = cli.Post("/resume");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(json::parse(r->body), json({{"status", "resumed"}}));
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
  r = cli.Post("/weight_checker", R"({"action":"compare","algorithm":"sha256","baseline":{"w":"sha256"}})",
               "application/json");
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

// GET /metrics answers the service's exposition as Prometheus text, behind the API key
// like every route but /health; a service without metrics answers 501 in JSON.
TEST_F(HttpRoutes, MetricsArePrometheusText) {
  auto cli = Cli();
  auto r = cli.Get("/metrics");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(r->get_header_value("Content-Type"), "text/plain; version=0.0.4; charset=utf-8");
  EXPECT_EQ(r->body, svc_.metrics);
  // Line by line: comments are HELP or TYPE, samples are `name{labels} value`.
  std::vector<std::string> names;
  size_t begin = 0;
  while (begin < r->body.size()) {
    size_t end = r->body.find('\n', begin);
    ASSERT_NE(end, std::string::npos) << "the last line ends with a newline";
    std::string line = r->body.substr(begin, end - begin);
    begin = end + 1;
    if (line.rfind("# HELP ", 0) == 0 || line.rfind("# TYPE ", 0) == 0) continue;
    size_t brace = line.find('{');
    size_t close = line.rfind("} ");
    ASSERT_TRUE(brace != std::string::npos && close != std::string::npos && close > brace) << line;
    names.push_back(line.substr(0, brace));
    double value = std::stod(line.substr(close + 2));
    EXPECT_GE(value, 0) << line;
  }
  EXPECT_EQ(names,
            (std::vector<std::string>{"wsync_weight_update_sessions_started_total", "wsync_weight_version_info"}));
  auto post_metrics = cli.Post("/metrics");
  EXPECT_EQ(post_metrics->status, 405);
  EXPECT_EQ(post_metrics->get_header_value("Allow"), "GET");

  Serve("s3cret");
  auto keyed = Cli();
  EXPECT_EQ(keyed.Get("/metrics")->status, 401);
  r = keyed.Get("/metrics", {{"Authorization", "Bearer s3cret"}});
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(r->body, svc_.metrics);
}

TEST(HttpRouter, AServiceWithoutMetricsAnswers501Json) {
  class NoMetrics : public RecordingService {
   public:
    Result<std::string> Metrics() const override { return ControlService::Metrics(); }
  } svc;
  HttpRouter router({}, &svc);
  HttpRequest req;
  req.method = "GET";
  req.path = "/metrics";
  HttpResponse r = router.Handle(req);
  EXPECT_EQ(r.status, 501);
  EXPECT_EQ(r.content_type, "application/json");
  EXPECT_EQ(json::parse(r.body)["error"]["message"], "this server exports no metrics");
  EXPECT_EQ(HttpRouter::LaneOf(req), HttpLane::kRead);
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


// ---- HttpRouter without sockets -------------------------------------------------------

HttpRequest Req(std::string method, std::string path, std::string body = "",
                std::map<std::string, std::string> headers = {},
                std::map<std::string, std::string> params = {}) {
  HttpRequest r;
  r.method = std::move(method);
  r.path = std::move(path);
  r.body = std::move(body);
  r.headers = std::move(headers);
  r.params = std::move(params);
  r.remote_addr = "127.0.0.1";
  return r;
}

// The reply's JSON; fails the test when it is not JSON.
json Body(const HttpResponse& r) {
  json j = json::parse(r.body, nullptr, /*allow_exceptions=*/false);
  EXPECT_FALSE(j.is_discarded()) << r.body;
  return j;
}

std::string Message(const HttpResponse& r) {
  json j = Body(r);
  if (!j.is_object() || !j.contains("error")) return "";
  EXPECT_EQ(j["error"]["code"], r.status) << r.body;
  return j["error"].value("message", "");
}

class ThrowingService : public RecordingService {
 public:
  Status StartWeightUpdate() override { throw std::runtime_error("start exploded \xFF"); }
  Result<bool> ResetPrefixCache(bool) override { throw 42; }
  Status Pause(std::string_view mode, bool) override {
    return InvalidArgument("unknown pause mode '" + std::string(mode) + "'");
  }
  json Health() const override { return {{"status", "ok"}, {"note", "\xC3\x28"}}; }
};

TEST(HttpRouter, AnyExceptionFromAServiceIsA500JsonReply) {
  ThrowingService svc;
  HttpRouter router({}, &svc);
  HttpResponse r = router.Handle(Req("POST", "/start_weight_update"));
  EXPECT_EQ(r.status, 500);
  EXPECT_NE(Message(r).find("start exploded"), std::string::npos) << r.body;
  r = router.Handle(Req("POST", "/reset_prefix_cache"));
  EXPECT_EQ(r.status, 500);
  EXPECT_FALSE(Message(r).empty());
}

TEST(HttpRouter, InvalidUtf8InPathQueryAndMessagesStillGivesValidJson) {
  for (const char* key : {"", "k"}) {
    SCOPED_TRACE(key);
    ThrowingService svc;
    HttpRouter router({key, 1 << 20}, &svc);
    const std::map<std::string, std::string> auth = {{"authorization", std::string("Bearer ") + key}};
    HttpResponse r = router.Handle(Req("GET", "/\xFF\xFE"));
    EXPECT_EQ(r.status, *key ? 401 : 404);
    EXPECT_NE(Message(r).find("\xEF\xBF\xBD"), std::string::npos) << r.body;  // U+FFFD
    r = router.Handle(Req("GET", "/\xFF", "", auth));
    EXPECT_EQ(r.status, 404);
    EXPECT_FALSE(Message(r).empty());
    r = router.Handle(Req("POST", "/pause", "", auth, {{"mode", "\xFF\xC3\x28"}}));
    EXPECT_EQ(r.status, 400);
    EXPECT_NE(Message(r).find("unknown pause mode"), std::string::npos) << r.body;
    r = router.Handle(Req("GET", "/get_world_size", "", auth, {{"include_dp", "\xED\xA0\x80"}}));
    EXPECT_EQ(r.status, 400);
    EXPECT_NE(Message(r).find("include_dp"), std::string::npos);
    r = router.Handle(Req("GET", "/health", "", {{"x-junk", "\xFF"}}));
    EXPECT_EQ(r.status, 200);
    EXPECT_EQ(Body(r)["status"], "ok");
    for (const char* body : {"{\"new_version\": \"\xFF\"}", "{\"new_version\": \"\\udc80\"}", "{\"\xC0\xAF\": 1}"}) {
      r = router.Handle(Req("POST", "/update_weight_version", body, auth));
      EXPECT_EQ(r.status, 400) << body;
      EXPECT_NE(Message(r).find("malformed JSON"), std::string::npos) << r.body;
    }
    // Exception text with invalid UTF-8, through the guard.
    r = router.Handle(Req("POST", "/start_weight_update", "", auth));
    EXPECT_EQ(r.status, 500);
    EXPECT_FALSE(Message(r).empty());
  }
}

TEST(HttpRouter, WeightCheckerFieldsOfTheWrongTypeAre400NamingTheField) {
  RecordingService svc;
  HttpRouter router({}, &svc);
  struct Case {
    const char* body;
    const char* field;
  };
  for (const Case& c : {Case{R"({"action":1})", "action"}, Case{R"({"action":["checksum"]})", "action"},
                        Case{R"({"action":"sum"})", "action"}, Case{R"({"algorithm":"sha256"})", "action"},
                        Case{R"({"action":"checksum","algorithm":[1]})", "algorithm"},
                        Case{R"({"action":"checksum","algorithm":"md5"})", "algorithm"},
                        Case{R"({"action":"checksum","algorithm":null})", "algorithm"},
                        Case{R"({"action":"compare","algorithm":"sha256"})", "baseline"},
                        Case{R"({"action":"compare","baseline":"x"})", "baseline"},
                        Case{R"({"action":"reset","algorithm":"sha256"})", "algorithm"}}) {
    HttpResponse r = router.Handle(Req("POST", "/weight_checker", c.body));
    EXPECT_EQ(r.status, 400) << c.body << " -> " << r.body;
    EXPECT_NE(Message(r).find(c.field), std::string::npos) << c.body << " -> " << r.body;
  }
  HttpResponse ok = router.Handle(
      Req("POST", "/weight_checker", R"({"action":"compare","algorithm":"sha256","baseline":{"w":"sha256"}})"));
  EXPECT_EQ(ok.status, 200) << ok.body;
  EXPECT_EQ(Body(ok)["match"], true);
  EXPECT_EQ(svc.runtime_action, "");  // an algorithm keeps wsync's HF digests
}

// vLLM's checker (no "algorithm"): `action` is required and every action reaches the
// service's runtime checker with the baseline it was given; the service's 409 (paused,
// sleeping) comes back as vLLM's; a server without a runtime checker answers 501.
TEST(HttpRouter, WeightCheckerWithoutAnAlgorithmIsVllmsRuntimeChecker) {
  RecordingService svc;
  HttpRouter router({}, &svc);
  HttpResponse r = router.Handle(Req("POST", "/weight_checker", "{}"));
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_NE(Message(r).find("weight_checker needs a field 'action'"), std::string::npos) << r.body;
  EXPECT_EQ(router.Handle(Req("POST", "/weight_checker", "")).status, 400);  // a body is required

  r = router.Handle(Req("POST", "/weight_checker", R"({"action":"checksum"})"));
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(svc.runtime_action, "checksum");
  EXPECT_TRUE(svc.runtime_baseline.is_null());
  EXPECT_EQ(Body(r)["checksums"]["dp0:pp0:pcp0:tp0:w"], "00");

  r = router.Handle(Req("POST", "/weight_checker", R"({"action":"reset"})"));
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(Body(r), json({{"status", "reset"}}));
  EXPECT_EQ(svc.runtime_action, "reset");

  // vLLM's 400 and words for a compare without a baseline (a null one is none), for both checkers.
  for (const char* body : {R"({"action":"compare"})", R"({"action":"compare","baseline":null})",
                           R"({"action":"compare","algorithm":"sha256"})"}) {
    svc.runtime_action.clear();
    r = router.Handle(Req("POST", "/weight_checker", body));
    EXPECT_EQ(r.status, 400) << body << " -> " << r.body;
    EXPECT_EQ(Message(r), "action='compare' requires a 'baseline' object") << r.body;
    EXPECT_EQ(svc.runtime_action, "");  // refused before the service is asked
  }
  // A baseline is {name: digest string}, as vLLM's dict[str, str].
  r = router.Handle(Req("POST", "/weight_checker", R"({"action":"compare","baseline":{"k":1}})"));
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_NE(Message(r).find("field 'baseline': the digest of k must be a string, not number"), std::string::npos)
      << r.body;
  r = router.Handle(Req("POST", "/weight_checker", R"({"action":"compare","baseline":{"k":"ab"}})"));
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(svc.runtime_baseline, json({{"k", "ab"}}));
  EXPECT_EQ(Body(r), json({{"match", true}, {"mismatches", json::array()}}));

  // The service's 409 (a weight session is open, or the weights sleep) passes through.
  svc.paused = true;
  r = router.Handle(Req("POST", "/weight_checker", R"({"action":"checksum"})"));
  EXPECT_EQ(r.status, 409) << r.body;
  r = router.Handle(Req("POST", "/weight_checker", R"({"action":"checksum","algorithm":"sha256"})"));
  EXPECT_EQ(r.status, 200) << r.body;

  class NoChecker : public RecordingService {
   public:
    Result<json> CheckRuntimeWeights(std::string_view a, const json* b) override {
      return ControlService::CheckRuntimeWeights(a, b);
    }
  } plain;
  HttpRouter plain_router({}, &plain);
  r = plain_router.Handle(Req("POST", "/weight_checker", R"({"action":"checksum"})"));
  EXPECT_EQ(r.status, 501) << r.body;
  EXPECT_NE(Message(r).find("name an 'algorithm'"), std::string::npos) << r.body;
}

// /collective_rpc runs no method by name: 501 naming the method and the routes there
// are instead; 400 without a method.
TEST(HttpRouter, CollectiveRpcNamesTheMethodItDoesNotRun) {
  RecordingService svc;
  HttpRouter router({}, &svc);
  HttpResponse r = router.Handle(Req("POST", "/collective_rpc", R"({"method":"reload_weights","args":[]})"));
  EXPECT_EQ(r.status, 501) << r.body;
  EXPECT_EQ(Body(r)["error"]["type"], "UNIMPLEMENTED");
  const std::string m = Message(r);
  EXPECT_NE(m.find("collective_rpc 'reload_weights'"), std::string::npos) << m;
  EXPECT_NE(m.find("dispatches no worker methods by name"), std::string::npos) << m;
  for (const char* route : {"/init_weight_transfer_engine", "/update_weights", "/sleep", "/weight_checker"}) {
    EXPECT_NE(m.find(route), std::string::npos) << route << " in " << m;
  }
  for (const char* body : {"{}", R"({"method":""})", R"({"method":7})", R"({"args":["x"]})"}) {
    r = router.Handle(Req("POST", "/collective_rpc", body));
    EXPECT_EQ(r.status, 400) << body << " -> " << r.body;
    EXPECT_NE(Message(r).find("method"), std::string::npos) << body << " -> " << r.body;
  }
  EXPECT_EQ(router.Handle(Req("POST", "/collective_rpc", "")).status, 400);
  EXPECT_EQ(router.Handle(Req("GET", "/collective_rpc")).status, 405);
}

// The route table a Python front reads is the one the router answers: every entry is
// admitted under its method, refused (405) under the other, and runs on its lane.
TEST(HttpRouter, TheRouteTableIsWhatTheRouterAnswers) {
  RecordingService svc;
  HttpRouter router({}, &svc);
  std::set<std::string_view> paths;
  for (const RouteEntry& r : RouteTable()) {
    SCOPED_TRACE(std::string(r.path));
    EXPECT_TRUE(paths.insert(r.path).second);
    EXPECT_EQ(router.Admit(Req(std::string(r.method), std::string(r.path)), std::nullopt), std::nullopt);
    auto other = router.Admit(Req(r.method == "GET" ? "POST" : "GET", std::string(r.path)), std::nullopt);
    ASSERT_TRUE(other.has_value());
    EXPECT_EQ(other->status, 405);
    const HttpLane lane = HttpRouter::LaneOf(Req(std::string(r.method), std::string(r.path), "", {}, {{"mode", "wait"}}));
    EXPECT_EQ(r.lane, lane == HttpLane::kRead ? "read" : lane == HttpLane::kControl ? "control" : "generation");
  }
  EXPECT_TRUE(paths.contains("/update_weights"));
}

TEST(HttpRouter, AdmitRefusesFromTheHeadAlone) {
  RecordingService svc;
  HttpRouter router({"k", 1000}, &svc);
  const std::map<std::string, std::string> auth = {{"authorization", "Bearer k"}};
  EXPECT_EQ(router.Admit(Req("POST", "/update_weights"), 10)->status, 401);
  EXPECT_EQ(router.Admit(Req("GET", "/health"), std::nullopt), std::nullopt);
  EXPECT_EQ(router.Admit(Req("POST", "/update_weights", "", auth), 1000), std::nullopt);
  EXPECT_EQ(router.Admit(Req("POST", "/update_weights", "", auth), std::nullopt), std::nullopt);
  EXPECT_EQ(router.Admit(Req("POST", "/update_weights", "", auth), 1001)->status, 413);
  EXPECT_EQ(router.Admit(Req("POST", "/update_weights", "", auth), UINT64_MAX)->status, 413);
  // A route's path under another method is vLLM's 405, with Allow; an unknown path 404.
  std::optional<HttpResponse> wrong = router.Admit(Req("GET", "/update_weights", "", auth), 0);
  ASSERT_TRUE(wrong);
  EXPECT_EQ(wrong->status, 405);
  EXPECT_EQ(wrong->allow, "POST");
  EXPECT_EQ(Message(*wrong), "GET /update_weights: method not allowed; use POST");
  EXPECT_EQ(Body(*wrong)["error"]["type"], "METHOD_NOT_ALLOWED");
  EXPECT_EQ(router.Admit(Req("DELETE", "/health"), 0)->allow, "GET");
  EXPECT_EQ(router.Admit(Req("GET", "/nothing_here", "", auth), 0)->status, 404);
  EXPECT_TRUE(router.Admit(Req("GET", "/nothing_here", "", auth), 0)->allow.empty());
  auto gz = auth;
  gz["content-encoding"] = "gzip";
  std::optional<HttpResponse> r = router.Admit(Req("POST", "/update_weights", "", gz), 10);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 415);
  EXPECT_NE(Message(*r).find("gzip"), std::string::npos);
  gz["content-encoding"] = "identity";
  EXPECT_EQ(router.Admit(Req("POST", "/update_weights", "", gz), 10), std::nullopt);
  EXPECT_EQ(router.TooLarge(Req("POST", "/update_weights")).status, 413);
  EXPECT_NE(Message(router.TooLarge(Req("POST", "/update_weights"))).find("1000 bytes"), std::string::npos);
}

TEST(HttpRouter, TheKeyMatchesOnlyWhole) {
  RecordingService svc;
  HttpRouter router({"s3cret", 1 << 20}, &svc);
  auto status = [&](std::optional<std::string> header) {
    std::map<std::string, std::string> h;
    if (header) h["authorization"] = *header;
    return router.Handle(Req("GET", "/weight_info", "", h)).status;
  };
  EXPECT_EQ(status("Bearer s3cret"), 200);
  EXPECT_EQ(status(std::nullopt), 401);
  EXPECT_EQ(status(""), 401);
  EXPECT_EQ(status("Bearer s3cre"), 401);
  EXPECT_EQ(status("Bearer s3cret "), 401);
  EXPECT_EQ(status("Bearer s3creT"), 401);
  EXPECT_EQ(status("bearer s3cret"), 401);
  EXPECT_EQ(status(std::string("Bearer s3cret\0", 14)), 401);
  EXPECT_EQ(status("Bearer " + std::string(1 << 20, 's')), 401);
  // /health needs no key.
  EXPECT_EQ(router.Handle(Req("GET", "/health")).status, 200);
}

TEST(HttpRouter, OnlyAcceptedLargeBodiesAreKeptForReuse) {
  RecordingService svc;
  HttpRouter router({}, &svc);
  json names = json::array();
  for (int i = 0; i < 300; ++i) names.push_back("model.layers." + std::to_string(i) + ".mlp.up_proj.weight");
  std::string good = json{{"update_info", {{"names", names}}}}.dump();
  std::string refused = json{{"update_info", {{"nothing", names}}}}.dump();
  ASSERT_GE(refused.size(), 4096u);
  auto update = [&](const std::string& body) {
    EXPECT_EQ(router.Handle(Req("POST", "/start_weight_update")).status, 200);
    int status = router.Handle(Req("POST", "/update_weights", body)).status;
    router.Handle(Req("POST", "/finish_weight_update"));
    return status;
  };
  ASSERT_EQ(update(refused), 400);
  std::shared_ptr<const json> first = svc.last_update_ptr;
  ASSERT_EQ(update(refused), 400);
  EXPECT_NE(svc.last_update_ptr.get(), nullptr);
  EXPECT_NE(svc.last_update_ptr, first) << "a refused body must not be kept and handed out again";
  ASSERT_EQ(update(good), 200);
  first = svc.last_update_ptr;
  ASSERT_EQ(update(good), 200);
  EXPECT_EQ(svc.last_update_ptr, first) << "an accepted body is parsed once and reused while byte-identical";
}

// ---- the server: limits and threads -----------------------------------------------

TEST_F(HttpRoutes, ChunkedBodyOverTheLimitIs413) {
  auto cli = Cli();
  std::string piece(64 << 10, 'x');
  size_t sent = 0;
  auto r = cli.Post(
      "/update_weights",
      [&](size_t, httplib::DataSink& sink) {
        if (sent >= (3u << 19)) {
          sink.done();
        } else {
          sink.write(piece.data(), piece.size());
          sent += piece.size();
        }
        return true;
      },
      "application/json");
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 413) << r->body;
  EXPECT_EQ(cli.Get("/health")->status, 200);
}

// Holds every caller of Enter() until Release(); counts them as they arrive.
class Gate {
 public:
  void Enter() const {
    std::unique_lock lock(mu_);
    ++waiting_;
    cv_.notify_all();
    cv_.wait(lock, [&] { return released_; });
  }
  // Waits (up to 10 s) until `n` callers are held.
  void WaitForWaiting(int n) const {
    std::unique_lock lock(mu_);
    cv_.wait_for(lock, std::chrono::seconds(10), [&] { return waiting_ >= n; });
  }
  void Release() {
    std::lock_guard lock(mu_);
    released_ = true;
    cv_.notify_all();
  }

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  mutable int waiting_ = 0;
  bool released_ = false;
};

// A service whose init blocks until released, as a rendezvous waiting for its peers does.
class BlockingInitService : public RecordingService {
 public:
  Status InitWeightTransfer(const json& info, const std::string&) override {
    gate.Enter();
    return Status::Ok();
  }
  Gate gate;
};

TEST(HttpServer, CallsThatBlockHoldAWorkerOfTheirLaneAndNothingElse) {
  BlockingInitService svc;
  HttpServerOptions o;
  o.worker_threads = 3;
  auto server = std::move(*HttpControlServer::Start(o, &svc));
  auto post = [&](const char* path, const char* body) {
    return std::async(std::launch::async, [&, path, body] {
      httplib::Client c("127.0.0.1", server->port());
      c.set_read_timeout(30, 0);
      auto r = c.Post(path, body, "application/json");
      return r ? r->status : 0;
    });
  };
  std::vector<std::future<int>> inits;
  for (int i = 0; i < kControlWorkers; ++i) inits.push_back(post("/init_weight_transfer_engine", R"({"init_info":{}})"));
  svc.gate.WaitForWaiting(kControlWorkers);
  // Every control worker is taken: the read-only routes and the generation lane still
  // answer, one more control call waits.
  httplib::Client cli("127.0.0.1", server->port());
  auto t = std::chrono::steady_clock::now();
  EXPECT_EQ(cli.Get("/health")->status, 200);
  EXPECT_EQ(cli.Get("/get_world_size")->status, 200);
  EXPECT_EQ(cli.Get("/nope")->status, 404);
  EXPECT_NE(cli.Post("/v1/completions", R"({"prompt":"a"})", "application/json")->status, 0);
  EXPECT_EQ(cli.Post("/pause?mode=wait")->status, 200);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count(), 2.0);
  std::future<int> start = post("/start_weight_update", "{}");
  EXPECT_EQ(start.wait_for(std::chrono::milliseconds(200)), std::future_status::timeout);
  svc.gate.Release();
  for (auto& f : inits) EXPECT_EQ(f.get(), 200);
  EXPECT_EQ(start.get(), 200);
}

TEST(HttpRouter, LanesKeepGenerationApartFromTheSession) {
  auto lane = [](const char* method, const char* path, std::map<std::string, std::string> params = {}) {
    HttpRequest r;
    r.method = method;
    r.path = path;
    r.params = std::move(params);
    return HttpRouter::LaneOf(r);
  };
  EXPECT_EQ(lane("GET", "/health"), HttpLane::kRead);
  EXPECT_EQ(lane("POST", "/update_weights"), HttpLane::kControl);
  EXPECT_EQ(lane("POST", "/finish_weight_update"), HttpLane::kControl);
  EXPECT_EQ(lane("POST", "/resume"), HttpLane::kControl);
  EXPECT_EQ(lane("POST", "/v1/completions"), HttpLane::kGeneration);
  EXPECT_EQ(lane("POST", "/pause", {{"mode", "wait"}}), HttpLane::kGeneration);
  EXPECT_EQ(lane("POST", "/pause"), HttpLane::kControl);
  EXPECT_EQ(lane("POST", "/pause", {{"mode", "abort"}}), HttpLane::kControl);
  EXPECT_EQ(lane("POST", "/sleep", {{"mode", "wait"}}), HttpLane::kGeneration);
}

// A service whose Health() blocks, as one holding its lock across a slow call would.
class BlockingHealthService : public RecordingService {
 public:
  json Health() const override {
    gate.Enter();
    return {{"status", "ok"}};
  }
  Gate gate;
};

TEST(HttpServer, AReadOnlyCallThatBlocksStallsNoOtherRoute) {
  BlockingHealthService svc;
  auto server = std::move(*HttpControlServer::Start(HttpServerOptions{}, &svc));
  std::vector<std::future<int>> healths;
  for (int i = 0; i < kReadWorkers + 1; ++i) {
    healths.push_back(std::async(std::launch::async, [&] {
      httplib::Client c("127.0.0.1", server->port());
      c.set_read_timeout(30, 0);
      auto r = c.Get("/health");
      return r ? r->status : 0;
    }));
  }
  svc.gate.WaitForWaiting(kReadWorkers);
  httplib::Client cli("127.0.0.1", server->port());
  auto t = std::chrono::steady_clock::now();
  EXPECT_EQ(cli.Post("/start_weight_update")->status, 200);
  EXPECT_EQ(cli.Post("/update_weights", R"({"update_info":{"names":[]}})", "application/json")->status, 200);
  EXPECT_EQ(cli.Post("/finish_weight_update")->status, 200);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count(), 2.0);
  svc.gate.Release();
  for (auto& f : healths) EXPECT_EQ(f.get(), 200);
}

TEST(HttpServer, StopWaitsForCallsInFlight) {
  BlockingInitService svc;
  auto server = std::move(*HttpControlServer::Start(HttpServerOptions{}, &svc));
  auto init = std::async(std::launch::async, [&] {
    httplib::Client c("127.0.0.1", server->port());
    auto r = c.Post("/init_weight_transfer_engine", R"({"init_info":{}})", "application/json");
    return r ? r->status : 0;
  });
  svc.gate.WaitForWaiting(1);
  auto stopped = std::async(std::launch::async, [&] { server->Stop(); });
  EXPECT_EQ(stopped.wait_for(std::chrono::milliseconds(300)), std::future_status::timeout);
  svc.gate.Release();
  stopped.get();
  EXPECT_EQ(init.get(), 200);
}

TEST(HttpServer, ACallLongerThanTheReadTimeoutsIsNotCut) {
  BlockingInitService svc;
  HttpServerOptions o;
  o.header_timeout_seconds = 0.5;
  o.body_timeout_seconds = 0.5;
  auto server = std::move(*HttpControlServer::Start(o, &svc));
  auto init = std::async(std::launch::async, [&] {
    httplib::Client c("127.0.0.1", server->port());
    c.set_read_timeout(30, 0);
    auto r = c.Post("/init_weight_transfer_engine", R"({"init_info":{}})", "application/json");
    return r ? r->status : 0;
  });
  svc.gate.WaitForWaiting(1);
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));  // past both, and the idle timeout
  svc.gate.Release();
  EXPECT_EQ(init.get(), 200);
}

// Two requests, then a third after a pause, on one kept-alive connection.
TEST(HttpServer, KeptAliveConnectionsServeRequestAfterRequest) {
  RecordingService svc;
  auto server = std::move(*HttpControlServer::Start(HttpServerOptions{}, &svc));
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(server->port()));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  auto exchange = [&](const std::string& request) {
    EXPECT_EQ(send(fd, request.data(), request.size(), MSG_NOSIGNAL), static_cast<ssize_t>(request.size()));
    std::string got;
    char buf[4096];
    while (got.find("\r\n\r\n") == std::string::npos || got.find('}') == std::string::npos) {
      ssize_t n = recv(fd, buf, sizeof(buf), 0);
      if (n <= 0) break;
      got.append(buf, static_cast<size_t>(n));
    }
    return got;
  };
  EXPECT_EQ(exchange("GET /health HTTP/1.1\r\nHost: x\r\n\r\n").rfind("HTTP/1.1 200", 0), 0u);
  EXPECT_EQ(exchange("POST /start_weight_update HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
                .rfind("HTTP/1.1 200", 0),
            0u);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_EQ(exchange("POST /finish_weight_update HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
                .rfind("HTTP/1.1 200", 0),
            0u);
  close(fd);
}

// One raw loopback connection, for what no client library sends.
class RawConn {
 public:
  explicit RawConn(int port) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ok_ = connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  }
  ~RawConn() { close(fd_); }
  bool ok() const { return ok_; }
  bool Send(std::string_view b) {
    while (!b.empty()) {
      ssize_t n = send(fd_, b.data(), b.size(), MSG_NOSIGNAL);
      if (n <= 0) return false;
      b.remove_prefix(static_cast<size_t>(n));
    }
    return true;
  }
  // The status of the reply that arrives within `seconds` (0: none, or closed first).
  int Status(double seconds) {
    std::string got;
    auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (got.size() < 12 && std::chrono::steady_clock::now() < end) {
      timeval tv{0, 50000};
      setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
      char buf[4096];
      ssize_t n = recv(fd_, buf, sizeof(buf), 0);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) break;
      if (n > 0) got.append(buf, static_cast<size_t>(n));
    }
    return got.rfind("HTTP/1.", 0) == 0 && got.size() >= 12 ? std::atoi(got.c_str() + 9) : 0;
  }
  // True once the server has closed the connection, within `seconds`.
  bool Closed(double seconds) {
    auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (std::chrono::steady_clock::now() < end) {
      char c[4096];
      ssize_t n = recv(fd_, c, sizeof(c), MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  }

 private:
  int fd_ = -1;
  bool ok_ = false;
};

TEST(HttpServer, DeadlinesCutTricklingHeadersAndStalledBodies) {
  RecordingService svc;
  HttpServerOptions o;
  o.header_timeout_seconds = 0.5;
  o.body_timeout_seconds = 0.5;
  auto server = std::move(*HttpControlServer::Start(o, &svc));
  RawConn trickle(server->port());
  ASSERT_TRUE(trickle.Send("GET /health HTTP/1.1\r\n"));
  auto t = std::chrono::steady_clock::now();
  bool open = true;
  while (open && std::chrono::steady_clock::now() - t < std::chrono::seconds(5)) {
    open = trickle.Send("X") && !trickle.Closed(0.1);
  }
  EXPECT_FALSE(open);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count(), 2.0);
  RawConn stalled(server->port());
  ASSERT_TRUE(stalled.Send("POST /update_weights HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"));
  EXPECT_TRUE(stalled.Closed(2.0));
  RawConn idle(server->port());  // opens and sends nothing
  EXPECT_TRUE(idle.Closed(2.0));
  EXPECT_EQ(Cli1(server->port()).Get("/health")->status, 200);
}

TEST(HttpServer, BodiesArePolicedAsTheyArriveAndEncodingsRefused) {
  RecordingService svc;
  HttpServerOptions o;
  o.max_body_bytes = 64 << 10;
  o.discard_bytes = 256 << 10;
  auto server = std::move(*HttpControlServer::Start(o, &svc));
  const int port = server->port();
  {
    RawConn c(port);
    auto t = std::chrono::steady_clock::now();
    ASSERT_TRUE(c.Send("POST /update_weights HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000000\r\n\r\n{"));
    EXPECT_EQ(c.Status(5), 413);
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count(), 1.0);
    EXPECT_TRUE(c.Closed(2));
  }
  {
    RawConn c(port);  // a little over: read, dropped, answered
    std::string body(100 << 10, 'x');
    ASSERT_TRUE(c.Send(fmt::format("POST /update_weights HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{}",
                                   body.size(), body)));
    EXPECT_EQ(c.Status(5), 413);
  }
  {
    RawConn c(port);  // chunked, a little over
    std::string piece(16 << 10, 'y');
    std::string req = "POST /update_weights HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n";
    for (int i = 0; i < 10; ++i) req += fmt::format("{:x}\r\n{}\r\n", piece.size(), piece);
    ASSERT_TRUE(c.Send(req + "0\r\n\r\n"));
    EXPECT_EQ(c.Status(5), 413);
  }
  {
    RawConn c(port);  // chunked, without end: cut
    ASSERT_TRUE(c.Send("POST /update_weights HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"));
    std::string piece(64 << 10, 'z');
    size_t sent = 0;
    while (sent < (size_t{256} << 20) && c.Send(fmt::format("{:x}\r\n{}\r\n", piece.size(), piece))) {
      sent += piece.size();
    }
    EXPECT_LT(sent, size_t{32} << 20);
  }
  {
    RawConn c(port);
    ASSERT_TRUE(c.Send("POST /update_weights HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\n"
                       "Content-Length: 4\r\n\r\n\x1f\x8b\x08\x00"));
    EXPECT_EQ(c.Status(5), 415);
  }
  EXPECT_EQ(Cli1(port).Post("/start_weight_update")->status, 200);
  EXPECT_EQ(Cli1(port).Post("/update_weights", R"({"update_info":{"names":[]}})", "application/json")->status, 200);
}

TEST(HttpServer, HundredsOfIdleConnectionsDoNotDelayHealth) {
  RecordingService svc;
  auto server = std::move(*HttpControlServer::Start(HttpServerOptions{}, &svc));
  std::vector<std::unique_ptr<RawConn>> idle;
  for (int i = 0; i < 300; ++i) {
    idle.push_back(std::make_unique<RawConn>(server->port()));
    if (i % 2) idle.back()->Send("GET /health HTTP/1.1\r\nHo");
  }
  double worst = 0;
  for (int i = 0; i < 10; ++i) {
    auto t = std::chrono::steady_clock::now();
    EXPECT_EQ(Cli1(server->port()).Get("/health")->status, 200);
    worst = std::max(worst, std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count());
  }
  EXPECT_LT(worst, 1.0);
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
