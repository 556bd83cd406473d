#include "sources/groups.h"

#include <map>
#include <optional>
#include <string_view>

#include <fmt/format.h>

namespace wsync {
namespace {

struct StackKey {
  std::string prefix;  // path up to the index, e.g. "model.layers"
  int64_t index = 0;
};

// The first all-digit path segment, or nullopt.
std::optional<StackKey> StackOf(std::string_view name) {
  size_t start = 0;
  while (start <= name.size()) {
    size_t dot = name.find('.', start);
    if (dot == std::string_view::npos) dot = name.size();
    std::string_view seg = name.substr(start, dot - start);
    if (!seg.empty() && seg.size() < 18 && seg.find_first_not_of("0123456789") == std::string_view::npos) {
      return StackKey{std::string(name.substr(0, start == 0 ? 0 : start - 1)), std::stoll(std::string(seg))};
    }
    start = dot + 1;
  }
  return std::nullopt;
}

std::string KeyOf(const StackKey& k) {
  return k.prefix.empty() ? std::to_string(k.index) : fmt::format("{}.{}", k.prefix, k.index);
}

}  // namespace

Result<std::vector<LayerGroup>> LayerGroups(const std::vector<std::string>& names) {
  // Bucket every name, then lay the buckets out in canonical order.
  std::vector<std::string> pre, post;
  std::vector<std::string> prefixes;                                      // first appearance
  std::map<std::string, std::map<int64_t, std::vector<std::string>>> stacks;
  bool seen_indexed = false;
  for (const std::string& n : names) {
    if (n.empty()) return InvalidArgument("layer groups: a tensor name is empty");
    auto k = StackOf(n);
    if (!k) {
      (seen_indexed ? post : pre).push_back(n);
      continue;
    }
    seen_indexed = true;
    if (!stacks.contains(k->prefix)) prefixes.push_back(k->prefix);
    stacks[k->prefix][k->index].push_back(n);
  }
  std::vector<LayerGroup> groups;
  std::vector<const std::string*> flat;
  flat.reserve(names.size());
  auto add = [&](std::string key, const std::vector<std::string>& members) {
    if (members.empty()) return;
    groups.push_back(LayerGroup{std::move(key), flat.size(), flat.size() + members.size()});
    for (const std::string& m : members) flat.push_back(&m);
  };
  add("pre", pre);
  for (const std::string& p : prefixes) {
    for (const auto& [index, members] : stacks[p]) add(KeyOf(StackKey{p, index}), members);
  }
  add("post", post);
  for (size_t i = 0; i < names.size(); ++i) {
    if (*flat[i] == names[i]) continue;
    // Name the group that should hold position i and the name found there instead.
    size_t g = 0;
    while (groups[g].end <= i) ++g;
    return InvalidArgument(fmt::format(
        "metadata order is not group-contiguous: position {} holds {}, but group '{}' "
        "(positions {}..{}) expects {} there; order tensors pre group, then layer by layer, "
        "then post group",
        i, names[i], groups[g].key, groups[g].begin, groups[g].end - 1, *flat[i]));
  }
  return groups;
}

}  // namespace wsync
