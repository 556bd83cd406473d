// Conversions between float dtypes, in one place: bit-exact element conversions between
// fp32 and the narrow float formats of model weights (bfloat16, IEEE float16,
// float8_e4m3fn, float8_e5m2), and Convert(), which casts a whole tensor's bytes between
// the formats a checkpoint may store and a model may run in (f32, bf16, f16): the
// `delta` publisher casts a bf16 runtime tensor to an f32 on-disk dtype before XORing
// (SkyRL's _stage_tensor_for_publish), and its receiver casts back when it reloads an
// f32 checkpoint into bf16 shards.
//
// fp32 -> narrow rounds to nearest, ties to even, like torch's .to(dtype), and keeps NaN a
// (quiet) NaN with its sign. The exceptions are stated per function. Narrow -> fp32 is
// exact. The element functions are pure, branch-light and inline so that the synthetic
// trainer's hot loops vectorize. Everything here is safe from any thread.
#pragma once

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string_view>

#include "wsync/dtype.h"
#include "wsync/status.h"

namespace wsync {

// fp32 -> bf16, round to nearest even. Overflow rounds to +-inf (FLT_MAX -> inf, as in
// torch); NaN stays NaN (quiet bit set, sign kept).
inline uint16_t FloatToBF16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  const uint32_t nan = (x >> 16) | 0x40u;
  return static_cast<uint16_t>((x & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

inline float BF16ToFloat(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

// fp32 -> IEEE half, round to nearest even. Values from 65520 up become +-inf; NaN becomes
// the canonical quiet NaN 0x7e00 with the input's sign. Subnormal halves are produced
// exactly (the addition of a magic constant lets the FPU do the rounding).
inline uint16_t FloatToF16(float f) {
  uint32_t x = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  uint32_t out;
  if (x >= (143u << 23)) {  // >= 65536 (or inf/NaN): the result has all exponent bits set
    out = x > 0x7f800000u ? 0x7e00u : 0x7c00u;
  } else if (x < (113u << 23)) {  // below 2^-14: subnormal half or zero
    const float magic = std::bit_cast<float>(126u << 23);  // 0.5: aligns 10 bits at the bottom
    out = std::bit_cast<uint32_t>(std::bit_cast<float>(x) + magic) - (126u << 23);
  } else {
    const uint32_t mant_odd = (x >> 13) & 1u;
    x += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + mant_odd;  // rebias, round
    out = x >> 13;  // a carry out of the mantissa overflows to 0x7c00 (inf) correctly
  }
  return static_cast<uint16_t>(out | sign);
}

inline float F16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t o = static_cast<uint32_t>(h & 0x7fffu) << 13;
  const uint32_t exp = o & (0x1fu << 23);
  o += static_cast<uint32_t>(127 - 15) << 23;
  if (exp == (0x1fu << 23)) {
    o += static_cast<uint32_t>(128 - 16) << 23;  // inf / NaN
  } else if (exp == 0) {
    o += 1u << 23;  // subnormal: renormalize through an fp32 subtraction
    o = std::bit_cast<uint32_t>(std::bit_cast<float>(o) - std::bit_cast<float>(113u << 23));
  }
  return std::bit_cast<float>(o | sign);
}

// fp32 -> float8_e4m3fn (bias 7, no infinities, NaN = S.1111.111), round to nearest even,
// SATURATING: finite values beyond +-448 and +-inf become +-448 (0x7e / 0xfe), as fp8
// quantization kernels do (torch's plain cast would give NaN). NaN becomes 0x7f / 0xff.
inline uint8_t FloatToF8E4M3(float f) {
  uint32_t x = std::bit_cast<uint32_t>(f);
  const uint8_t sign = static_cast<uint8_t>((x >> 24) & 0x80u);
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return sign | 0x7f;
  if (x >= 0x43e00000u) return sign | 0x7e;  // >= 448
  if (x < (121u << 23)) {                    // below 2^-6: subnormal e4m3 or zero
    const float magic = std::bit_cast<float>(141u << 23);  // 2^14: ulp there is 2^-9
    return sign | static_cast<uint8_t>(std::bit_cast<uint32_t>(std::bit_cast<float>(x) + magic) -
                                       (141u << 23));
  }
  const uint32_t mant_odd = (x >> 20) & 1u;
  x += (static_cast<uint32_t>(7 - 127) << 23) + 0x7ffffu + mant_odd;
  return sign | static_cast<uint8_t>(x >> 20);
}

inline float F8E4M3ToFloat(uint8_t v) {
  const float sign = (v & 0x80) ? -1.0f : 1.0f;
  const int exp = (v >> 3) & 0xf;
  const int mant = v & 0x7;
  if (exp == 0xf && mant == 0x7) return std::numeric_limits<float>::quiet_NaN();
  if (exp == 0) return sign * std::ldexp(static_cast<float>(mant), -9);
  return sign * std::ldexp(1.0f + mant / 8.0f, exp - 7);
}

// fp32 -> float8_e5m2 (bias 15, has inf), round to nearest even; values from 61440 up
// round to +-inf; NaN becomes 0x7f / 0xff.
inline uint8_t FloatToF8E5M2(float f) {
  uint32_t x = std::bit_cast<uint32_t>(f);
  const uint8_t sign = static_cast<uint8_t>((x >> 24) & 0x80u);
  x &= 0x7fffffffu;
  if (x >= (143u << 23)) return sign | (x > 0x7f800000u ? 0x7f : 0x7c);  // >= 65536, inf, NaN
  if (x < (113u << 23)) {  // below 2^-14: subnormal e5m2 or zero
    const float magic = std::bit_cast<float>(134u << 23);  // 2^7: ulp there is 2^-16
    return sign | static_cast<uint8_t>(std::bit_cast<uint32_t>(std::bit_cast<float>(x) + magic) -
                                       (134u << 23));
  }
  const uint32_t mant_odd = (x >> 21) & 1u;
  x += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffffu + mant_odd;
  return sign | static_cast<uint8_t>(x >> 21);
}

inline float F8E5M2ToFloat(uint8_t v) { return F16ToFloat(static_cast<uint16_t>(v) << 8); }

// True when Convert() handles `from` -> `to` (equal dtypes always are).
bool CanConvert(DType from, DType to);

// Casts src (elements of `from`) into dst (elements of `to`), round to nearest even.
// InvalidArgument naming `what` when the pair is unsupported or the sizes disagree.
Status Convert(std::span<const std::byte> src, DType from, std::span<std::byte> dst, DType to,
               std::string_view what);

}  // namespace wsync
