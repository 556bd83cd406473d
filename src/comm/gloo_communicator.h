// Gloo communicator: the CPU data plane, collectives over Gloo's TCP transport.
//
// ConnectGloo() joins one rank to a group through the HTTP rendezvous store
// (src/comm/store.h): it publishes this rank's pair addresses under `prefix`, waits
// for every other rank's, and opens one TCP connection per peer. It blocks until the
// whole group is connected or `connect_deadline` passes; on expiry the error names the
// ranks that never published their address ("rank 2 (server ... worker 1) never
// joined"). Every rank of the group must call it with the same store, prefix and size.
//
// The returned Communicator owns its own Gloo device (one I/O thread) and context, so
// many may live in one process (a server hosting several worker ranks, each on its
// own thread). Its collectives follow the Communicator contract (communicator.h).
//
// Broadcast moves the buffer in `chunk_bytes` pieces down a tree (chain or binomial,
// see GlooBroadcastAlgorithm): a rank forwards piece k to its children as soon as it
// has it, so relays overlap with receives, any length works (Gloo's per-message
// counts stay small), and a concurrent Abort() wakes the waiting rank at once. Each
// wait for a peer's next piece is bounded by min(op_timeout, deadline): op_timeout is
// the longest a rank waits without progress, the deadline bounds the whole call.
//
// PostPeerBatch posts Gloo unbound-buffer sends and receives, each message in pieces of
// at most 64 MiB on a slot made of its tag and its length, and returns at once; Wait()
// waits piece by piece, each wait bounded the same way. Posting takes the lock that a
// collective holds for its whole run (it waits for one in flight on another thread);
// Wait() takes none, so a rank may wait on one batch while it posts the next.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

#include "comm/communicator.h"
#include "core/deadline.h"
#include "wsync/status.h"

namespace wsync {

enum class GlooBroadcastAlgorithm {
  // root -> 1 -> 2 -> ... : every link carries the data once, so the root's egress
  // does not grow with the group; best across hosts and for large groups.
  kChain,
  // Binomial tree over chunks: the root sends to log2(size) ranks in parallel.
  kBinomial,
  // gloo::broadcast itself, unchunked and unpipelined: a baseline for benchmarks.
  // Buffers over 1 GiB go in 1 GiB calls; a concurrent Abort() waits for the timeout.
  kGlooBaseline,
};

struct GlooOptions {
  // Rendezvous store (a StoreServer) reachable from every rank.
  std::string store_host = "127.0.0.1";
  int store_port = 0;
  // Key prefix unique to this group and attempt, e.g. "sync-7f3a/gloo/1". Required. A
  // group rebuilt after a failure needs a fresh prefix: under a reused one, ranks would
  // read the dead group's addresses.
  std::string prefix;
  // This rank and the group size (0 <= rank < size).
  int rank = 0;
  int size = 0;
  // Local address the TCP transport listens on; must be reachable by every peer
  // (use the host's LAN address across hosts). Each peer pair uses an ephemeral port.
  std::string bind_host = "127.0.0.1";
  // When ConnectGloo gives up waiting for the other ranks.
  Deadline connect_deadline = Deadline::InSeconds(60);
  // Longest a collective waits for a peer's next piece of data (see above). Lower
  // detects a dead peer sooner; too low fails slow-but-alive peers.
  std::chrono::milliseconds op_timeout = std::chrono::seconds(120);
  // Broadcast piece size in bytes. Smaller pieces start relays sooner; each piece
  // costs one small control message per link. 4 MiB amortizes that on loopback.
  size_t chunk_bytes = size_t{4} << 20;
  GlooBroadcastAlgorithm algorithm = GlooBroadcastAlgorithm::kChain;
  // Names ranks in errors; empty means "rank N".
  DescribeRank describe_rank;
};

// Joins the group described by `options`. kInvalidArgument for bad options;
// kDeadlineExceeded naming the absent ranks when the group did not form in time;
// kUnavailable when the store or a peer could not be reached.
Result<std::unique_ptr<Communicator>> ConnectGloo(const GlooOptions& options);

}  // namespace wsync
