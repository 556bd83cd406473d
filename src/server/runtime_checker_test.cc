// vLLM's runtime weight checker: digests of each worker's parameters as held, keyed
// vLLM's way, checked against SHA-256 computed here from the bytes the test loaded; the
// random reset; and InferenceServer's /weight_checker semantics (vLLM 0.32's: compare
// needs the baseline it is sent, 400 without one; the checker answers while paused; reset
// marks the weights inconsistent until a sync finishes).
#include "server/runtime_checker.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <set>

#include <fmt/format.h>

#include "core/digest.h"
#include "server/inference_server.h"

namespace wsync {
namespace {

using nlohmann::json;

std::string Sha(std::span<const std::byte> b) { return HexDigest(DigestAlgorithm::kSha256, b); }

// An HF tensor of the model filled with bytes that depend on `salt`.
HostTensor Filled(const WorkerStore& store, std::string_view name, uint8_t salt) {
  const TensorMeta& meta = store.table().hf_tensors()[store.table().FindHf(name)];
  HostTensor t = *HostTensor::Zeros(meta);
  auto bytes = t.storage.span().first(meta.nbytes());
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = std::byte(uint8_t(i * 31 + salt) & 0x3F);
  return t;
}

std::vector<std::unique_ptr<WorkerStore>> Group(int tp) {
  std::vector<std::unique_ptr<WorkerStore>> g;
  for (int r = 0; r < tp; ++r) g.push_back(*WorkerStore::Create(*LookupModel("qwen3-tiny"), r, tp));
  return g;
}

TEST(RuntimeChecker, Fp8ParametersAreCheckedAsFp8BytesAndScales) {
  auto store = *WorkerStore::Create(*LookupModel("qwen3-tiny"), 0, 1);
  for (const TensorMeta& m : store->hf_tensors()) ASSERT_TRUE(store->Load(Filled(*store, m.name, 5).ref()).ok());
  auto sink = *Fp8WorkerSink::Create(store.get(), 1);
  ASSERT_TRUE(sink->QuantizeAll().ok());
  std::vector<RuntimeWorker> workers{{store.get(), 0, 0, sink.get()}};
  const ShardingTable& t = store->table();
  std::vector<std::string> want;
  for (size_t i = 0; i < t.params().size(); ++i) {
    want.push_back(t.params()[i].meta.name);
    if (IsFp8Param(t, static_cast<int>(i))) want.push_back(Fp8ScaleInvName(t.params()[i].meta.name));
  }
  EXPECT_EQ(RuntimeParamNames(workers[0]), want);
  auto sums = RuntimeParamDigests(workers, 2);
  ASSERT_TRUE(sums.ok()) << sums.status().ToString();
  EXPECT_EQ(sums->size(), want.size());
  const int qkv = 1;  // model.layers.0.self_attn.qkv_proj.weight
  ASSERT_EQ(t.params()[qkv].meta.name, "model.layers.0.self_attn.qkv_proj.weight");
  const Fp8ParamLayout& l = *sink->layout(qkv);
  EXPECT_EQ(sums->at("dp0:pp0:pcp0:tp0:model.layers.0.self_attn.qkv_proj.weight"),
            Sha(std::as_bytes(std::span(sink->weight_data(qkv), l.weight.nbytes()))));
  EXPECT_EQ(sums->at("dp0:pp0:pcp0:tp0:model.layers.0.self_attn.qkv_proj.weight_scale_inv"),
            Sha(std::as_bytes(std::span(sink->scale_data(qkv), l.scale_inv.nbytes() / sizeof(float)))));
  // The reset overwrites the fp8 bytes (never a NaN code) and the scales (finite).
  ASSERT_TRUE(RandomizeRuntimeParams(workers, 9, 2).ok());
  auto after = RuntimeParamDigests(workers, 2);
  ASSERT_TRUE(after.ok());
  for (const auto& [key, hex] : *sums) EXPECT_NE(after->at(key), hex) << key;
  for (size_t k = 0; k < l.weight.nbytes(); ++k) ASSERT_NE(sink->weight_data(qkv)[k] & 0x7f, 0x7f) << k;
  for (size_t k = 0; k < l.scale_inv.nbytes() / sizeof(float); ++k) ASSERT_TRUE(std::isfinite(sink->scale_data(qkv)[k]));
}

TEST(RuntimeChecker, KeysAreVllmsAndDigestsAreSha256OfTheParameterAsHeld) {
  auto group = Group(2);
  // The norm is replicated whole; the embedding is split by (padded) vocabulary rows.
  HostTensor norm = Filled(*group[0], "model.norm.weight", 1);
  HostTensor embed = Filled(*group[0], "model.embed_tokens.weight", 2);
  for (auto& s : group) {
    ASSERT_TRUE(s->Load(norm.ref()).ok());
    ASSERT_TRUE(s->Load(embed.ref()).ok());
  }
  std::vector<RuntimeWorker> workers{{group[0].get(), 3, 0}, {group[1].get(), 3, 1}};
  auto sums = RuntimeParamDigests(workers, 4, /*piece_bytes=*/4096);
  ASSERT_TRUE(sums.ok()) << sums.status().ToString();
  const auto& params = group[0]->table().params();
  ASSERT_EQ(sums->size(), 2 * params.size());
  for (int tp = 0; tp < 2; ++tp) {
    for (const WorkerParam& p : group[tp]->table().params()) {
      std::string key = fmt::format("dp3:pp0:pcp0:tp{}:{}", tp, p.meta.name);
      ASSERT_TRUE(sums->contains(key)) << key;
      EXPECT_EQ(key, RuntimeParamKey(3, tp, p.meta.name));
    }
  }
  auto norm_bytes = norm.storage.span().first(norm.meta.nbytes());
  EXPECT_EQ(sums->at("dp3:pp0:pcp0:tp0:model.norm.weight"), Sha(norm_bytes));
  EXPECT_EQ(sums->at("dp3:pp0:pcp0:tp1:model.norm.weight"), Sha(norm_bytes));
  // Rank r's embedding: rows [r*V/2, (r+1)*V/2) of the padded vocabulary.
  const int64_t vocab = embed.meta.shape[0], row = embed.meta.nbytes() / vocab;
  const int64_t padded = ShardingTable::PaddedVocab(vocab), half = padded / 2;
  for (int r = 0; r < 2; ++r) {
    std::vector<std::byte> want(half * row, std::byte{0});
    for (int64_t i = 0; i < half && r * half + i < vocab; ++i) {
      std::memcpy(want.data() + i * row, embed.storage.span().data() + (r * half + i) * row, row);
    }
    int idx = group[r]->table().FindParam("model.embed_tokens.weight");
    ASSERT_GE(idx, 0);
    EXPECT_EQ(sums->at(RuntimeParamKey(3, r, "model.embed_tokens.weight")), Sha(want)) << "tp" << r;
  }
  // A parameter nothing was loaded into: the digest of its zeroed bytes.
  const WorkerParam& qkv = params[group[0]->table().FindParam("model.layers.0.self_attn.qkv_proj.weight")];
  std::vector<std::byte> zeros(qkv.meta.nbytes(), std::byte{0});
  EXPECT_EQ(sums->at(RuntimeParamKey(3, 0, qkv.meta.name)), Sha(zeros));
}

TEST(RuntimeChecker, ResetWritesFiniteRandomValuesEverywhere) {
  auto group = Group(1);
  std::vector<RuntimeWorker> workers{{group[0].get(), 0, 0}};
  auto before = *RuntimeParamDigests(workers, 2);
  ASSERT_TRUE(RandomizeRuntimeParams(workers, 7, 2, 4096).ok());
  auto after = *RuntimeParamDigests(workers, 2);
  for (const auto& [key, hex] : before) EXPECT_NE(after.at(key), hex) << key;
  // bf16: no element has an all-ones exponent (NaN or infinity).
  for (size_t i = 0; i < group[0]->params().size(); ++i) {
    const HostTensor& p = group[0]->params()[i];
    ASSERT_EQ(ItemSize(p.meta.dtype), 2u) << p.meta.name;
    auto b = p.storage.span().first(p.meta.nbytes());
    for (size_t e = 0; e + 1 < b.size(); e += 2) {
      uint16_t v = uint16_t(b[e]) | uint16_t(uint16_t(b[e + 1]) << 8);
      ASSERT_NE(v & 0x7F80, 0x7F80) << p.meta.name << " element " << e / 2;
    }
  }
  ASSERT_TRUE(RandomizeRuntimeParams(workers, 8, 2).ok());
  auto other = *RuntimeParamDigests(workers, 2);
  for (const auto& [key, hex] : after) EXPECT_NE(other.at(key), hex) << key;
}

TEST(RuntimeChecker, MismatchesNameChangedMissingAndExtraKeys) {
  std::map<std::string, std::string> cur{{"a", "1"}, {"b", "2"}, {"c", "3"}};
  EXPECT_TRUE(DigestMismatches(cur, json(cur)).empty());
  EXPECT_EQ(DigestMismatches(cur, json{{"a", "1"}, {"b", "9"}, {"d", "4"}, {"c", 3}}),
            (std::vector<std::string>{"b", "c", "d"}));
  EXPECT_EQ(DigestMismatches(cur, json{{"a", "1"}, {"b", "2"}}), (std::vector<std::string>{"c"}));
}

// Loads the tensors the test sets into every worker; the update's list says which.
class LoadingBackend : public ReceiverBackend {
 public:
  LoadingBackend(ReceiverContext* ctx, std::map<std::string, HostTensor>* data) : ctx_(ctx), data_(data) {}
  std::string_view name() const override { return "loading"; }
  Status Init(const json&) override { return Status::Ok(); }
  Status Update(const UpdateRequest& req) override {
    WSYNC_RETURN_IF_ERROR(req.reject);
    for (const TensorMeta& m : *req.tensors) {
      for (const ReceiverWorker& w : ctx_->workers) WSYNC_RETURN_IF_ERROR(w.sink->Load(data_->at(m.name).ref()));
    }
    return Status::Ok();
  }

