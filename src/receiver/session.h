// ReceiverSession: the control-plane state machine of one inference server.
//
// It decides which calls may run, and what the weights are worth afterwards:
//
//   busy    one backend call at a time (init, update, finish, fetch, checksum). A call
//           holds a Call object; its destructor frees the server however the call ends
//           (a Status, an exception), so no failure can leave the server refusing
//           every later call with "... is in progress".
//   active  a session, from start_weight_update to finish_weight_update. A second
//           start, init during a session, and update/finish outside one are refused
//           (FailedPrecondition, HTTP 409). A failed update ends the session.
//   lease   a session whose trainer vanished (killed between start and finish) must not
//           block the next trainer: a session with no call in flight for longer than
//           `lease_seconds` since its last call expires, and the next start succeeds.
//   takeover  a new init (a new trainer) ends an active session that has no call in
//           flight at once: the newest trainer wins, the old one's next call gets 409
//           naming the takeover, and weights its updates touched are inconsistent until
//           the new trainer's session finishes. While a call of the session is in flight
//           the init is refused (409 naming the call): that call ends by its own deadline
//           or when its data plane sees the trainer gone.
//           A call in flight (an update receiving for minutes) is never expired: the
//           lease counts from the end of the session's last call. Expiry is decided when
//           a call or /health looks at the session; an expired session's late update or
//           finish gets 409 naming the expiry.
//   inconsistent  one reason says why weights_consistent is false, or none:
//           session      bytes may have landed in a session that did not finish (a
//                        data-phase failure, an update that threw, an expired or taken-over
//                        session that had an update); a refused update (bad payload, wrong
//                        state, a peer's veto) lands nothing;
//           overwritten  the weights were overwritten outside any session (the weight
//                        checker's reset), and still serve;
//           discarded    the weights were woken without their bytes (sleep level 2, or an
//                        offload that could not be read back) and hold nothing a trainer sent.
//           A reason replaces only one of its own kind or a weaker one (in that order:
//           session, overwritten, discarded). Clearing rule: a finished session clears a
//           `session` reason, and clears any reason when it landed an update (a session
//           with no update cannot clear a mark it did not cause).
//   checker the weight checker (checksum, reset, compare) is refused while a session is
//           active, so neither a poll nor a reset can interleave with a trainer's
//           updates; a session's update or finish that finds a checker call (or another
//           call outside the session) in flight waits for it, up to `wait_seconds`,
//           instead of failing.
//   asleep  while the weights sleep (/sleep level >= 1), start_weight_update and init
//           are refused (FailedPrecondition naming the fix) until the weights wake.
// Thread-safe: every method locks the object's own mutex; none blocks otherwise.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>

#include "wsync/status.h"

namespace wsync {

class ReceiverSession {
 public:
  using Clock = std::chrono::steady_clock;
  using NowFn = std::function<Clock::time_point()>;

  // lease_seconds <= 0: sessions never expire. `wait_seconds`: how long an update or
  // finish waits for a call outside the session to end (0: refused at once). `now` is the
  // clock (tests pass a fake).
  explicit ReceiverSession(double lease_seconds, NowFn now = [] { return Clock::now(); }, double wait_seconds = 0);
  ReceiverSession(const ReceiverSession&) = delete;
  ReceiverSession& operator=(const ReceiverSession&) = delete;

  // One backend call holding the server. Move-only; frees the server when destroyed.
  // An update or finish that never reports its outcome (Done) counts as failed after
  // bytes may have landed: the session ends and the weights are marked inconsistent.
  class Call {
   public:
    Call(Call&& other) noexcept;
    Call& operator=(Call&&) = delete;
    ~Call();
    // The outcome of the call. For an update, `may_have_landed` says whether a failure
    // came after bytes may have reached the shards (false for refusals). Idempotent
    // after the first call; the server stays held until destruction.
    void Done(const Status& outcome, bool may_have_landed = true);

   private:
    friend class ReceiverSession;
    enum class Kind { kExclusive, kUpdate, kFinish };
    Call(ReceiverSession* owner, Kind kind, uint64_t session) : owner_(owner), kind_(kind), session_(session) {}
    ReceiverSession* owner_;
    Kind kind_;
    uint64_t session_;  // the session the call belongs to; 0: none
    bool done_ = false;
  };

  // init, fetch, checksum: FailedPrecondition naming `what` while another call runs; init
  // (`refuse_in_session`) also while a session is active.
  Result<Call> BeginExclusive(const char* what, bool refuse_in_session = false);
  // init_weight_transfer_engine from `peer`: as BeginExclusive(refuse_in_session), except
  // that an active session with no call in flight is taken over (ended) instead of
  // refusing; `*took_over` says whether one was.
  Result<Call> BeginInit(const std::string& peer, bool* took_over);
  // start_weight_update: FailedPrecondition while a session is active (an expired one is
  // closed first). Does not wait for a call in flight outside the session (init).
  // `open` (the backend's Start, which must not block) runs under the object's lock once
  // the session may open; its failure leaves the session closed. `side`: a session whose
  // updates land beside the weights (a LoRA adapter's staging), never in them: its
  // outcome neither marks the weights inconsistent nor clears a mark.
  Status Start(const std::function<Status()>& open = nullptr, bool side = false);
  // update_weights: holds the server even outside a session, so that a backend whose
  // data plane is a collective can tell the trainer "no"; `*outside` is then set to the
  // FailedPrecondition the update must answer, otherwise to OK.
  Result<Call> BeginUpdate(Status* outside);
  // finish_weight_update: FailedPrecondition outside a session or while a call runs.
  // Done(OK) ends the session cleanly (weights consistent); Done(error) ends it too.
  Result<Call> BeginFinish();

