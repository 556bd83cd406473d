#include "comm/gloo_communicator.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <signal.h>

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

  // Two ranks; rank 0 has posted (not waited on) a receive that rank 1 never sends. The
  // batch is declared after the communicators, so it is destroyed before them.
  struct UnansweredReceive {
    std::vector<std::unique_ptr<Communicator>> comms;
    std::unique_ptr<Communicator::PeerBatch> batch;
  };
  UnansweredReceive ConnectWithUnansweredReceive() {
    UnansweredReceive out{ConnectAll(2), nullptr};
    const Communicator::PeerMessage from1{1, 1, unanswered_};
    auto posted = out.comms[0]->PostPeerBatch({}, {&from1, 1});
    EXPECT_TRUE(posted.ok()) << posted.status().ToString();
    if (posted.ok()) out.batch = std::move(posted).value();
    return out;
  }

  static void RunRanks(int size, const std::function<void(int)>& body) {
    std::vector<std::thread> threads;
    for (int r = 0; r < size; ++r) threads.emplace_back(body, r);
    for (auto& t : threads) t.join();
  }

  std::string prefix_ = "test-" + std::to_string(::getpid());
  std::unique_ptr<StoreServer> server_;
  std::vector<std::byte> unanswered_ = std::vector<std::byte>(1 << 20);
  std::vector<std::byte> from0_bytes_ = std::vector<std::byte>(1 << 20);
  // A receive on rank 1 from rank 0 that rank 0 never sends.
  const Communicator::PeerMessage from0_{0, 1, from0_bytes_};
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

// ---- Point to point (PostPeerBatch) ----

using PeerMessage = Communicator::PeerMessage;

// The pattern seed of the message `src` sends to `dst` under `tag`.
uint64_t PeerSeed(int src, int dst, uint32_t tag) { return 1000 + 100 * src + 10 * dst + tag; }

TEST_F(GlooTest, FourRanksEveryPairBothWaysInOneBatchBitExact) {
  constexpr int kRanks = 4;
  auto comms = ConnectAll(kRanks);
  RunRanks(kRanks, [&](int r) {
    // Sizes differ per pair and are not multiples of 8, so a crossed message shows.
    auto bytes = [](int src, int dst) { return size_t{1} << 20 | size_t(src * 37 + dst * 5 + 3); };
    std::vector<std::vector<std::byte>> out(kRanks), in(kRanks);
    std::vector<PeerMessage> sends, receives;
    for (int p = 0; p < kRanks; ++p) {
      if (p == r) continue;
      out[p].resize(bytes(r, p));
      testing::FillPattern(out[p], PeerSeed(r, p, 3));
      in[p].resize(bytes(p, r));
      sends.push_back({p, 3, out[p]});
      receives.push_back({p, 3, in[p]});
    }
    Status s = comms[r]->ExchangePeers(sends, receives, Deadline::InSeconds(30));
    ASSERT_TRUE(s.ok()) << s.ToString();
    for (int p = 0; p < kRanks; ++p) {
      if (p == r) continue;
      EXPECT_EQ(testing::FirstMismatch(in[p], PeerSeed(p, r, 3)), -1) << "rank " << r << " from " << p;
    }
  });
  for (auto& c : comms) EXPECT_FALSE(c->aborted());
}

TEST_F(GlooTest, MessagesOver64MiBArriveWholeBothWays) {
  auto comms = ConnectAll(2);
  // Two full 64 MiB pieces and a short tail one way, exactly one piece the other.
  const size_t big = (size_t{128} << 20) + 12345, exact = size_t{64} << 20;
  RunRanks(2, [&](int r) {
    const int peer = 1 - r;
    std::vector<std::byte> out(r == 0 ? big : exact), in(r == 0 ? exact : big);
    testing::FillPattern(out, PeerSeed(r, peer, 9));
    const PeerMessage send{peer, 9, out}, receive{peer, 9, in};
    Status s = comms[r]->ExchangePeers({&send, 1}, {&receive, 1}, Deadline::InSeconds(60));
    ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_EQ(testing::FirstMismatch(in, PeerSeed(peer, r, 9)), -1) << "rank " << r;
  });
}

