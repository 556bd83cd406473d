#include "plan/sharded_plan.h"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <map>
#include <optional>
#include <span>
#include <string_view>
#include <tuple>
#include <utility>

#include <fmt/format.h>

#include "core/checked_math.h"
#include "core/digest.h"

namespace wsync {
namespace {

// The ownership rules CheckShardedStream and RdtRouter::Create share, for a stream of
// `num_tensors` tensors.
Status CheckOwnership(const Ownership& own, const std::vector<int>& group_lens, int num_producers,
                      size_t num_tensors) {
  if (num_producers < 1) return InvalidArgument(fmt::format("num_producers is {}, must be >= 1", num_producers));
  std::optional<uint64_t> total = 0;
  for (size_t g = 0; g < group_lens.size() && total; ++g) {
    if (group_lens[g] <= 0) return InvalidArgument(fmt::format("group {} has {} tensors", g, group_lens[g]));
    total = CheckedAdd(*total, group_lens[g]);
  }
  if (!total || *total != num_tensors) {
    return InvalidArgument(fmt::format("the {} groups hold {} tensors, the stream has {}", group_lens.size(),
                                       total ? fmt::to_string(*total) : "too many", num_tensors));
  }
  if (own.name_owner_class.size() != num_tensors) {
    return InvalidArgument(fmt::format("ownership gives {} tensors a class, the stream has {}",
                                       own.name_owner_class.size(), num_tensors));
  }
  for (size_t k = 0; k < own.owner_sets.size(); ++k) {
    const std::vector<int>& set = own.owner_sets[k];
    if (set.empty()) return InvalidArgument(fmt::format("owner set {} is empty", k));
    for (size_t j = 0; j < set.size(); ++j) {
      if (set[j] < 0 || set[j] >= num_producers) {
        return InvalidArgument(
            fmt::format("owner set {} names rank {}, outside [0, {})", k, set[j], num_producers));
      }
      if (j > 0 && set[j] <= set[j - 1]) {
        return InvalidArgument(fmt::format("owner set {} is not ascending without repeats at rank {}", k, set[j]));
      }
    }
  }
  for (size_t i = 0; i < num_tensors; ++i) {
    const int k = own.name_owner_class[i];
    if (k < 0 || static_cast<size_t>(k) >= own.owner_sets.size()) {
      return InvalidArgument(
          fmt::format("tensor {} has owner class {}, outside [0, {})", i, k, own.owner_sets.size()));
    }
  }
  return Status::Ok();
}

// The owner RdtRouter's rule picks for group `group` among `owners`, for consumer
// `index` of a block of `size`.
int Route(const std::vector<int>& owners, int group, int index, int size) {
  const std::vector<int> bound = AssignProducerIndices(static_cast<int>(owners.size()), size, index);
  return owners[bound[static_cast<size_t>(group) % bound.size()]];
}

// SHA-256 over a canonical byte form: integers as 8 little-endian bytes, strings as their
// length then their bytes. Fed in pieces, so no canonical form is ever held whole.
class CanonicalHash {
 public:
  CanonicalHash() : hasher_(Hasher::Create(DigestAlgorithm::kSha256)) { buffer_.reserve(kFlush + 64); }
  void Int(uint64_t v) {
    char bytes[8];
    for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>(v >> (8 * i));
    buffer_.append(bytes, 8);
    if (buffer_.size() >= kFlush) Flush();
  }
  void Str(std::string_view s) {
    Int(s.size());
    buffer_.append(s);
    if (buffer_.size() >= kFlush) Flush();
  }
  void Meta(const TensorMeta& t) {
    Str(t.name);
    Str(TorchName(t.dtype));
    Int(t.shape.size());
    for (int64_t d : t.shape) Int(static_cast<uint64_t>(d));
  }
  std::string FinishHex() {
    Flush();
    return hasher_->FinishHex();
  }

