#include "model/update_meta.h"

#include <algorithm>

#include <fmt/format.h>

namespace wsync {

Status CheckUpdateMeta(const TensorMeta& held, DType dtype, std::span<const int64_t> shape) {
  if (held.dtype != dtype) {
    // The fix is the trainer's: a cast as it sends (the Python sources' dtype= argument).
    return InvalidArgument(fmt::format("dtype of {} is {}, update says {}: send it as {} (Python: "
                                       "StateDictSource(..., dtype=torch.{}) casts each tensor as it is sent)",
                                       held.name, TorchName(held.dtype), TorchName(dtype), TorchName(held.dtype),
                                       TorchName(held.dtype)));
  }
  if (!std::ranges::equal(held.shape, shape)) {
    return InvalidArgument(
        fmt::format("shape of {} is {}, update says {}", held.name, ShapeString(held.shape), ShapeString(shape)));
  }
  return Status::Ok();
}

}  // namespace wsync
