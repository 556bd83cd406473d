// Overflow-checked integer arithmetic for sizes, counts and offsets that come from the
// wire (JSON bodies, file headers, shared memory): nullopt instead of a wrapped or
// undefined result. Header-only, pure, thread-safe.
#pragma once

#include <optional>
#include <type_traits>

namespace wsync {

template <typename T>
constexpr std::optional<T> CheckedAdd(T a, T b) {
  static_assert(std::is_integral_v<T>);
  T out;
  if (__builtin_add_overflow(a, b, &out)) return std::nullopt;
  return out;
}

template <typename T>
constexpr std::optional<T> CheckedMul(T a, T b) {
  static_assert(std::is_integral_v<T>);
  T out;
  if (__builtin_mul_overflow(a, b, &out)) return std::nullopt;
  return out;
}

}  // namespace wsync
