// The delta trainer against recording servers over real HTTP on loopback: the init
// payload is exactly what SkyRL's delta receiver accepts for a server that is not wsync
// ({base_model_path, local_checkpoint_dir}: its DeltaTransferInitInfo refuses unknown
// keys), wsync servers also get sync_dir and format_version; a sync drives SkyRL's order
// (fetch -> pause(keep) -> reset_prefix_cache -> start -> update -> finish -> resume), the
// prefix cache reset going only to servers whose /server_info says they cache prefixes.
#include "backends/delta/trainer.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>

#include <fmt/format.h>

#include "backends/delta/manifest.h"
#include "control/http_server.h"
#include "testing/recording_service.h"

namespace wsync {
namespace {

using nlohmann::json;

// A recording server: `wsync` says "server": "wsync" at /health (else it answers as a
// vLLM server does, without the field); `prefix_caching` is what /server_info says, in
// wsync's capabilities or in vLLM's cache_config.
std::unique_ptr<RecordingService> Recorder(bool wsync, bool prefix_caching) {
  if (wsync) {
    return std::make_unique<RecordingService>(
        json{{"status", "ok"}, {"server", "wsync"}, {"backend", "delta"}},
        json{{"capabilities", {{"prefix_caching", prefix_caching}, {"weight_transfer_backend", "delta"}}}});
  }
  return std::make_unique<RecordingService>(
      json{{"status", "ok"}},
      json{{"vllm_config", {{"cache_config", {{"enable_prefix_caching", prefix_caching}, {"block_size", 16}}}}}});
}

class DeltaTrainerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           fmt::format("wsync_delta_trainer_test_{}_{}", ::getpid(),
                       ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override {
    servers_.clear();
    std::filesystem::remove_all(dir_);
  }
  // Starts one recording server per entry of {wsync, prefix_caching}.
  std::vector<std::string> Serve(std::vector<std::pair<bool, bool>> kinds) {
    std::vector<std::string> urls;
    for (auto [wsync, caching] : kinds) {
      services_.push_back(Recorder(wsync, caching));
      servers_.push_back(std::move(*HttpControlServer::Start(HttpServerOptions{}, services_.back().get())));
      urls.push_back(servers_.back()->url());
    }
    return urls;
  }
  Result<std::unique_ptr<DeltaTrainer>> Trainer(std::vector<std::string> urls, DeltaTrainerOptions d) {
    TrainerOptions o;
    o.servers = std::move(urls);
    o.backend = "delta";
    o.timeout_seconds = 20;
    d.sync_dir = (dir_ / "sync").string();
    return NewDeltaTrainer(o, std::move(d));
  }
  static HostTensorSource Source(float value) {
    HostTensor t = *HostTensor::Zeros({"w", DType::kF32, {4, 8}});
    auto* f = reinterpret_cast<float*>(t.storage.span().data());
    for (int i = 0; i < 32; ++i) f[i] = value + i;
    std::vector<HostTensor> v;
    v.push_back(std::move(t));
    return HostTensorSource(std::move(v));
  }

  std::filesystem::path dir_;
  std::vector<std::unique_ptr<RecordingService>> services_;
  std::vector<std::unique_ptr<HttpControlServer>> servers_;
};

TEST(DeltaInitPayload, SkyrlsDefaultLocalCheckpointDir) {
  const char* old = std::getenv("TMPDIR");
  std::string saved = old ? old : "";
  ::setenv("TMPDIR", "/scratch", 1);
  // The last component, sanitized, then the first 16 hex digits of the SHA-256 of the whole
  // sync dir (computed independently: hashlib.sha256(b"/mnt/nfs/run-7/sync dir")).
  EXPECT_EQ(DefaultSkyrlLocalCheckpointDir("/mnt/nfs/run-7/sync dir"),
            "/scratch/skyrl_delta_checkpoints/sync_dir_a04fe8f785b320c8");
  EXPECT_EQ(DefaultSkyrlLocalCheckpointDir(std::string(300, 'a')).size(),
            std::string("/scratch/skyrl_delta_checkpoints/").size() + 160);
  if (old) {
    ::setenv("TMPDIR", saved.c_str(), 1);
  } else {
    ::unsetenv("TMPDIR");
  }
}

TEST(DeltaInitPayload, ANonWsyncServerGetsExactlySkyrlsKeys) {
  DeltaTrainerOptions d;
  d.sync_dir = "/shared/sync";
  d.base_checkpoint = "/models/base";
  d.local_checkpoint_dir = "/var/ckpt";
  EXPECT_EQ(*DeltaInitPayload(d, false), json({{"base_model_path", "/models/base"}, {"local_checkpoint_dir", "/var/ckpt"}}));
  EXPECT_EQ(*DeltaInitPayload(d, true),
            json({{"base_model_path", "/models/base"}, {"local_checkpoint_dir", "/var/ckpt"},
                  {"sync_dir", "/shared/sync"}, {"format_version", delta::kManifestFormatVersion}}));
  // The base's digest goes to wsync servers only (SkyRL's init refuses unknown keys).
  const std::string digest(32, 'a');
  EXPECT_FALSE(DeltaInitPayload(d, false, digest)->contains("base_digest"));
  EXPECT_EQ((*DeltaInitPayload(d, true, digest))["base_digest"], digest);
  d.base_model_path = "/srv/models/base";  // the servers' own path wins
  EXPECT_EQ((*DeltaInitPayload(d, false))["base_model_path"], "/srv/models/base");
  d.base_model_path.clear();
  d.base_checkpoint.clear();
  Result<json> none = DeltaInitPayload(d, false);
  EXPECT_EQ(none.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(none.status().message().find("requires init_info 'base_model_path'"), std::string::npos);
  EXPECT_FALSE(DeltaInitPayload(d, true)->contains("base_model_path"));  // a wsync server has its flag
}

TEST_F(DeltaTrainerTest, AMixedFleetGetsSkyrlsInitAndWsyncFieldsOnlyWhereWsync) {
  std::vector<std::string> urls = Serve({{false, false}, {true, false}});
  DeltaTrainerOptions d;
  d.base_model_path = "/models/qwen";
  auto trainer = Trainer(urls, d);
  ASSERT_TRUE(trainer.ok()) << trainer.status().ToString();
  HostTensorSource source = Source(1);
  ASSERT_TRUE((*trainer)->Init(source.metadata()).ok());
  const std::string local = DefaultSkyrlLocalCheckpointDir((dir_ / "sync").string());
  EXPECT_EQ(services_[0]->init(), json({{"base_model_path", "/models/qwen"}, {"local_checkpoint_dir", local}}));
  EXPECT_EQ(services_[1]->init(),
            json({{"base_model_path", "/models/qwen"}, {"local_checkpoint_dir", local},
                  {"sync_dir", (dir_ / "sync").string()}, {"format_version", delta::kManifestFormatVersion}}));
  (*trainer)->Shutdown();
}

TEST_F(DeltaTrainerTest, ANonWsyncFleetWithoutABasePathIsRefusedBeforeAnyInit) {
  std::vector<std::string> urls = Serve({{true, false}, {false, false}});
  auto trainer = Trainer(urls, {});
  ASSERT_TRUE(trainer.ok());
  HostTensorSource source = Source(1);
  Status s = (*trainer)->Init(source.metadata());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find(urls[1]), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("base_model_path"), std::string::npos) << s.message();
  EXPECT_TRUE(services_[0]->init().is_null());
  EXPECT_TRUE(services_[1]->init().is_null());
}

TEST_F(DeltaTrainerTest, ASyncFollowsSkyrlsOrderAndResetsOnlyCachingServers) {
  // A vLLM server with prefix caching, a wsync server without, a wsync server with.
  std::vector<std::string> urls = Serve({{false, true}, {true, false}, {true, true}});
  DeltaTrainerOptions d;
  d.base_model_path = "/models/qwen";
  d.local_checkpoint_dir = "/var/ckpt";
  auto trainer = Trainer(urls, d);
  ASSERT_TRUE(trainer.ok());
  HostTensorSource source = Source(1);
  ASSERT_TRUE((*trainer)->Init(source.metadata()).ok());
  for (auto& s : services_) s->ClearCalls();
  auto stats = (*trainer)->SendWeights(source, std::string("v1"));
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  const std::vector<std::string> with_reset = {"fetch",  "pause keep clear_cache=false",
                                               "reset_prefix_cache running=true", "start", "update",
                                               "finish v1", "resume"};
  std::vector<std::string> without = with_reset;
  without.erase(without.begin() + 2);
  EXPECT_EQ(services_[0]->calls(), with_reset);
  EXPECT_EQ(services_[1]->calls(), without);
  EXPECT_EQ(services_[2]->calls(), with_reset);
  const std::string uri = delta::VersionDir((dir_ / "sync").string(), 1);
  EXPECT_EQ(services_[0]->fetch(), json({{"target_version", 1}, {"sync_dir", (dir_ / "sync").string()}, {"uri", uri}}));
  EXPECT_EQ(services_[0]->update(), json({{"target_version", 1}, {"version", 1}, {"sync_dir", (dir_ / "sync").string()},
                                        {"uri", uri}}));
  (*trainer)->Shutdown();
}

}  // namespace
}  // namespace wsync
