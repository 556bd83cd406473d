// How a `sharded` worker receives its plan: in LANES, one per trainer rank it pulls from
// (each pipeline stage's ranks are lanes of their own), every lane at once.
//
// A worker's plan (plan/sharded_plan.h) lists its chunks in group order, and a pipeline
// stage holds a contiguous run of groups; received in that order, the stages take turns.
// With concurrent lanes each lane keeps its own ring of receive buffers posted ahead, one
// waiter thread per lane waits for its chunks in the lane's order (a producer sends a
// pair's chunks in plan order, which NCCL's posting-order matching needs), and the
// calling (worker) thread lands chunks in the order they arrive, then posts the lane's
// next receive into the freed buffer. A lane never waits on another lane, so the order
// stays deadlock-free whatever the producers' relative speed; landing stays on one
// thread, one call at a time per sink (model/worker_sink.h).
//
// Sequential receiving is the one-lane case: every chunk in plan order through one ring,
// on the calling thread alone (the order NCCL's single stream needs).
//
// Staging per worker: each lane's ring holds min(ring, its chunks) buffers of its largest
// chunk; ReceiveStagingBytes computes it from the plan alone, so the trainer and the bench
// report the same figure the receiver allocates. A staging budget merges lanes of
// neighbouring ranks until it fits (SplitLanesWithin).
//
// Every wait takes the caller's deadline. The first failure (a lane's receive, a landing,
// the deadline) aborts the communicator, which ends every other lane's wait at once, and
// is returned naming the chunk and its producer.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "backends/nccl/staging.h"
#include "comm/communicator.h"
#include "plan/sharded_plan.h"
#include "wsync/status.h"

namespace wsync {

// One lane: the plan indices of its chunks, in plan order, and its receive ring.
struct ReceiveLane {
  int producer = -1;                 // its first producer; -1: the one lane of every producer
  std::vector<size_t> chunks;        // indices into ConsumerPlan::chunks, ascending
  std::vector<StagingBuffer> ring;   // min(ring size, chunks) buffers of max_chunk bytes
  size_t max_chunk = 0;
};

// The plan's lanes: one per producer (ascending) when `concurrent`, else one lane of every
// chunk. Buffers are not reserved.
std::vector<ReceiveLane> SplitLanes(const ConsumerPlan& plan, bool concurrent);

// Concurrent lanes whose staging with `ring` buffers each fits `budget` bytes: the most
// lanes K (at most one per producer) that fit, producers in ascending order cut into K
// contiguous runs (a pipeline stage's ranks are consecutive, so runs keep stages apart),
// each lane's chunks in plan order. Any such partition stays deadlock-free: every lane
// waits in plan order, as the single lane does. One lane when even two do not fit;
// budget 0: no bound.
std::vector<ReceiveLane> SplitLanesWithin(const ConsumerPlan& plan, int ring, size_t budget);

// The receive staging these lanes need with `ring` buffers per lane, in bytes.
size_t ReceiveStagingBytes(const std::vector<ReceiveLane>& lanes, int ring);

// Reserves every lane's ring (`ring` buffers at most) on `device`.
Status ReserveLanes(std::vector<ReceiveLane>& lanes, int ring, const Device& device);

// Lands chunk `k` of the plan from `bytes`; called on the thread that runs ReceiveLanes.
using LandChunk = std::function<Status(size_t k, std::span<const std::byte> bytes)>;
// Names chunk `k` in errors: "chunk 3/14 of group 2 (...) from trainer rank 1 (...)".
using NameChunk = std::function<std::string(size_t k)>;

// Receives every chunk of `plan` over `comm` through `lanes` (one lane: sequentially on
// this thread; several: concurrently, one waiter thread per lane) and lands each with
// `land`. On failure the communicator is aborted before this returns.
Status ReceiveLanes(Communicator& comm, const ConsumerPlan& plan, std::vector<ReceiveLane>& lanes,
                    const LandChunk& land, const NameChunk& name, Deadline deadline);

}  // namespace wsync
