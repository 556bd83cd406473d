#include "backends/ipc/region.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

namespace wsync {
namespace {

using Clock = std::chrono::steady_clock;

IpcRegionOptions Options(int readers, uint64_t slot_bytes = 4096, ShmBacking backing = ShmBacking::kMemfd) {
  IpcRegionOptions o;
  o.session = NewSessionId();
  o.reader_count = readers;
  o.slot_bytes = slot_bytes;
  o.backing = backing;
  return o;
}

IpcInitInfo InfoFor(const IpcRegion& r) {
  IpcInitInfo i;
  i.session = r.session();
  i.control_path = r.path();
  i.control_bytes = r.bytes();
  i.num_slots = r.num_slots();
  i.slot_bytes = r.slot_bytes();
  i.reader_count = r.reader_count();
  i.buffers[HostDeviceKey()] = r.ShmBuffer();
  return i;
}

TEST(IpcRegion, ReadersSeeEveryChunkOfARingMuchLongerThanTheSlots) {
  constexpr int kReaders = 3;
  constexpr uint64_t kChunks = 200;
  auto trainer = IpcRegion::Create(Options(kReaders));
  ASSERT_TRUE(trainer.ok()) << trainer.status().ToString();
  IpcRegion& t = **trainer;
  EXPECT_EQ(t.header_bytes() % (2 << 20), 0u);
  std::atomic<int> bad{0};
  std::vector<std::thread> readers;
  for (int r = 0; r < kReaders; ++r) {
    readers.emplace_back([&, r] {
      auto mine = IpcRegion::Open(InfoFor(t));  // its own mapping, as another process has
      ASSERT_TRUE(mine.ok()) << mine.status().ToString();
      (*mine)->Attach(r, 1234);
      for (uint64_t seq = 1; seq <= kChunks; ++seq) {
        Status s = (*mine)->WaitPublished(seq, 1, Deadline::InSeconds(20), "test");
        ASSERT_TRUE(s.ok()) << s.ToString();
        auto slot = (*mine)->slot(static_cast<int>(seq % (*mine)->num_slots()));
        for (size_t i = 0; i < slot.size(); i += 512) {
          if (slot[i] != std::byte(seq & 0xff)) ++bad;
        }
        (*mine)->Ack(r, seq);
      }
    });
  }
  for (uint64_t seq = 1; seq <= kChunks; ++seq) {
    ASSERT_TRUE(t.WaitAcked(seq > 2 ? seq - 2 : 0, Deadline::InSeconds(20), nullptr, nullptr).ok());
    auto slot = t.slot(static_cast<int>(seq % t.num_slots()));
    std::memset(slot.data(), static_cast<int>(seq & 0xff), slot.size());
    t.Publish(seq, slot.size());
  }
  EXPECT_TRUE(t.WaitAcked(kChunks, Deadline::InSeconds(20), nullptr, nullptr).ok());
  for (auto& th : readers) th.join();
  EXPECT_EQ(bad.load(), 0);
}

TEST(IpcRegion, OpenRejectsMissingGarbageAndForeignRegions) {
  auto trainer = IpcRegion::Create(Options(2));
  ASSERT_TRUE(trainer.ok());
  IpcInitInfo good = InfoFor(**trainer);
  ASSERT_TRUE(IpcRegion::Open(good).ok());

  IpcInitInfo i = good;
  i.control_path = "/dev/shm/wsync-no-such-region";
  auto r = IpcRegion::Open(i);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("cannot open"), std::string::npos) << r.status().message();

  auto garbage = std::filesystem::temp_directory_path() / ("wsync-garbage-" + NewSessionId());
  {
    std::ofstream f(garbage);
    f << std::string(1 << 20, 'x');
  }
  i.control_path = garbage.string();
  i.control_bytes = 4096;
  r = IpcRegion::Open(i);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("not a wsync ipc region"), std::string::npos) << r.status().message();
  std::filesystem::remove(garbage);

  i = good;
  i.control_path = "/proc/self/status";  // exists, not a shared-memory file
  EXPECT_EQ(IpcRegion::Open(i).status().code(), StatusCode::kInvalidArgument);

  i = good;
  i.session = NewSessionId();
  r = IpcRegion::Open(i);
  EXPECT_NE(r.status().message().find("belongs to session " + good.session), std::string::npos) << r.status().message();

