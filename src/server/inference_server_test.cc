// InferenceServer at the service boundary: a backend that throws from any call is answered
// with Internal naming the route, and the server takes the next call (no "in progress"
// left behind); the init request's peer address reaches the backend.
#include "server/inference_server.h"

#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <new>
#include <stdexcept>

#include "core/digest.h"
#include "model/config.h"
#include "model/sharding.h"
#include "model/worker_sink.h"
#include "wsync/tensor.h"

namespace wsync {
namespace {

using nlohmann::json;

// Throws from every call while `throwing` is set; records the peer of the last init.
class ThrowingBackend : public ReceiverBackend {
 public:
  explicit ThrowingBackend(bool* throwing, std::string* peer) : throwing_(throwing), peer_(peer) {}
  std::string_view name() const override { return "throwing"; }
  Status Init(const json&) override { return InitFromPeer(json(), ""); }
  Status InitFromPeer(const json&, const std::string& peer) override {
    *peer_ = peer;
    if (*throwing_) throw std::bad_alloc();
    return Status::Ok();
  }
  Status Update(const UpdateRequest& req) override {
    if (*throwing_) throw std::runtime_error("update exploded");
    return req.reject;
  }
  Result<json> Fetch(const json&) override {
    if (*throwing_) throw json::type_error::create(302, "type must be number, but is string", nullptr);
    return json{{"ok", true}};
  }

 private:
  bool* throwing_;
  std::string* peer_;
};

class InferenceServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    InferenceServerOptions o;
    o.model = "qwen3-tiny";
    auto s = InferenceServer::Create(o, [this](std::string_view, ReceiverContext*) -> Result<std::unique_ptr<ReceiverBackend>> {
      return std::unique_ptr<ReceiverBackend>(std::make_unique<ThrowingBackend>(&throwing_, &peer_));
    });
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    server_ = std::move(*s);
  }
  static json NormUpdate() {
    return json{{"names", {"model.norm.weight"}}, {"dtype_names", {"bfloat16"}}, {"shapes", {{256}}}};
  }
  bool throwing_ = true;
  std::string peer_;
  std::unique_ptr<InferenceServer> server_;
};

TEST_F(InferenceServerTest, AnInitThatThrowsIsInternalAndFreesTheServer) {
  Status s = server_->InitWeightTransfer(json::object(), "10.0.0.7");
  EXPECT_EQ(s.code(), StatusCode::kInternal);
  EXPECT_NE(s.message().find("init_weight_transfer_engine failed"), std::string::npos) << s.ToString();
  EXPECT_EQ(peer_, "10.0.0.7");
  throwing_ = false;
  EXPECT_TRUE(server_->InitWeightTransfer(json::object(), "::1").ok());  // not "in progress"
  EXPECT_EQ(peer_, "::1");
}

TEST_F(InferenceServerTest, AnUpdateThatThrowsEndsTheSessionInconsistentAndFreesTheServer) {
  ASSERT_TRUE(server_->StartWeightUpdate().ok());
  Status s = server_->UpdateWeights(NormUpdate());
  EXPECT_EQ(s.code(), StatusCode::kInternal);
  EXPECT_NE(s.message().find("update_weights failed: update exploded"), std::string::npos) << s.ToString();
  EXPECT_FALSE(server_->Health()["weights_consistent"].get<bool>());
  EXPECT_FALSE(server_->Health()["session_active"].get<bool>());
  throwing_ = false;
  ASSERT_TRUE(server_->StartWeightUpdate().ok());
  ASSERT_TRUE(server_->UpdateWeights(NormUpdate()).ok());
  ASSERT_TRUE(server_->FinishWeightUpdate(std::string("v2")).ok());
  EXPECT_TRUE(server_->Health()["weights_consistent"].get<bool>());
  EXPECT_EQ(server_->WeightVersion(), "v2");
}

TEST_F(InferenceServerTest, AFetchThatThrowsIsInternalAndFreesTheServer) {
  Result<json> r = server_->FetchWeights(json::object());
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);
  EXPECT_NE(r.status().message().find("fetch_weights failed"), std::string::npos) << r.status().ToString();
  throwing_ = false;
  EXPECT_TRUE(server_->FetchWeights(json::object()).ok());
  EXPECT_TRUE(server_->Checksums(DigestAlgorithm::kXxh3_128).ok());
}

