#include "model/group_landing.h"

#include <algorithm>

#include "core/digest.h"
#include "model/worker_store.h"

namespace wsync {

GroupLandingDigests::GroupLandingDigests(std::vector<const WorkerStore*> group, size_t threads)
    : group_(std::move(group)) {
  const size_t n = group_.empty() ? 0 : group_.front()->table().hf_tensors().size();
  expected_.assign(n, 0);
  for (const WorkerStore* store : group_) {
    const ShardingTable& table = store->table();
    std::vector<int>& mine = primary_.emplace_back(n, 0);
    for (size_t h = 0; h < n; ++h) {
      for (auto [param, piece] : table.PiecesOfHf(static_cast<int>(h))) {
        if (table.params()[param].pieces[piece].primary) ++mine[h];
      }
      expected_[h] += mine[h];
    }
  }
  left_ = std::make_unique<std::atomic<int>[]>(n);
  stale_ = std::make_unique<std::atomic<bool>[]>(n);
  for (size_t t = 0; t < std::max<size_t>(1, threads); ++t) threads_.emplace_back([this] { Run(); });
  Begin();
}

GroupLandingDigests::~GroupLandingDigests() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
    queue_.clear();
  }
  cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void GroupLandingDigests::WaitIdle(std::unique_lock<std::mutex>& lock) {
  cv_.wait(lock, [&] { return queue_.empty() && running_ == 0; });
}

void GroupLandingDigests::Begin(const std::map<std::string, RowRanges>& rows) {
  std::unique_lock lock(mu_);
  WaitIdle(lock);
  digests_.clear();
  rows_.assign(expected_.size(), RowRanges());
  if (!group_.empty()) {
    for (const auto& [name, ranges] : rows) {
      const int h = group_.front()->table().FindHf(name);
      if (h >= 0) rows_[h] = ranges;
    }
  }
  for (size_t h = 0; h < expected_.size(); ++h) {
    left_[h].store(expected_[h], std::memory_order_relaxed);
    stale_[h].store(false, std::memory_order_relaxed);
  }
}

void GroupLandingDigests::LandedAll(int tp_rank, int hf_index) {
  if (tp_rank < 0 || static_cast<size_t>(tp_rank) >= primary_.size() || hf_index < 0 ||
      static_cast<size_t>(hf_index) >= expected_.size()) {
    return;
  }
  Count(hf_index, primary_[tp_rank][hf_index]);
}

void GroupLandingDigests::LandedPiece(int hf_index) {
  if (hf_index < 0 || static_cast<size_t>(hf_index) >= expected_.size()) return;
  Count(hf_index, 1);
}

void GroupLandingDigests::Count(int hf_index, int pieces) {
  if (pieces <= 0) return;
  const int left = left_[hf_index].fetch_sub(pieces, std::memory_order_acq_rel) - pieces;
  if (left < 0) {
    stale_[hf_index].store(true, std::memory_order_release);
  } else if (left == 0) {
    {
      std::lock_guard lock(mu_);
      queue_.push_back(hf_index);
    }
    cv_.notify_one();
  }
}

void GroupLandingDigests::Run() {
  std::vector<std::byte> scratch;  // row-range reads, reused
  std::unique_lock lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (stop_) return;
    const int h = queue_.front();
    queue_.pop_front();
    ++running_;
    lock.unlock();
    const std::string& name = group_.front()->table().hf_tensors()[h].name;
    // rows_ changes only in Begin, which waits for every digest in flight first.
    Result<std::string> digest =
        rows_[h].empty() ? HfDigest(group_, name, DigestAlgorithm::kXxh3_128)
                         : HfRangesDigest(group_, name, rows_[h], DigestAlgorithm::kXxh3_128, &scratch);
    lock.lock();
    --running_;
    if (digest.ok()) digests_[h] = std::move(*digest);
    cv_.notify_all();
  }
}

std::map<std::string, GroupLandingDigests::Digest> GroupLandingDigests::Digests() {
  std::unique_lock lock(mu_);
  WaitIdle(lock);
  std::map<std::string, Digest> out;
  for (const auto& [h, hex] : digests_) {
    if (stale_[h].load(std::memory_order_acquire)) continue;
    out.emplace(group_.front()->table().hf_tensors()[h].name, Digest{rows_[h], hex});
  }
  return out;
}

}  // namespace wsync
