// Bad control-plane input against a live `wsync serve`, over raw HTTP: every refusal has
// the right status code and a message naming the field or tensor, the server stays up,
// and a full trainer sync afterwards still lands bit-exact. A trainer of another backend
// is told which backend the server runs.
#include <string>
#include <vector>

#include <fmt/format.h>

#include "e2e_test_base.h"

namespace wsync::e2e {
namespace {

using nlohmann::json;

class ControlErrorsTest : public E2eTest {
 protected:
  // A valid one-tensor update of qwen3-tiny (model.norm.weight is bf16 [256]).
  static json NormUpdate() {
    return json{{"update_info",
                 {{"names", {"model.norm.weight"}},
                  {"dtype_names", {"bfloat16"}},
                  {"shapes", {{256}}}}}};
  }
  // An update whose update_info has `field` replaced.
  static json NormUpdateWith(const std::string& field, json value) {
    json u = NormUpdate();
    u["update_info"][field] = std::move(value);
    return u;
  }
};

TEST_F(ControlErrorsTest, BadRequestsGetExactCodesAndNamedMessagesThenAValidSyncSucceeds) {
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("serve", {"--model", "qwen3-tiny", "--tp", "2",
                                                           "--max-body-mb", "1"}));
  const std::string& u = s.url;

  // Init payloads.
  EXPECT_TRUE(IsError(HttpPost(u, "/init_weight_transfer_engine", "{\"init_info\": {"), 400, {"JSON"}));
  EXPECT_TRUE(IsError(HttpPostJson(u, "/init_weight_transfer_engine", json::object()), 400, {"init_info"}));
  EXPECT_TRUE(IsError(HttpPostJson(u, "/init_weight_transfer_engine", json{{"init_info", 5}}), 400,
                      {"init_info"}));

  // Session state: update and finish outside a session, start twice.
  EXPECT_TRUE(IsError(HttpPostJson(u, "/update_weights", NormUpdate()), 409, {}));
  EXPECT_TRUE(IsError(HttpPostJson(u, "/finish_weight_update", json::object()), 409, {}));
  ASSERT_EQ(HttpPostJson(u, "/start_weight_update", json::object()).status, 200);
  EXPECT_TRUE(IsError(HttpPostJson(u, "/start_weight_update", json::object()), 409, {}));

  // Update payloads, inside the session.
  EXPECT_TRUE(IsError(HttpPost(u, "/update_weights", "{\"update_info\": [1,"), 400, {"JSON"}));
  EXPECT_TRUE(IsError(HttpPostJson(u, "/update_weights", json{{"names", json::array()}}), 400,
                      {"update_info"}));

  struct BadUpdate {
    const char* what;
    json body;
    std::vector<std::string> needles;
  };
  const BadUpdate bad[] = {
      {"unequal list lengths",
       NormUpdateWith("names", {"model.norm.weight", "model.embed_tokens.weight"}),
       {"names", "dtype_names", "shapes"}},
      {"missing names list",
       json{{"update_info", {{"dtype_names", {"bfloat16"}}, {"shapes", {{256}}}}}},
       {"names"}},
      {"unknown dtype", NormUpdateWith("dtype_names", {"bfloat17"}), {"bfloat17"}},
      {"a name the model lacks", NormUpdateWith("names", {"model.layers.99.mlp.up_proj.weight"}),
       {"model.layers.99.mlp.up_proj.weight"}},
      {"a wrong shape", NormUpdateWith("shapes", {{512}}), {"model.norm.weight", "shape"}},
      {"a wrong dtype", NormUpdateWith("dtype_names", {"float16"}), {"model.norm.weight", "dtype"}},
  };
  for (const BadUpdate& b : bad) {
    SCOPED_TRACE(b.what);
    // A session must be active so that the payload itself is what gets refused; a
    // refused update may or may not have ended the previous one.
    int start = HttpPostJson(u, "/start_weight_update", json::object()).status;
    ASSERT_TRUE(start == 200 || start == 409) << start;
    EXPECT_TRUE(IsError(HttpPostJson(u, "/update_weights", b.body), 400, b.needles));
  }
  // A refused update ends its session.
  EXPECT_TRUE(IsError(HttpPostJson(u, "/finish_weight_update", json::object()), 409, {}));

