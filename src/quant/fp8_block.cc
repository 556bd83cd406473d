#include "quant/fp8_block.h"

#include <algorithm>
#include <cstring>
#include <optional>

#include <fmt/format.h>

#include "core/checked_math.h"
#include "core/parallel.h"

namespace wsync {
namespace {

// Widening loads: the float32 bits of element i.
struct BF16In {
  using T = uint16_t;
  static uint32_t Bits(T v) { return static_cast<uint32_t>(v) << 16; }
};
struct F16In {
  using T = uint16_t;
  static uint32_t Bits(T v) {
    // IEEE half -> float32, exact, in integer arithmetic (subnormals renormalized).
    const uint32_t sign = static_cast<uint32_t>(v & 0x8000u) << 16;
    const uint32_t exp = (v >> 10) & 0x1fu;
    uint32_t mant = v & 0x3ffu;
    if (exp == 0x1f) return sign | 0x7f800000u | (mant << 13);
    if (exp != 0) return sign | ((exp + 112u) << 23) | (mant << 13);
    if (mant == 0) return sign;
    uint32_t e = 113;  // 2^-14 is the binade of the first subnormal bit pattern shifted up
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --e;
    }
    return sign | (e << 23) | ((mant & 0x3ffu) << 13);
  }
};
struct F32In {
  using T = uint32_t;
  static uint32_t Bits(T v) { return v; }
};

// One block: rows [r0, r1) and columns [c0, c1) of the matrix at `src` / `out`; returns its
// scale_inv. The loops are plain (no early exits) so that compilers vectorize them.
template <typename In>
[[gnu::always_inline]] inline float QuantizeBlockImpl(const typename In::T* src, uint8_t* out, int64_t cols,
                                                      int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  const int64_t w = c1 - c0;
  uint32_t amax = 0;
  for (int64_t r = r0; r < r1; ++r) {
    const typename In::T* row = src + r * cols + c0;
    for (int64_t c = 0; c < w; ++c) amax = std::max(amax, In::Bits(row[c]) & 0x7fffffffu);
  }
  const fp8::BlockScale s = fp8::BlockScaleFromAmaxBits(amax);
  for (int64_t r = r0; r < r1; ++r) {
    const typename In::T* row = src + r * cols + c0;
    uint8_t* dst = out + r * cols + c0;
    if (!s.finite) {
      std::memset(dst, fp8::kE4M3NaN, static_cast<size_t>(w));
      continue;
    }
    for (int64_t c = 0; c < w; ++c) dst[c] = fp8::QuantizeElement(fp8::BitsFloat(In::Bits(row[c])), s);
  }
  return s.scale_inv;
}

// The same code built for the baseline ISA and, on x86-64, for AVX2 (chosen at run time):
// the conversion's per-lane variable shifts and selects vectorize only with AVX2.
template <typename In>
float QuantizeBlock(const typename In::T* src, uint8_t* out, int64_t cols, int64_t r0, int64_t r1, int64_t c0,
                    int64_t c1) {
  return QuantizeBlockImpl<In>(src, out, cols, r0, r1, c0, c1);
}
#if defined(__x86_64__) && !defined(__AVX2__)
#define WSYNC_FP8_AVX2_DISPATCH 1
template <typename In>
[[gnu::target("avx2")]] float QuantizeBlockAvx2(const typename In::T* src, uint8_t* out, int64_t cols, int64_t r0,
                                                int64_t r1, int64_t c0, int64_t c1) {
  return QuantizeBlockImpl<In>(src, out, cols, r0, r1, c0, c1);
}
#endif

template <typename In>
void QuantizeAll(const std::byte* src_bytes, const Fp8MatrixShape& shape, uint8_t* out, float* scale_inv,
                 size_t threads) {
  const auto* src = reinterpret_cast<const typename In::T*>(src_bytes);
  const int64_t br = Fp8Blocks(shape.rows), bc = Fp8Blocks(shape.cols);
  const int64_t per_matrix = br * bc, total = shape.count * per_matrix;
  const int64_t matrix = shape.rows * shape.cols;
  // Enough blocks per thread that a thread's start-up is not the cost.
  constexpr int64_t kMinBlocksPerThread = 16;
  threads = std::min<size_t>(threads, static_cast<size_t>(std::max<int64_t>(1, total / kMinBlocksPerThread)));
  auto* block = &QuantizeBlock<In>;
#if defined(WSYNC_FP8_AVX2_DISPATCH)
  if (__builtin_cpu_supports("avx2")) block = &QuantizeBlockAvx2<In>;
#endif
  ParallelFor(static_cast<size_t>(total), threads, [&](size_t b, size_t e) {
    for (int64_t i = static_cast<int64_t>(b); i < static_cast<int64_t>(e); ++i) {
      const int64_t m = i / per_matrix, t = i % per_matrix;
      const int64_t r0 = t / bc * fp8::kBlock, c0 = t % bc * fp8::kBlock;
      scale_inv[i] = block(src + m * matrix, out + m * matrix, shape.cols, r0, std::min(shape.rows, r0 + fp8::kBlock),
                           c0, std::min(shape.cols, c0 + fp8::kBlock));
    }
  });
}

}  // namespace

