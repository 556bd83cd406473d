#include "comm/nccl_unique_id.h"

#include <openssl/evp.h>

#include <algorithm>

#include <fmt/format.h>

namespace wsync {

std::string EncodeNcclUniqueId(const NcclUniqueIdBytes& id) {
  std::string out(4 * ((kNcclUniqueIdBytes + 2) / 3), '\0');
  int n = EVP_EncodeBlock(reinterpret_cast<unsigned char*>(out.data()), id.data(), id.size());
  out.resize(static_cast<size_t>(n));
  return out;
}

Result<NcclUniqueIdBytes> DecodeNcclUniqueId(std::string_view b64) {
  constexpr size_t kEncoded = 4 * ((kNcclUniqueIdBytes + 2) / 3);  // 172 characters
  if (b64.size() != kEncoded) {
    return InvalidArgument(fmt::format(
        "nccl_unique_id_b64 must be {} characters of standard base64 (128 bytes), got {}",
        kEncoded, b64.size()));
  }
  for (size_t i = 0; i < b64.size(); ++i) {
    char c = b64[i];
    bool ok = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
              c == '+' || c == '/' || (c == '=' && i >= b64.size() - 2);
    if (!ok) {
      return InvalidArgument(fmt::format(
          "nccl_unique_id_b64 has '{}' at position {}: not standard base64", c, i));
    }
  }
  // 128 bytes encode with one '=' of padding; EVP_DecodeBlock returns the padded length.
  if (b64.back() != '=' || b64[b64.size() - 2] == '=') {
    return InvalidArgument("nccl_unique_id_b64 does not decode to exactly 128 bytes");
  }
  std::array<unsigned char, 3 * kEncoded / 4> raw{};
  int n = EVP_DecodeBlock(raw.data(), reinterpret_cast<const unsigned char*>(b64.data()),
                          static_cast<int>(b64.size()));
  if (n != static_cast<int>(raw.size())) {
    return InvalidArgument("nccl_unique_id_b64 is not valid base64");
  }
  NcclUniqueIdBytes id;
  std::copy_n(raw.begin(), kNcclUniqueIdBytes, id.begin());
  return id;
}

}  // namespace wsync