 private:
  ReceiverContext* ctx_;
  std::map<std::string, HostTensor>* data_;
};

class RuntimeCheckerServer : public ::testing::Test {
 protected:
  void SetUp() override {
    InferenceServerOptions o;
    o.model = "qwen3-tiny";
    o.tp = 2;
    o.dp = 2;
    auto s = InferenceServer::Create(o, [this](std::string_view, ReceiverContext* ctx) -> Result<std::unique_ptr<ReceiverBackend>> {
      return std::unique_ptr<ReceiverBackend>(std::make_unique<LoadingBackend>(ctx, &data_));
    });
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    server_ = std::move(*s);
    table_ = std::make_unique<ShardingTable>(*ShardingTable::Build(*LookupModel("qwen3-tiny"), 0, 2));
  }
  // One sync of model.norm.weight filled with `salt`.
  void SyncNorm(uint8_t salt) {
    auto store = *WorkerStore::Create(*LookupModel("qwen3-tiny"), 0, 1);
    data_.insert_or_assign("model.norm.weight", Filled(*store, "model.norm.weight", salt));
    ASSERT_TRUE(server_->StartWeightUpdate().ok());
    const TensorMeta& m = data_.at("model.norm.weight").meta;
    ASSERT_TRUE(server_->UpdateWeights(json{{"names", {m.name}}, {"dtype_names", {"bfloat16"}}, {"shapes", {m.shape}}}).ok());
    ASSERT_TRUE(server_->FinishWeightUpdate(std::nullopt).ok());
  }
  Result<json> Check(const char* action, const json* baseline = nullptr) {
    return server_->CheckRuntimeWeights(action, baseline);
  }
  bool Consistent() { return server_->Health()["weights_consistent"].get<bool>(); }