  i = good;
  i.reader_count = 3;
  r = IpcRegion::Open(i);
  EXPECT_NE(r.status().message().find("reader(s)"), std::string::npos) << r.status().message();
}

TEST(IpcRegion, ReadersSeeTheSyncTheTrainerAnnouncedLast) {
  auto trainer = IpcRegion::Create(Options(1));
  ASSERT_TRUE(trainer.ok()) << trainer.status().ToString();
  auto reader = IpcRegion::Open(InfoFor(**trainer));
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  EXPECT_EQ((*reader)->Announced().sync, 0u);  // nothing yet
  (*trainer)->Announce(1, 1);
  EXPECT_EQ((*reader)->Announced().sync, 1u);
  EXPECT_EQ((*reader)->Announced().first_seq, 1u);
  (*trainer)->Announce(2, 14);  // sync 1 took 13 chunks
  IpcRegion::Announcement a = (*reader)->Announced();
  EXPECT_EQ(a.sync, 2u);
  EXPECT_EQ(a.first_seq, 14u);
}

TEST(IpcRegion, PosixShmNameIsGoneAfterUnlinkButMappingsStay) {
  auto trainer = IpcRegion::Create(Options(1, 4096, ShmBacking::kPosixShm));
  ASSERT_TRUE(trainer.ok()) << trainer.status().ToString();
  EXPECT_EQ((*trainer)->path().rfind("/dev/shm/wsync-ipc-", 0), 0u) << (*trainer)->path();
  auto reader = IpcRegion::Open(InfoFor(**trainer));
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  (*trainer)->UnlinkName();
  EXPECT_FALSE(std::filesystem::exists((*trainer)->path()));
  EXPECT_FALSE(IpcRegion::Open(InfoFor(**trainer)).ok());
  (*trainer)->slot(1)[7] = std::byte{42};
  (*trainer)->Publish(1, 8);
  ASSERT_TRUE((*reader)->WaitPublished(1, 1, Deadline::InSeconds(5), "test").ok());
  EXPECT_EQ((*reader)->slot(1)[7], std::byte{42});
  EXPECT_TRUE((*reader)->TrainerAlive());
}

TEST(IpcRegion, AbortEndsTheReadersWaitWithTheReason) {
  auto trainer = IpcRegion::Create(Options(1));
  auto reader = IpcRegion::Open(InfoFor(**trainer));
  ASSERT_TRUE(reader.ok());
  std::thread aborter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    (*trainer)->Abort(4, "source failed at tensor x");
  });
  auto t0 = Clock::now();
  Status s = (*reader)->WaitPublished(1, 4, Deadline::InSeconds(20), "chunk 1/3 of sync 4");
  aborter.join();
  EXPECT_EQ(s.code(), StatusCode::kAborted) << s.ToString();
  EXPECT_NE(s.message().find("source failed at tensor x"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("chunk 1/3 of sync 4"), std::string::npos) << s.message();
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 5);
  // An abort of another sync does not stop this one.
  EXPECT_EQ((*reader)->WaitPublished(1, 5, Deadline::InSeconds(0.05), "x").code(), StatusCode::kDeadlineExceeded);
}

