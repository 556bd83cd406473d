// What a trainer learns about its fleet of servers before it builds a data plane.
//
// ServerWorldSizes: every server's GET /get_world_size?include_dp=true.
// WsyncServers: whether every server is a wsync server (its GET /health JSON says
// "server": "wsync"); a trainer speaks wsync's protocol extensions only to those, and
// plain vLLM to any other fleet.
// ServerTimeout: the bound a trainer hands the servers, a little under its own, so that a
// server left waiting answers with its account before the trainer's wait ends.
// WorkerLabels names the inference workers of a fleet for error messages, from each server's /health
// (wsync servers report tp, dp and dp_rank there): label[i] is "URL worker dpD/tpT" for
// the worker whose global index is offsets[server] + D * TP + T. Entries of servers that
// do not report a layout (other servers) get a vaguer name; entries no server covers stay
// empty. One GET /health per server, bounded by the deadline.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "control/client.h"
#include "core/deadline.h"

namespace wsync {

Result<std::vector<int>> ServerWorldSizes(const FanOutClient& client, Deadline deadline);

// Every server's GET /health body, in server order (an unreachable server is the error).
Result<std::vector<nlohmann::json>> FleetHealth(const FanOutClient& client, Deadline deadline);

// True when every /health body in `health` (FleetHealth) is a wsync server's; otherwise
// false, with the first other server's URL in `other` (when given).
bool WsyncServers(const FanOutClient& client, const std::vector<nlohmann::json>& health,
                  std::string* other = nullptr);

inline double ServerTimeout(double trainer_timeout_seconds) {
  return std::max(0.5, trainer_timeout_seconds * 0.9 - 0.25);
}

std::vector<std::string> WorkerLabels(const FanOutClient& client, int count,
                                      const std::vector<int>& offsets, Deadline deadline);
// The same from /health bodies already fetched (FleetHealth).
std::vector<std::string> WorkerLabels(const FanOutClient& client, const std::vector<nlohmann::json>& health,
                                      int count, const std::vector<int>& offsets);

}  // namespace wsync
