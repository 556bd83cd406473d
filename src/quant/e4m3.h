// float32 -> float8 e4m3 ("e4m3fn", OCP FP8) conversion and the per-block arithmetic of
// wsync's FP8 block quantization, written once for the CPU and CUDA paths.
//
// e4m3fn: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; no infinities; the only
// NaNs are S.1111.111 (0x7f, 0xff); the largest finite magnitude is 448 (0x7e); the
// smallest subnormal is 2^-9 (0x01).
//
// Fp8E4M3FromBits rounds |x| to the nearest e4m3 magnitude, ties to the even code, in
// integer arithmetic on the float's bits (no FPU rounding mode is involved), and:
//   - keeps the sign, also for zero and for values that round to zero (-tiny -> 0x80);
//   - saturates: finite values above 448 and +-inf become +-448 (0x7e / 0xfe);
//   - maps NaN (any payload, either sign) to 0x7f / 0xff with the input's sign.
//
// This header compiles as C++17 for nvcc (src/cuda/fp8_block_kernels.cu) and as C++20 for
// the host; its functions are pure and thread-safe.
#pragma once

#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define WSYNC_FP8_HD __host__ __device__ __forceinline__
#else
#define WSYNC_FP8_HD inline
#endif

namespace wsync::fp8 {

// Side of one quantization block (rows and columns of a 2-D tensor).
constexpr int64_t kBlock = 128;
// The largest finite e4m3 magnitude.
constexpr float kE4M3Max = 448.0f;
// The lower clamp of a block's amax (float32 0x38d1b717).
constexpr float kMinAmax = 1e-4f;
// Bits of |x| at and above which a block is non-finite (inf and NaN).
constexpr uint32_t kAbsInfBits = 0x7f800000u;
// What a non-finite block stores: every element NaN, scale_inv the canonical quiet NaN.
constexpr uint8_t kE4M3NaN = 0x7f;
constexpr uint32_t kScaleNaNBits = 0x7fc00000u;

WSYNC_FP8_HD uint32_t FloatBits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}

WSYNC_FP8_HD float BitsFloat(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

// float32 bits -> e4m3 code, as described above.
WSYNC_FP8_HD uint8_t Fp8E4M3FromBits(uint32_t bits) {
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t x = bits & 0x7fffffffu;
  if (x > kAbsInfBits) return static_cast<uint8_t>(sign | 0x7fu);  // NaN
  if (x >= 0x43e00000u) return static_cast<uint8_t>(sign | 0x7eu);  // >= 448, inf
  const uint32_t exp = x >> 23;
  uint32_t code;
  if (exp >= 121) {
    // Normal e4m3 (|x| >= 2^-6): exponent rebiased 127 -> 7, the top 3 of 23 mantissa bits
    // kept; the 20 dropped bits decide the rounding. A carry out of the mantissa moves to
    // the next binade, which the packed layout does by itself.
    code = (x >> 20) - (120u << 3);
    const uint32_t rem = x & 0xfffffu;
    code += (rem > 0x80000u || (rem == 0x80000u && (code & 1u))) ? 1u : 0u;
  } else {
    // Subnormal e4m3 (|x| < 2^-6): the code is |x| / 2^-9 rounded, i.e. the 24-bit
    // significand shifted right by 141 - exp (>= 21). Shifts past 31 give 0 with nothing to
    // round up (the significand is below half of 2^31); rounding 7.5+ up to 8 yields 0x08,
    // the smallest normal, which is its correct code.
    const uint32_t sig = (x & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 141u - exp > 31u ? 31u : 141u - exp;
    code = sig >> shift;
    const uint32_t rem = sig & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    code += (rem > half || (rem == half && (code & 1u))) ? 1u : 0u;
  }
  return static_cast<uint8_t>(sign | code);
}

// The exact float32 value of an e4m3 code (NaN for 0x7f / 0xff).
WSYNC_FP8_HD float Fp8E4M3ToFloat(uint8_t v) {
  const uint32_t sign = static_cast<uint32_t>(v & 0x80u) << 24;
  const uint32_t exp = (v >> 3) & 0xfu, mant = v & 0x7u;
  if (exp == 0xf && mant == 0x7) return BitsFloat(sign | 0x7fc00000u);
  if (exp == 0) {
    // mant * 2^-9, exact in float32.
    return BitsFloat(sign | FloatBits(static_cast<float>(mant) * 0.001953125f));
  }
  return BitsFloat(sign | ((exp + 120u) << 23) | (mant << 20));
}

// The per-block arithmetic, in this order and nothing else (so that every path gives the
// same bytes):
//   amax_bits = max over the block of (bits(float32(x)) & 0x7fffffff), as unsigned
//               integers (input widened to float32 exactly; the maximum of magnitudes,
//               independent of order);
//   if amax_bits >= 0x7f800000 (an inf or NaN in the block): every element is 0x7f and
//               scale_inv is NaN (0x7fc00000);
//   else amax = max(float(amax_bits), 1e-4f);
//        scale = 448.0f / amax                (float32 division, round to nearest even)
//        scale_inv = amax / 448.0f            (float32 division, round to nearest even)
//        q(x) = Fp8E4M3FromBits(bits(x * scale))   (float32 product, round to nearest
//               even, never fused with anything; then the e4m3 rounding above).
struct BlockScale {
  float scale;      // 448 / amax; unused when !finite
  float scale_inv;  // what the checkpoint stores: amax / 448
  bool finite;
};

WSYNC_FP8_HD BlockScale BlockScaleFromAmaxBits(uint32_t amax_bits) {
  if (amax_bits >= kAbsInfBits) return BlockScale{0.0f, BitsFloat(kScaleNaNBits), false};
  float amax = BitsFloat(amax_bits);
  if (amax < kMinAmax) amax = kMinAmax;
#if defined(__CUDA_ARCH__)
  return BlockScale{__fdiv_rn(kE4M3Max, amax), __fdiv_rn(amax, kE4M3Max), true};
#else
  return BlockScale{kE4M3Max / amax, amax / kE4M3Max, true};
#endif
}

WSYNC_FP8_HD uint8_t QuantizeElement(float x, const BlockScale& s) {
  if (!s.finite) return kE4M3NaN;
#if defined(__CUDA_ARCH__)
  return Fp8E4M3FromBits(FloatBits(__fmul_rn(x, s.scale)));
#else
  return Fp8E4M3FromBits(FloatBits(x * s.scale));
#endif
}

}  // namespace wsync::fp8