 private:
  static constexpr size_t kFlush = size_t{1} << 20;
  void Flush() {
    hasher_->Update(std::as_bytes(std::span(buffer_)));
    buffer_.clear();
  }
  std::unique_ptr<Hasher> hasher_;
  std::string buffer_;
};

// ConsumerPlan::body_digest, over (CanonicalHash's byte form, in this order):
//   "wsync-sharded-plan-body 2", the stream's tensors digest (StreamIndex), the table's
//   parameter count then each parameter's name, dtype (torch name), rank and dimensions,
//   the chunk count, then per chunk: group, owner class, producer, bytes, slice count, and
//   per slice: stream tensor index, parameter index, piece, offset, bytes and, when the
//   stream has split tensors, begin.
// Tensors and parameters are named once, through the stream's and the table's digests, and
// indexed in the slices.
std::string BodyDigest(const ConsumerPlan& plan, const StreamIndex& index, const ShardingTable& table, bool split) {
  CanonicalHash h;
  h.Str("wsync-sharded-plan-body 2");
  h.Str(index.tensors_digest);
  h.Int(table.params().size());
  for (const auto& p : table.params()) h.Meta(p.meta);
  h.Int(plan.chunks.size());
  for (const PlanChunk& chunk : plan.chunks) {
    h.Int(static_cast<uint64_t>(chunk.group));
    h.Int(static_cast<uint64_t>(chunk.owner_class));
    h.Int(static_cast<uint64_t>(chunk.producer));
    h.Int(chunk.bytes);
    h.Int(chunk.slices.size());
    for (const PlanSlice& s : chunk.slices) {
      h.Int(static_cast<uint64_t>(s.tensor));
      h.Int(static_cast<uint64_t>(s.param));
      h.Int(static_cast<uint64_t>(s.piece));
      h.Int(s.offset);
      h.Int(s.bytes);
      if (split) h.Int(s.begin);
    }
  }
  return h.FinishHex();
}

std::string WorkerName(const ShardingTable& table, const ConsumerSpot& spot) {
  return fmt::format("consumer {} (worker tp{}/{} of {})", spot.consumer, table.tp_rank(), table.tp_size(),
                     table.config().name);
}

}  // namespace

std::vector<int> AssignProducerIndices(int producers, int consumers, int consumer) {
  if (producers < 1 || consumers < 1 || consumer < 0 || consumer >= consumers) return {};
  const int64_t p = producers, c = consumers, i = consumer;
  if (p >= c) {
    std::vector<int> out;
    for (int64_t k = i * p / c; k < (i + 1) * p / c; ++k) out.push_back(static_cast<int>(k));
    return out;
  }
  return {static_cast<int>(i * p / c)};
}

std::string MetadataDigest(const std::vector<std::string>& names) {
  std::string text = fmt::format("{}\n", names.size());
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) text += '\n';
    text += names[i];
  }
  return HexDigest(DigestAlgorithm::kSha256, std::as_bytes(std::span(text))).substr(0, 16);
}

Result<Ownership> ResolveOwnership(const std::vector<std::string>& names, const std::vector<std::vector<bool>>& held) {
  if (held.empty()) return InvalidArgument("no trainer rank states what it holds");
  for (size_t r = 0; r < held.size(); ++r) {
    if (held[r].size() != names.size()) {
      return InvalidArgument(fmt::format("trainer rank {} states {} held flags for {} tensors", r, held[r].size(),
                                         names.size()));
    }
  }
  Ownership own;
  own.name_owner_class.reserve(names.size());
  std::map<std::vector<int>, int> class_of;
  std::vector<bool> holds_any(held.size(), false);
  for (size_t i = 0; i < names.size(); ++i) {
    std::vector<int> owners;
    for (size_t r = 0; r < held.size(); ++r) {
      if (!held[r][i]) continue;
      owners.push_back(static_cast<int>(r));
      holds_any[r] = true;
    }
    if (owners.empty()) return InvalidArgument(fmt::format("no trainer rank holds tensor {}", names[i]));
    auto [pos, fresh] = class_of.emplace(owners, static_cast<int>(own.owner_sets.size()));
    if (fresh) own.owner_sets.push_back(std::move(owners));
    own.name_owner_class.push_back(pos->second);
  }
  for (size_t r = 0; r < held.size(); ++r) {
    if (!holds_any[r]) {
      return InvalidArgument(fmt::format("trainer rank {} holds none of the {} tensors", r, names.size()));
    }
  }
  return own;
}

