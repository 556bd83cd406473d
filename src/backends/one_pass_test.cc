// The engine skeleton with every backend's data plane, against real servers on loopback:
// each sync iterates the source exactly once on every rank, and a source that lies in
// the middle of its pass fails the sync naming the tensor, leaves the servers'
// weights_consistent false, and the next sync (no Init in between) lands bit-exact.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include "backends/delta/testing.h"
#include "core/digest.h"
#include "model/config.h"
#include "server/inference_server.h"
#include "testing/faulty_source.h"
#include "testing/test_server.h"
#include "synthetic/synthetic.h"
#include "receiver/backend.h"
#include "wsync/trainer.h"

namespace wsync {
namespace {

using testing::ExpectServerHolds;
using testing::FaultySource;
using testing::FaultySourceOptions;
using testing::TestServer;

TestServer StartServer(const std::string& backend, int tp) {
  InferenceServerOptions o;
  o.model = "qwen3-tiny";
  o.tp = tp;
  o.backend = backend;
  o.timeout_seconds = 20;
  return std::move(*TestServer::Start(o, CreateReceiverBackend));
}

std::unique_ptr<SyntheticTrainer> Trainer(uint64_t seed) {
  return std::move(*SyntheticTrainer::FromMetadata(HfTensors(*LookupModel("qwen3-tiny")), seed, 2));
}

class OnePass : public ::testing::TestWithParam<const char*> {};

TEST_P(OnePass, EverySyncIteratesTheSourceOncePerRank) {
  const std::string backend = GetParam();
  auto trainer = Trainer(3);
  TestServer a = StartServer(backend, 2);
  TrainerOptions o;
  o.backend = backend;
  o.servers = {a.url()};
  o.timeout_seconds = 20;
  o.bucket_gb = 1.0 / 1024;  // several chunks
  auto sender = *CreateTrainerEngine(o);
  TrainerOptions other = o;
  other.rank = 1;
  other.servers.clear();
  auto drainer = *CreateTrainerEngine(other);
  ASSERT_TRUE(sender->Init(trainer->metadata()).ok());
  ASSERT_TRUE(drainer->Init(trainer->metadata()).ok());
  FaultySource rank0(&trainer->source()), rank1(&trainer->source());
  for (int sync = 1; sync <= 2; ++sync) {
    if (sync > 1) ASSERT_TRUE(trainer->Step(sync).ok());
    auto stats = sender->SendWeights(rank0, "v" + std::to_string(sync));
    ASSERT_TRUE(stats.ok()) << stats.status().ToString();
    auto drained = drainer->SendWeights(rank1, std::nullopt);
    ASSERT_TRUE(drained.ok()) << drained.status().ToString();
    EXPECT_EQ(rank0.passes(), sync);
    EXPECT_EQ(rank1.passes(), sync);
    EXPECT_EQ(drained->bytes, 0u);  // it sends nothing
    ExpectServerHolds(*a.service, trainer->source());
  }
  EXPECT_EQ(a.service->WeightVersion(), "v2");
}

TEST_P(OnePass, ASourceThatLiesMidStreamFailsTheSyncAndTheNextOneLands) {
  const std::string backend = GetParam();
  auto trainer = Trainer(4);
  TestServer a = StartServer(backend, 2);
  TestServer b = StartServer(backend, 2);  // every server of a broadcast runs one layout
  TrainerOptions o;
  o.backend = backend;
  o.servers = {a.url(), b.url()};
  o.timeout_seconds = 20;
  o.bucket_gb = 1.0 / 1024;  // the bad tensor comes after chunks already sent
  auto engine = *CreateTrainerEngine(o);
  ASSERT_TRUE(engine->Init(trainer->metadata()).ok());
  const size_t bad = trainer->metadata().size() - 2;
  FaultySource source(&trainer->source(), FaultySourceOptions{.lie_bytes_at = bad, .lie_bytes_pass = 1});
  auto t0 = std::chrono::steady_clock::now();
  auto r = engine->SendWeights(source, std::nullopt);
  ASSERT_FALSE(r.ok());
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(15));
  const std::string& bad_name = trainer->metadata()[bad].name;
  EXPECT_NE(r.status().message().find(bad_name), std::string::npos) << r.status().ToString();
  EXPECT_EQ(source.passes(), 1);
  for (TestServer* s : {&a, &b}) {
    EXPECT_EQ(s->service->Health()["weights_consistent"], false) << s->url();
    EXPECT_EQ(s->service->Health()["session_active"], false) << s->url();
  }
  // The next sync: no Init in between, one pass, bit-exact everywhere.
  source.options().lie_bytes_at.reset();
  auto next = engine->SendWeights(source, "good");
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  EXPECT_EQ(source.passes(), 2);
  for (TestServer* s : {&a, &b}) {
    ExpectServerHolds(*s->service, trainer->source());
    EXPECT_EQ(s->service->Health()["weights_consistent"], true);
    EXPECT_EQ(s->service->WeightVersion(), "good");
  }
}

// Metadata one tensor short of what the pass yields: the extra tensor is named.
TEST_P(OnePass, ASourceYieldingMoreThanItsMetadataFailsNamingTheExtraTensor) {
  const std::string backend = GetParam();
  auto trainer = Trainer(6);
  TestServer a = StartServer(backend, 1);
  TrainerOptions o;
  o.backend = backend;
  o.servers = {a.url()};
  o.timeout_seconds = 20;
  o.bucket_gb = 1.0 / 1024;
  FaultySource source(&trainer->source(), FaultySourceOptions{.metadata_omits_last = true});
  auto engine = *CreateTrainerEngine(o);
  ASSERT_TRUE(engine->Init(source.metadata()).ok());
  auto r = engine->SendWeights(source, std::nullopt);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
  EXPECT_NE(r.status().message().find(trainer->metadata().back().name), std::string::npos) << r.status().ToString();
}

INSTANTIATE_TEST_SUITE_P(Backends, OnePass, ::testing::Values("nccl", "ipc"));

// delta: rank 0 publishes from its one pass (no servers here: publishing alone), and a
// rank that sends nothing drains one pass too.
TEST(OnePassDelta, PublishingIteratesTheSourceOncePerRank) {
  auto trainer = Trainer(5);
  delta::testing::TempDir dir("one-pass");
  TrainerOptions o;
  o.backend = "delta";
  o.backend_options["sync_dir"] = dir / "sync";
  auto engine = *CreateTrainerEngine(o);
  TrainerOptions other = o;
  other.rank = 1;
  auto drainer = *CreateTrainerEngine(other);
  ASSERT_TRUE(engine->Init(trainer->metadata()).ok());
  ASSERT_TRUE(drainer->Init(trainer->metadata()).ok());
  FaultySource rank0(&trainer->source()), rank1(&trainer->source());
  for (int sync = 1; sync <= 2; ++sync) {
    if (sync > 1) ASSERT_TRUE(trainer->Step(sync).ok());
    auto stats = engine->SendWeights(rank0, std::nullopt);
    ASSERT_TRUE(stats.ok()) << stats.status().ToString();
    ASSERT_TRUE(drainer->SendWeights(rank1, std::nullopt).ok());
    EXPECT_EQ(rank0.passes(), sync);
    EXPECT_EQ(rank1.passes(), sync);
  }
  // A mid-stream lie fails the publish naming the tensor, after the same one pass.
  rank0.options().lie_bytes_at = 5;
  rank0.options().lie_bytes_pass = 3;
  auto r = engine->SendWeights(rank0, std::nullopt);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find(trainer->metadata()[5].name), std::string::npos) << r.status().ToString();
  EXPECT_EQ(rank0.passes(), 3);
}

TEST(BackendOptions, UnknownKeysAndBadValuesAreNamed) {
  TrainerOptions o;
  o.servers = {"http://127.0.0.1:1"};
  o.backend = "nccl";
  o.backend_options["piece_mb"] = "many";
  auto r = CreateTrainerEngine(o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), "nccl option piece_mb=many: not a number");
  o.backend = "ipc";
  o.backend_options = {{"mode", "zero_copy"}, {"modes", "x"}};
  r = CreateTrainerEngine(o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("backend 'ipc' has no option 'modes'"), std::string::npos)
      << r.status().message();
  o.backend_options = {{"mode", "fast"}};
  EXPECT_EQ(CreateTrainerEngine(o).status().message(), "ipc option mode=fast: not one of auto, packed, zero_copy");
}

}  // namespace
}  // namespace wsync
