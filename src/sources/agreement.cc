#include "sources/agreement.h"

#include <algorithm>
#include <cstring>
#include <unordered_map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/digest.h"

namespace wsync {

std::string MetadataDigest(const std::vector<TensorMeta>& metadata) {
  auto h = Hasher::Create(DigestAlgorithm::kSha256);
  auto feed = [&](const std::string& s) { h->Update(std::as_bytes(std::span(s.data(), s.size()))); };
  feed(fmt::format("{}\n", metadata.size()));
  for (const TensorMeta& m : metadata) {
    feed(fmt::format("{} {} {}\n", m.name, SafetensorsName(m.dtype), ShapeString(m.shape)));
  }
  return h->FinishHex().substr(0, 16);
}

Status CheckRanksAgree(Communicator& comm, const std::vector<TensorMeta>& metadata,
                       const std::optional<std::vector<std::string>>& held,
                       const DescribeRank& describe, Deadline deadline) {
  const int n = comm.size(), me = comm.rank();
  auto name = [&](int r) { return DescribeRankOrDefault(describe, r); };
  const std::string digest = MetadataDigest(metadata);
  std::vector<std::byte> all(16 * n);
  WSYNC_RETURN_IF_ERROR(comm.AllGather(std::as_bytes(std::span(digest.data(), 16)), all, deadline)
                            .WithContext(fmt::format("metadata check on {}", name(me))));
  auto digest_of = [&](int r) { return std::string(reinterpret_cast<const char*>(all.data()) + 16 * r, 16); };
  std::vector<std::string> differ;
  for (int r = 1; r < n; ++r) {
    if (digest_of(r) != digest_of(0)) differ.push_back(fmt::format("{} has {}", name(r), digest_of(r)));
  }
  if (!differ.empty()) {
    return InvalidArgument(fmt::format(
        "trainer ranks disagree on the model: {} has metadata digest {} but {}; every rank's "
        "metadata() must describe the WHOLE model, in the same order",
        name(0), digest_of(0), fmt::join(differ, ", ")));
  }

  // Holder counts per name, plus one slot counting ranks that hold names outside the model.
  std::vector<int64_t> holders(metadata.size() + 1, 0);
  std::string unknown;
  if (!held) {
    std::fill(holders.begin(), holders.end() - 1, 1);
  } else {
    std::unordered_map<std::string_view, size_t> index;
    for (size_t i = 0; i < metadata.size(); ++i) index.emplace(metadata[i].name, i);
    for (const std::string& h : *held) {
      auto it = index.find(h);
      if (it == index.end()) {
        if (unknown.empty()) unknown = h;
        continue;
      }
      holders[it->second] = 1;
    }
    if (!unknown.empty() || held->empty()) holders.back() = 1;
  }
  WSYNC_RETURN_IF_ERROR(comm.AllReduceSum(std::span(holders), deadline)
                            .WithContext(fmt::format("held-name check on {}", name(me))));
  if (holders.back() != 0) {
    if (!unknown.empty()) {
      return InvalidArgument(fmt::format("{} holds {}, which is not in the model's metadata", name(me), unknown));
    }
    return InvalidArgument(fmt::format("{} trainer rank(s) hold an empty or unknown set of names", holders.back()));
  }
  std::vector<std::string> nobody;
  for (size_t i = 0; i < metadata.size(); ++i) {
    if (holders[i] == 0) nobody.push_back(metadata[i].name);
  }
  if (!nobody.empty()) {
    return InvalidArgument(fmt::format(
        "{} tensor(s) are held by no trainer rank: {}{}", nobody.size(),
        fmt::join(nobody.begin(), nobody.begin() + std::min<size_t>(nobody.size(), 5), ", "),
        nobody.size() > 5 ? ", ..." : ""));
  }
  return Status::Ok();
}

}  // namespace wsync
