#include "backends/delta/local_checkpoint.h"

#include <gtest/gtest.h>
#include <linux/magic.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "backends/delta/fs.h"
#include "backends/delta/manifest.h"
#include "backends/delta/publisher.h"
#include "backends/delta/testing.h"
#include "core/sanitizers.h"
#include "core/subprocess.h"
#include "model/config.h"
#include "synthetic/synthetic.h"

namespace wsync::delta {
namespace {

using testing::CheckpointHolds;
using testing::TempDir;

// Whether this kernel has cachestat(2) (Linux 6.5+) and `dir` lies on a file system that
// writes pages back (not tmpfs): then a write-back is visible to WritableMapping.
bool WriteBackIsVisible(const std::string& dir) {
  errno = 0;
  bool cachestat = ::syscall(451, -1, nullptr, nullptr, 0) != 0 && errno != ENOSYS;
  struct statfs fs {};
  return cachestat && ::statfs(dir.c_str(), &fs) == 0 && fs.f_type != TMPFS_MAGIC;
}

// PrepareForWrite on a real file: writable entries are kept, entries a write-back
// protected are dropped and mapped again, and no byte changes on the way.
TEST(WritableMappingTest, KeepsWarmEntriesAndRemapsPagesWrittenBack) {
  TempDir dir("mapping");
  const std::string path = dir / "f.bin";
  constexpr size_t kBytes = 4 << 20;
  std::vector<uint8_t> expect(kBytes);
  for (size_t i = 0; i < kBytes; ++i) expect[i] = static_cast<uint8_t>(i * 131 + 7);
  {
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(expect.data()), kBytes);
  }
  auto m = WritableMapping::Open(path);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  // Two tensors' regions, the second not page-aligned at either end.
  std::span<std::byte> a = m->bytes().subspan(0, 1 << 20), b = m->bytes().subspan((1 << 20) + 100, (2 << 20) + 50);
  auto write_version = [&](uint8_t x) {
    for (std::span<std::byte> r : {a, b}) {
      for (std::byte& v : r) v ^= std::byte{x};
      size_t off = static_cast<size_t>(r.data() - m->bytes().data());
      for (size_t i = 0; i < r.size(); ++i) expect[off + i] ^= x;
    }
  };
  auto file_holds_expect = [&] {
    std::ifstream in(path, std::ios::binary);
    std::vector<uint8_t> got(kBytes);
    in.read(reinterpret_cast<char*>(got.data()), kBytes);
    return got == expect;
  };
  using P = WritableMapping::Prepared;
  m->BeginVersion();
  EXPECT_EQ(m->PrepareForWrite(a), P::kMapped);
  EXPECT_EQ(m->PrepareForWrite(b), P::kMapped);
  write_version(0x5a);
  EXPECT_TRUE(file_holds_expect());

  const bool visible = WriteBackIsVisible(dir.path());
  if (visible) {
    // Still dirty and writable: kept. The probe times a few hundred page touches, so a
    // preempted one may find them slow and re-map; a second try finds them writable.
    bool warm = false;
    for (int attempt = 0; attempt < 3 && !warm; ++attempt) {
      m->BeginVersion();
      warm = m->PrepareForWrite(a) == P::kWarm;
    }
    EXPECT_TRUE(warm);
  }
  write_version(0x11);
  EXPECT_TRUE(file_holds_expect());

  ASSERT_TRUE(WriteBackTree(dir.path()).ok());
  m->BeginVersion();
  P pa = m->PrepareForWrite(a), pb = m->PrepareForWrite(b);
  if (visible) {
    EXPECT_EQ(pa, P::kRemapped);
    EXPECT_EQ(pb, P::kRemapped);
  }
  write_version(0xc3);
  EXPECT_TRUE(file_holds_expect());

