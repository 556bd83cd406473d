// The in-line digest kernel behind DeviceRuntime::Xxh3Digests: xxh3-128 of many spans of
// device memory at once, one block of 16 warps per span (core/xxh3_lanes.h's per-block
// schedule). Not for use outside src/cuda.
#pragma once

#include <cuda_runtime_api.h>

#include "core/xxh3_lanes.h"

namespace wsync::cuda::kernels {

struct DigestSpan {
  const unsigned char* data;
  unsigned long long bytes;
};

// For each of `count` spans (`spans` in device memory), writes its digest's low word to
// out[2i] and its high word to out[2i + 1] (device memory).
cudaError_t LaunchXxh3Spans(const DigestSpan* spans, unsigned count, const xxh3::Secret& secret,
                            unsigned long long* out, cudaStream_t stream);

}  // namespace wsync::cuda::kernels
