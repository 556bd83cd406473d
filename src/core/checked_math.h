// Overflow-checked integer arithmetic for sizes, counts and offsets that arrive from
// untrusted bytes (request bodies, file headers, manifests, shared-memory headers).
// nullopt means the exact result does not fit T. Header-only, pure, any thread.
#pragma once

#include <optional>
#include <type_traits>

namespace wsync {

template <typename T>
  requires std::is_integral_v<T>
constexpr std::optional<T> CheckedAdd(T a, T b) {
  T r;
  if (__builtin_add_overflow(a, b, &r)) return std::nullopt;
  return r;
}

template <typename T>
  requires std::is_integral_v<T>
constexpr std::optional<T> CheckedMul(T a, T b) {
  T r;
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}

}  // namespace wsync
