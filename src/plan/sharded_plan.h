// The `sharded` backend's static plan: which trainer rank sends which slices of which HF
// tensors to which inference worker, decided once at init from the sharding tables.
//
// Trainer ranks are PRODUCERS (0..P-1); inference workers are CONSUMERS, numbered across
// the fleet (0..C-1). The model streams in the trainer's metadata order, cut into layer
// groups (sources/groups.h; `group_lens` counts each group's tensors in order). Each
// trainer rank holds some names (WeightSource::HeldNames); ResolveOwnership turns the
// ranks' held masks into OWNER CLASSES (deduplicated owner sets), as SkyRL does.
//
// A consumer keeps the slices its ShardingTable lists (model/sharding.h): for every piece
// of every parameter, the piece's byte runs of one HF tensor. Its plan has ONE CHUNK per
// (group, owner class) it needs anything from, in group order then class order; the
// chunk's slices are that group's pieces of that class's names, in the stream's tensor
// order then the table's piece order, each at a 16-byte aligned offset, packed as the
// piece's runs back to back (PackSlice / the sink's LoadPiece). Its producer is SkyRL's
// RdtRouter choice, generalised to fleets whose deployments differ in size: within the
// chunk's owner set, consumer `block_index` of a deployment of `block_size` workers binds
// AssignProducerIndices(|owners|, block_size, block_index) and takes entry
// group % (that many) of them (rotation per GROUP, so a group's names of one class come
// from one producer; the block is carved per deployment, so worker w of every replica of
// one shape resolves the same producer). With every deployment of one size this is
// exactly RdtRouter(..., workers_per_replica = that size).
//
// Both sides compute plans independently (the trainer every consumer's, a server its own
// workers'); ConsumerPlan::digest (hex SHA-256 over the consumer's place and the SHA-256
// of a canonical form of the plan's body: the stream's tensors and the table's parameters,
// then chunks, producers, slices with their tensor and parameter, offsets and sizes) is
// compared at init, and a mismatch fails init
// naming both digests. A plan's body does not depend on the consumer's fleet-global id,
// only on its table and its place in its block, so the trainer plans each distinct
// (table, block index, block size) once and digests the other consumers of it from the
// body's digest (plan/fleet_plan.h).
//
// A producer's view (PlanProducer) lists, per group, one SEND per distinct chunk: the
// consumers whose chunks of that group from this producer are byte-identical (same table,
// that is the same TP rank and size, and the same slices at the same offsets) share one
// packed buffer, so the trainer's memory does not grow with the number of deployments
// (SkyRL's slot sharing). A message's tag on the wire is the chunk's index in its
// consumer's plan.
//
// Pure functions and immutable results; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "model/sharding.h"
#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync {

// SkyRL's assign_producer_indices: the positions in an owner set of `producers` ranks
// that consumer `consumer` of a block of `consumers` binds. P >= C: the contiguous range
// [c*P/C, (c+1)*P/C); P < C: the single position c*P/C. Empty unless producers >= 1,
// consumers >= 1 and 0 <= consumer < consumers.
std::vector<int> AssignProducerIndices(int producers, int consumers, int consumer);

// SkyRL's metadata digest: the first 16 hex digits of SHA-256 over "<count>\n" followed by
// the names joined with "\n". Ranks that describe different models disagree on it.
std::string MetadataDigest(const std::vector<std::string>& names);

struct Ownership {
  // By class: the trainer ranks that hold the class's names, ascending. Classes are
  // numbered by the first name (in stream order) that has them.
  std::vector<std::vector<int>> owner_sets;
  // By tensor (stream order): its class.
  std::vector<int> name_owner_class;
  friend bool operator==(const Ownership&, const Ownership&) = default;
};

// held[r][i]: trainer rank r holds tensor i (every row as long as `names`).
// InvalidArgument naming the first tensor no rank holds, a rank that holds nothing, or a
// row of the wrong length.
Result<Ownership> ResolveOwnership(const std::vector<std::string>& names,
                                   const std::vector<std::vector<bool>>& held);

// SkyRL's RdtRouter, for one fleet of uniform deployments (kept for its exact vectors).
class RdtRouter {
 public:
  // `group_lens`: tensors per group, in stream order (they sum to the tensor count).
  // workers_per_replica 0: the whole fleet is one block. InvalidArgument when it does not
  // divide num_consumers, a count is below 1 (workers_per_replica below 0), or the
  // ownership and groups fail CheckShardedStream's rules (an owner set empty or naming a
  // rank outside [0, num_producers), a class id out of range, group lengths that do not
  // add up).
  static Result<RdtRouter> Create(int num_producers, int num_consumers, Ownership ownership,
                                  const std::vector<int>& group_lens, int workers_per_replica = 0);
  // The trainer rank consumer `consumer_id` pulls tensor `tensor` from; -1 for a
  // consumer outside [0, num_consumers) or a tensor outside the stream.
  int ProducerFor(int consumer_id, int tensor) const;
  // The union of the owners of group `group`'s tensors, ascending (who a consumer tells
  // that it is done with the group); empty for a group outside the stream.
  std::vector<int> GroupOwners(int group) const;

