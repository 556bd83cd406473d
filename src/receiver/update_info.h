// Parsing of the tensor lists that vLLM-style update payloads carry:
// {"names": [...], "dtype_names": ["bfloat16", ...], "shapes": [[...], ...]}.
// Errors are InvalidArgument naming the field and index. Pure; thread-safe.
#pragma once

#include <vector>

#include <nlohmann/json.hpp>

#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync {

class WorkerStore;

Result<std::vector<TensorMeta>> ParseTensorList(const nlohmann::json& update_info);
// The inverse: {"names", "dtype_names", "shapes"} of `tensors`, as trainers send them.
nlohmann::json TensorListJson(const std::vector<TensorMeta>& tensors);

// Every tensor must exist in the model with this dtype and shape, and appear once.
Status CheckTensorsAgainstModel(const std::vector<TensorMeta>& tensors, const WorkerStore& store);

}  // namespace wsync
