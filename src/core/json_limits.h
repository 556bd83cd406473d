// Bounds on JSON read from untrusted bytes: request bodies, config.json, file headers,
// manifests.
//
// nlohmann::json parses iteratively, but dumping, comparing and copying a value recurse
// over its nesting, so a body nested 100,000 deep is a stack overflow waiting for the
// first error message that quotes it. Every parser of untrusted JSON goes through
// ParseUntrustedJson(), which refuses text nested deeper than kMaxJsonDepth before the
// parser sees it (one linear scan, no allocation), and every error message that shows an
// untrusted value uses JsonExcerpt(), which never recurses and never grows with the value.
// Text fields (versions, request ids, names) are read through BoundedStringField() with a
// length limit from the table below. Pure functions, thread-safe.
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "wsync/status.h"

namespace wsync {

// Deepest nesting of arrays and objects accepted anywhere (the top-level object is depth 1).
// wsync's own formats nest at most 4 deep; Hugging Face configs about 5.
inline constexpr int kMaxJsonDepth = 64;

// Length limits of text fields that a request may set and that a server keeps or repeats
// (docs/security.md lists them).
inline constexpr size_t kMaxWeightVersionBytes = 256;  // weight_version, new_version
inline constexpr size_t kMaxRequestIdBytes = 256;      // request ids (/abort_requests)
inline constexpr size_t kMaxNameBytes = 1024;          // tensor, model and adapter names

// OK when no array or object in `text` nests deeper than `max_depth`. Otherwise an
// InvalidArgument that names `what` and, when the text is an object, the top-level field
// whose value is too deep: "body of /v1/completions: field 'max_tokens' nests deeper than
// 64 levels". Strings (and brackets inside them) are skipped; malformed text passes here and
// is the parser's to refuse.
Status CheckJsonDepth(std::string_view text, std::string_view what, int max_depth = kMaxJsonDepth);

// `text` parsed, after CheckJsonDepth(). Malformed JSON is InvalidArgument("malformed JSON
// in <what>: <parser's message>"); never throws.
Result<nlohmann::json> ParseUntrustedJson(std::string_view text, std::string_view what,
                                          int max_depth = kMaxJsonDepth);

// As ParseUntrustedJson, for text that must be an object of which only `fields` are read:
// the parser skips every other top-level field without building it, so a body padded with
// fields no one reads costs no memory beyond its text. InvalidArgument when the text is not
// an object.
Result<nlohmann::json> ParseUntrustedObject(std::string_view text, std::string_view what,
                                            std::span<const std::string_view> fields,
                                            int max_depth = kMaxJsonDepth);

// A short, valid-UTF-8 description of `v` for an error message: a scalar as JSON cut to
// `max_chars` (with "..."), an array as "a list of N items", an object as "an object of N
// fields". Never recurses, never throws.
std::string JsonExcerpt(const nlohmann::json& v, size_t max_chars = 64);

// obj[field] as a string of at most `max_bytes`, or `fallback` when absent or null.
// InvalidArgument names `where` and the field: "body of /update_weight_version: field
// 'new_version' is 65536 bytes, over the limit of 256" (the value itself is not echoed).
Result<std::string> BoundedStringField(const nlohmann::json& obj, const char* field, std::string_view where,
                                       size_t max_bytes, std::string_view fallback = {});

// `text` (a field name, a tensor name: untrusted text shown unquoted) for an error message:
// as is when at most `max_chars` bytes, otherwise its first `max_chars` bytes, cut on a
// UTF-8 code point boundary, then "... (N bytes)". Never throws.
std::string TextExcerpt(std::string_view text, size_t max_chars = 64);

}  // namespace wsync