  // A second mapping of the file re-dirties the pages after a write-back: the first
  // mapping's entries stay write-protected although every page is dirty. Whatever it
  // decides, the bytes must come out right.
  auto other = WritableMapping::Open(path);
  ASSERT_TRUE(other.ok());
  ASSERT_TRUE(WriteBackTree(dir.path()).ok());
  other->BeginVersion();
  EXPECT_EQ(other->PrepareForWrite(other->bytes()), P::kMapped);
  for (size_t i = 0; i < kBytes; ++i) {
    other->bytes()[i] ^= std::byte{0x3c};
    expect[i] ^= 0x3c;
  }
  m->BeginVersion();
  (void)m->PrepareForWrite(a);
  (void)m->PrepareForWrite(b);
  write_version(0x96);
  EXPECT_TRUE(file_holds_expect());
}

// A base checkpoint of qwen3-tiny, a trainer starting from it, and a publisher.
class LocalCheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto config = LookupModel("qwen3-tiny");
    ASSERT_TRUE(config.ok());
    auto t = SyntheticTrainer::FromMetadata(HfTensors(*config), 5, 2);
    ASSERT_TRUE(t.ok());
    trainer_ = std::move(*t);
    ASSERT_TRUE(testing::WriteCheckpoint(base(), trainer_->tensors()).ok());
    DeltaPublisherOptions o;
    o.sync_dir = sync();
    o.base_checkpoint = base();
    o.threads = 2;
    auto p = DeltaPublisher::Create(o, trainer_->metadata());
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    publisher_ = std::move(*p);
  }

  std::string base() const { return dir_ / "base"; }
  std::string sync() const { return dir_ / "sync"; }
  std::string root(const std::string& name = "local") const { return dir_ / name; }

  // Trains and publishes `steps` more versions.
  void PublishSteps(int steps) {
    for (int i = 0; i < steps; ++i) {
      ASSERT_TRUE(trainer_->Step(++step_).ok());
      auto st = publisher_->Publish(trainer_->source());
      ASSERT_TRUE(st.ok()) << st.status().ToString();
    }
  }

  LocalCheckpointOptions Options(const std::string& name, size_t threads) const {
    LocalCheckpointOptions o;
    o.base_checkpoint = base();
    o.root = root(name);
    o.threads = threads;
    return o;
  }

  // A second trainer run from the same base: its own trainer and a publisher into a
  // fresh sync dir, sync2(). `trainer` is null when a step of the setup failed.
  struct Chain {
    std::unique_ptr<SyntheticTrainer> trainer;
    std::unique_ptr<DeltaPublisher> publisher;
  };
  std::string sync2() const { return dir_ / "sync2"; }
  Chain SecondChain() {
    Chain c;
    auto t = SyntheticTrainer::FromMetadata(trainer_->metadata(), 5, 2);
    DeltaPublisherOptions o;
    o.sync_dir = sync2();
    o.base_checkpoint = base();
    auto p = DeltaPublisher::Create(o, trainer_->metadata());
    EXPECT_TRUE(t.ok() && p.ok());
    if (t.ok() && p.ok()) c = Chain{std::move(*t), std::move(*p)};
    return c;
  }
  // Trains the chain one step (to `step`) and publishes it.
  static bool PublishStep(Chain& c, uint64_t step) {
    return c.trainer->Step(step).ok() && c.publisher->Publish(c.trainer->source()).ok();
  }

  std::unique_ptr<LocalCheckpoint> Open(const std::string& name = "local") {
    auto c = LocalCheckpoint::Open(Options(name, 2), Deadline::InSeconds(30));
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return c.ok() ? std::move(*c) : nullptr;
  }

  TempDir dir_{"local"};
  std::unique_ptr<SyntheticTrainer> trainer_;
  std::unique_ptr<DeltaPublisher> publisher_;
  uint64_t step_ = 0;
};

