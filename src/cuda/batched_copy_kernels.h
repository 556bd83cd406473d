// The kernels behind batched_copy.h, with a plain launch interface so that only this
// pair of files goes through nvcc. Not for use outside src/cuda.
#pragma once

#include <cuda_runtime_api.h>

namespace wsync::cuda::kernels {

struct Tile {
  const unsigned char* src;
  unsigned char* dst;
  unsigned long long bytes;
};

// One block per tile of `tiles` (device memory).
cudaError_t LaunchCopyTiles(const Tile* tiles, unsigned count, cudaStream_t stream);
// Adds the checksum of `words` 8-byte words at `data` to *out (device memory).
cudaError_t LaunchChecksum(const void* data, unsigned long long words, unsigned long long* out, cudaStream_t stream);

}  // namespace wsync::cuda::kernels
