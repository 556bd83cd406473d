// Fuzz target: nccl_unique_id_b64 as it arrives in an init payload. Whatever decodes must
// be exactly 128 bytes that encode back to the same text (the codec is strict: one
// spelling per id).
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "comm/nccl_unique_id.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  wsync::Result<wsync::NcclUniqueIdBytes> id = wsync::DecodeNcclUniqueId(text);
  if (id.ok() && wsync::EncodeNcclUniqueId(*id) != text) std::abort();
  return 0;
}