  // A body over --max-body-mb 1.
  std::string big = "{\"update_info\": {\"names\": [\"" + std::string(2 << 20, 'x') + "\"]}}";
  EXPECT_TRUE(IsError(HttpPost(u, "/update_weights", big), 413, {}));

  // Still up and still answering.
  EXPECT_EQ(HttpGet(u, "/health").status, 200);
  HttpReply ws = HttpGet(u, "/get_world_size");
  ASSERT_EQ(ws.status, 200) << ws.Describe();
  EXPECT_EQ(ws.json.value("world_size", -1), 2);

  RunResult push = Push("push", {s}, {"--model", "qwen3-tiny", "--seed", "13", "--steps", "1",
                                      "--verify", "--timeout", "60"});
  ASSERT_TRUE(push.success()) << push.description;
  E2E_ASSERT_OK_AND_ASSIGN(Digests want, ExpectedSyntheticDigests("qwen3-tiny", 13, 1,
                                                                  DigestAlgorithm::kXxh3_128));
  ExpectServersHold({s}, want, DigestAlgorithm::kXxh3_128);
  ExpectCleanShutdown(s);
}

TEST_F(ControlErrorsTest, PushOfAnotherModelFailsNamingServerAndTensorThenTheRightModelSyncs) {
  // The refusal travels the data-plane path: the server must turn the trainer down inside
  // the collective instead of leaving it waiting for its --timeout.
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("serve", {"--model", "qwen3-tiny", "--tp", "2"}));
  RunResult wrong = Push("push_moe", {s}, {"--model", "qwen3-moe-tiny", "--seed", "1", "--verify",
                                           "--timeout", "60"},
                         /*timeout_seconds=*/90);
  EXPECT_FALSE(wrong.timed_out) << wrong.description;
  EXPECT_TRUE(wrong.exit.exited && wrong.exit.code != 0) << wrong.description;
  EXPECT_LT(wrong.seconds, 30) << "a refused update must not wait for the timeout\n" << wrong.description;
  EXPECT_NE(wrong.err.find(s.url), std::string::npos) << wrong.description;
  EXPECT_NE(wrong.err.find("mlp."), std::string::npos)
      << "stderr must name a tensor qwen3-tiny lacks:\n" << wrong.description;
  EXPECT_EQ(HttpGet(s.url, "/health").status, 200);

  RunResult right = Push("push_tiny", {s}, {"--model", "qwen3-tiny", "--seed", "8", "--verify",
                                            "--timeout", "60"});
  ASSERT_TRUE(right.success()) << right.description << "\n--- server ---\n" << s.process->Describe();
  E2E_ASSERT_OK_AND_ASSIGN(Digests want, ExpectedSyntheticDigests("qwen3-tiny", 8, 0,
                                                                  DigestAlgorithm::kXxh3_128));
  ExpectServersHold({s}, want, DigestAlgorithm::kXxh3_128);
}

