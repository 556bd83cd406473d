#include "control/fleet.h"

#include <fmt/format.h>

#include "control/init_payloads.h"
#include "core/json_int.h"

namespace wsync {

using nlohmann::json;

Result<std::vector<int>> ServerWorldSizes(const FanOutClient& client, Deadline deadline) {
  WSYNC_ASSIGN_OR_RETURN(std::vector<json> sizes, client.Get("/get_world_size?include_dp=true", deadline));
  std::vector<int> per_server;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (!sizes[i].is_object() || !sizes[i].contains("world_size")) {
      return Internal(fmt::format("{}: /get_world_size answered {}", client.urls()[i],
                                  sizes[i].dump(-1, ' ', true, json::error_handler_t::replace).substr(0, 200)));
    }
    // Exact: a reply of 4294967298 is not 2.
    Result<int64_t> size = JsonIntInRange(sizes[i]["world_size"], fmt::format("{}: /get_world_size world_size",
                                                                                client.urls()[i]),
                                          1, kMaxBroadcastWorldSize);
    if (!size.ok()) return Internal(size.status().message());
    per_server.push_back(static_cast<int>(*size));
  }
  return per_server;
}

Result<std::vector<json>> FleetHealth(const FanOutClient& client, Deadline deadline) {
  return client.Get("/health", deadline);
}

bool WsyncServers(const FanOutClient& client, const std::vector<json>& health, std::string* other) {
  for (size_t i = 0; i < health.size(); ++i) {
    if (!health[i].is_object() || health[i].value("server", "") != "wsync") {
      if (other != nullptr) *other = client.urls()[i];
      return false;
    }
  }
  return true;
}

std::vector<std::string> WorkerLabels(const FanOutClient& client, int count,
                                      const std::vector<int>& offsets, Deadline deadline) {
  Result<std::vector<json>> health = FleetHealth(client, deadline);
  return WorkerLabels(client, health.ok() ? *health : std::vector<json>(client.urls().size()), count, offsets);
}

std::vector<std::string> WorkerLabels(const FanOutClient& client, const std::vector<json>& health, int count,
                                      const std::vector<int>& offsets) {
  std::vector<std::string> labels(count);
  for (size_t i = 0; i < offsets.size() && i < client.urls().size(); ++i) {
    const std::string& url = client.urls()[i];
    json h = i < health.size() && health[i].is_object() ? health[i] : json::object();
    int tp = h.value("tp", 0), dp = h.value("dp", 0), dp_rank = h.value("dp_rank", -1);
    if (tp <= 0 || dp <= 0) {
      for (int r = offsets[i]; r < count; ++r) {
        if (labels[r].empty()) labels[r] = fmt::format("a worker of {} or a later server", url);
      }
      continue;
    }
    int first = dp_rank < 0 ? 0 : dp_rank, end = dp_rank < 0 ? dp : dp_rank + 1;
    for (int d = first; d < end; ++d) {
      for (int t = 0; t < tp; ++t) {
        int r = offsets[i] + d * tp + t;
        if (r >= 0 && r < count) labels[r] = fmt::format("{} worker dp{}/tp{}", url, d, t);
      }
    }
  }
  return labels;
}

}  // namespace wsync
