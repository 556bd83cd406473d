// The float32 -> e4m3 conversion of quant/e4m3.h against the slow reference of
// fp8_reference_testutil.h (boundaries, midpoints and a strided sample of all 2^32 float
// bit patterns) and against core's FloatToF8E4M3 (an FPU-rounded implementation) on every
// one of the 2^32 patterns.
#include <atomic>
#include <bit>
#include <cmath>
#include <limits>
#include <vector>

#include <gtest/gtest.h>

#include "core/dtype_convert.h"
#include "core/parallel.h"
#include "core/sanitizers.h"
#include "quant/e4m3.h"
#include "quant/fp8_reference_testutil.h"

namespace wsync {
namespace {

using fp8::Fp8E4M3FromBits;
namespace ref = fp8_reference;

uint8_t Convert(float f) { return Fp8E4M3FromBits(std::bit_cast<uint32_t>(f)); }

TEST(E4M3Test, DecodesEveryCode) {
  for (int k = 0; k < 256; ++k) {
    const float v = fp8::Fp8E4M3ToFloat(static_cast<uint8_t>(k));
    if ((k & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(v)) << k;
      continue;
    }
    const double want = (k & 0x80) ? -ref::Decode(k & 0x7f) : ref::Decode(k & 0x7f);
    EXPECT_EQ(static_cast<double>(v), want) << k;
    EXPECT_EQ(std::signbit(v), (k & 0x80) != 0) << k;
    // Every finite code converts back to itself.
    EXPECT_EQ(Convert(v), k) << k;
  }
  EXPECT_EQ(fp8::Fp8E4M3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(fp8::Fp8E4M3ToFloat(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(fp8::Fp8E4M3ToFloat(0x08), std::ldexp(1.0f, -6));
}

TEST(E4M3Test, MidpointsAndTheirNeighboursMatchTheReference) {
  std::vector<float> probes;
  for (int k = 0; k < 0x7e; ++k) {
    const float lo = static_cast<float>(ref::Decode(k)), hi = static_cast<float>(ref::Decode(k + 1));
    const float mid = static_cast<float>((ref::Decode(k) + ref::Decode(k + 1)) / 2);  // exact: 5 significant bits
    for (float v : {lo, hi, mid}) {
      probes.push_back(v);
      probes.push_back(std::nextafter(v, 0.0f));
      probes.push_back(std::nextafter(v, 1e30f));
    }
  }
  const float inf = std::numeric_limits<float>::infinity();
  for (float v : {448.0f, 456.0f, 464.0f, 480.0f, 1e6f, std::numeric_limits<float>::max(), inf,
                  std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::min(),
                  std::ldexp(1.0f, -10), std::ldexp(1.0f, -11), std::ldexp(3.0f, -11), std::ldexp(15.0f, -10),
                  0.0f}) {
    probes.push_back(v);
    probes.push_back(std::nextafter(v, 0.0f));
    probes.push_back(std::nextafter(v, inf));
  }
  for (float v : probes) {
    EXPECT_EQ(Convert(v), ref::Encode(v)) << v;
    EXPECT_EQ(Convert(-v), ref::Encode(-v)) << -v;
  }
  // The stated special cases.
  EXPECT_EQ(Convert(std::ldexp(1.0f, -10)), 0x00);         // half of 2^-9 ties to even: 0
  EXPECT_EQ(Convert(std::ldexp(3.0f, -10)), 0x02);         // 1.5 * 2^-9 ties to even: 2
  EXPECT_EQ(Convert(-std::ldexp(1.0f, -12)), 0x80);        // a tiny negative keeps its sign
  EXPECT_EQ(Convert(464.0f), 0x7e);                        // saturates, no NaN
  EXPECT_EQ(Convert(-inf), 0xfe);
  EXPECT_EQ(Fp8E4M3FromBits(0x7fc00000u), 0x7f);           // quiet NaN
  EXPECT_EQ(Fp8E4M3FromBits(0xff800001u), 0xff);           // negative signalling NaN
  EXPECT_EQ(Convert(std::ldexp(15.0f, -10)), 0x08);        // 7.5 * 2^-9 rounds to the smallest normal
}

TEST(E4M3Test, StridedSampleOfAllFloatsMatchesTheReference) {
  // A prime stride visits ~1M patterns spread over every exponent, sign and NaN payload.
  constexpr uint64_t kStride = 4093;
  std::atomic<int> mismatches{0};
  ParallelFor((uint64_t{1} << 32) / kStride + 1, DefaultThreads(), [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) {
      const uint64_t bits = i * kStride;
      if (bits > 0xffffffffu) break;
      const float f = std::bit_cast<float>(static_cast<uint32_t>(bits));
      const uint8_t got = Fp8E4M3FromBits(static_cast<uint32_t>(bits)), want = ref::Encode(f);
      if (got != want && mismatches.fetch_add(1) < 10) {
        ADD_FAILURE() << "bits 0x" << std::hex << bits << ": got 0x" << int{got} << ", want 0x" << int{want};
      }
    }
  });
  EXPECT_EQ(mismatches.load(), 0);
}

TEST(E4M3Test, AllFloatsMatchCoresFpuRoundedConversion) {
#if defined(WSYNC_SANITIZED)
  constexpr uint64_t kStride = 97;  // instrumented code: a dense sample instead of all
#else
  constexpr uint64_t kStride = 1;
#endif
  std::atomic<int> mismatches{0};
  constexpr uint64_t kChunks = 1024;
  ParallelFor(kChunks, DefaultThreads(), [&](size_t b, size_t e) {
    for (uint64_t c = b; c < e; ++c) {
      const uint64_t lo = c << 22, hi = (c + 1) << 22;
      for (uint64_t bits = lo; bits < hi; bits += kStride) {
        const uint32_t u = static_cast<uint32_t>(bits);
        const uint8_t got = Fp8E4M3FromBits(u), want = FloatToF8E4M3(std::bit_cast<float>(u));
        if (got != want && mismatches.fetch_add(1) < 10) {
          ADD_FAILURE() << "bits 0x" << std::hex << u << ": got 0x" << int{got} << ", core 0x" << int{want};
        }
      }
    }
  });
  EXPECT_EQ(mismatches.load(), 0);
}

}  // namespace
}  // namespace wsync
