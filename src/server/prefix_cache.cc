#include "server/prefix_cache.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "core/prefault.h"
#include "server/generation.h"

namespace wsync {

// What a slot records besides its "KV" bytes: enough to tell a hash collision from a hit.
struct PrefixCache::Slot {
  uint64_t key;
  uint64_t parent;
  uint64_t state;
  int32_t tokens[kBlockTokens];
};

Result<std::unique_ptr<PrefixCache>> PrefixCache::Create(size_t capacity_bytes, size_t block_bytes) {
  block_bytes = std::max(block_bytes, sizeof(Slot));
  block_bytes = (block_bytes + alignof(Slot) - 1) / alignof(Slot) * alignof(Slot);
  if (capacity_bytes > 0 && capacity_bytes < block_bytes) {
    return InvalidArgument(fmt::format(
        "a prefix cache of {} bytes holds no block: one block of {} tokens takes {} bytes (raise --kv-cache-mib, or "
        "0 disables prefix caching)",
        capacity_bytes, kBlockTokens, block_bytes));
  }
  std::unique_ptr<PrefixCache> c(new PrefixCache(capacity_bytes / std::max<size_t>(block_bytes, 1) * block_bytes,
                                                 block_bytes));
  if (c->enabled()) {
    std::lock_guard lock(c->mu_);
    WSYNC_RETURN_IF_ERROR(c->MapLocked());
  }
  return c;
}

uint64_t PrefixCache::BlockKey(uint64_t parent, std::span<const int32_t> block) {
  uint64_t h = parent;
  for (int32_t t : block) h = GenerationMix(h ^ static_cast<uint32_t>(t));
  return GenerationMix(h + block.size());
}

Status PrefixCache::MapLocked() {
  WSYNC_ASSIGN_OR_RETURN(pool_, HostBuffer::Allocate(capacity_bytes_));
  Prefault(pool_.span());
  free_.clear();
  for (size_t i = capacity_bytes_ / block_bytes_; i > 0; --i) free_.push_back(i - 1);
  return Status::Ok();
}

PrefixCache::Slot* PrefixCache::SlotLocked(size_t index) {
  return reinterpret_cast<Slot*>(pool_.data() + index * block_bytes_);
}

size_t PrefixCache::Lookup(std::span<const int32_t> tokens, size_t limit, uint64_t* state) {
  std::lock_guard lock(mu_);
  if (pool_.size() == 0) return 0;
  size_t matched = 0;
  uint64_t parent = kRootKey;
  limit = std::min(limit, tokens.size());
  for (size_t end = kBlockTokens; end <= limit; end += kBlockTokens) {
    std::span<const int32_t> block = tokens.subspan(end - kBlockTokens, kBlockTokens);
    uint64_t key = BlockKey(parent, block);
    auto it = index_.find(key);
    if (it == index_.end()) break;
    const Slot* s = SlotLocked(*it->second);
    if (s->parent != parent || !std::equal(block.begin(), block.end(), s->tokens)) break;
    lru_.splice(lru_.begin(), lru_, it->second);
    *state = s->state;
    matched = end;
    parent = key;
  }
  if (matched > 0) ++hits_;
  return matched;
}

void PrefixCache::Insert(std::span<const int32_t> tokens, std::span<const uint64_t> block_states, size_t first_block) {
  std::lock_guard lock(mu_);
  if (pool_.size() == 0) return;
  uint64_t parent = kRootKey;
  for (size_t b = 0; b < block_states.size() && (b + 1) * kBlockTokens <= tokens.size(); ++b) {
    std::span<const int32_t> block = tokens.subspan(b * kBlockTokens, kBlockTokens);
    uint64_t key = BlockKey(parent, block);
    if (b >= first_block) {
      size_t slot = 0;
      if (auto it = index_.find(key); it != index_.end()) {
        slot = *it->second;
        lru_.splice(lru_.begin(), lru_, it->second);
      } else {
        if (free_.empty()) {  // evict the least recently used entry
          size_t victim = lru_.back();
          index_.erase(SlotLocked(victim)->key);
          lru_.pop_back();
          free_.push_back(victim);
        }
        slot = free_.back();
        free_.pop_back();
        lru_.push_front(slot);
        index_[key] = lru_.begin();
      }
      Slot* s = SlotLocked(slot);
      s->key = key;
      s->parent = parent;
      s->state = block_states[b];
      std::copy(block.begin(), block.end(), s->tokens);
    }
    parent = key;
  }
}

void PrefixCache::ClearLocked() {
  for (size_t slot : lru_) free_.push_back(slot);
  lru_.clear();
  index_.clear();
}

void PrefixCache::Clear() {
  std::lock_guard lock(mu_);
  ClearLocked();
  ++resets_;
}

Status PrefixCache::Drop() {
  std::lock_guard lock(mu_);
  ClearLocked();
  free_.clear();
  pool_ = HostBuffer();
  return Status::Ok();
}

Status PrefixCache::Restore() {
  std::lock_guard lock(mu_);
  if (!enabled() || pool_.size() > 0) return Status::Ok();
  return MapLocked();
}

size_t PrefixCache::resident_bytes() const {
  std::lock_guard lock(mu_);
  if (pool_.size() == 0) return 0;
  long pages = ResidentPages(pool_.span());
  if (pages < 0) return pool_.size();
  return std::min(pool_.size(), static_cast<size_t>(pages) * static_cast<size_t>(sysconf(_SC_PAGESIZE)));
}

nlohmann::json PrefixCache::Health() const {
  size_t resident = resident_bytes();
  std::lock_guard lock(mu_);
  return nlohmann::json{{"enabled", enabled()},
                        {"entries", index_.size()},
                        {"bytes", index_.size() * block_bytes_},
                        {"capacity_bytes", capacity_bytes_},
                        {"block_bytes", block_bytes_},
                        {"block_tokens", kBlockTokens},
                        {"resident_bytes", resident},
                        {"dropped", enabled() && pool_.size() == 0},
                        {"hits", hits_},
                        {"resets", resets_}};
}

}  // namespace wsync
