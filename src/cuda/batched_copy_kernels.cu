#include "cuda/batched_copy_kernels.h"

#include <cstdint>

namespace wsync::cuda::kernels {
namespace {

// 1024 threads of four 16-byte loads each per 256 KiB tile: 2.06 TB/s on an H200 for
// qwen3-8b's 399 tensors, against 2.02 TB/s with 512 threads and 1.87 TB/s with one
// cudaMemcpyAsync per tensor (a single cudaMemcpyAsync of all the bytes: 2.15 TB/s).
constexpr int kThreads = 1024;

__global__ void __launch_bounds__(kThreads) CopyTiles(const Tile* __restrict__ tiles) {
  Tile t = tiles[blockIdx.x];
  bool wide = ((reinterpret_cast<uintptr_t>(t.src) | reinterpret_cast<uintptr_t>(t.dst) | t.bytes) & 15) == 0;
  if (wide) {
    const uint4* __restrict__ s = reinterpret_cast<const uint4*>(t.src);
    uint4* __restrict__ d = reinterpret_cast<uint4*>(t.dst);
    unsigned long long n = t.bytes / 16;
    unsigned long long i = threadIdx.x;
    // Four independent 16-byte loads in flight per thread before the first store.
    for (; i + 3 * kThreads < n; i += 4 * kThreads) {
      uint4 a = s[i], b = s[i + kThreads], c = s[i + 2 * kThreads], e = s[i + 3 * kThreads];
      d[i] = a;
      d[i + kThreads] = b;
      d[i + 2 * kThreads] = c;
      d[i + 3 * kThreads] = e;
    }
    for (; i < n; i += kThreads) d[i] = s[i];
  } else {
    for (unsigned long long i = threadIdx.x; i < t.bytes; i += kThreads) t.dst[i] = t.src[i];
  }
}

__global__ void Checksum(const unsigned long long* __restrict__ words, unsigned long long n,
                         unsigned long long* __restrict__ out) {
  unsigned long long acc = 0;
  for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    unsigned long long w = words[i] ^ (i * 0x9E3779B97F4A7C15ull);
    w *= 0xBF58476D1CE4E5B9ull;
    acc += w ^ (w >> 31);
  }
  atomicAdd(out, acc);
}

}  // namespace

cudaError_t LaunchCopyTiles(const Tile* tiles, unsigned count, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  // cudaGetLastError reports the last error of ANY earlier runtime call on this thread;
  // clear a stale one so that the check below is about this launch alone.
  (void)cudaGetLastError();
  CopyTiles<<<count, kThreads, 0, stream>>>(tiles);
  return cudaGetLastError();
}

cudaError_t LaunchChecksum(const void* data, unsigned long long words, unsigned long long* out, cudaStream_t stream) {
  (void)cudaGetLastError();  // as above: report this launch's error only
  Checksum<<<1024, 256, 0, stream>>>(static_cast<const unsigned long long*>(data), words, out);
  return cudaGetLastError();
}

}  // namespace wsync::cuda::kernels
