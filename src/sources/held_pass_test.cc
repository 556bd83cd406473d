// Held passes (WeightSource::IterateHeld) of trainer-rank sources, every rank a thread
// with its own Gloo communicator: each rank yields exactly its TP group's held names, bit
// for bit as the full pass yields them, from exchanges inside its TP group only; the plan
// picks one copy of every element and refuses a TP group that cannot assemble a tensor;
// a TP-group member that stalls or stops fails its own TP group only (an abandoned held
// pass: trainer_ranks_test.cc).
#include <algorithm>
#include <set>

#include "sources/held_plan.h"
#include "sources/test_util.h"
#include "testing/status_matchers.h"

namespace wsync {
namespace {

using namespace sources_test;
using ::testing::HasSubstr;
using ::wsync::testing::StatusIs;

// Bytes of the largest layer group's held tensors.
size_t LargestHeldGroup(const std::vector<TensorMeta>& meta, const std::vector<std::string>& held) {
  std::vector<std::string> names;
  for (const TensorMeta& m : meta) names.push_back(m.name);
  auto groups = LayerGroups(names);
  EXPECT_TRUE(groups.ok());
  std::set<std::string> h(held.begin(), held.end());
  size_t largest = 0;
  for (const LayerGroup& g : *groups) {
    size_t bytes = 0;
    for (size_t i = g.begin; i < g.end; ++i) bytes += h.contains(meta[i].name) ? meta[i].nbytes() : 0;
    largest = std::max(largest, bytes);
  }
  return largest;
}

// A count the rank threads wait on, for at most `seconds`: a thread that returns early on
// a failed ASSERT cannot hang the others.
class Countdown {
 public:
  explicit Countdown(int n) : left_(n) {}
  void Done() { --left_; }
  void Wait(double seconds = 30) {
    auto start = std::chrono::steady_clock::now();
    while (left_.load() > 0 && SecondsSince(start) < seconds) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    EXPECT_LE(left_.load(), 0) << "a rank thread did not arrive";
  }
  void DoneAndWait() {
    Done();
    Wait();
  }

