// The toy generation: its token function, its request parser, pause abort|wait|keep with
// requests in flight, aborts, the prefix cache (hits, staleness across a weight change,
// resets, drop and restore of its memory), against a Generator whose weights a test sets,
// and against a real InferenceServer whose weights a weight session changes.
#include "server/generation.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <thread>

#include "model/worker_sink.h"
#include "server/inference_server.h"

namespace wsync {
namespace {

using nlohmann::json;
using namespace std::chrono_literals;

// Tokens the header's token function gives: `probe` stands for the weights of every step.
std::vector<int32_t> Expected(const std::vector<int32_t>& prompt, int n, const std::function<uint64_t(int64_t)>& probe,
                              int64_t vocab, uint64_t state = kInitialState, size_t from = 0) {
  for (size_t k = from; k < prompt.size(); ++k) state = AbsorbToken(state, prompt[k], probe(prompt[k]));
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) {
    if (i > 0) state = AbsorbToken(state, out.back(), probe(out.back()));
    out.push_back(static_cast<int32_t>(SampleToken(state, vocab)));
  }
  return out;
}

std::vector<int32_t> Ids(const json& reply) { return reply["choices"][0]["token_ids"].get<std::vector<int32_t>>(); }

// Weights a test sets: probe(t) = Mix(t ^ salt); the gate closes while `closed` is set.
struct FakeWeights {
  std::atomic<uint64_t> salt{1};
  std::atomic<bool> closed{false};
  std::mutex mu;
  std::string version = "v1";
  uint64_t Probe(int64_t t) const { return GenerationMix(static_cast<uint64_t>(t) ^ salt.load()); }
  Generator::WithWeights Access() {
    return [this](const Generator::Step& step, std::string* why) {
      if (closed) {
        *why = "the test's weights";
        return false;
      }
      std::string v;
      {
        std::lock_guard lock(mu);
        v = version;
      }
      step([this](int64_t t) -> Result<uint64_t> { return Probe(t); }, v);
      return true;
    };
  }
  void Set(uint64_t s, std::string v) {
    std::lock_guard lock(mu);
    salt = s;
    version = std::move(v);
  }
};

constexpr int64_t kVocab = 4096;

class GeneratorTest : public ::testing::Test {
 protected:
  void Make(double interval_ms, double timeout = 10, size_t kv_bytes = size_t{1} << 20) {
    GeneratorOptions o;
    o.limits.model = "qwen3-tiny";
    o.limits.vocab_size = kVocab;
    o.token_interval_ms = interval_ms;
    o.timeout_seconds = timeout;
    o.kv_cache_bytes = kv_bytes;
    o.kv_block_bytes = 4096;
    auto g = Generator::Create(o, weights_.Access());
    ASSERT_TRUE(g.ok()) << g.status().ToString();
    gen_ = std::move(*g);
  }
  std::future<Result<json>> Async(json body) {
    return std::async(std::launch::async, [this, body] { return gen_->Complete(body); });
  }
  // Waits until /health says `n` requests run.
  void AwaitRunning(size_t n) {
    auto until = std::chrono::steady_clock::now() + 10s;
    while (gen_->Health()["running"].get<size_t>() != n && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(2ms);
    }
    ASSERT_EQ(gen_->Health()["running"].get<size_t>(), n);
  }
  FakeWeights weights_;
  std::unique_ptr<Generator> gen_;
};

std::vector<int32_t> Range(int n, int first = 1) {
  std::vector<int32_t> v;
  for (int i = 0; i < n; ++i) v.push_back(first + i);
  return v;
}

TEST(TokenFunction, ProbeFoldsLittleEndianWordsAndZeroPadsTheTail) {
  std::byte row[8], norm[3];
  for (int i = 0; i < 8; ++i) row[i] = std::byte(i + 1);
  for (int i = 0; i < 3; ++i) norm[i] = std::byte(0xa0 + i);
  uint64_t h = GenerationMix(kProbeSeed ^ 0x0807060504030201ULL);
  h = GenerationMix(h ^ 0xa2a1a0ULL);
  EXPECT_EQ(WeightProbe(row, norm), h);
  EXPECT_EQ(AbsorbToken(5, 7, 9), GenerationMix((5 ^ 9) + 8 * kGolden));
  EXPECT_EQ(SampleToken(4097, 4096), 1);
  const int32_t toks[] = {72, 105, 10, 300};
  EXPECT_EQ(RenderTokens(toks), "Hi<10><300>");
}

TEST(ParseCompletionRequest, NamesTheFieldItRefuses) {
  CompletionLimits l;
  l.model = "qwen3-tiny";
  l.vocab_size = 4096;
  auto ok = ParseCompletionRequest(json{{"prompt", "Hi"}, {"model", "qwen3-tiny"}, {"request_id", "r"}}, l);
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->prompt, (std::vector<int32_t>{72, 105}));
  EXPECT_EQ(ok->max_tokens, 16);
  EXPECT_EQ(ok->request_id, "r");
  struct Case {
    json body;
    StatusCode code;
    std::string needle;
  };
  const Case cases[] = {
      {json::object(), StatusCode::kInvalidArgument, "'prompt'"},
      {json{{"prompt", ""}}, StatusCode::kInvalidArgument, "'prompt' is empty"},
      {json{{"prompt", {1, 4096}}}, StatusCode::kInvalidArgument, "element 1"},
      {json{{"prompt", {1, -1}}}, StatusCode::kInvalidArgument, "element 1"},
      {json{{"prompt", {"a"}}}, StatusCode::kInvalidArgument, "element 0"},
      {json{{"prompt", 3}}, StatusCode::kInvalidArgument, "'prompt'"},
      {json{{"prompt", "x"}, {"max_tokens", 0}}, StatusCode::kInvalidArgument, "'max_tokens'"},
      {json{{"prompt", "x"}, {"max_tokens", 4097}}, StatusCode::kInvalidArgument, "'max_tokens'"},
      {json{{"prompt", "x"}, {"max_tokens", 1.5}}, StatusCode::kInvalidArgument, "'max_tokens'"},
      {json{{"prompt", "x"}, {"model", "gpt"}}, StatusCode::kNotFound, "`gpt` does not exist"},
      {json{{"prompt", "x"}, {"stream", true}}, StatusCode::kInvalidArgument, "'stream'"},
      {json{{"prompt", "x"}, {"n", 2}}, StatusCode::kInvalidArgument, "'n'"},
      {json{{"prompt", "x"}, {"request_id", 5}}, StatusCode::kInvalidArgument, "'request_id'"},
      {json{{"prompt", "x"}, {"request_id", std::string(300, 'r')}}, StatusCode::kInvalidArgument, "'request_id'"},
  };
  for (const Case& c : cases) {
    auto r = ParseCompletionRequest(c.body, l);
    ASSERT_FALSE(r.ok()) << c.body.dump();
    EXPECT_EQ(r.status().code(), c.code) << c.body.dump();
    EXPECT_NE(r.status().message().find(c.needle), std::string::npos) << r.status().ToString();
  }
}

