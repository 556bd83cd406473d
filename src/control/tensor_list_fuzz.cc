// Fuzz target: update_info's tensor lists (names, dtype_names, shapes) as JSON text from a
// request body. ParseTensorList() either refuses them or yields tensors whose byte counts
// are defined, and TensorListJson() of the result parses back to the same tensors.
#include <cstdint>
#include <cstdlib>

#include <nlohmann/json.hpp>

#include "core/shape_math.h"
#include "control/tensor_list.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  nlohmann::json j = nlohmann::json::parse(data, data + size, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return 0;
  wsync::Result<std::vector<wsync::TensorMeta>> tensors = wsync::ParseTensorList(j);
  if (!tensors.ok()) return 0;
  for (const wsync::TensorMeta& t : *tensors) {
    if (!wsync::CheckedNumBytes(t.shape, t.dtype)) std::abort();
    if (t.numel() < 0) std::abort();
    (void)t.nbytes();
  }
  wsync::Result<std::vector<wsync::TensorMeta>> again = wsync::ParseTensorList(wsync::TensorListJson(*tensors));
  if (!again.ok() || *again != *tensors) std::abort();
  return 0;
}