// Rank 0 posts three batches of sends before waiting on any; rank 1 posts its receives in
// two batches grouped differently and waits on them in the reverse order. Equal tags
// match in posting order.
TEST_F(GlooTest, SeveralBatchesInFlightMatchByTagAndOrder) {
  auto comms = ConnectAll(2);
  constexpr size_t kBytes = (3 << 20) + 1;
  // (tag, seed) of every send in posting order; tags 5 and 7 repeat.
  const std::vector<std::pair<uint32_t, uint64_t>> sent = {{5, 51}, {7, 71}, {5, 52}, {9, 91}, {7, 72}};
  std::vector<std::vector<std::byte>> out(sent.size(), std::vector<std::byte>(kBytes));
  std::vector<std::vector<std::byte>> in(sent.size(), std::vector<std::byte>(kBytes));
  RunRanks(2, [&](int r) {
    std::vector<std::unique_ptr<Communicator::PeerBatch>> batches;
    if (r == 0) {
      std::vector<PeerMessage> m;
      for (size_t i = 0; i < sent.size(); ++i) {
        testing::FillPattern(out[i], sent[i].second);
        m.push_back({1, sent[i].first, out[i]});
      }
      for (auto [begin, end] : {std::pair{0, 2}, std::pair{2, 4}, std::pair{4, 5}}) {
        auto b = comms[0]->PostPeerBatch(std::span(m).subspan(begin, end - begin), {});
        ASSERT_TRUE(b.ok()) << b.status().ToString();
        batches.push_back(std::move(b).value());
      }
    } else {
      // in[0..4] receive: tag 9, tag 7 (first), then tag 5, tag 5, tag 7 (second).
      const std::vector<uint32_t> tags = {9, 7, 5, 5, 7};
      std::vector<PeerMessage> m;
      for (size_t i = 0; i < tags.size(); ++i) m.push_back({0, tags[i], in[i]});
      for (auto [begin, end] : {std::pair{0, 2}, std::pair{2, 5}}) {
        auto b = comms[1]->PostPeerBatch({}, std::span(m).subspan(begin, end - begin));
        ASSERT_TRUE(b.ok()) << b.status().ToString();
        batches.push_back(std::move(b).value());
      }
    }
    for (auto it = batches.rbegin(); it != batches.rend(); ++it) {
      Status s = (*it)->Wait(Deadline::InSeconds(30));
      ASSERT_TRUE(s.ok()) << "rank " << r << ": " << s.ToString();
    }
  });
  const std::vector<uint64_t> expected = {91, 71, 51, 52, 72};
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(testing::FirstMismatch(in[i], expected[i]), -1) << "receive " << i;
  }
}

TEST_F(GlooTest, EmptyMessagesAndEmptyBatchesComplete) {
  auto comms = ConnectAll(2);
  RunRanks(2, [&](int r) {
    const int peer = 1 - r;
    std::vector<std::byte> out(4096), in(4096);
    testing::FillPattern(out, PeerSeed(r, peer, 2));
    // Empty messages on tags 1 and 3 around a real one on tag 2, both ways.
    const std::vector<PeerMessage> sends = {{peer, 1, {}}, {peer, 2, out}, {peer, 3, {}}};
    const std::vector<PeerMessage> receives = {{peer, 1, {}}, {peer, 2, in}, {peer, 3, {}}};
    Status s = comms[r]->ExchangePeers(sends, receives, Deadline::InSeconds(10));
    ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_EQ(testing::FirstMismatch(in, PeerSeed(peer, r, 2)), -1);
    // A batch of nothing, and one of only empty messages, complete without the peer.
    EXPECT_TRUE(comms[r]->ExchangePeers({}, {}, Deadline::InSeconds(1)).ok());
    auto empty = comms[r]->PostPeerBatch({}, std::span(receives).subspan(0, 1));
    ASSERT_TRUE(empty.ok()) << empty.status().ToString();
    empty->reset();  // destroyed unwaited: nothing was unfinished
    EXPECT_FALSE(comms[r]->aborted());
  });
}

