// FP8 block quantization of weight matrices on the CPU: the DeepSeek-V3 / vLLM block
// format ("weight_block_size": [128, 128]).
//
// A 2-D tensor [rows, cols] is cut into 128x128 blocks from its origin (the last block
// row / column may be partial). Each block is stored as float8 e4m3 values plus one
// float32 scale_inv, so that x ~= float(q) * scale_inv; the scale grid is
// [ceil(rows/128), ceil(cols/128)], row-major. The arithmetic, bit for bit, is stated in
// quant/e4m3.h (BlockScaleFromAmaxBits, QuantizeElement); the CUDA kernel
// (cuda/fp8_block_kernels.h) follows it and produces the same bytes.
//
// Inputs are bf16, f16 or f32 (widened to float32 exactly). Functions are thread-safe
// for disjoint outputs; QuantizeFp8Blocks blocks until done, splitting the blocks over up
// to `threads` threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "quant/e4m3.h"
#include "wsync/dtype.h"
#include "wsync/status.h"

namespace wsync {

// ceil(n / 128): blocks along a dimension of n elements.
constexpr int64_t Fp8Blocks(int64_t n) { return (n + fp8::kBlock - 1) / fp8::kBlock; }

// Whether QuantizeFp8Blocks takes elements of `dtype` (bf16, f16, f32).
bool IsFp8QuantizableDType(DType dtype);

// `count` row-major matrices [rows, cols] of `dtype`, back to back (a stacked-experts
// parameter is count = E).
struct Fp8MatrixShape {
  int64_t count = 1;
  int64_t rows = 0;
  int64_t cols = 0;

  int64_t elements() const { return count * rows * cols; }
  // Scales per matrix and in all.
  int64_t scales_per_matrix() const { return Fp8Blocks(rows) * Fp8Blocks(cols); }
  int64_t scales() const { return count * scales_per_matrix(); }
};

// Quantizes `src` (shape.elements() values of `dtype`) into `out` (one e4m3 byte per
// element, same layout) and `scale_inv` (shape.scales() floats: per matrix, its
// [ceil(rows/128), ceil(cols/128)] grid). InvalidArgument naming `what` for an
// unsupported dtype, a negative or overflowing shape, or spans of the wrong size.
Status QuantizeFp8Blocks(std::span<const std::byte> src, DType dtype, const Fp8MatrixShape& shape,
                         std::span<uint8_t> out, std::span<float> scale_inv, size_t threads,
                         std::string_view what);

}  // namespace wsync
