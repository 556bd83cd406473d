#include "receiver/session.h"

#include <fmt/format.h>

#include "core/log.h"

namespace wsync {

ReceiverSession::ReceiverSession(double lease_seconds, NowFn now, double wait_seconds)
    : lease_seconds_(lease_seconds), now_(std::move(now)), wait_seconds_(wait_seconds) {}

ReceiverSession::Call::Call(Call&& other) noexcept
    : owner_(other.owner_), kind_(other.kind_), session_(other.session_), done_(other.done_) {
  other.owner_ = nullptr;
}

ReceiverSession::Call::~Call() {
  if (owner_ != nullptr) owner_->Release(*this);
}

void ReceiverSession::Call::Done(const Status& outcome, bool may_have_landed) {
  if (owner_ == nullptr || done_) return;
  std::lock_guard lock(owner_->mu_);
  owner_->OutcomeLocked(*this, outcome, may_have_landed);
  done_ = true;
}

void ReceiverSession::Release(const Call& call) {
  std::lock_guard lock(mu_);
  if (!call.done_) {
    // The call ended without an outcome (an exception went through it): whatever it was
    // doing may have landed bytes.
    OutcomeLocked(call, Internal("the call ended without an outcome"), true);
  }
  busy_with_ = nullptr;
  busy_in_session_ = false;
  if (call.session_ != 0 && call.session_ == session_) last_call_ = now_();
  idle_cv_.notify_all();
}

void ReceiverSession::WaitForOutsideCallLocked(std::unique_lock<std::mutex>& lock) {
  if (busy_with_ == nullptr || busy_in_session_ || wait_seconds_ <= 0) return;
  idle_cv_.wait_for(lock, std::chrono::duration<double>(wait_seconds_),
                    [&] { return busy_with_ == nullptr || busy_in_session_; });
}

void ReceiverSession::OutcomeLocked(const Call& call, const Status& outcome, bool may_have_landed) {
  // A call outside any session, or for a session that has since ended, changes nothing.
  const bool mine = call.session_ != 0 && call.session_ == session_ && active_;
  if (call.kind_ == Call::Kind::kUpdate) {
    if (!mine) return;
    if (outcome.ok()) {
      session_touched_ = !side_;
    } else {
      active_ = false;  // a failed update ends the session
      ++failed_update_;
      if (may_have_landed && !side_) {
        MarkInconsistentLocked(Inconsistency::kSession,
                               fmt::format("an update failed after its bytes may have landed: {}", outcome.message()));
      }
      expiry_note_.clear();
    }
  } else if (call.kind_ == Call::Kind::kFinish) {
    if (!mine) return;
    active_ = false;
    expiry_note_.clear();
    ++(outcome.ok() ? finished_ : failed_finish_);
    if (outcome.ok()) {
      if (!side_) ClearInconsistencyLocked();
    } else if (session_touched_ && may_have_landed) {
      MarkInconsistentLocked(Inconsistency::kSession,
                             fmt::format("finish_weight_update failed after the session's updates landed: {}",
                                         outcome.message()));
    }
  }
}

bool ReceiverSession::ExpiredLocked(Clock::time_point now) const {
  if (!active_ || busy_with_ != nullptr || lease_seconds_ <= 0) return false;
  return std::chrono::duration<double>(now - last_call_).count() > lease_seconds_;
}

void ReceiverSession::ExpireIfIdleLocked() {
  if (!ExpiredLocked(now_())) return;
  active_ = false;
  ++expired_;
  expiry_note_ = fmt::format(
      "the last session expired after {:g} s without a call (its trainer vanished between "
      "start_weight_update and finish_weight_update){}",
      lease_seconds_, session_touched_ ? "; its updates left the weights inconsistent" : "");
  if (session_touched_) MarkInconsistentLocked(Inconsistency::kSession, expiry_note_);
  WSYNC_LOG_WARN("weight-update session {} expired: {}", session_, expiry_note_);
}

Result<ReceiverSession::Call> ReceiverSession::BeginExclusive(const char* what, bool refuse_in_session) {
  std::lock_guard lock(mu_);
  ExpireIfIdleLocked();
  return BeginExclusiveLocked(what, refuse_in_session);
}

Result<ReceiverSession::Call> ReceiverSession::BeginExclusiveLocked(const char* what, bool refuse_in_session) {
  if (refuse_in_session && active_) {
    return FailedPrecondition(fmt::format("{} called during an active weight update; finish it first", what));
  }
  if (refuse_in_session && !asleep_.empty()) return FailedPrecondition(fmt::format("{} refused: {}", what, asleep_));
  if (busy_with_ != nullptr) {
    return FailedPrecondition(fmt::format("{} refused: {} is in progress", what, busy_with_));
  }
  busy_with_ = what;
  return Call(this, Call::Kind::kExclusive, 0);
}

Result<ReceiverSession::Call> ReceiverSession::BeginInit(const std::string& peer, bool* took_over) {
  *took_over = false;
  std::lock_guard lock(mu_);
  ExpireIfIdleLocked();
  if (active_ && busy_with_ != nullptr) {
    return FailedPrecondition(fmt::format(
        "init_weight_transfer_engine refused: the active weight update's {} is in progress (a new trainer "
        "takes over once it ends: by its deadline, or as soon as its data plane sees the old trainer gone)",
        busy_with_));
  }
  if (active_) {
    const double idle = std::chrono::duration<double>(now_() - last_call_).count();
    active_ = false;
    ++taken_over_;
    expiry_note_ = fmt::format(
        "the session was taken over by a new init_weight_transfer_engine{} {:.1f} s after its last call{}",
        peer.empty() ? std::string() : fmt::format(" from {}", peer), idle,
        session_touched_ ? "; its updates left the weights inconsistent until the next session finishes" : "");
    if (session_touched_) MarkInconsistentLocked(Inconsistency::kSession, expiry_note_);
    WSYNC_LOG_WARN("weight-update session {}: {}", session_, expiry_note_);
    *took_over = true;
  }
  // Under the same lock as the takeover: no start can slip in between.
  return BeginExclusiveLocked("init_weight_transfer_engine", /*refuse_in_session=*/true);
}

Status ReceiverSession::Start(const std::function<Status()>& open, bool side) {
  std::lock_guard lock(mu_);
  ExpireIfIdleLocked();
  if (active_) {
    double idle = std::chrono::duration<double>(now_() - last_call_).count();
    std::string why =
        busy_with_ != nullptr
            ? fmt::format("{} is in progress", busy_with_)
            : fmt::format("its last call was {:.1f} s ago{}", idle,
                          lease_seconds_ > 0 ? fmt::format("; it expires after {:g} s without a call", lease_seconds_)
                                             : std::string());
    return FailedPrecondition(
        fmt::format("start_weight_update called while a weight update is already active ({})", why));
  }
  if (!asleep_.empty()) return FailedPrecondition(fmt::format("start_weight_update refused: {}", asleep_));
  if (open) WSYNC_RETURN_IF_ERROR(open());
  active_ = true;
  ++session_;
  ++started_;
  session_touched_ = false;
  side_ = side;
  expiry_note_.clear();
  last_call_ = now_();
  return Status::Ok();
}

Result<ReceiverSession::Call> ReceiverSession::BeginUpdate(Status* outside) {
  std::unique_lock lock(mu_);
  if (active_) WaitForOutsideCallLocked(lock);
  if (busy_with_ != nullptr) {
    return FailedPrecondition(fmt::format("update_weights refused: {} is in progress", busy_with_));
  }
  ExpireIfIdleLocked();
  *outside = Status::Ok();
  if (!active_) {
    *outside = FailedPrecondition(
        expiry_note_.empty() ? std::string("start_weight_update must be called before update_weights")
                             : fmt::format("start_weight_update must be called before update_weights: {}", expiry_note_));
  }
  busy_with_ = "update_weights";
  busy_in_session_ = active_;
  return Call(this, Call::Kind::kUpdate, active_ ? session_ : 0);
}

Result<ReceiverSession::Call> ReceiverSession::BeginFinish() {
  std::unique_lock lock(mu_);
  if (active_) WaitForOutsideCallLocked(lock);
  if (busy_with_ != nullptr) {
    return FailedPrecondition(fmt::format("finish_weight_update refused: {} is in progress", busy_with_));
  }
  ExpireIfIdleLocked();
  if (!active_) {
    std::string msg = "finish_weight_update called without an active weight update; call start_weight_update first";
    if (!expiry_note_.empty()) msg += ": " + expiry_note_;
    return FailedPrecondition(std::move(msg));
  }
  busy_with_ = "finish_weight_update";
  busy_in_session_ = true;
  return Call(this, Call::Kind::kFinish, session_);
}

Status ReceiverSession::SetWeightsAsleep(std::string refusal) {
  std::lock_guard lock(mu_);
  ExpireIfIdleLocked();
  if (!refusal.empty() && active_) {
    return FailedPrecondition("sleep called during an active weight update; finish it first");
  }
  asleep_ = std::move(refusal);
  return Status::Ok();
}

void ReceiverSession::MarkDiscarded(std::string why) {
  std::lock_guard lock(mu_);
  MarkInconsistentLocked(Inconsistency::kDiscarded, std::move(why));
}

void ReceiverSession::MarkInconsistentLocked(Inconsistency kind, std::string why) {
  if (kind < inconsistent_) return;
  inconsistent_ = kind;
  inconsistent_why_ = std::move(why);
}

void ReceiverSession::ClearInconsistencyLocked() {
  if (inconsistent_ == Inconsistency::kSession || session_touched_) {
    inconsistent_ = Inconsistency::kNone;
    inconsistent_why_.clear();
  }
}

bool ReceiverSession::MayHaveLanded(const Status& outcome) {
  const StatusCode c = outcome.code();
  return c != StatusCode::kInvalidArgument && c != StatusCode::kFailedPrecondition && c != StatusCode::kAborted;
}

ReceiverSession::Snapshot ReceiverSession::Look() const {
  std::lock_guard lock(mu_);
  bool expired = ExpiredLocked(now_());
  Snapshot s;
  s.active = active_ && !expired;
  s.inconsistent = inconsistent_why_;
  if (inconsistent_ == Inconsistency::kNone && expired && session_touched_) {
    s.inconsistent = "the active session's lease ran out after its updates landed";
  }
  s.consistent = s.inconsistent.empty();
  if (inconsistent_ == Inconsistency::kDiscarded) s.discarded = inconsistent_why_;
  s.busy_with = busy_with_ != nullptr ? busy_with_ : "";
  s.started_sessions = started_;
  s.finished_sessions = finished_;
  s.failed_update_sessions = failed_update_;
  s.failed_finish_sessions = failed_finish_;
  s.expired_sessions = expired_ + (expired ? 1 : 0);
  s.taken_over_sessions = taken_over_;
  return s;
}

bool ReceiverSession::ExpireIfIdle() {
  std::lock_guard lock(mu_);
  const int before = expired_;
  ExpireIfIdleLocked();
  return expired_ != before;
}

void ReceiverSession::MarkOverwritten(std::string why) {
  std::lock_guard lock(mu_);
  MarkInconsistentLocked(Inconsistency::kOverwritten, std::move(why));
}

}  // namespace wsync
