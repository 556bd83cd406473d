// Connect: the one entry that builds a Communicator, whichever transport moves the bytes.
//
// A CommSpec says how the group meets: through a rendezvous store (Gloo over TCP; host
// memory) or through an NCCL unique id (NCCL; device memory). Backends fill a spec from
// their init_info and call Connect(); only src/comm knows the concrete communicators and
// whether this build has NCCL. A transport not built in answers kUnimplemented naming it.
// Thread-safe; Connect() blocks until every rank joined or the spec's connect deadline.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "comm/communicator.h"
#include "core/deadline.h"
#include "wsync/status.h"

namespace wsync {

struct CommSpec {
  // Gloo: the rendezvous store every rank dials, and the key prefix unique to this group
  // and attempt.
  struct Store {
    std::string host = "127.0.0.1";
    int port = 0;
    std::string prefix;
    std::string bind_host = "127.0.0.1";  // where this rank listens for its peers
  };
  std::optional<Store> store;
  // NCCL: the group's unique id (base64 of ncclUniqueId, as init_info carries it) and
  // this rank's CUDA device; `piece_bytes` cuts each broadcast (0: one call per
  // broadcast; every rank must use the same value).
  std::optional<std::string> nccl_unique_id_b64;
  int device = 0;
  size_t piece_bytes = 0;

  int rank = 0;
  int size = 0;
  Deadline connect_deadline = Deadline::InSeconds(300);
  std::chrono::milliseconds op_timeout = std::chrono::seconds(300);
  DescribeRank describe_rank;
};

// Joins the group `spec` describes: Gloo when it names a store, NCCL when it names a
// unique id (exactly one of them).
Result<std::unique_ptr<Communicator>> Connect(const CommSpec& spec);

// A fresh NCCL unique id, base64-encoded, for a group whose rank 0 is this process.
// kUnimplemented when this build has no NCCL.
Result<std::string> NewNcclGroupId();

// Whether this build carries the NCCL transport.
bool HasNccl();

}  // namespace wsync
