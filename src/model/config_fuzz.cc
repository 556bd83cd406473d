// Fuzz target: a checkpoint's config.json. ParseHfConfig() either refuses it or yields a
// model whose HF tensors can be listed and counted without overflow (UBSan) or runaway
// allocation (the fuzzer's RSS limit).
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "core/shape_math.h"
#include "model/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  wsync::Result<wsync::ModelConfig> c = wsync::ParseHfConfig(text, "config.json");
  if (!c.ok()) return 0;
  for (const wsync::TensorMeta& t : wsync::HfTensors(*c)) {
    if (!wsync::CheckedNumBytes(t.shape, t.dtype)) std::abort();
  }
  if (wsync::ModelBytes(*c) < 0) std::abort();
  return 0;
}