TEST_F(InferenceServerTest, AnotherBackendsInitInfoIsRefusedBeforeTheBackendSeesIt) {
  throwing_ = false;
  Status s = server_->InitWeightTransfer(json{{"buffers", json::object()}, {"control_path", "/dev/shm/x"}}, "10.0.0.7");
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(),
            "this server runs backend 'throwing'; the init_info is for backend 'ipc' (field 'buffers'): start the "
            "server with --backend ipc or push with --backend throwing");
  EXPECT_EQ(peer_, "");  // the backend was never called
  EXPECT_EQ(server_->Health()["backend"], "throwing");  // /health and the refusal name the same backend
  EXPECT_TRUE(server_->InitWeightTransfer(json::object(), "::1").ok());  // the server is free
  EXPECT_EQ(peer_, "::1");
}

// The draft-session rule holds for a body the server already checked in an ordinary
// session (the same bytes, served from the body cache as the same object).
TEST(InferenceServerDraft, ADraftSessionRefusesATargetTensorEvenInABodyCheckedBefore) {
  bool throwing = false;
  std::string peer;
  InferenceServerOptions o;
  o.model = "deepseek-v3-tiny";
  o.speculative = "mtp";
  auto made = InferenceServer::Create(o, [&](std::string_view, ReceiverContext*) -> Result<std::unique_ptr<ReceiverBackend>> {
    return std::unique_ptr<ReceiverBackend>(std::make_unique<ThrowingBackend>(&throwing, &peer));
  });
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  InferenceServer& server = **made;
  const auto body = std::make_shared<const json>(
      json{{"names", {"model.norm.weight"}}, {"dtype_names", {"bfloat16"}}, {"shapes", {{256}}}});
  ASSERT_TRUE(server.StartWeightUpdate().ok());
  ASSERT_TRUE(server.UpdateWeights(body).ok());
  ASSERT_TRUE(server.FinishWeightUpdate(std::nullopt).ok());
  ASSERT_TRUE(server.StartDraftWeightUpdate().ok());
  Status s = server.UpdateWeights(body);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("draft session: tensor model.norm.weight (update_info entry 0) is not one of the MTP "
                             "drafter's"),
            std::string::npos)
      << s.ToString();
}

// Lands every HF tensor of `hf` through every worker's sink, whatever the update names:
// whole (Load), or with `slices` every piece of the worker's table (LoadPiece), as
// `sharded` lands them.
class LandingBackend : public ReceiverBackend {
 public:
  using Rows = std::map<std::string, std::vector<std::pair<int64_t, int64_t>>>;
  LandingBackend(ReceiverContext* ctx, const std::vector<HostTensor>* hf, const Rows* rows, bool slices)
      : ctx_(ctx), hf_(hf), rows_(rows), slices_(slices) {}
  std::string_view name() const override { return "landing"; }
  Rows RowDigestRanges() const override { return *rows_; }
  bool LandsSlices() const override { return slices_; }
  Status Init(const json&) override { return Status::Ok(); }
  Status Update(const UpdateRequest& req) override {
    WSYNC_RETURN_IF_ERROR(req.reject);
    for (const ReceiverWorker& w : ctx_->workers) {
      std::vector<std::vector<std::byte>> packed;  // valid until ChunkLanded
      if (!slices_) {
        for (const HostTensor& t : *hf_) WSYNC_RETURN_IF_ERROR(w.sink->Load(t.ref()));
      } else {
        const ShardingTable& table = *w.sink->sharding();
        for (auto [param, piece] : table.PiecesByHf()) {
          const std::string& name = table.params()[param].pieces[piece].hf_name;
          auto t = std::ranges::find(*hf_, name, [](const HostTensor& h) { return h.meta.name; });
          if (t == hf_->end()) return Internal("no test tensor " + name);
          const PieceRuns r = table.Runs(param, piece);
          std::vector<std::byte>& bytes = packed.emplace_back(static_cast<size_t>(r.count * r.run_bytes));
          for (int64_t o = 0; o < r.count; ++o) {
            std::memcpy(bytes.data() + o * r.run_bytes, t->storage.data() + r.hf_offset + o * r.hf_stride,
                        static_cast<size_t>(r.run_bytes));
          }
          WSYNC_RETURN_IF_ERROR(w.sink->LoadPiece(param, piece, bytes, Device{}));
        }
      }
      WSYNC_RETURN_IF_ERROR(w.sink->ChunkLanded());
    }
    return Status::Ok();
  }

 private:
  ReceiverContext* ctx_;
  const std::vector<HostTensor>* hf_;
  const Rows* rows_;
  bool slices_;
};

struct LandingServer {
  std::vector<HostTensor> hf;
  json digests = json::object();
  LandingBackend::Rows announced;  // what the backend says the trainer digests by rows
  std::unique_ptr<InferenceServer> server;
};

