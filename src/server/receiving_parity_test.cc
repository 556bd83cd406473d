// The receive side's rules, one table, two hosts: every case runs through a
// ReceiverEngine (include/wsync/receiver.h, what a Python front drives) and through
// `wsync serve`'s InferenceServer, both over the registry's ipc backend and the same
// model, and both must answer each step with the same status code and, where admission
// or the session decides (not the host's own description of what it holds), the same
// message.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "model/config.h"
#include "receiver/backend.h"
#include "server/inference_server.h"
#include "wsync/receiver.h"

namespace wsync {
namespace {

using nlohmann::json;

constexpr uint64_t kMaxUpdateBytes = 4096;

// One host of the receive side, seen through the session routes.
class Host {
 public:
  virtual ~Host() = default;
  virtual Status Start() = 0;
  virtual Status Update(const json& update_info) = 0;
  virtual Status Finish() = 0;
  virtual bool Consistent() = 0;
};

class EngineHost final : public Host {
 public:
  EngineHost() {
    ReceiverEngineOptions o;
    o.backend = "ipc";
    o.timeout_seconds = 30;
    o.metadata = HfTensors(*LookupModel("qwen3-tiny"));
    o.max_update_bytes = kMaxUpdateBytes;
    o.label = "worker 0";
    auto made = ReceiverEngine::Create(o);
    EXPECT_TRUE(made.ok()) << made.status().ToString();
    engine_ = std::move(*made);
  }
  Status Start() override { return engine_->StartWeightUpdate(); }
  Status Update(const json& update_info) override {
    return engine_->UpdateWeights(update_info, [](std::span<const TensorRef>) { return Status::Ok(); });
  }
  Status Finish() override { return engine_->FinishWeightUpdate(); }
  bool Consistent() override { return engine_->Session().weights_consistent; }

 private:
  std::unique_ptr<ReceiverEngine> engine_;
};

class ServerHost final : public Host {
 public:
  ServerHost() {
    InferenceServerOptions o;
    o.model = "qwen3-tiny";
    o.backend = "ipc";
    o.timeout_seconds = 30;
    o.max_update_bytes = kMaxUpdateBytes;
    auto made = InferenceServer::Create(o, CreateReceiverBackend);
    EXPECT_TRUE(made.ok()) << made.status().ToString();
    server_ = std::move(*made);
  }
  Status Start() override { return server_->StartWeightUpdate(); }
  Status Update(const json& update_info) override { return server_->UpdateWeights(update_info); }
  Status Finish() override { return server_->FinishWeightUpdate(std::nullopt); }
  bool Consistent() override { return server_->Health()["weights_consistent"].get<bool>(); }

