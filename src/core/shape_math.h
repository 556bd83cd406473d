// Overflow-checked element and byte counts of a shape. Shapes from the wire (an update
// request, a safetensors header, a manifest) go through these before anything is sized
// by them; NumElements (wsync/tensor.h) on such a shape is then defined. Header-only,
// pure, thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <span>

#include "core/checked_math.h"
#include "wsync/dtype.h"

namespace wsync {

// numel when every dimension is >= 0 and every partial product fits int64; else nullopt.
inline std::optional<int64_t> CheckedNumElements(std::span<const int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return std::nullopt;
    std::optional<int64_t> next = CheckedMul<int64_t>(n, d);
    if (!next) return std::nullopt;
    n = *next;
  }
  return n;
}

// numel * ItemSize(dtype) under the same conditions.
inline std::optional<int64_t> CheckedNumBytes(std::span<const int64_t> shape, DType dtype) {
  std::optional<int64_t> n = CheckedNumElements(shape);
  if (!n) return std::nullopt;
  return CheckedMul<int64_t>(*n, static_cast<int64_t>(ItemSize(dtype)));
}

}  // namespace wsync
