// InferenceServer's LoRA adapters (--max-loras) at the service boundary, over a backend
// that lands each update's tensors through every worker's sink: lora sessions stage
// beside the live version and install it at finish; a failed or abandoned session keeps
// the previous version serving and leaves the weights' state alone; the capacity refuses
// a new name; /health, /v1/models, the adapters' checksums and the toy generation see
// each version.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include "control/http_routes.h"
#include "core/digest.h"
#include "model/config.h"
#include "model/worker_sink.h"
#include "receiver/lora_spec.h"
#include "server/inference_server.h"
#include "wsync/tensor.h"

namespace wsync {
namespace {

using nlohmann::json;

// Lands every tensor of an update, each byte update_info["fill"], on every worker.
class FillingBackend : public ReceiverBackend {
 public:
  explicit FillingBackend(ReceiverContext* ctx) : ctx_(ctx) {}
  std::string_view name() const override { return "filling"; }
  Status Init(const json&) override { return Status::Ok(); }
  Status Update(const UpdateRequest& req) override {
    WSYNC_RETURN_IF_ERROR(req.reject);
    const auto fill = static_cast<std::byte>(req.update_info->value("fill", 0));
    for (const ReceiverWorker& w : ctx_->workers) {
      for (const TensorMeta& m : *req.tensors) {
        std::vector<std::byte> bytes(m.nbytes(), fill);
        WSYNC_RETURN_IF_ERROR(w.sink->Load(TensorRef{m.name, m.dtype, m.shape, bytes, Device{}}));
      }
      WSYNC_RETURN_IF_ERROR(w.sink->ChunkLanded());
    }
    return Status::Ok();
  }