Result<RdtRouter> RdtRouter::Create(int num_producers, int num_consumers, Ownership ownership,
                                    const std::vector<int>& group_lens, int workers_per_replica) {
  if (num_consumers < 1) return InvalidArgument(fmt::format("num_consumers is {}, must be >= 1", num_consumers));
  if (workers_per_replica < 0) {
    return InvalidArgument(fmt::format("workers_per_replica is {}, must be >= 0", workers_per_replica));
  }
  const int block = std::min(num_consumers, workers_per_replica > 0 ? workers_per_replica : num_consumers);
  if (num_consumers % block != 0) {
    return InvalidArgument(fmt::format("workers_per_replica {} does not divide the {} consumers", workers_per_replica,
                                       num_consumers));
  }
  WSYNC_RETURN_IF_ERROR(
      CheckOwnership(ownership, group_lens, num_producers, ownership.name_owner_class.size()));
  RdtRouter r;
  r.num_producers_ = num_producers;
  r.num_consumers_ = num_consumers;
  r.block_consumers_ = block;
  r.group_of_.reserve(ownership.name_owner_class.size());
  size_t tensor = 0;
  for (size_t g = 0; g < group_lens.size(); ++g) {
    std::vector<bool> owner(num_producers, false);
    for (int k = 0; k < group_lens[g]; ++k, ++tensor) {
      r.group_of_.push_back(static_cast<int>(g));
      for (int rank : ownership.owner_sets[ownership.name_owner_class[tensor]]) owner[rank] = true;
    }
    std::vector<int>& owners = r.group_owners_.emplace_back();
    for (int rank = 0; rank < num_producers; ++rank) {
      if (owner[rank]) owners.push_back(rank);
    }
  }
  r.ownership_ = std::move(ownership);
  return r;
}

int RdtRouter::ProducerFor(int consumer_id, int tensor) const {
  if (consumer_id < 0 || consumer_id >= num_consumers_ || tensor < 0 ||
      static_cast<size_t>(tensor) >= group_of_.size()) {
    return -1;
  }
  const std::vector<int>& owners = ownership_.owner_sets[ownership_.name_owner_class[tensor]];
  return Route(owners, group_of_[tensor], consumer_id % block_consumers_, block_consumers_);
}

std::vector<int> RdtRouter::GroupOwners(int group) const {
  if (group < 0 || static_cast<size_t>(group) >= group_owners_.size()) return {};
  return group_owners_[group];
}

bool ShardedStream::split() const {
  return std::any_of(parts.begin(), parts.end(), [](const auto& p) { return !p.empty(); });
}

Status CheckShardedStream(const ShardedStream& stream) {
  WSYNC_RETURN_IF_ERROR(
      CheckOwnership(stream.ownership, stream.group_lens, stream.num_producers, stream.tensors.size()));
  if (stream.parts.empty()) return Status::Ok();
  if (stream.parts.size() != stream.tensors.size()) {
    return InvalidArgument(fmt::format("parts are given for {} tensors, the stream has {}", stream.parts.size(),
                                       stream.tensors.size()));
  }
  for (size_t i = 0; i < stream.parts.size(); ++i) {
    const std::vector<TensorPart>& parts = stream.parts[i];
    if (parts.empty()) continue;
    const TensorMeta& t = stream.tensors[i];
    if (t.shape.empty()) return InvalidArgument(fmt::format("tensor {} has no dim 0 to cut into parts", t.name));
    int64_t row = 0;
    for (const TensorPart& p : parts) {
      if (p.row_begin != row || p.row_end <= p.row_begin || p.row_end > t.shape[0]) {
        return InvalidArgument(fmt::format("tensor {} (dim 0 of {}): part [{}, {}) does not follow row {}", t.name,
                                           t.shape[0], p.row_begin, p.row_end, row));
      }
      if (p.owner_class < 0 || static_cast<size_t>(p.owner_class) >= stream.ownership.owner_sets.size()) {
        return InvalidArgument(fmt::format("tensor {}: part [{}, {}) has owner class {}, outside [0, {})", t.name,
                                           p.row_begin, p.row_end, p.owner_class,
                                           stream.ownership.owner_sets.size()));
      }
      row = p.row_end;
    }
    if (row != t.shape[0]) {
      return InvalidArgument(fmt::format("tensor {}: its parts end at row {} of {}", t.name, row, t.shape[0]));
    }
  }
  return Status::Ok();
}