std::unique_ptr<LandingServer> MakeLandingServer(int tp, bool corrupt, bool slices = false) {
  auto out = std::make_unique<LandingServer>();
  uint32_t n = 1;
  for (TensorMeta m : HfTensors(*LookupModel("qwen3-tiny"))) {
    HostTensor t = *HostTensor::Zeros(std::move(m));
    for (size_t i = 0; i + 4 <= t.meta.nbytes(); i += 4, n = n * 1664525u + 1013904223u) {
      std::memcpy(t.storage.data() + i, &n, 4);
    }
    out->digests[t.meta.name] = HexDigest(DigestAlgorithm::kXxh3_128, t.ref().bytes);
    out->hf.push_back(std::move(t));
  }
  InferenceServerOptions o;
  o.model = "qwen3-tiny";
  o.tp = tp;
  o.fault_corrupt_landed = corrupt;
  LandingServer* raw = out.get();
  auto s = InferenceServer::Create(o, [raw, slices](std::string_view, ReceiverContext* ctx) -> Result<std::unique_ptr<ReceiverBackend>> {
    return std::unique_ptr<ReceiverBackend>(std::make_unique<LandingBackend>(ctx, &raw->hf, &raw->announced, slices));
  });
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  if (!s.ok()) return nullptr;
  out->server = std::move(*s);
  return out;
}

const json kNormUpdate = json{{"names", {"model.norm.weight"}}, {"dtype_names", {"bfloat16"}}, {"shapes", {{256}}}};

// In-line verification at the service boundary: a session started as verified hashes
// every tensor a worker holds whole as it lands, and every TP-split tensor, or every
// tensor landed as slices (at TP=1 too), once its TP group holds it whole
// (GroupLandingDigests); one started plainly hashes all at finish; either way every
// tensor is verified. A landing that wrote one wrong bit fails the finish naming the
// tensor and keeps the old version.
TEST(InferenceServerInline, LandedTensorsAreHashedAsTheyLandTheRestAtFinish) {
  for (int tp : {1, 2}) {
    for (bool announced : {true, false}) {
    for (bool slices : {false, true}) {
      SCOPED_TRACE(fmt::format("tp={} announced={} slices={}", tp, announced, slices));
      auto ls = MakeLandingServer(tp, /*corrupt=*/false, slices);
      ASSERT_NE(ls, nullptr);
      InferenceServer& server = *ls->server;
      ASSERT_TRUE((announced ? server.StartWeightUpdateInlineVerified() : server.StartWeightUpdate()).ok());
      ASSERT_TRUE(server.UpdateWeights(std::make_shared<const json>(kNormUpdate)).ok());
      Result<json> r = server.FinishWeightUpdateVerified(std::string("v1"), ls->digests, "xxh3_128");
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      const json& v = (*r)["verified"];
      EXPECT_EQ(v["tensors"].get<size_t>(), ls->hf.size()) << v.dump();
      const size_t at_landing = v["hashed_at_landing"].get<size_t>();
      if (!announced) {
        EXPECT_EQ(at_landing, 0u) << v.dump();
      } else {
        EXPECT_EQ(at_landing, ls->hf.size()) << v.dump();
      }
      EXPECT_EQ(server.Health()["weight_version"], "v1");
    }
    }
  }
}

TEST(InferenceServerInline, ACorruptLandingFailsTheFinishNamingTheTensor) {
  // At TP=2 the corrupted tensor (the vocabulary-split embedding) is one the TP group
  // digests from its shards once both halves landed.
  for (int tp : {1, 2}) {
  for (bool announced : {true, false}) {
  for (bool slices : {false, true}) {
    SCOPED_TRACE(fmt::format("tp={} announced={} slices={}", tp, announced, slices));
    auto ls = MakeLandingServer(tp, /*corrupt=*/true, slices);
    ASSERT_NE(ls, nullptr);
    InferenceServer& server = *ls->server;
    ASSERT_TRUE((announced ? server.StartWeightUpdateInlineVerified() : server.StartWeightUpdate()).ok());
    ASSERT_TRUE(server.UpdateWeights(std::make_shared<const json>(kNormUpdate)).ok());
    Result<json> r = server.FinishWeightUpdateVerified(std::string("v1"), ls->digests, "xxh3_128");
    ASSERT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status().ToString();
    EXPECT_NE(r.status().message().find("1 tensor(s)"), std::string::npos) << r.status().ToString();
    EXPECT_NE(r.status().message().find("model.embed_tokens.weight"), std::string::npos) << r.status().ToString();
    json h = server.Health();
    EXPECT_FALSE(h["weights_consistent"].get<bool>()) << h.dump();
    EXPECT_NE(h["weight_version"], "v1") << h.dump();
  }
  }
  }
}

