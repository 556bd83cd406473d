// Fuzz target: a "wsync_digests" row-digest entry (receiver/row_digests.h), read as JSON,
// for a tensor of 1..4096 rows (the first input byte's low 12 bits + 1). Every answer is a
// refusal or ranges that tile [0, rows) in order with one non-empty hex per range.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include <nlohmann/json.hpp>

#include "receiver/row_digests.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2 || size > 8192) return 0;
  const int64_t rows = ((int64_t{data[0]} << 8 | data[1]) & 0xfff) + 1;
  nlohmann::json j = nlohmann::json::parse(std::string_view(reinterpret_cast<const char*>(data + 2), size - 2), nullptr,
                                           /*allow_exceptions=*/false);
  if (j.is_discarded()) return 0;
  wsync::Result<wsync::RowDigests> r = wsync::ParseRowDigests(j, "t", rows);
  if (!r.ok()) return 0;
  if (r->ranges.empty() || r->ranges.size() > wsync::kMaxRowRanges) std::abort();
  int64_t next = 0;
  for (const auto& [begin, end] : r->ranges) {
    if (begin != next || end <= begin) std::abort();
    next = end;
  }
  if (next != rows) std::abort();
  size_t commas = 0;
  for (char c : r->joined) commas += c == ',';
  if (commas + 1 != r->ranges.size()) std::abort();
  return 0;
}