Result<std::vector<std::vector<TensorPart>>> ResolveParts(const std::vector<TensorMeta>& tensors,
                                                          const std::vector<std::vector<bool>>& held,
                                                          const HeldRowsByRank& rows, Ownership& ownership) {
  std::vector<std::vector<TensorPart>> parts(tensors.size());
  bool any = false;
  std::map<std::vector<int>, int> class_of;
  for (size_t k = 0; k < ownership.owner_sets.size(); ++k) class_of.emplace(ownership.owner_sets[k], static_cast<int>(k));
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorMeta& t = tensors[i];
    const int64_t extent = t.shape.empty() ? 1 : t.shape[0];
    bool split = false;
    std::vector<int64_t> bounds{0, extent};
    std::vector<std::pair<int64_t, int64_t>> range(held.size(), {0, 0});
    for (size_t r = 0; r < held.size(); ++r) {
      if (r >= rows.size() || i >= rows[r].size() || !held[r][i]) {
        if (r < held.size() && held[r][i]) range[r] = {0, extent};
        continue;
      }
      range[r] = rows[r][i].value_or(std::pair<int64_t, int64_t>{0, extent});
      const auto [b, e] = range[r];
      if (b < 0 || e <= b || e > extent || (t.shape.empty() && rows[r][i])) {
        return InvalidArgument(fmt::format("trainer rank {} holds rows [{}, {}) of {}, whose dim 0 has {}", r, b, e,
                                           t.name, t.shape.empty() ? 0 : extent));
      }
      if (b != 0 || e != extent) split = true;
      bounds.push_back(b);
      bounds.push_back(e);
    }
    if (!split) continue;
    any = true;
    std::sort(bounds.begin(), bounds.end());
    bounds.erase(std::unique(bounds.begin(), bounds.end()), bounds.end());
    for (size_t j = 0; j + 1 < bounds.size(); ++j) {
      std::vector<int> owners;
      for (size_t r = 0; r < held.size(); ++r) {
        if (range[r].first <= bounds[j] && bounds[j + 1] <= range[r].second) owners.push_back(static_cast<int>(r));
      }
      if (owners.empty()) {
        return InvalidArgument(
            fmt::format("no trainer rank holds rows [{}, {}) of {}", bounds[j], bounds[j + 1], t.name));
      }
      auto [pos, fresh] = class_of.emplace(owners, static_cast<int>(ownership.owner_sets.size()));
      if (fresh) ownership.owner_sets.push_back(std::move(owners));
      parts[i].push_back(TensorPart{bounds[j], bounds[j + 1], pos->second});
    }
  }
  if (!any) parts.clear();
  return parts;
}

size_t PackedBytesBelow(const PieceRuns& r, size_t hf) {
  const int64_t x = static_cast<int64_t>(hf) - r.hf_offset;
  if (x <= 0 || r.count <= 0) return 0;
  if (r.count == 1 || r.hf_stride <= 0) return static_cast<size_t>(std::min(x, r.run_bytes));
  const int64_t k = x / r.hf_stride;
  if (k >= r.count) return static_cast<size_t>(r.count * r.run_bytes);
  return static_cast<size_t>(k * r.run_bytes + std::min(x % r.hf_stride, r.run_bytes));
}

