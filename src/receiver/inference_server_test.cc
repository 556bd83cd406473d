// InferenceServer at the service boundary: a backend that throws from any call is answered
// with Internal naming the route, and the server takes the next call (no "in progress"
// left behind); the init request's peer address reaches the backend.
#include "receiver/inference_server.h"

#include <gtest/gtest.h>

#include <new>
#include <stdexcept>

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

}  // namespace
}  // namespace wsync
