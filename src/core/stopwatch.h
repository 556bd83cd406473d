// Stopwatch: elapsed seconds on the steady clock, for the timings wsync reports
// (SyncStats phases, publish and fetch reports, log lines). Cheap to copy; not
// thread-safe (one owner reads and restarts it).
#pragma once

#include <chrono>

namespace wsync {

using SteadyClock = std::chrono::steady_clock;

inline double SecondsSince(SteadyClock::time_point start) {
  return std::chrono::duration<double>(SteadyClock::now() - start).count();
}

class Stopwatch {
 public:
  Stopwatch() : start_(SteadyClock::now()) {}
  double seconds() const { return SecondsSince(start_); }
  double milliseconds() const { return seconds() * 1e3; }
  // The seconds since the start (or the last Lap), and starts again.
  double Lap() {
    auto now = SteadyClock::now();
    double s = std::chrono::duration<double>(now - start_).count();
    start_ = now;
    return s;
  }
  void Restart() { start_ = SteadyClock::now(); }
  SteadyClock::time_point start() const { return start_; }

 private:
  SteadyClock::time_point start_;
};

}  // namespace wsync
