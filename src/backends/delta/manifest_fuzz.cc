// Fuzz target: a delta manifest.json as a sync directory holds it. Parse never throws or
// crashes; what parses writes back (ToJson) to text that parses to the same manifest,
// and every payload file it names is a plain file name (one path component).
#include <cstdint>
#include <cstdlib>
#include <string>

#include "backends/delta/confined_dir.h"
#include "backends/delta/manifest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string text(reinterpret_cast<const char*>(data), size);
  wsync::Result<wsync::delta::DeltaManifest> m = wsync::delta::DeltaManifest::Parse(text);
  if (!m.ok()) return 0;
  for (const std::string& f : m->payload_files) {
    if (!wsync::delta::IsPlainFileName(f)) std::abort();
  }
  std::string again = m->ToJson();
  wsync::Result<wsync::delta::DeltaManifest> m2 = wsync::delta::DeltaManifest::Parse(again);
  if (!m2.ok() || m2->ToJson() != again) std::abort();
  return 0;
}
