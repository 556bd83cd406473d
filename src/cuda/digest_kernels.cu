#include "cuda/digest_kernels.h"

#include <cstdint>

namespace wsync::cuda::kernels {
namespace {

constexpr int kWarpsPerBlock = 16;
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

// One block of kWarpsPerBlock warps per span. xxh3 scrambles its 8 accumulators after every
// 1 KiB block, but what a block adds to them does not depend on them: each round, warp w
// folds block r * kWarps + w (lane t reads words t, t + 32, t + 64 and t + 96 of it: word
// t % 8 of stripes t / 8 + 4k) into 8 additions in shared memory, and warp 0 then runs the
// round's kWarpsPerBlock add-and-scramble steps, every lane holding accumulator lane % 8. The
// additions are double-buffered (one barrier a round) and each warp's next block loads
// while the round is folded (two rounds ahead).
template <bool kAligned>
__device__ void Long(const DigestSpan& s, const xxh3::Secret& secret, uint64_t* acc_out) {
  __shared__ uint64_t added[2][kWarpsPerBlock][8];
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
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
  const uint64_t rounds = (layout.full_blocks + kWarpsPerBlock - 1) / kWarpsPerBlock;
  uint64_t acc = xxh3::InitialAccumulator(j);
  // This warp's blocks of the next two rounds load while a round is folded.
  uint64_t cur[4] = {0, 0, 0, 0}, next[4] = {0, 0, 0, 0}, later[4] = {0, 0, 0, 0};
  if (static_cast<uint64_t>(warp) < layout.full_blocks) {
#pragma unroll
    for (int k = 0; k < 4; ++k) cur[k] = word(warp, k);
  }
  if (static_cast<uint64_t>(warp + kWarpsPerBlock) < layout.full_blocks) {
#pragma unroll
    for (int k = 0; k < 4; ++k) next[k] = word(warp + kWarpsPerBlock, k);
  }
  for (uint64_t r = 0; r < rounds; ++r) {
    const uint64_t block = r * kWarpsPerBlock + warp;
    const uint64_t ahead = block + 2 * kWarpsPerBlock;
    if (ahead < layout.full_blocks) {
#pragma unroll
      for (int k = 0; k < 4; ++k) later[k] = word(ahead, k);
    }
    if (block < layout.full_blocks) {
      uint64_t product = 0, sum = 0;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        product += xxh3::Xxh3Product(cur[k], key[k]);
        sum += cur[k];
      }
      const uint64_t add = Fold(product, sum);
      if (q == 0) added[r & 1][warp][j] = add;
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      cur[k] = next[k];
      next[k] = later[k];
    }
    __syncthreads();
    if (warp == 0) {
      const uint64_t in_round = min(static_cast<uint64_t>(kWarpsPerBlock), layout.full_blocks - r * kWarpsPerBlock);
      uint64_t round[kWarpsPerBlock];  // read before the dependent chain starts
#pragma unroll
      for (int w = 0; w < kWarpsPerBlock; ++w) round[w] = added[r & 1][w][j];
#pragma unroll
      for (int w = 0; w < kWarpsPerBlock; ++w) {
        if (static_cast<uint64_t>(w) < in_round) acc = xxh3::Scramble(acc + round[w], scramble_key);
      }
    }
  }
  if (warp != 0) return;
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
    Xxh3Spans(const DigestSpan* __restrict__ spans, const xxh3::Secret secret, unsigned long long* __restrict__ out) {
  const DigestSpan s = spans[blockIdx.x];  // one block per span: every thread takes the same path
  xxh3::Hash128 h;
  if (s.bytes <= xxh3::kMidSizeMax) {
    if (threadIdx.x != 0) return;
    h = xxh3::Short(WordLoad{s.data}, ByteLoad{s.data}, s.bytes, secret);
  } else {
    uint64_t acc[8];
    if ((reinterpret_cast<uintptr_t>(s.data) & 7) == 0) {
      Long<true>(s, secret, acc);
    } else {
      Long<false>(s, secret, acc);
    }
    if (threadIdx.x != 0) return;
    h = xxh3::FinishLong(acc, secret, s.bytes);
  }
  out[2 * blockIdx.x] = h.low;
  out[2 * blockIdx.x + 1] = h.high;
}

}  // namespace

cudaError_t LaunchXxh3Spans(const DigestSpan* spans, unsigned count, const xxh3::Secret& secret,
                            unsigned long long* out, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  (void)cudaGetLastError();  // report this launch's error only
  Xxh3Spans<<<count, 32 * kWarpsPerBlock, 0, stream>>>(spans, secret, out);
  return cudaGetLastError();
}

}  // namespace wsync::cuda::kernels
