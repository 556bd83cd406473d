#include "receiver/update_info.h"

#include <unordered_set>

#include <fmt/format.h>

#include "model/worker_store.h"

namespace wsync {

Status CheckTensorsAgainstModel(const std::vector<TensorMeta>& tensors, const WorkerStore& store) {
  std::unordered_set<std::string_view> seen;
  for (const TensorMeta& t : tensors) {
    if (!seen.insert(t.name).second) {
      return InvalidArgument(fmt::format("tensor {} is listed twice in update_info", t.name));
    }
    WSYNC_RETURN_IF_ERROR(store.CheckHf(t));
  }
  return Status::Ok();
}

}  // namespace wsync
