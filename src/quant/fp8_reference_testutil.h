// Test-only reference of FP8 block quantization, written from the format's definition and
// independent of quant/e4m3.h: e4m3 values decoded with ldexp, rounding by searching all
// 127 finite magnitudes for the nearest (ties to the even code), block amax in double.
// Slow on purpose. Used by the quant tests only.
#pragma once

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace wsync::fp8_reference {

// The value of e4m3 code k (0..0x7e, positive), from the definition.
inline double Decode(int k) {
  const int exp = (k >> 3) & 0xf, mant = k & 7;
  if (exp == 0) return std::ldexp(static_cast<double>(mant), -9);
  return std::ldexp(1.0 + mant / 8.0, exp - 7);
}

// float -> e4m3: nearest finite magnitude, ties to the even code; above 448 (and inf)
// saturates to 448; NaN is 0x7f with the sign.
inline uint8_t Encode(float f) {
  const uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  if (std::isnan(f)) return sign | 0x7f;
  const double a = std::fabs(static_cast<double>(f));
  if (a >= 448.0) return sign | 0x7e;
  int best = 0;
  double best_d = a;
  for (int k = 1; k <= 0x7e; ++k) {
    const double d = std::fabs(Decode(k) - a);
    if (d < best_d || (d == best_d && (k & 1) == 0)) {
      best = k;
      best_d = d;
    }
  }
  return sign | static_cast<uint8_t>(best);
}

// bf16 values (little-endian, 2 bytes each) widened to float32: the bits shifted up by 16.
inline std::vector<float> WidenBf16(const std::byte* bytes, size_t count) {
  std::vector<float> x(count);
  for (size_t i = 0; i < count; ++i) {
    const uint32_t h = static_cast<uint32_t>(bytes[2 * i]) | static_cast<uint32_t>(bytes[2 * i + 1]) << 8;
    x[i] = std::bit_cast<float>(h << 16);
  }
  return x;
}

struct Quantized {
  std::vector<uint8_t> q;
  std::vector<float> scale_inv;
};

// Quantizes one row-major [rows, cols] matrix of float32 values (already widened), 128x128
// blocks: amax in double; a block with inf or NaN is all 0x7f with a NaN scale; amax below
// 1e-4f is raised to it; scale = float(448 / amax), x' = float(x * scale) (both exactly the
// float32 operations: double then one rounding to float is correct rounding here), q = Encode(x').
inline Quantized Quantize(const std::vector<float>& x, int64_t rows, int64_t cols) {
  const int64_t br = (rows + 127) / 128, bc = (cols + 127) / 128;
  Quantized out{std::vector<uint8_t>(x.size()), std::vector<float>(br * bc)};
  for (int64_t i = 0; i < br; ++i) {
    for (int64_t j = 0; j < bc; ++j) {
      const int64_t r1 = std::min(rows, (i + 1) * 128), c1 = std::min(cols, (j + 1) * 128);
      double amax = 0;
      bool finite = true;
      for (int64_t r = i * 128; r < r1; ++r) {
        for (int64_t c = j * 128; c < c1; ++c) {
          const double v = x[r * cols + c];
          if (!std::isfinite(v)) finite = false;
          amax = std::max(amax, std::fabs(v));
        }
      }
      if (!finite) {
        out.scale_inv[i * bc + j] = std::bit_cast<float>(0x7fc00000u);
        for (int64_t r = i * 128; r < r1; ++r) {
          for (int64_t c = j * 128; c < c1; ++c) out.q[r * cols + c] = 0x7f;
        }
        continue;
      }
      amax = std::max(amax, static_cast<double>(1e-4f));
      const float scale = static_cast<float>(448.0 / amax);
      out.scale_inv[i * bc + j] = static_cast<float>(amax / 448.0);
      for (int64_t r = i * 128; r < r1; ++r) {
        for (int64_t c = j * 128; c < c1; ++c) {
          const float y = static_cast<float>(static_cast<double>(x[r * cols + c]) * scale);
          out.q[r * cols + c] = Encode(y);
        }
      }
    }
  }
  return out;
}

}  // namespace wsync::fp8_reference
