// RankOutcomes: two ranks in one process, each with its own object, over rank 0's real
// store on loopback. The cases are the orders in which ranks of separate processes end a
// round and shut their engines down.
#include "engine/rank_outcomes.h"

#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <thread>

namespace wsync {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

struct Pair {
  std::unique_ptr<RankOutcomes> r0, r1;
};

Pair Make(double timeout_seconds) {
  RankOutcomesOptions o;
  o.world_size = 2;
  o.timeout_seconds = timeout_seconds;
  o.rank = 0;
  Result<std::unique_ptr<RankOutcomes>> r0 = RankOutcomes::Create(o);
  EXPECT_TRUE(r0.ok()) << r0.status().ToString();
  o.rank = 1;
  o.store_port = (*r0)->port();
  Result<std::unique_ptr<RankOutcomes>> r1 = RankOutcomes::Create(o);
  EXPECT_TRUE(r1.ok()) << r1.status().ToString();
  return Pair{std::move(r0).value(), std::move(r1).value()};
}

// Rank 0 fails, returns and shuts down before rank 1 reaches End (its source took
// longer): rank 1 still learns rank 0's cause, because rank 0's store stays up until
// rank 1 has read the round.
TEST(RankOutcomesTest, RankZeroFailingAndShuttingDownFirstStillTellsRankOne) {
  Pair p = Make(10);
  p.r0->Begin("1/send");
  p.r1->Begin("1/send");
  Status mine = Unavailable("server http://127.0.0.1:9 refused the connection");
  Status zero = p.r0->End("1/send", mine);
  EXPECT_EQ(zero.message(), mine.message());
  auto shut = std::async(std::launch::async, [&] { p.r0.reset(); });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  Status one = p.r1->End("1/send", Status::Ok());
  EXPECT_EQ(one.code(), StatusCode::kUnavailable) << one.ToString();
  EXPECT_NE(one.message().find("trainer rank 0 failed: server http://127.0.0.1:9 refused the connection"),
            std::string::npos) << one.ToString();
  ASSERT_EQ(shut.wait_for(std::chrono::seconds(5)), std::future_status::ready);
}

// A round every rank finished: rank 1 waits in End first; rank 0 ends and shuts down at
// once. Rank 1's outcome is OK, not a store that vanished under it.
TEST(RankOutcomesTest, ASuccessfulRoundEndsOkOnRankOneWhenRankZeroShutsDownAtOnce) {
  Pair p = Make(10);
  p.r0->Begin("1/send");
  p.r1->Begin("1/send");
  auto one = std::async(std::launch::async, [&] { return p.r1->End("1/send", Status::Ok()); });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_TRUE(p.r0->End("1/send", Status::Ok()).ok());
  const Clock::time_point t = Clock::now();
  p.r0.reset();
  EXPECT_LT(SecondsSince(t), 3.0);
  ASSERT_EQ(one.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  Status s = one.get();
  EXPECT_TRUE(s.ok()) << s.ToString();
}

// A rank whose engine is dropped in the middle of a round tells the others why, instead
// of leaving them to wait out its silence.
TEST(RankOutcomesTest, ARankShutDownMidRoundFailsTheRoundOnTheOthersAtOnce) {
  Pair p = Make(30);
  p.r0->Begin("2/send");
  p.r1->Begin("2/send");
  p.r1.reset();
  const Clock::time_point t = Clock::now();
  Status zero = p.r0->End("2/send", Status::Ok());
  EXPECT_LT(SecondsSince(t), 5.0);
  EXPECT_EQ(zero.code(), StatusCode::kAborted) << zero.ToString();
  EXPECT_NE(zero.message().find("trainer rank 1 failed: trainer rank 1's engine was shut down during sync 2/send"),
            std::string::npos) << zero.ToString();
}

// Rank 0 keeps its store up for a rank that never ends the round only for the timeout;
// that rank then finds the store gone and says so.
TEST(RankOutcomesTest, RankZeroWaitsForASilentRankOnlyForTheTimeout) {
  Pair p = Make(1.5);
  p.r0->Begin("3/send");
  p.r1->Begin("3/send");
  EXPECT_FALSE(p.r0->End("3/send", Aborted("rank 0's source raised")).ok());
  const Clock::time_point t = Clock::now();
  p.r0.reset();
  const double lingered = SecondsSince(t);
  EXPECT_GE(lingered, 1.4);
  EXPECT_LT(lingered, 4.0);
  Status one = p.r1->End("3/send", Status::Ok());
  EXPECT_EQ(one.code(), StatusCode::kUnavailable) << one.ToString();
  EXPECT_NE(one.message().find("group store"), std::string::npos) << one.ToString();
}

// A rank that never began the round (its process is gone) holds rank 0's shutdown only
// until it has been silent a few seconds, not for the whole timeout.
TEST(RankOutcomesTest, RankZeroStopsWaitingForARankThatNeverBeganTheRound) {
  Pair p = Make(60);
  p.r0->Begin("4/send");
  EXPECT_FALSE(p.r0->End("4/send", Aborted("rank 0's source raised")).ok());
  const Clock::time_point t = Clock::now();
  p.r0.reset();
  const double lingered = SecondsSince(t);
  EXPECT_GE(lingered, 4.5);
  EXPECT_LT(lingered, 10.0);
}

}  // namespace
}  // namespace wsync
