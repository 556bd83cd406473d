// Digests of the HF tensors a TP group's host stores land between them, taken as soon as
// the group holds every primary piece of a tensor, on background threads: in-line
// verification of tensors split across workers (and of `sharded`'s slices) then reads
// each tensor while later chunks are still arriving, instead of all of them at finish.
//
// A store reports its landings (WorkerStore::set_group_landing): all of its primary
// pieces of a tensor (a full-tensor Load) or one piece (LoadPiece). When a tensor's count
// of primary pieces still to land reaches zero, one background thread digests it from
// the shards (HfDigest, xxh3-128, in HF order: what landed, not what was sent). A piece
// that lands again after that (a tensor sent twice in one session) makes the tensor's
// digest stale: Digests() leaves it out, and finish reads it as before.
//
// Thread-safe: stores report from any thread. Begin and Digests are called while no store
// of the group lands (session start and finish). The stores must outlive this object; its
// destructor waits for the digests in flight.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace wsync {

class WorkerStore;

class GroupLandingDigests {
 public:
  // `group`: the TP group's host stores in tp-rank order (tables of one model).
  // `threads`: background digest threads (at least 1).
  GroupLandingDigests(std::vector<const WorkerStore*> group, size_t threads);
  ~GroupLandingDigests();
  GroupLandingDigests(const GroupLandingDigests&) = delete;
  GroupLandingDigests& operator=(const GroupLandingDigests&) = delete;

  using RowRanges = std::vector<std::pair<int64_t, int64_t>>;
  // A tensor's digest, whole (ranges empty) or of row ranges joined by ','
  // (HfRangesDigest).
  struct Digest {
    RowRanges ranges;
    std::string hex;
  };

  // A new session: waits for digests in flight, forgets every count and digest. The
  // tensors named in `rows` are digested by those row ranges (ReceiverBackend::
  // RowDigestRanges) instead of whole.
  void Begin(const std::map<std::string, RowRanges>& rows = {});
  // Store `tp_rank` landed every primary piece it holds of HF tensor `hf_index`.
  void LandedAll(int tp_rank, int hf_index);
  // A store landed one primary piece of HF tensor `hf_index`.
  void LandedPiece(int hf_index);
  // Waits for the digests in flight; the digest of every tensor whose primary pieces all
  // landed exactly once since Begin, by HF name.
  std::map<std::string, Digest> Digests();

 private:
  void Count(int hf_index, int pieces);
  void Run();
  void WaitIdle(std::unique_lock<std::mutex>& lock);

  std::vector<const WorkerStore*> group_;
  std::vector<std::vector<int>> primary_;     // [tp rank][hf index]: primary pieces held
  std::vector<int> expected_;                 // by hf index: primary pieces in the group
  std::unique_ptr<std::atomic<int>[]> left_;  // by hf index: still to land this session
  std::unique_ptr<std::atomic<bool>[]> stale_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<int> queue_;                // GUARDED_BY(mu_): hf indices to digest
  size_t running_ = 0;                   // GUARDED_BY(mu_)
  bool stop_ = false;                    // GUARDED_BY(mu_)
  std::vector<RowRanges> rows_;          // by hf index, set at Begin; empty: whole
  std::map<int, std::string> digests_;   // GUARDED_BY(mu_)
  std::vector<std::thread> threads_;
};

}  // namespace wsync
