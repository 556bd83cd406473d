// `serve --api-key` (and WSYNC_API_KEY): every route but /health needs
// `Authorization: Bearer KEY`; a trainer without the key fails and says why, a trainer
// with it syncs bit-exact.
#include <algorithm>
#include <cctype>

#include "e2e_test_base.h"

namespace wsync::e2e {
namespace {

class ApiKeyTest : public E2eTest {};

std::string Lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

TEST_F(ApiKeyTest, RoutesNeedTheKeyAndOnlyAPushWithTheKeySyncs) {
  const std::string key = "e2e-secret-key";
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("serve", {"--model", "qwen3-tiny", "--api-key", key}));

  EXPECT_EQ(HttpGet(s.url, "/health").status, 200);
  EXPECT_EQ(HttpGet(s.url, "/get_world_size").status, 401);
  EXPECT_EQ(HttpGet(s.url, "/get_world_size", "not-the-key").status, 401);
  EXPECT_EQ(HttpPost(s.url, "/start_weight_update", "").status, 401);
  HttpReply ok = HttpGet(s.url, "/get_world_size", key);
  ASSERT_EQ(ok.status, 200) << ok.Describe();
  EXPECT_EQ(ok.json.value("world_size", -1), 1);

  RunResult keyless = Push("push_no_key", {s}, {"--model", "qwen3-tiny", "--seed", "6", "--verify",
                                                "--timeout", "30"});
  EXPECT_FALSE(keyless.timed_out) << keyless.description;
  EXPECT_TRUE(keyless.exit.exited && keyless.exit.code != 0) << keyless.description;
  std::string err = Lower(keyless.err);
  EXPECT_TRUE(err.find("401") != std::string::npos || err.find("authorization") != std::string::npos)
      << "stderr must say the server wants a key:\n" << keyless.description;

  RunResult keyed = Push("push_key", {s}, {"--model", "qwen3-tiny", "--seed", "6", "--steps", "1",
                                           "--verify", "--api-key", key, "--timeout", "60"});
  ASSERT_TRUE(keyed.success()) << keyed.description;
  E2E_ASSERT_OK_AND_ASSIGN(Digests want, ExpectedSyntheticDigests("qwen3-tiny", 6, 1,
                                                                  DigestAlgorithm::kXxh3_128));
  ExpectServersHold({s}, want, DigestAlgorithm::kXxh3_128, key);
  EXPECT_EQ(HttpPost(s.url, "/weight_checker", R"({"action":"checksum"})").status, 401);
}

TEST_F(ApiKeyTest, ServeTakesTheKeyFromWsyncApiKeyEnvironment) {
  const std::string key = "e2e-env-key";
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("serve", {"--model", "qwen3-tiny"},
                                                 {{"WSYNC_API_KEY", key}}));
  EXPECT_EQ(HttpGet(s.url, "/health").status, 200);
  EXPECT_EQ(HttpGet(s.url, "/get_world_size").status, 401);
  EXPECT_EQ(HttpGet(s.url, "/get_world_size", "wrong").status, 401);
  EXPECT_EQ(HttpGet(s.url, "/get_world_size", key).status, 200);
}

}  // namespace
}  // namespace wsync::e2e
