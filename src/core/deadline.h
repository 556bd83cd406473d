// Deadline: the absolute time by which a blocking wait must give up.
//
// Every blocking call in wsync takes one. Cheap to copy; thread-safe (immutable).
#pragma once

#include <chrono>
#include <cstdint>

namespace wsync {

class Deadline {
 public:
  using Clock = std::chrono::steady_clock;

  static Deadline In(std::chrono::duration<double> d) {
    return Deadline(Clock::now() + std::chrono::duration_cast<Clock::duration>(d));
  }
  static Deadline InSeconds(double s) { return In(std::chrono::duration<double>(s)); }
  static Deadline Never() { return Deadline(Clock::time_point::max()); }

  bool expired() const { return Clock::now() >= at_; }
  Clock::time_point at() const { return at_; }
  // Time left, never negative.
  std::chrono::milliseconds remaining() const {
    auto now = Clock::now();
    if (now >= at_) return std::chrono::milliseconds(0);
    if (at_ == Clock::time_point::max()) return std::chrono::hours(24 * 365);
    return std::chrono::duration_cast<std::chrono::milliseconds>(at_ - now);
  }
  double remaining_seconds() const { return remaining().count() / 1000.0; }
  // The earlier of two deadlines.
  Deadline Min(Deadline other) const { return at_ < other.at_ ? *this : other; }

 private:
  explicit Deadline(Clock::time_point at) : at_(at) {}
  Clock::time_point at_;
};

}  // namespace wsync