TEST_F(LocalCheckpointTest, ALateReceiverReplaysTheWholeChainBitExact) {
  PublishSteps(3);
  auto local = Open();
  EXPECT_EQ(local->CurrentDir(), base());
  auto r = local->Fetch(3, sync(), Deadline::InSeconds(30));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->from_version, 0);
  EXPECT_EQ(r->versions, 3);
  EXPECT_TRUE(r->applied);
  EXPECT_EQ(local->CurrentDir(), root() + "/weights");
  EXPECT_TRUE(CheckpointHolds(local->CurrentDir(), trainer_->tensors()));
  EXPECT_TRUE(local->ValidateReady(3).ok());
  EXPECT_EQ(local->ValidateReady(2).code(), StatusCode::kFailedPrecondition);
  // The base is never modified.
  auto base_ckpt = CheckpointDir::Open(base());
  ASSERT_TRUE(base_ckpt.ok());
  // Already there: nothing to do. Behind the local version: refused.
  auto again = local->Fetch(3, sync(), Deadline::InSeconds(30));
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(again->applied);
  EXPECT_EQ(local->Fetch(2, sync(), Deadline::InSeconds(30)).status().code(), StatusCode::kFailedPrecondition);
  // One more version, incrementally; then an empty one.
  PublishSteps(1);
  ASSERT_TRUE(publisher_->Publish(trainer_->source()).ok());
  auto next = local->Fetch(5, sync(), Deadline::InSeconds(30));
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  EXPECT_EQ(next->versions, 2);
  EXPECT_TRUE(CheckpointHolds(local->CurrentDir(), trainer_->tensors()));
  auto state = local->ReadState();
  ASSERT_TRUE(state.ok());
  EXPECT_EQ(state->version, 5);
  EXPECT_FALSE(state->write_in_progress);
  EXPECT_EQ(state->sync_dir, sync());
}