size_t ConsumerPlan::bytes() const {
  size_t n = 0;
  for (const PlanChunk& c : chunks) n += c.bytes;
  return n;
}

size_t ConsumerPlan::max_chunk_bytes() const {
  size_t n = 0;
  for (const PlanChunk& c : chunks) n = std::max(n, c.bytes);
  return n;
}

Result<StreamIndex> IndexStream(const ShardedStream& stream, std::shared_ptr<const HfCatalog> catalog,
                                std::string_view who) {
  if (!catalog) return InvalidArgument(fmt::format("{}: no model catalog", who));
  // Every stream tensor must be one of the model's, once, as the model has it. A stream in
  // the model's own order (the usual case) resolves by position, without a lookup by name.
  const std::vector<TensorMeta>& model = catalog->tensors();
  StreamIndex index;
  index.stream_of.assign(model.size(), -1);
  index.hf_of.assign(stream.tensors.size(), -1);
  for (size_t i = 0; i < stream.tensors.size(); ++i) {
    const TensorMeta& t = stream.tensors[i];
    const int hf = i < model.size() && model[i].name == t.name ? static_cast<int>(i) : catalog->Find(t.name);
    if (hf < 0) return InvalidArgument(fmt::format("{}: the model has no tensor {}", who, t.name));
    if (index.stream_of[hf] >= 0) {
      return InvalidArgument(fmt::format("{}: the stream names {} twice (tensors {} and {})", who, t.name,
                                         index.stream_of[hf], i));
    }
    WSYNC_RETURN_IF_ERROR(CheckSameMeta(model[hf], t).WithContext(who));
    index.stream_of[hf] = static_cast<int>(i);
    index.hf_of[i] = hf;
  }
  CanonicalHash h;
  h.Str("wsync-sharded-stream 1");
  h.Int(stream.tensors.size());
  for (const TensorMeta& t : stream.tensors) h.Meta(t);
  index.tensors_digest = h.FinishHex();
  index.catalog = std::move(catalog);
  return index;
}

Result<ConsumerPlan> PlanConsumer(const ShardedStream& stream, const ShardingTable& table, const ConsumerSpot& spot) {
  WSYNC_RETURN_IF_ERROR(CheckShardedStream(stream));
  const std::string who = WorkerName(table, spot);
  if (spot.consumer < 0 || spot.block_size < 1 || spot.block_index < 0 || spot.block_index >= spot.block_size) {
    return InvalidArgument(fmt::format("{}: block index {} of a block of {} is out of range", who, spot.block_index,
                                       spot.block_size));
  }
  WSYNC_ASSIGN_OR_RETURN(StreamIndex index, IndexStream(stream, table.catalog(), who));
  return PlanConsumer(stream, index, table, spot);
}

