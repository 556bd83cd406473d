#include "core/json_limits.h"

#include <algorithm>

#include <fmt/format.h>

namespace wsync {

using nlohmann::json;

Status CheckJsonDepth(std::string_view text, std::string_view what, int max_depth) {
  int depth = 0;
  bool in_string = false;
  bool escaped = false;
  bool top_is_object = false;
  // The last string that ended at depth 1 of an object: the top-level field being read.
  size_t key_begin = 0;
  size_t key_end = 0;
  size_t string_begin = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
        if (depth == 1 && top_is_object) {
          key_begin = string_begin;
          key_end = i;
        }
      }
      continue;
    }
    switch (c) {
      case '"':
        in_string = true;
        string_begin = i + 1;
        break;
      case '[':
      case '{':
        if (depth == 0) top_is_object = c == '{';
        if (++depth > max_depth) {
          if (top_is_object && key_end > key_begin) {
            std::string key = TextExcerpt(text.substr(key_begin, key_end - key_begin));
            return InvalidArgument(fmt::format("{}: field '{}' nests deeper than {} levels", what, key, max_depth));
          }
          return InvalidArgument(fmt::format("{}: JSON nests deeper than {} levels", what, max_depth));
        }
        break;
      case ']':
      case '}':
        if (depth > 0) --depth;
        break;
      default:
        break;
    }
  }
  return Status::Ok();
}

namespace {

// Builds the top-level fields of an object that `fields` names and skips every other one,
// in one linear pass. (nlohmann's callback parser rescans a container for discarded
// values at the end of each of its children: quadratic in the length of a list.)
class FieldFilter {
 public:
  FieldFilter(json& out, std::span<const std::string_view> fields) : dom_(out), fields_(fields) {}

  bool null() { return Scalar() || dom_.null(); }
  bool boolean(bool v) { return Scalar() || dom_.boolean(v); }
  bool number_integer(json::number_integer_t v) { return Scalar() || dom_.number_integer(v); }
  bool number_unsigned(json::number_unsigned_t v) { return Scalar() || dom_.number_unsigned(v); }
  bool number_float(json::number_float_t v, const std::string& s) { return Scalar() || dom_.number_float(v, s); }
  bool string(std::string& v) { return Scalar() || dom_.string(v); }
  bool binary(json::binary_t& v) { return Scalar() || dom_.binary(v); }
  bool start_object(std::size_t n) { return ++depth_, skipping_ || dom_.start_object(n); }
  bool start_array(std::size_t n) { return ++depth_, skipping_ || dom_.start_array(n); }
  bool end_object() { return End() || dom_.end_object(); }
  bool end_array() { return End() || dom_.end_array(); }
  bool key(std::string& k) {
    if (depth_ == 1) skipping_ = std::find(fields_.begin(), fields_.end(), k) == fields_.end();
    return skipping_ || dom_.key(k);
  }
  bool parse_error(std::size_t position, const std::string& token, const nlohmann::detail::exception& e) {
    return dom_.parse_error(position, token, e);
  }

 private:
  // Whether a scalar belongs to a skipped field (and ends it, at the top level).
  bool Scalar() {
    const bool skip = skipping_;
    if (depth_ == 1) skipping_ = false;
    return skip;
  }
  // Whether a container's end belongs to a skipped field (and ends it, at the top level).
  bool End() {
    const bool skip = skipping_;
    if (--depth_ == 1) skipping_ = false;
    return skip;
  }

  nlohmann::detail::json_sax_dom_parser<json> dom_;
  std::span<const std::string_view> fields_;
  int depth_ = 0;          // containers open; 1 inside the top-level object
  bool skipping_ = false;  // within a top-level field `fields_` does not name
};

// `text` parsed after CheckJsonDepth(): whole, or (with `fields`) the top-level fields
// they name only. Errors are values.
Result<json> ParseBounded(std::string_view text, std::string_view what, int max_depth,
                          const std::span<const std::string_view>* fields) {
  WSYNC_RETURN_IF_ERROR(CheckJsonDepth(text, what, max_depth));
  try {
    if (fields == nullptr) return json::parse(text);
    json out;
    FieldFilter filter(out, *fields);
    json::sax_parse(text, &filter);
    return out;
  } catch (const json::exception& e) {
    return InvalidArgument(fmt::format("malformed JSON in {}: {}", what, e.what()));
  } catch (const std::bad_alloc&) {
    return PayloadTooLarge(fmt::format("{}: out of memory parsing {} bytes of JSON", what, text.size()));
  }
}

// The length of the longest prefix of `text` of at most `max_chars` bytes that does not end
// inside a UTF-8 sequence.
size_t CodePointCut(std::string_view text, size_t max_chars) {
  size_t cut = std::min(max_chars, text.size());
  while (cut > 0 && cut < text.size() && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;
  return cut;
}

}  // namespace

Result<json> ParseUntrustedJson(std::string_view text, std::string_view what, int max_depth) {
  return ParseBounded(text, what, max_depth, nullptr);
}

Result<json> ParseUntrustedObject(std::string_view text, std::string_view what,
                                  std::span<const std::string_view> fields, int max_depth) {
  WSYNC_ASSIGN_OR_RETURN(json j, ParseBounded(text, what, max_depth, &fields));
  if (!j.is_object()) return InvalidArgument(fmt::format("{} must be a JSON object", what));
  return j;
}

std::string JsonExcerpt(const json& v, size_t max_chars) {
  try {
    switch (v.type()) {
      case json::value_t::array:
        return fmt::format("a list of {} items", v.size());
      case json::value_t::object:
        return fmt::format("an object of {} fields", v.size());
      case json::value_t::string: {
        const std::string& s = v.get_ref<const std::string&>();
        if (s.size() <= max_chars) return json(s).dump(-1, ' ', false, json::error_handler_t::replace);
        std::string shown =
            json(s.substr(0, CodePointCut(s, max_chars))).dump(-1, ' ', false, json::error_handler_t::replace);
        shown.pop_back();  // the closing quote
        return fmt::format("{}...\" ({} bytes)", shown, s.size());
      }
      default:
        return v.dump(-1, ' ', false, json::error_handler_t::replace).substr(0, max_chars);
    }
  } catch (...) {
    return "(a value)";
  }
}

Result<std::string> BoundedStringField(const json& obj, const char* field, std::string_view where, size_t max_bytes,
                                       std::string_view fallback) {
  if (!obj.is_object()) return std::string(fallback);
  auto it = obj.find(field);
  if (it == obj.end() || it->is_null()) return std::string(fallback);
  if (!it->is_string()) {
    return InvalidArgument(fmt::format("{}: field '{}' must be a string, not {}", where, field, it->type_name()));
  }
  const std::string& s = it->get_ref<const std::string&>();
  if (s.size() > max_bytes) {
    return InvalidArgument(
        fmt::format("{}: field '{}' is {} bytes, over the limit of {}", where, field, s.size(), max_bytes));
  }
  return s;
}

std::string TextExcerpt(std::string_view text, size_t max_chars) {
  if (text.size() <= max_chars) return std::string(text);
  return fmt::format("{}... ({} bytes)", text.substr(0, CodePointCut(text, max_chars)), text.size());
}

}  // namespace wsync
