#include "backends/sharded/lanes.h"

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include <fmt/format.h>

namespace wsync {

std::vector<ReceiveLane> SplitLanes(const ConsumerPlan& plan, bool concurrent) {
  std::vector<ReceiveLane> lanes;
  if (!concurrent) {
    ReceiveLane all;
    for (size_t k = 0; k < plan.chunks.size(); ++k) all.chunks.push_back(k);
    all.max_chunk = plan.max_chunk_bytes();
    lanes.push_back(std::move(all));
    return lanes;
  }
  std::map<int, size_t> of_producer;
  for (size_t k = 0; k < plan.chunks.size(); ++k) {
    const PlanChunk& c = plan.chunks[k];
    auto [it, added] = of_producer.try_emplace(c.producer, 0);
    if (added) {
      lanes.push_back(ReceiveLane{c.producer, {}, {}, 0});
      it->second = lanes.size() - 1;
    }
    ReceiveLane& lane = lanes[it->second];
    lane.chunks.push_back(k);
    lane.max_chunk = std::max(lane.max_chunk, c.bytes);
  }
  std::sort(lanes.begin(), lanes.end(), [](const ReceiveLane& a, const ReceiveLane& b) { return a.producer < b.producer; });
  return lanes;
}

std::vector<ReceiveLane> SplitLanesWithin(const ConsumerPlan& plan, int ring, size_t budget) {
  std::vector<ReceiveLane> per_producer = SplitLanes(plan, true);
  const size_t n = per_producer.size();
  if (budget == 0 || n <= 1 || ReceiveStagingBytes(per_producer, ring) <= budget) return per_producer;
  for (size_t k = n - 1; k >= 2; --k) {
    std::vector<ReceiveLane> merged(k);
    for (size_t i = 0; i < n; ++i) {
      ReceiveLane& to = merged[i * k / n];
      const ReceiveLane& from = per_producer[i];
      to.producer = to.chunks.empty() ? from.producer : to.producer;
      to.chunks.insert(to.chunks.end(), from.chunks.begin(), from.chunks.end());
      to.max_chunk = std::max(to.max_chunk, from.max_chunk);
    }
    for (ReceiveLane& lane : merged) std::sort(lane.chunks.begin(), lane.chunks.end());
    if (ReceiveStagingBytes(merged, ring) <= budget) return merged;
  }
  return SplitLanes(plan, false);
}

size_t ReceiveStagingBytes(const std::vector<ReceiveLane>& lanes, int ring) {
  size_t bytes = 0;
  for (const ReceiveLane& lane : lanes) {
    bytes += std::min(lane.chunks.size(), static_cast<size_t>(std::max(1, ring))) * lane.max_chunk;
  }
  return bytes;
}

Status ReserveLanes(std::vector<ReceiveLane>& lanes, int ring, const Device& device) {
  for (ReceiveLane& lane : lanes) {
    lane.ring.resize(std::min(lane.chunks.size(), static_cast<size_t>(std::max(1, ring))));
    if (lane.max_chunk == 0) continue;  // nothing to receive from this producer
    for (StagingBuffer& b : lane.ring) WSYNC_RETURN_IF_ERROR(b.Reserve(device, lane.max_chunk));
  }
  return Status::Ok();
}

namespace {

using Batch = std::unique_ptr<Communicator::PeerBatch>;

constexpr double kLaneReportGraceSeconds = 5;
constexpr double kLaneCauseGraceSeconds = 1;

Result<Batch> Post(Communicator& comm, const ConsumerPlan& plan, const ReceiveLane& lane, size_t j,
                   const NameChunk& name) {
  const size_t k = lane.chunks[j];
  const PlanChunk& c = plan.chunks[k];
  Communicator::PeerMessage m{c.producer, static_cast<uint32_t>(k), lane.ring[j % lane.ring.size()].span(c.bytes)};
  Result<Batch> batch = comm.PostPeerBatch({}, std::span(&m, 1));
  if (!batch.ok()) return batch.status().WithContext("posting " + name(k));
  return batch;
}

// The one-lane order: post `ring` ahead, wait, land, post the next into the freed buffer.
Status ReceiveInOrder(Communicator& comm, const ConsumerPlan& plan, ReceiveLane& lane, const LandChunk& land,
                      const NameChunk& name, Deadline deadline) {
  const size_t n = lane.chunks.size(), ring = lane.ring.size();
  std::vector<Batch> posted(ring);
  for (size_t j = 0; j < std::min(n, ring); ++j) {
    WSYNC_ASSIGN_OR_RETURN(posted[j], Post(comm, plan, lane, j, name));
  }
  for (size_t j = 0; j < n; ++j) {
    const size_t k = lane.chunks[j];
    Status s = posted[j % ring]->Wait(deadline);
    posted[j % ring].reset();
    if (!s.ok()) return s.WithContext("receiving " + name(k));
    WSYNC_RETURN_IF_ERROR(land(k, lane.ring[j % ring].span(plan.chunks[k].bytes)));
    if (j + ring < n) {
      WSYNC_ASSIGN_OR_RETURN(posted[j % ring], Post(comm, plan, lane, j + ring, name));
    }
  }
  return Status::Ok();
}

// The lanes' shared state: what each waiter may wait for next, and what arrived.
struct Board {
  struct Arrived {
    size_t lane = 0;
    size_t j = 0;  // position in the lane
    Status status;
  };
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::vector<Batch>> posted;  // GUARDED_BY(mu): [lane][slot]
  std::vector<size_t> posted_count;        // GUARDED_BY(mu): receives posted per lane
  std::deque<Arrived> arrived;             // GUARDED_BY(mu)
  bool stop = false;                       // GUARDED_BY(mu)
};

// Waits for lane `l`'s chunks in its order and reports each; stops at the first failure.
void WaitLane(Board& board, const ReceiveLane& lane, size_t l, Deadline deadline) {
  const size_t ring = lane.ring.size();
  for (size_t j = 0; j < lane.chunks.size(); ++j) {
    Batch batch;
    {
      std::unique_lock lock(board.mu);
      while (!board.stop && board.posted_count[l] <= j && !deadline.expired()) {
        board.cv.wait_for(lock, std::min<std::chrono::milliseconds>(deadline.remaining(), std::chrono::seconds(1)));
      }
      if (board.stop) return;
      if (board.posted_count[l] <= j) {
        board.arrived.push_back({l, j, DeadlineExceeded("the worker did not free a receive buffer in time")});
        board.cv.notify_all();
        return;
      }
      batch = std::move(board.posted[l][j % ring]);
    }
    Status s = batch->Wait(deadline);
    batch.reset();
    std::lock_guard lock(board.mu);
    board.arrived.push_back({l, j, s});
    board.cv.notify_all();
    if (!s.ok()) return;
  }
}

// The error a failed arrival stands for. A failure on one pair aborts the communicator,
// so the other lanes' waits end as kAborted too, and one of those may arrive first: an
// aborted lane waits briefly for another lane's failure of its own and names that.
Status Cause(Board& board, const std::vector<ReceiveLane>& lanes, const Board::Arrived& first, const NameChunk& name) {
  auto describe = [&](const Board::Arrived& a) {
    return a.status.WithContext("receiving " + name(lanes[a.lane].chunks[a.j]));
  };
  if (first.status.code() != StatusCode::kAborted) return describe(first);
  const Deadline grace = Deadline::InSeconds(kLaneCauseGraceSeconds);
  std::unique_lock lock(board.mu);
  for (;;) {
    for (const Board::Arrived& a : board.arrived) {
      if (!a.status.ok() && a.status.code() != StatusCode::kAborted) return describe(a);
    }
    if (grace.expired()) return describe(first);
    board.cv.wait_for(lock, grace.remaining());
  }
}

Status ReceiveConcurrently(Communicator& comm, const ConsumerPlan& plan, std::vector<ReceiveLane>& lanes,
                           const LandChunk& land, const NameChunk& name, Deadline deadline) {
  Board board;
  board.posted.resize(lanes.size());
  board.posted_count.assign(lanes.size(), 0);
  size_t total = 0;
  for (size_t l = 0; l < lanes.size(); ++l) {
    ReceiveLane& lane = lanes[l];
    total += lane.chunks.size();
    board.posted[l].resize(lane.ring.size());
    for (size_t j = 0; j < std::min(lane.chunks.size(), lane.ring.size()); ++j) {
      WSYNC_ASSIGN_OR_RETURN(board.posted[l][j], Post(comm, plan, lane, j, name));
      board.posted_count[l] = j + 1;
    }
  }
  std::vector<std::thread> waiters;
  for (size_t l = 0; l < lanes.size(); ++l) {
    waiters.emplace_back([&board, &lane = lanes[l], l, deadline] { WaitLane(board, lane, l, deadline); });
  }
  // A waiter reports its lane's failure at `deadline` at the latest; this side waits a
  // little longer so that the lane's own error, which names the chunk, is the one returned.
  const Deadline reports = Deadline::InSeconds(deadline.remaining_seconds() + kLaneReportGraceSeconds);
  auto landed_all = [&]() -> Status {
    for (size_t done = 0; done < total; ++done) {
      Board::Arrived a;
      {
        std::unique_lock lock(board.mu);
        while (board.arrived.empty() && !reports.expired()) {
          board.cv.wait_for(lock, std::min<std::chrono::milliseconds>(reports.remaining(), std::chrono::seconds(1)));
        }
        if (board.arrived.empty()) {
          return DeadlineExceeded(fmt::format("{} of {} chunks arrived before the deadline", done, total));
        }
        a = std::move(board.arrived.front());
        board.arrived.pop_front();
      }
      ReceiveLane& lane = lanes[a.lane];
      const size_t k = lane.chunks[a.j], ring = lane.ring.size();
      if (!a.status.ok()) return Cause(board, lanes, a, name);
      WSYNC_RETURN_IF_ERROR(land(k, lane.ring[a.j % ring].span(plan.chunks[k].bytes)));
      if (a.j + ring < lane.chunks.size()) {
        WSYNC_ASSIGN_OR_RETURN(Batch next, Post(comm, plan, lane, a.j + ring, name));
        std::lock_guard lock(board.mu);
        board.posted[a.lane][a.j % ring] = std::move(next);
        board.posted_count[a.lane] = a.j + ring + 1;
        board.cv.notify_all();
      }
    }
    return Status::Ok();
  };
  Status s = landed_all();
  if (!s.ok()) comm.Abort();  // ends every lane's wait now
  {
    std::lock_guard lock(board.mu);
    board.stop = true;
    board.cv.notify_all();
  }
  for (std::thread& t : waiters) t.join();
  return s;
}

}  // namespace

Status ReceiveLanes(Communicator& comm, const ConsumerPlan& plan, std::vector<ReceiveLane>& lanes,
                    const LandChunk& land, const NameChunk& name, Deadline deadline) {
  for (const ReceiveLane& lane : lanes) {
    if (lane.ring.empty() && !lane.chunks.empty()) return FailedPrecondition("receive lanes without buffers");
  }
  Status s = lanes.size() == 1 ? ReceiveInOrder(comm, plan, lanes.front(), land, name, deadline)
                               : ReceiveConcurrently(comm, plan, lanes, land, name, deadline);
  if (!s.ok()) comm.Abort();
  return s;
}

}  // namespace wsync
