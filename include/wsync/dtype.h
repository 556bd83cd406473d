// Element types of weight tensors and their names in the formats wsync speaks.
//
// Three vocabularies meet here: torch names on the control plane ("bfloat16", vLLM's
// `dtype_names`), safetensors names in checkpoints ("BF16") and NCCL's datatype enum on
// the GPU data plane. All functions are pure and thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "wsync/status.h"

namespace wsync {

enum class DType : uint8_t {
  kBool,
  kU8,
  kI8,
  kI16,
  kI32,
  kI64,
  kF16,
  kBF16,
  kF32,
  kF64,
  kF8E4M3,  // torch float8_e4m3fn, safetensors F8_E4M3
  kF8E5M2,  // torch float8_e5m2, safetensors F8_E5M2
};

// Bytes per element.
size_t ItemSize(DType dtype);
// torch's name without the "torch." prefix, as vLLM puts it in `dtype_names`.
std::string_view TorchName(DType dtype);
// The dtype string of a safetensors header.
std::string_view SafetensorsName(DType dtype);
// Accepts torch names (with or without "torch."); the error names the string.
Result<DType> DTypeFromTorchName(std::string_view name);
Result<DType> DTypeFromSafetensorsName(std::string_view name);
// ncclDataType_t value vLLM's NCCL engine uses for this dtype, or -1 when NCCL has none.
int NcclDataTypeCode(DType dtype);

}  // namespace wsync
