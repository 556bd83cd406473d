// The CUDA implementation of wsync::DeviceRuntime (include/wsync/device_runtime.h).
// InstallDeviceRuntime() makes it the process-wide runtime; binaries built with CUDA call
// it once at start-up (idempotent, thread-safe). On a machine without a driver it still
// installs: DeviceCount() is 0 and every device call returns CUDA's own error.
#pragma once

namespace wsync::cuda {

void InstallDeviceRuntime();

}  // namespace wsync::cuda