TEST_F(LocalCheckpointTest, ACorruptPayloadByteIsDetectedAndTheNextFetchRebuildsFromTheBase) {
  PublishSteps(2);
  auto local = Open();
  std::string payload = VersionDir(sync(), 2) + "/" + PayloadFileName(0, 0);
  std::string good = *ReadFile(payload);
  std::string bad = good;
  bad[bad.size() - bad.size() / 3] ^= 0x04;  // inside some tensor's frame
  ASSERT_TRUE(WriteFileAtomic(payload, bad).ok());
  auto r = local->Fetch(2, sync(), Deadline::InSeconds(30));
  ASSERT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status().ToString();
  EXPECT_NE(r.status().message().find("version 2"), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find(PayloadFileName(0, 0)), std::string::npos) << r.status().message();
  EXPECT_TRUE(local->ReadState()->write_in_progress);
  EXPECT_EQ(local->ValidateReady(2).code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(WriteFileAtomic(payload, good).ok());
  auto fixed = local->Fetch(2, sync(), Deadline::InSeconds(30));
  ASSERT_TRUE(fixed.ok()) << fixed.status().ToString();
  EXPECT_TRUE(fixed->reset);
  EXPECT_EQ(fixed->versions, 2);
  EXPECT_TRUE(CheckpointHolds(local->CurrentDir(), trainer_->tensors()));
}

TEST_F(LocalCheckpointTest, AManifestWithAWrongBaseVersionIsRefusedWithoutTouchingTheFiles) {
  PublishSteps(2);
  auto local = Open();
  ASSERT_TRUE(local->Fetch(1, sync(), Deadline::InSeconds(30)).ok());
  std::string path = VersionDir(sync(), 2) + "/manifest.json";
  auto m = nlohmann::json::parse(*ReadFile(path));
  m["base_version"] = 0;
  ASSERT_TRUE(WriteFileAtomic(path, m.dump()).ok());
  auto r = local->Fetch(2, sync(), Deadline::InSeconds(30));
  ASSERT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << r.status().ToString();
  EXPECT_NE(r.status().message().find("base_version 0"), std::string::npos) << r.status().message();
  auto state = local->ReadState();
  EXPECT_EQ(state->version, 1);
  EXPECT_FALSE(state->write_in_progress);
  // With the manifest repaired, a fetch past the last published version applies what
  // exists, then stops at the first missing version: NotFound naming it, state clean.
  m["base_version"] = 1;
  ASSERT_TRUE(WriteFileAtomic(path, m.dump()).ok());
  auto past = local->Fetch(9, sync(), Deadline::InSeconds(30));
  EXPECT_EQ(past.status().code(), StatusCode::kNotFound) << past.status().ToString();
  EXPECT_NE(past.status().message().find("version 3"), std::string::npos) << past.status().message();
  EXPECT_EQ(local->ReadState()->version, 2);
  EXPECT_FALSE(local->ReadState()->write_in_progress);
  EXPECT_TRUE(CheckpointHolds(local->CurrentDir(), trainer_->tensors()));
}

TEST_F(LocalCheckpointTest, ConcurrentFetchesOfOneHostApplyOnce) {
  PublishSteps(2);
  std::vector<std::unique_ptr<LocalCheckpoint>> workers;
  for (int i = 0; i < 4; ++i) workers.push_back(Open());
  std::vector<Result<FetchReport>> reports(workers.size(), Internal("not run"));
  std::vector<std::thread> threads;
  for (size_t i = 0; i < workers.size(); ++i) {
    threads.emplace_back([&, i] { reports[i] = workers[i]->Fetch(2, sync(), Deadline::InSeconds(30)); });
  }
  for (auto& t : threads) t.join();
  int applied = 0;
  for (auto& r : reports) {
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    applied += r->applied;
  }
  EXPECT_EQ(applied, 1);
  EXPECT_TRUE(CheckpointHolds(workers[0]->CurrentDir(), trainer_->tensors()));
}

TEST_F(LocalCheckpointTest, AnApplyKilledMidwayRecoversFromTheBase) {
  PublishSteps(2);
  Open();  // state at version 0
  auto child = Subprocess::Fork([&] {
    int applied = 0;
    LocalCheckpointOptions o = Options("local", 1);
    o.after_tensor_applied = [&](std::string_view) {
      if (++applied == 3) ::_exit(42);  // dies with the files half-patched
    };
    auto c = LocalCheckpoint::Open(o, Deadline::InSeconds(30));
    if (!c.ok()) return 1;
    (void)(*c)->Fetch(2, sync(), Deadline::InSeconds(30));
    return 0;
  });
  ASSERT_TRUE(child.ok()) << child.status().ToString();
  std::optional<ExitStatus> st = (*child)->Wait(Deadline::InSeconds(60));
  ASSERT_TRUE(st.has_value());
  ASSERT_EQ(st->ShellCode(), 42) << st->ToString();
  auto local = Open();
  EXPECT_TRUE(local->ReadState()->write_in_progress);
  EXPECT_FALSE(CheckpointHolds(local->CurrentDir(), trainer_->tensors()));
  auto r = local->Fetch(2, sync(), Deadline::InSeconds(30));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->reset);
  EXPECT_TRUE(CheckpointHolds(local->CurrentDir(), trainer_->tensors()));
}

// A new sync dir resets the files from the base. Receivers keep the local files mapped
// between versions, so another receiver of the host that applied the old chain must
// write the rebuilt files on its next apply, not its old mapping.
TEST_F(LocalCheckpointTest, ANewSyncDirStartsANewChainFromTheBase) {
  PublishSteps(2);
  auto other = Open();
  ASSERT_TRUE(other->Fetch(2, sync(), Deadline::InSeconds(30)).ok());  // it applies, and keeps the mapping
  auto local = Open();
  ASSERT_TRUE(local->Fetch(2, sync(), Deadline::InSeconds(30)).ok());
  // A second trainer run: a fresh sync dir whose version 1 is the base plus one step.
  Chain two = SecondChain();
  ASSERT_TRUE(two.trainer);
  ASSERT_TRUE(PublishStep(two, 1));
  auto r = local->Fetch(1, sync2(), Deadline::InSeconds(30));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->reset);
  EXPECT_TRUE(CheckpointHolds(local->CurrentDir(), two.trainer->tensors()));
  ASSERT_TRUE(PublishStep(two, 2));
  auto ro = other->Fetch(2, sync2(), Deadline::InSeconds(30));
  ASSERT_TRUE(ro.ok()) << ro.status().ToString();
  EXPECT_FALSE(ro->reset);
  EXPECT_EQ(ro->versions, 1);
  EXPECT_TRUE(CheckpointHolds(local->CurrentDir(), two.trainer->tensors()));
}