 private:
  std::atomic<int> left_;
};

size_t ModelBytes(const std::vector<HostTensor>& full) {
  size_t bytes = 0;
  for (const HostTensor& t : full) bytes += t.meta.nbytes();
  return bytes;
}

// Every rank makes `passes` held passes (new weights before each later one, as a trainer
// step rewrites them) and checks each; returns every rank's held names.
std::vector<std::vector<std::string>> HeldRoundTrip(const ModelConfig& c, const ParallelLayout& layout,
                                                    int passes = 1) {
  std::vector<std::unique_ptr<SyntheticTrainer>> models;
  for (int p = 0; p < passes; ++p) {
    auto t = SyntheticTrainer::FromMetadata(HfTensors(c), 7 + p, 2);
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    models.push_back(std::move(*t));
  }
  std::vector<std::vector<std::string>> held(layout.world);
  RunRanks(layout, 60, [&](int rank, std::shared_ptr<Communicator> comm) {
    const std::string who = c.name + " " + layout.ToString() + " " + layout.Describe(rank);
    auto source = BuildRankSource(comm, layout, &c, models[0]->tensors(), 60);
    ASSERT_TRUE(source.ok()) << who << ": " << source.status().ToString();
    auto names = (*source)->HeldNames();
    ASSERT_TRUE(names.has_value()) << who;
    held[rank] = *names;
    for (int p = 0; p < passes; ++p) {
      if (p > 0) {
        ASSERT_OK(RefreshRankSource(**source, models[p]->tensors()));
      }
      ExpectPassEquals(**source, models[p]->tensors(), who + " pass " + std::to_string(p + 1), true);
    }
    // One group's held tensors plus their packed slices; never a whole group of the model.
    auto* memory = dynamic_cast<SourceMemory*>(source->get());
    ASSERT_NE(memory, nullptr);
    const size_t largest = LargestHeldGroup((*source)->metadata(), *names);
    EXPECT_LE(memory->peak_buffer_bytes(), (layout.tp > 1 ? 2 : 1) * largest) << who;
    EXPECT_LT(memory->peak_buffer_bytes(), ModelBytes(models[0]->tensors())) << who;
  });
  // Members of one TP group differ only in the experts each holds whole (etp 1); together
  // the ranks hold the whole model.
  std::set<std::string> all;
  auto shared = [](const std::vector<std::string>& names) {
    std::vector<std::string> out;
    for (const std::string& n : names) {
      if (n.find(".mlp.experts.") == std::string::npos) out.push_back(n);
    }
    return out;
  };
  for (int r = 0; r < layout.world; ++r) {
    all.insert(held[r].begin(), held[r].end());
    for (int m : TpGroupRanks(layout, r)) {
      if (layout.etp == 1) {
        EXPECT_EQ(shared(held[m]), shared(held[r])) << layout.Describe(r);
      } else {
        EXPECT_EQ(held[m], held[r]) << layout.Describe(r);
      }
    }
  }
  EXPECT_EQ(all.size(), HfTensors(c).size()) << c.name << " " << layout.ToString();
  return held;
}

TEST(HeldPass, MoeTp2Pp2Ep2EachRankYieldsItsHeldNames) {
  ModelConfig c = Config("qwen3-moe-tiny");
  auto layout = *ParallelLayout::Parse("tp2pp2ep2", 8);
  auto held = HeldRoundTrip(c, layout, 2);
  // Stage 0 (ranks 0-3) has the embedding and layer 0, stage 1 layer 1, norm and lm_head;
  // with etp 1 an expert stays whole on its EP rank: expert 7 (EP rank 1) on the odd ranks
  // only, although each TP group of two spans both EP ranks.
  const std::string embed = "model.embed_tokens.weight", head = "lm_head.weight";
  for (int r = 0; r < 8; ++r) {
    const bool first = r < 4;
    const auto& h = held[r];
    EXPECT_EQ(std::count(h.begin(), h.end(), embed), first ? 1 : 0) << r;
    EXPECT_EQ(std::count(h.begin(), h.end(), head), first ? 0 : 1) << r;
    const std::string expert = fmt::format("model.layers.{}.mlp.experts.7.down_proj.weight", first ? 0 : 1);
    EXPECT_EQ(std::count(h.begin(), h.end(), expert), r % 2) << r;
  }
}

TEST(HeldPass, DenseTp2Pp2WithAndWithoutReplicas) {
  HeldRoundTrip(Config("qwen3-tiny"), *ParallelLayout::Parse("tp2pp2ep1", 4), 2);
  HeldRoundTrip(Config("qwen3-tiny"), *ParallelLayout::Parse("tp2pp2ep1", 8));
  HeldRoundTrip(TinyKv4(), OneReplica("tp4pp1ep1"));
  HeldRoundTrip(Config("qwen3-tiny"), OneReplica("tp1pp2ep1"));
}

TEST(HeldPass, ExpertsAcrossTheTpGroup) {
  // etp 2: each expert's shards spread over the TP group.
  HeldRoundTrip(Config("qwen3-moe-tiny"), OneReplica("tp2pp1ep2etp2"));
  HeldRoundTrip(Config("qwen3-moe-tiny"), OneReplica("tp2pp2ep2etp2"));
  // tp 1: a TP group of one holds its own EP rank's experts only.
  auto held = HeldRoundTrip(Config("qwen3-moe-tiny"), OneReplica("tp1pp1ep2"));
  auto has = [](const std::vector<std::string>& h, const std::string& n) {
    return std::find(h.begin(), h.end(), n) != h.end();
  };
  EXPECT_TRUE(has(held[0], "model.layers.0.mlp.experts.3.up_proj.weight"));
  EXPECT_FALSE(has(held[0], "model.layers.0.mlp.experts.4.up_proj.weight"));
  EXPECT_TRUE(has(held[1], "model.layers.0.mlp.experts.4.up_proj.weight"));
  // etp < tp: expert grid and attention grid differ inside the TP group.
  HeldRoundTrip(MoeKv4(), OneReplica("tp4pp1ep2etp2"));
  HeldRoundTrip(MoeKv4(), OneReplica("tp4pp2ep1etp4"));
  HeldRoundTrip(Config("qwen3-moe-tiny"), *ParallelLayout::Parse("tp2pp1ep2", 8));
}

TEST(HeldPass, TiedEmbeddingsOverStages) {
  ModelConfig c = Config("qwen3-tiny");
  c.tie_word_embeddings = true;
  // The last stage holds the embedding through its output layer (a replica).
  auto held = HeldRoundTrip(c, *ParallelLayout::Parse("tp2pp2ep1", 4), 2);
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(std::count(held[r].begin(), held[r].end(), "model.embed_tokens.weight"), 1) << r;
  }
  HeldRoundTrip(c, *ParallelLayout::Parse("tp1pp2ep1", 2));
}

TEST(HeldPass, FsdpHeldPassIsTheFullPass) {
  ModelConfig c = Config("qwen3-tiny");
  auto model = Model(c);
  auto layout = *ParallelLayout::Parse("fsdp", 3);
  RunRanks(layout, 30, [&](int rank, std::shared_ptr<Communicator> comm) {
    auto source = BuildRankSource(comm, layout, nullptr, model->tensors(), 30);
    ASSERT_TRUE(source.ok()) << source.status().ToString();
    EXPECT_FALSE((*source)->HeldNames().has_value());
    for (int p = 0; p < 2; ++p) ExpectPassEquals(**source, model->tensors(), layout.Describe(rank), true);
  });
}

// The plan: one copy per element of a split tensor, from the lowest member holding it;
// replicated tensors never cross the group.
TEST(HeldPlan, LowestMemberSendsEachElementOnce) {
  ModelConfig c = Config("qwen3-tiny");
  auto layout = MegatronLayout::Build(c, *ParallelLayout::Parse("tp2pp1ep1", 2));
  ASSERT_TRUE(layout.ok());
  std::vector<std::string> names;
  for (const TensorMeta& m : layout->hf_tensors()) names.push_back(m.name);
  auto groups = LayerGroups(names);
  ASSERT_TRUE(groups.ok());
  auto plan = PlanHeldPass(layout->hf_tensors(), *groups, 2, 1, HeldPiecesOf(*layout, 1), "tp");
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  ASSERT_EQ(plan->size(), groups->size());
  const auto& hf = layout->hf_tensors();
  for (const HeldGroupPlan& g : *plan) {
    EXPECT_EQ(g.names.size(), (*groups)[g.group].size());
    // The contributions tile the split tensors; the replicated ones are member 1's own.
    size_t replicated = 0;
    for (int h : g.names) replicated += hf[h].shape.size() == 1 ? hf[h].nbytes() : 0;
    EXPECT_EQ(g.contribution[0] + g.contribution[1] + replicated, g.bytes) << (*groups)[g.group].key;
  }
  // Layer 0: each member sends its half of the split weights; the norms are placed by
  // member 1 from its own parameters.
  const HeldGroupPlan& layer0 = (*plan)[1];
  size_t replicated = 0, split = 0, own = 0;
  for (size_t i = 0; i < layer0.names.size(); ++i) {
    const TensorMeta& m = hf[layer0.names[i]];
    (m.shape.size() == 1 ? replicated : split) += m.nbytes();
  }
  for (const HeldRun& r : layer0.own) own += static_cast<size_t>(r.runs.count * r.runs.run_bytes);
  EXPECT_GT(replicated, 0u);
  EXPECT_EQ(own, replicated);
  EXPECT_EQ(layer0.contribution[1], split / 2);
  EXPECT_EQ(layer0.contribution[0], split / 2);
}

// Under expert parallelism with etp 1 an expert is whole on its EP rank: only that member
// holds it, nothing of it crosses the TP group, and its TP peer does not hold it.
TEST(HeldPlan, AnExpertStaysOnItsOwnRank) {
  ModelConfig c = Config("qwen3-moe-tiny");  // 8 experts
  auto layout = MegatronLayout::Build(c, *ParallelLayout::Parse("tp2pp1ep2", 4));
  ASSERT_TRUE(layout.ok()) << layout.status().ToString();
  std::vector<std::string> names;
  for (const TensorMeta& m : layout->hf_tensors()) names.push_back(m.name);
  auto groups = LayerGroups(names);
  ASSERT_TRUE(groups.ok());
  const auto& hf = layout->hf_tensors();
  const int e0 = layout->FindHf("model.layers.0.mlp.experts.0.up_proj.weight");
  const int e7 = layout->FindHf("model.layers.0.mlp.experts.7.up_proj.weight");
  const int q = layout->FindHf("model.layers.0.self_attn.q_proj.weight");
  ASSERT_GE(e0, 0);
  ASSERT_GE(e7, 0);
  for (int me : {0, 1}) {
    auto plan = PlanHeldPass(hf, *groups, 2, me, HeldPiecesOf(*layout, me), "tp");
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    const HeldGroupPlan& layer0 = (*plan)[1];
    auto holds = [&](int h) { return std::find(layer0.names.begin(), layer0.names.end(), h) != layer0.names.end(); };
    EXPECT_EQ(holds(e0), me == 0);
    EXPECT_EQ(holds(e7), me == 1);
    EXPECT_TRUE(holds(q));
    // The exchanged bytes are the split tensors alone: every byte of the group is either
    // a contribution or placed from the member's own parameters, experts among the latter.
    size_t own = 0;
    for (const HeldRun& r : layer0.own) own += static_cast<size_t>(r.runs.count * r.runs.run_bytes);
    EXPECT_GE(own, 4 * 3 * hf[e0].nbytes()) << "member " << me;  // its 4 experts' 3 projections
    EXPECT_EQ(layer0.contribution[0] + layer0.contribution[1] + own, layer0.bytes) << "member " << me;
    auto held = layout->HeldNames(me);
    std::vector<std::string> planned;
    for (const HeldGroupPlan& g : *plan) {
      for (int h : g.names) planned.push_back(hf[h].name);
    }
    EXPECT_EQ(planned, held) << "member " << me;
  }
}

TEST(HeldPlan, TpGroupThatCannotAssembleATensorIsRefused) {
  const std::vector<TensorMeta> hf = {{"model.layers.0.mlp.down_proj.weight", DType::kBF16, {8, 16}},
                                      {"model.layers.0.norm.weight", DType::kBF16, {8}}};
  const std::vector<LayerGroup> groups = {{"model.layers.0", 0, 2}};
  // Runs of a piece held at the start of its parameter: `outer` runs of `length` indices
  // of `inner` bytes, rows of 32 bytes in the HF tensor.
  auto piece = [](int member, int dim, int64_t start, int64_t length, int64_t inner, int64_t outer) {
    PieceRuns r{outer, length * inner, start * inner, 32, 0, length * inner};
    return HeldPiece{member, 0, dim, start, length, r};
  };
  // Columns [12, 16) of down_proj are on no member.
  std::vector<std::vector<HeldPiece>> pieces = {{piece(0, 1, 0, 8, 2, 8), piece(1, 1, 4, 8, 2, 8)},
                                                {piece(0, 0, 0, 8, 2, 1)}};
  auto plan = PlanHeldPass(hf, groups, 2, 0, pieces, "the TP group of trainer ranks 2, 3");
  EXPECT_THAT(plan.status(),
              StatusIs(StatusCode::kInvalidArgument,
                       "the TP group of trainer ranks 2, 3 cannot assemble model.layers.0.mlp.down_proj.weight by "
                       "itself: indices [12, 16) of its 16 along dim 1 are on no member"));
  // Slices along different dims cannot be stitched.
  pieces[0] = {piece(0, 1, 0, 16, 2, 8), piece(1, 0, 0, 8, 32, 1)};
  EXPECT_THAT(PlanHeldPass(hf, groups, 2, 0, pieces, "tp").status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("along dims 1 and 0")));
  // Overlapping slices: member 1 sends only what member 0 lacks.
  pieces[0] = {piece(1, 1, 4, 12, 2, 8), piece(0, 1, 0, 8, 2, 8)};
  auto ok = PlanHeldPass(hf, groups, 2, 1, pieces, "tp");
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  ASSERT_EQ((*ok)[0].runs[1].size(), 1u);
  EXPECT_EQ((*ok)[0].runs[1][0].runs.hf_offset, 8 * 2);
  EXPECT_EQ((*ok)[0].runs[1][0].runs.dst_offset, 4 * 2);
  EXPECT_EQ((*ok)[0].contribution[1], 8u * 8 * 2);
  // The norm is member 0's alone (it holds it whole), so member 1 does not hold it.
  EXPECT_EQ((*ok)[0].contribution[0], 8u * 8 * 2);
  ASSERT_EQ((*ok)[0].names.size(), 1u);
  EXPECT_TRUE((*ok)[0].own.empty());
}