TEST(IpcRegion, DeadlinesNameWhatWasAwaited) {
  auto trainer = IpcRegion::Create(Options(2));
  auto reader = IpcRegion::Open(InfoFor(**trainer));
  Status s = (*reader)->WaitPublished(1, 1, Deadline::InSeconds(0.05), "chunk 1/1 of sync 1");
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(s.message().find("did not publish chunk seq 1"), std::string::npos) << s.message();
  (*reader)->Ack(0, 1);
  s = (*trainer)->WaitAcked(1, Deadline::InSeconds(0.05), nullptr, [](int r) { return "worker " + std::to_string(r); });
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(s.message().find("1 of 2 receiving worker(s)"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("worker 1"), std::string::npos) << s.message();
  // The check callback ends the wait with its own error.
  s = (*trainer)->WaitAcked(1, Deadline::InSeconds(20), [] { return Unavailable("server gone"); }, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
}

TEST(IpcRegion, AReaderThatFellOutOfTheRingGetsDataLossNotStaleBytes) {
  auto trainer = IpcRegion::Create(Options(1));
  auto reader = IpcRegion::Open(InfoFor(**trainer));
  (*trainer)->Publish(3, 1);  // slot 1 now carries seq 3; seq 1 is gone
  Status s = (*reader)->WaitPublished(1, 1, Deadline::InSeconds(1), "x");
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
}

TEST(IpcRegion, ATrainerThatDiesIsSeenWithinMillisecondsAndItsSlotsAreFreed) {
  int pipefd[2];
  ASSERT_EQ(pipe(pipefd), 0);
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto r = IpcRegion::Create(Options(1, 1 << 20));
    if (!r.ok()) _exit(3);
    std::memset((*r)->slot(0).data(), 7, (*r)->slot(0).size());
    std::string line = (*r)->path() + "\n" + (*r)->session() + "\n";
    if (write(pipefd[1], line.data(), line.size()) != static_cast<ssize_t>(line.size())) _exit(4);
    for (;;) pause();
  }
  close(pipefd[1]);
  char buf[512] = {};
  ssize_t n = 0, got;
  while ((got = read(pipefd[0], buf + n, sizeof(buf) - 1 - n)) > 0) {
    n += got;
    if (std::count(buf, buf + n, '\n') == 2) break;
  }
  close(pipefd[0]);
  std::string text(buf, n);
  IpcInitInfo info;
  info.control_path = text.substr(0, text.find('\n'));
  info.session = text.substr(text.find('\n') + 1, 32);
  info.num_slots = 2;
  info.slot_bytes = 1 << 20;
  info.reader_count = 1;
  auto reader = IpcRegion::Open(info);
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  EXPECT_EQ((*reader)->trainer_pid(), static_cast<uint32_t>(child));
  EXPECT_TRUE((*reader)->TrainerAlive());
  EXPECT_EQ((*reader)->slot(0)[100], std::byte{7});

  std::thread killer([child] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    kill(child, SIGKILL);
  });
  auto t0 = Clock::now();
  Status s = (*reader)->WaitPublished(1, 1, Deadline::InSeconds(20), "chunk 1/1 of sync 1");
  double waited = std::chrono::duration<double>(Clock::now() - t0).count();
  killer.join();
  int status = 0;
  waitpid(child, &status, 0);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  EXPECT_NE(s.message().find("exited during the sync"), std::string::npos) << s.message();
  EXPECT_LT(waited, 2.0);
  EXPECT_FALSE((*reader)->TrainerAlive());
}

TEST(IpcRegion, AnOrderlyTrainerShutdownPunchesOutTheSlots) {
  auto trainer = IpcRegion::Create(Options(1, 1 << 20));
  auto reader = IpcRegion::Open(InfoFor(**trainer));
  std::memset((*trainer)->slot(1).data(), 9, 1 << 20);
  EXPECT_EQ((*reader)->slot(1)[12345], std::byte{9});
  trainer->reset();
  EXPECT_EQ((*reader)->slot(1)[12345], std::byte{0});  // pages released, not pinned by the reader
  EXPECT_FALSE((*reader)->TrainerAlive());
}

