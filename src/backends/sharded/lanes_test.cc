// SplitLanes and ReceiveStagingBytes: one lane per producer in producer order, each
// lane's chunks in plan order, staging of min(ring, chunks) of each lane's largest chunk.
#include "backends/sharded/lanes.h"

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace wsync