// Rank 1 never starts its held pass: rank 0, its TP-group peer, fails within the timeout
// naming it; ranks 2 and 3 (the other stage's TP group) pass, even after rank 0 failed.
TEST(HeldPass, RankThatNeverStartsFailsItsTpGroupOnly) {
  ModelConfig c = Config("qwen3-tiny");
  auto model = Model(c);
  auto layout = *ParallelLayout::Parse("tp2pp2ep1", 4);
  const double timeout = 1.5;
  Countdown rank0_done(1), all_done(4);
  std::atomic<int> passed{0};
  RunGroups(layout, timeout, [&](int rank, std::shared_ptr<TrainerGroup> group) {
    auto source = BuildRankSource(*group, layout, &c, model->tensors(), timeout);
    ASSERT_TRUE(source.ok()) << source.status().ToString();
    if (rank == 0) {
      auto start = std::chrono::steady_clock::now();
      auto stream = (*source)->IterateHeld();
      ASSERT_TRUE(stream.ok());
      TensorRef t;
      Result<bool> more = (*stream)->Next(&t);
      EXPECT_LT(SecondsSince(start), timeout + 3);
      EXPECT_THAT(more.status(),
                  StatusIs(StatusCode::kDeadlineExceeded,
                           HasSubstr("megatron held pass of group 'pre' on trainer rank 0 (tp0 pp0 ep0 dp0)")));
      EXPECT_THAT(more.status(), StatusIs(StatusCode::kDeadlineExceeded, HasSubstr("waiting for trainer rank 1 "
                                                                                   "(tp1 pp0 ep0 dp0)")));
      rank0_done.Done();
    } else if (rank == 1) {
      rank0_done.Wait();  // never iterates
    } else {
      rank0_done.Wait();
      ExpectPassEquals(**source, model->tensors(), layout.Describe(rank), true);
      ++passed;
    }
    all_done.DoneAndWait();
  });
  EXPECT_EQ(passed, 2);
}

