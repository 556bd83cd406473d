#include "comm/gloo_communicator.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <thread>
#include <vector>

#include "comm/gloo_tree.h"
#include "comm/store.h"
#include "comm/testing.h"
#include "core/subprocess.h"

namespace wsync {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

double SecondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

std::string Describe(int r) {
  return fmt::format("rank {} (server http://127.0.0.1:{} worker 0)", r, 8000 + r);
}

class GlooTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto s = StoreServer::Start("127.0.0.1", 0);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    server_ = std::move(s).value();
  }

  GlooOptions Options(int rank, int size) {
    GlooOptions o;
    o.store_port = server_->port();
    o.prefix = prefix_;
    o.rank = rank;
    o.size = size;
    o.connect_deadline = Deadline::InSeconds(20);
    o.op_timeout = std::chrono::seconds(20);
    o.describe_rank = Describe;
    return o;
  }

  // Connects `size` ranks on threads; fails the test if any cannot connect.
  std::vector<std::unique_ptr<Communicator>> ConnectAll(
      int size, const std::function<void(GlooOptions&)>& tweak = nullptr) {
    std::vector<std::unique_ptr<Communicator>> comms(size);
    RunRanks(size, [&](int r) {
      GlooOptions o = Options(r, size);
      if (tweak) tweak(o);
      auto c = ConnectGloo(o);
      ASSERT_TRUE(c.ok()) << c.status().ToString();
      comms[r] = std::move(c).value();
    });
    return comms;
  }

  static void RunRanks(int size, const std::function<void(int)>& body) {
    std::vector<std::thread> threads;
    for (int r = 0; r < size; ++r) threads.emplace_back(body, r);
    for (auto& t : threads) t.join();
  }

  std::string prefix_ = "test-" + std::to_string(::getpid());
  std::unique_ptr<StoreServer> server_;
};

TEST(BroadcastTreeTest, ChainAndBinomialShapes) {
  EXPECT_EQ(ChainTree(0, 4, 0).parent, -1);
  EXPECT_EQ(ChainTree(0, 4, 0).children, std::vector<int>{1});
  EXPECT_EQ(ChainTree(1, 4, 2).parent, 0);
  EXPECT_TRUE(ChainTree(1, 4, 2).children.empty());
  EXPECT_EQ(BinomialTree(0, 5, 0).children, (std::vector<int>{1, 2, 4}));
  EXPECT_EQ(BinomialTree(3, 5, 0).parent, 1);
  EXPECT_EQ(BinomialTree(1, 5, 0).children, std::vector<int>{3});
  // Root 2 of 3: virtual ranks 0,1,2 are real 2,0,1.
  EXPECT_EQ(BinomialTree(2, 3, 2).children, (std::vector<int>{0, 1}));
  EXPECT_EQ(BinomialTree(1, 3, 2).parent, 2);
}

class GlooBroadcastTest : public GlooTest,
                          public ::testing::WithParamInterface<GlooBroadcastAlgorithm> {};

TEST_P(GlooBroadcastTest, ThreeThreadRanksBitExactFromEveryRoot) {
  auto comms = ConnectAll(3, [](GlooOptions& o) {
    o.algorithm = GetParam();
    o.chunk_bytes = 1 << 20;  // several pieces per call
  });
  const size_t bytes = (5 << 20) + 3;
  for (int root = 0; root < 3; ++root) {
    RunRanks(3, [&](int r) {
      std::vector<std::byte> buf(bytes);
      if (r == root) testing::FillPattern(buf, 100 + root);
      Status s = comms[r]->Broadcast(buf, root, Deadline::InSeconds(20));
      ASSERT_TRUE(s.ok()) << s.ToString();
      EXPECT_EQ(testing::FirstMismatch(buf, 100 + root), -1) << "rank " << r << " root " << root;
    });
  }
  EXPECT_EQ(comms[0]->kind(), "gloo");
  EXPECT_EQ(comms[2]->rank(), 2);
  EXPECT_EQ(comms[2]->size(), 3);
}

INSTANTIATE_TEST_SUITE_P(Algorithms, GlooBroadcastTest,
                         ::testing::Values(GlooBroadcastAlgorithm::kChain,
                                           GlooBroadcastAlgorithm::kBinomial,
                                           GlooBroadcastAlgorithm::kGlooBaseline),
                         [](const auto& info) {
                           switch (info.param) {
                             case GlooBroadcastAlgorithm::kChain:
                               return "Chain";
                             case GlooBroadcastAlgorithm::kBinomial:
                               return "Binomial";
                             default:
                               return "GlooBaseline";
                           }
                         });

TEST_F(GlooTest, AllReduceSumsInt64AndFloat) {
  auto comms = ConnectAll(3);
  RunRanks(3, [&](int r) {
    std::vector<int64_t> ints = {r, 10 * r, int64_t{1} << 40};
    ASSERT_TRUE(comms[r]->AllReduceSum(std::span<int64_t>(ints), Deadline::InSeconds(10)).ok());
    EXPECT_EQ(ints, (std::vector<int64_t>{3, 30, int64_t{3} << 40}));
    std::vector<float> floats(1000, 0.5f * (r + 1));
    ASSERT_TRUE(comms[r]->AllReduceSum(std::span<float>(floats), Deadline::InSeconds(10)).ok());
    for (float f : floats) ASSERT_EQ(f, 3.0f);
  });
}