bool IsFp8QuantizableDType(DType dtype) {
  return dtype == DType::kBF16 || dtype == DType::kF16 || dtype == DType::kF32;
}

Status QuantizeFp8Blocks(std::span<const std::byte> src, DType dtype, const Fp8MatrixShape& shape,
                         std::span<uint8_t> out, std::span<float> scale_inv, size_t threads,
                         std::string_view what) {
  if (!IsFp8QuantizableDType(dtype)) {
    return InvalidArgument(fmt::format("fp8 quantization of {}: dtype {} is not bf16, f16 or f32",
                                       what, TorchName(dtype)));
  }
  if (shape.count < 0 || shape.rows < 0 || shape.cols < 0) {
    return InvalidArgument(fmt::format("fp8 quantization of {}: negative shape [{}, {}, {}]", what,
                                       shape.count, shape.rows, shape.cols));
  }
  std::optional<uint64_t> n = CheckedMul(shape.count, shape.rows);
  if (n) n = CheckedMul(*n, shape.cols);
  std::optional<uint64_t> bytes = n ? CheckedMul(*n, ItemSize(dtype)) : std::nullopt;
  if (!bytes || *n > static_cast<uint64_t>(INT64_MAX)) {
    return InvalidArgument(fmt::format("fp8 quantization of {}: shape [{}, {}, {}] overflows", what,
                                       shape.count, shape.rows, shape.cols));
  }
  if (src.size() != *bytes || out.size() != *n ||
      scale_inv.size() != static_cast<size_t>(shape.scales())) {
    return InvalidArgument(fmt::format(
        "fp8 quantization of {} [{}, {}, {}]: got {} input bytes, {} outputs and {} scales; "
        "need {}, {} and {}",
        what, shape.count, shape.rows, shape.cols, src.size(), out.size(), scale_inv.size(), *bytes, *n,
        shape.scales()));
  }
  if (reinterpret_cast<uintptr_t>(src.data()) % ItemSize(dtype) != 0) {
    return InvalidArgument(fmt::format("fp8 quantization of {}: input is not aligned to its {}-byte elements",
                                       what, ItemSize(dtype)));
  }
  if (*n == 0) return Status::Ok();
  threads = std::max<size_t>(1, threads);
  switch (dtype) {
    case DType::kBF16:
      QuantizeAll<BF16In>(src.data(), shape, out.data(), scale_inv.data(), threads);
      break;
    case DType::kF16:
      QuantizeAll<F16In>(src.data(), shape, out.data(), scale_inv.data(), threads);
      break;
    default:
      QuantizeAll<F32In>(src.data(), shape, out.data(), scale_inv.data(), threads);
      break;
  }
  return Status::Ok();
}

}  // namespace wsync
