// Fuzz target: a local checkpoint's state.json (.skyrl_weight_sync/state.json). Parsing
// never throws or crashes; what parses has a non-negative version.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "backends/delta/local_checkpoint.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  wsync::Result<wsync::delta::CheckpointState> s = wsync::delta::ParseCheckpointState(text);
  if (s.ok() && s->version < 0) std::abort();
  return 0;
}
