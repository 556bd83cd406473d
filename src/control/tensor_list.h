// The tensor lists of vLLM's update payloads, both ways:
// {"names": [...], "dtype_names": ["bfloat16", ...], "shapes": [[...], ...]}.
//
// A trainer encodes its metadata with TensorListJson (the session driver sends it in
// update_weights); a server parses what arrives with ParseTensorList, whose errors are
// InvalidArgument naming the field and index. The encoding of a list parses back to the
// same list. Pure functions; thread-safe.
#pragma once

#include <vector>

#include <nlohmann/json.hpp>

#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync {

// Refuses lists of unequal length, non-string names or dtypes, names longer than
// kMaxNameBytes (core/json_limits.h), unknown dtypes, negative or non-integer dimensions
// and shapes whose byte count overflows int64. Errors show a refused value as a flat
// excerpt (JsonExcerpt), never the whole list.
Result<std::vector<TensorMeta>> ParseTensorList(const nlohmann::json& update_info);
// {"names", "dtype_names", "shapes"} of `tensors`, in order.
nlohmann::json TensorListJson(const std::vector<TensorMeta>& tensors);

}  // namespace wsync
