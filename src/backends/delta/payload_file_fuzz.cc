// Fuzz target: the header of a payload (or local checkpoint) safetensors file, as
// ParseSafetensorsHeader reads it under the delta backend's kUntrustedHeader. The first 4 input bytes say how many data bytes follow
// the header in the pretend file; the rest is the header. Whatever parses lies inside the
// file and no two tensors overlap.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "backends/delta/payload_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 4) return 0;
  uint64_t data_bytes = uint64_t{data[0]} | uint64_t{data[1]} << 8 | uint64_t{data[2]} << 16 | uint64_t{data[3]} << 24;
  std::string_view header(reinterpret_cast<const char*>(data + 4), size - 4);
  uint64_t file_size = 8 + header.size() + data_bytes;
  auto layout = wsync::ParseSafetensorsHeader(header, file_size, "fuzz.safetensors", wsync::delta::kUntrustedHeader);
  if (!layout.ok()) return 0;
  for (const auto& l : layout->entries) {
    if (l.offset < 8 + header.size() || l.offset > file_size || l.nbytes > file_size - l.offset) std::abort();
  }
  return 0;
}