  // Sets (non-empty) or clears (empty) the refusal start and init answer while the weights
  // sleep. Setting it is FailedPrecondition while a session is active.
  Status SetWeightsAsleep(std::string refusal);
  // Marks the weights as discarded; `why` says how (the `discarded` reason).
  void MarkDiscarded(std::string why);

  struct Snapshot {
    bool active = false;
    bool consistent = true;    // weights_consistent
    std::string inconsistent;  // why they are not consistent; empty when they are
    std::string discarded;     // why the weights hold no trainer's bytes; empty otherwise
    std::string busy_with;    // the call in flight; empty when idle
    // How sessions ended, since the server started: every started session is finished,
    // failed (one of the four reasons) or active.
    int started_sessions = 0;
    int finished_sessions = 0;       // finish_weight_update answered OK
    int failed_update_sessions = 0;  // ended by an update that failed (refusals included)
    int failed_finish_sessions = 0;  // ended by a finish_weight_update that failed
    int expired_sessions = 0;
    int taken_over_sessions = 0;
  };
  // What /health reports, expiry applied as of now (without changing the state).
  Snapshot Look() const;
  // Applies expiry now: true when an active session's lease ran out just now.
  bool ExpireIfIdle();

  // The weights were overwritten outside any session (`why`: the weight checker's reset),
  // and still serve (the `overwritten` reason).
  void MarkOverwritten(std::string why);

  // Whether a failed update's bytes may have landed: false for a refusal (InvalidArgument,
  // FailedPrecondition, Aborted), which lands nothing; true otherwise.
  static bool MayHaveLanded(const Status& outcome);

 private:
  // Closes an active session whose lease ran out. Needs mu_.
  void ExpireIfIdleLocked();
  // BeginExclusive's checks and claim. Needs mu_.
  Result<Call> BeginExclusiveLocked(const char* what, bool refuse_in_session);
  bool ExpiredLocked(Clock::time_point now) const;
  // Waits (releasing mu_) up to wait_seconds_ for a call outside the session to end. Needs
  // mu_ held through `lock`.
  void WaitForOutsideCallLocked(std::unique_lock<std::mutex>& lock);
  // Applies a call's outcome to the session it belongs to. Needs mu_.
  void OutcomeLocked(const Call& call, const Status& outcome, bool may_have_landed);
  void Release(const Call& call);
  // Why the weights are inconsistent, weakest first.
  enum class Inconsistency { kNone, kSession, kOverwritten, kDiscarded };
  // Sets the reason unless a stronger one holds. Needs mu_.
  void MarkInconsistentLocked(Inconsistency kind, std::string why);
  // The clearing rule, at a session's successful finish. Needs mu_.
  void ClearInconsistencyLocked();

  const double lease_seconds_;
  const NowFn now_;
  const double wait_seconds_;
  mutable std::mutex mu_;
  std::condition_variable idle_cv_;     // notified when a call ends
  bool active_ = false;                 // GUARDED_BY(mu_)
  uint64_t session_ = 0;                // GUARDED_BY(mu_): id of the current or last session
  const char* busy_with_ = nullptr;     // GUARDED_BY(mu_): the call in flight
  Inconsistency inconsistent_ = Inconsistency::kNone;  // GUARDED_BY(mu_)
  std::string inconsistent_why_;        // GUARDED_BY(mu_): the reason's words
  bool session_touched_ = false;        // GUARDED_BY(mu_): an update ran in this session
  bool side_ = false;                   // GUARDED_BY(mu_): the session is a side session (Start)
  Clock::time_point last_call_;         // GUARDED_BY(mu_): end of the session's last call
  int started_ = 0;                     // GUARDED_BY(mu_)
  int finished_ = 0;                    // GUARDED_BY(mu_)
  int failed_update_ = 0;               // GUARDED_BY(mu_)
  int failed_finish_ = 0;               // GUARDED_BY(mu_)
  int expired_ = 0;                     // GUARDED_BY(mu_)
  int taken_over_ = 0;                  // GUARDED_BY(mu_)
  bool busy_in_session_ = false;        // GUARDED_BY(mu_): the call in flight is an update or finish
  std::string expiry_note_;             // GUARDED_BY(mu_): why the last session ended
  std::string asleep_;                  // GUARDED_BY(mu_): the refusal while the weights sleep
};

}  // namespace wsync