  std::map<std::string, HostTensor> data_;
  std::unique_ptr<InferenceServer> server_;
  std::unique_ptr<ShardingTable> table_;
};

TEST_F(RuntimeCheckerServer, ChecksumListsEveryEngineAndCompareNeedsItsBaseline) {
  Result<json> first = Check("checksum");
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  const size_t params = table_->params().size();
  ASSERT_EQ((*first)["checksums"].size(), 4 * params);
  EXPECT_FALSE(first->contains("baseline_created"));  // nothing is kept server-side
  ASSERT_EQ((*first)["engines"].size(), 2u);
  for (int dp = 0; dp < 2; ++dp) {
    const json& engine = (*first)["engines"][dp];
    EXPECT_EQ(engine.size(), 2 * params);
    for (const auto& [key, hex] : engine.items()) {
      EXPECT_TRUE(key.starts_with(fmt::format("dp{}:pp0:pcp0:tp", dp))) << key;
      EXPECT_EQ((*first)["checksums"][key], hex);
    }
  }
  // Nothing changed: compare against the checksums matches, as often as asked.
  const json baseline = (*first)["checksums"];
  for (int i = 0; i < 2; ++i) {
    Result<json> same = Check("compare", &baseline);
    ASSERT_TRUE(same.ok()) << same.status().ToString();
    EXPECT_EQ(*same, json({{"match", true}, {"mismatches", json::array()}}));
  }
  Result<json> none = Check("compare");
  EXPECT_EQ(none.status().code(), StatusCode::kInvalidArgument) << none.status().ToString();
  EXPECT_EQ(none.status().message(), "action='compare' requires a 'baseline' object");
}

TEST_F(RuntimeCheckerServer, CompareAfterASyncNamesExactlyTheParametersThatChanged) {
  const json baseline = Check("checksum")->at("checksums");
  SyncNorm(5);
  Result<json> cmp = Check("compare", &baseline);
  ASSERT_TRUE(cmp.ok()) << cmp.status().ToString();
  EXPECT_EQ((*cmp)["match"], false);
  std::set<std::string> want;
  for (int dp = 0; dp < 2; ++dp) {
    for (int tp = 0; tp < 2; ++tp) {
      auto table = *ShardingTable::Build(*LookupModel("qwen3-tiny"), tp, 2);
      for (auto [param, piece] : table.PiecesOf("model.norm.weight")) {
        want.insert(RuntimeParamKey(dp, tp, table.params()[param].meta.name));
      }
    }
  }
  ASSERT_EQ(want.size(), 4u);
  EXPECT_EQ((*cmp)["mismatches"].get<std::set<std::string>>(), want);
  std::vector<std::string> listed = (*cmp)["mismatches"].get<std::vector<std::string>>();
  EXPECT_TRUE(std::is_sorted(listed.begin(), listed.end()));  // vLLM sorts them
}

TEST_F(RuntimeCheckerServer, ResetRandomizesAndLeavesTheWeightsInconsistentUntilASync) {
  json before = Check("checksum")->at("checksums");
  ASSERT_TRUE(server_->Checksums(DigestAlgorithm::kSha256).ok());
  ASSERT_TRUE(Consistent());
  Result<json> reset = Check("reset");
  ASSERT_TRUE(reset.ok()) << reset.status().ToString();
  EXPECT_EQ(*reset, json({{"status", "reset"}}));
  EXPECT_FALSE(Consistent());
  Result<json> cmp = Check("compare", &before);
  ASSERT_TRUE(cmp.ok());
  EXPECT_EQ((*cmp)["match"], false);
  EXPECT_EQ((*cmp)["mismatches"].size(), before.size());  // every parameter changed
  // wsync's HF digests see the reset too: each rank's copy of a replicated tensor got
  // its own random values.
  auto hf_after = server_->Checksums(DigestAlgorithm::kSha256);
  EXPECT_EQ(hf_after.status().code(), StatusCode::kDataLoss) << hf_after.status().ToString();
  SyncNorm(9);
  EXPECT_TRUE(Consistent());
}

// vLLM's list form of update_info lands as the object form does; the list is bounded by
// the world (TP 2 x DP 2) and a refused one ends the session.
TEST_F(RuntimeCheckerServer, ListFormUpdateInfoLandsAndIsBoundedByTheWorld) {
  auto store = *WorkerStore::Create(*LookupModel("qwen3-tiny"), 0, 1);
  data_.insert_or_assign("model.norm.weight", Filled(*store, "model.norm.weight", 3));
  const TensorMeta& m = data_.at("model.norm.weight").meta;
  const json one = {{"names", {m.name}}, {"dtype_names", {"bfloat16"}}, {"shapes", {m.shape}}};
  const json before = Check("checksum")->at("checksums");
  ASSERT_TRUE(server_->StartWeightUpdate().ok());
  Status s = server_->UpdateWeights(std::make_shared<const json>(json(std::vector<json>(4, one))));
  ASSERT_TRUE(s.ok()) << s.ToString();
  ASSERT_TRUE(server_->FinishWeightUpdate(std::nullopt).ok());
  Result<json> cmp = Check("compare", &before);
  ASSERT_TRUE(cmp.ok());
  EXPECT_EQ((*cmp)["mismatches"].size(), 4u);  // model.norm.weight on every worker

  for (const json& bad : {json(std::vector<json>(3, one)), json(std::vector<json>(5, one)),
                          json::array({one, one, one, json::object()})}) {
    ASSERT_TRUE(server_->StartWeightUpdate().ok());
    Status r = server_->UpdateWeights(std::make_shared<const json>(bad));
    EXPECT_EQ(r.code(), StatusCode::kInvalidArgument) << r.ToString();
    EXPECT_FALSE(server_->Health()["session_active"].get<bool>()) << "a refused update ends the session";
  }
}

TEST_F(RuntimeCheckerServer, AnswersWhilePausedAsVllmDoes) {
  ASSERT_TRUE(server_->Pause("keep", false).ok());
  Result<json> sums = Check("checksum");
  ASSERT_TRUE(sums.ok()) << sums.status().ToString();
  const json baseline = (*sums)["checksums"];
  Result<json> cmp = Check("compare", &baseline);
  ASSERT_TRUE(cmp.ok()) << cmp.status().ToString();
  EXPECT_EQ((*cmp)["match"], true);
  EXPECT_TRUE(server_->Checksums(DigestAlgorithm::kXxh3_128).ok());  // a trainer verifies inside its pause
  ASSERT_TRUE(server_->Resume().ok());
}

TEST_F(RuntimeCheckerServer, RefusedWhileAWeightSessionIsOpen) {
  ASSERT_TRUE(server_->StartWeightUpdate().ok());
  for (const char* action : {"checksum", "reset"}) {
    Result<json> r = Check(action);
    EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << action << ": " << r.status().ToString();
  }
  EXPECT_TRUE(Consistent());  // the refused reset changed nothing
}

}  // namespace
}  // namespace wsync
