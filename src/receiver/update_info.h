// The receiver's checks of an update's tensor list (parsed by control/tensor_list.h)
// against the model it serves. Pure; thread-safe.
#pragma once

#include <vector>

#include <nlohmann/json.hpp>

#include "control/tensor_list.h"
#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync {

class WorkerStore;

// Every tensor must exist in the model with this dtype and shape, and appear once.
Status CheckTensorsAgainstModel(const std::vector<TensorMeta>& tensors, const WorkerStore& store);

}  // namespace wsync
