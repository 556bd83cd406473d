// The engine skeleton with every backend's data plane, against real servers on loopback:
// each sync iterates the source exactly once on every rank, and a source that lies in
// the middle of its pass fails the sync naming the tensor, leaves the servers'
// weights_consistent false, and the next sync (no Init in between) lands bit-exact.
#include <gtest/gtest.h>

#include <atomic>

#include <fmt/format.h>

#include "backends/delta/testing.h"
#include "control/http_server.h"
#include "core/digest.h"
#include "model/config.h"
#include "receiver/inference_server.h"
#include "synthetic/synthetic.h"
#include "receiver/backend.h"
#include "wsync/trainer.h"

namespace wsync {
namespace {

struct Server {
  std::unique_ptr<InferenceServer> service;
  std::unique_ptr<HttpControlServer> http;
};

Server StartServer(const std::string& backend, int tp) {
  InferenceServerOptions o;
  o.model = "qwen3-tiny";
  o.tp = tp;
  o.backend = backend;
  o.timeout_seconds = 20;
  Server s;
  s.service = std::move(*InferenceServer::Create(o, CreateReceiverBackend));
  s.http = std::move(*HttpControlServer::Start(HttpServerOptions{}, s.service.get()));
  s.service->set_url(s.http->url());
  return s;
}

void ExpectServerHolds(InferenceServer& server, WeightSource& source) {
  auto sums = server.Checksums(DigestAlgorithm::kXxh3_128);
  ASSERT_TRUE(sums.ok()) << sums.status().ToString();
  auto stream = *source.Iterate();
  TensorRef t;
  size_t n = 0;
  while (*stream->Next(&t)) {
    EXPECT_EQ((*sums)[std::string(t.name)], HexDigest(DigestAlgorithm::kXxh3_128, t.bytes)) << t.name;
    ++n;
  }
  EXPECT_EQ(n, sums->size());
}

// Counts the passes made over `inner`; from pass `lie_on_pass` on (1-based; 0: never),
// tensor `bad` comes out one element short, after every tensor before it.
class CountingSource : public WeightSource {
 public:
  explicit CountingSource(WeightSource& inner) : inner_(inner) {}
  const std::vector<TensorMeta>& metadata() const override { return inner_.metadata(); }
  Result<std::unique_ptr<TensorStream>> Iterate() override {
    ++passes;
    WSYNC_ASSIGN_OR_RETURN(auto s, inner_.Iterate());
    if (lie_on_pass == 0 || passes < lie_on_pass) return s;
    class Lying final : public TensorStream {
     public:
      Lying(std::unique_ptr<TensorStream> s, size_t bad) : s_(std::move(s)), bad_(bad) {}
      Result<bool> Next(TensorRef* out) override {
        WSYNC_ASSIGN_OR_RETURN(bool more, s_->Next(out));
        if (more && i_++ == bad_) {
          shape_.assign(out->shape.begin(), out->shape.end());
          shape_.back() -= 1;
          out->shape = shape_;
          out->bytes = out->bytes.first(out->bytes.size() / (shape_.back() + 1) * shape_.back());
        }
        return more;
      }

     private:
      std::unique_ptr<TensorStream> s_;
      size_t bad_;
      size_t i_ = 0;
      Shape shape_;
    };
    return std::unique_ptr<TensorStream>(std::make_unique<Lying>(std::move(s), bad));
  }
  std::atomic<int> passes{0};
  int lie_on_pass = 0;
  size_t bad = 0;

