// SplitLanes and ReceiveStagingBytes: one lane per producer in producer order, each
// lane's chunks in plan order, staging of min(ring, chunks) of each lane's largest chunk.
// ReceiveLanes over a Gloo group on loopback with two paced producers, one per pipeline
// stage: concurrent lanes take about one stage's time where plan order takes both, and
// land the same bytes; a producer that fails ends every lane at once, naming its chunk.
#include "backends/sharded/lanes.h"

#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <thread>

#include <fmt/format.h>

#include "comm/connect.h"
#include "comm/store.h"
#include "comm/testing.h"
#include "core/stopwatch.h"

namespace wsync {
namespace {

ConsumerPlan TwoStagePlan() {
  // Groups 0..3: stage 0 (ranks 0, 1) holds groups 0 and 1, stage 1 (ranks 2, 3) groups 2 and 3.
  ConsumerPlan p;
  auto chunk = [](int group, int producer, size_t bytes) {
    PlanChunk c;
    c.group = group;
    c.producer = producer;
    c.bytes = bytes;
    return c;
  };
  p.chunks = {chunk(0, 0, 100), chunk(0, 1, 50), chunk(1, 1, 70), chunk(1, 0, 10),
              chunk(2, 3, 400), chunk(2, 2, 30), chunk(3, 2, 300), chunk(3, 3, 20)};
  return p;
}

TEST(SplitLanes, OneLanePerProducerInProducerOrderEachInPlanOrder) {
  const std::vector<ReceiveLane> lanes = SplitLanes(TwoStagePlan(), true);
  ASSERT_EQ(lanes.size(), 4u);
  EXPECT_EQ(lanes[0].producer, 0);
  EXPECT_EQ(lanes[0].chunks, (std::vector<size_t>{0, 3}));
  EXPECT_EQ(lanes[0].max_chunk, 100u);
  EXPECT_EQ(lanes[1].chunks, (std::vector<size_t>{1, 2}));
  EXPECT_EQ(lanes[2].chunks, (std::vector<size_t>{5, 6}));
  EXPECT_EQ(lanes[3].producer, 3);
  EXPECT_EQ(lanes[3].chunks, (std::vector<size_t>{4, 7}));
  EXPECT_EQ(lanes[3].max_chunk, 400u);
  // Two buffers per lane of its largest chunk; one buffer when the ring is one deep.
  EXPECT_EQ(ReceiveStagingBytes(lanes, 2), 2u * (100 + 70 + 300 + 400));
  EXPECT_EQ(ReceiveStagingBytes(lanes, 1), 100u + 70 + 300 + 400);
  // A ring deeper than a lane holds only its chunks.
  EXPECT_EQ(ReceiveStagingBytes(lanes, 8), 2u * (100 + 70 + 300 + 400));
}

TEST(SplitLanes, PlanOrderIsOneLaneOfEveryChunk) {
  const std::vector<ReceiveLane> lanes = SplitLanes(TwoStagePlan(), false);
  ASSERT_EQ(lanes.size(), 1u);
  EXPECT_EQ(lanes[0].chunks, (std::vector<size_t>{0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(ReceiveStagingBytes(lanes, 2), 800u);
}

TEST(SplitLanes, ABudgetMergesNeighbouringRanksUntilItFits) {
  const ConsumerPlan plan = TwoStagePlan();
  // Unbounded or roomy: one lane per producer.
  EXPECT_EQ(SplitLanesWithin(plan, 2, 0).size(), 4u);
  EXPECT_EQ(SplitLanesWithin(plan, 2, 2 * 870).size(), 4u);
  // Two lanes, one per stage: ranks 0 and 1 (largest chunk 100), ranks 2 and 3 (400).
  std::vector<ReceiveLane> stages = SplitLanesWithin(plan, 2, 2 * 500);
  ASSERT_EQ(stages.size(), 2u);
  EXPECT_EQ(stages[0].producer, 0);
  EXPECT_EQ(stages[0].chunks, (std::vector<size_t>{0, 1, 2, 3}));
  EXPECT_EQ(stages[1].chunks, (std::vector<size_t>{4, 5, 6, 7}));
  EXPECT_EQ(ReceiveStagingBytes(stages, 2), 2u * 500);
  // Below two stages' worth: plan order, whatever the bound.
  std::vector<ReceiveLane> one = SplitLanesWithin(plan, 2, 10);
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].chunks.size(), 8u);
}

TEST(SplitLanes, ReserveSizesEachRingToItsLane) {
  std::vector<ReceiveLane> lanes = SplitLanes(TwoStagePlan(), true);
  ASSERT_TRUE(ReserveLanes(lanes, 3, Device{}).ok());
  for (const ReceiveLane& lane : lanes) {
    ASSERT_EQ(lane.ring.size(), 2u);  // each lane has two chunks
    for (const StagingBuffer& b : lane.ring) EXPECT_GE(b.size(), lane.max_chunk);
  }
}

// Two stages of kChunks chunks each: producer 0 sends groups 0..kChunks-1, producer 1 the
// rest, to the one consumer (group rank 2).
constexpr int kChunks = 6;
constexpr size_t kChunkBytes = 64 << 10;
constexpr auto kPace = std::chrono::milliseconds(40);

ConsumerPlan StagePlan() {
  ConsumerPlan p;
  for (int k = 0; k < 2 * kChunks; ++k) {
    PlanChunk c;
    c.group = k;
    c.producer = k < kChunks ? 0 : 1;
    c.bytes = kChunkBytes;
    p.chunks.push_back(c);
  }
  return p;
}

struct Group {
  std::unique_ptr<StoreServer> store;
  std::vector<std::unique_ptr<Communicator>> comms;  // by group rank: producers 0, 1, consumer 2
};

Group Join(const std::string& prefix) {
  Group g;
  g.store = *StoreServer::Start("127.0.0.1", 0);
  g.comms.resize(3);
  std::vector<std::future<Status>> joins;
  for (int r = 0; r < 3; ++r) {
    joins.push_back(std::async(std::launch::async, [&g, &prefix, r]() -> Status {
      CommSpec spec;
      spec.store = CommSpec::Store{"127.0.0.1", g.store->port(), prefix};
      spec.rank = r;
      spec.size = 3;
      spec.connect_deadline = Deadline::InSeconds(30);
      spec.op_timeout = std::chrono::seconds(30);
      WSYNC_ASSIGN_OR_RETURN(g.comms[r], Connect(spec));
      return Status::Ok();
    }));
  }
  for (auto& j : joins) EXPECT_TRUE(j.get().ok());
  return g;
}

// Producer `p` sends its chunks one at a time, in plan order, kPace after each; with
// `fail_after` >= 0 it aborts its communicator after that many.
Status Produce(Communicator& comm, const ConsumerPlan& plan, int p, int fail_after = -1) {
  std::vector<std::byte> buf(kChunkBytes);
  int sent = 0;
  for (size_t k = 0; k < plan.chunks.size(); ++k) {
    if (plan.chunks[k].producer != p) continue;
    if (sent == fail_after) {
      comm.Abort();
      return Aborted("fault: the producer gave up");
    }
    testing::FillPattern(buf, k);
    Communicator::PeerMessage m{2, static_cast<uint32_t>(k), std::span(buf)};
    WSYNC_RETURN_IF_ERROR(comm.ExchangePeers(std::span(&m, 1), {}, Deadline::InSeconds(30)));
    ++sent;
    std::this_thread::sleep_for(kPace);
  }
  return Status::Ok();
}

// One sync of `plan` into the consumer: its seconds, after checking every chunk's bytes.
Result<double> Receive(bool concurrent, const std::string& prefix) {
  const ConsumerPlan plan = StagePlan();
  Group g = Join(prefix);
  std::vector<ReceiveLane> lanes = SplitLanes(plan, concurrent);
  WSYNC_RETURN_IF_ERROR(ReserveLanes(lanes, 2, Device{}));
  Stopwatch watch;
  auto p0 = std::async(std::launch::async, [&] { return Produce(*g.comms[0], plan, 0); });
  auto p1 = std::async(std::launch::async, [&] { return Produce(*g.comms[1], plan, 1); });
  int landed = 0;
  Status s = ReceiveLanes(
      *g.comms[2], plan, lanes,
      [&](size_t k, std::span<const std::byte> bytes) -> Status {
        if (testing::FirstMismatch(bytes, k) != -1) return DataLoss(fmt::format("chunk {} differs", k));
        ++landed;
        return Status::Ok();
      },
      [](size_t k) { return fmt::format("chunk {}", k); }, Deadline::InSeconds(30));
  const double seconds = watch.seconds();
  WSYNC_RETURN_IF_ERROR(s);
  WSYNC_RETURN_IF_ERROR(p0.get());
  WSYNC_RETURN_IF_ERROR(p1.get());
  if (landed != 2 * kChunks) return Internal(fmt::format("{} chunks landed", landed));
  return seconds;
}

TEST(ReceiveLanes, ConcurrentLanesTakeOneStagesTimeWherePlanOrderTakesBoth) {
  Result<double> in_turn = Receive(false, "lanes-test/turns");
  ASSERT_TRUE(in_turn.ok()) << in_turn.status().ToString();
  Result<double> concurrent = Receive(true, "lanes-test/concurrent");
  ASSERT_TRUE(concurrent.ok()) << concurrent.status().ToString();
  const double stage = kChunks * std::chrono::duration<double>(kPace).count();
  fmt::print("in turn {:.3f} s, concurrent {:.3f} s, one stage's pacing {:.3f} s\n", *in_turn, *concurrent, stage);
  EXPECT_GE(*in_turn, 1.4 * stage);  // the stages overlap only by the ring posted ahead
  EXPECT_LT(*concurrent, *in_turn * 0.75) << *concurrent << " s concurrent against " << *in_turn << " s in turn";
}

TEST(ReceiveLanes, AFailedStageEndsEveryLaneAtOnceNamingItsChunk) {
  const ConsumerPlan plan = StagePlan();
  Group g = Join("lanes-test/fail");
  std::vector<ReceiveLane> lanes = SplitLanes(plan, true);
  ASSERT_TRUE(ReserveLanes(lanes, 2, Device{}).ok());
  Stopwatch watch;
  auto p0 = std::async(std::launch::async, [&] { return Produce(*g.comms[0], plan, 0); });
  auto p1 = std::async(std::launch::async, [&] { return Produce(*g.comms[1], plan, 1, 2); });
  Status s = ReceiveLanes(
      *g.comms[2], plan, lanes, [](size_t, std::span<const std::byte>) { return Status::Ok(); },
      [](size_t k) { return fmt::format("chunk {} from producer {}", k, k < kChunks ? 0 : 1); },
      Deadline::InSeconds(30));
  ASSERT_FALSE(s.ok());
  EXPECT_LT(watch.seconds(), 10) << s.ToString();
  EXPECT_NE(s.message().find(fmt::format("receiving chunk {} from producer 1", kChunks + 2)), std::string::npos)
      << s.ToString();
  EXPECT_TRUE(g.comms[2]->aborted());
  (void)p1.get();
  g.comms[0]->Abort();  // producer 0's consumer is gone: its next send fails
  (void)p0.get();
}

}  // namespace
}  // namespace wsync
