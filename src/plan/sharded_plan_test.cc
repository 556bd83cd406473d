#include "plan/sharded_plan.h"
#include "plan/fleet_plan.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "model/worker_store.h"
#include "sources/groups.h"
#include "synthetic/synthetic.h"

namespace wsync {
namespace {

using Ints = std::vector<int>;
using Held = std::vector<std::vector<bool>>;

ModelConfig Model(const std::string& name) { return *LookupModel(name); }

// Ownership of `classes` (one class id per tensor) over `sets`, built by hand.
Ownership Own(std::vector<Ints> sets, Ints classes) { return Ownership{std::move(sets), std::move(classes)}; }

// ---------------------------------------------------------------------------------------
// Routing: SkyRL's formulas, vectors worked out by hand.

TEST(AssignProducerIndices, MoreProducersThanConsumersBindsContiguousRanges) {
  EXPECT_EQ(AssignProducerIndices(4, 2, 0), (Ints{0, 1}));
  EXPECT_EQ(AssignProducerIndices(4, 2, 1), (Ints{2, 3}));
  EXPECT_EQ(AssignProducerIndices(3, 2, 0), (Ints{0}));     // range(0, 3//2 = 1)
  EXPECT_EQ(AssignProducerIndices(3, 2, 1), (Ints{1, 2}));  // range(1, 6//2 = 3)
  EXPECT_EQ(AssignProducerIndices(5, 3, 0), (Ints{0}));     // range(0, 5//3 = 1)
  EXPECT_EQ(AssignProducerIndices(5, 3, 1), (Ints{1, 2}));  // range(1, 10//3 = 3)
  EXPECT_EQ(AssignProducerIndices(5, 3, 2), (Ints{3, 4}));  // range(3, 15//3 = 5)
  EXPECT_EQ(AssignProducerIndices(2, 2, 1), (Ints{1}));
  EXPECT_EQ(AssignProducerIndices(4, 1, 0), (Ints{0, 1, 2, 3}));
}

TEST(AssignProducerIndices, FewerProducersThanConsumersBindsOnePosition) {
  // [c*2//4]: 0, 0, 1, 1.
  EXPECT_EQ(AssignProducerIndices(2, 4, 0), (Ints{0}));
  EXPECT_EQ(AssignProducerIndices(2, 4, 1), (Ints{0}));
  EXPECT_EQ(AssignProducerIndices(2, 4, 2), (Ints{1}));
  EXPECT_EQ(AssignProducerIndices(2, 4, 3), (Ints{1}));
  // [c*3//5]: 0, 0, 1, 1, 2.
  const Ints want = {0, 0, 1, 1, 2};
  for (int c = 0; c < 5; ++c) EXPECT_EQ(AssignProducerIndices(3, 5, c), (Ints{want[c]})) << c;
  EXPECT_EQ(AssignProducerIndices(1, 3, 2), (Ints{0}));
}

TEST(AssignProducerIndices, OutOfRangeArgumentsBindNothing) {
  EXPECT_TRUE(AssignProducerIndices(0, 2, 0).empty());
  EXPECT_TRUE(AssignProducerIndices(2, 0, 0).empty());
  EXPECT_TRUE(AssignProducerIndices(2, 2, 2).empty());
  EXPECT_TRUE(AssignProducerIndices(2, 2, -1).empty());
}

// Five tensors in groups [2, 1, 2]: tensors 0,1 in group 0, tensor 2 in group 1, 3,4 in 2.
const Ints kGroups = {2, 1, 2};

// ProducerFor(consumer, t) for every tensor t.
Ints Producers(const RdtRouter& r, int consumer) {
  Ints out;
  for (int t = 0; t < 5; ++t) out.push_back(r.ProducerFor(consumer, t));
  return out;
}

TEST(RdtRouter, FourProducersTwoConsumersRotatesPerGroup) {
  // One class held by all 4; block 2: consumer 0 binds [0, 1], consumer 1 binds [2, 3];
  // group g takes entry g % 2.
  RdtRouter r = *RdtRouter::Create(4, 2, Own({{0, 1, 2, 3}}, {0, 0, 0, 0, 0}), kGroups);
  EXPECT_EQ(Producers(r, 0), (Ints{0, 0, 1, 0, 0}));
  EXPECT_EQ(Producers(r, 1), (Ints{2, 2, 3, 2, 2}));
  EXPECT_EQ(r.GroupOwners(0), (Ints{0, 1, 2, 3}));
}

TEST(RdtRouter, TwoProducersFourConsumers) {
  // [c*2//4] = 0, 0, 1, 1 whatever the group.
  RdtRouter r = *RdtRouter::Create(2, 4, Own({{0, 1}}, {0, 0, 0, 0, 0}), kGroups);
  EXPECT_EQ(Producers(r, 0), (Ints{0, 0, 0, 0, 0}));
  EXPECT_EQ(Producers(r, 1), (Ints{0, 0, 0, 0, 0}));
  EXPECT_EQ(Producers(r, 2), (Ints{1, 1, 1, 1, 1}));
  EXPECT_EQ(Producers(r, 3), (Ints{1, 1, 1, 1, 1}));
}

TEST(RdtRouter, ThreeProducersTwoConsumers) {
  // Consumer 0 binds [0]; consumer 1 binds [1, 2] and rotates 1, 2, 1 over the groups.
  RdtRouter r = *RdtRouter::Create(3, 2, Own({{0, 1, 2}}, {0, 0, 0, 0, 0}), kGroups);
  EXPECT_EQ(Producers(r, 0), (Ints{0, 0, 0, 0, 0}));
  EXPECT_EQ(Producers(r, 1), (Ints{1, 1, 2, 1, 1}));
}

TEST(RdtRouter, WorkersPerReplicaCarvesTheBlockPerDeployment) {
  const Ownership fsdp = Own({{0, 1, 2, 3}}, {0, 0, 0, 0, 0});
  // Without carving, 4 consumers over 4 owners bind one each.
  RdtRouter whole = *RdtRouter::Create(4, 4, fsdp, kGroups);
  for (int c = 0; c < 4; ++c) EXPECT_EQ(Producers(whole, c), Ints(5, c)) << c;
  // Deployments of 2: consumers 0 and 2 are worker 0 of their replica, 1 and 3 worker 1.
  RdtRouter carved = *RdtRouter::Create(4, 4, fsdp, kGroups, /*workers_per_replica=*/2);
  EXPECT_EQ(Producers(carved, 0), (Ints{0, 0, 1, 0, 0}));
  EXPECT_EQ(Producers(carved, 2), Producers(carved, 0));
  EXPECT_EQ(Producers(carved, 1), (Ints{2, 2, 3, 2, 2}));
  EXPECT_EQ(Producers(carved, 3), Producers(carved, 1));
  // workers_per_replica past the fleet is the whole fleet.
  RdtRouter big = *RdtRouter::Create(4, 4, fsdp, kGroups, 8);
  for (int c = 0; c < 4; ++c) EXPECT_EQ(Producers(big, c), Producers(whole, c)) << c;
}

TEST(RdtRouter, ClassesOfAPipelineAndGroupOwners) {
  // pp2 x tp2: ranks {0, 1} hold groups 0 and 1, ranks {2, 3} group 2; tensor 2 is also
  // held by every rank (a tied name), a class of its own.
  RdtRouter r = *RdtRouter::Create(4, 2, Own({{0, 1}, {0, 1, 2, 3}, {2, 3}}, {0, 0, 1, 2, 2}), kGroups);
  // Consumer 0: class 0 -> Assign(2, 2, 0) = [0] -> rank 0; class 1 (group 1) -> [0, 1]
  // entry 1 -> rank 1; class 2 -> rank 2. Consumer 1: ranks 1, 3 (entry 1 of [2, 3]), 3.
  EXPECT_EQ(Producers(r, 0), (Ints{0, 0, 1, 2, 2}));
  EXPECT_EQ(Producers(r, 1), (Ints{1, 1, 3, 3, 3}));
  EXPECT_EQ(r.GroupOwners(0), (Ints{0, 1}));
  EXPECT_EQ(r.GroupOwners(1), (Ints{0, 1, 2, 3}));
  EXPECT_EQ(r.GroupOwners(2), (Ints{2, 3}));
  EXPECT_TRUE(r.GroupOwners(3).empty());
  EXPECT_EQ(r.ProducerFor(2, 0), -1);
  EXPECT_EQ(r.ProducerFor(0, 5), -1);
}

TEST(RdtRouter, EveryNameOfAGroupAndClassComesFromOneProducer) {
  const int P = 5, C = 3;
  Ints classes(5, 0);
  RdtRouter r = *RdtRouter::Create(P, C, Own({{0, 1, 2, 3, 4}}, classes), kGroups);
  for (int c = 0; c < C; ++c) {
    EXPECT_EQ(r.ProducerFor(c, 0), r.ProducerFor(c, 1)) << c;
    EXPECT_EQ(r.ProducerFor(c, 3), r.ProducerFor(c, 4)) << c;
  }
}

TEST(RdtRouter, RejectsBadGeometry) {
  const Ownership fsdp = Own({{0, 1}}, {0, 0, 0, 0, 0});
  auto wpr = RdtRouter::Create(2, 4, fsdp, kGroups, 3);
  EXPECT_EQ(wpr.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(wpr.status().message().find("workers_per_replica 3 does not divide the 4 consumers"), std::string::npos)
      << wpr.status().ToString();
  auto outside = RdtRouter::Create(2, 2, Own({{0, 2}}, {0, 0, 0, 0, 0}), kGroups);
  EXPECT_NE(outside.status().message().find("owner set 0 names rank 2, outside [0, 2)"), std::string::npos)
      << outside.status().ToString();
  auto empty = RdtRouter::Create(2, 2, Own({{0}, {}}, {0, 0, 0, 1, 1}), kGroups);
  EXPECT_NE(empty.status().message().find("owner set 1 is empty"), std::string::npos) << empty.status().ToString();
  auto klass = RdtRouter::Create(2, 2, Own({{0}}, {0, 0, 0, 1, 0}), kGroups);
  EXPECT_NE(klass.status().message().find("tensor 3 has owner class 1, outside [0, 1)"), std::string::npos)
      << klass.status().ToString();
  auto lens = RdtRouter::Create(2, 2, fsdp, {2, 2});
  EXPECT_NE(lens.status().message().find("the 2 groups hold 4 tensors, the stream has 5"), std::string::npos)
      << lens.status().ToString();
  EXPECT_EQ(RdtRouter::Create(2, 0, fsdp, kGroups).status().code(), StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------------------------------
// Ownership and the metadata digest.

TEST(ResolveOwnership, ClassesNumberedByFirstAppearance) {
  const std::vector<std::string> names = {"a", "b", "c", "d", "e"};
  const Held held = {{true, false, true, true, false},  //
                     {false, true, true, true, true},
                     {false, true, false, true, true}};
  Ownership own = *ResolveOwnership(names, held);
  // a:{0} b:{1,2} c:{0,1} d:{0,1,2} e:{1,2} (class 1 again).
  EXPECT_EQ(own.owner_sets, (std::vector<Ints>{{0}, {1, 2}, {0, 1}, {0, 1, 2}}));
  EXPECT_EQ(own.name_owner_class, (Ints{0, 1, 2, 3, 1}));
}

TEST(ResolveOwnership, FsdpIsOneClass) {
  const std::vector<std::string> names = {"a", "b", "c"};
  Ownership own = *ResolveOwnership(names, Held(3, std::vector<bool>(3, true)));
  EXPECT_EQ(own.owner_sets, (std::vector<Ints>{{0, 1, 2}}));
  EXPECT_EQ(own.name_owner_class, (Ints{0, 0, 0}));
}

TEST(ResolveOwnership, MegatronLikeStagesAndExperts) {
  // tp2 pp2: ranks 0,1 own stage 0 (pre, layer 0), ranks 2,3 stage 1 (layer 1, post).
  const std::vector<std::string> names = {"embed", "l0.q", "l0.k", "l1.q", "l1.k", "norm"};
  const Held held = {{1, 1, 1, 0, 0, 0}, {1, 1, 1, 0, 0, 0}, {0, 0, 0, 1, 1, 1}, {0, 0, 0, 1, 1, 1}};
  Ownership own = *ResolveOwnership(names, held);
  EXPECT_EQ(own.owner_sets, (std::vector<Ints>{{0, 1}, {2, 3}}));
  EXPECT_EQ(own.name_owner_class, (Ints{0, 0, 0, 1, 1, 1}));
  // ep2: the router is replicated, experts 0 and 1 live on rank 0 and 1 respectively.
  const std::vector<std::string> moe = {"gate", "experts.0.w", "experts.1.w"};
  Ownership ep = *ResolveOwnership(moe, {{1, 1, 0}, {1, 0, 1}});
  EXPECT_EQ(ep.owner_sets, (std::vector<Ints>{{0, 1}, {0}, {1}}));
  EXPECT_EQ(ep.name_owner_class, (Ints{0, 1, 2}));
}

TEST(ResolveOwnership, OrphanNamesEmptyRanksAndShortRowsAreErrors) {
  const std::vector<std::string> names = {"a", "model.norm.weight", "c"};
  auto orphan = ResolveOwnership(names, {{true, false, true}, {true, false, false}});
  EXPECT_EQ(orphan.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(orphan.status().message(), "no trainer rank holds tensor model.norm.weight");
  auto idle = ResolveOwnership(names, {{true, true, true}, {false, false, false}});
  EXPECT_EQ(idle.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(idle.status().message(), "trainer rank 1 holds none of the 3 tensors");
  auto row = ResolveOwnership(names, {{true, true, true}, {true, true}});
  EXPECT_EQ(row.status().message(), "trainer rank 1 states 2 held flags for 3 tensors");
  EXPECT_EQ(ResolveOwnership(names, {}).status().code(), StatusCode::kInvalidArgument);
}

TEST(MetadataDigest, MatchesSkyRLsFormula) {
  // /usr/bin/python3: hashlib.sha256((str(len(n)) + "\n" + "\n".join(n)).encode()).hexdigest()[:16]
  EXPECT_EQ(MetadataDigest({"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "lm_head.weight"}),
            "e41d6397e4b417b6");
  EXPECT_EQ(MetadataDigest({}), "9a271f2a916b0b6e");
  EXPECT_NE(MetadataDigest({"a", "b"}), MetadataDigest({"b", "a"}));
}

// ---------------------------------------------------------------------------------------
// Streams of registered models.

std::vector<std::string> Names(const std::vector<TensorMeta>& metas) {
  std::vector<std::string> n;
  for (const TensorMeta& m : metas) n.push_back(m.name);
  return n;
}

Ints GroupLens(const std::vector<TensorMeta>& metas) {
  auto groups = LayerGroups(Names(metas));
  EXPECT_TRUE(groups.ok()) << groups.status().ToString();
  Ints lens;
  for (const LayerGroup& g : *groups) lens.push_back(static_cast<int>(g.size()));
  return lens;
}

ShardedStream MakeStream(std::vector<TensorMeta> tensors, const Held& held) {
  ShardedStream s;
  s.group_lens = GroupLens(tensors);
  auto own = ResolveOwnership(Names(tensors), held);
  EXPECT_TRUE(own.ok()) << own.status().ToString();
  s.ownership = *own;
  s.tensors = std::move(tensors);
  s.num_producers = static_cast<int>(held.size());
  return s;
}

Held Fsdp(int ranks, size_t tensors) { return Held(ranks, std::vector<bool>(tensors, true)); }

// pp stages x tp ranks (rank = stage * tp + t): stage s holds a contiguous share of the
// groups; with `ep` > 1 the ep ranks of a stage split each layer's experts.
Held Megatron(const std::vector<TensorMeta>& tensors, int tp, int pp, int ep = 1) {
  const Ints lens = GroupLens(tensors);
  Held held(tp * pp * ep, std::vector<bool>(tensors.size(), false));
  size_t i = 0;
  for (size_t g = 0; g < lens.size(); ++g) {
    const int stage = static_cast<int>(g * pp / lens.size());
    for (int k = 0; k < lens[g]; ++k, ++i) {
      const std::string& n = tensors[i].name;
      const size_t at = n.find(".experts.");
      for (int e = 0; e < ep; ++e) {
        bool mine = true;
        if (at != std::string::npos) {
          const int expert = std::stoi(n.substr(at + 9));
          mine = expert % ep == e;
        }
        for (int t = 0; t < tp; ++t) held[(stage * ep + e) * tp + t][i] = mine;
      }
    }
  }
  return held;
}

// The full HF tensors of a stream, synthetic.
std::vector<std::vector<std::byte>> FullTensors(const std::vector<TensorMeta>& tensors, uint64_t seed) {
  std::vector<std::vector<std::byte>> out;
  for (const TensorMeta& m : tensors) {
    out.emplace_back(m.nbytes());
    GenerateInitial(seed, m, out.back(), 1);
  }
  return out;
}

// Rows of the vocab-parallel params that are padding (past vocab_size): no slice covers
// them.
bool IsPadding(const ShardingTable& t, const WorkerParam& p, size_t byte) {
  if (p.meta.name != "model.embed_tokens.weight" && p.meta.name != "lm_head.weight") return false;
  const int64_t row_bytes = p.meta.shape[1] * static_cast<int64_t>(ItemSize(p.meta.dtype));
  const int64_t row = t.tp_rank() * p.meta.shape[0] + static_cast<int64_t>(byte) / row_bytes;
  return row >= t.config().vocab_size;
}

// The plan of worker `spot` is sound: chunks in (group, class) order with the routed
// producer, slices of their group and class, 16-byte aligned and packed in order; every
// parameter byte is covered exactly once (padding never); packing each chunk from the
// full tensors and landing it through LoadPiece gives the same shards as Load() of the
// full tensors. Adds the padding bytes it saw to `*padding_bytes`.
void CheckPlanLands(const ShardedStream& stream, const ShardingTable& table, const ConsumerSpot& spot,
                    const ConsumerPlan& plan, const std::vector<std::vector<std::byte>>& full,
                    size_t* padding_bytes = nullptr) {
  SCOPED_TRACE(fmt::format("{} tp{}/{} consumer {}", table.config().name, table.tp_rank(), table.tp_size(),
                           spot.consumer));
  Ints group_begin = {0};
  for (int len : stream.group_lens) group_begin.push_back(group_begin.back() + len);

  std::vector<std::vector<uint8_t>> covered;
  for (const WorkerParam& p : table.params()) covered.emplace_back(p.meta.nbytes(), 0);

  auto landed = *WorkerStore::Create(table.config(), table.tp_rank(), table.tp_size());
  std::pair<int, int> last{-1, -1};
  for (const PlanChunk& chunk : plan.chunks) {
    ASSERT_LT(last, std::make_pair(chunk.group, chunk.owner_class));
    last = {chunk.group, chunk.owner_class};
    const Ints& owners = stream.ownership.owner_sets[chunk.owner_class];
    const Ints bound = AssignProducerIndices(static_cast<int>(owners.size()), spot.block_size, spot.block_index);
    EXPECT_EQ(chunk.producer, owners[bound[chunk.group % bound.size()]]);
    ASSERT_FALSE(chunk.slices.empty());
    std::vector<std::byte> buffer(chunk.bytes, std::byte{0x5a});
    size_t end = 0;
    for (const PlanSlice& s : chunk.slices) {
      EXPECT_GE(s.tensor, group_begin[chunk.group]);
      EXPECT_LT(s.tensor, group_begin[chunk.group + 1]);
      EXPECT_EQ(stream.ownership.name_owner_class[s.tensor], chunk.owner_class);
      EXPECT_EQ(s.offset % 16, 0u);
      EXPECT_EQ(s.offset, (end + 15) / 16 * 16);
      const PieceRuns r = table.Runs(s.param, s.piece);
      EXPECT_EQ(s.bytes, static_cast<size_t>(r.count * r.run_bytes));
      EXPECT_EQ(table.params()[s.param].pieces[s.piece].hf_name, stream.tensors[s.tensor].name);
      end = s.offset + s.bytes;
      PackSliceHost(table, s, full[s.tensor].data(), buffer.data());
      for (int64_t k = 0; k < r.count; ++k) {
        for (int64_t b = 0; b < r.run_bytes; ++b) ++covered[s.param][r.dst_offset + k * r.dst_stride + b];
      }
      ASSERT_TRUE(
          landed->LoadPiece(s.param, s.piece, std::span(buffer).subspan(s.offset, s.bytes), Device{}).ok());
    }
    EXPECT_EQ(chunk.bytes, end);
    ASSERT_TRUE(landed->ChunkLanded().ok());
  }
  EXPECT_EQ(plan.bytes(), [&] {
    size_t n = 0;
    for (const PlanChunk& c : plan.chunks) n += c.bytes;
    return n;
  }());

  auto loaded = *WorkerStore::Create(table.config(), table.tp_rank(), table.tp_size());
  for (size_t i = 0; i < stream.tensors.size(); ++i) {
    const TensorMeta& m = stream.tensors[i];
    ASSERT_TRUE(loaded->Load(TensorRef{m.name, m.dtype, m.shape, full[i], Device{}}).ok()) << m.name;
  }
  for (size_t p = 0; p < table.params().size(); ++p) {
    const WorkerParam& wp = table.params()[p];
    size_t wrong = 0, padding = 0;
    for (size_t b = 0; b < covered[p].size(); ++b) {
      const bool pad = IsPadding(table, wp, b);
      padding += pad;
      wrong += covered[p][b] != (pad ? 0 : 1);
    }
    EXPECT_EQ(wrong, 0u) << wp.meta.name << " has bytes covered other than once (padding: " << padding << ")";
    if (padding_bytes) *padding_bytes += padding;
    ASSERT_EQ(std::memcmp(landed->params()[p].storage.data(), loaded->params()[p].storage.data(), wp.meta.nbytes()), 0)
        << wp.meta.name;
  }
}

// Returns the padding bytes across the TP group.
size_t CheckEveryWorker(const ModelConfig& config, int tp, const Held& held) {
  ShardedStream stream = MakeStream(HfTensors(config), held);
  const auto full = FullTensors(stream.tensors, 7);
  size_t padding = 0;
  for (int r = 0; r < tp; ++r) {
    ShardingTable table = *ShardingTable::Build(config, r, tp);
    const ConsumerSpot spot{r, r, tp};
    auto plan = PlanConsumer(stream, table, spot);
    EXPECT_TRUE(plan.ok()) << plan.status().ToString();
    if (!plan.ok()) return padding;
    CheckPlanLands(stream, table, spot, *plan, full, &padding);
    EXPECT_EQ(plan->consumer, r);
    EXPECT_EQ(plan->tp_rank, r);
    EXPECT_EQ(plan->tp_size, tp);
    EXPECT_EQ(plan->digest.size(), 64u);
  }
  return padding;
}

TEST(PlanConsumer, DenseTp124FromFsdpAndPipelineCoversEveryShardByte) {
  const ModelConfig c = Model("qwen3-tiny");
  const size_t n = HfTensors(c).size();
  for (int tp : {1, 2, 4}) {
    EXPECT_EQ(CheckEveryWorker(c, tp, Fsdp(3, n)), 0u);
    EXPECT_EQ(CheckEveryWorker(c, tp, Megatron(HfTensors(c), 2, 2)), 0u);
  }
}

TEST(PlanConsumer, MoeTp124FromExpertParallelRanksCoversEveryShardByte) {
  const ModelConfig c = Model("qwen3-moe-tiny");
  for (int tp : {1, 2, 4}) {
    SCOPED_TRACE(tp);
    CheckEveryWorker(c, tp, Megatron(HfTensors(c), 2, 2, 2));  // tp2 pp2 ep2: 8 ranks
    CheckEveryWorker(c, tp, Fsdp(2, HfTensors(c).size()));
  }
}

// FSDP's dim-0 shards: rank r of `ranks` holds torch.chunk's rows of every tensor.
HeldRowsByRank ChunkRows(const std::vector<TensorMeta>& tensors, int ranks) {
  HeldRowsByRank rows(ranks, std::vector<std::optional<std::pair<int64_t, int64_t>>>(tensors.size()));
  for (size_t i = 0; i < tensors.size(); ++i) {
    const int64_t extent = tensors[i].shape.empty() ? 1 : tensors[i].shape[0];
    const int64_t size = (extent + ranks - 1) / ranks;
    for (int r = 0; r < ranks; ++r) {
      const int64_t b = std::min(extent, r * size), e = std::min(extent, b + size);
      if (!tensors[i].shape.empty()) rows[r][i] = std::make_pair(b, e);
    }
  }
  return rows;
}

TEST(PlanConsumer, RowPartsFromEachRankLandEveryShardByte) {
  for (const char* model : {"qwen3-tiny", "qwen3-moe-tiny"}) {
    const ModelConfig c = Model(model);
    const std::vector<TensorMeta> tensors = HfTensors(c);
    for (int ranks : {2, 3, 4}) {
      SCOPED_TRACE(fmt::format("{} from {} ranks", model, ranks));
      HeldRowsByRank rows = ChunkRows(tensors, ranks);
      Held held(ranks, std::vector<bool>(tensors.size(), false));
      for (int r = 0; r < ranks; ++r) {
        for (size_t i = 0; i < tensors.size(); ++i) {
          held[r][i] = !rows[r][i] || rows[r][i]->second > rows[r][i]->first;
          if (!held[r][i]) rows[r][i].reset();
        }
      }
      ShardedStream stream = MakeStream(tensors, held);
      auto parts = ResolveParts(tensors, held, rows, stream.ownership);
      ASSERT_TRUE(parts.ok()) << parts.status().ToString();
      stream.parts = *parts;
      ASSERT_TRUE(stream.split());
      ASSERT_TRUE(CheckShardedStream(stream).ok()) << CheckShardedStream(stream).ToString();
      const auto full = FullTensors(tensors, 11);
      for (int tp : {1, 2, 4}) {
        for (int w = 0; w < tp; ++w) {
          ShardingTable table = *ShardingTable::Build(c, w, tp);
          auto plan = PlanConsumer(stream, table, {w, w, tp});
          ASSERT_TRUE(plan.ok()) << plan.status().ToString();
          auto landed = *WorkerStore::Create(c, w, tp);
          std::map<std::pair<int, int>, std::pair<std::vector<std::byte>, size_t>> partial;
          for (const PlanChunk& chunk : plan->chunks) {
            const Ints& owners = stream.ownership.owner_sets[chunk.owner_class];
            ASSERT_TRUE(std::count(owners.begin(), owners.end(), chunk.producer));
            std::vector<std::byte> buffer(chunk.bytes);
            for (const PlanSlice& s : chunk.slices) {
              // Packed by the producer from its own rows only.
              const auto& mine = rows[chunk.producer][s.tensor];
              const TensorMeta& m = tensors[s.tensor];
              const size_t first = mine ? m.nbytes() / m.shape[0] * mine->first : 0;
              const size_t last = mine ? m.nbytes() / m.shape[0] * mine->second : m.nbytes();
              std::vector<std::byte> own(full[s.tensor].begin() + first, full[s.tensor].begin() + last);
              const PieceRuns r = table.Runs(s.param, s.piece);
              PackPartHost(r, s.begin, s.bytes, first, own.data(), buffer.data() + s.offset);
              auto& [bytes, got] = partial[{s.param, s.piece}];
              bytes.resize(r.count * r.run_bytes);
              std::memcpy(bytes.data() + s.begin, buffer.data() + s.offset, s.bytes);
              got += s.bytes;
              if (got == bytes.size()) {
                ASSERT_TRUE(landed->LoadPiece(s.param, s.piece, bytes, Device{}).ok());
              }
            }
          }
          auto loaded = *WorkerStore::Create(c, w, tp);
          for (size_t i = 0; i < tensors.size(); ++i) {
            const TensorMeta& m = tensors[i];
            ASSERT_TRUE(loaded->Load(TensorRef{m.name, m.dtype, m.shape, full[i], Device{}}).ok()) << m.name;
          }
          for (size_t p = 0; p < table.params().size(); ++p) {
            ASSERT_EQ(std::memcmp(landed->params()[p].storage.data(), loaded->params()[p].storage.data(),
                                  table.params()[p].meta.nbytes()), 0)
                << table.params()[p].meta.name << " tp" << w << "/" << tp;
          }
        }
      }
    }
  }
}

TEST(ResolveParts, OverlappingHoldersShareAPartAndGapsAreNamed) {
  const std::vector<TensorMeta> tensors = {TensorMeta{"model.norm.weight", DType::kF32, {10}}};
  Held held(3, std::vector<bool>{true});
  HeldRowsByRank rows(3, std::vector<std::optional<std::pair<int64_t, int64_t>>>(1));
  rows[0][0] = std::make_pair(0, 6);
  rows[1][0] = std::make_pair(4, 10);
  rows[2][0] = std::make_pair(4, 10);
  Ownership own = *ResolveOwnership({"model.norm.weight"}, held);
  auto parts = *ResolveParts(tensors, held, rows, own);
  ASSERT_EQ(parts[0].size(), 3u);
  EXPECT_EQ(own.owner_sets[parts[0][0].owner_class], (Ints{0}));
  EXPECT_EQ(own.owner_sets[parts[0][1].owner_class], (Ints{0, 1, 2}));
  EXPECT_EQ(own.owner_sets[parts[0][2].owner_class], (Ints{1, 2}));
  EXPECT_EQ(parts[0][1], (TensorPart{4, 6, parts[0][1].owner_class}));
  rows[0][0] = std::make_pair(0, 3);
  own = *ResolveOwnership({"model.norm.weight"}, held);
  auto gap = ResolveParts(tensors, held, rows, own);
  ASSERT_FALSE(gap.ok());
  EXPECT_NE(gap.status().message().find("no trainer rank holds rows [3, 4) of model.norm.weight"), std::string::npos)
      << gap.status().message();
  // No part held by any rank: no parts at all.
  for (auto& r : rows) r[0].reset();
  own = *ResolveOwnership({"model.norm.weight"}, held);
  EXPECT_TRUE(ResolveParts(tensors, held, rows, own)->empty());
}

TEST(PackedBytesBelow, CountsThePackedBytesOfRunsBelowAnHfOffset) {
  const PieceRuns r{3, 4, 10, 16, 0, 4};  // runs at 10..14, 26..30, 42..46
  EXPECT_EQ(PackedBytesBelow(r, 0), 0u);
  EXPECT_EQ(PackedBytesBelow(r, 12), 2u);
  EXPECT_EQ(PackedBytesBelow(r, 20), 4u);
  EXPECT_EQ(PackedBytesBelow(r, 28), 6u);
  EXPECT_EQ(PackedBytesBelow(r, 100), 12u);
  const PieceRuns one{1, 40, 8, 0, 0, 0};
  EXPECT_EQ(PackedBytesBelow(one, 18), 10u);
  EXPECT_EQ(PackedBytesBelow(one, 60), 40u);
}

TEST(PlanConsumer, PaddedVocabRowsStayZero) {
  ModelConfig c = Model("qwen3-tiny");
  c.vocab_size = 4000;  // padded to 4032: 32 rows of padding at the end of the last shard
  // 32 rows of 256 bf16 in embed_tokens and in lm_head, on the last rank whatever tp.
  for (int tp : {1, 2, 4}) EXPECT_EQ(CheckEveryWorker(c, tp, Megatron(HfTensors(c), 1, 2)), 2u * 32 * 256 * 2) << tp;
}

TEST(PlanConsumer, OneChunkPerGroupAndClass) {
  const ModelConfig c = Model("qwen3-moe-tiny");
  ShardedStream stream = MakeStream(HfTensors(c), Megatron(HfTensors(c), 1, 1, 2));
  // Classes: {0, 1} (replicated), {0} (even experts), {1} (odd experts).
  ASSERT_EQ(stream.ownership.owner_sets, (std::vector<Ints>{{0, 1}, {0}, {1}}));
  ShardingTable table = *ShardingTable::Build(c, 0, 2);
  ConsumerPlan plan = *PlanConsumer(stream, table, {0, 0, 2});
  // pre (embed), 2 MoE layers with three classes each, post (norm, lm_head).
  std::vector<std::pair<int, int>> want = {{0, 0}, {1, 0}, {1, 1}, {1, 2}, {2, 0}, {2, 1}, {2, 2}, {3, 0}};
  std::vector<std::pair<int, int>> got;
  for (const PlanChunk& ch : plan.chunks) got.emplace_back(ch.group, ch.owner_class);
  EXPECT_EQ(got, want);
  // Consumer 0 of a block of 2 binds entry 0 of {0, 1}: rank 0; the expert classes have
  // one owner each.
  EXPECT_EQ(plan.chunks[1].producer, 0);
  EXPECT_EQ(plan.chunks[2].producer, 0);
  EXPECT_EQ(plan.chunks[3].producer, 1);
  // A layer's replicated class packs its tensors in stream order.
  Ints tensors;
  for (const PlanSlice& s : plan.chunks[1].slices) tensors.push_back(s.tensor);
  EXPECT_TRUE(std::is_sorted(tensors.begin(), tensors.end()));
  EXPECT_EQ(plan.max_chunk_bytes(), std::max_element(plan.chunks.begin(), plan.chunks.end(), [](auto& a, auto& b) {
                                      return a.bytes < b.bytes;
                                    })->bytes);
}

// ---------------------------------------------------------------------------------------
// Stream errors.

Status PlanError(const ShardedStream& stream, const ShardingTable& table) {
  return PlanConsumer(stream, table, {1, 1, 2}).status();
}

void ExpectInvalid(const Status& s, const std::string& part) {
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find(part), std::string::npos) << s.ToString();
}

TEST(PlanConsumer, StreamThatDoesNotMatchTheModelIsNamed) {
  const ModelConfig c = Model("qwen3-tiny");
  const std::vector<TensorMeta> hf = HfTensors(c);
  ShardingTable table = *ShardingTable::Build(c, 1, 2);
  const ShardedStream good = MakeStream(hf, Fsdp(2, hf.size()));
  ASSERT_TRUE(PlanError(good, table).ok());

  ShardedStream missing = good;  // the last group (model.norm, lm_head) loses lm_head
  missing.tensors.pop_back();
  missing.ownership.name_owner_class.pop_back();
  --missing.group_lens.back();
  ExpectInvalid(PlanError(missing, table),
                "consumer 1 (worker tp1/2 of qwen3-tiny): tensor lm_head.weight is missing from the trainer's stream");

  ShardedStream shape = good;
  shape.tensors[1].shape[0] *= 2;
  ExpectInvalid(PlanError(shape, table), "shape of " + hf[1].name + " is");

  ShardedStream dtype = good;
  dtype.tensors[2].dtype = DType::kF32;
  ExpectInvalid(PlanError(dtype, table), "dtype of " + hf[2].name + " is bfloat16, got float32");

  ShardedStream extra = good;
  extra.tensors.push_back({"model.mtp.weight", DType::kBF16, {4}});
  extra.ownership.name_owner_class.push_back(0);
  ++extra.group_lens.back();
  ExpectInvalid(PlanError(extra, table), "the model has no tensor model.mtp.weight");

  ShardedStream twice = good;
  twice.tensors[3] = twice.tensors[2];
  ExpectInvalid(PlanError(twice, table), "the stream names " + hf[2].name + " twice (tensors 2 and 3)");

  EXPECT_EQ(PlanConsumer(good, table, {1, 2, 2}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanConsumer(good, table, {1, 0, 0}).status().code(), StatusCode::kInvalidArgument);
}

TEST(CheckShardedStream, NamesWhatIsWrong) {
  ShardedStream s;
  s.tensors = {{"a", DType::kBF16, {2}}, {"b", DType::kBF16, {2}}, {"c", DType::kBF16, {2}}};
  s.group_lens = {2, 1};
  s.ownership = Own({{0}, {0, 1}}, {0, 1, 1});
  s.num_producers = 2;
  ASSERT_TRUE(CheckShardedStream(s).ok());
  auto with = [&](auto edit) {
    ShardedStream t = s;
    edit(t);
    return CheckShardedStream(t);
  };
  ExpectInvalid(with([](ShardedStream& t) { t.group_lens = {2, 0, 1}; }), "group 1 has 0 tensors");
  ExpectInvalid(with([](ShardedStream& t) { t.group_lens = {2, 2}; }), "the 2 groups hold 4 tensors, the stream has 3");
  ExpectInvalid(with([](ShardedStream& t) { t.ownership.name_owner_class = {0, 1}; }),
                "ownership gives 2 tensors a class, the stream has 3");
  ExpectInvalid(with([](ShardedStream& t) { t.ownership.name_owner_class[2] = 2; }),
                "tensor 2 has owner class 2, outside [0, 2)");
  ExpectInvalid(with([](ShardedStream& t) { t.ownership.name_owner_class[0] = -1; }),
                "tensor 0 has owner class -1");
  ExpectInvalid(with([](ShardedStream& t) { t.ownership.owner_sets[0] = {}; }), "owner set 0 is empty");
  ExpectInvalid(with([](ShardedStream& t) { t.ownership.owner_sets[1] = {1, 0}; }),
                "owner set 1 is not ascending without repeats at rank 0");
  ExpectInvalid(with([](ShardedStream& t) { t.ownership.owner_sets[1] = {1, 1}; }),
                "owner set 1 is not ascending without repeats at rank 1");
  ExpectInvalid(with([](ShardedStream& t) { t.ownership.owner_sets[1] = {0, 2}; }),
                "owner set 1 names rank 2, outside [0, 2)");
  ExpectInvalid(with([](ShardedStream& t) { t.ownership.owner_sets[0] = {-1}; }), "names rank -1");
  ExpectInvalid(with([](ShardedStream& t) { t.num_producers = 0; }), "num_producers is 0");
}

// ---------------------------------------------------------------------------------------
// Digests.

TEST(PlanDigest, DeterministicAndSensitiveToWhatTheWorkerPulls) {
  const ModelConfig c = Model("qwen3-tiny");
  const std::vector<TensorMeta> hf = HfTensors(c);
  const ShardedStream fsdp = MakeStream(hf, Fsdp(4, hf.size()));
  // Both sides build their own table.
  ShardingTable trainer_side = *ShardingTable::Build(c, 1, 2);
  ShardingTable server_side = *ShardingTable::Build(c, 1, 2);
  const ConsumerSpot spot{3, 1, 2};
  const std::string base = PlanConsumer(fsdp, trainer_side, spot)->digest;
  EXPECT_EQ(PlanConsumer(fsdp, server_side, spot)->digest, base);
  EXPECT_EQ(PlanConsumer(fsdp, trainer_side, spot)->digest, base);

  // Another consumer id, same slices and producers.
  EXPECT_NE(PlanConsumer(fsdp, trainer_side, {1, 1, 2})->digest, base);
  // Other ownership: the pipeline split routes groups to other ranks.
  const ShardedStream pipeline = MakeStream(hf, Megatron(hf, 2, 2));
  EXPECT_NE(PlanConsumer(pipeline, trainer_side, spot)->digest, base);
  // Other stream order: k_proj before q_proj in layer 0 (still group-contiguous).
  std::vector<TensorMeta> swapped = hf;
  const auto q = std::find_if(swapped.begin(), swapped.end(),
                              [](const TensorMeta& m) { return m.name == "model.layers.0.self_attn.q_proj.weight"; });
  ASSERT_NE(q, swapped.end());
  ASSERT_EQ(q[1].name, "model.layers.0.self_attn.k_proj.weight");
  std::iter_swap(q, q + 1);
  EXPECT_NE(PlanConsumer(MakeStream(swapped, Fsdp(4, hf.size())), trainer_side, spot)->digest, base);
  // A tensor of another shape (a wider MLP): both sides' tables change with the model.
  ModelConfig wide = c;
  wide.intermediate_size *= 2;
  const std::vector<TensorMeta> wide_hf = HfTensors(wide);
  ShardingTable wide_table = *ShardingTable::Build(wide, 1, 2);
  const std::string wide_digest = PlanConsumer(MakeStream(wide_hf, Fsdp(4, wide_hf.size())), wide_table, spot)->digest;
  EXPECT_NE(wide_digest, base);
  EXPECT_EQ(PlanConsumer(MakeStream(wide_hf, Fsdp(4, wide_hf.size())), *ShardingTable::Build(wide, 1, 2), spot)->digest,
            wide_digest);
}

// ---------------------------------------------------------------------------------------
// Producers and slot sharing.

struct Fleet {
  std::vector<ShardingTable> tables;
  std::vector<ConsumerSpot> spots;
  std::vector<ConsumerPlan> plans;
};

// Deployments with the given TP sizes (dp 1 each), numbered in order.
Fleet MakeFleet(const ShardedStream& stream, const ModelConfig& c, const Ints& tps) {
  Fleet f;
  int offset = 0;
  for (int tp : tps) {
    for (int r = 0; r < tp; ++r) {
      f.tables.push_back(*ShardingTable::Build(c, r, tp));
      f.spots.push_back({offset + r, r, tp});
      auto plan = PlanConsumer(stream, f.tables.back(), f.spots.back());
      EXPECT_TRUE(plan.ok()) << plan.status().ToString();
      f.plans.push_back(*plan);
    }
    offset += tp;
  }
  return f;
}

// A chunk packed from the full tensors with its consumer's table.
std::vector<std::byte> Pack(const ShardingTable& table, const PlanChunk& chunk,
                            const std::vector<std::vector<std::byte>>& full) {
  std::vector<std::byte> out(chunk.bytes);
  for (const PlanSlice& s : chunk.slices) PackSliceHost(table, s, full[s.tensor].data(), out.data());
  return out;
}

// Every (consumer, chunk) is sent exactly once by its producer, and what the producer
// packs once for a send is byte for byte what each of its consumers' chunks holds.
void CheckSendsCoverPlans(const Fleet& f, int producers, int groups, const std::vector<std::vector<std::byte>>& full) {
  const std::vector<ConsumerPlan>& plans = f.plans;
  std::set<std::pair<int, int>> sent;
  for (int p = 0; p < producers; ++p) {
    ProducerPlan pp = PlanProducer(p, groups, plans);
    EXPECT_EQ(pp.producer, p);
    ASSERT_EQ(pp.by_group.size(), static_cast<size_t>(groups));
    for (int g = 0; g < groups; ++g) {
      for (const ProducerSend& s : pp.by_group[g]) {
        EXPECT_EQ(s.group, g);
        ASSERT_EQ(s.consumers.size(), s.chunks.size());
        EXPECT_TRUE(std::is_sorted(s.consumers.begin(), s.consumers.end()));
        const PlanChunk& layout = plans[s.plan].chunks[s.chunk];
        EXPECT_EQ(layout.producer, p);
        EXPECT_EQ(layout.group, g);
        EXPECT_EQ(s.bytes, layout.bytes);
        const std::vector<std::byte> packed = Pack(f.tables[s.plan], layout, full);
        for (size_t i = 0; i < s.consumers.size(); ++i) {
          const int id = s.consumers[i];  // plans are indexed by consumer id here
          ASSERT_EQ(plans[id].consumer, id);
          EXPECT_EQ(plans[id].chunks[s.chunks[i]], layout);
          EXPECT_TRUE(Pack(f.tables[id], plans[id].chunks[s.chunks[i]], full) == packed)
              << "consumer " << id << " chunk " << s.chunks[i] << " differs from the shared send";
          EXPECT_TRUE(sent.emplace(id, s.chunks[i]).second);
        }
      }
    }
  }
  size_t chunks = 0;
  for (const ConsumerPlan& cp : plans) chunks += cp.chunks.size();
  EXPECT_EQ(sent.size(), chunks);
}

TEST(PlanConsumer, UniformFleetRoutesAsRdtRouterWithWorkersPerReplica) {
  const ModelConfig c = Model("qwen3-moe-tiny");
  const std::vector<TensorMeta> hf = HfTensors(c);
  for (const Held& held : {Fsdp(4, hf.size()), Megatron(hf, 2, 1, 2), Fsdp(3, hf.size())}) {
    const ShardedStream stream = MakeStream(hf, held);
    Fleet f = MakeFleet(stream, c, {2, 2, 2});
    RdtRouter router = *RdtRouter::Create(stream.num_producers, 6, stream.ownership, stream.group_lens, 2);
    for (const ConsumerPlan& plan : f.plans) {
      for (const PlanChunk& ch : plan.chunks) {
        for (const PlanSlice& sl : ch.slices) {
          EXPECT_EQ(ch.producer, router.ProducerFor(plan.consumer, sl.tensor))
              << "consumer " << plan.consumer << " tensor " << stream.tensors[sl.tensor].name;
        }
      }
    }
  }
}

TEST(PlanProducer, ReplicasShareSlotsSoTrainerMemoryDoesNotGrowWithTheFleet) {
  const ModelConfig c = Model("qwen3-tiny");
  const std::vector<TensorMeta> hf = HfTensors(c);
  const auto full = FullTensors(hf, 5);
  for (const Held& held : {Fsdp(4, hf.size()), Megatron(hf, 2, 2)}) {
    const ShardedStream stream = MakeStream(hf, held);
    const int groups = static_cast<int>(stream.group_lens.size());
    std::vector<size_t> one_fleet_group_bytes, one_fleet_sent;
    for (int deployments : {1, 2, 4}) {
      SCOPED_TRACE(deployments);
      Fleet f = MakeFleet(stream, c, Ints(deployments, 2));
      CheckSendsCoverPlans(f, 4, groups, full);
      for (int p = 0; p < 4; ++p) {
        ProducerPlan pp = PlanProducer(p, groups, f.plans);
        if (deployments == 1) {
          one_fleet_group_bytes.push_back(pp.max_group_bytes);
          one_fleet_sent.push_back(pp.bytes_sent);
        } else {
          EXPECT_EQ(pp.max_group_bytes, one_fleet_group_bytes[p]) << "producer " << p;
          EXPECT_EQ(pp.bytes_sent, one_fleet_sent[p] * deployments) << "producer " << p;
        }
        // Consumers c and c + 2 pull identical chunks: one send serves worker w of every
        // replica.
        for (const auto& sends : pp.by_group) {
          for (const ProducerSend& s : sends) {
            ASSERT_EQ(s.consumers.size(), static_cast<size_t>(deployments));
            for (size_t i = 1; i < s.consumers.size(); ++i) EXPECT_EQ(s.consumers[i], s.consumers[i - 1] + 2);
          }
        }
      }
    }
    // Every producer sends something when 4 ranks serve TP=2 workers from one class.
    size_t total = 0;
    for (size_t b : one_fleet_sent) total += b;
    EXPECT_GT(total, 0u);
  }
}

TEST(PlanProducer, WithoutACarvedBlockReplicasDoNotShare) {
  // Two TP=2 deployments routed as one block of 4 (SkyRL without workers_per_replica):
  // each consumer binds its own owner, so no send is shared.
  const ModelConfig c = Model("qwen3-tiny");
  const std::vector<TensorMeta> hf = HfTensors(c);
  const ShardedStream stream = MakeStream(hf, Fsdp(4, hf.size()));
  Fleet f;
  for (int id = 0; id < 4; ++id) {
    f.tables.push_back(*ShardingTable::Build(c, id % 2, 2));
    f.spots.push_back({id, id, 4});
    f.plans.push_back(*PlanConsumer(stream, f.tables.back(), f.spots.back()));
  }
  const int groups = static_cast<int>(stream.group_lens.size());
  CheckSendsCoverPlans(f, 4, groups, FullTensors(hf, 5));
  for (int p = 0; p < 4; ++p) {
    ProducerPlan pp = PlanProducer(p, groups, f.plans);
    for (const auto& sends : pp.by_group) {
      for (const ProducerSend& s : sends) EXPECT_EQ(s.consumers.size(), 1u);
    }
  }
}

TEST(PlanProducer, HeterogeneousFleetTp2BesideTp1) {
  const ModelConfig c = Model("qwen3-tiny");
  const std::vector<TensorMeta> hf = HfTensors(c);
  for (const Held& held : {Fsdp(3, hf.size()), Megatron(hf, 1, 3)}) {
    const ShardedStream stream = MakeStream(hf, held);
    Fleet f = MakeFleet(stream, c, {2, 1});
    ASSERT_EQ(f.plans.size(), 3u);
    const auto full = FullTensors(hf, 11);
    for (size_t i = 0; i < f.plans.size(); ++i) CheckPlanLands(stream, f.tables[i], f.spots[i], f.plans[i], full);
    // The TP=1 worker's slices are the whole model, each HF tensor once.
    size_t slice_bytes = 0;
    for (const PlanChunk& ch : f.plans[2].chunks) {
      for (const PlanSlice& sl : ch.slices) slice_bytes += sl.bytes;
    }
    EXPECT_EQ(slice_bytes, static_cast<size_t>(ModelBytes(c)));
    CheckSendsCoverPlans(f, stream.num_producers, static_cast<int>(stream.group_lens.size()), full);
    // The two deployments differ in shape: nothing is shared across them.
    for (int p = 0; p < stream.num_producers; ++p) {
      for (const auto& sends : PlanProducer(p, static_cast<int>(stream.group_lens.size()), f.plans).by_group) {
        for (const ProducerSend& s : sends) EXPECT_EQ(s.consumers.size(), 1u);
      }
    }
  }
}

TEST(PlanProducer, WorkersOfOneDeploymentNeverShareThoughTheirSlicesLookAlike) {
  // One trainer rank serves a TP=2 deployment and a second one: rank 0 and rank 1 pull
  // the same (param, piece, offset, bytes) slices from producer 0, but of other HF rows.
  // Only the workers with the same table share.
  const ModelConfig c = Model("qwen3-tiny");
  const std::vector<TensorMeta> hf = HfTensors(c);
  const ShardedStream stream = MakeStream(hf, Fsdp(1, hf.size()));
  Fleet f = MakeFleet(stream, c, {2, 2});
  ASSERT_EQ(f.plans[0].chunks.size(), f.plans[1].chunks.size());
  EXPECT_EQ(f.plans[0].chunks[1], f.plans[1].chunks[1]);
  EXPECT_NE(f.plans[0].digest, f.plans[2].digest);  // the consumer id is in the digest
  const int groups = static_cast<int>(stream.group_lens.size());
  CheckSendsCoverPlans(f, 1, groups, FullTensors(hf, 3));
  ProducerPlan pp = PlanProducer(0, groups, f.plans);
  for (const auto& sends : pp.by_group) {
    ASSERT_EQ(sends.size(), 2u);
    EXPECT_EQ(sends[0].consumers, (Ints{0, 2}));
    EXPECT_EQ(sends[1].consumers, (Ints{1, 3}));
  }
  EXPECT_EQ(pp.bytes_sent, f.plans[0].bytes() * 2 + f.plans[1].bytes() * 2);
}

TEST(PackSliceHost, CopiesTheRunsBackToBack) {
  // A TP=2 column slice of a row-sliced tensor: o_proj is split along dim 1, so each of
  // its rows is one run.
  const ModelConfig c = Model("qwen3-tiny");
  ShardingTable t = *ShardingTable::Build(c, 1, 2);
  const std::string name = "model.layers.0.self_attn.o_proj.weight";
  ASSERT_EQ(t.PiecesOf(name).size(), 1u);
  const auto [param, piece] = t.PiecesOf(name)[0];
  const PieceRuns r = t.Runs(param, piece);
  ASSERT_GT(r.count, 1);
  const TensorMeta& m = t.hf_tensors()[t.FindHf(name)];
  std::vector<std::byte> hf(m.nbytes());
  for (size_t i = 0; i < hf.size(); ++i) hf[i] = static_cast<std::byte>(i * 7 + 3);
  const PlanSlice s{0, param, piece, 32, static_cast<size_t>(r.count * r.run_bytes)};
  std::vector<std::byte> chunk(32 + s.bytes + 16, std::byte{0xee});
  PackSliceHost(t, s, hf.data(), chunk.data());
  for (int64_t k = 0; k < r.count; ++k) {
    ASSERT_EQ(std::memcmp(chunk.data() + 32 + k * r.run_bytes, hf.data() + r.hf_offset + k * r.hf_stride,
                          r.run_bytes),
              0)
        << "run " << k;
  }
  for (size_t i = 0; i < 32; ++i) ASSERT_EQ(chunk[i], std::byte{0xee});
  for (size_t i = 32 + s.bytes; i < chunk.size(); ++i) ASSERT_EQ(chunk[i], std::byte{0xee});
}

// ---------------------------------------------------------------------------------------
// PlanFleet: one plan per shape gives what one plan per consumer gives.

// A producer's sends as (group, bytes, consumers, chunk indices), with the packed layout
// each send carries, independent of which plan list the send points into.
std::vector<std::string> SendsOf(const ProducerPlan& pp, const std::vector<ConsumerPlan>& plans) {
  std::vector<std::string> out;
  for (const auto& sends : pp.by_group) {
    for (const ProducerSend& s : sends) {
      std::string line = fmt::format("g{} {}B to", s.group, s.bytes);
      for (size_t i = 0; i < s.consumers.size(); ++i) line += fmt::format(" {}:{}", s.consumers[i], s.chunks[i]);
      for (const PlanSlice& sl : plans[s.plan].chunks[s.chunk].slices) {
        line += fmt::format(" [{} {} {} {} {}]", sl.tensor, sl.param, sl.piece, sl.offset, sl.bytes);
      }
      out.push_back(line);
    }
  }
  return out;
}

TEST(PlanFleet, SharesPlansAmongReplicasAndEqualsOnePlanPerConsumer) {
  const ModelConfig c = Model("qwen3-tiny");
  const std::vector<TensorMeta> hf = HfTensors(c);
  auto catalog = *HfCatalog::Make(c);
  for (const Held& held : {Fsdp(3, hf.size()), Megatron(hf, 2, 2)}) {
    const ShardedStream stream = MakeStream(hf, held);
    const int groups = static_cast<int>(stream.group_lens.size());
    // Two replicas of TP=2, one TP=1, one more TP=2: consumers 0-1, 2-3, 4, 5-6.
    const std::vector<FleetDeployment> deployments = {{2, 2, 0}, {2, 2, 2}, {1, 1, 4}, {2, 2, 5}};
    Fleet f;  // one plan per consumer
    for (const FleetDeployment& d : deployments) {
      for (int j = 0; j < d.workers; ++j) {
        f.tables.push_back(*ShardingTable::Build(c, j % d.tp, d.tp));
        f.spots.push_back({d.first_consumer + j, j, d.workers});
        f.plans.push_back(*PlanConsumer(stream, f.tables.back(), f.spots.back()));
      }
    }
    auto all = PlanFleet(stream, catalog, deployments, true);
    ASSERT_TRUE(all.ok()) << all.status().ToString();
    EXPECT_EQ(all->shapes.size(), 3u);  // (tp2, rank 0), (tp2, rank 1), (tp1, rank 0)
    EXPECT_EQ(all->shape_consumers[0], (Ints{0, 2, 5}));
    EXPECT_EQ(all->shape_of, (Ints{0, 1, 0, 1, 2, 0, 1}));
    size_t bytes = 0, chunks = 0;
    for (size_t i = 0; i < f.plans.size(); ++i) {
      EXPECT_EQ(all->digests[i], f.plans[i].digest) << "consumer " << i;
      bytes += f.plans[i].bytes();
      chunks += f.plans[i].chunks.size();
    }
    EXPECT_EQ(all->fleet_bytes, bytes);
    EXPECT_EQ(all->fleet_chunks, chunks);
    EXPECT_NE(all->digests[0], all->digests[2]);  // same plan, another consumer
    for (int p = 0; p < stream.num_producers; ++p) {
      const std::vector<std::string> want = SendsOf(PlanProducer(p, groups, f.plans), f.plans);
      EXPECT_EQ(SendsOf(all->Producer(p, groups), all->shapes), want) << "producer " << p;
      // Keeping one producer: its sends and their runs, nothing of the others' chunks.
      auto kept = PlanFleet(stream, catalog, deployments, false, p);
      ASSERT_TRUE(kept.ok()) << kept.status().ToString();
      EXPECT_TRUE(kept->digests.empty());
      const ProducerPlan pp = kept->Producer(p, groups);
      EXPECT_EQ(SendsOf(pp, kept->shapes), want) << "producer " << p;
      for (size_t k = 0; k < kept->shapes.size(); ++k) {
        const ConsumerPlan& shape = kept->shapes[k];
        const ShardingTable& table = f.tables[static_cast<size_t>(kept->shape_consumers[k].front())];
        for (size_t ch = 0; ch < shape.chunks.size(); ++ch) {
          const PlanChunk& chunk = shape.chunks[ch];
          EXPECT_EQ(chunk.bytes, all->shapes[k].chunks[ch].bytes);
          ASSERT_EQ(kept->runs[k][ch].size(), chunk.slices.size());
          if (chunk.producer != p) {
            EXPECT_TRUE(chunk.slices.empty());
          }
          for (size_t i = 0; i < chunk.slices.size(); ++i) {
            const PieceRuns want_runs = table.Runs(chunk.slices[i].param, chunk.slices[i].piece);
            EXPECT_EQ(kept->runs[k][ch][i].hf_offset, want_runs.hf_offset);
            EXPECT_EQ(kept->runs[k][ch][i].count, want_runs.count);
          }
        }
      }
    }
  }
}

TEST(PlanFleet, RefusesDeploymentsThatDoNotNumberTheFleet) {
  const ModelConfig c = Model("qwen3-tiny");
  const std::vector<TensorMeta> hf = HfTensors(c);
  const ShardedStream stream = MakeStream(hf, Fsdp(1, hf.size()));
  auto catalog = *HfCatalog::Make(c);
  auto gap = PlanFleet(stream, catalog, {{1, 1, 0}, {1, 1, 2}}, true);
  ASSERT_FALSE(gap.ok());
  EXPECT_NE(gap.status().message().find("numbered from 1"), std::string::npos) << gap.status().ToString();
  auto odd = PlanFleet(stream, catalog, {{2, 3, 0}}, true);
  ASSERT_FALSE(odd.ok());
  EXPECT_NE(odd.status().message().find("multiple of tp"), std::string::npos) << odd.status().ToString();
}

}  // namespace
}  // namespace wsync