// Row digests (a tensor no trainer rank held whole, digested by row ranges): each range
// is digested from the group's shards at finish and compared, at TP=1 and TP=2; one wrong
// byte fails the finish naming the tensor; ranges that do not tile dim 0 are refused.
json RowDigestsOf(const HostTensor& t, int64_t split) {
  const int64_t rows = t.meta.shape[0];
  const size_t row_bytes = t.meta.nbytes() / static_cast<size_t>(rows);
  json list = json::array();
  for (auto [a, b] : {std::pair<int64_t, int64_t>{0, split}, {split, rows}}) {
    list.push_back({a, b, HexDigest(DigestAlgorithm::kXxh3_128, t.ref().bytes.subspan(a * row_bytes, (b - a) * row_bytes))});
  }
  return json{{"rows", list}};
}

// Row ranges the backend announced are digested as the TP group lands the tensor; ranges
// it did not announce (or a TP=1 server landing whole tensors, which tracks no group) are
// read at finish.
TEST(InferenceServerInline, RowDigestsOfSplitTensorsAreVerifiedAtLandingOrFinish) {
  for (int tp : {1, 2}) {
    for (bool announce : {false, true}) {
    for (bool corrupt : {false, true}) {
    for (bool slices : {false, true}) {
      SCOPED_TRACE(fmt::format("tp={} announce={} corrupt={} slices={}", tp, announce, corrupt, slices));
      auto ls = MakeLandingServer(tp, corrupt, slices);
      ASSERT_NE(ls, nullptr);
      size_t by_rows = 0;
      for (const HostTensor& t : ls->hf) {
        if (t.meta.shape.size() < 1 || t.meta.shape[0] < 2) continue;
        const int64_t split = t.meta.shape[0] / 2 + 1;
        ls->digests[t.meta.name] = RowDigestsOf(t, split);
        if (announce) ls->announced[t.meta.name] = {{0, split}, {split, t.meta.shape[0]}};
        ++by_rows;
      }
      ASSERT_GT(by_rows, 0u);
      InferenceServer& server = *ls->server;
      ASSERT_TRUE(server.StartWeightUpdateInlineVerified().ok());
      ASSERT_TRUE(server.UpdateWeights(std::make_shared<const json>(kNormUpdate)).ok());
      Result<json> r = server.FinishWeightUpdateVerified(std::string("v1"), ls->digests, "xxh3_128");
      if (corrupt) {
        ASSERT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status().ToString();
        EXPECT_NE(r.status().message().find("model.embed_tokens.weight"), std::string::npos) << r.status().ToString();
        EXPECT_NE(server.Health()["weight_version"], "v1");
        continue;
      }
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      const json& v = (*r)["verified"];
      EXPECT_EQ(v["tensors"].get<size_t>(), ls->hf.size()) << v.dump();
      const size_t at_landing = (tp > 1 || slices) && announce ? ls->hf.size() : ls->hf.size() - by_rows;
      EXPECT_EQ(v["hashed_at_landing"].get<size_t>(), at_landing) << v.dump();
      EXPECT_EQ(server.Health()["weight_version"], "v1");
    }
    }
    }
  }
}

TEST(InferenceServerInline, RowRangesThatDoNotTileDimZeroAreRefusedNamingTheTensor) {
  auto ls = MakeLandingServer(2, /*corrupt=*/false);
  ASSERT_NE(ls, nullptr);
  const HostTensor& embed = ls->hf.front();
  ASSERT_EQ(embed.meta.name, "model.embed_tokens.weight");
  const int64_t rows = embed.meta.shape[0];
  const std::string hex(32, '0');
  const std::vector<json> hostile = {
      json{{"rows", {{0, rows - 1, hex}}}},                      // stops short
      json{{"rows", {{1, rows, hex}}}},                          // starts late
      json{{"rows", {{0, 5, hex}, {4, rows, hex}}}},             // overlaps
      json{{"rows", {{0, rows + 1, hex}}}},                      // past dim 0
      json{{"rows", json::array()}},                             // empty
      json{{"rows", {{0, rows, 7}}}},                            // digest not a string
      json{{"rows", {{0, rows, hex}}}, {"extra", 1}},            // unknown field
  };
  for (const json& entry : hostile) {
    SCOPED_TRACE(entry.dump());
    InferenceServer& server = *ls->server;
    ASSERT_TRUE(server.StartWeightUpdateInlineVerified().ok());
    ASSERT_TRUE(server.UpdateWeights(std::make_shared<const json>(kNormUpdate)).ok());
    json digests = ls->digests;
    digests[embed.meta.name] = entry;
    Result<json> r = server.FinishWeightUpdateVerified(std::string("v1"), digests, "xxh3_128");
    ASSERT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
    EXPECT_NE(r.status().message().find("wsync_digests[model.embed_tokens.weight]"), std::string::npos)
        << r.status().ToString();
    EXPECT_NE(server.Health()["weight_version"], "v1");
  }
}

}  // namespace
}  // namespace wsync
