// The element loops of the synthetic trainer: counter-based random numbers, weight
// generation and the update step, over one contiguous range of one tensor.
//
// Every value is a pure function of (key, element index), so the result does not depend
// on how a tensor is split into ranges or across threads. The kernels are compiled for
// AVX2 and for baseline x86-64 (picked at load time); both produce identical bits, as
// they use only exactly-rounded IEEE operations and no FMA contraction. Thread-safe on
// disjoint ranges.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace wsync::synthetic {

// Per-element hash input is `index * mul + add` (mod 2^32); mul is odd, so distinct
// indices within one 2^32 block never collide.
struct HashKey {
  uint32_t mul;
  uint32_t add;
};

// splitmix64's finalizer: a well-mixed 64-bit bijection.
inline uint64_t Mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// FNV-1a of a tensor name: keys values by name, so a tensor's synthetic values do not
// depend on which other tensors exist or their order (ranks holding subsets agree).
inline uint64_t NameKey(std::string_view name) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (char c : name) h = (h ^ static_cast<uint8_t>(c)) * 0x100000001b3ull;
  return h;
}

// The key of elements [block * 2^32, (block + 1) * 2^32) of a tensor for one purpose
// (initial values, or the update of one step).
inline HashKey MakeKey(uint64_t seed, uint64_t purpose, uint64_t name_key, uint64_t block) {
  uint64_t h = Mix64(Mix64(Mix64(Mix64(seed) ^ purpose) ^ name_key) ^ block);
  return HashKey{static_cast<uint32_t>(h) | 1u, static_cast<uint32_t>(h >> 32)};
}

// Chris Wellons' lowbias32: a 32-bit bijection with low bias, cheap enough to vectorize.
inline uint32_t Hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// out[j] = mean + stddev * z, z approximately N(0, 1) (the scaled sum of four 16-bit
// uniforms, so |z| < 3.47), for element indices first + j, j < n.
void GenerateNormal(float* out, size_t n, uint32_t first, HashKey key, float mean, float stddev);
// out[j] = a hash-derived byte (bool tensors: 0 or 1).
void GenerateBytes(uint8_t* out, size_t n, uint32_t first, HashKey key, bool as_bool);

// Narrowing of fp32 values into a tensor's own dtype.
void RoundToBF16(const float* in, uint16_t* out, size_t n);
void RoundToF16(const float* in, uint16_t* out, size_t n);
void RoundToF8E4M3(const float* in, uint8_t* out, size_t n);
void RoundToF8E5M2(const float* in, uint8_t* out, size_t n);
// One update of a model tensor that keeps no fp32 master: x = value - lr * u, with u
// uniform in [-1, 1) from the key, computed in fp32, then stochastically rounded back to
// the tensor's dtype: to one of the two representable neighbours of x, the upper one with
// probability (x - lower) / (upper - lower), drawn from a second hash of the element. The
// expected value of the new weight is x, so small updates accumulate in expectation as an
// fp32 master would accumulate them. Returns how many values changed (bit-wise). F32
// tensors are updated exactly (no rounding step).
uint64_t StepBF16(uint16_t* model, size_t n, uint32_t first, HashKey key, float lr);
uint64_t StepF16(uint16_t* model, size_t n, uint32_t first, HashKey key, float lr);
uint64_t StepF32(float* model, size_t n, uint32_t first, HashKey key, float lr);

}  // namespace wsync::synthetic
