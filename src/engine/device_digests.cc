#include "engine/device_digests.h"

#include <algorithm>

#include <fmt/format.h>

#include "core/digest.h"
#include "wsync/device_runtime.h"

namespace wsync {

std::vector<DeviceDigestPiece> DeviceDigestPieces(size_t bytes, int64_t rows) {
  if (bytes <= kDeviceWholeDigestBytes || rows < 2) return {DeviceDigestPiece{true, 0, rows, 0, bytes}};
  const size_t row_bytes = bytes / static_cast<size_t>(rows);
  int64_t per = static_cast<int64_t>(std::max<size_t>(1, kDeviceRowDigestBytes / std::max<size_t>(row_bytes, 1)));
  per = std::max(per, (rows + kMaxDeviceRowDigests - 1) / kMaxDeviceRowDigests);
  std::vector<DeviceDigestPiece> pieces;
  for (int64_t begin = 0; begin < rows; begin += per) {
    const int64_t end = std::min(rows, begin + per);
    pieces.push_back({false, begin, end, static_cast<size_t>(begin) * row_bytes,
                      static_cast<size_t>(end - begin) * row_bytes});
  }
  return pieces;
}

Status RecordDeviceDigests(const Device& device, std::span<const DeviceTensorBytes> tensors, PassDigests& digests) {
  if (tensors.empty()) return Status::Ok();
  auto fail = [&](const Status& s) {
    return s.WithContext(fmt::format("digesting {} tensor(s) on {} ({}, ...)", tensors.size(), device.ToString(),
                                     tensors.front().meta->name));
  };
  std::vector<DeviceRuntime::Span> spans;
  std::vector<std::pair<const TensorMeta*, DeviceDigestPiece>> owners;
  for (const DeviceTensorBytes& t : tensors) {
    for (const DeviceDigestPiece& p : DeviceDigestPieces(*t.meta)) {
      spans.push_back({t.data + p.offset, p.bytes});
      owners.emplace_back(t.meta, p);
    }
  }
  Result<std::vector<std::string>> hexes = DeviceXxh3Hex(device, spans);
  if (!hexes.ok()) return fail(hexes.status());
  for (size_t i = 0; i < owners.size(); ++i) {
    const auto& [meta, piece] = owners[i];
    std::string& hex = (*hexes)[i];
    if (piece.whole) {
      digests.Record(meta->name, std::move(hex));
    } else {
      digests.RecordRows(meta->name, piece.row_begin, piece.row_end, std::move(hex));
    }
  }
  return Status::Ok();
}

}  // namespace wsync
