#include "plan/packing.h"

#include <gtest/gtest.h>

namespace wsync {
namespace {

std::vector<TensorMeta> U8Tensors(std::initializer_list<int64_t> sizes) {
  std::vector<TensorMeta> v;
  int i = 0;
  for (int64_t s : sizes) v.push_back({"t" + std::to_string(i++), DType::kU8, {s}});
  return v;
}

std::vector<std::pair<size_t, size_t>> Ranges(const ChunkPlan& p) {
  std::vector<std::pair<size_t, size_t>> r;
  for (const auto& c : p.chunks) r.emplace_back(c.first, c.end);
  return r;
}

TEST(PlanChunks, CutsOnlyWhenStrictlyGreater) {
  // Running sizes 4, 8 (== 8, not > 8: keep going), 12 (> 8: cut after t2).
  auto plan = *PlanChunks(U8Tensors({4, 4, 4, 4}), 8);
  using R = std::vector<std::pair<size_t, size_t>>;
  EXPECT_EQ(Ranges(plan), (R{{0, 3}, {3, 4}}));
  EXPECT_EQ(plan.chunks[0].bytes, 12u);
  EXPECT_EQ(plan.chunks[1].bytes, 4u);
  EXPECT_EQ(plan.max_chunk_bytes, 12u);
  EXPECT_EQ(plan.total_bytes, 16u);
  EXPECT_EQ(plan.offset_in_chunk, (std::vector<size_t>{0, 4, 8, 0}));
}

TEST(PlanChunks, OversizedTensorClosesItsChunk) {
  auto plan = *PlanChunks(U8Tensors({2, 100, 3, 3}), 10);
  using R = std::vector<std::pair<size_t, size_t>>;
  // t0+t1 = 102 > 10: cut after t1 (a chunk may exceed the buffer by one tensor).
  EXPECT_EQ(Ranges(plan), (R{{0, 2}, {2, 4}}));
  EXPECT_EQ(plan.chunks[0].bytes, 102u);
}

TEST(PlanChunks, NoEmptyTrailingChunk) {
  auto plan = *PlanChunks(U8Tensors({5, 6}), 10);  // 11 > 10 cuts exactly at the end
  ASSERT_EQ(plan.chunks.size(), 1u);
  EXPECT_EQ(plan.chunks[0].end, 2u);
  EXPECT_TRUE(PlanChunks(U8Tensors({}), 10)->chunks.empty());
}

TEST(PlanChunks, UsesBytesNotElements) {
  std::vector<TensorMeta> t = {{"a", DType::kBF16, {3}}, {"b", DType::kF32, {2}}};
  auto plan = *PlanChunks(t, 6);  // 6 bytes (not > 6), then 14 > 6
  ASSERT_EQ(plan.chunks.size(), 1u);
  EXPECT_EQ(plan.chunks[0].bytes, 14u);
  EXPECT_EQ(plan.offset_in_chunk[1], 6u);
}

TEST(PlanChunks, ZeroBufferIsAnError) {
  EXPECT_EQ(PlanChunks(U8Tensors({1}), 0).status().code(), StatusCode::kInvalidArgument);
}

TEST(CutChunks, CloseBeforeOverflowKeepsEveryChunkWithinTheLimitWithAlignedOffsets) {
  // Offsets 0, 8 (5 aligned up), 16 would end at 21 > 20: cut before t2.
  ChunkCut cut{ChunkCut::Rule::kCloseBeforeOverflow, 20, 8, "the slot"};
  auto plan = CutChunks(U8Tensors({5, 5, 5, 20, 1}), cut);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  using R = std::vector<std::pair<size_t, size_t>>;
  EXPECT_EQ(Ranges(*plan), (R{{0, 2}, {2, 3}, {3, 4}, {4, 5}}));
  EXPECT_EQ(plan->offset_in_chunk, (std::vector<size_t>{0, 8, 0, 0, 0}));
  EXPECT_EQ(plan->chunks[0].bytes, 13u);  // padding counts
  EXPECT_EQ(plan->max_chunk_bytes, 20u);
}

TEST(CutChunks, CloseBeforeOverflowNamesATensorLargerThanTheLimit) {
  ChunkCut cut{ChunkCut::Rule::kCloseBeforeOverflow, 10, 1, "the ipc staging slot"};
  auto plan = CutChunks(U8Tensors({2, 11}), cut);
  ASSERT_EQ(plan.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(plan.status().message(), "tensor t1 (11 bytes) is larger than the ipc staging slot (10 bytes)");
}

TEST(PackedBufferSize, IsAtLeastTheLargestTensor) {
  auto t = U8Tensors({10, 300, 20});
  EXPECT_EQ(PackedBufferSize(t, 100), 300u);
  EXPECT_EQ(PackedBufferSize(t, 1000), 1000u);
}

}  // namespace
}  // namespace wsync