// Rank 3 stops its group (a failure outside its source) instead of making its held pass:
// rank 2, its TP-group peer, fails at once with kAborted naming it and the cause, not at
// the timeout; ranks 0 and 1 (the other replica's TP group) pass.
TEST(HeldPass, PeerThatStopsFailsItsTpGroupAtOnce) {
  ModelConfig c = Config("qwen3-moe-tiny");
  auto model = Model(c);
  auto layout = *ParallelLayout::Parse("tp2pp1ep1", 4);
  Countdown built(4), others_passed(2), all_done(4);
  RunGroups(layout, 30, [&](int rank, std::shared_ptr<TrainerGroup> group) {
    auto source = BuildRankSource(*group, layout, &c, model->tensors(), 30);
    ASSERT_TRUE(source.ok()) << source.status().ToString();
    built.DoneAndWait();
    if (rank == 3) {
      others_passed.Wait();
      std::this_thread::sleep_for(std::chrono::milliseconds(200));  // rank 2 is waiting
      group->Stop(Internal("optimizer step failed"));
    } else if (rank == 2) {
      auto start = std::chrono::steady_clock::now();
      auto stream = (*source)->IterateHeld();
      ASSERT_TRUE(stream.ok());
      TensorRef t;
      Result<bool> more = (*stream)->Next(&t);
      EXPECT_LT(SecondsSince(start), 10.0);
      EXPECT_THAT(more.status(), StatusIs(StatusCode::kAborted,
                                          "megatron held pass of group 'pre' on trainer rank 2 (tp0 pp0 ep0 dp1): "
                                          "exchange of 2097152 bytes within the TP group of trainer ranks 2, 3: "
                                          "trainer rank 3 (tp1 pp0 ep0 dp1) stopped: optimizer step failed"));
    } else {
      ExpectPassEquals(**source, model->tensors(), layout.Describe(rank), true);
      others_passed.Done();
    }
    all_done.DoneAndWait();
  });
}

}  // namespace
}  // namespace wsync
