// Constants of the zstd format (RFC 8878) that both sides of the `delta` backend use:
// the frame writer (zstd_writer.h) when it codes sequences, and the sparse decoder
// (apply/zstd_decode.h, apply/sparse_apply.h) when it reads them. The code tables of
// literal lengths and match lengths (baseline and extra bits per code) are the RFC's;
// IsaChoice picks a loop's instruction-set clone.
// Header-only; everything here is constant or per-object, safe from any thread.
#pragma once

#include <array>
#include <cstdint>

namespace wsync::delta::zstd {

inline constexpr std::array<uint32_t, 36> kLlBase = {0,  1,  2,  3,  4,  5,  6,   7,   8,   9,   10,   11,
                                              12, 13, 14, 15, 16, 18, 20,  22,  24,  28,  32,   40,
                                              48, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536};
inline constexpr std::array<uint8_t, 36> kLlBits = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,  0,  0,  0,  1,  1,
                                             1, 1, 2, 2, 3, 3, 4, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
inline constexpr std::array<uint32_t, 53> kMlBase = {
    3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29,
    30, 31, 32, 33, 34, 35, 37, 39, 41, 43, 47, 51, 59, 67, 83, 99, 131, 259, 515, 1027, 2051, 4099, 8195, 16387,
    32771, 65539};
inline constexpr std::array<uint8_t, 53> kMlBits = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                             0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1,
                                             2, 2, 3, 3, 4, 4, 5, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
// Whether a loop with a clone for an instruction-set extension runs that clone: the CPU
// has the extension and no test asked for the baseline clone (UseBaseline is not
// thread-safe against the loops that read enabled()).
class IsaChoice {
 public:
  explicit IsaChoice(bool cpu_has) : cpu_has_(cpu_has), use_(cpu_has) {}
  bool enabled() const { return use_; }
  void UseBaseline(bool baseline) { use_ = cpu_has_ && !baseline; }

 private:
  bool cpu_has_;
  bool use_;
};

}  // namespace wsync::delta::zstd
