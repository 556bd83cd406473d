// Helpers for comm tests and benchmarks only: deterministic byte patterns (child
// processes come from core/subprocess.h). Not linked into wsync_comm; thread-safe (no
// shared state).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

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

}  // namespace wsync::testing
