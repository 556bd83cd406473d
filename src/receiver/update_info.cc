#include "receiver/update_info.h"

#include "core/log.h"
#include "model/dropped_names.h"
#include "model/worker_store.h"

namespace wsync {

std::string_view StoreTensors::DropReason(std::string_view name) const {
  if (store_->table().FindHf(name) >= 0) return {};
  return DroppedNameReason(name, store_->config());
}

const TensorMeta* StoreTensors::Find(std::string_view name) const {
  const int i = store_->table().FindHf(name);
  return i < 0 ? nullptr : &store_->table().hf_tensors()[i];
}

bool IsDroppedBy(const WorkerStore& store, std::string_view hf_name) {
  std::string_view reason = StoreTensors(&store).DropReason(hf_name);
  if (reason.empty()) return false;
  WSYNC_LOG_DEBUG("update_info: dropping {} ({})", hf_name, reason);
  return true;
}

}  // namespace wsync
