// ProgressGate: a count that one thread advances and others wait on, with a deadline.
//
// Used to pipeline a producer and a consumer over one buffer at sub-buffer granularity:
// the packer advances the gate as bytes are written and the broadcast waits for them; the
// broadcast advances it as bytes arrive and the loader waits for them. Fail() wakes every
// waiter with an error. Thread-safe.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <mutex>

#include "core/deadline.h"
#include "wsync/status.h"

namespace wsync {

class ProgressGate {
 public:
  void Advance(size_t value) {
    {
      std::lock_guard lock(mu_);
      if (value > value_) value_ = value;
    }
    cv_.notify_all();
  }

  void Fail(Status status) {
    {
      std::lock_guard lock(mu_);
      if (failure_.ok()) failure_ = std::move(status);
    }
    cv_.notify_all();
  }

  // Returns once the count reaches `value`; the failure, or DeadlineExceeded naming `what`.
  Status WaitFor(size_t value, Deadline deadline, const char* what) {
    std::unique_lock lock(mu_);
    bool ok = cv_.wait_until(lock, deadline.at(), [&] { return value_ >= value || !failure_.ok(); });
    if (!failure_.ok()) return failure_;
    if (!ok) return DeadlineExceeded(std::string("timed out waiting for ") + what);
    return Status::Ok();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  size_t value_ = 0;  // GUARDED_BY(mu_)
  Status failure_;    // GUARDED_BY(mu_)
};

}  // namespace wsync
