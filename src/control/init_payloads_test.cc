#include "control/init_payloads.h"

#include <gtest/gtest.h>

namespace wsync {
namespace {

using V = std::vector<int>;

// Test vectors from SkyRL's test_control_plane.py (reference/skyrl_weight_sync.md §3).
TEST(NcclRankOffsets, SkyrlVectors) {
  EXPECT_EQ(*NcclRankOffsets(5, 1, 1), V({1}));
  EXPECT_EQ(*NcclRankOffsets(9, 2, 1), V({1, 5}));
  EXPECT_EQ(*NcclRankOffsets(9, 4, 2), V({1, 1, 5, 5}));
  auto bad = NcclRankOffsets(8, 3, 1);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("does not divide"), std::string::npos);
  auto none = NcclRankOffsets(1, 1, 1);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("no inference workers"), std::string::npos);
}

TEST(NcclRankOffsets, ServersNotDivisibleByDp) {
  EXPECT_EQ(NcclRankOffsets(9, 3, 2).status().code(), StatusCode::kInvalidArgument);
}

TEST(RdtReplicaStamps, IndexDivDp) {
  auto s = *RdtReplicaStamps(4, 2);
  std::vector<ReplicaStamp> want = {{0, 2}, {0, 2}, {1, 2}, {1, 2}};
  EXPECT_EQ(s, want);
  EXPECT_EQ((*RdtReplicaStamps(3, 1))[2], (ReplicaStamp{2, 3}));
  auto bad = RdtReplicaStamps(3, 2);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("does not divide"), std::string::npos);
}

TEST(BroadcastWorldSize, FromServerSizes) {
  EXPECT_EQ(*BroadcastWorldSize({4, 4}, 1), 9);
  EXPECT_EQ(*BroadcastWorldSize({2, 2, 2, 2}, 2), 5);  // 4 DP-rank servers of 2 deployments
  EXPECT_FALSE(BroadcastWorldSize({2, 4}, 1).ok());
  EXPECT_FALSE(BroadcastWorldSize({2, 2, 2}, 2).ok());
}

// World sizes come from the servers' replies: the arithmetic does not overflow, and a
// world over the cap is refused before anything is allocated per rank.
TEST(BroadcastWorldSize, HugeServerSizesAreRefusedNotOverflowed) {
  const int big = 2147483647;
  auto r = BroadcastWorldSize({big, big}, 1);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("over 65536"), std::string::npos) << r.status().ToString();
  EXPECT_FALSE(BroadcastWorldSize({65536}, 1).ok());        // 65537 with the trainer
  EXPECT_EQ(*BroadcastWorldSize({65535}, 1), 65536);
  EXPECT_FALSE(NcclRankOffsets(big, 1, 1).ok());
  EXPECT_FALSE(NcclRankOffsets(9, 2, 1, -2147483647).ok());
  // Found by init_payloads_fuzz: world - rank_offset overflowed int (UBSan).
  auto none = NcclRankOffsets(-469762049, 1, 1, 2147483647);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("no inference workers"), std::string::npos) << none.status().ToString();
}

}  // namespace
}  // namespace wsync
