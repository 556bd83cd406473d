// Names the inference workers of a fleet for error messages, from each server's /health
// (wsync servers report tp, dp and dp_rank there): label[i] is "URL worker dpD/tpT" for
// the worker whose global index is offsets[server] + D * TP + T. Entries of servers that
// do not report a layout (other servers) get a vaguer name; entries no server covers stay
// empty. One GET /health per server, bounded by the deadline.
#pragma once

#include <string>
#include <vector>

#include "control/client.h"
#include "core/deadline.h"

namespace wsync {

std::vector<std::string> WorkerLabels(const FanOutClient& client, int count,
                                      const std::vector<int>& offsets, Deadline deadline);

}  // namespace wsync