// Without cachestat (Linux before 6.5, or a seccomp filter that refuses it) the timed
// probe alone finds the entries a write-back protected, and leaves writable ones be.
TEST(WritableMappingTest, WithoutCachestatTheProbeFindsPagesWrittenBack) {
#ifdef WSYNC_SANITIZED
  GTEST_SKIP() << "the probe classifies pages by how long a fault takes; ASan changes that time";
#endif
  TempDir dir("mapping");
  struct statfs fs {};
  if (::statfs(dir.path().c_str(), &fs) != 0 || fs.f_type == TMPFS_MAGIC) GTEST_SKIP() << "needs a disk file system";
  const std::string path = dir / "f.bin";
  {
    std::ofstream out(path, std::ios::binary);
    std::vector<char> bytes(1 << 20, 'y');
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  WritableMapping::DisableCachestatForTesting(true);
  struct Restore {
    ~Restore() { WritableMapping::DisableCachestatForTesting(false); }
  } restore;
  auto m = WritableMapping::Open(path);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  using P = WritableMapping::Prepared;
  m->BeginVersion();
  EXPECT_EQ(m->PrepareForWrite(m->bytes()), P::kMapped);
  for (std::byte& b : m->bytes()) b ^= std::byte{2};
  bool warm = false;
  for (int attempt = 0; attempt < 3 && !warm; ++attempt) {  // see KeepsWarmEntriesAndRemapsPagesWrittenBack
    m->BeginVersion();
    warm = m->PrepareForWrite(m->bytes()) == P::kWarm;
  }
  EXPECT_TRUE(warm);
  ASSERT_TRUE(WriteBackTree(dir.path()).ok());
  m->BeginVersion();
  EXPECT_EQ(m->PrepareForWrite(m->bytes()), P::kRemapped);
  for (std::byte& b : m->bytes()) b ^= std::byte{2};
  std::ifstream in(path, std::ios::binary);
  std::vector<char> got(1 << 20);
  in.read(got.data(), static_cast<std::streamsize>(got.size()));
  EXPECT_EQ(got, std::vector<char>(1 << 20, 'y'));
}

// tmpfs never writes back, and cachestat never counts its pages dirty: the entries a
// mapping made writable stay so, and must not be dropped and faulted in again for every
// version (one fault per 4 KiB page on tmpfs).
TEST(WritableMappingTest, OnTmpfsPreparedPagesStayWarm) {
  struct statfs fs {};
  if (::statfs("/dev/shm", &fs) != 0 || fs.f_type != TMPFS_MAGIC) GTEST_SKIP() << "no tmpfs at /dev/shm";
  const std::string path = fmt::format("/dev/shm/wsync-mapping-test-{}", ::getpid());
  {
    std::ofstream out(path, std::ios::binary);
    std::vector<char> bytes(2 << 20, 'x');
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  {
    auto m = WritableMapping::Open(path);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    m->BeginVersion();
    EXPECT_EQ(m->PrepareForWrite(m->bytes()), WritableMapping::Prepared::kMapped);
    for (std::byte& b : m->bytes()) b ^= std::byte{1};
    bool warm = false;
    for (int attempt = 0; attempt < 3 && !warm; ++attempt) {  // see KeepsWarmEntriesAndRemapsPagesWrittenBack
      m->BeginVersion();
      warm = m->PrepareForWrite(m->bytes()) == WritableMapping::Prepared::kWarm;
    }
    EXPECT_TRUE(warm);
    EXPECT_EQ(m->bytes()[12345], std::byte{'x' ^ 1});
  }
  ::unlink(path.c_str());
}

// Steps further apart than the kernel keeps pages dirty: the files are written back
// between versions, and the next apply maps their pages again (and stays bit-exact).
TEST_F(LocalCheckpointTest, AVersionAfterAWriteBackRemapsThePagesAndStaysBitExact) {
  PublishSteps(3);
  auto local = Open();
  auto r1 = local->Fetch(1, sync(), Deadline::InSeconds(30));
  ASSERT_TRUE(r1.ok()) << r1.status().ToString();
  EXPECT_EQ(r1->remapped_bytes, 0u);  // a fresh mapping has nothing to re-map
  ASSERT_TRUE(WriteBackTree(root() + "/weights").ok());
  auto r2 = local->Fetch(2, sync(), Deadline::InSeconds(30));
  ASSERT_TRUE(r2.ok()) << r2.status().ToString();
  if (WriteBackIsVisible(root())) {
    // Not every tensor: with large folios (2 MiB), re-mapping the first tensor of a folio
    // leaves the folio dirty and the small tensors beside it writable again.
    EXPECT_GT(r2->remapped_bytes, 0u);
  }
  auto r3 = local->Fetch(3, sync(), Deadline::InSeconds(30));
  ASSERT_TRUE(r3.ok()) << r3.status().ToString();
  EXPECT_TRUE(CheckpointHolds(local->CurrentDir(), trainer_->tensors()));
}

// Frames whose large tensors were encoded in parts (fresh tables mid-frame) apply and
// verify bit-exactly through the receiver's SparseApplier, never through libzstd.
TEST_F(LocalCheckpointTest, AChainPublishedInPartsAppliesBitExact) {
  DeltaPublisherOptions o;
  o.sync_dir = sync2();
  o.base_checkpoint = base();
  o.threads = kMinThreadsForParts;
  o.part_bytes = 16 << 10;
  auto pub = DeltaPublisher::Create(o, trainer_->metadata());
  ASSERT_TRUE(pub.ok()) << pub.status().ToString();
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(trainer_->Step(++step_).ok());
    ASSERT_TRUE((*pub)->Publish(trainer_->source()).ok());
  }
  auto local = Open();
  auto r = local->Fetch(2, sync2(), Deadline::InSeconds(30));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->versions, 2);
  EXPECT_EQ(r->libzstd_frames, 0u);
  EXPECT_TRUE(CheckpointHolds(local->CurrentDir(), trainer_->tensors()));
}

