// Fuzz target: the ipc backend's init_info and update_info as they arrive in a request
// body (JSON text). Byte 0 picks the parser (even: init_info, odd: update_info); the rest
// is the JSON. Whatever parses must survive its own round trip unchanged; an update that
// validates against tensors of the sizes it names must keep every tensor inside the
// slots (or the zero-copy export), however large the numbers.
#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "backends/ipc/protocol.h"
#include "core/checked_math.h"
#include "core/json_limits.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace wsync;
  using nlohmann::json;
  if (size < 1) return 0;
  std::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);
  // The bounded parser every request body goes through (core/json_limits.h).
  Result<json> parsed = ParseUntrustedJson(text, "ipc payload");
  if (!parsed.ok() || !parsed->is_object()) return 0;
  const json& j = *parsed;
  if (data[0] % 2 == 0) {
    Result<IpcInitInfo> info = IpcInitInfo::Parse(j);
    if (!info.ok()) {
      (void)json(info.status().message()).dump();  // throws on a message that is not UTF-8
      return 0;
    }
    Result<IpcInitInfo> again = IpcInitInfo::Parse(info->ToJson());
    if (!again.ok() || again->ToJson() != info->ToJson()) std::abort();
    (void)info->FindBuffer(HostDeviceKey());
    return 0;
  }
  Result<IpcUpdateInfo> update = IpcUpdateInfo::Parse(j);
  if (!update.ok()) {
    (void)json(update.status().message()).dump();
    return 0;
  }
  json back = json::object();
  update->AddTo(&back);
  Result<IpcUpdateInfo> again = IpcUpdateInfo::Parse(back);
  if (!again.ok() || !(*again == *update)) std::abort();
  // Tensors of the sizes the update names (uint8, one dimension; sizes past what a shape
  // holds are left as they are: Validate must refuse them).
  std::vector<TensorMeta> tensors;
  for (size_t i = 0; i < update->tensor_sizes.size() && i < 4096; ++i) {
    uint64_t n = update->tensor_sizes[i];
    tensors.push_back(TensorMeta{"t" + std::to_string(i), DType::kU8,
                                 {static_cast<int64_t>(std::min<uint64_t>(n, uint64_t{1} << 62))}});
  }
  uint64_t slot_bytes = uint64_t{1} << 20;
  if (auto it = j.find("fuzz_slot_bytes"); it != j.end() && it->is_number_unsigned()) slot_bytes = it->get<uint64_t>();
  Status s = update->Validate(tensors, slot_bytes);
  if (!s.ok()) {
    (void)json(s.message()).dump();
    return 0;
  }
  const uint64_t limit = update->zero_copy ? update->zero_copy->bytes : slot_bytes;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!RangeWithin(update->tensor_offsets[i], update->tensor_sizes[i], limit)) std::abort();
  }
  return 0;
}
