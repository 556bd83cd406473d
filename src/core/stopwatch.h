// Stopwatch: elapsed seconds on the steady clock, for the timings wsync reports
// (SyncStats phases, publish and fetch reports, log lines), and the CPU time a process
// or thread has used. A Stopwatch is cheap to copy and not thread-safe (one owner reads
// and restarts it); the free functions are thread-safe.
#pragma once

#include <time.h>

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

// CPU seconds this process has used (all threads): per-core throughput is bytes over
// this, whatever else shares the machine.
inline double ProcessCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

// CPU seconds the calling thread has used.
inline double ThreadCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

}  // namespace wsync
