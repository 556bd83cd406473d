#include "python/hosted_service.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

namespace wsync {
namespace {

using nlohmann::json;

// Workers that record what they receive; worker `failing` refuses every update.
struct Fleet {
  std::vector<std::vector<json>> received;
  std::map<std::string, std::string> sums{{"a", "00"}, {"b", "11"}};
  int failing = -1;
  Status refusal = InvalidArgument("bad tensor list");

  std::vector<HostedWorker> Workers(size_t n) {
    received.resize(n);
    std::vector<HostedWorker> out(n);
    for (size_t i = 0; i < n; ++i) {
      out[i].init = [](const json&, const std::string&) { return Status::Ok(); };
      out[i].receive = [this, i](const json& info) {
        received[i].push_back(info);
        return static_cast<int>(i) == failing ? refusal : Status::Ok();
      };
      out[i].checksums = [this, i](DigestAlgorithm) -> Result<std::map<std::string, std::string>> {
        auto s = sums;
        if (i == 1 && failing == 1) s["b"] = "ff";
        return s;
      };
    }
    return out;
  }
};

HostedServiceOptions Options() {
  HostedServiceOptions o;
  o.model = "m";
  o.backend = "nccl";
  o.device = "cpu";
  o.timeout_seconds = 5;
  o.frontend_name = "the test front";
  return o;
}

TEST(HostedService, ListFormGivesEachWorkerItsEntryAndAWrongLengthEndsTheSession) {
  Fleet fleet;
  HostedService svc(Options(), fleet.Workers(2));
  ASSERT_TRUE(svc.StartWeightUpdate().ok());
  auto list = std::make_shared<const json>(json::parse(R"([{"w":0},{"w":1}])"));
  ASSERT_TRUE(svc.UpdateWeights(list).ok());
  ASSERT_EQ(fleet.received[0].size(), 1u);
  ASSERT_EQ(fleet.received[1].size(), 1u);
  EXPECT_EQ(fleet.received[0][0], json::parse(R"({"w":0})"));
  EXPECT_EQ(fleet.received[1][0], json::parse(R"({"w":1})"));
  Status s = svc.UpdateWeights(std::make_shared<const json>(json::parse(R"([{}])")));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("update_info is a list of 1 entries"), std::string::npos) << s.message();
  EXPECT_FALSE(svc.Health()["session_active"].get<bool>());
  EXPECT_TRUE(svc.Health()["weights_consistent"].get<bool>());  // a refusal lands nothing
}

TEST(HostedService, AFailedUpdateEndsTheSessionAndAFinishedOneSetsTheVersion) {
  Fleet fleet;
  fleet.failing = 1;
  fleet.refusal = Internal("worker 1: load_weights raised RuntimeError: disk on fire");
  HostedService svc(Options(), fleet.Workers(2));
  ASSERT_TRUE(svc.StartWeightUpdate().ok());
  Status s = svc.UpdateWeights(std::make_shared<const json>(json::object()));
  EXPECT_EQ(s.message(), "worker 1: load_weights raised RuntimeError: disk on fire");
  json health = svc.Health();
  EXPECT_FALSE(health["session_active"].get<bool>());
  EXPECT_FALSE(health["weights_consistent"].get<bool>());
  EXPECT_EQ(svc.FinishWeightUpdate("v1").code(), StatusCode::kFailedPrecondition);
  fleet.failing = -1;
  ASSERT_TRUE(svc.StartWeightUpdate().ok());
  ASSERT_TRUE(svc.UpdateWeights(std::make_shared<const json>(json::object())).ok());
  ASSERT_TRUE(svc.FinishWeightUpdate("v1").ok());
  EXPECT_EQ(svc.WeightVersion(), "v1");
  EXPECT_TRUE(svc.Health()["weights_consistent"].get<bool>());
  EXPECT_EQ(svc.Health()["syncs"], 1);
}

TEST(HostedService, ChecksumsOfWorkersThatDifferAreDataLossAndRefusedInASession) {
  Fleet fleet;
  HostedService svc(Options(), fleet.Workers(2));
  Result<std::map<std::string, std::string>> sums = svc.Checksums(DigestAlgorithm::kSha256);
  ASSERT_TRUE(sums.ok()) << sums.status().ToString();
  EXPECT_EQ(*sums, fleet.sums);
  fleet.failing = 1;
  sums = svc.Checksums(DigestAlgorithm::kSha256);
  EXPECT_EQ(sums.status().code(), StatusCode::kDataLoss);
  EXPECT_EQ(sums.status().message(), "worker 1 differs from worker 0 in b");
  ASSERT_TRUE(svc.StartWeightUpdate().ok());
  EXPECT_EQ(svc.Checksums(DigestAlgorithm::kSha256).status().code(), StatusCode::kFailedPrecondition);
}

TEST(HostedService, WhatItLacksIsUnimplementedNamingTheRouteAndTheFront) {
  Fleet fleet;
  HostedService svc(Options(), fleet.Workers(1));
  EXPECT_EQ(svc.Sleep(1, "abort").message(), "/sleep: the test front has no sleep mode (its models' memory is their own)");
  EXPECT_EQ(svc.Complete(json::object()).status().message(), "/v1/completions: the test front has no generation");
  EXPECT_EQ(svc.Pause("later", true).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(svc.Pause("keep", true).ok());
  EXPECT_TRUE(svc.IsPaused());
}

// Counts its live copies; letting go of one takes a while, as dropping a Python object
// does when it must wait for the GIL.
struct SlowToRelease {
  static inline std::atomic<int> live{0};
  SlowToRelease() { ++live; }
  SlowToRelease(const SlowToRelease&) { ++live; }
  ~SlowToRelease() {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    --live;
  }
};

// A call's per-worker threads let go of what the workers' functions hold before the call
// returns: the caller (Python's worker server) may then drop the workers, and with them
// the interpreter, and nothing of theirs may be released on a thread it no longer knows.
TEST(HostedService, ACallLeavesNothingOfTheWorkersOnItsThreads) {
  std::vector<HostedWorker> workers(2);
  {
    SlowToRelease held;
    for (HostedWorker& w : workers) {
      w.checksums = [held](DigestAlgorithm) -> Result<std::map<std::string, std::string>> {
        return std::map<std::string, std::string>{{"a", "00"}};
      };
      w.init = [held](const json&, const std::string&) { return Status::Ok(); };
    }
  }
  ASSERT_EQ(SlowToRelease::live.load(), 4);
  HostedService svc(Options(), std::move(workers));
  ASSERT_TRUE(svc.Checksums(DigestAlgorithm::kSha256).ok());
  EXPECT_EQ(SlowToRelease::live.load(), 4);
  ASSERT_TRUE(svc.InitWeightTransfer(json::object(), "127.0.0.1").ok());
  EXPECT_EQ(SlowToRelease::live.load(), 4);
}

}  // namespace
}  // namespace wsync
