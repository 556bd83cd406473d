// Fuzz target: update_info's tensor lists (names, dtype_names, shapes) as JSON text from a
// request body, as an object or in vLLM's list form (one object per worker).
// SelectUpdateInfo() either refuses a list or picks an object entry of it, equal for every
// rank it was asked for; ParseTensorList() either refuses the object or yields tensors
// whose byte counts are defined, and TensorListJson() of the result parses back to the
// same tensors.
#include <cstdint>
#include <algorithm>
#include <cstdlib>
#include <memory>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/json_limits.h"
#include "core/shape_math.h"
#include "control/tensor_list.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // The bounded parser every request body goes through (core/json_limits.h).
  wsync::Result<nlohmann::json> j =
      wsync::ParseUntrustedJson(std::string_view(reinterpret_cast<const char*>(data), size), "update_info");
  if (!j.ok()) return 0;
  auto body = std::make_shared<const nlohmann::json>(std::move(*j));
  if (body->is_array()) {
    // The deployment's world: mostly the list's own length, for one text length in four
    // one more (a list one entry short).
    const int world = static_cast<int>(std::min<size_t>(body->size(), 1 << 20)) + (size % 4 == 3 ? 1 : 0);
    std::vector<int> ranks;
    for (int r = world > 1 ? 1 : 0; r < std::min(world, 4); ++r) ranks.push_back(r);
    if (ranks.empty()) ranks.push_back(0);
    wsync::Result<std::shared_ptr<const nlohmann::json>> mine = wsync::SelectUpdateInfo(body, world, ranks);
    if (!mine.ok()) {
      (void)nlohmann::json(mine.status().message()).dump();
      return 0;
    }
    if (body->size() != static_cast<size_t>(world) || !(*mine)->is_object()) std::abort();
    for (int r : ranks) {
      if ((*body)[static_cast<size_t>(r)] != **mine) std::abort();
    }
    body = *mine;
  }
  wsync::Result<std::vector<wsync::TensorMeta>> tensors = wsync::ParseTensorList(*body);
  if (!tensors.ok()) {
    (void)nlohmann::json(tensors.status().message()).dump();  // throws on a message that is not UTF-8
    return 0;
  }
  for (const wsync::TensorMeta& t : *tensors) {
    if (!wsync::CheckedNumBytes(t.shape, t.dtype)) std::abort();
    if (t.numel() < 0) std::abort();
    (void)t.nbytes();
  }
  wsync::Result<std::vector<wsync::TensorMeta>> again = wsync::ParseTensorList(wsync::TensorListJson(*tensors));
  if (!again.ok() || *again != *tensors) std::abort();
  return 0;
}
