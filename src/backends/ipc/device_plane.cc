// The parts of device_plane.h that need no CUDA of their own.
#include "backends/ipc/device_plane.h"

namespace wsync {

Result<DeviceCopies*> DeviceCopyCache::Get(const Device& device, size_t key, const Copies& copies) {
  auto same = [&copies](const Copies& other) {
    if (other.size() != copies.size()) return false;
    for (size_t i = 0; i < copies.size(); ++i) {
      if (other[i].src != copies[i].src || other[i].dst != copies[i].dst || other[i].bytes != copies[i].bytes) {
        return false;
      }
    }
    return true;
  };
  auto it = entries_.find(key);
  if (it != entries_.end() && same(it->second.copies)) return it->second.plan.get();
  WSYNC_ASSIGN_OR_RETURN(std::unique_ptr<DeviceCopies> plan, DeviceCopies::Create(device, copies));
  Entry& e = entries_[key];
  e.copies = copies;
  e.plan = std::move(plan);
  return e.plan.get();
}

DeviceCopies* DeviceCopyCache::Find(size_t key) const {
  auto it = entries_.find(key);
  return it == entries_.end() ? nullptr : it->second.plan.get();
}

}  // namespace wsync
