#include "cuda/digest_kernels.h"

#include <cstdint>

namespace wsync::cuda::kernels {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr unsigned kAll = 0xFFFFFFFFu;

// The 8 little-endian bytes at data + at: one load where aligned, else two aligned loads
// of the words that hold them (both hold input bytes when at + 8 <= the span's length).
struct WordLoad {
  const unsigned char* data;
  __device__ __forceinline__ uint64_t operator()(uint64_t at) const {
    const uintptr_t a = reinterpret_cast<uintptr_t>(data + at);
    const unsigned shift = static_cast<unsigned>(a & 7) * 8;
    const uint64_t* w = reinterpret_cast<const uint64_t*>(a & ~uintptr_t{7});
    if (shift == 0) return w[0];
    return (w[0] >> shift) | (w[1] << (64 - shift));
  }
};

struct ByteLoad {
  const unsigned char* data;
  __device__ __forceinline__ unsigned char operator()(uint64_t at) const { return data[at]; }
};

// Sums a word's contributions over the warp: each lane ends with what its accumulator
// (lane % 8) gains, its own products summed over the 4 stripe groups plus the words of
// the neighbouring accumulator (lane % 8 ^ 1).
__device__ __forceinline__ uint64_t Fold(uint64_t product, uint64_t words) {
  product += __shfl_xor_sync(kAll, product, 8);
  product += __shfl_xor_sync(kAll, product, 16);
  words += __shfl_xor_sync(kAll, words, 8);
  words += __shfl_xor_sync(kAll, words, 16);
  return product + __shfl_xor_sync(kAll, words, 1);
}

// One warp per span. Lane t holds accumulator t % 8 and reads words t, t + 32, t + 64 and
// t + 96 of each 1024-byte block (word t % 8 of stripes t / 8 + 4k), the words of the
// next kAhead blocks loading while a block is folded.
template <bool kAligned>
__device__ void Long(const DigestSpan& s, const xxh3::Secret& secret, int lane, uint64_t* acc_out) {
  const int j = lane & 7, q = lane >> 3;
  uint64_t key[4];
  for (int k = 0; k < 4; ++k) key[k] = secret.Word(xxh3::StripeSecretOffset(q + 4 * k) + 8 * j);
  const uint64_t scramble_key = xxh3::ScrambleKey(secret, j);
  const uint64_t* words = reinterpret_cast<const uint64_t*>(s.data);
  const WordLoad load{s.data};
  auto word = [&](uint64_t block, int k) -> uint64_t {
    const uint64_t at = block * xxh3::kBlockBytes + 8 * (lane + 32 * k);
    return kAligned ? words[at / 8] : load(at);
  };
  const xxh3::LongLayout layout(s.bytes);
  uint64_t acc = xxh3::InitialAccumulator(j);
  // kAhead blocks' words in flight: the ring's slots are registers (static indices).
  constexpr int kAhead = 4;
  uint64_t ring[kAhead][4];
#pragma unroll
  for (int d = 0; d < kAhead; ++d) {
    if (static_cast<uint64_t>(d) < layout.full_blocks) {
#pragma unroll
      for (int k = 0; k < 4; ++k) ring[d][k] = word(d, k);
    }
  }
  for (uint64_t b0 = 0; b0 < layout.full_blocks; b0 += kAhead) {
#pragma unroll
    for (int d = 0; d < kAhead; ++d) {
      const uint64_t b = b0 + d;
      if (b >= layout.full_blocks) break;
      uint64_t product = 0, sum = 0;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        product += xxh3::Xxh3Product(ring[d][k], key[k]);
        sum += ring[d][k];
      }
      if (b + kAhead < layout.full_blocks) {
#pragma unroll
        for (int k = 0; k < 4; ++k) ring[d][k] = word(b + kAhead, k);
      }
      acc = xxh3::Scramble(acc + Fold(product, sum), scramble_key);
    }
  }
  uint64_t product = 0, sum = 0;
  for (int k = 0; k < 4; ++k) {
    if (static_cast<uint64_t>(q + 4 * k) < layout.tail_stripes) {
      const uint64_t w = word(layout.full_blocks, k);
      product += xxh3::Xxh3Product(w, key[k]);
      sum += w;
    }
  }
  if (q == 0) {
    const uint64_t w = load(s.bytes - xxh3::kStripeBytes + 8 * j);
    product += xxh3::Xxh3Product(w, secret.Word(xxh3::kLastStripeSecretOffset + 8 * j));
    sum += w;
  }
  acc += Fold(product, sum);
  for (int i = 0; i < 8; ++i) acc_out[i] = __shfl_sync(kAll, acc, i);
}

__global__ void __launch_bounds__(32 * kWarpsPerBlock)
    Xxh3Spans(const DigestSpan* __restrict__ spans, unsigned count, const xxh3::Secret secret,
              unsigned long long* __restrict__ out) {
  const unsigned span = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (span >= count) return;  // the whole warp: `span` is the same on every lane
  const DigestSpan s = spans[span];
  xxh3::Hash128 h;
  if (s.bytes <= xxh3::kMidSizeMax) {
    if (lane != 0) return;
    h = xxh3::Short(WordLoad{s.data}, ByteLoad{s.data}, s.bytes, secret);
  } else {
    uint64_t acc[8];
    if ((reinterpret_cast<uintptr_t>(s.data) & 7) == 0) {
      Long<true>(s, secret, lane, acc);
    } else {
      Long<false>(s, secret, lane, acc);
    }
    if (lane != 0) return;
    h = xxh3::FinishLong(acc, secret, s.bytes);
  }
  out[2 * span] = h.low;
  out[2 * span + 1] = h.high;
}

}  // namespace

cudaError_t LaunchXxh3Spans(const DigestSpan* spans, unsigned count, const xxh3::Secret& secret,
                            unsigned long long* out, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  (void)cudaGetLastError();  // report this launch's error only
  const unsigned blocks = (count + kWarpsPerBlock - 1) / kWarpsPerBlock;
  Xxh3Spans<<<blocks, 32 * kWarpsPerBlock, 0, stream>>>(spans, count, secret, out);
  return cudaGetLastError();
}

}  // namespace wsync::cuda::kernels
