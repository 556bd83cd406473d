#include "cuda/device.h"

#include <fmt/format.h>

#include "cuda/cuda_check.h"

namespace wsync::cuda {

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}

std::string FormatGpuUuid(const unsigned char b[16]) {
  return fmt::format("GPU-{:02x}{:02x}{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}{:02x}{:02x}{:02x}{:02x}",
                     b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14],
                     b[15]);
}

Result<std::string> GpuUuid(int index) {
  cudaDeviceProp prop{};
  WSYNC_CUDA_CHECK(cudaGetDeviceProperties(&prop, index));
  return FormatGpuUuid(reinterpret_cast<const unsigned char*>(prop.uuid.bytes));
}

}  // namespace wsync::cuda
