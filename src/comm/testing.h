// Helpers for comm tests and benchmarks only: deterministic byte patterns and child
// processes with deadlines. Not linked into wsync_comm; thread-safe (no shared state).
#pragma once

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "core/deadline.h"

extern char** environ;

namespace wsync::testing {

// The 8-byte word at word index i of pattern `seed` (splitmix64).
inline uint64_t PatternWord(uint64_t seed, uint64_t i) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + i + 1;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

inline void FillPattern(std::span<std::byte> data, uint64_t seed) {
  size_t words = data.size() / 8;
  for (size_t i = 0; i < words; ++i) {
    uint64_t w = PatternWord(seed, i);
    std::memcpy(data.data() + i * 8, &w, 8);
  }
  uint64_t tail = PatternWord(seed, words);
  std::memcpy(data.data() + words * 8, &tail, data.size() - words * 8);
}

// Offset of the first byte that differs from pattern `seed`, or -1 when all match.
inline int64_t FirstMismatch(std::span<const std::byte> data, uint64_t seed) {
  size_t words = data.size() / 8;
  for (size_t i = 0; i < words; ++i) {
    uint64_t w = PatternWord(seed, i);
    if (std::memcmp(data.data() + i * 8, &w, 8) != 0) return static_cast<int64_t>(i * 8);
  }
  uint64_t tail = PatternWord(seed, words);
  if (std::memcmp(data.data() + words * 8, &tail, data.size() - words * 8) != 0) {
    return static_cast<int64_t>(words * 8);
  }
  return -1;
}

// Starts `argv[0]` with `argv`; returns its pid or -1.
inline pid_t Spawn(const std::vector<std::string>& argv) {
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = -1;
  if (posix_spawn(&pid, args[0], nullptr, nullptr, args.data(), environ) != 0) return -1;
  return pid;
}

// The exit code of `pid`; on `deadline` it is killed (SIGKILL) and -1 returned.
inline int WaitExit(pid_t pid, Deadline deadline) {
  for (;;) {
    int status = 0;
    pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (r < 0) return -1;
    if (deadline.expired()) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

}  // namespace wsync::testing
