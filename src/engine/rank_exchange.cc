#include "engine/rank_exchange.h"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

namespace wsync {

Result<std::vector<std::string>> AllGatherStrings(Communicator& comm, const std::string& mine, Deadline deadline) {
  const size_t n = static_cast<size_t>(comm.size());
  uint64_t length = mine.size();
  std::vector<uint64_t> lengths(n);
  WSYNC_RETURN_IF_ERROR(comm.AllGather(std::as_bytes(std::span(&length, 1)),
                                       std::as_writable_bytes(std::span(lengths)), deadline)
                            .WithContext("gathering message lengths from the trainer ranks"));
  const uint64_t width = *std::max_element(lengths.begin(), lengths.end());
  std::vector<std::byte> in(width), out(width * n);
  std::memcpy(in.data(), mine.data(), mine.size());
  if (width > 0) {
    WSYNC_RETURN_IF_ERROR(comm.AllGather(in, out, deadline)
                              .WithContext("gathering messages from the trainer ranks"));
  }
  std::vector<std::string> all(n);
  for (size_t r = 0; r < n; ++r) {
    all[r].assign(reinterpret_cast<const char*>(out.data() + r * width), lengths[r]);
  }
  return all;
}

Result<std::string> BroadcastString(Communicator& comm, const std::string& mine, int root, Deadline deadline) {
  uint64_t length = comm.rank() == root ? mine.size() : 0;
  WSYNC_RETURN_IF_ERROR(comm.Broadcast(std::as_writable_bytes(std::span(&length, 1)), root, deadline)
                            .WithContext(fmt::format("a message length from trainer rank {}", root)));
  std::string out = comm.rank() == root ? mine : std::string(length, '\0');
  if (length > 0) {
    WSYNC_RETURN_IF_ERROR(comm.Broadcast(std::as_writable_bytes(std::span(out.data(), out.size())), root, deadline)
                              .WithContext(fmt::format("a message from trainer rank {}", root)));
  }
  return out;
}

nlohmann::json StatusToJson(const Status& s) {
  return nlohmann::json{{"error", s.message()}, {"code", static_cast<int>(s.code())}};
}

Status StatusFromJson(const nlohmann::json& j, const std::string& who) {
  std::string message = j.value("error", std::string("unknown error"));
  auto code = static_cast<StatusCode>(j.value("code", static_cast<int>(StatusCode::kInternal)));
  return Status(code, who.empty() ? message : fmt::format("{}: {}", who, message));
}

Result<bool> AllRanksReady(Communicator& comm, const Status& mine, bool down, int self, Deadline deadline) {
  nlohmann::json j = mine.ok() ? nlohmann::json{{"down", down}} : StatusToJson(mine);
  WSYNC_ASSIGN_OR_RETURN(std::vector<std::string> all, AllGatherStrings(comm, j.dump(), deadline));
  bool any_down = false;
  for (size_t r = 0; r < all.size(); ++r) {
    nlohmann::json e = nlohmann::json::parse(all[r]);
    if (e.contains("error")) return StatusFromJson(e, static_cast<int>(r) == self ? "" : fmt::format("trainer rank {}", r));
    any_down = any_down || e["down"].get<bool>();
  }
  return !any_down;
}

}  // namespace wsync
