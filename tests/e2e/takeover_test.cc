// A trainer that dies inside a session (SIGKILL after its servers' start_weight_update)
// must not lock its servers out: a fresh trainer's init takes the session over and its
// sync lands bit-exact within seconds, on every backend whose session the test can open
// here (nccl over Gloo with two servers, ipc, sharded; delta's case, which also checks
// that the dead trainer's pause ends, is in delta_test.cc). The checker's rules inside a
// session are checked against a live server too.
#include <signal.h>

#include <chrono>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "e2e_test_base.h"

namespace wsync::e2e {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

struct Case {
  std::string backend;
  int servers;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.backend << " x" << c.servers; }

class TakeoverTest : public E2eTest, public ::testing::WithParamInterface<Case> {};

TEST_P(TakeoverTest, ATrainerKilledInsideASessionIsTakenOverByTheNextOne) {
  const Case& c = GetParam();
  std::vector<Server> servers;
  for (int i = 0; i < c.servers; ++i) {
    E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer(fmt::format("serve{}", i),
                                                   {"--model", "qwen3-tiny", "--backend", c.backend, "--tp", "2",
                                                    "--timeout", "60"}));
    servers.push_back(s);
  }
  std::vector<std::string> push = {"push", "--servers", JoinUrls(servers), "--backend", c.backend, "--model",
                                   "qwen3-tiny", "--seed", "3", "--timeout", "60"};
  E2E_ASSERT_OK_AND_ASSIGN(Subprocess * dying,
                           SpawnWsync("dying", push, {{"WSYNC_FAULT_TRAINER_STALL", "after-start"}}));
  Clock::time_point wait = Clock::now();
  while (dying->Stderr().find("stalled after start_weight_update") == std::string::npos) {
    ASSERT_TRUE(dying->Running()) << dying->Describe();
    ASSERT_LT(Clock::now() - wait, std::chrono::seconds(60)) << dying->Describe();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  for (const Server& s : servers) {
    EXPECT_EQ(HttpGet(s.url, "/health").json.value("session_active", false), true) << s.name;
  }
  dying->Signal(SIGKILL);
  ASSERT_TRUE(dying->Wait(Deadline::InSeconds(10)).has_value());

  Clock::time_point t = Clock::now();
  std::vector<std::string> next = push;
  next[next.size() - 3] = "4";  // --seed 4
  next.push_back("--verify");
  RunResult fresh = RunWsync("fresh", next, 120);
  const double took = std::chrono::duration<double>(Clock::now() - t).count();
  std::printf("[takeover] %s, %d server(s): the next trainer's verified sync %.2f s after the SIGKILL\n",
              c.backend.c_str(), c.servers, took);
  ASSERT_TRUE(fresh.success()) << fresh.description;
  EXPECT_LT(took, 30.0) << "the next trainer waited for the lease";
  E2E_ASSERT_OK_AND_ASSIGN(Digests want, ExpectedSyntheticDigests("qwen3-tiny", 4, 0, DigestAlgorithm::kXxh3_128));
  ExpectServersHold(servers, want, DigestAlgorithm::kXxh3_128);
  for (const Server& s : servers) {
    HttpReply h = HttpGet(s.url, "/health");
    EXPECT_EQ(h.json.value("taken_over_sessions", 0), 1) << h.Describe();
    EXPECT_EQ(h.json.value("weights_consistent", false), true) << h.Describe();
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, TakeoverTest,
                         ::testing::Values(Case{"nccl", 2}, Case{"ipc", 1}, Case{"sharded", 1}),
                         [](const auto& info) { return info.param.backend; });

class CheckerInSessionTest : public E2eTest {};

// The checker cannot forge consistency: a reset inside a session is refused; a reset
// outside one leaves the weights inconsistent until a session lands updates, which a
// session with no update cannot clear; a checksum poll inside a session is refused
// instead of failing the trainer's update.
TEST_F(CheckerInSessionTest, TheCheckerNeitherInterleavesWithNorIsClearedByASession) {
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("serve", {"--model", "qwen3-tiny"}));
  ASSERT_EQ(HttpPostJson(s.url, "/start_weight_update", json::object()).status, 200);
  for (const char* action : {"reset", "checksum"}) {
    HttpReply r = HttpPostJson(s.url, "/weight_checker", json{{"action", action}});
    EXPECT_TRUE(IsError(r, 409, {"weight_checker called during an active weight update; finish it first"})) << action;
  }
  HttpReply r = HttpPostJson(s.url, "/weight_checker", json{{"action", "checksum"}, {"algorithm", "xxh3_128"}});
  EXPECT_TRUE(IsError(r, 409, {"during an active weight update"})) << r.Describe();
  ASSERT_EQ(HttpPostJson(s.url, "/finish_weight_update", json::object()).status, 200);
  EXPECT_EQ(HttpGet(s.url, "/health").json.value("weights_consistent", false), true);

  ASSERT_EQ(HttpPostJson(s.url, "/weight_checker", json{{"action", "reset"}}).status, 200);
  ASSERT_EQ(HttpPostJson(s.url, "/start_weight_update", json::object()).status, 200);
  ASSERT_EQ(HttpPostJson(s.url, "/finish_weight_update", json::object()).status, 200);
  HttpReply h = HttpGet(s.url, "/health");
  EXPECT_EQ(h.json.value("weights_consistent", true), false) << "an empty session cleared the reset: " << h.Describe();
  RunResult push = Push("push", {s}, {"--model", "qwen3-tiny", "--seed", "9", "--verify", "--timeout", "60"});
  ASSERT_TRUE(push.success()) << push.description;
  EXPECT_EQ(HttpGet(s.url, "/health").json.value("weights_consistent", false), true);
}

}  // namespace
}  // namespace wsync::e2e
