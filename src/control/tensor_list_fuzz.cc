// Fuzz target: update_info's tensor lists (names, dtype_names, shapes) as JSON text from a
// request body. ParseTensorList() either refuses them or yields tensors whose byte counts
// are defined, and TensorListJson() of the result parses back to the same tensors.
#include <cstdint>
#include <cstdlib>

#include <nlohmann/json.hpp>

#include "core/json_limits.h"
#include "core/shape_math.h"
#include "control/tensor_list.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // The bounded parser every request body goes through (core/json_limits.h).
  wsync::Result<nlohmann::json> j =
      wsync::ParseUntrustedJson(std::string_view(reinterpret_cast<const char*>(data), size), "update_info");
  if (!j.ok()) return 0;
  wsync::Result<std::vector<wsync::TensorMeta>> tensors = wsync::ParseTensorList(*j);
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
