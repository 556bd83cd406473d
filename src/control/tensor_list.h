// The tensor lists of vLLM's update payloads, both ways:
// {"names": [...], "dtype_names": ["bfloat16", ...], "shapes": [[...], ...]}.
//
// A trainer encodes its metadata with TensorListJson (the session driver sends it in
// update_weights); a server parses what arrives with ParseTensorList, whose errors are
// InvalidArgument naming the field and index. The encoding of a list parses back to the
// same list. SelectUpdateInfo picks a server's entry of vLLM's list form of update_info.
// Pure functions; thread-safe.
#pragma once

#include <memory>
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

// The update_info one server's workers take from POST /update_weights's field `info`: the
// object itself, or an entry of vLLM's list form (one object per worker of the whole
// deployment, indexed by global worker rank dp_index * TP + tp_rank, as vLLM's
// Worker.update_weights picks it). The list is untrusted: InvalidArgument unless it has
// exactly `world_size` entries (the deployment's TP * DP, /get_world_size) and every entry
// `ranks` picks is an object; since a server's backend takes one update_info for all its
// workers, those entries must also be equal (the message names the two that differ).
// The result shares `info`'s lifetime and identity: the same body, the same pointer.
Result<std::shared_ptr<const nlohmann::json>> SelectUpdateInfo(std::shared_ptr<const nlohmann::json> info,
                                                                int world_size, const std::vector<int>& ranks);

}  // namespace wsync
