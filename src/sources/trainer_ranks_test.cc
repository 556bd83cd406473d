// Failures among trainer ranks: disagreeing metadata, names nobody holds, ranks that stop
// iterating, abandon a pass, or stop their group (TrainerGroup::Stop); each a clear
// error, in time, naming the rank.
#include "sources/trainer_ranks.h"

#include <atomic>
#include <chrono>
#include <thread>

#include "sources/agreement.h"
#include "sources/test_util.h"

namespace wsync {
namespace {

using namespace sources_test;

TEST(SourceErrors, MetadataDigestMismatch) {
  ModelConfig a = Config("qwen3-tiny"), b = a;
  b.num_hidden_layers = 3;
  auto ma = Model(a), mb = Model(b);
  auto layout = *ParallelLayout::Parse("fsdp", 3);
  std::atomic<int> failed{0};
  RunRanks(layout, 20, [&](int rank, std::shared_ptr<Communicator> comm) {
    auto source = BuildRankSource(comm, layout, nullptr, rank == 1 ? mb->tensors() : ma->tensors(), 20);
    ASSERT_FALSE(source.ok());
    EXPECT_NE(source.status().message().find("disagree on the model"), std::string::npos)
        << source.status().message();
    EXPECT_NE(source.status().message().find("trainer rank 1 has"), std::string::npos)
        << source.status().message();
    ++failed;
  });
  EXPECT_EQ(failed, 3);
}

TEST(SourceErrors, NameHeldByNobody) {
  auto meta = HfTensors(Config("qwen3-tiny"));
  auto layout = *ParallelLayout::Parse("fsdp", 2);
  RunRanks(layout, 20, [&](int rank, std::shared_ptr<Communicator> comm) {
    std::vector<std::string> held;
    for (const auto& m : meta) {
      if (m.name != "model.norm.weight") held.push_back(m.name);
    }
    Status s = CheckRanksAgree(*comm, meta, held, nullptr, Deadline::InSeconds(20));
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.message().find("held by no trainer rank: model.norm.weight"), std::string::npos) << s.message();
  });
}

TEST(SourceErrors, NonContiguousMetadata) {
  auto model = Model(Config("qwen3-tiny"));
  std::vector<HostTensor> shuffled;
  for (auto& t : model->tensors()) {
    auto c = HostTensor::Zeros(t.meta);
    std::memcpy(c->storage.data(), t.storage.data(), t.meta.nbytes());
    shuffled.push_back(std::move(*c));
  }
  std::swap(shuffled[1], shuffled[shuffled.size() - 2]);  // a layer-0 tensor near the end
  auto layout = *ParallelLayout::Parse("fsdp", 2);
  RunRanks(layout, 20, [&](int rank, std::shared_ptr<Communicator> comm) {
    auto source = BuildRankSource(comm, layout, nullptr, shuffled, 20);
    ASSERT_FALSE(source.ok());
    EXPECT_NE(source.status().message().find("not group-contiguous"), std::string::npos)
        << source.status().message();
  });
}

// Rank 2 stops after 3 tensors and holds its stream: the others time out naming it.
TEST(SourceErrors, RankThatStopsIteratingFailsTheOthersInTime) {
  for (const char* name : {"fsdp", "tp1pp1ep1"}) {
    ModelConfig c = Config("qwen3-tiny");
    auto model = Model(c);
    auto layout = *ParallelLayout::Parse(name, 3);
    if (!layout.fsdp) layout = *ParallelLayout::Parse("tp1pp1ep1", 3);  // 3 DP replicas
    SCOPED_TRACE(name);
    std::atomic<int> failed{0};
    RunRanks(layout, 1.5, [&](int rank, std::shared_ptr<Communicator> comm) {
      auto source = BuildRankSource(comm, layout, &c, model->tensors(), 1.5);
      ASSERT_TRUE(source.ok()) << source.status().ToString();
      auto stream = (*source)->Iterate();
      ASSERT_TRUE(stream.ok());
      TensorRef t;
      auto start = std::chrono::steady_clock::now();
      for (int i = 0;; ++i) {
        if (rank == 2 && i == 3) {
          std::this_thread::sleep_for(std::chrono::seconds(4));  // stuck, stream held
          return;
        }
        auto more = (*stream)->Next(&t);
        if (!more.ok()) {
          double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
          EXPECT_LT(s, 4.0) << more.status().ToString();
          // Broadcasts name the rank waited for; Gloo's ring all-gather cannot.
          const std::string& m = more.status().message();
          EXPECT_TRUE(m.find("trainer rank 2") != std::string::npos ||
                      m.find("stopped iterating") != std::string::npos)
              << more.status().ToString();
          ++failed;
          return;
        }
        ASSERT_TRUE(*more) << "pass ended although rank 2 stopped";
      }
    });
    EXPECT_EQ(failed, 2);
  }
}

// A rank that drops its stream mid-pass (a full pass, or a held pass of its TP group)
// aborts its communicator: the others fail at once, and the source refuses new passes.
TEST(SourceErrors, AbandonedPassFailsTheOthersFast) {
  ModelConfig c = Config("qwen3-tiny");
  auto model = Model(c);
  auto layout = *ParallelLayout::Parse("tp2pp1ep1", 2);
  for (bool held : {false, true}) {
    SCOPED_TRACE(held ? "held pass" : "full pass");
    RunRanks(layout, 30, [&](int rank, std::shared_ptr<Communicator> comm) {
      auto source = BuildRankSource(comm, layout, &c, model->tensors(), 30);
      ASSERT_TRUE(source.ok());
      auto stream = held ? (*source)->IterateHeld() : (*source)->Iterate();
      ASSERT_TRUE(stream.ok());
      TensorRef t;
      auto start = std::chrono::steady_clock::now();
      if (rank == 1) {
        (void)(*stream)->Next(&t);
        stream->reset();  // abandons the pass
        EXPECT_TRUE(comm->aborted());
        EXPECT_EQ((*source)->Iterate().status().code(), StatusCode::kAborted);
        EXPECT_EQ((*source)->IterateHeld().status().code(), StatusCode::kAborted);
        return;
      }
      for (;;) {
        auto more = (*stream)->Next(&t);
        if (!more.ok()) break;
        ASSERT_TRUE(*more) << "pass ended although rank 1 abandoned it";
      }
      EXPECT_LT(SecondsSince(start), 10.0);
    });
  }
}

// What a rank was doing when its first collective of a pass failed, as the sources word it.
std::string FirstCollective(const ParallelLayout& layout, const std::vector<TensorMeta>& meta, int rank) {
  if (layout.fsdp) {
    return fmt::format("fsdp source on trainer rank {}: all-gather of {} (tensor 1/{})", rank, meta[0].name,
                       meta.size());
  }
  // 'pre' holds the embedding, whose primary pieces are on dp 0 (rank 0 for tp1).
  return fmt::format("megatron export of group 'pre' on {}: broadcast of the {} bytes of pieces held by {}",
                     layout.Describe(rank), meta[0].nbytes(), layout.Describe(0));
}

// Rank 0 (the sender) drains the check pass, then fails outside its source (a server
// refused the update) and stops the group: ranks 1 and 2, already in the transfer pass,
// fail at once (not at the 30 s timeout) with kAborted naming rank 0 and its cause.
TEST(SourceErrors, SenderThatStopsFailsTheOthersAtOnce) {
  for (const char* name : {"fsdp", "tp1pp1ep1"}) {
    SCOPED_TRACE(name);
    ModelConfig c = Config("qwen3-tiny");
    auto model = Model(c);
    auto layout = *ParallelLayout::Parse(name, 3);
    const Status cause = Unavailable("POST /start_weight_update to http://127.0.0.1:9 refused");
    std::atomic<int> failed{0};
    RunGroups(layout, 30, [&](int rank, std::shared_ptr<TrainerGroup> group) {
      auto source = BuildRankSource(*group, layout, &c, model->tensors(), 30);
      ASSERT_TRUE(source.ok()) << source.status().ToString();
      ExpectPassEquals(**source, model->tensors(), layout.Describe(rank));  // the check pass
      if (rank == 0) {
        std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the others are waiting
        EXPECT_TRUE(group->PeerStopped().ok());
        group->Stop(cause);
        return;
      }
      auto start = std::chrono::steady_clock::now();
      auto stream = (*source)->Iterate();
      ASSERT_TRUE(stream.ok());
      TensorRef t;
      auto more = (*stream)->Next(&t);
      ASSERT_FALSE(more.ok());
      EXPECT_LT(SecondsSince(start), 5.0) << more.status().ToString();
      EXPECT_EQ(more.status().code(), StatusCode::kAborted);
      EXPECT_EQ(more.status().message(),
                FirstCollective(layout, (*source)->metadata(), rank) + ": " + layout.Describe(0) +
                    " stopped: POST /start_weight_update to http://127.0.0.1:9 refused");
      // A new pass fails at once for the same reason.
      stream->reset();
      auto again = (*source)->Iterate();
      ASSERT_FALSE(again.ok());
      EXPECT_EQ(again.status().code(), StatusCode::kAborted);
      EXPECT_EQ(again.status().message(),
                std::string(layout.fsdp ? "fsdp" : "megatron") + " source: " + layout.Describe(0) +
                    " stopped: POST /start_weight_update to http://127.0.0.1:9 refused");
      ++failed;
    });
    EXPECT_EQ(failed, 2);
  }
}

// A non-sender rank fails mid-pass (holding its stream) and stops the group: rank 0 and
// the other non-sender fail at once naming it; later stops (consequences) do not replace
// the first cause on the board.
TEST(SourceErrors, NonSenderThatStopsFailsTheSenderAtOnce) {
  for (const char* name : {"fsdp", "tp1pp1ep1"}) {
    SCOPED_TRACE(name);
    ModelConfig c = Config("qwen3-tiny");
    auto model = Model(c);
    auto layout = *ParallelLayout::Parse(name, 3);
    std::atomic<int> failed{0};
    RunGroups(layout, 30, [&](int rank, std::shared_ptr<TrainerGroup> group) {
      auto source = BuildRankSource(*group, layout, &c, model->tensors(), 30);
      ASSERT_TRUE(source.ok()) << source.status().ToString();
      auto stream = (*source)->Iterate();
      ASSERT_TRUE(stream.ok());
      TensorRef t;
      auto start = std::chrono::steady_clock::now();
      size_t yielded = 0;
      for (;;) {
        if (rank == 2 && yielded == 3) {
          group->Stop(Internal("checksum of model.layers.0.mlp.up_proj.weight differs"));
          EXPECT_TRUE(group->PeerStopped().ok()) << "a rank does not see its own stop";
          std::this_thread::sleep_for(std::chrono::seconds(1));  // stream still held
          return;
        }
        auto more = (*stream)->Next(&t);
        if (!more.ok()) {
          EXPECT_LT(SecondsSince(start), 5.0) << more.status().ToString();
          EXPECT_EQ(more.status().code(), StatusCode::kAborted);
          const std::string want = layout.Describe(2) +
                                   " stopped: checksum of model.layers.0.mlp.up_proj.weight differs";
          const std::string& m = more.status().message();
          EXPECT_EQ(m.substr(m.size() - std::min(m.size(), want.size())), want) << m;
          // This failure is a consequence: stopping does not replace rank 2's cause.
          group->Stop(more.status());
          Status seen = group->PeerStopped();
          EXPECT_EQ(seen.message(), want);
          ++failed;
          return;
        }
        ASSERT_TRUE(*more) << "pass ended although rank 2 stopped";
        ++yielded;
      }
    });
    EXPECT_EQ(failed, 2);
  }
}

// The exact wording of the stop board, and its first-cause rule: rank 1 stopping after
// rank 3 (a consequence) does not replace rank 3's cause, though rank 1 is lower-numbered.
TEST(TrainerGroup, StopBoardNamesTheFirstRankAndCause) {
  auto layout = *ParallelLayout::Parse("tp2pp1ep1", 4);
  const std::string want =
      "trainer rank 3 (tp1 pp0 ep0 dp1) stopped: server http://h:1 did not answer /update_weights";
  std::atomic<int> phase{0}, checked{0};
  auto wait_for = [](std::atomic<int>& v, int n) {
    while (v.load() < n) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  };
  RunGroups(layout, 30, [&](int rank, std::shared_ptr<TrainerGroup> group) {
    EXPECT_TRUE(group->PeerStopped().ok());
    ++checked;
    wait_for(checked, 4);
    if (rank == 3) {
      group->Stop(DeadlineExceeded("server http://h:1 did not answer /update_weights"));
      EXPECT_TRUE(group->comm()->aborted());
      phase = 1;
    }
    wait_for(phase, 1);
    if (rank == 1) {
      group->Stop(Aborted("a consequence"));
      phase = 2;
    }
    wait_for(phase, 2);
    Status s = group->PeerStopped();
    if (rank == 3) {
      EXPECT_TRUE(s.ok()) << "a rank does not see its own stop: " << s.ToString();
    } else {
      EXPECT_EQ(s.code(), StatusCode::kAborted);
      EXPECT_EQ(s.message(), want);
    }
  });
}

}  // namespace
}  // namespace wsync