Result<ConsumerPlan> PlanConsumer(const ShardedStream& stream, const StreamIndex& index, const ShardingTable& table,
                                  const ConsumerSpot& spot, bool digest) {
  WSYNC_RETURN_IF_ERROR(CheckShardedStream(stream));
  const std::string who = WorkerName(table, spot);
  if (spot.consumer < 0 || spot.block_size < 1 || spot.block_index < 0 || spot.block_index >= spot.block_size) {
    return InvalidArgument(fmt::format("{}: block index {} of a block of {} is out of range", who, spot.block_index,
                                       spot.block_size));
  }
  if (index.catalog != table.catalog() || index.hf_of.size() != stream.tensors.size()) {
    return InvalidArgument(fmt::format("{}: the stream was indexed against another model", who));
  }
  // The worker's pieces in stream order (a tensor's pieces in table order); every tensor
  // the worker keeps pieces of must be in the stream (the first missing in model order is
  // named).
  struct Entry {
    int tensor, param, piece;
  };
  std::vector<Entry> entries;
  const std::span<const std::pair<int, int>> pieces = table.PiecesByHf();
  const std::span<const int> pieces_hf = table.PiecesHf();
  entries.reserve(pieces.size());
  for (size_t k = 0; k < pieces.size(); ++k) {
    const int tensor = index.stream_of[pieces_hf[k]];
    if (tensor < 0) {
      return InvalidArgument(fmt::format("{}: tensor {} is missing from the trainer's stream", who,
                                         table.hf_tensors()[pieces_hf[k]].name));
    }
    entries.push_back({tensor, pieces[k].first, pieces[k].second});
  }
  std::stable_sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) { return a.tensor < b.tensor; });

  ConsumerPlan plan;
  plan.consumer = spot.consumer;
  plan.tp_rank = table.tp_rank();
  plan.tp_size = table.tp_size();
  size_t begin = 0, next = 0;
  for (size_t g = 0; g < stream.group_lens.size() && next < entries.size(); ++g) {
    const size_t end = begin + static_cast<size_t>(stream.group_lens[g]);
    std::map<int, PlanChunk> by_class;  // ascending class id
    for (; next < entries.size() && static_cast<size_t>(entries[next].tensor) < end; ++next) {
      // Plain names, not a structured binding: the lambda below captures them.
      const int i = entries[next].tensor;
      const int param = entries[next].param;
      const int piece = entries[next].piece;
      const PieceRuns runs = table.Runs(param, piece);
      const std::optional<size_t> bytes = CheckedMul<size_t>(runs.count, runs.run_bytes);
      auto add = [&](int k, size_t begin, size_t end) -> Status {
        PlanChunk& chunk = by_class[k];
        const std::optional<size_t> offset = CheckedAdd<size_t>(chunk.bytes, size_t{15});
        const std::optional<size_t> slice_end =
            offset ? CheckedAdd<size_t>(*offset & ~size_t{15}, end - begin) : std::nullopt;
        if (!slice_end) {
          return InvalidArgument(fmt::format("{}: the slices of group {} overflow at tensor {}", who, g,
                                             stream.tensors[i].name));
        }
        chunk.slices.push_back(PlanSlice{i, param, piece, *offset & ~size_t{15}, end - begin, begin});
        chunk.bytes = *slice_end;
        return Status::Ok();
      };
      if (!bytes) {
        return InvalidArgument(fmt::format("{}: the slices of group {} overflow at tensor {}", who, g,
                                           stream.tensors[i].name));
      }
      if (stream.parts.empty() || stream.parts[i].empty()) {
        WSYNC_RETURN_IF_ERROR(add(stream.ownership.name_owner_class[i], 0, *bytes));
        continue;
      }
      // One sub-slice per part: the piece's packed bytes are in HF order, so each part's
      // rows are one range of them.
      const TensorMeta& t = stream.tensors[i];
      const size_t row_bytes = t.nbytes() / static_cast<size_t>(std::max<int64_t>(t.shape[0], 1));
      for (const TensorPart& p : stream.parts[i]) {
        const size_t lo = PackedBytesBelow(runs, static_cast<size_t>(p.row_begin) * row_bytes);
        const size_t hi = PackedBytesBelow(runs, static_cast<size_t>(p.row_end) * row_bytes);
        if (hi > lo) WSYNC_RETURN_IF_ERROR(add(p.owner_class, lo, hi));
      }
    }
    for (auto& [k, chunk] : by_class) {
      chunk.group = static_cast<int>(g);
      chunk.owner_class = k;
      chunk.producer = Route(stream.ownership.owner_sets[k], static_cast<int>(g), spot.block_index, spot.block_size);
      plan.chunks.push_back(std::move(chunk));
    }
    begin = end;
  }
  if (!digest) return plan;
  plan.body_digest = BodyDigest(plan, index, table, stream.split());
  plan.digest = ConsumerDigest(plan.body_digest, spot, plan.tp_rank, plan.tp_size);
  return plan;
}

