#include "receiver/row_digests.h"

#include <fmt/format.h>

#include "core/digest.h"

namespace wsync {

Result<RowDigests> ParseRowDigests(const nlohmann::json& entry, std::string_view name, int64_t dim0) {
  const std::string label = fmt::format("wsync_digests[{}]", name.substr(0, 200));
  auto rows = entry.is_object() ? entry.find("rows") : entry.end();
  if (rows == entry.end() || entry.size() != 1 || !rows->is_array() || rows->empty() ||
      rows->size() > kMaxRowRanges) {
    return InvalidArgument(fmt::format("{} must be {{\"rows\": [[begin, end, hex], ...]}} with 1 to {} ranges",
                                       label, kMaxRowRanges));
  }
  RowDigests out;
  int64_t next = 0;
  auto is_hex = [](const std::string& h) { return h.size() <= kMaxDigestHexBytes && IsLowerHex(h); };
  for (const nlohmann::json& e : *rows) {
    if (!e.is_array() || e.size() != 3 || !e[0].is_number_integer() || !e[1].is_number_integer() ||
        !e[2].is_string() || !is_hex(e[2].get_ref<const std::string&>())) {
      return InvalidArgument(fmt::format("{}: each range must be [begin, end, hex] with 1 to {} lowercase hex digits",
                                         label, kMaxDigestHexBytes));
    }
    const int64_t begin = e[0].get<int64_t>(), end = e[1].get<int64_t>();
    if (begin != next || end <= begin || end > dim0) {
      return InvalidArgument(fmt::format("{}: range [{}, {}) does not continue the ranges before it (next row {}) "
                                         "within dim 0 ({} rows)", label, begin, end, next, dim0));
    }
    next = end;
    if (!out.ranges.empty()) out.joined += ',';
    out.joined += e[2].get_ref<const std::string&>();
    out.ranges.emplace_back(begin, end);
  }
  if (next != dim0) {
    return InvalidArgument(fmt::format("{}: the ranges end at row {}; dim 0 has {} rows", label, next, dim0));
  }
  return out;
}

}  // namespace wsync
