#include "cuda/batched_copy.h"

#include <algorithm>
#include <vector>

#include <fmt/format.h>

#include "cuda/batched_copy_kernels.h"
#include "cuda/cuda_check.h"

namespace wsync::cuda {

using kernels::Tile;

Result<std::unique_ptr<CopyPlan>> CopyPlan::Create(std::span<const CopyOp> ops) {
  std::vector<Tile> tiles;
  std::unique_ptr<CopyPlan> plan(new CopyPlan());
  for (const CopyOp& op : ops) {
    for (size_t off = 0; off < op.bytes; off += kTileBytes) {
      size_t n = std::min(kTileBytes, op.bytes - off);
      tiles.push_back(Tile{static_cast<const unsigned char*>(op.src) + off, static_cast<unsigned char*>(op.dst) + off, n});
    }
    plan->bytes_ += op.bytes;
  }
  if (tiles.size() > 0x7fffffffu) return InvalidArgument(fmt::format("copy plan of {} tiles is too large", tiles.size()));
  plan->tiles_ = tiles.size();
  if (tiles.empty()) return plan;
  WSYNC_CUDA_CHECK(cudaGetDevice(&plan->device_));
  WSYNC_CUDA_CHECK(cudaMalloc(&plan->device_tiles_, tiles.size() * sizeof(Tile)));
  WSYNC_CUDA_CHECK(cudaMemcpy(plan->device_tiles_, tiles.data(), tiles.size() * sizeof(Tile), cudaMemcpyHostToDevice));
  return plan;
}

CopyPlan::~CopyPlan() {
  if (device_tiles_ == nullptr) return;
  int current = -1;
  (void)cudaGetDevice(&current);
  if (current != device_) (void)cudaSetDevice(device_);
  (void)cudaFree(device_tiles_);
  if (current >= 0 && current != device_) (void)cudaSetDevice(current);
}

Status CopyPlan::Launch(cudaStream_t stream) const {
  WSYNC_CUDA_CHECK(kernels::LaunchCopyTiles(static_cast<const Tile*>(device_tiles_), static_cast<unsigned>(tiles_), stream));
  return Status::Ok();
}

Result<uint64_t> DeviceChecksum(const void* data, size_t bytes, cudaStream_t stream) {
  if (bytes % 8 != 0) return InvalidArgument(fmt::format("checksum of {} bytes: not a multiple of 8", bytes));
  unsigned long long* sum = nullptr;
  WSYNC_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&sum), sizeof(*sum)));
  unsigned long long host = 0;
  cudaError_t err = cudaMemsetAsync(sum, 0, sizeof(*sum), stream);
  if (err == cudaSuccess) err = kernels::LaunchChecksum(data, bytes / 8, sum, stream);
  if (err == cudaSuccess) err = cudaMemcpyAsync(&host, sum, sizeof(host), cudaMemcpyDeviceToHost, stream);
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
  cudaFree(sum);
  WSYNC_CUDA_CHECK(err);
  return static_cast<uint64_t>(host);
}

}  // namespace wsync::cuda
