#include "control/init_payloads.h"

#include <gtest/gtest.h>

namespace wsync {
namespace {

using V = std::vector<int>;

using Layout = NcclFleetLayout;

// Test vectors from SkyRL's test_control_plane.py (reference/skyrl_weight_sync.md §3),
// its uniform formula written as per-server world sizes: (world 5, 1 server, dp 1),
// (world 9, 2 servers, dp 1), (world 9, 4 servers, dp 2).
TEST(NcclFleetRanks, SkyrlUniformVectors) {
  EXPECT_EQ(*NcclFleetRanks({4}, 1), (Layout{5, {1}}));
  EXPECT_EQ(*NcclFleetRanks({4, 4}, 1), (Layout{9, {1, 5}}));
  EXPECT_EQ(*NcclFleetRanks({4, 4, 4, 4}, 2), (Layout{9, {1, 1, 5, 5}}));
  EXPECT_EQ(*NcclFleetRanks({2, 2, 2, 2}, 2), (Layout{5, {1, 1, 3, 3}}));  // 4 DP-rank servers, 2 deployments
}

TEST(NcclFleetRanks, HeterogeneousDeployments) {
  // A TP=2 server beside a TP=1 server.
  EXPECT_EQ(*NcclFleetRanks({2, 1}, 1), (Layout{4, {1, 3}}));
  EXPECT_EQ(*NcclFleetRanks({1, 2}, 1), (Layout{4, {1, 2}}));
  // dp 2: a deployment of world 4 (2 servers of TP=2), then one of world 2 (TP=1).
  EXPECT_EQ(*NcclFleetRanks({4, 4, 2, 2}, 2), (Layout{7, {1, 1, 5, 5}}));
  EXPECT_EQ(*NcclFleetRanks({2, 2, 4, 4, 8, 8}, 2), (Layout{15, {1, 1, 3, 3, 7, 7}}));
  // Another first rank (a group whose ranks 0..2 are not workers).
  EXPECT_EQ(*NcclFleetRanks({2, 1}, 1, 3), (Layout{6, {3, 5}}));
}

TEST(NcclFleetRanks, OneDeploymentReportingTwoSizesNamesBothServers) {
  auto bad = NcclFleetRanks({4, 4, 2, 4}, 2);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(),
            "server 2 and server 3 form one deployment (data_parallel_size 2) but report world sizes 2 and 4: the "
            "servers of one deployment must run the same layout");
  const std::vector<std::string> urls = {"http://a:1", "http://b:2"};
  auto named = NcclFleetRanks({2, 1}, 2, 1, urls);
  ASSERT_FALSE(named.ok());
  EXPECT_NE(named.status().message().find("http://a:1 and http://b:2 form one deployment"), std::string::npos)
      << named.status().message();
  EXPECT_NE(named.status().message().find("world sizes 2 and 1"), std::string::npos) << named.status().message();
}

TEST(NcclFleetRanks, ServersNotDivisibleByDp) {
  auto bad = NcclFleetRanks({4, 4, 4}, 2);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("does not divide"), std::string::npos) << bad.status().message();
  EXPECT_EQ(NcclFleetRanks({}, 1).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(NcclFleetRanks({4}, 0).status().code(), StatusCode::kInvalidArgument);
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

// World sizes come from the servers' replies: the arithmetic does not overflow, and a
// world over the cap is refused before anything is allocated per rank.
TEST(NcclFleetRanks, HugeServerSizesAreRefusedNotOverflowed) {
  const int big = 2147483647;
  auto r = NcclFleetRanks({big, big}, 1);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("past the limit of 65536"), std::string::npos) << r.status().ToString();
  EXPECT_NE(r.status().message().find("the deployment of server 0 (world size 2147483647)"), std::string::npos)
      << r.status().ToString();
  EXPECT_FALSE(NcclFleetRanks({65536}, 1).ok());  // 65537 with the trainer
  EXPECT_EQ(NcclFleetRanks({65535}, 1)->world_size, 65536);
  EXPECT_EQ(NcclFleetRanks({32767, 32768}, 1)->rank_offsets, (std::vector<int>{1, 32768}));
  EXPECT_FALSE(NcclFleetRanks({32768, 32768}, 1).ok());
  // Many servers whose sum, not any one size, passes the cap (and would wrap an int).
  EXPECT_FALSE(NcclFleetRanks(std::vector<int>(4096, 1 << 20), 1).ok());
  EXPECT_FALSE(NcclFleetRanks(std::vector<int>(70000, 1), 1).ok());
  EXPECT_FALSE(NcclFleetRanks({0}, 1).ok());
  EXPECT_FALSE(NcclFleetRanks({-5, -5}, 2).ok());
  // The first rank: SkyRL's world - rank_offset once overflowed int here (init_payloads_fuzz).
  EXPECT_FALSE(NcclFleetRanks({4, 4}, 1, -2147483647).ok());
  EXPECT_FALSE(NcclFleetRanks({1}, 1, 2147483647).ok());
  EXPECT_FALSE(NcclFleetRanks({1}, 1, 0).ok());
}

}  // namespace
}  // namespace wsync