TEST_F(GeneratorTest, TokensFollowTheDocumentedFunctionAndReplyLikeVllm) {
  Make(0);
  auto r = gen_->Complete(json{{"prompt", "Hello"}, {"max_tokens", 5}});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  std::vector<int32_t> prompt{'H', 'e', 'l', 'l', 'o'};
  auto probe = [this](int64_t t) { return weights_.Probe(t); };
  EXPECT_EQ(Ids(*r), Expected(prompt, 5, probe, kVocab));
  const json& c = (*r)["choices"][0];
  EXPECT_EQ(c["finish_reason"], "length");
  EXPECT_EQ(c["weight_versions"], json({"v1", "v1", "v1", "v1", "v1"}));
  EXPECT_EQ(c["text"], RenderTokens(Ids(*r)));
  EXPECT_EQ((*r)["object"], "text_completion");
  EXPECT_EQ((*r)["model"], "qwen3-tiny");
  EXPECT_EQ((*r)["id"], "cmpl-0");
  EXPECT_EQ((*r)["weight_version"], "v1");
  EXPECT_EQ((*r)["usage"], json({{"prompt_tokens", 5},
                                 {"completion_tokens", 5},
                                 {"total_tokens", 10},
                                 {"prompt_tokens_details", {{"cached_tokens", 0}}}}));
  EXPECT_EQ(gen_->Health()["completed"], 1);
}