TEST_F(LocalCheckpointTest, TheWriterLockWaitHasADeadline) {
  auto local = Open();
  auto held = FileLock::Acquire(root() + "/.skyrl_weight_sync/writer.lock", FileLock::Mode::kExclusive,
                                Deadline::InSeconds(5));
  ASSERT_TRUE(held.ok());
  auto r = local->Fetch(0, sync(), Deadline::InSeconds(0.2));
  EXPECT_EQ(r.status().code(), StatusCode::kDeadlineExceeded) << r.status().ToString();
  EXPECT_EQ(local->LockForReading(Deadline::InSeconds(0.1)).status().code(), StatusCode::kDeadlineExceeded);
}

TEST(ParseCheckpointStateTest, WrongTypesAreDataLossNeverAnException) {
  auto ok = ParseCheckpointState(R"({"version": 3, "write_in_progress": false, "target_version": null,
                                     "base_model_path": "/b", "sync_dir": "/s"})");
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->version, 3);
  EXPECT_EQ(ok->sync_dir, "/s");
  for (const char* bad : {R"({"version": "two"})", R"({"version": -1})", R"({"version": 18446744073709551615})",
                          R"({"write_in_progress": 1})", R"({"target_version": [1]})", R"({"sync_dir": 7})",
                          R"({"base_model_path": {}})", "[1, 2]", "{", ""}) {
    auto r = ParseCheckpointState(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << bad;
  }
  auto deep = ParseCheckpointState(R"({"sync_dir": )" + std::string(100000, '[') + std::string(100000, ']') + "}");
  ASSERT_FALSE(deep.ok());
  EXPECT_EQ(deep.status().code(), StatusCode::kDataLoss);
  EXPECT_EQ(deep.status().message(), "the state: field 'sync_dir' nests deeper than 64 levels");
}

}  // namespace
}  // namespace wsync::delta
