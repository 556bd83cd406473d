#include "cuda/fp8_block_kernels.h"

#include <cuda_fp16.h>

#include <cstdint>

#include "quant/e4m3.h"

namespace wsync::cuda::kernels {
namespace {

constexpr int kTile = 128;
constexpr int kThreads = 256;

// Element loads: the float32 bits of an element, widened exactly.
struct BF16Elem {
  using T = unsigned short;
  static __device__ __forceinline__ uint32_t Bits(T v) { return static_cast<uint32_t>(v) << 16; }
};
struct F16Elem {
  using T = unsigned short;
  static __device__ __forceinline__ uint32_t Bits(T v) {
    return __float_as_uint(__half2float(__ushort_as_half(v)));  // exact widening
  }
};
struct F32Elem {
  using T = uint32_t;
  static __device__ __forceinline__ uint32_t Bits(T v) { return v; }
};

// Block (tile_r, tile_c) = (blockIdx.x / tiles_c, blockIdx.x % tiles_c) of matrix
// blockIdx.y. Each thread owns kVec consecutive elements of rows tid / kPerRow + p * kRows;
// it keeps them in registers between the amax reduction and the conversion.
template <typename E>
__global__ void __launch_bounds__(kThreads)
    QuantizeTiles(const typename E::T* __restrict__ src, unsigned char* __restrict__ out,
                  float* __restrict__ scale_inv, long long rows, long long cols, long long tiles_c,
                  bool vector) {
  using T = typename E::T;
  constexpr int kVec = 16 / sizeof(T);        // elements per 16-byte load
  constexpr int kPerRow = kTile / kVec;       // threads per tile row
  constexpr int kRows = kThreads / kPerRow;   // rows per pass
  constexpr int kPasses = kTile / kRows;
  const long long matrix = blockIdx.y;
  const long long tile = blockIdx.x;
  const long long r0 = tile / tiles_c * kTile, c0 = tile % tiles_c * kTile;
  const long long tiles = ((rows + kTile - 1) / kTile) * tiles_c;
  src += matrix * rows * cols;
  out += matrix * rows * cols;
  const int tid = threadIdx.x;
  const long long c = c0 + (tid % kPerRow) * kVec;

  T v[kPasses][kVec];
  uint32_t amax = 0;
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const long long r = r0 + tid / kPerRow + p * kRows;
    if (vector && r < rows && c < cols) {
      // cols is a multiple of kVec here, so the whole vector is inside the row.
      const uint4 w = *reinterpret_cast<const uint4*>(src + r * cols + c);
      memcpy(v[p], &w, sizeof(w));
    } else {
#pragma unroll
      for (int k = 0; k < kVec; ++k) v[p][k] = (r < rows && c + k < cols) ? src[r * cols + c + k] : T(0);
    }
#pragma unroll
    for (int k = 0; k < kVec; ++k) amax = max(amax, E::Bits(v[p][k]) & 0x7fffffffu);
  }

  // Block-wide maximum: warp shuffles, then one value per warp through shared memory.
  __shared__ uint32_t warp_max[kThreads / 32];
  __shared__ fp8::BlockScale scale;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (tid % 32 == 0) warp_max[tid / 32] = amax;
  __syncthreads();
  if (tid == 0) {
    uint32_t m = warp_max[0];
#pragma unroll
    for (int w = 1; w < kThreads / 32; ++w) m = max(m, warp_max[w]);
    scale = fp8::BlockScaleFromAmaxBits(m);
    scale_inv[matrix * tiles + tile] = scale.scale_inv;
  }
  __syncthreads();
  const fp8::BlockScale s = scale;

#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const long long r = r0 + tid / kPerRow + p * kRows;
    unsigned char q[kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) q[k] = fp8::QuantizeElement(__uint_as_float(E::Bits(v[p][k])), s);
    if (vector && r < rows && c < cols) {
      // kVec bytes at an offset that is a multiple of kVec (cols and c are).
      if constexpr (kVec == 8) {
        uint2 w;
        memcpy(&w, q, sizeof(w));
        *reinterpret_cast<uint2*>(out + r * cols + c) = w;
      } else {
        uint32_t w;
        memcpy(&w, q, sizeof(w));
        *reinterpret_cast<uint32_t*>(out + r * cols + c) = w;
      }
    } else {
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        if (r < rows && c + k < cols) out[r * cols + c + k] = q[k];
      }
    }
  }
}

template <typename E>
cudaError_t Launch(const void* src, long long count, long long rows, long long cols, unsigned char* out,
                   float* scale_inv, cudaStream_t stream) {
  using T = typename E::T;
  constexpr int kVec = 16 / sizeof(T);
  const long long tiles_r = (rows + kTile - 1) / kTile, tiles_c = (cols + kTile - 1) / kTile;
  const long long tiles = tiles_r * tiles_c;
  if (tiles > 0x7fffffffLL || count > 65535) return cudaErrorInvalidConfiguration;
  if (reinterpret_cast<uintptr_t>(src) % sizeof(T) != 0) return cudaErrorMisalignedAddress;
  // Vector loads and stores need 16-byte aligned input rows and kVec-aligned output rows.
  const bool vector = reinterpret_cast<uintptr_t>(src) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % kVec == 0 &&
                      cols % kVec == 0;
  (void)cudaGetLastError();  // report this launch's error only, not an earlier call's
  dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(count));
  QuantizeTiles<E><<<grid, kThreads, 0, stream>>>(static_cast<const T*>(src), out, scale_inv, rows, cols, tiles_c,
                                                  vector);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchFp8BlockQuantize(const void* src, Fp8Input dtype, long long count, long long rows,
                                   long long cols, unsigned char* out, float* scale_inv, cudaStream_t stream) {
  if (count < 0 || rows < 0 || cols < 0) return cudaErrorInvalidValue;
  if (count == 0 || rows == 0 || cols == 0) return cudaSuccess;
  switch (dtype) {
    case Fp8Input::kBF16:
      return Launch<BF16Elem>(src, count, rows, cols, out, scale_inv, stream);
    case Fp8Input::kF16:
      return Launch<F16Elem>(src, count, rows, cols, out, scale_inv, stream);
    case Fp8Input::kF32:
      return Launch<F32Elem>(src, count, rows, cols, out, scale_inv, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace wsync::cuda::kernels