 private:
  RdtRouter() = default;
  int num_producers_ = 0;
  int num_consumers_ = 0;
  int block_consumers_ = 0;
  Ownership ownership_;
  std::vector<int> group_of_;  // by tensor
  std::vector<std::vector<int>> group_owners_;
};

// Rows [row_begin, row_end) of dim 0 of a tensor, held by the ranks of `owner_class`:
// a tensor no trainer rank holds whole (FSDP's dim-0 shards) is cut into such parts.
struct TensorPart {
  int64_t row_begin = 0;
  int64_t row_end = 0;
  int owner_class = 0;
  friend bool operator==(const TensorPart&, const TensorPart&) = default;
};

// The model as the trainer streams it, with who holds what: the same on both sides.
struct ShardedStream {
  std::vector<TensorMeta> tensors;  // stream (metadata) order, group-contiguous
  std::vector<int> group_lens;      // tensors per group, in order
  Ownership ownership;
  int num_producers = 1;
  // Empty, or by tensor: its parts, ascending and covering its dim 0 without gaps; an
  // empty list means the tensor is held whole by its name_owner_class. A worker's slice
  // of a split tensor comes in one sub-slice per part it touches, each from that part's
  // owners.
  std::vector<std::vector<TensorPart>> parts;
  bool split() const;  // whether any tensor has parts
};

// OK when the stream is well formed: group_lens positive and summing to the tensor
// count, one class per tensor, classes within owner_sets, owner sets non-empty, ranks
// in [0, num_producers), ascending, no duplicates; parts (when given, one list per
// tensor) of tensors with at least one dimension, non-empty, ascending, covering dim 0
// exactly, their classes within owner_sets. InvalidArgument naming what is wrong.
Status CheckShardedStream(const ShardedStream& stream);

// Per tensor, the ranks' held rows: `rows[r][i]` is trainer rank r's [begin, end) of
// dim 0 of tensor i, or nullopt where it holds all of it (or none: held[r][i] false).
// The parts of the tensors some holder holds only rows of: cut at every holder's bounds,
// each part owned by the holders covering it, its class added to `ownership` (whose
// classes come from ResolveOwnership over `held`). InvalidArgument naming a tensor whose
// rows no rank holds or a range outside dim 0. Empty when no rank holds a part.
using HeldRowsByRank = std::vector<std::vector<std::optional<std::pair<int64_t, int64_t>>>>;
Result<std::vector<std::vector<TensorPart>>> ResolveParts(const std::vector<TensorMeta>& tensors,
                                                          const std::vector<std::vector<bool>>& held,
                                                          const HeldRowsByRank& rows, Ownership& ownership);

// The bytes of a packed piece (its runs back to back) whose HF bytes lie below `hf`
// (a byte offset in the HF tensor): where a dim-0 part's bytes begin in the piece.
size_t PackedBytesBelow(const PieceRuns& runs, size_t hf);

// Where one consumer sits: its fleet-global id and its routing block (its deployment).
struct ConsumerSpot {
  int consumer = 0;     // fleet-global id
  int block_index = 0;  // dp_index * tp + tp_rank within its deployment
  int block_size = 1;   // workers of its deployment (tp * dp)
};

struct PlanSlice {
  int tensor = 0;     // index into ShardedStream::tensors
  int param = 0;      // index into the consumer's ShardingTable::params()
  int piece = 0;      // index into that parameter's pieces
  size_t offset = 0;  // in the chunk; a multiple of 16
  size_t bytes = 0;   // the piece's runs: count * run_bytes (a sub-slice: its share)
  // A sub-slice (a split tensor's part): where its bytes begin in the packed piece. A
  // slice is the whole piece when begin is 0 and bytes is count * run_bytes.
  size_t begin = 0;
  friend bool operator==(const PlanSlice&, const PlanSlice&) = default;
};

struct PlanChunk {
  int group = 0;
  int owner_class = 0;
  int producer = 0;  // trainer rank
  size_t bytes = 0;  // the end of its last slice
  std::vector<PlanSlice> slices;
  friend bool operator==(const PlanChunk&, const PlanChunk&) = default;
};

struct ConsumerPlan {
  int consumer = 0;
  // The worker's table (ShardingTable::tp_rank / tp_size). A slice names a parameter and
  // a piece, not the HF rows it takes: equal chunks hold the same bytes only for workers
  // of one table, so PlanProducer shares a send only between plans where these agree.
  int tp_rank = 0;
  int tp_size = 1;
  std::vector<PlanChunk> chunks;  // group order, then owner class
  std::string body_digest;        // hex SHA-256 of the body's canonical form (sharded_plan.cc)
  std::string digest;             // ConsumerDigest(body_digest, spot, tp)
  size_t bytes() const;           // every chunk's bytes
  size_t max_chunk_bytes() const;
};

