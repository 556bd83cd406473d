#include "core/dtype_convert.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <vector>

#include <gtest/gtest.h>

namespace wsync {
namespace {

float F(uint32_t bits) { return std::bit_cast<float>(bits); }

// Round-to-nearest-even of a finite fp32 to a format whose values are listed by `decode`,
// by comparing exact distances in double: the reference the bit tricks are checked against.
uint16_t ReferenceBF16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint16_t lo = static_cast<uint16_t>(x >> 16);
  if ((x & 0xffff) == 0) return lo;
  const uint16_t hi = lo + 1;
  const double vlo = BF16ToFloat(lo);
  // The value after the largest finite bf16 rounds as if it were 2^128.
  const double vhi = (hi & 0x7fff) == 0x7f80 ? std::copysign(std::ldexp(1.0, 128), f) : BF16ToFloat(hi);
  const double dlo = std::fabs(f - vlo), dhi = std::fabs(vhi - f);
  if (dlo < dhi) return lo;
  if (dhi < dlo) return hi;
  return (lo & 1) ? hi : lo;
}

TEST(FloatConvert, BF16EdgeCases) {
  EXPECT_EQ(FloatToBF16(1.0f), 0x3f80);
  EXPECT_EQ(FloatToBF16(-2.0f), 0xc000);
  EXPECT_EQ(FloatToBF16(0.0f), 0x0000);
  EXPECT_EQ(FloatToBF16(-0.0f), 0x8000);
  EXPECT_EQ(FloatToBF16(F(0x7f7fffff)), 0x7f80);  // FLT_MAX rounds up to inf, as in torch
  EXPECT_EQ(FloatToBF16(F(0x7f7f7fff)), 0x7f7f);  // just below the midpoint stays finite
  EXPECT_EQ(FloatToBF16(F(0x3f808000)), 0x3f80);  // tie, even below
  EXPECT_EQ(FloatToBF16(F(0x3f818000)), 0x3f82);  // tie, even above
  EXPECT_EQ(FloatToBF16(F(0x3f808001)), 0x3f81);  // just past the tie
  EXPECT_EQ(FloatToBF16(F(0x00008000)), 0x0000);  // subnormal tie to even zero
  EXPECT_EQ(FloatToBF16(F(0x00018000)), 0x0002);
  EXPECT_EQ(FloatToBF16(INFINITY), 0x7f80);
  EXPECT_EQ(FloatToBF16(-INFINITY), 0xff80);
  EXPECT_EQ(FloatToBF16(F(0x7fc00000)), 0x7fc0);
  // NaNs whose payload is only in the low 16 bits must not turn into inf.
  EXPECT_EQ(FloatToBF16(F(0x7f800001)), 0x7fc0);
  EXPECT_EQ(FloatToBF16(F(0xff800001)), 0xffc0);
  EXPECT_TRUE(std::isnan(BF16ToFloat(FloatToBF16(F(0x7fffffff)))));
  EXPECT_EQ(BF16ToFloat(0x3f80), 1.0f);
}

TEST(FloatConvert, BF16MatchesReferenceOnASweep) {
  // ~8M bit patterns spread over all finite floats (a prime stride visits every exponent).
  uint64_t mismatches = 0;
  for (uint64_t k = 0; k < (uint64_t{1} << 32); k += 509) {
    const uint32_t x = static_cast<uint32_t>(k);
    if ((x & 0x7f800000) == 0x7f800000) continue;
    if (FloatToBF16(F(x)) != ReferenceBF16(F(x)) && ++mismatches < 5) {
      ADD_FAILURE() << std::hex << "0x" << x << " -> 0x" << FloatToBF16(F(x)) << ", want 0x"
                    << ReferenceBF16(F(x));
    }
  }
  EXPECT_EQ(mismatches, 0u);
}

TEST(FloatConvert, F16Sanity) {
  EXPECT_EQ(FloatToF16(1.0f), 0x3c00);
  EXPECT_EQ(FloatToF16(-2.0f), 0xc000);
  EXPECT_EQ(FloatToF16(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToF16(65519.0f), 0x7bff);
  EXPECT_EQ(FloatToF16(65520.0f), 0x7c00);
  EXPECT_EQ(FloatToF16(1e10f), 0x7c00);
  EXPECT_EQ(FloatToF16(-INFINITY), 0xfc00);
  EXPECT_EQ(FloatToF16(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(FloatToF16(std::ldexp(1.0f, -25)), 0x0000);  // tie to even zero
  EXPECT_EQ(FloatToF16(std::ldexp(1.5f, -25)), 0x0001);
  EXPECT_EQ(FloatToF16(std::ldexp(1.0f, -14)), 0x0400);  // smallest normal
  EXPECT_EQ(FloatToF16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie, even below
  EXPECT_EQ(FloatToF16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);  // tie, even above
  EXPECT_EQ(FloatToF16(NAN) & 0x7e00, 0x7e00);
  EXPECT_TRUE(std::isnan(F16ToFloat(FloatToF16(F(0x7f800001)))));
  // Every non-NaN half survives a round trip through fp32.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7c00) == 0x7c00 && (h & 0x3ff)) continue;
    ASSERT_EQ(FloatToF16(F16ToFloat(static_cast<uint16_t>(h))), h) << std::hex << h;
  }
  EXPECT_EQ(F16ToFloat(0x0001), std::ldexp(1.0f, -24));
#ifdef __FLT16_MAX__
  // The compiler's own conversion is correctly rounded: compare on a sweep.
  for (uint64_t k = 0; k < (uint64_t{1} << 32); k += 4099) {
    const float f = F(static_cast<uint32_t>(k));
    if (std::isnan(f)) continue;
    const _Float16 h = static_cast<_Float16>(f);
    ASSERT_EQ(FloatToF16(f), std::bit_cast<uint16_t>(h)) << std::hex << k;
  }
#endif
}

TEST(FloatConvert, Fp8E4M3KnownValues) {
  EXPECT_EQ(FloatToF8E4M3(1.0f), 0x38);
  EXPECT_EQ(FloatToF8E4M3(448.0f), 0x7e);
  EXPECT_EQ(FloatToF8E4M3(-2.0f), 0xc0);
  EXPECT_EQ(FloatToF8E4M3(0.0f), 0x00);
  EXPECT_EQ(FloatToF8E4M3(-0.0f), 0x80);
  EXPECT_EQ(FloatToF8E4M3(0.0625f), 0x18);
  EXPECT_EQ(FloatToF8E4M3(500.0f), 0x7e);  // saturates
  EXPECT_EQ(FloatToF8E4M3(-1e30f), 0xfe);
  EXPECT_EQ(FloatToF8E4M3(INFINITY), 0x7e);
  EXPECT_EQ(FloatToF8E4M3(NAN), 0x7f);
  EXPECT_EQ(FloatToF8E4M3(std::ldexp(1.0f, -6)), 0x08);  // smallest normal
  EXPECT_EQ(FloatToF8E4M3(std::ldexp(1.0f, -9)), 0x01);  // smallest subnormal
  EXPECT_EQ(FloatToF8E4M3(std::ldexp(1.0f, -10)), 0x00);  // tie to even zero
  EXPECT_EQ(FloatToF8E4M3(std::ldexp(3.0f, -11)), 0x01);
  EXPECT_EQ(FloatToF8E4M3(1.0625f), 0x38);  // tie between 1 and 1.125, even below
  EXPECT_EQ(FloatToF8E4M3(1.1875f), 0x3a);  // tie between 1.125 and 1.25, even above
  EXPECT_EQ(FloatToF8E4M3(0.3f), 0x2a);     // 0.3 -> 0.3125 = 1.25 * 2^-2
  EXPECT_EQ(F8E4M3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(F8E4M3ToFloat(0x08), std::ldexp(1.0f, -6));
  EXPECT_TRUE(std::isnan(F8E4M3ToFloat(0xff)));
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;
    EXPECT_EQ(FloatToF8E4M3(F8E4M3ToFloat(static_cast<uint8_t>(c))), c) << c;
  }
}

TEST(FloatConvert, Fp8E5M2KnownValues) {
  EXPECT_EQ(FloatToF8E5M2(1.0f), 0x3c);
  EXPECT_EQ(FloatToF8E5M2(-2.0f), 0xc0);
  EXPECT_EQ(FloatToF8E5M2(57344.0f), 0x7b);
  EXPECT_EQ(FloatToF8E5M2(61440.0f), 0x7c);  // tie between max and inf: even is inf
  EXPECT_EQ(FloatToF8E5M2(INFINITY), 0x7c);
  EXPECT_EQ(FloatToF8E5M2(NAN), 0x7f);
  EXPECT_EQ(FloatToF8E5M2(std::ldexp(1.0f, -16)), 0x01);
  // 1 + 2^-3 + 2^-20 lies just above the tie between 1 and 1.25: it must round up,
  // which rounding through f16 first would get wrong.
  EXPECT_EQ(FloatToF8E5M2(1.0f + 0.125f + std::ldexp(1.0f, -20)), 0x3d);
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7c) == 0x7c && (c & 3)) continue;
    EXPECT_EQ(FloatToF8E5M2(F8E5M2ToFloat(static_cast<uint8_t>(c))), c) << c;
  }
}

TEST(Convert, CastsAmongF32BF16AndF16AndRefusesTheRest) {
  std::vector<float> f32 = {1.0f, -2.5f, 1024.0f, 0.0f};  // exact in bf16 and f16
  std::vector<uint16_t> bf16(4), f16(4);
  std::vector<float> back(4);
  auto bytes = [](auto& v) { return std::as_writable_bytes(std::span(v)); };
  ASSERT_TRUE(Convert(bytes(f32), DType::kF32, bytes(bf16), DType::kBF16, "t").ok());
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(bf16[i], FloatToBF16(f32[i])) << i;
  ASSERT_TRUE(Convert(bytes(bf16), DType::kBF16, bytes(f16), DType::kF16, "t").ok());
  ASSERT_TRUE(Convert(bytes(f16), DType::kF16, bytes(back), DType::kF32, "t").ok());
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(back[i], f32[i]) << i;
  EXPECT_TRUE(CanConvert(DType::kI64, DType::kI64));
  EXPECT_FALSE(CanConvert(DType::kF8E4M3, DType::kF32));
  Status s = Convert(bytes(f32), DType::kF32, bytes(f16), DType::kF8E4M3, "model.norm.weight");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("model.norm.weight"), std::string::npos) << s.message();
  s = Convert(bytes(f32), DType::kF32, std::span(bytes(f16)).first(6), DType::kBF16, "x");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
}

}  // namespace
}  // namespace wsync