std::string ConsumerDigest(std::string_view body_digest, const ConsumerSpot& spot, int tp_rank, int tp_size) {
  const std::string text = fmt::format("wsync-sharded-plan 2\nconsumer {} block {} {} tp {} {}\nbody {}\n",
                                       spot.consumer, spot.block_index, spot.block_size, tp_rank, tp_size,
                                       body_digest);
  return HexDigest(DigestAlgorithm::kSha256, std::as_bytes(std::span(text)));
}

ProducerPlan PlanProducer(int producer, int num_groups, const std::vector<ConsumerPlan>& plans) {
  std::vector<std::vector<int>> consumers;
  consumers.reserve(plans.size());
  for (const ConsumerPlan& p : plans) consumers.push_back({p.consumer});
  return PlanProducer(producer, num_groups, plans, consumers);
}

ProducerPlan PlanProducer(int producer, int num_groups, const std::vector<ConsumerPlan>& plans,
                          const std::vector<std::vector<int>>& consumers) {
  ProducerPlan out;
  out.producer = producer;
  out.by_group.resize(static_cast<size_t>(std::max(num_groups, 0)));
  for (size_t p = 0; p < plans.size() && p < consumers.size(); ++p) {
    for (size_t c = 0; c < plans[p].chunks.size(); ++c) {
      const PlanChunk& chunk = plans[p].chunks[c];
      if (chunk.producer != producer || chunk.group < 0 || chunk.group >= num_groups) continue;
      std::vector<ProducerSend>& sends = out.by_group[chunk.group];
      auto same = std::find_if(sends.begin(), sends.end(), [&](const ProducerSend& s) {
        const ConsumerPlan& sharer = plans[s.plan];
        return s.bytes == chunk.bytes && sharer.tp_rank == plans[p].tp_rank && sharer.tp_size == plans[p].tp_size &&
               sharer.chunks[s.chunk] == chunk;
      });
      if (same == sends.end()) {
        sends.push_back(ProducerSend{chunk.group, {}, {}, static_cast<int>(p), static_cast<int>(c), chunk.bytes});
        same = sends.end() - 1;
      }
      for (int consumer : consumers[p]) {
        same->consumers.push_back(consumer);
        same->chunks.push_back(static_cast<int>(c));
      }
    }
  }
  for (std::vector<ProducerSend>& sends : out.by_group) {
    size_t group_bytes = 0;
    for (ProducerSend& s : sends) {
      // Consumers ascending, each keeping its chunk index beside it.
      std::vector<std::pair<int, int>> pairs;
      for (size_t i = 0; i < s.consumers.size(); ++i) pairs.emplace_back(s.consumers[i], s.chunks[i]);
      std::sort(pairs.begin(), pairs.end());
      for (size_t i = 0; i < pairs.size(); ++i) std::tie(s.consumers[i], s.chunks[i]) = pairs[i];
      group_bytes += s.bytes;
      out.bytes_sent += s.bytes * s.consumers.size();
    }
    out.max_group_bytes = std::max(out.max_group_bytes, group_bytes);
  }
  return out;
}

void PackSliceHost(const ShardingTable& table, const PlanSlice& s, const std::byte* hf, std::byte* chunk) {
  const PieceRuns r = table.Runs(s.param, s.piece);
  std::byte* dst = chunk + s.offset;
  for (int64_t k = 0; k < r.count; ++k) {
    std::memcpy(dst + k * r.run_bytes, hf + r.hf_offset + k * r.hf_stride, static_cast<size_t>(r.run_bytes));
  }
}

void PackPartHost(const PieceRuns& r, size_t begin, size_t bytes, size_t first_byte, const std::byte* rows,
                  std::byte* dst) {
  const size_t run = static_cast<size_t>(r.run_bytes);
  const size_t end = begin + bytes;
  for (size_t q = begin; q < end;) {
    const size_t k = q / run, j = q % run;
    const size_t n = std::min(run - j, end - q);
    const size_t hf = static_cast<size_t>(r.hf_offset) + k * static_cast<size_t>(r.hf_stride) + j;
    std::memcpy(dst + (q - begin), rows + (hf - first_byte), n);
    q += n;
  }
}

}  // namespace wsync
