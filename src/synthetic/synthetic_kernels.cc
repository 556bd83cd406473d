#include "synthetic/synthetic_kernels.h"

#include <algorithm>
#include <bit>

#include "core/dtype_convert.h"

// Each kernel is built twice, for AVX2 and for baseline x86-64, and the loader picks one.
// The loops are written so that the compiler vectorizes them (this file builds at -O3).
#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define WSYNC_KERNEL __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef WSYNC_KERNEL
#define WSYNC_KERNEL
#endif

namespace wsync::synthetic {
namespace {

// u in [-1, 1): a hash read as a signed 32-bit fraction.
inline float UniformOf(uint32_t h) { return static_cast<float>(static_cast<int32_t>(h)) * 0x1p-31f; }
inline float Uniform(uint32_t i, HashKey key) { return UniformOf(Hash32(i * key.mul + key.add)); }

}  // namespace

WSYNC_KERNEL void GenerateNormal(float* __restrict out, size_t n, uint32_t first, HashKey key,
                                 float mean, float stddev) {
  // Four U[0, 65536) summands: mean 131070, standard deviation 65536 / sqrt(3).
  const float scale = stddev * 1.7320508075688772f / 65536.0f;
  const uint32_t count = static_cast<uint32_t>(n);
  for (uint32_t j = 0; j < count; ++j) {
    const uint32_t h1 = Hash32((first + j) * key.mul + key.add);
    const uint32_t h2 = Hash32(h1 + 0x9e3779b9u);
    const int32_t sum = static_cast<int32_t>((h1 & 0xffffu) + (h1 >> 16) + (h2 & 0xffffu) + (h2 >> 16));
    out[j] = mean + static_cast<float>(sum - 131070) * scale;
  }
}

WSYNC_KERNEL void GenerateBytes(uint8_t* __restrict out, size_t n, uint32_t first, HashKey key,
                                bool as_bool) {
  const uint32_t count = static_cast<uint32_t>(n);
  const uint32_t mask = as_bool ? 1u : 0xffu;
  for (uint32_t j = 0; j < count; ++j) {
    out[j] = static_cast<uint8_t>((Hash32((first + j) * key.mul + key.add) >> 13) & mask);
  }
}

WSYNC_KERNEL void RoundToBF16(const float* __restrict in, uint16_t* __restrict out, size_t n) {
  for (size_t j = 0; j < n; ++j) out[j] = FloatToBF16(in[j]);
}

WSYNC_KERNEL void RoundToF16(const float* __restrict in, uint16_t* __restrict out, size_t n) {
  for (size_t j = 0; j < n; ++j) out[j] = FloatToF16(in[j]);
}

void RoundToF8E4M3(const float* __restrict in, uint8_t* __restrict out, size_t n) {
  for (size_t j = 0; j < n; ++j) out[j] = FloatToF8E4M3(in[j]);
}

void RoundToF8E5M2(const float* __restrict in, uint8_t* __restrict out, size_t n) {
  for (size_t j = 0; j < n; ++j) out[j] = FloatToF8E5M2(in[j]);
}

WSYNC_KERNEL uint64_t StepBF16(uint16_t* __restrict model, size_t n, uint32_t first, HashKey key, float lr) {
  const uint32_t count = static_cast<uint32_t>(n);
  uint32_t changed = 0;
  for (uint32_t j = 0; j < count; ++j) {
    const uint32_t h = Hash32((first + j) * key.mul + key.add);
    const float x = BF16ToFloat(model[j]) - lr * UniformOf(h);
    // bf16 is fp32's upper half: adding 16 random low bits to the magnitude and
    // truncating rounds the magnitude up with probability (its low bits) / 2^16.
    const uint32_t r = Hash32(h + 0x9e3779b9u) >> 16;
    const uint16_t b = static_cast<uint16_t>((std::bit_cast<uint32_t>(x) + r) >> 16);
    changed += b != model[j];
    model[j] = b;
  }
  return changed;
}

namespace {

// The f16 bit patterns next above and below `h` (finite inputs; +-0 step to +-min subnormal).
uint16_t F16NextUp(uint16_t h) {
  if (h == 0x8000) return 0x0001;
  return (h & 0x8000) ? static_cast<uint16_t>(h - 1) : static_cast<uint16_t>(h + 1);
}
uint16_t F16NextDown(uint16_t h) {
  if (h == 0x0000) return 0x8001;
  return (h & 0x8000) ? static_cast<uint16_t>(h + 1) : static_cast<uint16_t>(h - 1);
}

}  // namespace

uint64_t StepF16(uint16_t* __restrict model, size_t n, uint32_t first, HashKey key, float lr) {
  const uint32_t count = static_cast<uint32_t>(n);
  uint32_t changed = 0;
  for (uint32_t j = 0; j < count; ++j) {
    const uint32_t h = Hash32((first + j) * key.mul + key.add);
    const float x = F16ToFloat(model[j]) - lr * UniformOf(h);
    uint16_t out = FloatToF16(x);
    const float near = F16ToFloat(out);
    if (near != x) {
      const uint16_t other = near < x ? F16NextUp(out) : F16NextDown(out);
      const float far = F16ToFloat(other);
      const uint16_t lo = near < far ? out : other, hi = near < far ? other : out;
      const float lo_v = std::min(near, far), hi_v = std::max(near, far);
      const float p_hi = (x - lo_v) / (hi_v - lo_v);
      const float draw = static_cast<float>(Hash32(h + 0x9e3779b9u) >> 8) * 0x1p-24f;
      out = draw < p_hi ? hi : lo;
    }
    changed += out != model[j];
    model[j] = out;
  }
  return changed;
}

WSYNC_KERNEL uint64_t StepF32(float* __restrict model, size_t n, uint32_t first, HashKey key,
                              float lr) {
  const uint32_t count = static_cast<uint32_t>(n);
  uint32_t changed = 0;
  for (uint32_t j = 0; j < count; ++j) {
    const float old = model[j];
    const float m = old - lr * Uniform(first + j, key);
    changed += std::bit_cast<uint32_t>(m) != std::bit_cast<uint32_t>(old);
    model[j] = m;
  }
  return changed;
}

}  // namespace wsync::synthetic
