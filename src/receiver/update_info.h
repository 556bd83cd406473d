// The receiver's checks of an update's tensor list (parsed by control/tensor_list.h)
// against the model it serves. Pure; thread-safe.
#pragma once

#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "control/tensor_list.h"
#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync {

class WorkerStore;


// Every tensor must appear once, and exist in the model with this dtype and shape unless
// the rule of model/dropped_names.h drops it (admitted unchecked; WorkerStore::Load lands
// nothing of it).
Status CheckTensorsAgainstModel(const std::vector<TensorMeta>& tensors, const WorkerStore& store);

// Whether the store's model has no tensor `hf_name` and the rule drops it; logs the drop
// at debug level with the name and the reason.
bool IsDroppedBy(const WorkerStore& store, std::string_view hf_name);

}  // namespace wsync
