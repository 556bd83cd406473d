// The NCCL communicator (GPU data plane), behind the same Communicator interface as Gloo.
//
// vLLM's UID rendezvous: the trainer mints the id (NewNcclUniqueId), ships it to every
// server as `nccl_unique_id_b64`, and every rank enters ConnectNccl concurrently; there is
// no store barrier. The communicator is non-blocking (ncclConfig.blocking = 0) so that
// every wait can be bounded: init, and each collective, are polled until done, failed, or
// past their deadline, and on expiry the communicator is aborted (ncclCommAbort) with an
// error that says what was waited for. After ConnectNccl, callers run the one-element
// float32 SUM all-reduce warm-up as vLLM does. Buffers passed to collectives are device
// pointers on options.device. Built only when CUDA and NCCL are found
// (WSYNC_WITH_NCCL); one caller thread at a time, which must be the thread that calls
// ConnectNccl or any thread after it sets the same device.
//
// PostPeerBatch enqueues one ncclGroupStart/ncclSend.../ncclRecv.../ncclGroupEnd on the
// communicator's stream and records an event after it; Wait() polls that event with the
// same deadline, async-error and abort handling as the collectives, and a timeout names
// every peer and tag of the batch. Posting blocks (up to op_timeout) while NCCL connects
// to a peer for the first time, which needs that peer to post its side. The messages of
// one batch progress together, but batches run one after another in posting order on
// the stream: two ranks that each post a send batch to the other before the matching
// receive batch wait for each other until the deadline. Empty messages are left out.
#pragma once

#include <chrono>
#include <memory>

#include "comm/communicator.h"
#include "comm/nccl_unique_id.h"
#include "core/deadline.h"
#include "wsync/status.h"

namespace wsync {

struct NcclOptions {
  NcclUniqueIdBytes unique_id{};
  int rank = 0;
  int size = 0;
  int device = 0;  // CUDA device ordinal
  // Broadcast() issues ncclBroadcast calls of at most this many bytes, so that a caller's
  // StreamHooks see the data in pieces; 0: one call per Broadcast(). Every rank of a group
  // must use the same value (the calls must match), which is why wsync peers agree on it
  // in init_info and vLLM peers (one call per chunk) get 0.
  size_t piece_bytes = 0;
  Deadline connect_deadline = Deadline::InSeconds(300);
  std::chrono::milliseconds op_timeout = std::chrono::seconds(300);
  DescribeRank describe_rank;
};

// ncclGetUniqueId; the trainer (rank 0) calls it once per group.
Result<NcclUniqueIdBytes> NewNcclUniqueId();

Result<std::unique_ptr<Communicator>> ConnectNccl(const NcclOptions& options);

// Number of visible CUDA devices; 0 when there is no driver or no GPU.
int CudaDeviceCount();

}  // namespace wsync