 private:
  std::unique_ptr<InferenceServer> server_;
};

json Info(const std::vector<std::tuple<std::string, std::string, std::vector<int64_t>>>& tensors) {
  json info{{"names", json::array()}, {"dtype_names", json::array()}, {"shapes", json::array()}};
  for (const auto& [name, dtype, shape] : tensors) {
    info["names"].push_back(name);
    info["dtype_names"].push_back(dtype);
    info["shapes"].push_back(shape);
  }
  return info;
}

std::vector<int64_t> EmbedShape() {
  for (const TensorMeta& m : HfTensors(*LookupModel("qwen3-tiny"))) {
    if (m.name == "model.embed_tokens.weight") return std::vector<int64_t>(m.shape.begin(), m.shape.end());
  }
  return {};
}

struct Step {
  enum Op { kStart, kUpdate, kFinish } op;
  json update_info = nullptr;
};

struct Case {
  std::string name;
  std::vector<Step> steps;   // every step answers the same code on both hosts
  StatusCode code;           // the last step's
  std::string text;          // in the last step's message on both hosts
  bool same_message = true;  // the messages are equal (the engine's label aside)
};

Status RunStep(Host& host, const Step& step) {
  switch (step.op) {
    case Step::kStart: return host.Start();
    case Step::kUpdate: return host.Update(step.update_info);
    case Step::kFinish: return host.Finish();
  }
  return Internal("unknown step");
}

// The engine names its worker before each message ("worker 0: ...").
std::string WithoutLabel(const std::string& message) {
  constexpr std::string_view kLabel = "worker 0: ";
  return message.starts_with(kLabel) ? message.substr(kLabel.size()) : message;
}

std::vector<Case> Cases() {
  const Step start{Step::kStart};
  const Step finish{Step::kFinish};
  auto update = [](json info) { return Step{Step::kUpdate, std::move(info)}; };
  const json norm = Info({{"model.norm.weight", "bfloat16", {256}}});
  return {
      {"bad update_info", {start, update(json{{"names", "model.norm.weight"}})}, StatusCode::kInvalidArgument,
       "names"},
      {"update_info not an object", {start, update(json(7))}, StatusCode::kInvalidArgument,
       "update_info must be a JSON object"},
      {"shape mismatch", {start, update(Info({{"model.norm.weight", "bfloat16", {255}}}))},
       StatusCode::kInvalidArgument, "shape of model.norm.weight is [256], update says [255]"},
      {"dtype mismatch", {start, update(Info({{"model.norm.weight", "float32", {256}}}))},
       StatusCode::kInvalidArgument,
       "dtype of model.norm.weight is bfloat16, update says float32: send it as bfloat16 (Python: "
       "StateDictSource(..., dtype=torch.bfloat16) casts each tensor as it is sent)"},
      {"duplicate name",
       {start, update(Info({{"model.norm.weight", "bfloat16", {256}}, {"model.norm.weight", "bfloat16", {256}}}))},
       StatusCode::kInvalidArgument, "update_info names tensor model.norm.weight twice (entries 0 and 1)"},
      {"unknown tensor", {start, update(Info({{"model.layers.99.mlp.up_proj.weight", "bfloat16", {4, 4}}}))},
       StatusCode::kInvalidArgument,
       "update_info names tensor model.layers.99.mlp.up_proj.weight, which the worker does not hold"},
      {"over-size",
       {start, update(Info({{"model.norm.weight", "bfloat16", {256}}, {"model.embed_tokens.weight", "bfloat16", EmbedShape()}}))},
       StatusCode::kInvalidArgument, "the max_update_bytes limit"},
      {"update outside a session", {update(norm)}, StatusCode::kFailedPrecondition,
       "start_weight_update must be called before update_weights"},
      {"second start while active", {start, start}, StatusCode::kFailedPrecondition,
       "start_weight_update called while a weight update is already active", false},
      {"finish without start", {finish}, StatusCode::kFailedPrecondition,
       "finish_weight_update called without an active weight update; call start_weight_update first"},
      {"a refused update ends the session", {start, update(json(7)), finish}, StatusCode::kFailedPrecondition,
       "finish_weight_update called without an active weight update"},
      {"an empty session finishes", {start, finish}, StatusCode::kOk, ""},
  };
}

TEST(ReceivingParity, EngineAndServerAnswerEveryCaseAlike) {
  for (const Case& c : Cases()) {
    SCOPED_TRACE(c.name);
    EngineHost engine;
    ServerHost server;
    Status from_engine, from_server;
    for (size_t i = 0; i < c.steps.size(); ++i) {
      from_engine = RunStep(engine, c.steps[i]);
      from_server = RunStep(server, c.steps[i]);
      ASSERT_EQ(from_engine.code(), from_server.code())
          << "step " << i << ": " << from_engine.ToString() << " | " << from_server.ToString();
    }
    EXPECT_EQ(from_engine.code(), c.code) << from_engine.ToString();
    EXPECT_EQ(from_server.code(), c.code) << from_server.ToString();
    EXPECT_NE(from_engine.message().find(c.text), std::string::npos) << from_engine.ToString();
    EXPECT_NE(from_server.message().find(c.text), std::string::npos) << from_server.ToString();
    if (c.same_message) EXPECT_EQ(WithoutLabel(from_engine.message()), from_server.message());
    // A refusal lands nothing: the weights stay consistent on both.
    EXPECT_TRUE(engine.Consistent());
    EXPECT_TRUE(server.Consistent());
  }
}

}  // namespace
}  // namespace wsync
