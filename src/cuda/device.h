// CUDA devices as wsync names them: how many there are (0 without a driver or GPU, never
// an error, so that GPU tests can skip), their UUIDs and the device keys the `ipc`
// backend's buffers are indexed by ("GPU-" + UUID, nvidia-smi's spelling: the physical
// GPU, whatever CUDA_VISIBLE_DEVICES says, so trainer and server processes agree).
// Thread-safe; the functions set no current device.
#pragma once

#include <string>

#include "wsync/status.h"

namespace wsync::cuda {

// Devices this process can use; 0 when CUDA reports no device or no driver.
int DeviceCount();
// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" of device `index`.
Result<std::string> GpuUuid(int index);
// Formats 16 raw UUID bytes the way GpuUuid does.
std::string FormatGpuUuid(const unsigned char bytes[16]);

}  // namespace wsync::cuda
