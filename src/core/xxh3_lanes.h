// XXH3-128 (seed 0, the default secret) split into the steps a GPU warp runs in parallel,
// bit-identical to libxxhash's XXH3_128bits. The same code compiles for the host (the CPU
// tests check every length class against libxxhash) and for the device (src/cuda's
// digest kernel), so the device digest is the one the tests checked.
//
// The long-input loop (more than 240 bytes) consumes 1024-byte blocks of 16 stripes of
// 8 words. Within a block every word adds into the accumulators independently:
// word j of stripe s adds Xxh3Product(word, secret word s + j) to accumulator j and the
// word itself to accumulator j ^ 1; only the scramble after each block is sequential.
// A warp of 32 lanes therefore splits a block 8 words x 4 stripe groups, sums the
// groups, and scrambles its 8 accumulators; Xxh3LongByLanes below is that schedule run
// on the host.
//
// Every reader of input bytes is a callable `load(offset) -> uint64_t` returning the 8
// little-endian bytes at byte `offset` of the input (any alignment).
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define WSYNC_HD __host__ __device__ __forceinline__
#else
#define WSYNC_HD inline
#endif

namespace wsync::xxh3 {

inline constexpr size_t kSecretBytes = 192;
inline constexpr size_t kStripeBytes = 64;
inline constexpr size_t kBlockBytes = 1024;  // 16 stripes: (secret - stripe) / 8 per block
inline constexpr size_t kStripesPerBlock = kBlockBytes / kStripeBytes;
inline constexpr size_t kMidSizeMax = 240;  // longer inputs take the block loop

inline constexpr uint64_t kPrime32_1 = 0x9E3779B1U;
inline constexpr uint64_t kPrime32_2 = 0x85EBCA77U;
inline constexpr uint64_t kPrime32_3 = 0xC2B2AE3DU;
inline constexpr uint64_t kPrime64_1 = 0x9E3779B185EBCA87ULL;
inline constexpr uint64_t kPrime64_2 = 0xC2B2AE3D27D4EB4FULL;
inline constexpr uint64_t kPrime64_3 = 0x165667B19E3779F9ULL;
inline constexpr uint64_t kPrime64_4 = 0x85EBCA77C2B2AE63ULL;
inline constexpr uint64_t kPrime64_5 = 0x27D4EB2F165667C5ULL;

struct Hash128 {
  uint64_t low = 0;
  uint64_t high = 0;
};

// The 192-byte secret as bytes; its words are read unaligned.
struct Secret {
  unsigned char bytes[kSecretBytes];
  WSYNC_HD uint64_t Word(size_t offset) const {
    uint64_t v = 0;
    for (int i = 7; i >= 0; --i) v = (v << 8) | bytes[offset + i];
    return v;
  }
  WSYNC_HD uint32_t Word32(size_t offset) const {
    uint32_t v = 0;
    for (int i = 3; i >= 0; --i) v = (v << 8) | bytes[offset + i];
    return v;
  }
};

// The accumulators' starting values.
WSYNC_HD uint64_t InitialAccumulator(int lane) {
  switch (lane) {
    case 0: return kPrime32_3;
    case 1: return kPrime64_1;
    case 2: return kPrime64_2;
    case 3: return kPrime64_3;
    case 4: return kPrime64_4;
    case 5: return kPrime32_2;
    case 6: return kPrime64_5;
    default: return kPrime32_1;
  }
}

// What one input word adds to its own accumulator, keyed by its secret word.
WSYNC_HD uint64_t Xxh3Product(uint64_t word, uint64_t key) {
  const uint64_t k = word ^ key;
  return (k & 0xFFFFFFFFULL) * (k >> 32);
}

// The key that scrambles accumulator `lane` after each block: a word of the secret's
// last stripe.
WSYNC_HD uint64_t ScrambleKey(const Secret& secret, int lane) {
  return secret.Word(kSecretBytes - kStripeBytes + 8 * lane);
}

WSYNC_HD uint64_t Scramble(uint64_t acc, uint64_t key) {
  acc ^= acc >> 47;
  acc ^= key;
  return acc * kPrime32_1;
}

// Secret offset of stripe s of a block, and of the input's last stripe.
WSYNC_HD size_t StripeSecretOffset(size_t stripe) { return 8 * stripe; }
inline constexpr size_t kLastStripeSecretOffset = kSecretBytes - kStripeBytes - 7;

WSYNC_HD uint64_t Mul128Fold64(uint64_t a, uint64_t b) {
#if defined(__CUDA_ARCH__)
  return (a * b) ^ __umul64hi(a, b);
#else
  const unsigned __int128 p = static_cast<unsigned __int128>(a) * b;
  return static_cast<uint64_t>(p) ^ static_cast<uint64_t>(p >> 64);
#endif
}

WSYNC_HD Hash128 Mul64To128(uint64_t a, uint64_t b) {
#if defined(__CUDA_ARCH__)
  return Hash128{a * b, __umul64hi(a, b)};
#else
  const unsigned __int128 p = static_cast<unsigned __int128>(a) * b;
  return Hash128{static_cast<uint64_t>(p), static_cast<uint64_t>(p >> 64)};
#endif
}

WSYNC_HD uint64_t Avalanche(uint64_t h) {
  h ^= h >> 37;
  h *= 0x165667919E3779F9ULL;
  return h ^ (h >> 32);
}

WSYNC_HD uint64_t Avalanche64(uint64_t h) {
  h ^= h >> 33;
  h *= kPrime64_2;
  h ^= h >> 29;
  h *= kPrime64_3;
  return h ^ (h >> 32);
}

WSYNC_HD uint64_t Swap64(uint64_t x) {
  uint64_t r = 0;
  for (int i = 0; i < 8; ++i) r |= ((x >> (8 * i)) & 0xFF) << (8 * (7 - i));
  return r;
}

WSYNC_HD uint32_t Swap32(uint32_t x) {
  return (x >> 24) | ((x >> 8) & 0xFF00U) | ((x << 8) & 0xFF0000U) | (x << 24);
}

// The digest of a long input from its 8 final accumulators.
WSYNC_HD Hash128 FinishLong(const uint64_t acc[8], const Secret& secret, uint64_t len) {
  auto merge = [&](size_t offset, uint64_t start) {
    uint64_t r = start;
    for (int i = 0; i < 4; ++i) {
      r += Mul128Fold64(acc[2 * i] ^ secret.Word(offset + 16 * i), acc[2 * i + 1] ^ secret.Word(offset + 16 * i + 8));
    }
    return Avalanche(r);
  };
  Hash128 h;
  h.low = merge(11, len * kPrime64_1);
  h.high = merge(kSecretBytes - 64 - 11, ~(len * kPrime64_2));
  return h;
}

template <typename Load>
WSYNC_HD uint64_t Mix16(const Load& load, size_t at, const Secret& secret, size_t s) {
  return Mul128Fold64(load(at) ^ secret.Word(s), load(at + 8) ^ secret.Word(s + 8));
}

template <typename Load>
WSYNC_HD Hash128 Mix32(Hash128 acc, const Load& load, size_t a, size_t b, const Secret& secret, size_t s) {
  acc.low += Mix16(load, a, secret, s);
  acc.low ^= load(b) + load(b + 8);
  acc.high += Mix16(load, b, secret, s + 16);
  acc.high ^= load(a) + load(a + 8);
  return acc;
}

// Inputs of at most 240 bytes. `byte(i)` returns input byte i (used below 9 bytes);
// `load` reads only words that lie wholly inside the input.
template <typename Load, typename Byte>
WSYNC_HD Hash128 Short(const Load& load, const Byte& byte, uint64_t len, const Secret& secret) {
  Hash128 h;
  if (len == 0) {
    h.low = Avalanche64(secret.Word(64) ^ secret.Word(72));
    h.high = Avalanche64(secret.Word(80) ^ secret.Word(88));
    return h;
  }
  if (len <= 3) {
    const uint32_t c1 = byte(0), c2 = byte(len >> 1), c3 = byte(len - 1);
    const uint32_t lo = (c1 << 16) | (c2 << 24) | c3 | (static_cast<uint32_t>(len) << 8);
    const uint32_t swapped = Swap32(lo);
    const uint32_t hi = (swapped << 13) | (swapped >> 19);
    h.low = Avalanche64(static_cast<uint64_t>(lo) ^ (secret.Word32(0) ^ secret.Word32(4)));
    h.high = Avalanche64(static_cast<uint64_t>(hi) ^ (secret.Word32(8) ^ secret.Word32(12)));
    return h;
  }
  if (len <= 8) {
    auto word32 = [&](uint64_t at) {
      return static_cast<uint64_t>(byte(at)) | (static_cast<uint64_t>(byte(at + 1)) << 8) |
             (static_cast<uint64_t>(byte(at + 2)) << 16) | (static_cast<uint64_t>(byte(at + 3)) << 24);
    };
    const uint64_t in_lo = word32(0);
    const uint64_t in_hi = word32(len - 4);
    const uint64_t keyed = (in_lo + (in_hi << 32)) ^ (secret.Word(16) ^ secret.Word(24));
    Hash128 m = Mul64To128(keyed, kPrime64_1 + (len << 2));
    m.high += m.low << 1;
    m.low ^= m.high >> 3;
    m.low ^= m.low >> 35;
    m.low *= 0x9FB21C651E98DF25ULL;
    m.low ^= m.low >> 28;
    m.high = Avalanche(m.high);
    return m;
  }
  if (len <= 16) {
    const uint64_t flip_lo = secret.Word(32) ^ secret.Word(40);
    const uint64_t flip_hi = secret.Word(48) ^ secret.Word(56);
    uint64_t in_hi = load(len - 8);
    Hash128 m = Mul64To128(load(0) ^ in_hi ^ flip_lo, kPrime64_1);
    m.low += (len - 1) << 54;
    in_hi ^= flip_hi;
    m.high += in_hi + (in_hi & 0xFFFFFFFFULL) * (kPrime32_2 - 1);
    m.low ^= Swap64(m.high);
    Hash128 r = Mul64To128(m.low, kPrime64_2);
    r.high += m.high * kPrime64_2;
    r.low = Avalanche(r.low);
    r.high = Avalanche(r.high);
    return r;
  }
  Hash128 acc{len * kPrime64_1, 0};
  if (len <= 128) {
    if (len > 32) {
      if (len > 64) {
        if (len > 96) acc = Mix32(acc, load, 48, len - 64, secret, 96);
        acc = Mix32(acc, load, 32, len - 48, secret, 64);
      }
      acc = Mix32(acc, load, 16, len - 32, secret, 32);
    }
    acc = Mix32(acc, load, 0, len - 16, secret, 0);
  } else {
    const int rounds = static_cast<int>(len / 32);
    for (int i = 0; i < 4; ++i) acc = Mix32(acc, load, 32 * i, 32 * i + 16, secret, 32 * i);
    acc.low = Avalanche(acc.low);
    acc.high = Avalanche(acc.high);
    for (int i = 4; i < rounds; ++i) acc = Mix32(acc, load, 32 * i, 32 * i + 16, secret, 3 + 32 * (i - 4));
    // The last 32 bytes, with the secret 136 - 17 - 16 bytes in and the seed negated (0).
    acc = Mix32(acc, load, len - 16, len - 32, secret, 136 - 17 - 16);
  }
  h.low = Avalanche(acc.low + acc.high);
  h.high = 0 - Avalanche(acc.low * kPrime64_1 + acc.high * kPrime64_4 + len * kPrime64_2);
  return h;
}

// Where the long loop's pieces of an input of `len` (> 240) bytes lie.
struct LongLayout {
  uint64_t full_blocks;    // scrambled after each
  uint64_t tail_stripes;   // stripes of the last, partial block (not scrambled)
  WSYNC_HD explicit LongLayout(uint64_t len)
      : full_blocks((len - 1) / kBlockBytes), tail_stripes(((len - 1) % kBlockBytes) / kStripeBytes) {}
};

// The warp's schedule on the host: lane t of 32 takes word j = t % 8 of stripes
// t / 8, t / 8 + 4, ... of each block. Compare against libxxhash to check the schedule
// the device kernel runs.
template <typename Load>
Hash128 LongByLanes(const Load& load, uint64_t len, const Secret& secret) {
  uint64_t acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = InitialAccumulator(j);
  const LongLayout layout(len);
  auto block = [&](uint64_t base, uint64_t stripes, bool scramble) {
    uint64_t product[32] = {}, word_sum[32] = {};
    for (int t = 0; t < 32; ++t) {
      const int j = t % 8;
      for (uint64_t s = t / 8; s < stripes; s += 4) {
        const uint64_t w = load(base + s * kStripeBytes + 8 * j);
        product[t] += Xxh3Product(w, secret.Word(StripeSecretOffset(s) + 8 * j));
        word_sum[t] += w;
      }
    }
    for (int j = 0; j < 8; ++j) {
      for (int q = 0; q < 4; ++q) acc[j] += product[8 * q + j] + word_sum[8 * q + (j ^ 1)];
      if (scramble) acc[j] = Scramble(acc[j], ScrambleKey(secret, j));
    }
  };
  for (uint64_t b = 0; b < layout.full_blocks; ++b) block(b * kBlockBytes, kStripesPerBlock, true);
  block(layout.full_blocks * kBlockBytes, layout.tail_stripes, false);
  for (int j = 0; j < 8; ++j) {
    const uint64_t w = load(len - kStripeBytes + 8 * j);
    acc[j] += Xxh3Product(w, secret.Word(kLastStripeSecretOffset + 8 * j));
    acc[j ^ 1] += w;
  }
  return FinishLong(acc, secret, len);
}

}  // namespace wsync::xxh3