 private:
  WeightSource& inner_;
};

std::unique_ptr<SyntheticTrainer> Trainer(uint64_t seed) {
  return std::move(*SyntheticTrainer::FromMetadata(HfTensors(*LookupModel("qwen3-tiny")), seed, 2));
}

class OnePass : public ::testing::TestWithParam<const char*> {};

TEST_P(OnePass, EverySyncIteratesTheSourceOncePerRank) {
  const std::string backend = GetParam();
  auto trainer = Trainer(3);
  Server a = StartServer(backend, 2);
  TrainerOptions o;
  o.backend = backend;
  o.servers = {a.http->url()};
  o.timeout_seconds = 20;
  o.bucket_gb = 1.0 / 1024;  // several chunks
  auto sender = *CreateTrainerEngine(o);
  TrainerOptions other = o;
  other.rank = 1;
  other.servers.clear();
  auto drainer = *CreateTrainerEngine(other);
  ASSERT_TRUE(sender->Init(trainer->metadata()).ok());
  ASSERT_TRUE(drainer->Init(trainer->metadata()).ok());
  CountingSource rank0(trainer->source()), rank1(trainer->source());
  for (int sync = 1; sync <= 2; ++sync) {
    if (sync > 1) ASSERT_TRUE(trainer->Step(sync).ok());
    auto stats = sender->SendWeights(rank0, "v" + std::to_string(sync));
    ASSERT_TRUE(stats.ok()) << stats.status().ToString();
    auto drained = drainer->SendWeights(rank1, std::nullopt);
    ASSERT_TRUE(drained.ok()) << drained.status().ToString();
    EXPECT_EQ(rank0.passes, sync);
    EXPECT_EQ(rank1.passes, sync);
    EXPECT_EQ(drained->bytes, 0u);  // it sends nothing
    ExpectServerHolds(*a.service, trainer->source());
  }
  EXPECT_EQ(a.service->WeightVersion(), "v2");
}

TEST_P(OnePass, ASourceThatLiesMidStreamFailsTheSyncAndTheNextOneLands) {
  const std::string backend = GetParam();
  auto trainer = Trainer(4);
  Server a = StartServer(backend, 2);
  Server b = StartServer(backend, 2);  // every server of a broadcast runs one layout
  TrainerOptions o;
  o.backend = backend;
  o.servers = {a.http->url(), b.http->url()};
  o.timeout_seconds = 20;
  o.bucket_gb = 1.0 / 1024;  // the bad tensor comes after chunks already sent
  auto engine = *CreateTrainerEngine(o);
  ASSERT_TRUE(engine->Init(trainer->metadata()).ok());
  CountingSource source(trainer->source());
  source.lie_on_pass = 1;
  source.bad = trainer->metadata().size() - 2;
  auto t0 = std::chrono::steady_clock::now();
  auto r = engine->SendWeights(source, std::nullopt);
  ASSERT_FALSE(r.ok());
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(15));
  const std::string& bad_name = trainer->metadata()[source.bad].name;
  EXPECT_NE(r.status().message().find(bad_name), std::string::npos) << r.status().ToString();
  EXPECT_EQ(source.passes, 1);
  for (Server* s : {&a, &b}) {
    EXPECT_EQ(s->service->Health()["weights_consistent"], false) << s->http->url();
    EXPECT_EQ(s->service->Health()["session_active"], false) << s->http->url();
  }
  // The next sync: no Init in between, one pass, bit-exact everywhere.
  source.lie_on_pass = 0;
  auto next = engine->SendWeights(source, "good");
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  EXPECT_EQ(source.passes, 2);
  for (Server* s : {&a, &b}) {
    ExpectServerHolds(*s->service, trainer->source());
    EXPECT_EQ(s->service->Health()["weights_consistent"], true);
    EXPECT_EQ(s->service->WeightVersion(), "good");
  }
}

// Metadata one tensor short of what the pass yields: the extra tensor is named.
class ExtraTensorSource : public WeightSource {
 public:
  explicit ExtraTensorSource(WeightSource& inner) : inner_(inner), meta_(inner.metadata()) { meta_.pop_back(); }
  const std::vector<TensorMeta>& metadata() const override { return meta_; }
  Result<std::unique_ptr<TensorStream>> Iterate() override { return inner_.Iterate(); }

 private:
  WeightSource& inner_;
  std::vector<TensorMeta> meta_;
};

TEST_P(OnePass, ASourceYieldingMoreThanItsMetadataFailsNamingTheExtraTensor) {
  const std::string backend = GetParam();
  auto trainer = Trainer(6);
  Server a = StartServer(backend, 1);
  TrainerOptions o;
  o.backend = backend;
  o.servers = {a.http->url()};
  o.timeout_seconds = 20;
  o.bucket_gb = 1.0 / 1024;
  ExtraTensorSource source(trainer->source());
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
  CountingSource rank0(trainer->source()), rank1(trainer->source());
  for (int sync = 1; sync <= 2; ++sync) {
    if (sync > 1) ASSERT_TRUE(trainer->Step(sync).ok());
    auto stats = engine->SendWeights(rank0, std::nullopt);
    ASSERT_TRUE(stats.ok()) << stats.status().ToString();
    ASSERT_TRUE(drainer->SendWeights(rank1, std::nullopt).ok());
    EXPECT_EQ(rank0.passes, sync);
    EXPECT_EQ(rank1.passes, sync);
  }
  // A mid-stream lie fails the publish naming the tensor, after the same one pass.
  rank0.lie_on_pass = 3;
  rank0.bad = 5;
  auto r = engine->SendWeights(rank0, std::nullopt);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find(trainer->metadata()[5].name), std::string::npos) << r.status().ToString();
  EXPECT_EQ(rank0.passes, 3);
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
