// Row digests: the in-line digest of a tensor no trainer rank held whole (FSDP's dim-0
// shards under `sharded`), sent in the finish's "wsync_digests" as
// {"rows": [[begin, end, hex], ...]}: digests of row ranges of dim 0 that tile it
// (docs/protocol.md). Untrusted: every range and digest is checked before it sizes a read.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "wsync/status.h"

namespace wsync {

inline constexpr size_t kMaxRowRanges = 4096;
inline constexpr size_t kMaxDigestHexBytes = 128;

struct RowDigests {
  std::vector<std::pair<int64_t, int64_t>> ranges;  // [begin, end), ascending, tiling [0, dim0)
  std::string joined;                               // the hexes, ',' between them
};

// `entry`, the "wsync_digests" value of tensor `name` (for messages), for a tensor of
// `dim0` rows: exactly {"rows": [...]} with 1 to kMaxRowRanges ranges [begin, end, hex],
// each beginning where the previous ended (the first at 0), non-empty, the last ending at
// dim0, hex 1 to kMaxDigestHexBytes lowercase hex digits. InvalidArgument naming
// wsync_digests[name] and what is wrong.
Result<RowDigests> ParseRowDigests(const nlohmann::json& entry, std::string_view name, int64_t dim0);

}  // namespace wsync
