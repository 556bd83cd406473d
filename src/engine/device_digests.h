// In-line digests of tensors that live on a GPU, taken on the device
// (DeviceRuntime::Xxh3Digests) by the reader that copies them, so a GPU trainer's syncs
// are verified like a CPU trainer's without reading its tensors back.
//
// The digest kernel hashes one span per block of 16 warps, and xxh3 scrambles its
// accumulators after every 1 KiB block, in order: one span digests at about 14.5 GB/s
// (H100), the device about 1.5 TB/s over spans of 4 to 16 MiB. So a tensor of at most
// kDeviceWholeDigestBytes is digested whole and a larger one by row ranges of dim 0 of
// about kDeviceRowDigestBytes each (the finish's {"rows": [[begin, end, hex], ...]} form,
// docs/protocol.md), which every wsync receiver checks as it checks an FSDP rank's rows.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "engine/sync_pass.h"
#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync {

inline constexpr size_t kDeviceWholeDigestBytes = size_t{32} << 20;
inline constexpr size_t kDeviceRowDigestBytes = size_t{16} << 20;
// The most row ranges one tensor is cut into (receivers take up to 4096).
inline constexpr int64_t kMaxDeviceRowDigests = 2048;

// One digest of a tensor digested on the device: bytes [offset, offset + bytes) of it,
// rows [row_begin, row_end) of dim 0 unless `whole`.
struct DeviceDigestPiece {
  bool whole = true;
  int64_t row_begin = 0;
  int64_t row_end = 0;
  size_t offset = 0;
  size_t bytes = 0;
};

// How a tensor of `bytes` bytes and `rows` rows of dim 0 (0: no dims) is digested on
// the device: one whole piece, or row ranges that tile dim 0 in order. A receiver told
// the trainer digests on its device (init_info `wsync_device_digests`, docs/protocol.md)
// digests what it lands by the same pieces.
std::vector<DeviceDigestPiece> DeviceDigestPieces(size_t bytes, int64_t rows);
inline std::vector<DeviceDigestPiece> DeviceDigestPieces(const TensorMeta& meta) {
  return DeviceDigestPieces(meta.nbytes(), meta.shape.empty() ? 0 : meta.shape[0]);
}

// A tensor's bytes on the device, contiguous, as `meta` describes them.
struct DeviceTensorBytes {
  const TensorMeta* meta = nullptr;
  const std::byte* data = nullptr;
};

// Digests `tensors` (device memory of `device`, made current on the calling thread) in
// one launch, after the work this thread enqueued before, and records them in `digests`
// (whole, or by rows). Errors name the device and the first tensor.
Status RecordDeviceDigests(const Device& device, std::span<const DeviceTensorBytes> tensors, PassDigests& digests);

}  // namespace wsync
