// The receiver's session state machine with a fake clock, transition by transition: start,
// update, finish and the exclusive calls in and out of a session, the refusals and what
// they name, busy flags freed however a call ends, weights_consistent after every kind of
// ending, and the lease that expires the session of a trainer that vanished.
#include "receiver/session.h"

#include <gtest/gtest.h>

#include <optional>
#include <stdexcept>
#include <thread>

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

// Every started session ends one way, and the snapshot counts each: finished, failed by
// an update, failed by a finish, expired, taken over (/metrics reports these).
TEST_F(SessionTest, CountsHowSessionsEnd) {
  Status outside;
  auto finish = [&](const Status& outcome) {
    auto call = session_.BeginFinish();
    ASSERT_TRUE(call.ok());
    call->Done(outcome);
  };
  ASSERT_TRUE(session_.Start().ok());
  finish(Status::Ok());
  ASSERT_TRUE(session_.Start().ok());
  {
    auto update = session_.BeginUpdate(&outside);
    ASSERT_TRUE(update.ok());
    update->Done(InvalidArgument("bad tensor list"), false);
  }
  ASSERT_TRUE(session_.Start().ok());
  finish(Internal("backend finish failed"));
  ASSERT_TRUE(session_.Start().ok());
  Advance(11);
  EXPECT_EQ(session_.Look().expired_sessions, 1);  // as of now, before anything applies it
  ASSERT_TRUE(session_.Start().ok());  // closes the expired one
  bool took_over = false;
  {
    auto init = session_.BeginInit("", &took_over);
    ASSERT_TRUE(init.ok());
    init->Done(Status::Ok());
  }
  EXPECT_TRUE(took_over);
  // Refused calls outside a session end nothing.
  {
    auto update = session_.BeginUpdate(&outside);
    ASSERT_TRUE(update.ok());
    update->Done(outside, false);
  }
  EXPECT_FALSE(session_.BeginFinish().ok());
  ASSERT_TRUE(session_.Start().ok());
  ReceiverSession::Snapshot s = session_.Look();
  EXPECT_TRUE(s.active);
  EXPECT_EQ(s.started_sessions, 6);
  EXPECT_EQ(s.finished_sessions, 1);
  EXPECT_EQ(s.failed_update_sessions, 1);
  EXPECT_EQ(s.failed_finish_sessions, 1);
  EXPECT_EQ(s.expired_sessions, 1);
  EXPECT_EQ(s.taken_over_sessions, 1);
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

// A finish that fails after updates leaves the weights inconsistent; one that fails with
// nothing landed (no update ran, or the failure came before any byte) does not.
TEST_F(SessionTest, AFailedFinishIsInconsistentOnlyWhenUpdatesLanded) {
  auto fail_finish = [&](bool may_have_landed) {
    auto finish = session_.BeginFinish();
    ASSERT_TRUE(finish.ok()) << finish.status().ToString();
    finish->Done(Internal("backend finish failed"), may_have_landed);
  };
  ASSERT_TRUE(session_.Start().ok());
  fail_finish(true);
  EXPECT_FALSE(session_.Look().active);
  EXPECT_TRUE(session_.Look().consistent);  // no update ran in that session
  ASSERT_TRUE(session_.Start().ok());
  {
    Status outside;
    auto update = session_.BeginUpdate(&outside);
    update->Done(Status::Ok());
  }
  fail_finish(false);
  EXPECT_TRUE(session_.Look().consistent);
  ASSERT_TRUE(session_.Start().ok());
  {
    Status outside;
    auto update = session_.BeginUpdate(&outside);
    update->Done(Status::Ok());
  }
  fail_finish(true);
  EXPECT_FALSE(session_.Look().active);
  EXPECT_FALSE(session_.Look().consistent);
}

// Which calls wait for which: start does not wait for an init in flight outside a
// session; finish and update refuse while a call runs, naming it; fetch and checksum may
// run during a session (init may not).
TEST_F(SessionTest, CallsInFlightRefuseOthersNamingThemselves) {
  {
    auto init = session_.BeginExclusive("init_weight_transfer_engine", true);
    ASSERT_TRUE(init.ok());
    EXPECT_EQ(session_.Look().busy_with, "init_weight_transfer_engine");
    ASSERT_TRUE(session_.Start().ok());
    auto finish = session_.BeginFinish();
    EXPECT_EQ(finish.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_EQ(finish.status().message(), "finish_weight_update refused: init_weight_transfer_engine is in progress");
    Status outside;
    EXPECT_EQ(session_.BeginUpdate(&outside).status().message(),
              "update_weights refused: init_weight_transfer_engine is in progress");
    init->Done(Status::Ok());
  }
  EXPECT_TRUE(session_.Look().busy_with.empty());
  {
    auto checksum = session_.BeginExclusive("weight_checker");
    ASSERT_TRUE(checksum.ok()) << checksum.status().ToString();
    Status refused = session_.Start();
    EXPECT_EQ(refused.code(), StatusCode::kFailedPrecondition);
    EXPECT_NE(refused.message().find("weight_checker is in progress"), std::string::npos) << refused.message();
    checksum->Done(Status::Ok(), false);
  }
  auto init = session_.BeginExclusive("init_weight_transfer_engine", true);
  EXPECT_EQ(init.status().message(),
            "init_weight_transfer_engine called during an active weight update; finish it first");
  auto finish = session_.BeginFinish();
  ASSERT_TRUE(finish.ok());
  finish->Done(Status::Ok());
  EXPECT_TRUE(session_.Look().consistent);
}

// Done reports once: a second outcome is ignored, and a moved-from call frees nothing.
TEST_F(SessionTest, DoneIsIdempotentAndAMovedCallFreesTheServerOnce) {
  ASSERT_TRUE(session_.Start().ok());
  {
    Status outside;
    auto update = session_.BeginUpdate(&outside);
    ASSERT_TRUE(update.ok());
    ReceiverSession::Call moved(std::move(*update));
    moved.Done(Status::Ok());
    moved.Done(Internal("too late"));  // ignored: the update succeeded
    EXPECT_EQ(session_.Look().busy_with, "update_weights");  // held until destruction
  }
  EXPECT_TRUE(session_.Look().active);
  EXPECT_TRUE(session_.Look().consistent);
  EXPECT_TRUE(session_.Look().busy_with.empty());
}

// An update refused outside a session changes nothing, whatever it reports; the next
// session starts clean.
TEST_F(SessionTest, AnUpdateOutsideASessionChangesNothing) {
  {
    Status outside;
    auto update = session_.BeginUpdate(&outside);
    ASSERT_TRUE(update.ok());
    EXPECT_EQ(outside.message(), "start_weight_update must be called before update_weights");
    update->Done(Internal("landed anyway?"), true);
  }
  ReceiverSession::Snapshot s = session_.Look();
  EXPECT_FALSE(s.active);
  EXPECT_TRUE(s.consistent);
  EXPECT_EQ(s.expired_sessions, 0);
  ASSERT_TRUE(session_.Start().ok());
}

// After an expiry, the note explains a refused update until the next start clears it.
TEST_F(SessionTest, TheExpiryNoteExplainsRefusalsUntilTheNextStart) {
  ASSERT_TRUE(session_.Start().ok());
  Advance(11);
  EXPECT_EQ(session_.Look().expired_sessions, 1);  // Look applies expiry as of now
  auto finish = session_.BeginFinish();
  EXPECT_NE(finish.status().message().find("expired after 10 s"), std::string::npos) << finish.status().message();
  ASSERT_TRUE(session_.Start().ok());
  EXPECT_EQ(session_.Look().expired_sessions, 1);
  {
    auto f = session_.BeginFinish();
    ASSERT_TRUE(f.ok());
    f->Done(Status::Ok());
  }
  Status outside;
  {
    auto update = session_.BeginUpdate(&outside);
    update->Done(outside, false);
  }
  EXPECT_EQ(outside.message(), "start_weight_update must be called before update_weights");
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

// A new trainer's init ends an active session that has no call in flight: the newest
// trainer wins, the old one's late calls are refused naming the takeover, and what its
// updates touched stays inconsistent until the new trainer's session finishes.
TEST_F(SessionTest, ANewInitTakesOverASessionWithNoCallInFlight) {
  ASSERT_TRUE(session_.Start().ok());
  Status outside;
  {
    auto update = session_.BeginUpdate(&outside);
    ASSERT_TRUE(update.ok());
    update->Done(Status::Ok());
  }
  Advance(0.5);
  bool took_over = false;
  {
    auto init = session_.BeginInit("127.0.0.2", &took_over);
    ASSERT_TRUE(init.ok()) << init.status().ToString();
    EXPECT_TRUE(took_over);
    init->Done(Status::Ok());
  }
  ReceiverSession::Snapshot s = session_.Look();
  EXPECT_FALSE(s.active);
  EXPECT_FALSE(s.consistent);
  EXPECT_EQ(s.taken_over_sessions, 1);
  Result<ReceiverSession::Call> late = session_.BeginFinish();
  ASSERT_FALSE(late.ok());
  EXPECT_EQ(late.status().message(),
            "finish_weight_update called without an active weight update; call start_weight_update first: the "
            "session was taken over by a new init_weight_transfer_engine from 127.0.0.2 0.5 s after its last call; "
            "its updates left the weights inconsistent until the next session finishes");
  // The new trainer's session makes them consistent again.
  ASSERT_TRUE(session_.Start().ok());
  {
    auto update = session_.BeginUpdate(&outside);
    update->Done(Status::Ok());
  }
  session_.BeginFinish()->Done(Status::Ok());
  EXPECT_TRUE(session_.Look().consistent);
}

TEST_F(SessionTest, ANewInitWaitsOutACallInFlightByRefusing) {
  ASSERT_TRUE(session_.Start().ok());
  Status outside;
  auto update = session_.BeginUpdate(&outside);
  ASSERT_TRUE(update.ok());
  bool took_over = true;
  Result<ReceiverSession::Call> init = session_.BeginInit("127.0.0.2", &took_over);
  ASSERT_FALSE(init.ok());
  EXPECT_FALSE(took_over);
  EXPECT_EQ(init.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(init.status().message().find("the active weight update's update_weights is in progress"),
            std::string::npos)
      << init.status().message();
  update->Done(Status::Ok());
}

// The checker never interleaves with a trainer's session: refused while one is active; a
// reset outside a session marks the weights until a session that lands updates finishes,
// and a session with no update cannot clear it.
TEST_F(SessionTest, TheCheckerIsRefusedInASessionAndItsResetIsClearedOnlyByLandedUpdates) {
  ASSERT_TRUE(session_.Start().ok());
  Result<ReceiverSession::Call> checker = session_.BeginExclusive("weight_checker", /*refuse_in_session=*/true);
  ASSERT_FALSE(checker.ok());
  EXPECT_EQ(checker.status().message(), "weight_checker called during an active weight update; finish it first");
  session_.BeginFinish()->Done(Status::Ok());

  session_.MarkOverwritten("weight_checker 'reset' overwrote the runtime parameters with random values");
  EXPECT_FALSE(session_.Look().consistent);
  ASSERT_TRUE(session_.Start().ok());
  session_.BeginFinish()->Done(Status::Ok());
  EXPECT_FALSE(session_.Look().consistent) << "a finish with no update cannot clear a mark it did not cause";
  ASSERT_TRUE(session_.Start().ok());
  Status outside;
  session_.BeginUpdate(&outside)->Done(Status::Ok());
  session_.BeginFinish()->Done(Status::Ok());
  EXPECT_TRUE(session_.Look().consistent);
}

// One reason says why the weights are inconsistent; a weaker reason never replaces a
// stronger one, and a finished session clears a session's reason, or any reason once it
// landed an update.
TEST_F(SessionTest, OneInconsistencyReasonAndItsClearingRule) {
  auto failed_update = [&] {
    ASSERT_TRUE(session_.Start().ok());
    Status outside;
    session_.BeginUpdate(&outside)->Done(Internal("the data plane broke"));
  };
  auto finish_without_update = [&] {
    ASSERT_TRUE(session_.Start().ok());
    session_.BeginFinish()->Done(Status::Ok());
  };
  failed_update();
  ReceiverSession::Snapshot s = session_.Look();
  EXPECT_FALSE(s.consistent);
  EXPECT_EQ(s.inconsistent, "an update failed after its bytes may have landed: the data plane broke");
  EXPECT_TRUE(s.discarded.empty());
  finish_without_update();
  EXPECT_TRUE(session_.Look().consistent) << "a finished session clears the reason a session left";
  EXPECT_TRUE(session_.Look().inconsistent.empty());

  session_.MarkDiscarded("woken without their bytes");
  session_.MarkOverwritten("reset to random values");
  failed_update();
  s = session_.Look();
  EXPECT_EQ(s.inconsistent, "woken without their bytes") << "neither a reset nor a failed update replaces it";
  EXPECT_EQ(s.discarded, "woken without their bytes");
  finish_without_update();
  EXPECT_EQ(session_.Look().discarded, "woken without their bytes");

  ASSERT_TRUE(session_.Start().ok());
  Status outside;
  session_.BeginUpdate(&outside)->Done(Status::Ok());
  session_.BeginFinish()->Done(Status::Ok());
  s = session_.Look();
  EXPECT_TRUE(s.consistent);
  EXPECT_TRUE(s.discarded.empty());
}

// An update that finds a call outside the session in flight (a checksum that began
// before start) waits for it instead of failing the trainer's sync.
TEST(SessionWaitTest, AnUpdateWaitsForACallOutsideTheSession) {
  ReceiverSession session(10, [] { return Clock::now(); }, /*wait_seconds=*/5);
  std::optional<ReceiverSession::Call> checksum;
  {
    auto c = session.BeginExclusive("weight_checker", true);
    ASSERT_TRUE(c.ok());
    checksum.emplace(std::move(*c));
  }
  ASSERT_TRUE(session.Start().ok());
  std::thread ends([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    checksum->Done(Status::Ok(), false);
    checksum.reset();
  });
  Status outside;
  auto t = Clock::now();
  Result<ReceiverSession::Call> update = session.BeginUpdate(&outside);
  ASSERT_TRUE(update.ok()) << update.status().ToString();
  EXPECT_TRUE(outside.ok());
  EXPECT_GE(Clock::now() - t, std::chrono::milliseconds(150));
  update->Done(Status::Ok());
  ends.join();
}

}  // namespace
}  // namespace wsync
