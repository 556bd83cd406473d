// Overflow-checked integer arithmetic for sizes, offsets, strides and counts that arrive
// from untrusted input: JSON payloads, file headers, shared memory (STYLE.md 18). Each
// helper returns std::nullopt where the exact mathematical result does not fit the
// result type, instead of wrapping (unsigned) or invoking undefined behaviour (signed);
// the caller turns that into an error naming the field and the limit.
//
//   std::optional<uint64_t> end = CheckedMulAdd(stride, count, offset);  // offset + stride * count
//   if (!end || *end > file_size) return InvalidArgument(...);
//
// Operands may be of any integral types, mixed; the result type is the first template
// argument (uint64_t unless given). Header-only, constexpr, thread-safe.
#pragma once

#include <concepts>
#include <cstdint>
#include <optional>
#include <utility>

namespace wsync {

template <std::integral R = uint64_t, std::integral A, std::integral B>
constexpr std::optional<R> CheckedAdd(A a, B b) {
  R r{};
  if (__builtin_add_overflow(a, b, &r)) return std::nullopt;
  return r;
}

template <std::integral R = uint64_t, std::integral A, std::integral B>
constexpr std::optional<R> CheckedSub(A a, B b) {
  R r{};
  if (__builtin_sub_overflow(a, b, &r)) return std::nullopt;
  return r;
}

template <std::integral R = uint64_t, std::integral A, std::integral B>
constexpr std::optional<R> CheckedMul(A a, B b) {
  R r{};
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}

// a * b + c, the extent of `b` items of `a` bytes after `c` bytes.
template <std::integral R = uint64_t, std::integral A, std::integral B, std::integral C>
constexpr std::optional<R> CheckedMulAdd(A a, B b, C c) {
  std::optional<R> m = CheckedMul<R>(a, b);
  if (!m) return std::nullopt;
  return CheckedAdd<R>(*m, c);
}

// `v` as type R when it is representable there, exactly.
template <std::integral R, std::integral V>
constexpr std::optional<R> CheckedCast(V v) {
  if (!std::in_range<R>(v)) return std::nullopt;
  return static_cast<R>(v);
}

// Whether [offset, offset + length) lies inside [0, size), without computing a sum that
// could wrap.
constexpr bool RangeWithin(uint64_t offset, uint64_t length, uint64_t size) {
  return offset <= size && length <= size - offset;
}

}  // namespace wsync
