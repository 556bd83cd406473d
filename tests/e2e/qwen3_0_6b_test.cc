// One sync of a real-size model (qwen3-0.6b, 1.2 GB of bf16 with tied embeddings) into a
// TP=2 server, checked bit-exact, with the memory both sides report: neither the trainer
// nor the server's verification holds a second copy of the model. Labelled "slow".
#include <cmath>
#include <regex>

#include "e2e_test_base.h"

namespace wsync::e2e {
namespace {

class Qwen3_0_6bTest : public E2eTest {};

constexpr double kMB = 1e6;
// The model's bytes (qwen3-0.6b, bf16, tied embeddings).
constexpr double kModelBytes = 1192099840;

TEST_F(Qwen3_0_6bTest, OneStepIntoTp2ServerMatchesTrainerInBoundedMemory) {
  // Computed first, so the test's own copy of the model is freed before the CLI runs.
  E2E_ASSERT_OK_AND_ASSIGN(Digests want, ExpectedSyntheticDigests("qwen3-0.6b", 17, 1,
                                                                  DigestAlgorithm::kXxh3_128));
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("tp2", {"--model", "qwen3-0.6b", "--tp", "2"},
                                                 {}, /*ready_seconds=*/120));
  // Buckets of 0.5 GB: the trainer's staging is two of them.
  const double bucket = 0.5 * (1 << 30);
  RunResult push = Push("push", {s}, {"--model", "qwen3-0.6b", "--seed", "17", "--steps", "1",
                                      "--verify", "--timeout", "300", "--bucket-gb", "0.5"},
                        /*timeout_seconds=*/480);
  ASSERT_TRUE(push.success()) << push.description;
  EXPECT_TRUE(HasVerifiedTable(push.out, 2));
  ExpectServersHold({s}, want, DigestAlgorithm::kXxh3_128);
  std::cout << "[e2e] qwen3-0.6b push took " << push.seconds << " s\n";

  // The trainer: one copy of the model plus its staging (an fp32 master or a second copy
  // would add 1.2-2.4 GB), and a verification that hashes in place.
  std::smatch m;
  const std::regex summary(
      R"(memory: model ([0-9.]+) MB on cpu; process RSS [0-9.]+ MB \(peak ([0-9.]+) MB\); peak extra per sync: )"
      R"(host ([0-9.]+) MB, device ([0-9.]+) MB; per verification: host ([0-9.]+) MB)");
  ASSERT_TRUE(std::regex_search(push.err, m, summary)) << push.description;
  EXPECT_DOUBLE_EQ(std::stod(m[1]), std::round(kModelBytes / kMB * 10) / 10);
  const double peak_rss = std::stod(m[2]) * kMB;
  EXPECT_LE(peak_rss, kModelBytes + 2 * bucket + 384 * kMB) << m[0];
  EXPECT_LE(std::stod(m[5]) * kMB, 256 * kMB) << m[0];
  EXPECT_EQ(std::stod(m[4]), 0.0) << m[0];

  // The server: /weight_checker's read-back of a model far larger than one read-back
  // block (the 311 MB embedding alone) takes bounded extra memory, reported in /health.
  HttpReply health = HttpGet(s.url, "/health");
  ASSERT_EQ(health.status, 200) << health.Describe();
  const nlohmann::json& mem = health.json["memory"];
  ASSERT_TRUE(mem["last_checksum"].is_object()) << health.Describe();
  ASSERT_TRUE(mem["last_sync"].is_object()) << health.Describe();
  EXPECT_LE(mem["last_checksum"]["host_peak_extra_bytes"].get<int64_t>(), 256 * kMB) << health.Describe();
  EXPECT_EQ(mem["last_checksum"]["device_peak_extra_bytes"].get<int64_t>(), 0) << health.Describe();
  EXPECT_GE(mem["last_sync"]["host_peak_extra_bytes"].get<int64_t>(), 0) << health.Describe();
  std::cout << "[e2e] trainer peak RSS " << peak_rss / kMB << " MB for a " << kModelBytes / kMB
            << " MB model; server checksum read-back +"
            << mem["last_checksum"]["host_peak_extra_bytes"].get<int64_t>() / kMB << " MB\n";
}

}  // namespace
}  // namespace wsync::e2e
