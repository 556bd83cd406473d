// What the receiving halves of the backends that join a trainer's communicator (nccl,
// sharded) share: which rendezvous a server may join, and waiting for every worker's
// join. Pure functions over the server's context; thread-safe.
#pragma once

#include <future>
#include <string>
#include <string_view>
#include <vector>

#include "engine/backend_options.h"
#include "receiver/backend.h"
#include "wsync/status.h"

namespace wsync {

// The numeric address to dial for a Gloo rendezvous store that the control-plane peer at
// `peer_address` names `host`: AdmitStoreHost (comm/store_address.h) with the hosts this
// server's flags allow (backend_config "allowed_store_hosts").
Result<std::string> AdmitGlooStore(const ReceiverContext& ctx, std::string_view host, std::string_view peer_address);

// OK when every worker can join an NCCL group: each on a CUDA device, in a build with
// NCCL. Unimplemented naming the first worker on cpu, or the missing NCCL, otherwise.
Status CheckNcclWorkers(const ReceiverContext& ctx);

// The backend_config keys these backends' receivers take: "allowed_store_hosts" (read by
// AdmitGlooStore) and the tests' hidden "fault" (die-mid-update).
std::vector<BackendOptionSpec> GroupReceiverOptions();

// Waits for every worker's task and returns the first failure, in worker order.
Status JoinAll(std::vector<std::future<Status>>& futures);

}  // namespace wsync
