// device_plane.h without CUDA: every factory says that this build has no GPU data plane.
#include <fmt/format.h>

#include "backends/ipc/device_plane.h"

namespace wsync {
namespace {

Status NotBuilt(const Device& device) {
  return Unimplemented(fmt::format("{}: this wsync was built without CUDA, so the ipc backend moves bytes through "
                                   "host shared memory only (use --device cpu, or a CUDA build)",
                                   device.ToString()));
}

}  // namespace

bool IpcDevicePlaneBuilt() { return false; }

Result<std::string> IpcDeviceKey(const Device& device) { return NotBuilt(device); }

Result<std::unique_ptr<DeviceExport>> DeviceExport::Allocate(const Device& device, uint64_t, std::string_view) {
  return NotBuilt(device);
}

Result<std::unique_ptr<DeviceExport>> DeviceExport::Existing(const Device& device, const void*, uint64_t) {
  return NotBuilt(device);
}

Result<std::unique_ptr<DeviceImport>> DeviceImport::Open(const Device& device, std::string_view,
                                                         const nlohmann::json&, uint64_t) {
  return NotBuilt(device);
}

Result<std::unique_ptr<DeviceCopies>> DeviceCopies::Create(const Device& device,
                                                           std::span<const WorkerStore::ByteCopy>) {
  return NotBuilt(device);
}

Status SynchronizeIpcDevice(const Device& device) { return NotBuilt(device); }

Result<std::pair<uint64_t, uint64_t>> IpcDeviceMemoryInfo(const Device& device) { return NotBuilt(device); }

}  // namespace wsync
