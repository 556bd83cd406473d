// Fuzz target: nccl_unique_id_b64 as it arrives in an init payload. Whatever decodes must
// be exactly 128 bytes whose canonical encoding is as long as the input and decodes to
// the same bytes. (Base64 text may spell the same bytes with other unused trailing bits,
// as Python's decoder, and so vLLM, accepts; the codec takes those too.)
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "comm/nccl_unique_id.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  wsync::Result<wsync::NcclUniqueIdBytes> id = wsync::DecodeNcclUniqueId(text);
  if (!id.ok()) return 0;
  std::string canonical = wsync::EncodeNcclUniqueId(*id);
  if (canonical.size() != text.size()) std::abort();
  wsync::Result<wsync::NcclUniqueIdBytes> again = wsync::DecodeNcclUniqueId(canonical);
  if (!again.ok() || *again != *id) std::abort();
  return 0;
}
