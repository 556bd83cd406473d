// FP8 block quantization of one TP worker parameter on a CUDA device: the parameter's
// model-dtype bytes in device memory in, its e4m3 bytes and float32 scale_inv (layouts of
// Fp8LayoutOf, quant/fp8_sharding.h) in device memory out, enqueued on `stream`.
//
// The bytes equal QuantizeFp8Param's on the CPU bit for bit (cuda/fp8_block_kernels.h).
// The call returns once the kernel is enqueued: the outputs are ready when the stream is,
// and `src` must stay valid until then. Errors: Fp8LayoutOf's (the parameter is not
// quantized, its shards are off the 128 grid), an unsupported dtype (InvalidArgument), or
// the launch's CUDA error with the parameter's name; execution errors surface at the
// stream's synchronization. Thread-safe; call on a thread whose current device holds the
// pointers. Built only with CUDA (library wsync_quant_cuda).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "model/sharding.h"
#include "wsync/status.h"

namespace wsync {

Status QuantizeFp8ParamOnDevice(const ShardingTable& table, int param, const void* src, uint8_t* weight,
                                float* scale_inv, cudaStream_t stream);

}  // namespace wsync
