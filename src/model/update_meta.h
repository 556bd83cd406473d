// How a receiver refuses a tensor that an update names with another dtype or shape than
// the worker holds: one wording for update admission (receiver/admission.h, every host of
// the receive side) and WorkerStore's own loads.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "wsync/dtype.h"
#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync {

// OK when `dtype` and `shape` are `held`'s; else InvalidArgument naming the tensor, what
// the worker holds and what the update says: "shape of X is [3072, 1024], update says
// [1024, 3072]"; a dtype refusal also says how the trainer casts as it sends.
Status CheckUpdateMeta(const TensorMeta& held, DType dtype, std::span<const int64_t> shape);

}  // namespace wsync
