#include "quant/fp8_device.h"

#include <fmt/format.h>

#include "cuda/cuda_check.h"
#include "cuda/fp8_block_kernels.h"
#include "quant/fp8_sharding.h"

namespace wsync {

Status QuantizeFp8ParamOnDevice(const ShardingTable& table, int param, const void* src, uint8_t* weight,
                                float* scale_inv, cudaStream_t stream) {
  WSYNC_ASSIGN_OR_RETURN(Fp8ParamLayout l, Fp8LayoutOf(table, param));
  using cuda::kernels::Fp8Input;
  Fp8Input in;
  switch (table.params()[param].meta.dtype) {
    case DType::kBF16:
      in = Fp8Input::kBF16;
      break;
    case DType::kF16:
      in = Fp8Input::kF16;
      break;
    case DType::kF32:
      in = Fp8Input::kF32;
      break;
    default:
      return InvalidArgument(fmt::format("fp8 quantization of {}: dtype {} is not bf16, f16 or f32", l.weight.name,
                                         TorchName(table.params()[param].meta.dtype)));
  }
  const Fp8MatrixShape& s = l.shape;
  const cudaError_t err =
      cuda::kernels::LaunchFp8BlockQuantize(src, in, s.count, s.rows, s.cols, weight, scale_inv, stream);
  if (err != cudaSuccess) {
    return cuda::CudaError(err, "LaunchFp8BlockQuantize", __FILE__, __LINE__)
        .WithContext(fmt::format("fp8 quantization of {}", l.weight.name));
  }
  return Status::Ok();
}

}  // namespace wsync