TEST_F(GlooTest, SilentPeerFailsAtTheDeadlineNamingItAndTheTag) {
  auto comms = ConnectAll(3);
  std::vector<std::byte> from1(1 << 20), from2(1 << 20), out(1 << 20);
  testing::FillPattern(out, 1);
  // Rank 1 sends its message; rank 2 never sends.
  const PeerMessage send{0, 11, out};
  auto sent = comms[1]->PostPeerBatch({&send, 1}, {});
  ASSERT_TRUE(sent.ok()) << sent.status().ToString();
  const std::vector<PeerMessage> receives = {{1, 11, from1}, {2, 22, from2}};
  auto start = Clock::now();
  Status s = comms[0]->ExchangePeers({}, receives, Deadline::InSeconds(1));
  double took = SecondsSince(start);
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
  EXPECT_NE(s.message().find("receiving 1.0 MiB from " + Describe(2) + " (tag 22)"), std::string::npos)
      << s.message();
  EXPECT_NE(s.message().find("waiting for " + Describe(2) + " to send it"), std::string::npos) << s.message();
  EXPECT_GE(took, 0.9);
  EXPECT_LT(took, 2.0);
  EXPECT_TRUE(comms[0]->aborted());
  EXPECT_TRUE((*sent)->Wait(Deadline::InSeconds(5)).ok());
  EXPECT_EQ(testing::FirstMismatch(from1, 1), -1);

  // Later calls on the failed rank fail at once; its closed connections fail the idle
  // peer's next wait fast instead of at the deadline.
  start = Clock::now();
  EXPECT_EQ(comms[0]->ExchangePeers({}, receives, Deadline::InSeconds(30)).code(), StatusCode::kAborted);
  EXPECT_LT(SecondsSince(start), 0.1);
  const PeerMessage receive{0, 5, from2};
  start = Clock::now();
  Status peer = comms[2]->ExchangePeers({}, {&receive, 1}, Deadline::InSeconds(30));
  EXPECT_TRUE(peer.code() == StatusCode::kUnavailable || peer.code() == StatusCode::kAborted) << peer.ToString();
  EXPECT_LT(SecondsSince(start), 2.0) << peer.ToString();
  EXPECT_TRUE(comms[2]->aborted());
}

TEST_F(GlooTest, PeerNotTakingASendTimesOutNamingIt) {
  auto comms = ConnectAll(2, [](GlooOptions& o) { o.op_timeout = milliseconds(800); });
  std::vector<std::byte> out(1 << 20);
  const PeerMessage send{1, 40, out};
  auto start = Clock::now();
  Status s = comms[0]->ExchangePeers({&send, 1}, {}, Deadline::InSeconds(30));  // op_timeout wins
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
  EXPECT_NE(s.message().find("sending 1.0 MiB to " + Describe(1) + " (tag 40)"), std::string::npos) << s.message();
  EXPECT_LT(SecondsSince(start), 2.0);
}

// A receive whose length differs from its send's never matches it: the receiver fails at
// its deadline, naming the mismatch, and its buffer is neither overrun nor completed
// short; the sender fails too (its later deadline, or the receiver's abort). The sender's
// deadline is the later one so that its own abort cannot reach the receiver first.
TEST_F(GlooTest, LengthMismatchFailsAtTheDeadlineInsteadOfCorrupting) {
  auto comms = ConnectAll(2);
  std::vector<Status> results(2);
  std::vector<std::byte> in(96, std::byte{0xab});
  RunRanks(2, [&](int r) {
    std::vector<std::byte> out(100, std::byte{0x11});
    const PeerMessage m{1 - r, 3, r == 0 ? std::span(out) : std::span(in)};
    results[r] = r == 0 ? comms[0]->ExchangePeers({&m, 1}, {}, Deadline::InSeconds(4))
                        : comms[1]->ExchangePeers({}, {&m, 1}, Deadline::InSeconds(1));
  });
  EXPECT_FALSE(results[0].ok());
  EXPECT_EQ(results[1].code(), StatusCode::kDeadlineExceeded) << results[1].ToString();
  EXPECT_NE(results[1].message().find("another length"), std::string::npos) << results[1].message();
  for (std::byte b : in) ASSERT_EQ(b, std::byte{0xab});
}

TEST_F(GlooTest, AbortFromAnotherThreadWakesAWaitAndFailsThePeerFast) {
  UnansweredReceive setup = ConnectWithUnansweredReceive();
  auto& comms = setup.comms;
  auto& peer_batch = setup.batch;
  ASSERT_NE(peer_batch, nullptr);
  std::thread aborter([&] {
    std::this_thread::sleep_for(milliseconds(300));
    comms[1]->Abort();
  });
  auto start = Clock::now();
  Status s = comms[1]->ExchangePeers({}, {&from0_, 1}, Deadline::InSeconds(30));  // never sent either
  double took = SecondsSince(start);
  aborter.join();
  EXPECT_EQ(s.code(), StatusCode::kAborted) << s.ToString();
  EXPECT_NE(s.message().find("from " + Describe(0) + " (tag 1)"), std::string::npos) << s.message();
  EXPECT_LT(took, 1.5);
  EXPECT_TRUE(comms[1]->aborted());
  // The aborted rank closed its connections although a batch was alive on its peer.
  start = Clock::now();
  Status peer = peer_batch->Wait(Deadline::InSeconds(30));
  EXPECT_EQ(peer.code(), StatusCode::kUnavailable) << peer.ToString();
  EXPECT_NE(peer.message().find(Describe(1)), std::string::npos) << peer.message();
  EXPECT_LT(SecondsSince(start), 1.5);
  // Wait is idempotent.
  EXPECT_EQ(peer_batch->Wait(Deadline::InSeconds(30)).code(), StatusCode::kUnavailable);
}

