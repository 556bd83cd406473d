// Communicator: the transport-neutral collective group that moves weight bytes.
//
// One Communicator is one rank's membership in a fixed group of `size()` ranks (a
// trainer sender plus every receiving worker). Backends and engines outside src/comm
// see only this interface; whether bytes move over Gloo (CPU, TCP) or NCCL (GPU) is
// decided by the factory that built it (ConnectGloo, ...), and `kind()` says which.
//
// Collectives are blocking and must be called by every rank in the same order with
// matching sizes; one collective runs at a time per communicator (calls from several
// threads are serialized). Each call blocks until it completes on this rank, fails, or
// `deadline` passes. Errors are values:
//   kDeadlineExceeded  a peer did not send or receive in time; the message names the
//                      operation, the byte count, this rank and the ranks waited for.
//   kUnavailable       a peer closed its connection or the transport failed.
//   kAborted           the communicator was aborted earlier (by a failure or Abort()).
//   kInvalidArgument   bad root or mismatched arguments detected locally.
// After any failure the communicator is aborted: its connections are closed so that
// peers fail fast too, and every later call returns kAborted at once. A new group is
// built to recover.
//
// Abort() is the one call that is safe from any thread at any time, including while a
// collective is in flight on another thread; it wakes that collective where the
// backend allows (Gloo broadcast: at once; all-reduce: at its timeout).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "core/deadline.h"
#include "wsync/status.h"
#include "wsync/trainer.h"

namespace wsync {

// Names a rank for error messages, e.g. "rank 3 (server http://127.0.0.1:8001 worker 1)".
// Called from whichever thread builds the error; must be thread-safe and cheap.
using DescribeRank = std::function<std::string(int rank)>;

// "rank N" when `describe` is empty, otherwise describe(rank).
std::string DescribeRankOrDefault(const DescribeRank& describe, int rank);

// A RankGroup (wsync/trainer.h) whose collectives a backend may run.
class Communicator : public RankGroup {
 public:
  ~Communicator() override = default;

  int rank() const override = 0;
  int size() const override = 0;
  // "gloo" or "nccl".
  virtual std::string_view kind() const = 0;

  // Root sends `data`; every other rank receives into `data` (same length on every
  // rank). Afterwards `data` is bit-identical on every rank. Blocks until done or
  // `deadline`. Any length works, including many GB.
  virtual Status Broadcast(std::span<std::byte> data, int root, Deadline deadline) = 0;

  // Lets a caller overlap its own work with a broadcast, piece by piece. On the root,
  // `before_send(end)` is called before bytes [0, end) go out and must return once they
  // are ready (or a Status to stop). On the other ranks, `on_received(end)` is called once
  // bytes [0, end) have arrived; it must not block. Both see `end` grow to data.size().
  struct StreamHooks {
    std::function<Status(size_t end)> before_send;
    std::function<void(size_t end)> on_received;
  };
  // Default: the whole buffer as one piece.
  virtual Status Broadcast(std::span<std::byte> data, int root, Deadline deadline,
                           const StreamHooks& hooks) {
    if (rank() == root && hooks.before_send) WSYNC_RETURN_IF_ERROR(hooks.before_send(data.size()));
    WSYNC_RETURN_IF_ERROR(Broadcast(data, root, deadline));
    if (rank() != root && hooks.on_received) hooks.on_received(data.size());
    return Status::Ok();
  }

  // Every rank contributes `in` (the same length on every rank); afterwards `out`, of
  // size() * in.size() bytes, holds rank r's bytes at [r * in.size(), (r+1) * in.size())
  // on every rank. `in` must not overlap `out`. Default: one Broadcast per rank, so any
  // implementation has it; backends override it with a native all-gather.
  virtual Status AllGather(std::span<const std::byte> in, std::span<std::byte> out,
                           Deadline deadline) {
    const size_t n = in.size();
    if (out.size() != n * static_cast<size_t>(size())) {
      return InvalidArgument("all-gather: output is not size() times the input");
    }
    if (n > 0) std::copy(in.begin(), in.end(), out.begin() + rank() * n);
    for (int r = 0; r < size() && n > 0; ++r) {
      WSYNC_RETURN_IF_ERROR(Broadcast(out.subspan(r * n, n), r, deadline));
    }
    return Status::Ok();
  }

  // Point to point. One message of a batch: bytes sent to `peer` or received from it.
  // A send and a receive match when they name each other's rank and the same tag; equal
  // tags between one pair of ranks match in posting order. (NCCL has no tags: between one
  // pair, messages match in posting order alone, so both sides post them in the same
  // order; its tags only name messages in errors.) A receive's length must equal its
  // send's (Gloo: a send of another length never matches, and the wait fails at its
  // deadline; NCCL: undefined). An empty message moves nothing and always completes.
  // `data` must stay valid (and a send's unchanged) until the batch's Wait() returns or
  // the batch is destroyed. Gloo takes host memory; NCCL device memory on its device.
  struct PeerMessage {
    int peer = 0;
    uint32_t tag = 0;
    std::span<std::byte> data;
  };
  // A batch of sends and receives in flight. One thread at a time calls Wait(); a batch
  // must be destroyed before its communicator.
  class PeerBatch {
   public:
    // A batch destroyed with messages unfinished (before Wait() returned Ok) aborts the
    // communicator: those messages would leave their peers waiting.
    virtual ~PeerBatch() = default;
    // Waits for every message of the batch, each wait bounded by `deadline` (and by the
    // transport's op timeout). Errors, which name the peer and tag waited for:
    //   kDeadlineExceeded  a peer did not send or receive in time;
    //   kUnavailable       a peer's connection failed (it died or aborted);
    //   kAborted           the communicator was aborted, by Abort() from any thread (which
    //                      wakes this wait at once) or by another failed call.
    // After any failure the communicator is aborted (the contract above). A second call
    // returns the first call's result.
    virtual Status Wait(Deadline deadline) = 0;
  };
  // Posts every send and receive of a batch at once and returns while they are in
  // flight, so that a rank may prepare its next batch meanwhile; several batches may be
  // in flight (Gloo: posted and waited from several threads, beside collectives; NCCL:
  // from its one caller thread, as its collectives). Unlike a collective, only the two
  // ranks of a message take part in it. kInvalidArgument when a peer is this rank or
  // outside the group (nothing is posted then); kAborted once the communicator is
  // aborted. Default: Unimplemented (a transport without point to point).
  virtual Result<std::unique_ptr<PeerBatch>> PostPeerBatch(std::span<const PeerMessage> sends,
                                                           std::span<const PeerMessage> receives) {
    return Unimplemented(fmt::format("{} communicator has no point-to-point transfers", kind()));
  }
  // PostPeerBatch, then Wait.
  Status ExchangePeers(std::span<const PeerMessage> sends, std::span<const PeerMessage> receives,
                       Deadline deadline) {
    WSYNC_ASSIGN_OR_RETURN(std::unique_ptr<PeerBatch> batch, PostPeerBatch(sends, receives));
    return batch->Wait(deadline);
  }

  // Element-wise sum over all ranks, in place; every rank ends with the same values.
  virtual Status AllReduceSum(std::span<int64_t> data, Deadline deadline) = 0;
  virtual Status AllReduceSum(std::span<float> data, Deadline deadline) = 0;

  // Marks the communicator unusable and closes its connections; later calls return
  // kAborted fast. Idempotent; callable from any thread.
  virtual void Abort() = 0;
  virtual bool aborted() const = 0;
};

}  // namespace wsync