 private:
  ReceiverContext* ctx_;
};

class LoraServerTest : public ::testing::Test {
 protected:
  void SetUp() override { Make(2, 2); }
  void Make(int max_loras, int tp) {
    InferenceServerOptions o;
    o.model = "qwen3-tiny";
    o.tp = tp;
    o.max_loras = max_loras;
    o.session_lease_seconds = 0.5;
    auto s = InferenceServer::Create(o, [](std::string_view, ReceiverContext* ctx) -> Result<std::unique_ptr<ReceiverBackend>> {
      return std::unique_ptr<ReceiverBackend>(std::make_unique<FillingBackend>(ctx));
    });
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    server_ = std::move(*s);
  }
  static json Spec(const std::string& name, const std::string& version) {
    return json{{"format", 1}, {"name", name}, {"version", version}, {"r", 4}, {"alpha", 8},
                {"target_modules", {"q_proj", "v_proj"}}};
  }
  // The update_info of `spec`'s tensors [first, last), landing `fill`.
  json Update(const json& spec, int fill, size_t first = 0, size_t last = SIZE_MAX) {
    auto parsed = ParseLoraSpec(spec, server_->model());
    auto tensors = LoraTensors(*parsed, server_->model());
    json u{{"names", json::array()}, {"dtype_names", json::array()}, {"shapes", json::array()}, {"fill", fill}};
    for (size_t i = first; i < std::min(last, tensors->size()); ++i) {
      u["names"].push_back((*tensors)[i].name);
      u["dtype_names"].push_back(std::string(TorchName((*tensors)[i].dtype)));
      u["shapes"].push_back((*tensors)[i].shape);
    }
    return u;
  }
  Status Sync(const std::string& name, const std::string& version, int fill) {
    WSYNC_RETURN_IF_ERROR(server_->StartLoraWeightUpdate(Spec(name, version), false));
    WSYNC_RETURN_IF_ERROR(server_->UpdateWeights(Update(Spec(name, version), fill)));
    return server_->FinishWeightUpdate(std::nullopt);
  }
  // The tokens and per-token versions of a completion naming `model`.
  std::pair<json, json> Complete(const std::string& model) {
    Result<json> r = server_->Complete(json{{"model", model}, {"prompt", "hello"}, {"max_tokens", 4}});
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    if (!r.ok()) return {};
    return {(*r)["choices"][0]["token_ids"], (*r)["choices"][0]["weight_versions"]};
  }
  std::unique_ptr<InferenceServer> server_;
};

TEST_F(LoraServerTest, ASyncedAdapterServesItsVersionAndChangesGeneration) {
  ASSERT_TRUE(Sync("math", "step-1", 1).ok());
  json health = server_->Health();
  ASSERT_EQ(health["lora"]["adapters"].size(), 1u) << health.dump();
  EXPECT_EQ(health["lora"]["adapters"][0]["version"], "step-1");
  EXPECT_EQ(health["lora"]["adapters"][0]["scaling"], 2.0);
  EXPECT_EQ(health["weight_version"], "default");  // the base is untouched
  EXPECT_TRUE(health["weights_consistent"].get<bool>());
  Result<json> models = server_->Models();
  ASSERT_TRUE(models.ok());
  ASSERT_EQ((*models)["data"].size(), 2u);
  EXPECT_EQ((*models)["data"][1]["id"], "math");
  EXPECT_EQ((*models)["data"][1]["parent"], "qwen3-tiny");

  auto [base, base_versions] = Complete("qwen3-tiny");
  auto [v1, v1_versions] = Complete("math");
  EXPECT_NE(base, v1);
  EXPECT_EQ(v1_versions, json({"step-1", "step-1", "step-1", "step-1"}));
  EXPECT_EQ(base_versions[0], "default");
  ASSERT_TRUE(Sync("math", "step-2", 2).ok());
  auto [v2, v2_versions] = Complete("math");
  EXPECT_NE(v1, v2);
  EXPECT_EQ(v2_versions[0], "step-2");
  EXPECT_EQ(Complete("qwen3-tiny").first, base);

  // The checksums read what every worker holds.
  Result<json> sums = server_->LoraChecksums("math", DigestAlgorithm::kSha256);
  ASSERT_TRUE(sums.ok()) << sums.status().ToString();
  EXPECT_EQ((*sums)["version"], "step-2");
  EXPECT_EQ((*sums)["checksums"].size(), 4u * static_cast<size_t>(server_->model().num_hidden_layers));
  EXPECT_EQ(server_->LoraChecksums("other", DigestAlgorithm::kSha256).status().code(), StatusCode::kNotFound);
}

TEST_F(LoraServerTest, AFinishMissingATensorKeepsThePreviousVersion) {
  ASSERT_TRUE(Sync("math", "step-1", 1).ok());
  auto [v1, unused] = Complete("math");
  json spec = Spec("math", "step-2");
  ASSERT_TRUE(server_->StartLoraWeightUpdate(spec, false).ok());
  ASSERT_TRUE(server_->UpdateWeights(Update(spec, 2, 0, 3)).ok());
  EXPECT_EQ(server_->FinishWeightUpdate("bad\nversion").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(server_->Health()["lora"]["adapters"][0]["version"], "step-1");
  ASSERT_TRUE(server_->StartLoraWeightUpdate(spec, false).ok());
  ASSERT_TRUE(server_->UpdateWeights(Update(spec, 2, 0, 3)).ok());
  Status s = server_->FinishWeightUpdate(std::nullopt);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("did not arrive"), std::string::npos) << s.ToString();
  EXPECT_EQ(server_->Health()["lora"]["adapters"][0]["version"], "step-1");
  EXPECT_TRUE(server_->Health()["weights_consistent"].get<bool>());
  EXPECT_EQ(Complete("math").first, v1);
  // The next session installs normally.
  ASSERT_TRUE(Sync("math", "step-3", 3).ok());
  EXPECT_EQ(Complete("math").second[0], "step-3");
}

TEST_F(LoraServerTest, AnAbandonedSessionExpiresAndKeepsThePreviousVersion) {
  ASSERT_TRUE(Sync("math", "step-1", 1).ok());
  json spec = Spec("math", "step-2");
  ASSERT_TRUE(server_->StartLoraWeightUpdate(spec, false).ok());
  ASSERT_TRUE(server_->UpdateWeights(Update(spec, 2, 0, 3)).ok());  // then the trainer dies
  std::this_thread::sleep_for(std::chrono::milliseconds(700));
  EXPECT_FALSE(server_->Health()["session_active"].get<bool>());
  EXPECT_TRUE(server_->Health()["weights_consistent"].get<bool>());
  EXPECT_EQ(Complete("math").second[0], "step-1");
  // A full-weight session after it lands in the weights, not in the adapter's staging.
  ASSERT_TRUE(server_->StartWeightUpdate().ok());
  ASSERT_TRUE(server_->UpdateWeights(json{{"names", {"model.norm.weight"}}, {"dtype_names", {"bfloat16"}},
                                          {"shapes", {{server_->model().hidden_size}}}, {"fill", 5}})
                  .ok());
  ASSERT_TRUE(server_->FinishWeightUpdate("w1").ok());
  EXPECT_EQ(server_->Health()["weight_version"], "w1");
  EXPECT_EQ(server_->Health()["lora"]["adapters"][0]["version"], "step-1");
}

TEST_F(LoraServerTest, RefusesANewNameBeyondMaxLorasAndBaseTensorsInALoraSession) {
  ASSERT_TRUE(Sync("a", "1", 1).ok());
  ASSERT_TRUE(Sync("b", "1", 2).ok());
  Status full = server_->StartLoraWeightUpdate(Spec("c", "1"), false);
  EXPECT_EQ(full.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(full.message().find("a, b"), std::string::npos) << full.ToString();
  EXPECT_TRUE(Sync("a", "2", 3).ok());  // a held name is replaced
  ASSERT_TRUE(server_->UnloadLoraAdapter("b").ok());
  EXPECT_EQ(server_->UnloadLoraAdapter("b").code(), StatusCode::kNotFound);
  ASSERT_TRUE(Sync("c", "1", 4).ok());

  ASSERT_TRUE(server_->StartLoraWeightUpdate(Spec("c", "2"), false).ok());
  Status base = server_->UpdateWeights(
      json{{"names", {"model.norm.weight"}}, {"dtype_names", {"bfloat16"}}, {"shapes", {{server_->model().hidden_size}}}});
  EXPECT_EQ(base.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(base.message().find("model.norm.weight, which adapter c ("), std::string::npos) << base.ToString();
  EXPECT_TRUE(server_->Health()["weights_consistent"].get<bool>());
  EXPECT_EQ(server_->Complete(json{{"model", "b"}, {"prompt", "x"}}).status().code(), StatusCode::kNotFound);
}

TEST_F(LoraServerTest, InlineDigestsMustMatchWhatLanded) {
  json spec = Spec("math", "step-1");
  ASSERT_TRUE(server_->StartLoraWeightUpdate(spec, true).ok());
  json update = Update(spec, 7);
  ASSERT_TRUE(server_->UpdateWeights(update).ok());
  json digests = json::object();
  for (size_t i = 0; i < update["names"].size(); ++i) {
    digests[update["names"][i].get<std::string>()] = std::string(32, '0');
  }
  Result<json> r = server_->FinishWeightUpdateVerified(std::nullopt, digests, "xxh3_128");
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  EXPECT_EQ(server_->Health()["lora"]["adapters"].size(), 0u);
}

// A trainer digests a large tensor on its GPU by row ranges ({"rows": [[begin, end, hex],
// ...]}); an adapter's staged tensors are checked range by range: matching ranges verify,
// one wrong range refuses the version naming the tensor, ranges that do not tile dim 0
// are refused as malformed.
TEST_F(LoraServerTest, RowDigestsOfAnAdapterTensorAreCheckedByRange) {
  json spec = Spec("math", "step-1");
  const json update = Update(spec, 7);
  auto tensors = LoraTensors(*ParseLoraSpec(spec, server_->model()), server_->model());
  ASSERT_TRUE(tensors.ok());
  const TensorMeta& first_meta = tensors->front();
  const std::string& first = first_meta.name;
  const int64_t rows = first_meta.shape[0];
  ASSERT_GE(rows, 2);
  const size_t row_bytes = first_meta.nbytes() / static_cast<size_t>(rows);
  auto digests_with = [&](const json& first_entry) {
    json digests = json::object();
    for (const TensorMeta& m : *tensors) {
      digests[m.name] = HexDigest(DigestAlgorithm::kXxh3_128, std::vector<std::byte>(m.nbytes(), std::byte{7}));
    }
    digests[first] = first_entry;
    return digests;
  };
  const std::vector<std::byte> one_row(row_bytes, std::byte{7}), rest(row_bytes * (rows - 1), std::byte{7});
  const std::string row_hex = HexDigest(DigestAlgorithm::kXxh3_128, one_row);
  const std::string rest_hex = HexDigest(DigestAlgorithm::kXxh3_128, rest);
  auto finish = [&](const json& first_entry) {
    EXPECT_TRUE(server_->StartLoraWeightUpdate(spec, true).ok());
    EXPECT_TRUE(server_->UpdateWeights(update).ok());
    return server_->FinishWeightUpdateVerified(std::nullopt, digests_with(first_entry), "xxh3_128");
  };

  Result<json> bad = finish(json{{"rows", {{0, 1, row_hex}, {1, rows, row_hex}}}});
  EXPECT_EQ(bad.status().code(), StatusCode::kDataLoss) << bad.status().ToString();
  EXPECT_NE(bad.status().message().find(first), std::string::npos) << bad.status().ToString();
  EXPECT_EQ(server_->Health()["lora"]["adapters"].size(), 0u);

  Result<json> gap = finish(json{{"rows", {{0, 1, row_hex}, {2, rows, rest_hex}}}});
  EXPECT_EQ(gap.status().code(), StatusCode::kInvalidArgument) << gap.status().ToString();
  EXPECT_NE(gap.status().message().find("wsync_digests[" + first + "]"), std::string::npos) << gap.status().ToString();

  Result<json> good = finish(json{{"rows", {{0, 1, row_hex}, {1, rows, rest_hex}}}});
  ASSERT_TRUE(good.ok()) << good.status().ToString();
  EXPECT_EQ((*good)["verified"]["tensors"].get<size_t>(), update["names"].size()) << good->dump();
  EXPECT_EQ(server_->Health()["lora"]["adapters"][0]["version"], "step-1");
}

TEST_F(LoraServerTest, TheRoutesCarryTheSpecAndAnswerWithTheirCodes) {
  HttpRouter router(HttpRouterOptions{}, server_.get());
  auto call = [&](const char* method, const char* path, const json& body) {
    HttpRequest req;
    req.method = method;
    req.path = path;
    if (!body.is_null()) req.body = body.dump();
    return router.Handle(req);
  };
  EXPECT_EQ(call("POST", "/start_weight_update", json{{"wsync_lora", "math"}}).status, 400);
  json spec = Spec("math", "http-1");
  ASSERT_EQ(call("POST", "/start_weight_update", json{{"wsync_lora", spec}}).status, 200);
  ASSERT_EQ(call("POST", "/update_weights", json{{"update_info", Update(spec, 9)}}).status, 200);
  ASSERT_EQ(call("POST", "/finish_weight_update", json::object()).status, 200);
  HttpResponse models = call("GET", "/v1/models", nullptr);
  ASSERT_EQ(models.status, 200);
  EXPECT_EQ(json::parse(models.body)["data"][1]["lora_version"], "http-1");
  HttpResponse sums = call("POST", "/weight_checker", json{{"action", "checksum"}, {"lora", "math"}});
  ASSERT_EQ(sums.status, 200) << sums.body;
  EXPECT_EQ(json::parse(sums.body)["algorithm"], "xxh3_128");
  EXPECT_EQ(call("POST", "/weight_checker", json{{"action", "reset"}, {"lora", "math"}}).status, 400);
  EXPECT_EQ(call("POST", "/v1/completions", json{{"model", "nope"}, {"prompt", "x"}}).status, 404);
  EXPECT_EQ(call("POST", "/v1/completions", json{{"model", "math"}, {"prompt", "x"}}).status, 200);
  EXPECT_EQ(call("POST", "/v1/unload_lora_adapter", json::object()).status, 400);
  EXPECT_EQ(call("POST", "/v1/unload_lora_adapter", json{{"lora_name", "nope"}}).status, 404);
  EXPECT_EQ(call("POST", "/v1/unload_lora_adapter", json{{"lora_name", "math"}}).status, 200);
  EXPECT_EQ(call("POST", "/weight_checker", json{{"action", "checksum"}, {"lora", "math"}}).status, 404);
}

TEST(LoraServerOff, WithoutMaxLorasALoraSessionIsRefused) {
  InferenceServerOptions o;
  auto s = InferenceServer::Create(o, [](std::string_view, ReceiverContext* ctx) -> Result<std::unique_ptr<ReceiverBackend>> {
    return std::unique_ptr<ReceiverBackend>(std::make_unique<FillingBackend>(ctx));
  });
  ASSERT_TRUE(s.ok());
  Status st = (*s)->StartLoraWeightUpdate(json::object(), false);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("--max-loras"), std::string::npos);
  EXPECT_TRUE((*s)->Health()["lora"].is_null());
}

}  // namespace
}  // namespace wsync
