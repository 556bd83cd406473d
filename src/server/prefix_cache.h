// PrefixCache: the toy generation's "KV cache" (generation.h), in a real memory pool.
//
// A prompt is cut into blocks of kBlockTokens tokens. Each cached block is keyed by the
// whole prefix up to its end (a chained hash, checked against the block's own tokens and
// its parent's key, so a hash collision is a miss) and holds the generation's running
// state after that block, as it was computed with the weights of that time: nothing
// invalidates an entry when the weights change, only Clear() (reset_prefix_cache, the
// clear_cache of pause) does, so a stale cache is observable as it is in vLLM.
//
// Entries live in slots of one pool of `capacity_bytes`, allocated and prefaulted by
// Create() and Restore(), one slot of `block_bytes` per block (what a real KV cache holds
// for kBlockTokens tokens), evicted least recently used first. Drop() unmaps the pool
// (sleep), Restore() maps it again, empty (wake_up); while dropped every lookup misses
// and nothing is inserted. A cache created with capacity 0 is disabled for good.
//
// Thread-safe: every method locks the object's own mutex and never blocks otherwise.
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <span>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync {

class PrefixCache {
 public:
  static constexpr size_t kBlockTokens = 16;

  // `capacity_bytes` 0 disables the cache. InvalidArgument when the pool cannot hold one
  // block of `block_bytes` (the message names both sizes).
  static Result<std::unique_ptr<PrefixCache>> Create(size_t capacity_bytes, size_t block_bytes);

  bool enabled() const { return capacity_bytes_ > 0; }

  // The longest cached prefix of tokens[0, limit), in whole blocks: its length in tokens
  // (0 when none) and the state after it in `*state`. Counts a hit when non-zero.
  size_t Lookup(std::span<const int32_t> tokens, size_t limit, uint64_t* state);
  // Records block_states[b], the state after block b of `tokens`, for every whole block
  // b in [first_block, block_states.size()). An entry already cached is overwritten.
  void Insert(std::span<const int32_t> tokens, std::span<const uint64_t> block_states, size_t first_block);
  // Removes every entry (the memory stays mapped); counts a reset.
  void Clear();
  // Unmaps the pool, entries gone; no-op when dropped or disabled.
  Status Drop();
  // Maps and prefaults the pool again, empty; no-op when mapped or disabled.
  Status Restore();
  // Bytes of the pool resident in memory now (mincore), 0 when dropped or disabled.
  size_t resident_bytes() const;
  // {"enabled", "entries", "bytes", "capacity_bytes", "block_bytes", "resident_bytes",
  //  "hits", "resets", "dropped"} for /health.
  nlohmann::json Health() const;

  // The key of the prefix ending with `block` whose parent prefix has key `parent`
  // (kRootKey for the first block).
  static constexpr uint64_t kRootKey = 0x5bd1e9955bd1e995ULL;
  static uint64_t BlockKey(uint64_t parent, std::span<const int32_t> block);

 private:
  struct Slot;  // the header at the start of each pool slot
  PrefixCache(size_t capacity_bytes, size_t block_bytes) : capacity_bytes_(capacity_bytes), block_bytes_(block_bytes) {}
  Status MapLocked();
  Slot* SlotLocked(size_t index);
  void ClearLocked();

  const size_t capacity_bytes_;
  const size_t block_bytes_;
  mutable std::mutex mu_;
  HostBuffer pool_;                                         // GUARDED_BY(mu_): empty when dropped
  std::list<size_t> lru_;                                   // GUARDED_BY(mu_): slot indices, most recent first
  std::unordered_map<uint64_t, std::list<size_t>::iterator> index_;  // GUARDED_BY(mu_): key -> lru_ entry
  std::vector<size_t> free_;                                // GUARDED_BY(mu_): unused slots
  uint64_t hits_ = 0;                                       // GUARDED_BY(mu_)
  uint64_t resets_ = 0;                                     // GUARDED_BY(mu_)
};

}  // namespace wsync