// A trainer of one backend against a server of another: /health names the server's
// backend, so a wsync trainer refuses before init, naming both backends; an init_info of
// another backend that reaches a server anyway (another trainer) is refused with 409
// naming both backends, the field that gave it away and the way out, whichever pair it
// is. The server stays up and syncs with the right trainer afterwards.
TEST_F(ControlErrorsTest, ABackendMismatchIsNamedWithBothBackendsThenTheRightBackendSyncs) {
  E2E_ASSERT_OK_AND_ASSIGN(Server nccl, StartServer("serve_nccl", {"--model", "qwen3-tiny"}));
  E2E_ASSERT_OK_AND_ASSIGN(Server delta, StartServer("serve_delta", {"--model", "qwen3-tiny", "--backend", "delta"}));
  HttpReply health = HttpGet(nccl.url, "/health");
  ASSERT_EQ(health.status, 200) << health.Describe();
  EXPECT_EQ(health.json.value("backend", ""), "nccl") << health.Describe();
  EXPECT_EQ(HttpGet(delta.url, "/health").json.value("backend", ""), "delta");

  const std::string expected = fmt::format(
      "the trainer asked for backend 'ipc', but {} runs backend 'nccl': start the servers with --backend ipc "
      "or push with the servers' backend", nccl.url);
  RunResult ipc_push = RunWsync("push_ipc", {"push", "--servers", nccl.url, "--backend", "ipc", "--model",
                                             "qwen3-tiny", "--seed", "1", "--timeout", "30"},
                                /*timeout_seconds=*/60);
  EXPECT_FALSE(ipc_push.timed_out) << ipc_push.description;
  EXPECT_TRUE(ipc_push.exit.exited && ipc_push.exit.code != 0) << ipc_push.description;
  EXPECT_LT(ipc_push.seconds, 20) << "a refused init must not wait for the timeout\n" << ipc_push.description;
  EXPECT_NE(ipc_push.err.find(nccl.url), std::string::npos) << ipc_push.description;
  EXPECT_NE(ipc_push.err.find(expected), std::string::npos) << ipc_push.description;

  // Raw init_infos of each other backend.
  const json delta_init = {{"sync_dir", (dir() / "sync").string()}, {"format_version", 1}};
  EXPECT_TRUE(IsError(HttpPostJson(nccl.url, "/init_weight_transfer_engine", json{{"init_info", delta_init}}), 409,
                      {"this server runs backend 'nccl'; the init_info is for backend 'delta' (field "
                       "'format_version'): start the server with --backend delta or push with --backend nccl"}));
  const json nccl_init = {{"world_size", 2}, {"rank_offset", 1}, {"gloo_store_host", "127.0.0.1"},
                          {"gloo_store_port", 1}};
  EXPECT_TRUE(IsError(HttpPostJson(delta.url, "/init_weight_transfer_engine", json{{"init_info", nccl_init}}), 409,
                      {"this server runs backend 'delta'; the init_info is for backend 'nccl' (field "
                       "'gloo_store_host'): start the server with --backend nccl or push with --backend delta"}));
  // An unknown field no backend claims still gets the backend's own parser's answer.
  EXPECT_TRUE(IsError(HttpPostJson(nccl.url, "/init_weight_transfer_engine",
                                   json{{"init_info", {{"world_size", 2}, {"rank_offset", 1}, {"bogus", 1}}}}),
                      400, {"init_info has unknown field 'bogus'"}));

  RunResult right = Push("push_nccl", {nccl}, {"--model", "qwen3-tiny", "--seed", "3", "--verify", "--timeout", "60"});
  ASSERT_TRUE(right.success()) << right.description << "\n--- server ---\n" << nccl.process->Describe();
  E2E_ASSERT_OK_AND_ASSIGN(Digests want, ExpectedSyntheticDigests("qwen3-tiny", 3, 0, DigestAlgorithm::kXxh3_128));
  ExpectServersHold({nccl}, want, DigestAlgorithm::kXxh3_128);
}

TEST_F(ControlErrorsTest, PauseResumeAndPrefixCacheRoutesAnswerLikeVllm) {
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("serve", {"--model", "qwen3-tiny"}));
  const std::string& u = s.url;
  HttpReply paused = HttpGet(u, "/is_paused");
  ASSERT_EQ(paused.status, 200) << paused.Describe();
  EXPECT_EQ(paused.json.value("is_paused", true), false);

  EXPECT_EQ(HttpPost(u, "/pause?mode=keep", "").status, 200);
  EXPECT_EQ(HttpGet(u, "/is_paused").json.value("is_paused", false), true);
  EXPECT_EQ(HttpPost(u, "/resume", "").status, 200);
  EXPECT_EQ(HttpGet(u, "/is_paused").json.value("is_paused", true), false);
  EXPECT_TRUE(IsError(HttpPost(u, "/pause?mode=sideways", ""), 400, {"sideways"}));
  EXPECT_EQ(HttpPost(u, "/reset_prefix_cache", "").status, 200);

  HttpReply info = HttpGet(u, "/weight_info");
  ASSERT_EQ(info.status, 200) << info.Describe();
  EXPECT_TRUE(info.json.contains("weight_version")) << info.body;
}

}  // namespace
}  // namespace wsync::e2e
