// Exact-width integers from untrusted JSON.
//
// nlohmann::json holds a number as int64, uint64 or double; reading it with get<int>()
// truncates (4294967297 becomes 1) and a range check on the truncated value passes. These
// helpers accept a value only when it is a JSON integer (not 2.0, not "2") that fits an
// int64 and lies in [min, max], and their InvalidArgument names the field, the value and
// the range: "init_info 'world_size' is 4294967297, outside [2, 65536]". Range-check
// before any arithmetic or allocation that the number sizes. Header-only, pure,
// thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/json_limits.h"
#include "wsync/status.h"

namespace wsync {

// `v` as an int64 in [min, max]; `name` says what it is ("init_info 'world_size'").
inline Result<int64_t> JsonIntInRange(const nlohmann::json& v, std::string_view name, int64_t min,
                                      int64_t max) {
  auto outside = [&](std::string_view shown) {
    return InvalidArgument(fmt::format("{} is {}, outside [{}, {}]", name, shown, min, max));
  };
  if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    if (max < 0 || u > static_cast<uint64_t>(max) || (min > 0 && u < static_cast<uint64_t>(min))) {
      return outside(std::to_string(u));
    }
    return static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) {
    int64_t i = v.get<int64_t>();
    if (i < min || i > max) return outside(std::to_string(i));
    return i;
  }
  // Not an integer: a float (even 2.0), a string, a bool, null, a list or an object. The
  // value is shown as a flat excerpt: it may be a large or deeply nested body.
  return InvalidArgument(fmt::format("{} must be an integer in [{}, {}], got {}", name, min, max, JsonExcerpt(v)));
}

// obj[field] as above; nullopt when the field is absent or null.
inline Result<std::optional<int64_t>> OptionalJsonIntField(const nlohmann::json& obj, const char* field,
                                                           std::string_view where, int64_t min,
                                                           int64_t max) {
  if (!obj.is_object()) return std::optional<int64_t>();
  auto it = obj.find(field);
  if (it == obj.end() || it->is_null()) return std::optional<int64_t>();
  Result<int64_t> v = JsonIntInRange(*it, fmt::format("{} '{}'", where, field), min, max);
  if (!v.ok()) return v.status();
  return std::optional<int64_t>(*v);
}

}  // namespace wsync
