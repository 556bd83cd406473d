// FP8 block quantization on a CUDA device: the kernel behind src/quant's format, with a
// plain launch interface so that only this pair of files goes through nvcc.
//
// LaunchFp8BlockQuantize quantizes `count` row-major matrices [rows, cols] (device memory,
// back to back: a stacked-experts parameter is count = E) into e4m3 bytes (same layout) and
// float32 scale_inv (per matrix, its [ceil(rows/128), ceil(cols/128)] grid, row-major),
// asynchronously on `stream`. One CUDA block per 128x128 tile: it reduces the tile's amax,
// then converts; the arithmetic is quant/e4m3.h's (BlockScaleFromAmaxBits,
// QuantizeElement), so the bytes equal QuantizeFp8Blocks' on the CPU bit for bit. `src`
// must be aligned to its element size (else cudaErrorMisalignedAddress); 16-byte aligned
// inputs whose rows are a multiple of 16 bytes take vector loads. A grid too large for one
// launch (over 2^31-1 tiles per matrix, over 65535 matrices) is
// cudaErrorInvalidConfiguration; negative sizes are cudaErrorInvalidValue. For one parameter of a ShardingTable, take count/rows/cols from
// quant/fp8_sharding.h's Fp8LayoutOf (which refuses shards off the 128 grid).
//
// The returned error is the launch's (a bad configuration); execution errors surface at
// the stream's next synchronization. Thread-safe; callers own the stream ordering.
#pragma once

#include <cuda_runtime_api.h>

namespace wsync::cuda::kernels {

enum class Fp8Input : int { kBF16 = 0, kF16 = 1, kF32 = 2 };

cudaError_t LaunchFp8BlockQuantize(const void* src, Fp8Input dtype, long long count, long long rows,
                                   long long cols, unsigned char* out, float* scale_inv, cudaStream_t stream);

}  // namespace wsync::cuda::kernels
