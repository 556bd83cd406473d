// The engine skeleton's prefix-cache reset, against recording servers over real HTTP on
// loopback: the engine probes each server's /server_info at Init (wsync's capabilities,
// vLLM's cache_config, or nothing) and, for a plane that does not reset at its own point,
// POSTs /reset_prefix_cache?reset_running_requests=true to exactly the caching servers
// after the update has landed and before finish. A server that answers {"success":
// false} fails the sync, naming it, and every session is closed. A plane's SessionShape
// moves the reset before start and adds its steps around the session.
#include "engine/engine.h"

#include <gtest/gtest.h>

#include <stdexcept>

#include "control/http_server.h"
#include "testing/recording_service.h"

namespace wsync {
namespace {

using nlohmann::json;

// A server whose /server_info says `server_info`.
std::unique_ptr<RecordingService> Recorder(json server_info, bool reset_ok = true) {
  return std::make_unique<RecordingService>(json{{"status", "ok"}}, std::move(server_info), reset_ok);
}

// A plane that moves nothing: the session and the reset are the engine's.
class NullPlane : public DataPlane {
 public:
  SessionShape Shape() override { return SessionShape{}; }
  Status Init(const PlaneInit& init) override { return init.driver->InitAll(json::object()); }
  Result<bool> Ready(const Status& mine) override {
    WSYNC_RETURN_IF_ERROR(mine);
    return true;
  }
  Status Prepare(SyncContext& sync) override {
    sync.update_body = UpdateBody(sync.pass.AsSource().metadata());
    return Status::Ok();
  }
  Status Transfer(SyncContext&, SessionDriver::Pending&) override { return Status::Ok(); }
  Status Abort(const Status& cause, SessionDriver::Pending*) override { return cause; }
  void Shutdown() override {}
};

// A plane shaped as delta's: no transfer phase, a pause before start (where the prefix
// caches are reset) and a resume after the session. `fail_before_start`: the pause step
// fails after pausing. Records the steps the engine ran.
class ShapedPlane : public NullPlane {
 public:
  explicit ShapedPlane(std::vector<std::string>* steps, bool fail_before_start = false)
      : steps_(steps), fail_before_start_(fail_before_start) {}
  SessionShape Shape() override {
    SessionShape shape;
    shape.transfer = false;
    shape.prefix_cache_reset = PrefixCacheReset::kBeforeStart;
    shape.before_start = [this](SyncContext& sync) {
      steps_->push_back("before_start");
      WSYNC_RETURN_IF_ERROR(sync.driver->Pause("keep", false));
      return fail_before_start_ ? Unavailable("the pause step failed") : Status::Ok();
    };
    shape.after_session = [this](SyncContext& sync, Status outcome) {
      steps_->push_back(outcome.ok() ? "after_session ok" : "after_session failed");
      Status resumed = sync.driver->Resume();
      return outcome.ok() ? resumed : outcome;
    };
    shape.account = [this](SyncStats*) { steps_->push_back("account"); };
    return shape;
  }
  Status Abort(const Status& cause, SessionDriver::Pending* update) override {
    steps_->push_back(update == nullptr ? "abort before update" : "abort");
    return cause;
  }