// A stream checked once against a model's tensors (the catalog its workers' tables share),
// for planning many consumers of it: each stream tensor's index in the catalog and back.
struct StreamIndex {
  std::shared_ptr<const HfCatalog> catalog;
  std::vector<int> hf_of;      // by stream position: index into catalog->tensors()
  std::vector<int> stream_of;  // by catalog index: stream position, or -1
  // Hex SHA-256 of the stream's tensors (names, dtypes, shapes, in order), which plan
  // digests refer to by index.
  std::string tensors_digest;
};

// InvalidArgument, each message prefixed by `who`, naming a stream tensor the model does
// not have, has with another dtype or shape, or that the stream names twice.
Result<StreamIndex> IndexStream(const ShardedStream& stream, std::shared_ptr<const HfCatalog> catalog,
                                std::string_view who = "stream");

// The plan of the worker `table` describes, at `spot`. The stream must pass
// CheckShardedStream and the spot must lie in its block (0 <= block_index < block_size,
// consumer >= 0). Every tensor the table has pieces of must be in the stream once, with
// the table's dtype and shape (else InvalidArgument naming it); stream tensors the worker
// keeps nothing of are skipped; a stream tensor the model does not have, or one named
// twice, is InvalidArgument naming it.
Result<ConsumerPlan> PlanConsumer(const ShardedStream& stream, const ShardingTable& table,
                                  const ConsumerSpot& spot);
// The same plan, from a stream indexed once against table.catalog() (else InvalidArgument):
// its cost grows with the worker's pieces, not with the model's tensors. `digest` false
// leaves ConsumerPlan::digest empty (for a caller that needs the plan's sizes, not its
// agreement with a peer).
Result<ConsumerPlan> PlanConsumer(const ShardedStream& stream, const StreamIndex& index, const ShardingTable& table,
                                  const ConsumerSpot& spot, bool digest = true);

// The digest of the plan with body digest `body_digest` and table `tp_rank`/`tp_size`,
// for the consumer at `spot`: hex SHA-256 of
//   wsync-sharded-plan 2\nconsumer <id> block <index> <size> tp <rank> <size>\nbody <body_digest>\n
std::string ConsumerDigest(std::string_view body_digest, const ConsumerSpot& spot, int tp_rank, int tp_size);

// One packed buffer a producer sends for one group, to each consumer listed.
struct ProducerSend {
  int group = 0;
  std::vector<int> consumers;  // fleet-global ids, ascending
  std::vector<int> chunks;     // for each consumer, the chunk's index in its plan (the tag)
  // Where the layout lives: plans[plan].chunks[chunk] of the `plans` PlanProducer got
  // (any sharer's; all are identical).
  int plan = 0;
  int chunk = 0;
  size_t bytes = 0;
};

struct ProducerPlan {
  int producer = 0;
  std::vector<std::vector<ProducerSend>> by_group;  // indexed by group
  size_t max_group_bytes = 0;  // the largest sum of one group's distinct packed buffers
  size_t bytes_sent = 0;       // per sync, each consumer's copy counted
};

// What `producer` sends, from every consumer's plan (indexed by position in `plans`,
// whose `consumer` fields are the ids). `num_groups` sizes by_group; every chunk's group
// must lie in [0, num_groups) (the plans come from PlanConsumer over one stream). Sends
// of a group are listed in order of their first sharer (plan order, then chunk order).
ProducerPlan PlanProducer(int producer, int num_groups, const std::vector<ConsumerPlan>& plans);
// The same, where plans[p] is the plan of every consumer in consumers[p] (ids, any
// order; plans[p].consumer is not read): what PlanProducer over one plan per consumer
// gives, with ProducerSend::plan indexing `plans`. consumers.size() == plans.size().
ProducerPlan PlanProducer(int producer, int num_groups, const std::vector<ConsumerPlan>& plans,
                          const std::vector<std::vector<int>>& consumers);

// Copies slice `s` of a consumer whose table is `table` out of its HF tensor's bytes
// (`hf`, the whole tensor, host memory) into `chunk` at s.offset (host memory): the
// piece's runs (ShardingTable::Runs) back to back, s.bytes in all. `s` must come from a
// plan made with `table`.
void PackSliceHost(const ShardingTable& table, const PlanSlice& s, const std::byte* hf, std::byte* chunk);

// Copies packed bytes [begin, begin + bytes) of the piece `runs` describes (a sub-slice)
// into `dst`, from `rows`: the HF tensor's bytes from byte `first_byte` on (a rank's rows
// of it), which must hold every byte the range reads. Host memory.
void PackPartHost(const PieceRuns& runs, size_t begin, size_t bytes, size_t first_byte, const std::byte* rows,
                  std::byte* dst);

}  // namespace wsync
