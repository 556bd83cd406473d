#include "core/dtype_convert.h"

#include <cstring>

#include <fmt/format.h>

namespace wsync {
namespace {

bool IsCastable(DType d) { return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16; }

float Load(const std::byte* p, DType d, size_t i) {
  if (d == DType::kF32) {
    float f;
    std::memcpy(&f, p + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p + 2 * i, 2);
  return d == DType::kBF16 ? BF16ToFloat(h) : F16ToFloat(h);
}

void Store(std::byte* p, DType d, size_t i, float f) {
  if (d == DType::kF32) {
    std::memcpy(p + 4 * i, &f, 4);
    return;
  }
  uint16_t h = d == DType::kBF16 ? FloatToBF16(f) : FloatToF16(f);
  std::memcpy(p + 2 * i, &h, 2);
}

}  // namespace

bool CanConvert(DType from, DType to) { return from == to || (IsCastable(from) && IsCastable(to)); }

Status Convert(std::span<const std::byte> src, DType from, std::span<std::byte> dst, DType to,
               std::string_view what) {
  if (!CanConvert(from, to)) {
    return InvalidArgument(fmt::format("{}: cannot cast {} to {} (casts exist among float32, bfloat16 "
                                       "and float16)", what, TorchName(from), TorchName(to)));
  }
  size_t n = src.size() / ItemSize(from);
  if (src.size() % ItemSize(from) != 0 || dst.size() != n * ItemSize(to)) {
    return InvalidArgument(fmt::format("{}: casting {} bytes of {} needs {} bytes of {}, got {}", what,
                                       src.size(), TorchName(from), n * ItemSize(to), TorchName(to),
                                       dst.size()));
  }
  if (from == to) {
    std::memcpy(dst.data(), src.data(), src.size());
    return Status::Ok();
  }
  for (size_t i = 0; i < n; ++i) Store(dst.data(), to, i, Load(src.data(), from, i));
  return Status::Ok();
}

}  // namespace wsync
