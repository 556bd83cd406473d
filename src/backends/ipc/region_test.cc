#include "backends/ipc/region.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "backends/ipc/region_testing.h"
#include "core/checked_math.h"
#include "core/subprocess.h"

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
  i.control_path = "/dev/shm/wsync-ipc-no-such-region";
  auto r = IpcRegion::Open(i, IpcOpenPolicy{"/dev/shm"});
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("is not a wsync ipc region this server may open"), std::string::npos)
      << r.status().message();

  // Garbage in a memfd (sealed, as the trainer's is) that the reader may open.
  int garbage = memfd_create("wsync-garbage", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_GE(garbage, 0);
  ASSERT_EQ(ftruncate(garbage, 1 << 20), 0);
  ASSERT_EQ(pwrite(garbage, std::string(4096, 'x').data(), 4096, 0), 4096);
  ASSERT_EQ(fcntl(garbage, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  i.control_path = "/proc/" + std::to_string(getpid()) + "/fd/" + std::to_string(garbage);
  i.control_bytes = 4096;
  r = IpcRegion::Open(i);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("not a wsync ipc region (bad magic)"), std::string::npos) << r.status().message();
  close(garbage);

  i = good;
  i.control_path = "/proc/self/status";  // exists, not a shared-memory file
  EXPECT_EQ(IpcRegion::Open(i).status().code(), StatusCode::kInvalidArgument);

  i = good;
  i.session = NewSessionId();
  r = IpcRegion::Open(i);
  EXPECT_NE(r.status().message().find("belongs to another session"), std::string::npos) << r.status().message();
  EXPECT_EQ(r.status().message().find(good.session), std::string::npos) << "the region's own session must not leak";

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
  EXPECT_FALSE(IpcRegion::Open(InfoFor(**trainer)).ok());  // POSIX shm only where the server's flags allow
  auto reader = IpcRegion::Open(InfoFor(**trainer), IpcOpenPolicy{"/dev/shm"});
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  EXPECT_FALSE((*reader)->sealed());
  (*trainer)->UnlinkName();
  EXPECT_FALSE(std::filesystem::exists((*trainer)->path()));
  EXPECT_FALSE(IpcRegion::Open(InfoFor(**trainer), IpcOpenPolicy{"/dev/shm"}).ok());
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
  auto trainer = Subprocess::Fork([&] {
    auto r = IpcRegion::Create(Options(1, 1 << 20));
    if (!r.ok()) return 3;
    std::memset((*r)->slot(0).data(), 7, (*r)->slot(0).size());
    std::string line = (*r)->path() + "\n" + (*r)->session() + "\n";
    if (write(pipefd[1], line.data(), line.size()) != static_cast<ssize_t>(line.size())) return 4;
    for (;;) pause();
  });
  ASSERT_TRUE(trainer.ok()) << trainer.status().ToString();
  pid_t child = (*trainer)->pid();
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
  EXPECT_TRUE((*trainer)->Wait(Deadline::InSeconds(10)).has_value());
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
  auto publisher = Subprocess::Fork([&]() -> int {
    auto p = IpcRegion::OpenPublisher((*trainer)->path(), (*trainer)->session(), 1);
    char c = p.ok() ? 'y' : 'n';
    if (write(pipefd[1], &c, 1) != 1) _exit(2);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    _exit(0);  // dies mid-sync without closing, chunk 1 never published
  });
  ASSERT_TRUE(publisher.ok()) << publisher.status().ToString();
  char c = 0;
  ASSERT_EQ(read(pipefd[0], &c, 1), 1);
  ASSERT_EQ(c, 'y');
  EXPECT_TRUE((*reader)->PublisherAlive(1));
  auto t0 = Clock::now();
  Status s = (*reader)->WaitPublished(1, 1, Deadline::InSeconds(20), "chunk 1/1 of sync 1", 1);
  double took = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_TRUE((*publisher)->Wait(Deadline::InSeconds(10)).has_value());
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  EXPECT_NE(s.message().find("publisher 1"), std::string::npos) << s.message();
  EXPECT_LT(took, 5);
  EXPECT_FALSE((*reader)->PublisherAlive(1));
  EXPECT_TRUE((*reader)->PublisherAlive(0));  // the trainer itself is alive
  close(pipefd[0]);
  close(pipefd[1]);
}

using ipc_testing::kHeaderBytesAt;
using ipc_testing::kNumSlotsAt;
using ipc_testing::kSlotStrideAt;
using ipc_testing::kTotalBytesAt;
using ipc_testing::Poke;

TEST(IpcRegion, AHeaderWhoseSlotsOverflow64BitsIsRefusedNamingTheField) {
  auto trainer = IpcRegion::Create(Options(1));
  ASSERT_TRUE(trainer.ok());
  // 4 slots of stride 2^62: header_bytes + stride * num_slots wraps to header_bytes.
  Poke<uint32_t>(**trainer, kNumSlotsAt, 4);
  Poke<uint64_t>(**trainer, kSlotStrideAt, uint64_t{1} << 62);
  IpcInitInfo info = InfoFor(**trainer);
  info.num_slots = 4;
  auto reader = IpcRegion::Open(info);
  if (reader.ok()) (*reader)->slot(1)[0] = std::byte{1};  // 2^62 bytes past the mapping
  ASSERT_FALSE(reader.ok());
  EXPECT_EQ(reader.status().code(), StatusCode::kInvalidArgument) << reader.status().ToString();
  EXPECT_NE(reader.status().message().find("slot_stride 4611686018427387904 x num_slots 4"), std::string::npos)
      << reader.status().message();

  for (auto [at, value, field] : {std::tuple{kHeaderBytesAt, uint64_t{1} << 63, "header_bytes"},
                                  std::tuple{kTotalBytesAt, uint64_t{1} << 40, "total_bytes"},
                                  std::tuple{kSlotStrideAt, uint64_t{1}, "slot_stride 1 is below slot_bytes"}}) {
    auto fresh = IpcRegion::Create(Options(1));
    Poke<uint64_t>(**fresh, at, value);
    auto r = IpcRegion::Open(InfoFor(**fresh));
    ASSERT_FALSE(r.ok()) << field;
    EXPECT_NE(r.status().message().find(field), std::string::npos) << r.status().message();
  }
}

TEST(IpcRegion, AHeaderRewrittenAfterOpenChangesNothingTheReaderUses) {
  auto trainer = IpcRegion::Create(Options(1));
  auto reader = IpcRegion::Open(InfoFor(**trainer));
  ASSERT_TRUE(reader.ok());
  std::span<std::byte> before = (*reader)->slot(1);
  Poke<uint32_t>(**trainer, kNumSlotsAt, 4);
  Poke<uint64_t>(**trainer, kSlotStrideAt, uint64_t{1} << 62);
  Poke<uint64_t>(**trainer, kHeaderBytesAt, ~uint64_t{0});
  EXPECT_EQ((*reader)->slot(1).data(), before.data());
  EXPECT_EQ((*reader)->slot(1).size(), before.size());
  EXPECT_TRUE((*reader)->slot(3).empty());
  (*trainer)->slot(1)[5] = std::byte{9};
  (*trainer)->Publish(1, 8);
  ASSERT_TRUE((*reader)->WaitPublished(1, 1, Deadline::InSeconds(5), "x").ok());
  EXPECT_EQ((*reader)->slot(1)[5], std::byte{9});
  EXPECT_TRUE((*reader)->CheckStillMapped().ok());
}

TEST(IpcRegion, TheTrainersMemfdIsSealedAndAnUnsealedOneIsRefused) {
  auto trainer = IpcRegion::Create(Options(1));
  ASSERT_TRUE(trainer.ok());
  int fd = open((*trainer)->path().c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  int seals = fcntl(fd, F_GET_SEALS);
  EXPECT_EQ(seals & (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL), F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  EXPECT_NE(ftruncate(fd, 4096), 0);  // nobody can shrink it under a receiver's mapping
  EXPECT_EQ(errno, EPERM);
  auto reader = IpcRegion::Open(InfoFor(**trainer));
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  EXPECT_TRUE((*reader)->sealed());

  // A trainer that does not seal (an older or hostile one; a trainer of this tree cannot
  // make one, so the test copies a valid region into an unsealed memfd).
  std::string bytes((*trainer)->bytes(), '\0');
  ASSERT_EQ(pread(fd, bytes.data(), bytes.size(), 0), static_cast<ssize_t>(bytes.size()));
  close(fd);
  int unsealed = memfd_create("wsync-ipc-unsealed", MFD_CLOEXEC);
  ASSERT_EQ(pwrite(unsealed, bytes.data(), bytes.size(), 0), static_cast<ssize_t>(bytes.size()));
  IpcInitInfo info = InfoFor(**trainer);
  info.control_path = "/proc/" + std::to_string(getpid()) + "/fd/" + std::to_string(unsealed);
  auto r = IpcRegion::Open(info);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("is not sealed (it needs F_SEAL_SHRINK|F_SEAL_GROW"), std::string::npos)
      << r.status().message();
  close(unsealed);
}

TEST(IpcRegion, AnUnsealedShmFileShrunkUnderTheMappingIsDataLossNotSigbus) {
  auto trainer = IpcRegion::Create(Options(1, 4096, ShmBacking::kPosixShm));
  ASSERT_TRUE(trainer.ok());
  auto reader = IpcRegion::Open(InfoFor(**trainer), IpcOpenPolicy{"/dev/shm"});
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  (*trainer)->slot(1)[7] = std::byte{42};
  (*trainer)->Publish(1, 8);
  ASSERT_TRUE((*reader)->WaitPublished(1, 1, Deadline::InSeconds(5), "chunk 1").ok());
  ASSERT_EQ((*reader)->slot(1)[7], std::byte{42});

  ASSERT_EQ(truncate((*trainer)->path().c_str(), 4096), 0);  // anyone who may write the file can
  Status s = (*reader)->CheckStillMapped();
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
  EXPECT_NE(s.message().find("shrank to 4096 bytes"), std::string::npos) << s.message();
  // A read already under way lands on zero pages instead of killing the process.
  EXPECT_EQ((*reader)->slot(1)[7], std::byte{0});
  s = (*reader)->WaitPublished(2, 1, Deadline::InSeconds(5), "chunk 2");
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
  EXPECT_NE(s.message().find("chunk 2"), std::string::npos) << s.message();
}

TEST(IpcRegion, AnAbortReasonInSharedMemoryReachesMessagesAsPrintableAscii) {
  auto trainer = IpcRegion::Create(Options(1));
  auto reader = IpcRegion::Open(InfoFor(**trainer));
  ASSERT_TRUE(reader.ok());
  (*trainer)->Abort(2, "tensor \xff\xfe\x01 failed");  // not UTF-8: a message must stay serializable
  Status s = (*reader)->WaitPublished(1, 2, Deadline::InSeconds(5), "chunk 1/1 of sync 2");
  EXPECT_EQ(s.code(), StatusCode::kAborted);
  EXPECT_NE(s.message().find("tensor ??? failed"), std::string::npos) << s.message();
  EXPECT_EQ((*reader)->AbortedReason(2), "tensor ??? failed");
}

// Every refusal of a path the server may not open reads the same, whatever is there.
TEST(IpcRegion, ControlPathsOutsideWhatTheFlagsAllowAreRefusedWithoutSayingWhatIsThere) {
  auto trainer = IpcRegion::Create(Options(1));
  IpcInitInfo good = InfoFor(**trainer);
  auto dir = std::filesystem::temp_directory_path() / ("wsync-ipc-root-" + NewSessionId());
  std::filesystem::create_directories(dir);
  IpcOpenPolicy policy{dir.string()};
  auto message = [&](const std::string& path) {
    IpcInitInfo i = good;
    i.control_path = path;
    auto r = IpcRegion::Open(i, policy);
    EXPECT_FALSE(r.ok()) << path;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << path;
    std::string m = r.status().message();
    size_t at = m.find(path);
    if (at != std::string::npos) m.replace(at, path.size(), "PATH");
    return m;
  };
  const std::string uniform = message("/etc/no-such-file-" + NewSessionId());
  EXPECT_NE(uniform.find("is not a wsync ipc region this server may open"), std::string::npos) << uniform;

  auto big = dir / "wsync-ipc-big";
  std::ofstream(big) << std::string(1 << 20, 'x');
  int devzero = open("/dev/zero", O_RDWR | O_CLOEXEC);
  int regular = open(big.c_str(), O_RDWR | O_CLOEXEC);
  int pipes[2];
  ASSERT_EQ(pipe(pipes), 0);
  std::filesystem::create_symlink(good.control_path, dir / "wsync-ipc-link");
  ASSERT_EQ(mkfifo((dir / "wsync-ipc-fifo").c_str(), 0600), 0);
  std::filesystem::create_directories(dir / "sub");
  std::ofstream(dir / "sub" / "wsync-ipc-x") << std::string(8192, 'x');
  std::ofstream(dir / "not-wsync") << std::string(8192, 'x');
  std::vector<std::string> refused = {
      "/etc/passwd",
      "/etc/hostname",
      "/dev/zero",
      "/proc/" + std::to_string(getpid()) + "/fd/" + std::to_string(devzero),
      "/proc/" + std::to_string(getpid()) + "/fd/" + std::to_string(regular),  // a regular file, 1 MiB, not shared memory
      "/proc/" + std::to_string(getpid()) + "/fd/" + std::to_string(pipes[0]),
      "/proc/self/fd/999999",
      "/proc/" + std::to_string(getpid()) + "/fd/999999",
      "/proc/self/status",
      "/proc/999999999/fd/3",
      "/proc/01/fd/3",
      (dir / "wsync-ipc-link").string(),           // a symlink to a real region
      (dir / "wsync-ipc-fifo").string(),           // must neither hang nor open
      (dir / "sub" / "wsync-ipc-x").string(),      // not directly in the directory
      (dir / "sub" / ".." / "wsync-ipc-big").string(),
      (dir / "not-wsync").string(),
      "/dev/shm/" + std::filesystem::path(good.control_path).filename().string(),
  };
  auto t0 = Clock::now();
  for (const std::string& path : refused) {
    SCOPED_TRACE(path);
    std::string m = message(path);
    EXPECT_EQ(m, uniform);
    EXPECT_EQ(m.find("1048576"), std::string::npos);
    EXPECT_EQ(m.find("No such file"), std::string::npos);
  }
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 5);
  // Inside the allowed directory the server may say more: it is not a region.
  IpcInitInfo i = good;
  i.control_path = big.string();
  EXPECT_NE(IpcRegion::Open(i, policy).status().message().find("bad magic"), std::string::npos);
  // The real region through the same policy still opens.
  ASSERT_TRUE(IpcRegion::Open(good, policy).ok());
  close(devzero);
  close(regular);
  close(pipes[0]);
  close(pipes[1]);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace wsync
