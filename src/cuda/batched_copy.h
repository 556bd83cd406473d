// BatchedCopy: many device-to-device copies in ONE kernel launch.
//
// A packed sync copies every tensor into a staging slot and every worker copies its
// pieces back out: hundreds of copies per chunk, the same list every sync. A CopyPlan is
// that list cut into tiles of at most kTileBytes and uploaded to the device once; Launch()
// then runs all of it with one launch, 16-byte accesses where source, destination and
// size allow (the ipc protocol aligns tensors to 256 bytes in a slot), byte accesses
// otherwise. Copies must not overlap each other. Launch() is asynchronous on `stream`;
// a plan is immutable after Create() and may be launched from any thread whose current
// device is the plan's; it may be destroyed on any thread.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>
#include <span>

#include "wsync/status.h"

namespace wsync::cuda {

struct CopyOp {
  const void* src = nullptr;
  void* dst = nullptr;
  size_t bytes = 0;
};

class CopyPlan {
 public:
  static constexpr size_t kTileBytes = size_t{256} << 10;

  // Uploads the tiles of `ops` to the current device. Empty ops are skipped.
  static Result<std::unique_ptr<CopyPlan>> Create(std::span<const CopyOp> ops);
  ~CopyPlan();
  CopyPlan(const CopyPlan&) = delete;
  CopyPlan& operator=(const CopyPlan&) = delete;

  Status Launch(cudaStream_t stream) const;
  size_t bytes() const { return bytes_; }
  size_t tiles() const { return tiles_; }

 private:
  CopyPlan() = default;
  int device_ = 0;                // where device_tiles_ lives
  void* device_tiles_ = nullptr;  // Tile[tiles_] in device memory
  size_t tiles_ = 0;
  size_t bytes_ = 0;
};

// A position-sensitive 64-bit checksum of `bytes` of device memory (bytes % 8 == 0),
// for tests and benchmarks that must prove two buffers equal without copying them out.
Result<uint64_t> DeviceChecksum(const void* data, size_t bytes, cudaStream_t stream);

}  // namespace wsync::cuda
