// Fuzz target: ParseUntrustedJson on arbitrary bytes, then every value of what it accepts
// shown through JsonExcerpt and dumped (dump recurses: the depth bound keeps it shallow).
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "core/json_limits.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  wsync::Result<nlohmann::json> j = wsync::ParseUntrustedJson(text, "fuzz");
  if (!j.ok()) return 0;
  (void)wsync::JsonExcerpt(*j, 16);
  (void)j->dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (j->is_object()) {
    for (const auto& [k, v] : j->items()) (void)wsync::JsonExcerpt(v, 16);
    (void)wsync::BoundedStringField(*j, "a", "fuzz", 8);
  }
  return 0;
}
