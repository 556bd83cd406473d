// The parts of device_plane.h that need no CUDA of their own: dispatch to the installed
// plane, and the copy cache.
#include "backends/ipc/device_plane.h"

#include <atomic>

namespace wsync {
namespace {

std::atomic<IpcDevicePlane*> g_test_plane{nullptr};

IpcDevicePlane& Plane() {
  IpcDevicePlane* p = g_test_plane.load(std::memory_order_acquire);
  return p != nullptr ? *p : BuiltinIpcDevicePlane();
}

}  // namespace

void SetIpcDevicePlaneForTesting(IpcDevicePlane* plane) { g_test_plane.store(plane, std::memory_order_release); }

Result<std::string> IpcDeviceKey(const Device& device) { return Plane().DeviceKey(device); }

Result<std::unique_ptr<DeviceExport>> DeviceExport::Allocate(const Device& device, uint64_t bytes,
                                                             std::string_view kind) {
  return Plane().Allocate(device, bytes, kind);
}

Result<std::unique_ptr<DeviceExport>> DeviceExport::Existing(const Device& device, const void* ptr, uint64_t bytes) {
  return Plane().Existing(device, ptr, bytes);
}

Result<std::unique_ptr<DeviceImport>> DeviceImport::Open(const Device& device, std::string_view kind,
                                                         const nlohmann::json& handle, uint64_t bytes) {
  return Plane().Open(device, kind, handle, bytes);
}

Result<std::unique_ptr<DeviceCopies>> DeviceCopies::Create(const Device& device,
                                                           std::span<const WorkerStore::ByteCopy> copies) {
  return Plane().Copies(device, copies);
}

Status SynchronizeIpcDevice(const Device& device) { return Plane().Synchronize(device); }

Result<std::pair<uint64_t, uint64_t>> IpcDeviceMemoryInfo(const Device& device) { return Plane().MemoryInfo(device); }

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