TEST_F(GlooTest, TwoProcessesBroadcast64MBitExact) {
  const size_t bytes = size_t{64} << 20;
  SpawnOptions so;
  so.args = {std::to_string(server_->port()), prefix_, "1", "2", std::to_string(bytes)};
  auto child = Subprocess::Spawn(WSYNC_GLOO_RANK_HELPER, std::move(so));
  ASSERT_TRUE(child.ok()) << child.status().ToString();
  GlooOptions o = Options(0, 2);
  auto comm = ConnectGloo(o);
  ASSERT_TRUE(comm.ok()) << comm.status().ToString();
  std::vector<std::byte> buf(bytes);
  // Same protocol as gloo_rank_helper: root 0 with pattern 1, then root 1 with pattern 2.
  testing::FillPattern(buf, 1);
  ASSERT_TRUE((*comm)->Broadcast(buf, 0, Deadline::InSeconds(60)).ok());
  Status s = (*comm)->Broadcast(buf, 1, Deadline::InSeconds(60));
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(testing::FirstMismatch(buf, 2), -1);
  std::optional<ExitStatus> st = (*child)->Wait(Deadline::InSeconds(60));
  ASSERT_TRUE(st.has_value()) << "the rank helper ran past 60 s";
  EXPECT_TRUE(st->success()) << st->ToString();
}

TEST_F(GlooTest, RankThatNeverJoinsIsNamedAtConnectDeadline) {
  std::vector<Status> results(2);
  std::vector<double> took(2);
  RunRanks(2, [&](int r) {
    GlooOptions o = Options(r, 3);  // rank 2 never comes
    o.connect_deadline = Deadline::InSeconds(2);
    auto start = Clock::now();
    auto c = ConnectGloo(o);
    took[r] = SecondsSince(start);
    results[r] = c.status();
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(results[r].code(), StatusCode::kDeadlineExceeded) << results[r].ToString();
    EXPECT_NE(results[r].message().find("never joined: " + Describe(2)), std::string::npos)
        << results[r].message();
    EXPECT_LT(took[r], 4.0);
  }
}

TEST_F(GlooTest, SilentPeerTimesOutThenCallsAbortFast) {
  auto comms = ConnectAll(2, [](GlooOptions& o) { o.op_timeout = milliseconds(1000); });
  std::vector<std::byte> buf(1 << 20);
  auto start = Clock::now();
  Status s = comms[0]->Broadcast(buf, 0, Deadline::InSeconds(30));  // rank 1 never joins in
  double took = SecondsSince(start);
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
  EXPECT_NE(s.message().find(Describe(1)), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("broadcast of 1.0 MiB"), std::string::npos) << s.message();
  EXPECT_GE(took, 0.9);
  EXPECT_LT(took, 2.5);
  EXPECT_TRUE(comms[0]->aborted());

  start = Clock::now();
  Status again = comms[0]->Broadcast(buf, 0, Deadline::InSeconds(30));
  EXPECT_EQ(again.code(), StatusCode::kAborted) << again.ToString();
  std::vector<int64_t> v(1);
  EXPECT_EQ(comms[0]->AllReduceSum(std::span<int64_t>(v), Deadline::InSeconds(30)).code(),
            StatusCode::kAborted);
  EXPECT_LT(SecondsSince(start), 0.1);

  // The failed rank closed its connections, so the peer fails fast instead of waiting.
  start = Clock::now();
  Status peer = comms[1]->Broadcast(buf, 0, Deadline::InSeconds(30));
  EXPECT_FALSE(peer.ok());
  EXPECT_LT(SecondsSince(start), 0.9) << peer.ToString();
  EXPECT_TRUE(comms[1]->aborted());
}

TEST_F(GlooTest, ReceiverWaitingForSilentRootNamesTheRoot) {
  auto comms = ConnectAll(3, [](GlooOptions& o) { o.op_timeout = milliseconds(800); });
  std::vector<std::byte> buf(3 << 20);
  Status s = comms[1]->Broadcast(buf, 0, Deadline::InSeconds(30));
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
  EXPECT_NE(s.message().find("waiting for " + Describe(0) + " to send piece 1/1"),
            std::string::npos)
      << s.message();
}

TEST_F(GlooTest, DeadlineShorterThanOpTimeoutWins) {
  auto comms = ConnectAll(2);
  std::vector<std::byte> buf(1024);
  auto start = Clock::now();
  Status s = comms[1]->Broadcast(buf, 0, Deadline::InSeconds(0.5));
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
  EXPECT_LT(SecondsSince(start), 1.5);
}

TEST_F(GlooTest, AbortFromAnotherThreadWakesABlockedBroadcast) {
  auto comms = ConnectAll(2);
  std::vector<std::byte> buf(1 << 20);
  std::thread aborter([&] {
    std::this_thread::sleep_for(milliseconds(300));
    comms[1]->Abort();
  });
  auto start = Clock::now();
  Status s = comms[1]->Broadcast(buf, 0, Deadline::InSeconds(30));
  aborter.join();
  EXPECT_EQ(s.code(), StatusCode::kAborted) << s.ToString();
  EXPECT_LT(SecondsSince(start), 2.0);
  EXPECT_TRUE(comms[1]->aborted());
}

TEST_F(GlooTest, InvalidArgumentsAreRejected) {
  GlooOptions o = Options(3, 2);
  EXPECT_EQ(ConnectGloo(o).status().code(), StatusCode::kInvalidArgument);
  o = Options(0, 1);
  o.prefix.clear();
  EXPECT_EQ(ConnectGloo(o).status().code(), StatusCode::kInvalidArgument);
  auto single = ConnectGloo(Options(0, 1));
  ASSERT_TRUE(single.ok()) << single.status().ToString();
  std::vector<std::byte> buf(16);
  EXPECT_TRUE((*single)->Broadcast(buf, 0, Deadline::InSeconds(1)).ok());
  EXPECT_EQ((*single)->Broadcast(buf, 1, Deadline::InSeconds(1)).code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace wsync
