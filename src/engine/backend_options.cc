#include "engine/backend_options.h"

#include <algorithm>
#include <charconv>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace wsync {
namespace {

template <typename T>
Status Parse(std::string_view backend, std::string_view key, const std::string& text, T* out) {
  T v{};
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size()) {
    return InvalidArgument(fmt::format("{} option {}={}: not a number", backend, key, text));
  }
  *out = v;
  return Status::Ok();
}

Status UnknownOption(std::string_view backend, std::string_view key, const std::vector<std::string>& known) {
  return InvalidArgument(fmt::format("backend '{}' has no option '{}' (its options: {})", backend, key,
                                     known.empty() ? std::string("none") : fmt::format("{}", fmt::join(known, ", "))));
}

}  // namespace

Status CheckBackendOptionKeys(std::string_view backend, std::span<const BackendOptionSpec> schema,
                              const std::vector<std::string>& keys) {
  for (const std::string& key : keys) {
    bool found = std::any_of(schema.begin(), schema.end(), [&](const BackendOptionSpec& o) { return o.key == key; });
    if (found) continue;
    std::vector<std::string> known;
    for (const BackendOptionSpec& o : schema) {
      if (!o.hidden) known.emplace_back(o.key);
    }
    return UnknownOption(backend, key, known);
  }
  return Status::Ok();
}

Status CheckBackendOptionKeys(std::string_view backend, std::span<const BackendOptionSpec> schema,
                              const std::map<std::string, std::string>& values) {
  std::vector<std::string> keys;
  for (const auto& [key, _] : values) keys.push_back(key);
  return CheckBackendOptionKeys(backend, schema, keys);
}

BackendOptions::BackendOptions(std::string_view backend, const std::map<std::string, std::string>& values)
    : backend_(backend), values_(values) {}

const std::string* BackendOptions::Find(std::string_view key) {
  known_.emplace_back(key);
  auto it = values_.find(std::string(key));
  return it == values_.end() ? nullptr : &it->second;
}

Status BackendOptions::Read(std::string_view key, std::string* out) {
  if (const std::string* v = Find(key)) *out = *v;
  return Status::Ok();
}

Status BackendOptions::Read(std::string_view key, int64_t* out) {
  const std::string* v = Find(key);
  return v == nullptr ? Status::Ok() : Parse(backend_, key, *v, out);
}

Status BackendOptions::Read(std::string_view key, size_t* out) {
  const std::string* v = Find(key);
  return v == nullptr ? Status::Ok() : Parse(backend_, key, *v, out);
}

Status BackendOptions::Read(std::string_view key, double* out) {
  const std::string* v = Find(key);
  return v == nullptr ? Status::Ok() : Parse(backend_, key, *v, out);
}

Status BackendOptions::ReadChoice(std::string_view key, const std::vector<std::string_view>& choices, int* out) {
  const std::string* v = Find(key);
  if (v == nullptr) return Status::Ok();
  for (size_t i = 0; i < choices.size(); ++i) {
    if (*v == choices[i]) {
      *out = static_cast<int>(i);
      return Status::Ok();
    }
  }
  return InvalidArgument(fmt::format("{} option {}={}: not one of {}", backend_, key, *v, fmt::join(choices, ", ")));
}

Status BackendOptions::Finish() const {
  for (const auto& [key, value] : values_) {
    if (std::find(known_.begin(), known_.end(), key) == known_.end()) return UnknownOption(backend_, key, known_);
  }
  return Status::Ok();
}

}  // namespace wsync
