#include "backends/nccl/staging.h"

#include <unistd.h>

#include <memory>
#include <vector>

#include <gtest/gtest.h>

namespace wsync {
namespace {

ChunkPlan PlanOf(std::vector<size_t> chunk_bytes) {
  ChunkPlan p;
  for (size_t b : chunk_bytes) {
    p.chunks.push_back(Chunk{p.chunks.size(), p.chunks.size() + 1, b});
    p.max_chunk_bytes = std::max(p.max_chunk_bytes, b);
    p.total_bytes += b;
  }
  return p;
}

long Pages(size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return static_cast<long>((bytes + page - 1) / page);
}

TEST(StagingRing, EachSlotHoldsTheLargestChunkThatPassesThroughIt) {
  const ChunkPlan plan = PlanOf({1000, 300, 700, 200, 900});
  EXPECT_EQ(RingSlotBytes(plan, 1, 0), 1000u);
  EXPECT_EQ(RingSlotBytes(plan, 2, 0), 1000u);  // chunks 0, 2, 4
  EXPECT_EQ(RingSlotBytes(plan, 2, 1), 300u);   // chunks 1, 3
  EXPECT_EQ(RingSlotBytes(PlanOf({5000}), 2, 1), 0u);
}

// Host rings are resident once reserved (the first sync takes no page faults), and grow
// only: a smaller plan keeps the buffers and their addresses.
TEST(StagingRing, HostBuffersAreResidentAndOnlyGrow) {
  std::vector<StagingBuffer> ring(2);
  const size_t big = size_t{6} << 20, small = size_t{1} << 20;
  ASSERT_TRUE(ReserveRing(ring, Device{}, PlanOf({big, small, big})).ok());
  EXPECT_GE(ring[0].size(), big);
  EXPECT_GE(ring[1].size(), small);
  EXPECT_LT(ring[1].size(), big);
  for (const StagingBuffer& b : ring) EXPECT_EQ(ResidentPages(b.span(b.size())), Pages(b.size()));

  std::byte* first = ring[0].data();
  ASSERT_TRUE(ReserveRing(ring, Device{}, PlanOf({small})).ok());
  EXPECT_EQ(ring[0].data(), first);
  EXPECT_GE(ring[0].size(), big);

  ASSERT_TRUE(ReserveRing(ring, Device{}, PlanOf({small, big})).ok());
  EXPECT_GE(ring[1].size(), big);
  EXPECT_EQ(ResidentPages(ring[1].span(ring[1].size())), Pages(ring[1].size()));
}

TEST(StagingRing, RingsOfPointersReserveTheSame) {
  std::vector<std::shared_ptr<StagingBuffer>> ring = {std::make_shared<StagingBuffer>(),
                                                      std::make_shared<StagingBuffer>()};
  ASSERT_TRUE(ReserveRing(ring, Device{}, PlanOf({4096, 8192})).ok());
  EXPECT_GE(ring[0]->size(), 4096u);
  EXPECT_GE(ring[1]->size(), 8192u);
}

}  // namespace
}  // namespace wsync