 private:
  std::vector<std::string>* steps_;
  bool fail_before_start_;
};

struct Fleet {
  explicit Fleet(std::vector<std::unique_ptr<RecordingService>> r) : recorders(std::move(r)) {
    for (auto& rec : recorders) {
      servers.push_back(std::move(*HttpControlServer::Start(HttpServerOptions{}, rec.get())));
      urls.push_back(servers.back()->url());
    }
  }
  // An engine over a NullPlane for this fleet, initialized for Source(), calls cleared.
  std::unique_ptr<TrainerEngine> Engine(const WeightSource& source,
                                        std::unique_ptr<DataPlane> plane = std::make_unique<NullPlane>()) {
    TrainerOptions o;
    o.servers = urls;
    o.backend = "null";
    o.timeout_seconds = 20;
    auto engine = NewTrainerEngine(o, std::move(plane));
    EXPECT_TRUE(engine.ok());
    EXPECT_TRUE((*engine)->Init(source.metadata()).ok());
    for (auto& rec : recorders) rec->ClearCalls();
    return std::move(*engine);
  }
  std::vector<std::unique_ptr<RecordingService>> recorders;
  std::vector<std::unique_ptr<HttpControlServer>> servers;
  std::vector<std::string> urls;
};

HostTensorSource Source() {
  std::vector<HostTensor> v;
  v.push_back(*HostTensor::Zeros({"w", DType::kF32, {2, 2}}));
  return HostTensorSource(std::move(v));
}

TEST(EnginePrefixCache, ProbedServersAreResetAfterTheUpdateAndBeforeFinish) {
  std::vector<std::unique_ptr<RecordingService>> r;
  r.push_back(Recorder(json{{"capabilities", {{"prefix_caching", true}}}}));
  r.push_back(Recorder(json{{"capabilities", {{"prefix_caching", false}}}}));
  // vLLM: cache_config in the JSON config, or in its text form.
  r.push_back(Recorder(json{{"vllm_config", {{"cache_config", {{"enable_prefix_caching", true}}}}}}));
  r.push_back(Recorder(json{{"vllm_config", "CacheConfig(block_size=16, enable_prefix_caching=True)"}}));
  r.push_back(Recorder(json{{"vllm_config", {{"cache_config", {{"block_size", 16}}}}}}));
  Fleet f(std::move(r));
  HostTensorSource source = Source();
  auto engine = f.Engine(source);
  ASSERT_TRUE(engine->SendWeights(source, std::string("v1")).ok());
  const std::vector<std::string> reset = {"start", "update", "reset_prefix_cache running=true", "finish v1"};
  const std::vector<std::string> plain = {"start", "update", "finish v1"};
  EXPECT_EQ(f.recorders[0]->calls(), reset);
  EXPECT_EQ(f.recorders[1]->calls(), plain);
  EXPECT_EQ(f.recorders[2]->calls(), reset);
  EXPECT_EQ(f.recorders[3]->calls(), reset);
  EXPECT_EQ(f.recorders[4]->calls(), plain);
}

TEST(EnginePrefixCache, AServerWithoutServerInfoIsTakenAsNotCaching) {
  // A server whose /server_info fails (an older server answers 404; this one 500).
  class Old : public RecordingService {
   public:
    Old() : RecordingService(json{{"status", "ok"}}, json::object()) {}
    json ServerInfo() const override { throw std::runtime_error("no /server_info here"); }
  };
  std::vector<std::unique_ptr<RecordingService>> r;
  r.push_back(std::make_unique<Old>());
  r.push_back(Recorder(json{{"capabilities", {{"prefix_caching", true}}}}));
  Fleet f(std::move(r));
  SessionDriver driver(f.urls, "", 10);
  EXPECT_EQ(driver.PrefixCaching(), (std::vector<bool>{false, true}));
}

TEST(EnginePrefixCache, AResetThatFailsFailsTheSyncNamingTheServerAndClosesSessions) {
  std::vector<std::unique_ptr<RecordingService>> r;
  r.push_back(Recorder(json{{"capabilities", {{"prefix_caching", true}}}}, /*reset_ok=*/false));
  Fleet f(std::move(r));
  HostTensorSource source = Source();
  auto engine = f.Engine(source);
  auto stats = engine->SendWeights(source, std::string("v1"));
  ASSERT_FALSE(stats.ok());
  EXPECT_EQ(stats.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(stats.status().message().find(f.urls[0]), std::string::npos) << stats.status().ToString();
  EXPECT_NE(stats.status().message().find("old weights"), std::string::npos) << stats.status().ToString();
  // The session is closed by the best-effort finish (no version).
  EXPECT_EQ(f.recorders[0]->calls(),
            (std::vector<std::string>{"start", "update", "reset_prefix_cache running=true", "finish -"}));
}

TEST(EngineSessionShape, AShapeWithoutTransferResetsInsideItsPauseBeforeStartAndResumesAfterFinish) {
  std::vector<std::unique_ptr<RecordingService>> r;
  r.push_back(Recorder(json{{"capabilities", {{"prefix_caching", true}}}}));
  r.push_back(Recorder(json{{"capabilities", {{"prefix_caching", false}}}}));
  Fleet f(std::move(r));
  HostTensorSource source = Source();
  std::vector<std::string> steps;
  auto engine = f.Engine(source, std::make_unique<ShapedPlane>(&steps));
  auto stats = engine->SendWeights(source, std::string("v1"));
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  EXPECT_EQ(steps, (std::vector<std::string>{"before_start", "after_session ok", "account"}));
  EXPECT_EQ(f.recorders[0]->calls(),
            (std::vector<std::string>{"pause keep clear_cache=false", "reset_prefix_cache running=true", "start",
                                      "update", "finish v1", "resume"}));
  EXPECT_EQ(f.recorders[1]->calls(),
            (std::vector<std::string>{"pause keep clear_cache=false", "start", "update", "finish v1", "resume"}));
}

TEST(EngineSessionShape, AFailedStepBeforeStartAbortsThePlaneStartsNothingAndStillRunsTheStepAfter) {
  std::vector<std::unique_ptr<RecordingService>> r;
  r.push_back(Recorder(json{{"capabilities", {{"prefix_caching", true}}}}));
  Fleet f(std::move(r));
  HostTensorSource source = Source();
  std::vector<std::string> steps;
  auto engine = f.Engine(source, std::make_unique<ShapedPlane>(&steps, /*fail_before_start=*/true));
  auto stats = engine->SendWeights(source, std::string("v1"));
  ASSERT_FALSE(stats.ok());
  EXPECT_EQ(stats.status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(steps, (std::vector<std::string>{"before_start", "abort before update", "after_session failed"}));
  EXPECT_EQ(f.recorders[0]->calls(), (std::vector<std::string>{"pause keep clear_cache=false", "resume"}));
}

}  // namespace
}  // namespace wsync
