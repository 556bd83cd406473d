#include "quant/fp8_digest.h"

#include <algorithm>
#include <cstdint>
#include <span>

#include <fmt/format.h>

#include "quant/fp8_block.h"
#include "wsync/device_runtime.h"

namespace wsync {

Result<Fp8Digests> Fp8TensorDigests(DigestAlgorithm algorithm, const TensorRef& tensor,
                                    std::vector<std::byte>& scratch) {
  if (tensor.shape.size() != 2 || !IsFp8QuantizableDType(tensor.dtype)) {
    return InvalidArgument(fmt::format("{}: fp8 digests need a 2-D bf16, f16 or f32 tensor, got {} {}", tensor.name,
                                       SafetensorsName(tensor.dtype), ShapeString(tensor.shape)));
  }
  const int64_t rows = tensor.shape[0], cols = tensor.shape[1];
  const size_t item = ItemSize(tensor.dtype);
  const size_t row_bytes = static_cast<size_t>(cols) * item;
  WSYNC_RETURN_IF_ERROR(UseDeviceOnThisThread(tensor.device)
                            .WithContext(fmt::format("reading tensor {} back", tensor.name)));
  auto weight = Hasher::Create(algorithm);
  auto scales = Hasher::Create(algorithm);
  std::vector<uint8_t> q;
  std::vector<float> s;
  for (int64_t r0 = 0; r0 < rows; r0 += fp8::kBlock) {
    const int64_t n = std::min<int64_t>(fp8::kBlock, rows - r0);
    const size_t bytes = static_cast<size_t>(n) * row_bytes;
    std::span<const std::byte> strip = tensor.bytes.subspan(static_cast<size_t>(r0) * row_bytes, bytes);
    if (!tensor.device.is_cpu()) {
      scratch.resize(bytes);
      WSYNC_RETURN_IF_ERROR(CopyAndWait(tensor.device, scratch.data(), bytes, strip.data(), bytes, bytes, 1)
                                .WithContext(fmt::format("reading tensor {} back from {}", tensor.name,
                                                         tensor.device.ToString())));
      strip = std::span<const std::byte>(scratch.data(), bytes);
    }
    const Fp8MatrixShape shape{1, n, cols};
    q.resize(static_cast<size_t>(shape.elements()));
    s.resize(static_cast<size_t>(shape.scales()));
    WSYNC_RETURN_IF_ERROR(QuantizeFp8Blocks(strip, tensor.dtype, shape, q, s, 1, tensor.name));
    weight->Update(std::as_bytes(std::span<const uint8_t>(q)));
    scales->Update(std::as_bytes(std::span<const float>(s)));
  }
  return Fp8Digests{weight->FinishHex(), scales->FinishHex()};
}

}  // namespace wsync