TEST_F(GeneratorTest, PrefixCacheHitsAreWholeBlocksBeforeTheLastTokenAndGoStaleUntilReset) {
  Make(0);
  const std::vector<int32_t> prompt = Range(40);
  auto old_probe = [](int64_t t) { return GenerationMix(static_cast<uint64_t>(t) ^ 1); };
  auto first = gen_->Complete(json{{"prompt", prompt}, {"max_tokens", 4}});
  ASSERT_TRUE(first.ok());
  EXPECT_EQ((*first)["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  EXPECT_EQ(gen_->Health()["prefix_cache"]["entries"], 2);
  // Exactly two blocks long: the last token is computed, so one block is a hit.
  auto exact = gen_->Complete(json{{"prompt", Range(32)}, {"max_tokens", 1}});
  EXPECT_EQ((*exact)["usage"]["prompt_tokens_details"]["cached_tokens"], 16);

  // The weights change without a reset: the cached state of 32 tokens is the old one.
  weights_.Set(2, "v2");
  auto new_probe = [](int64_t t) { return GenerationMix(static_cast<uint64_t>(t) ^ 2); };
  auto stale = gen_->Complete(json{{"prompt", prompt}, {"max_tokens", 4}});
  ASSERT_TRUE(stale.ok());
  EXPECT_EQ((*stale)["usage"]["prompt_tokens_details"]["cached_tokens"], 32);
  uint64_t old_state = kInitialState;
  for (int k = 0; k < 32; ++k) old_state = AbsorbToken(old_state, prompt[k], old_probe(prompt[k]));
  EXPECT_EQ(Ids(*stale), Expected(prompt, 4, new_probe, kVocab, old_state, 32));
  EXPECT_NE(Ids(*stale), Expected(prompt, 4, new_probe, kVocab));

  EXPECT_TRUE(gen_->ResetPrefixCache(false));
  EXPECT_EQ(gen_->Health()["prefix_cache"]["entries"], 0);
  EXPECT_EQ(gen_->Health()["prefix_cache"]["resets"], 1);
  auto fresh = gen_->Complete(json{{"prompt", prompt}, {"max_tokens", 4}});
  EXPECT_EQ((*fresh)["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  EXPECT_EQ(Ids(*fresh), Expected(prompt, 4, new_probe, kVocab));
  EXPECT_EQ(gen_->Health()["prefix_cache"]["hits"], 2);
}

TEST_F(GeneratorTest, PauseAbortEndsRequestsInFlightWithTheirTokensAndQueuesNewOnes) {
  Make(5);
  auto a = Async(json{{"prompt", "a"}, {"max_tokens", 4000}, {"request_id", "A"}});
  AwaitRunning(1);
  std::this_thread::sleep_for(30ms);
  ASSERT_TRUE(gen_->Pause("abort", true).ok());
  auto r = a.get();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ((*r)["choices"][0]["finish_reason"], "abort");
  size_t n = Ids(*r).size();
  EXPECT_GT(n, 0u);
  EXPECT_LT(n, 4000u);
  EXPECT_EQ(Ids(*r), Expected({'a'}, static_cast<int>(n), [this](int64_t t) { return weights_.Probe(t); }, kVocab));
  EXPECT_TRUE(gen_->IsPaused());
  // A request made while paused waits for the resume.
  auto b = Async(json{{"prompt", "b"}, {"max_tokens", 2}});
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(gen_->Health()["waiting"], 1);
  EXPECT_EQ(b.wait_for(0s), std::future_status::timeout);
  ASSERT_TRUE(gen_->Resume().ok());
  EXPECT_EQ(Ids(*b.get()).size(), 2u);
  EXPECT_EQ(gen_->Health()["aborted"], 1);
}

TEST_F(GeneratorTest, PauseWaitReturnsOnlyOnceRequestsInFlightHaveFinished) {
  Make(5);
  auto a = Async(json{{"prompt", "a"}, {"max_tokens", 30}});
  auto b = Async(json{{"prompt", "b"}, {"max_tokens", 20}});
  AwaitRunning(2);
  ASSERT_TRUE(gen_->Pause("wait", false).ok());
  json h = gen_->Health();  // both had ended when the pause returned
  EXPECT_EQ(h["running"], 0);
  EXPECT_EQ(h["completed"], 2);
  EXPECT_EQ(Ids(*a.get()).size(), 30u);
  EXPECT_EQ(Ids(*b.get()).size(), 20u);
  EXPECT_EQ(gen_->Health()["pause_mode"], "wait");
}

TEST_F(GeneratorTest, PauseWaitThatCannotDrainIsDeadlineExceededNamingTheRequest) {
  Make(5, /*timeout=*/0.3);
  auto a = Async(json{{"prompt", "a"}, {"max_tokens", 4000}, {"request_id", "long-one"}});
  AwaitRunning(1);
  Status s = gen_->Pause("wait", true);
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(s.message().find("long-one ("), std::string::npos) << s.ToString();
  EXPECT_TRUE(gen_->IsPaused());
  EXPECT_EQ(gen_->Abort({"long-one"}), 1);
  EXPECT_EQ((*a.get())["choices"][0]["finish_reason"], "abort");
}

TEST_F(GeneratorTest, PauseKeepFreezesAndLaterTokensComeFromTheWeightsOfTheirStep) {
  Make(5);
  const std::vector<int32_t> prompt = Range(20, 100);
  auto a = Async(json{{"prompt", prompt}, {"max_tokens", 40}});
  AwaitRunning(1);
  std::this_thread::sleep_for(20ms);
  ASSERT_TRUE(gen_->Pause("keep", true).ok());
  json h = gen_->Health();
  EXPECT_EQ(h["pause_mode"], "keep");
  EXPECT_EQ(h["prefix_cache"]["entries"], 1);  // keep never clears
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(a.wait_for(0s), std::future_status::timeout);
  weights_.Set(7, "v2");
  ASSERT_TRUE(gen_->Resume().ok());
  auto r = a.get();
  ASSERT_TRUE(r.ok());
  auto versions = (*r)["choices"][0]["weight_versions"].get<std::vector<std::string>>();
  ASSERT_EQ(versions.size(), 40u);
  size_t k = std::find(versions.begin(), versions.end(), "v2") - versions.begin();
  ASSERT_GT(k, 0u);
  ASSERT_LT(k, 40u);
  for (size_t i = k; i < 40; ++i) EXPECT_EQ(versions[i], "v2");
  // Tokens before k from the old weights; from k on, each step absorbs with the new ones.
  auto ids = Ids(*r);
  auto old_probe = [](int64_t t) { return GenerationMix(static_cast<uint64_t>(t) ^ 1); };
  auto new_probe = [](int64_t t) { return GenerationMix(static_cast<uint64_t>(t) ^ 7); };
  std::vector<int32_t> before = Expected(prompt, static_cast<int>(k), old_probe, kVocab);
  EXPECT_EQ(std::vector<int32_t>(ids.begin(), ids.begin() + k), before);
  uint64_t s = kInitialState;
  for (int32_t t : prompt) s = AbsorbToken(s, t, old_probe(t));
  for (size_t i = 0; i + 1 < k; ++i) s = AbsorbToken(s, ids[i], old_probe(ids[i]));
  for (size_t i = k; i < 40; ++i) {
    s = AbsorbToken(s, ids[i - 1], new_probe(ids[i - 1]));
    EXPECT_EQ(ids[i], SampleToken(s, kVocab)) << i;
  }
  EXPECT_NE(ids, Expected(prompt, 40, old_probe, kVocab));
}

TEST_F(GeneratorTest, ResetWithRunningRequestsFailsUnlessTheyAreResetAndThenRecomputes) {
  Make(5);
  const std::vector<int32_t> prompt = Range(20, 7);
  auto a = Async(json{{"prompt", prompt}, {"max_tokens", 30}});
  AwaitRunning(1);
  ASSERT_TRUE(gen_->Pause("keep", false).ok());
  EXPECT_FALSE(gen_->ResetPrefixCache(false));
  EXPECT_EQ(gen_->Health()["prefix_cache"]["entries"], 1);
  weights_.Set(9, "v2");
  EXPECT_TRUE(gen_->ResetPrefixCache(true));
  EXPECT_EQ(gen_->Health()["prefix_cache"]["entries"], 0);
  ASSERT_TRUE(gen_->Resume().ok());
  auto r = a.get();
  ASSERT_TRUE(r.ok());
  auto ids = Ids(*r);
  auto versions = (*r)["choices"][0]["weight_versions"].get<std::vector<std::string>>();
  size_t k = std::find(versions.begin(), versions.end(), "v2") - versions.begin();
  ASSERT_GT(k, 0u);
  ASSERT_LT(k, 30u);
  // The first step after the reset recomputes prompt and tokens so far with the new weights.
  auto new_probe = [](int64_t t) { return GenerationMix(static_cast<uint64_t>(t) ^ 9); };
  uint64_t s = kInitialState;
  for (int32_t t : prompt) s = AbsorbToken(s, t, new_probe(t));
  for (size_t i = 0; i < k; ++i) s = AbsorbToken(s, ids[i], new_probe(ids[i]));
  EXPECT_EQ(ids[k], SampleToken(s, kVocab));
}

TEST_F(GeneratorTest, AbortRequestsByIdAndAllWithoutPausing) {
  Make(5);
  auto a = Async(json{{"prompt", "a"}, {"max_tokens", 4000}, {"request_id", "A"}});
  auto b = Async(json{{"prompt", "b"}, {"max_tokens", 4000}, {"request_id", "B"}});
  auto c = Async(json{{"prompt", "c"}, {"max_tokens", 4000}, {"request_id", "C"}});
  AwaitRunning(3);
  auto dup = gen_->Complete(json{{"prompt", "d"}, {"request_id", "A"}});
  EXPECT_EQ(dup.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(gen_->Abort({"B", "nope"}), 1);
  EXPECT_EQ((*b.get())["choices"][0]["finish_reason"], "abort");
  EXPECT_EQ(gen_->Abort({"nope"}), 0);
  EXPECT_FALSE(gen_->IsPaused());
  EXPECT_EQ(gen_->Abort({}), 2);
  EXPECT_EQ((*a.get())["choices"][0]["finish_reason"], "abort");
  EXPECT_EQ((*c.get())["choices"][0]["finish_reason"], "abort");
  EXPECT_EQ(gen_->Health()["aborted"], 3);
}

TEST_F(GeneratorTest, ARequestFrozenLongerThanTheTimeoutEndsWithAnErrorNamingIt) {
  Make(1, /*timeout=*/0.3);
  weights_.closed = true;
  auto r = gen_->Complete(json{{"prompt", "a"}, {"max_tokens", 3}, {"request_id", "stuck"}});
  EXPECT_EQ(r.status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(r.status().message().find("request stuck waited 0.3 s for the test's weights"), std::string::npos)
      << r.status().ToString();
  weights_.closed = false;
  ASSERT_TRUE(gen_->Pause("keep", false).ok());
  auto q = gen_->Complete(json{{"prompt", "a"}, {"max_tokens", 3}, {"request_id", "queued"}});
  EXPECT_EQ(q.status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(q.status().message().find("request queued waited 0.3 s in the queue"), std::string::npos)
      << q.status().ToString();
}

TEST_F(GeneratorTest, DropReleasesTheCacheMemoryAndRestoreBringsItBackEmpty) {
  Make(0, 10, size_t{4} << 20);
  EXPECT_TRUE(gen_->prefix_caching());
  EXPECT_EQ(gen_->kv_cache_bytes_resident(), size_t{4} << 20);
  ASSERT_TRUE(gen_->Complete(json{{"prompt", Range(40)}, {"max_tokens", 1}}).ok());
  ASSERT_TRUE(gen_->DropKvCache().ok());
  EXPECT_EQ(gen_->kv_cache_bytes_resident(), 0u);
  EXPECT_EQ(gen_->Health()["prefix_cache"]["entries"], 0);
  auto during = gen_->Complete(json{{"prompt", Range(40)}, {"max_tokens", 1}});
  EXPECT_EQ((*during)["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  ASSERT_TRUE(gen_->RestoreKvCache().ok());
  EXPECT_EQ(gen_->kv_cache_bytes_resident(), size_t{4} << 20);
  auto after = gen_->Complete(json{{"prompt", Range(40)}, {"max_tokens", 1}});
  EXPECT_EQ((*after)["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  auto again = gen_->Complete(json{{"prompt", Range(40)}, {"max_tokens", 1}});
  EXPECT_EQ((*again)["usage"]["prompt_tokens_details"]["cached_tokens"], 32);
}

TEST_F(GeneratorTest, ZeroCacheBytesDisablesPrefixCaching) {
  Make(0, 10, 0);
  EXPECT_FALSE(gen_->prefix_caching());
  EXPECT_EQ(gen_->kv_cache_bytes_resident(), 0u);
  ASSERT_TRUE(gen_->Complete(json{{"prompt", Range(40)}, {"max_tokens", 1}}).ok());
  auto again = gen_->Complete(json{{"prompt", Range(40)}, {"max_tokens", 1}});
  EXPECT_EQ((*again)["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  EXPECT_EQ(gen_->Health()["prefix_cache"]["enabled"], false);
}

TEST_F(GeneratorTest, ShutdownEndsRequestsInFlightAsUnavailable) {
  Make(5);
  auto a = Async(json{{"prompt", "a"}, {"max_tokens", 4000}});
  AwaitRunning(1);
  gen_->Shutdown();
  EXPECT_EQ(a.get().status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(gen_->Complete(json{{"prompt", "a"}}).status().code(), StatusCode::kUnavailable);
}

// ---- Against a real InferenceServer: the probe reads its shards, a weight session gates
// generation, and the weights a session lands change the tokens.

// Lands every tensor of an update as bytes filled with `fill` (set by the test).
class FillingBackend : public ReceiverBackend {
 public:
  FillingBackend(ReceiverContext* ctx, std::atomic<int>* fill) : ctx_(ctx), fill_(fill) {}
  std::string_view name() const override { return "filling"; }
  Status Init(const json&) override { return Status::Ok(); }
  Status Update(const UpdateRequest& req) override {
    WSYNC_RETURN_IF_ERROR(req.reject);
    for (const TensorMeta& t : *req.tensors) {
      std::vector<std::byte> bytes(t.nbytes(), std::byte(fill_->load()));
      for (const ReceiverWorker& w : ctx_->workers) {
        WSYNC_RETURN_IF_ERROR(w.sink->Load(TensorRef{t.name, t.dtype, t.shape, bytes, Device{}}));
      }
    }
    return Status::Ok();
  }

 private:
  ReceiverContext* ctx_;
  std::atomic<int>* fill_;
};

class ServerGenerationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    InferenceServerOptions o;
    o.model = "qwen3-tiny";
    o.tp = 2;
    o.token_interval_ms = 5;
    o.timeout_seconds = 10;
    auto make = [this](std::string_view, ReceiverContext* ctx) -> Result<std::unique_ptr<ReceiverBackend>> {
      return std::unique_ptr<ReceiverBackend>(std::make_unique<FillingBackend>(ctx, &fill_));
    };
    auto s = InferenceServer::Create(o, make);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    server_ = std::move(*s);
  }
  static json Update() {
    return json{{"names", {"model.embed_tokens.weight", "model.norm.weight"}},
                {"dtype_names", {"bfloat16", "bfloat16"}},
                {"shapes", {{4096, 256}, {256}}}};
  }
  // The probe of any token when embed_tokens and norm are filled with `byte` (qwen3-tiny:
  // rows of 256 bf16 values, 512 bytes; the norm too).
  static uint64_t FilledProbe(uint8_t byte) {
    std::vector<std::byte> row(512, std::byte(byte));
    return WeightProbe(row, row);
  }
  std::atomic<int> fill_{0};
  std::unique_ptr<InferenceServer> server_;
};

TEST_F(ServerGenerationTest, TokensComeFromTheShardsAndASessionHoldsGenerationUntilItFinishes) {
  const std::vector<int32_t> prompt{4000, 1, 2100};  // rows on tp1, tp0, tp1
  auto zeros = [](int64_t) { return FilledProbe(0); };
  // The server starts with synthetic weights: zero the two tensors the probe reads first.
  ASSERT_TRUE(server_->StartWeightUpdate().ok());
  ASSERT_TRUE(server_->UpdateWeights(Update()).ok());
  ASSERT_TRUE(server_->FinishWeightUpdate(std::nullopt).ok());
  auto r0 = server_->Complete(json{{"prompt", prompt}, {"max_tokens", 6}});
  ASSERT_TRUE(r0.ok()) << r0.status().ToString();
  EXPECT_EQ(Ids(*r0), Expected(prompt, 6, zeros, 4096));
  EXPECT_EQ((*r0)["choices"][0]["weight_versions"][0], "default");
  EXPECT_TRUE(server_->prefix_caching());
  EXPECT_EQ(server_->Health()["generation"]["completed"], 1);

  // A request in flight when a session starts waits for it, then reads the new weights.
  auto a = std::async(std::launch::async,
                      [&] { return server_->Complete(json{{"prompt", prompt}, {"max_tokens", 60}}); });
  auto until = std::chrono::steady_clock::now() + 10s;
  while (server_->Health()["generation"]["running"] != 1 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(2ms);
  }
  std::this_thread::sleep_for(20ms);
  ASSERT_TRUE(server_->StartWeightUpdate().ok());
  fill_ = 0x3f;
  ASSERT_TRUE(server_->UpdateWeights(Update()).ok());
  std::this_thread::sleep_for(50ms);  // generation holds while the session is active
  EXPECT_EQ(a.wait_for(0s), std::future_status::timeout);
  ASSERT_TRUE(server_->FinishWeightUpdate(std::string("v2")).ok());
  auto r = a.get();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  auto ids = Ids(*r);
  auto versions = (*r)["choices"][0]["weight_versions"].get<std::vector<std::string>>();
  size_t k = std::find(versions.begin(), versions.end(), "v2") - versions.begin();
  ASSERT_GT(k, 0u);
  ASSERT_LT(k, 60u);
  EXPECT_EQ(std::vector<int32_t>(ids.begin(), ids.begin() + k), Expected(prompt, static_cast<int>(k), zeros, 4096));
  uint64_t s = kInitialState;
  for (int32_t t : prompt) s = AbsorbToken(s, t, FilledProbe(0));
  for (size_t i = 0; i + 1 < k; ++i) s = AbsorbToken(s, ids[i], FilledProbe(0));
  for (size_t i = k; i < ids.size(); ++i) {
    s = AbsorbToken(s, ids[i - 1], FilledProbe(0x3f));
    EXPECT_EQ(ids[i], SampleToken(s, 4096)) << i;
  }
  EXPECT_EQ((*r)["weight_version"], "v2");

  // A fresh request reads the new weights from the first token.
  auto fresh = server_->Complete(json{{"prompt", prompt}, {"max_tokens", 4}});
  EXPECT_EQ(Ids(*fresh), Expected(prompt, 4, [](int64_t) { return FilledProbe(0x3f); }, 4096));
}

TEST_F(ServerGenerationTest, PauseResumeAndAbortGoThroughTheServer) {
  EXPECT_EQ(server_->Pause("sideways", true).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(server_->Resume().ok());  // not paused: fine
  ASSERT_TRUE(server_->Pause("keep", true).ok());
  EXPECT_TRUE(server_->IsPaused());
  EXPECT_EQ(server_->Health()["generation"]["pause_mode"], "keep");
  EXPECT_EQ(*server_->AbortRequests({}), 0);
  EXPECT_TRUE(*server_->ResetPrefixCache(false));
  ASSERT_TRUE(server_->Resume().ok());
  EXPECT_FALSE(server_->IsPaused());
  auto bad = server_->Complete(json{{"prompt", "x"}, {"model", "other"}});
  EXPECT_EQ(bad.status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace wsync
