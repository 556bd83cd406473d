#include "receiver/update_info.h"

#include <unordered_set>

#include <fmt/format.h>

#include "core/log.h"
#include "model/dropped_names.h"
#include "model/worker_store.h"

namespace wsync {

Status CheckTensorsAgainstModel(const std::vector<TensorMeta>& tensors, const WorkerStore& store) {
  std::unordered_set<std::string_view> seen;
  for (const TensorMeta& t : tensors) {
    if (!seen.insert(t.name).second) {
      return InvalidArgument(fmt::format("tensor {} is listed twice in update_info", t.name));
    }
    if (IsDroppedBy(store, t.name)) continue;
    WSYNC_RETURN_IF_ERROR(store.CheckHf(t));
  }
  return Status::Ok();
}

bool IsDroppedBy(const WorkerStore& store, std::string_view hf_name) {
  if (store.table().FindHf(hf_name) >= 0) return false;
  std::string_view reason = DroppedNameReason(hf_name, store.config());
  if (reason.empty()) return false;
  WSYNC_LOG_DEBUG("update_info: dropping {} ({})", hf_name, reason);
  return true;
}

}  // namespace wsync
