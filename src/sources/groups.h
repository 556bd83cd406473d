// Layer groups: the units a trainer gathers, exports and frees together.
//
// LayerGroups() partitions a model's tensor names (metadata order) on the outermost
// integer path segment, as SkyRL's layerwise_groups does: "model.layers.3.mlp.experts.7.
// gate_proj.weight" belongs to group "model.layers.3" (a MoE layer stays whole). Names
// without an index form a "pre" group (embeddings) when they come before the first
// indexed name and a "post" group (final norm, lm_head) otherwise; pre is first, post
// last, and stacks follow in order of first appearance of their prefix, then ascending
// index. Sources produce tensors group by group, so metadata order must already be
// group-contiguous: flattening the groups must give the names back, else the call fails
// naming the first name out of place. Pure and thread-safe.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "wsync/status.h"

namespace wsync {

struct LayerGroup {
  std::string key;     // "pre", "post", or the stack entry, e.g. "model.layers.3"
  size_t begin = 0;    // first name's index in metadata order
  size_t end = 0;      // one past the last
  size_t size() const { return end - begin; }
  friend bool operator==(const LayerGroup&, const LayerGroup&) = default;
};

// InvalidArgument when the order is not group-contiguous or a name is empty.
Result<std::vector<LayerGroup>> LayerGroups(const std::vector<std::string>& names);

}  // namespace wsync
