#include "wsync/dtype.h"

#include <array>
#include <string>

#include "core/json_limits.h"

namespace wsync {
namespace {

struct DTypeInfo {
  DType dtype;
  size_t item_size;
  std::string_view torch;
  std::string_view safetensors;
  int nccl;  // ncclDataType_t, -1 if none
};

// One row per dtype: the only place these names live.
constexpr std::array<DTypeInfo, 12> kDTypes = {{
    {DType::kBool, 1, "bool", "BOOL", -1},
    {DType::kU8, 1, "uint8", "U8", 1},
    {DType::kI8, 1, "int8", "I8", 0},
    {DType::kI16, 2, "int16", "I16", -1},
    {DType::kI32, 4, "int32", "I32", 2},
    {DType::kI64, 8, "int64", "I64", 4},
    {DType::kF16, 2, "float16", "F16", 6},
    {DType::kBF16, 2, "bfloat16", "BF16", 9},
    {DType::kF32, 4, "float32", "F32", 7},
    {DType::kF64, 8, "float64", "F64", 8},
    {DType::kF8E4M3, 1, "float8_e4m3fn", "F8_E4M3", 10},
    {DType::kF8E5M2, 1, "float8_e5m2", "F8_E5M2", 11},
}};

const DTypeInfo& Info(DType d) { return kDTypes[static_cast<size_t>(d)]; }

}  // namespace

size_t ItemSize(DType dtype) { return Info(dtype).item_size; }
std::string_view TorchName(DType dtype) { return Info(dtype).torch; }
std::string_view SafetensorsName(DType dtype) { return Info(dtype).safetensors; }
int NcclDataTypeCode(DType dtype) { return Info(dtype).nccl; }

Result<DType> DTypeFromTorchName(std::string_view name) {
  std::string_view bare = name;
  if (bare.starts_with("torch.")) bare.remove_prefix(6);
  for (const auto& row : kDTypes) {
    if (row.torch == bare) return row.dtype;
  }
  // torch aliases that trainers print.
  if (bare == "half") return DType::kF16;
  if (bare == "float") return DType::kF32;
  if (bare == "double") return DType::kF64;
  return InvalidArgument("unknown dtype '" + TextExcerpt(name) + "'");
}

Result<DType> DTypeFromSafetensorsName(std::string_view name) {
  for (const auto& row : kDTypes) {
    if (row.safetensors == name) return row.dtype;
  }
  return InvalidArgument("unsupported safetensors dtype '" + TextExcerpt(name) + "'");
}

}  // namespace wsync
