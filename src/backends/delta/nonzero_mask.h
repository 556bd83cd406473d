// NonzeroMask: which of up to 64 bytes are nonzero, the scan the frame writer
// (zstd_writer.cc) and the benchmark's libzstd baseline (libzstd_baseline.cc) run over an
// XOR patch.
// Internal to src/backends/delta. Pure; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace wsync::delta {

// Bit i set when p[i] != 0, for the first `n` (<= 64) bytes at p.
__attribute__((always_inline)) inline uint64_t NonzeroMask(const uint8_t* p, size_t n) {
#if defined(__SSE2__)
  if (n == 64) {
    const __m128i zero = _mm_setzero_si128();
    uint64_t zeros = 0;
    for (int k = 0; k < 4; ++k) {
      __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * k));
      zeros |= static_cast<uint64_t>(static_cast<uint16_t>(_mm_movemask_epi8(_mm_cmpeq_epi8(v, zero)))) << (16 * k);
    }
    return ~zeros;
  }
#endif
  uint64_t mask = 0;
  for (size_t i = 0; i < n; ++i) mask |= static_cast<uint64_t>(p[i] != 0) << i;
  return mask;
}

}  // namespace wsync::delta