// Several trainer ranks: publisher p packs into its own slots and waits only for the
// readers that attached to it; its readers wait only for its slot words.
TEST(IpcRegion, EachPublisherHandsOffToItsOwnReadersOnly) {
  IpcRegionOptions o = Options(3);
  o.publisher_count = 2;
  o.slots_in_region = false;  // GPU slots: the region holds the hand-off words only
  auto trainer = IpcRegion::Create(o);
  ASSERT_TRUE(trainer.ok()) << trainer.status().ToString();
  auto other = IpcRegion::OpenPublisher((*trainer)->path(), (*trainer)->session(), 1);
  ASSERT_TRUE(other.ok()) << other.status().ToString();
  EXPECT_EQ((*other)->publisher(), 1);
  // Publisher 1 is taken; there is no publisher 2.
  EXPECT_FALSE(IpcRegion::OpenPublisher((*trainer)->path(), (*trainer)->session(), 1).ok());
  EXPECT_FALSE(IpcRegion::OpenPublisher((*trainer)->path(), (*trainer)->session(), 2).ok());
  EXPECT_FALSE(IpcRegion::OpenPublisher((*trainer)->path(), NewSessionId(), 1).ok());
  auto reader = IpcRegion::Open(InfoFor(**trainer));
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  (*reader)->Attach(0, 11, 1);
  (*reader)->Attach(1, 12, 1);
  (*reader)->Attach(2, 13, 0);
  EXPECT_TRUE((*trainer)->HasReaders());
  EXPECT_TRUE((*other)->HasReaders());
  EXPECT_EQ((*trainer)->reader_publisher(1), 1);

  // Publisher 1 waits for the announcement of the sync it is about to pack.
  std::thread announcer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    (*trainer)->Announce(1, 1);
  });
  auto first = (*other)->WaitAnnounced(1, Deadline::InSeconds(20));
  announcer.join();
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_EQ(*first, 1u);

  // Publisher 1's chunk 1 is not publisher 0's: a reader of publisher 0 still waits.
  (*other)->Publish(1, 8);
  ASSERT_TRUE((*reader)->WaitPublished(1, 1, Deadline::InSeconds(5), "x", 1).ok());
  EXPECT_EQ((*reader)->WaitPublished(1, 1, Deadline::InSeconds(0.05), "x", 0).code(), StatusCode::kDeadlineExceeded);
  (*trainer)->Publish(1, 8);
  ASSERT_TRUE((*reader)->WaitPublished(1, 1, Deadline::InSeconds(5), "x", 0).ok());
  // Publisher 0 waits for reader 2 alone, publisher 1 for readers 0 and 1.
  (*reader)->Ack(2, 1);
  EXPECT_TRUE((*trainer)->WaitAcked(1, Deadline::InSeconds(5), nullptr, nullptr).ok());
  Status s = (*other)->WaitAcked(1, Deadline::InSeconds(0.05), nullptr, [](int r) { return "worker " + std::to_string(r); });
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(s.message().find("2 of 2 receiving worker(s)"), std::string::npos) << s.message();
  (*reader)->Ack(0, 1);
  (*reader)->Ack(1, 1);
  EXPECT_TRUE((*other)->WaitAcked(1, Deadline::InSeconds(5), nullptr, nullptr).ok());

  // Any publisher may abandon a sync; the first reason stays.
  (*other)->Abort(2, "rank 1 failed");
  (*trainer)->Abort(2, "rank 0 followed");
  EXPECT_EQ((*reader)->AbortedReason(2).value_or(""), "rank 1 failed");
  s = (*reader)->WaitPublished(3, 2, Deadline::InSeconds(5), "chunk 1/1 of sync 2", 0);
  EXPECT_EQ(s.code(), StatusCode::kAborted) << s.ToString();
  EXPECT_NE(s.message().find("rank 1 failed"), std::string::npos) << s.message();
  EXPECT_EQ((*other)->WaitAnnounced(2, Deadline::InSeconds(5)).status().code(), StatusCode::kAborted);
}

TEST(IpcRegion, APublisherThatDiesIsSeenByItsReadersWithinMilliseconds) {
  IpcRegionOptions o = Options(1);
  o.publisher_count = 2;
  auto trainer = IpcRegion::Create(o);
  ASSERT_TRUE(trainer.ok()) << trainer.status().ToString();
  auto reader = IpcRegion::Open(InfoFor(**trainer));
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  int pipefd[2];
  ASSERT_EQ(pipe(pipefd), 0);
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto p = IpcRegion::OpenPublisher((*trainer)->path(), (*trainer)->session(), 1);
    char c = p.ok() ? 'y' : 'n';
    if (write(pipefd[1], &c, 1) != 1) _exit(2);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    _exit(0);  // dies mid-sync, chunk 1 never published
  }
  char c = 0;
  ASSERT_EQ(read(pipefd[0], &c, 1), 1);
  ASSERT_EQ(c, 'y');
  EXPECT_TRUE((*reader)->PublisherAlive(1));
  auto t0 = Clock::now();
  Status s = (*reader)->WaitPublished(1, 1, Deadline::InSeconds(20), "chunk 1/1 of sync 1", 1);
  double took = std::chrono::duration<double>(Clock::now() - t0).count();
  int status = 0;
  waitpid(child, &status, 0);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  EXPECT_NE(s.message().find("publisher 1"), std::string::npos) << s.message();
  EXPECT_LT(took, 5);
  EXPECT_FALSE((*reader)->PublisherAlive(1));
  EXPECT_TRUE((*reader)->PublisherAlive(0));  // the trainer itself is alive
  close(pipefd[0]);
  close(pipefd[1]);
}

}  // namespace
}  // namespace wsync
