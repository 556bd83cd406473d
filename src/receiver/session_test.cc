// The receiver's session state machine with a fake clock: busy flags freed however a call
// ends, and the lease that expires the session of a trainer that vanished.
#include "receiver/session.h"

#include <gtest/gtest.h>

#include <stdexcept>

namespace wsync {
namespace {

using Clock = ReceiverSession::Clock;

class SessionTest : public ::testing::Test {
 protected:
  // A session with a 10 s lease on a clock the test moves.
  ReceiverSession session_{10, [this] { return now_; }};
  Clock::time_point now_ = Clock::time_point() + std::chrono::hours(1);
  void Advance(double s) { now_ += std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s)); }
};

TEST_F(SessionTest, LifecycleAndRefusals) {
  Status outside;
  {
    auto update = session_.BeginUpdate(&outside);
    ASSERT_TRUE(update.ok());
    EXPECT_EQ(outside.code(), StatusCode::kFailedPrecondition);
    update->Done(outside, false);
  }
  EXPECT_EQ(session_.BeginFinish().status().code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(session_.Start().ok());
  EXPECT_EQ(session_.Start().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(session_.BeginExclusive("init_weight_transfer_engine", true).status().code(),
            StatusCode::kFailedPrecondition);
  {
    auto update = session_.BeginUpdate(&outside);
    ASSERT_TRUE(update.ok());
    EXPECT_TRUE(outside.ok());
    // One call at a time.
    Status other;
    EXPECT_EQ(session_.BeginUpdate(&other).status().message(), "update_weights refused: update_weights is in progress");
    EXPECT_EQ(session_.BeginExclusive("weight_checker").status().code(), StatusCode::kFailedPrecondition);
    update->Done(Status::Ok());
  }
  {
    auto finish = session_.BeginFinish();
    ASSERT_TRUE(finish.ok());
    finish->Done(Status::Ok());
  }
  ReceiverSession::Snapshot s = session_.Look();
  EXPECT_FALSE(s.active);
  EXPECT_TRUE(s.consistent);
  EXPECT_TRUE(s.busy_with.empty());
}

// A call that ends by an exception (no Done) frees the server, ends its session and marks
// the weights inconsistent: nothing answers "in progress" afterwards.
TEST_F(SessionTest, ACallThatThrowsFreesTheServer) {
  auto run_init_that_throws = [&] {
    auto init = session_.BeginExclusive("init_weight_transfer_engine", true);
    ASSERT_TRUE(init.ok());
    throw std::runtime_error("world_size 2147483647: bad_alloc");
  };
  EXPECT_THROW(run_init_that_throws(), std::runtime_error);
  auto again = session_.BeginExclusive("init_weight_transfer_engine", true);
  EXPECT_TRUE(again.ok()) << again.status().ToString();
}

TEST_F(SessionTest, AnUpdateThatThrowsEndsTheSessionInconsistent) {
  ASSERT_TRUE(session_.Start().ok());
  auto run_update_that_throws = [&] {
    Status outside;
    auto update = session_.BeginUpdate(&outside);
    ASSERT_TRUE(update.ok());
    throw std::runtime_error("boom");
  };
  EXPECT_THROW(run_update_that_throws(), std::runtime_error);
  ReceiverSession::Snapshot s = session_.Look();
  EXPECT_FALSE(s.active);
  EXPECT_FALSE(s.consistent);
  EXPECT_TRUE(s.busy_with.empty());
  ASSERT_TRUE(session_.Start().ok());  // the next trainer starts at once
}

TEST_F(SessionTest, ARefusedUpdateEndsTheSessionButLandsNothing) {
  ASSERT_TRUE(session_.Start().ok());
  {
    Status outside;
    auto update = session_.BeginUpdate(&outside);
    update->Done(InvalidArgument("bad shape"), /*may_have_landed=*/false);
  }
  EXPECT_FALSE(session_.Look().active);
  EXPECT_TRUE(session_.Look().consistent);
}

// The trainer is killed between start and update: the next trainer's start succeeds once
// the lease has run out, and nothing was written.
TEST_F(SessionTest, AnIdleSessionExpiresAfterItsLease) {
  ASSERT_TRUE(session_.Start().ok());
  Advance(9);
  Status refused = session_.Start();
  EXPECT_EQ(refused.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.message().find("expires after 10 s without a call"), std::string::npos) << refused.message();
  Advance(2);
  EXPECT_FALSE(session_.Look().active);
  EXPECT_TRUE(session_.Look().consistent);  // only start ran: no byte landed
  ASSERT_TRUE(session_.Start().ok());
  EXPECT_EQ(session_.Look().expired_sessions, 1);
}

// Killed between update and finish: the expired session's bytes landed without a finish,
// so the weights are inconsistent until the next finished session.
TEST_F(SessionTest, AnExpiredSessionWithUpdatesLeavesTheWeightsInconsistent) {
  ASSERT_TRUE(session_.Start().ok());
  {
    Status outside;
    auto update = session_.BeginUpdate(&outside);
    update->Done(Status::Ok());
  }
  EXPECT_TRUE(session_.Look().consistent);
  Advance(11);
  EXPECT_FALSE(session_.Look().consistent);  // /health sees it before any call does
  // The vanished trainer's late finish is refused, naming the expiry.
  auto late = session_.BeginFinish();
  ASSERT_FALSE(late.ok());
  EXPECT_NE(late.status().message().find("expired after 10 s"), std::string::npos) << late.status().message();
  ASSERT_TRUE(session_.Start().ok());
  EXPECT_FALSE(session_.Look().consistent);
  {
    Status outside;
    auto update = session_.BeginUpdate(&outside);
    update->Done(Status::Ok());
  }
  auto finish = session_.BeginFinish();
  ASSERT_TRUE(finish.ok());
  finish->Done(Status::Ok());
  EXPECT_TRUE(session_.Look().consistent);
}

// An update in flight is never expired, however long it runs; the lease counts from the
// end of the session's last call.
TEST_F(SessionTest, AnUpdateInFlightIsNeverExpired) {
  ASSERT_TRUE(session_.Start().ok());
  {
    Status outside;
    auto update = session_.BeginUpdate(&outside);
    ASSERT_TRUE(update.ok());
    Advance(1000);
    EXPECT_TRUE(session_.Look().active);
    EXPECT_EQ(session_.Start().code(), StatusCode::kFailedPrecondition);
    update->Done(Status::Ok());
  }
  auto checksum = session_.BeginExclusive("weight_checker");
  ASSERT_TRUE(checksum.ok());
  Advance(1000);  // a checksum in flight holds the server too
  EXPECT_TRUE(session_.Look().active);
}

TEST_F(SessionTest, TheLeaseRestartsAfterEveryCall) {
  ASSERT_TRUE(session_.Start().ok());
  for (int i = 0; i < 5; ++i) {
    Advance(8);
    Status outside;
    auto update = session_.BeginUpdate(&outside);
    ASSERT_TRUE(outside.ok()) << "update " << i << ": " << outside.ToString();
    update->Done(Status::Ok());
  }
  Advance(8);
  auto finish = session_.BeginFinish();
  ASSERT_TRUE(finish.ok()) << finish.status().ToString();
  finish->Done(Status::Ok());
  EXPECT_EQ(session_.Look().expired_sessions, 0);
}

// A late update from the expired session's trainer is refused and cannot end the next
// trainer's session.
TEST_F(SessionTest, ALateUpdateOfAnExpiredSessionIsRefused) {
  ASSERT_TRUE(session_.Start().ok());
  Advance(11);
  Status outside;
  {
    auto update = session_.BeginUpdate(&outside);
    ASSERT_TRUE(update.ok());
    EXPECT_EQ(outside.code(), StatusCode::kFailedPrecondition);
    EXPECT_NE(outside.message().find("expired"), std::string::npos) << outside.message();
    update->Done(outside, false);
  }
  ASSERT_TRUE(session_.Start().ok());
  EXPECT_TRUE(session_.Look().active);
}

TEST(Session, ALeaseOfZeroNeverExpires) {
  Clock::time_point now = Clock::now();
  ReceiverSession session(0, [&] { return now; });
  ASSERT_TRUE(session.Start().ok());
  now += std::chrono::hours(24 * 365);
  EXPECT_TRUE(session.Look().active);
  EXPECT_EQ(session.Start().code(), StatusCode::kFailedPrecondition);
}

TEST(Session, ABackendStartThatFailsLeavesTheSessionClosed) {
  ReceiverSession session(10);
  EXPECT_EQ(session.Start([] { return Unavailable("backend down"); }).code(), StatusCode::kUnavailable);
  EXPECT_FALSE(session.Look().active);
  EXPECT_TRUE(session.Start().ok());
}

}  // namespace
}  // namespace wsync
