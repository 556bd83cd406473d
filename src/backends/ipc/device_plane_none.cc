// device_plane.h without CUDA: every call says that this build has no GPU data plane.
#include <fmt/format.h>

#include "backends/ipc/device_plane.h"

namespace wsync {
namespace {

Status NotBuilt(const Device& device) {
  return Unimplemented(fmt::format("{}: this wsync was built without CUDA, so the ipc backend moves bytes through "
                                   "host shared memory only (use --device cpu, or a CUDA build)",
                                   device.ToString()));
}

class NoPlane final : public IpcDevicePlane {
 public:
  Result<std::string> DeviceKey(const Device& device) override { return NotBuilt(device); }
  Result<std::unique_ptr<DeviceExport>> Allocate(const Device& device, uint64_t, std::string_view) override {
    return NotBuilt(device);
  }
  Result<std::unique_ptr<DeviceExport>> Existing(const Device& device, const void*, uint64_t) override {
    return NotBuilt(device);
  }
  Result<std::unique_ptr<DeviceImport>> Open(const Device& device, std::string_view, const nlohmann::json&,
                                             uint64_t) override {
    return NotBuilt(device);
  }
  Result<std::unique_ptr<DeviceCopies>> Copies(const Device& device, std::span<const WorkerStore::ByteCopy>) override {
    return NotBuilt(device);
  }
  Status Synchronize(const Device& device) override { return NotBuilt(device); }
  Result<std::pair<uint64_t, uint64_t>> MemoryInfo(const Device& device) override { return NotBuilt(device); }
};

}  // namespace

bool IpcDevicePlaneBuilt() { return false; }

IpcDevicePlane& BuiltinIpcDevicePlane() {
  static NoPlane plane;
  return plane;
}

}  // namespace wsync