TEST_F(GlooTest, BatchDestroyedUnwaitedAbortsTheCommunicator) {
  UnansweredReceive setup = ConnectWithUnansweredReceive();
  auto& comms = setup.comms;
  auto& waiting = setup.batch;
  ASSERT_NE(waiting, nullptr);
  auto dropped = comms[1]->PostPeerBatch({}, {&from0_, 1});
  ASSERT_TRUE(dropped.ok()) << dropped.status().ToString();
  dropped->reset();
  EXPECT_TRUE(comms[1]->aborted());
  auto start = Clock::now();
  Status peer = waiting->Wait(Deadline::InSeconds(30));
  EXPECT_EQ(peer.code(), StatusCode::kUnavailable) << peer.ToString();
  EXPECT_LT(SecondsSince(start), 1.5);
}

TEST_F(GlooTest, DeadPeerProcessFailsTheWaitFast) {
  const size_t bytes = (size_t{2} << 20) + 3;
  SpawnOptions so;
  so.args = {std::to_string(server_->port()), prefix_, "1", "2", std::to_string(bytes), "p2p"};
  auto child = Subprocess::Spawn(WSYNC_GLOO_RANK_HELPER, std::move(so));
  ASSERT_TRUE(child.ok()) << child.status().ToString();
  auto comm = ConnectGloo(Options(0, 2));
  ASSERT_TRUE(comm.ok()) << comm.status().ToString();
  // The helper's one message proves the pair works; then it is killed while rank 0 waits.
  std::vector<std::byte> first(bytes), second(bytes);
  const PeerMessage receive1{1, 1, first}, receive2{1, 2, second};
  Status s = (*comm)->ExchangePeers({}, {&receive1, 1}, Deadline::InSeconds(60));
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(testing::FirstMismatch(first, 7), -1);
  std::thread killer([&] {
    std::this_thread::sleep_for(milliseconds(300));
    (*child)->Signal(SIGKILL);
  });
  auto start = Clock::now();
  s = (*comm)->ExchangePeers({}, {&receive2, 1}, Deadline::InSeconds(60));
  double took = SecondsSince(start);
  killer.join();
  EXPECT_TRUE(s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kAborted) << s.ToString();
  EXPECT_NE(s.message().find("from " + Describe(1) + " (tag 2)"), std::string::npos) << s.message();
  EXPECT_LT(took, 5.0) << s.ToString();
  EXPECT_TRUE((*comm)->aborted());
}

TEST_F(GlooTest, BadPeerRanksAreInvalidAndPostNothing) {
  auto comms = ConnectAll(2);
  std::vector<std::byte> buf(64);
  for (int bad : {0, -1, 2}) {
    const PeerMessage m{bad, 4, buf};
    auto as_send = comms[0]->PostPeerBatch({&m, 1}, {});
    EXPECT_EQ(as_send.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(as_send.status().message().find(fmt::format("send to rank {} (tag 4)", bad)), std::string::npos)
        << as_send.status().message();
    auto as_receive = comms[0]->PostPeerBatch({}, {&m, 1});
    EXPECT_EQ(as_receive.status().code(), StatusCode::kInvalidArgument) << bad;
  }
  // A bad message anywhere rejects the whole batch before anything is posted.
  const std::vector<PeerMessage> mixed = {{1, 4, buf}, {5, 4, buf}};
  EXPECT_EQ(comms[0]->PostPeerBatch(mixed, {}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(comms[0]->aborted());
  // The communicator still works.
  RunRanks(2, [&](int r) {
    std::vector<std::byte> out(64), in(64);
    testing::FillPattern(out, PeerSeed(r, 1 - r, 4));
    const PeerMessage send{1 - r, 4, out}, receive{1 - r, 4, in};
    Status s = comms[r]->ExchangePeers({&send, 1}, {&receive, 1}, Deadline::InSeconds(10));
    ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_EQ(testing::FirstMismatch(in, PeerSeed(1 - r, r, 4)), -1);
  });
}

}  // namespace
}  // namespace wsync
