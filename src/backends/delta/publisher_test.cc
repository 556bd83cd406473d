#include "backends/delta/publisher.h"

#include <gtest/gtest.h>
#include <zstd.h>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "backends/delta/base_digest.h"
#include "backends/delta/fs.h"
#include "backends/delta/manifest.h"
#include "backends/delta/state_file.h"
#include "backends/delta/testing.h"
#include "core/process_memory.h"
#include "core/sanitizers.h"
#include "format/safetensors.h"
#include "model/config.h"
#include "synthetic/synthetic.h"
#include "testing/faulty_source.h"

namespace wsync::delta {
namespace {

using testing::TempDir;

std::unique_ptr<SyntheticTrainer> Tiny(uint64_t seed = 11) {
  auto config = LookupModel("qwen3-tiny");
  EXPECT_TRUE(config.ok());
  auto t = SyntheticTrainer::FromMetadata(HfTensors(*config), seed, 2);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return std::move(*t);
}

std::vector<std::vector<std::byte>> Copy(const std::vector<HostTensor>& tensors) {
  std::vector<std::vector<std::byte>> out;
  for (const HostTensor& t : tensors) out.emplace_back(t.ref().bytes.begin(), t.ref().bytes.end());
  return out;
}

// Decompresses one record's payload and XORs it into `old`.
std::vector<std::byte> Patched(const std::string& sync_dir, const DeltaManifest& m, const DeltaTensorRecord& r,
                               std::vector<std::byte> old) {
  auto file = SafetensorsFile::Open(VersionDir(sync_dir, m.version) + "/" + r.payload_file);
  EXPECT_TRUE(file.ok()) << file.status().ToString();
  auto frame = file->Bytes(r.payload_key);
  EXPECT_TRUE(frame.ok());
  std::vector<std::byte> patch(r.uncompressed_num_bytes);
  EXPECT_EQ(ZSTD_decompress(patch.data(), patch.size(), frame->data(), frame->size()), patch.size());
  for (size_t i = 0; i < old.size(); ++i) old[i] ^= patch[i];
  return old;
}

TEST(DeltaPublisherTest, FirstPassIsVersionZeroThenEachStepIsAVerifiableDelta) {
  TempDir dir("pub");
  auto trainer = Tiny();
  DeltaPublisherOptions o;
  o.sync_dir = dir / "sync";
  o.threads = 2;
  auto pub = DeltaPublisher::Create(o, trainer->metadata());
  ASSERT_TRUE(pub.ok()) << pub.status().ToString();
  auto first = (*pub)->Publish(trainer->source());
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_EQ(first->version, 1);
  // Version 1 is the full version of the first pass: a record per tensor whose patch
  // changes nothing and whose checksum is the tensor's digest, and the base's digest.
  EXPECT_TRUE(first->full_version);
  EXPECT_EQ(first->changed_tensors, trainer->tensors().size());
  EXPECT_EQ(first->changed_bytes, 0u);
  EXPECT_LT(first->compressed_bytes, first->model_bytes / 1000);
  auto m1 = ReadManifest(o.sync_dir, 1);
  ASSERT_TRUE(m1.ok()) << m1.status().ToString();
  EXPECT_EQ(m1->base_version, 0);
  ASSERT_EQ(m1->tensors.size(), trainer->tensors().size());
  TensorDigests digests;
  for (const HostTensor& t : trainer->tensors()) {
    digests[t.meta.name] = HexDigest(DigestAlgorithm::kXxh3_128, t.ref().bytes);
    auto it = std::find_if(m1->tensors.begin(), m1->tensors.end(), [&](const auto& r) { return r.name == t.meta.name; });
    ASSERT_NE(it, m1->tensors.end()) << t.meta.name;
    EXPECT_EQ(it->checksum, digests[t.meta.name]);
    std::vector<std::byte> bytes(t.ref().bytes.begin(), t.ref().bytes.end());
    EXPECT_EQ(Patched(o.sync_dir, *m1, *it, bytes), bytes) << t.meta.name;
  }
  EXPECT_EQ(m1->base_digest, CombineDigests(digests));
  EXPECT_EQ((*pub)->base_digest(), m1->base_digest);

  auto old = Copy(trainer->tensors());
  ASSERT_TRUE(trainer->Step(1).ok());
  auto second = (*pub)->Publish(trainer->source());
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  EXPECT_EQ(second->version, 2);
  EXPECT_GT(second->changed_tensors, 0u);
  EXPECT_LT(second->compressed_bytes, second->model_bytes / 5);
  auto m2 = ReadManifest(o.sync_dir, 2);
  ASSERT_TRUE(m2.ok()) << m2.status().ToString();
  EXPECT_EQ(m2->base_version, 1);
  EXPECT_EQ(m2->payload_files, std::vector<std::string>{PayloadFileName(0, 0)});
  size_t checked = 0;
  for (size_t i = 0; i < trainer->tensors().size(); ++i) {
    const HostTensor& t = trainer->tensors()[i];
    auto it = std::find_if(m2->tensors.begin(), m2->tensors.end(), [&](const auto& r) { return r.name == t.meta.name; });
    bool changed = !std::equal(old[i].begin(), old[i].end(), t.ref().bytes.begin());
    ASSERT_EQ(it != m2->tensors.end(), changed) << t.meta.name;
    if (!changed) continue;
    EXPECT_EQ(it->checksum, HexDigest(DigestAlgorithm::kXxh3_128, t.ref().bytes));
    EXPECT_EQ(it->shape, t.meta.shape);
    std::vector<std::byte> now = Patched(o.sync_dir, *m2, *it, old[i]);
    EXPECT_TRUE(std::equal(now.begin(), now.end(), t.ref().bytes.begin())) << t.meta.name;
    ++checked;
  }
  EXPECT_EQ(checked, m2->tensors.size());
}

// One record's payload: the zstd frame as stored.
std::vector<uint8_t> FrameOf(const std::string& sync_dir, const DeltaManifest& m, const DeltaTensorRecord& r) {
  auto file = SafetensorsFile::Open(VersionDir(sync_dir, m.version) + "/" + r.payload_file);
  EXPECT_TRUE(file.ok()) << file.status().ToString();
  if (!file.ok()) return {};
  auto frame = file->Bytes(r.payload_key);
  EXPECT_TRUE(frame.ok());
  if (!frame.ok()) return {};
  const auto* p = reinterpret_cast<const uint8_t*>(frame->data());
  return {p, p + frame->size()};
}

// Tensors larger than twice part_bytes are encoded in parts on any pool thread and joined
// into one frame: the payload is the same bytes on four threads or seven, and each record
// has the checksum and decodes to the patch of a publisher that never splits. A pool of
// fewer than four threads never splits either.
TEST(DeltaPublisherTest, LargeTensorsEncodedInPartsGiveTheSameFramesOnAnyThreadCount) {
  TempDir dir("pub");
  auto trainer = Tiny();
  struct Run {
    std::string sync;
    size_t threads, part_bytes;
    std::unique_ptr<DeltaPublisher> pub;
  };
  std::vector<Run> runs;
  runs.push_back({dir / "four-threads", 4, 16 << 10, nullptr});
  runs.push_back({dir / "seven-threads", 7, 16 << 10, nullptr});
  runs.push_back({dir / "unsplit", 2, 0, nullptr});
  runs.push_back({dir / "three-threads", 3, 16 << 10, nullptr});  // too few threads to split
  for (Run& r : runs) {
    DeltaPublisherOptions o;
    o.sync_dir = r.sync;
    o.threads = r.threads;
    o.part_bytes = r.part_bytes;
    auto p = DeltaPublisher::Create(o, trainer->metadata());
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    r.pub = std::move(*p);
    ASSERT_TRUE(r.pub->Publish(trainer->source()).ok());
  }
  size_t split = 0;
  for (uint64_t step = 1; step <= 2; ++step) {
    ASSERT_TRUE(trainer->Step(step).ok());
    for (Run& r : runs) ASSERT_TRUE(r.pub->Publish(trainer->source()).ok()) << r.sync;
    std::vector<DeltaManifest> m;
    for (Run& r : runs) {
      auto read = ReadManifest(r.sync, static_cast<int64_t>(step) + 1);
      ASSERT_TRUE(read.ok()) << read.status().ToString();
      m.push_back(std::move(*read));
    }
    ASSERT_EQ(m[0].tensors.size(), m[2].tensors.size());
    ASSERT_EQ(m[1].tensors.size(), m[2].tensors.size());
    ASSERT_EQ(m[3].tensors.size(), m[2].tensors.size());
    for (size_t i = 0; i < m[2].tensors.size(); ++i) {
      const DeltaTensorRecord &a = m[0].tensors[i], &b = m[1].tensors[i], &c = m[2].tensors[i], &d = m[3].tensors[i];
      ASSERT_EQ(a.name, c.name);
      EXPECT_EQ(a.checksum, c.checksum) << a.name;
      EXPECT_EQ(b.checksum, c.checksum) << a.name;
      std::vector<uint8_t> fa = FrameOf(runs[0].sync, m[0], a), fb = FrameOf(runs[1].sync, m[1], b),
                           fc = FrameOf(runs[2].sync, m[2], c);
      EXPECT_EQ(fa, fb) << a.name << ": the frame depends on the thread count";
      EXPECT_EQ(FrameOf(runs[3].sync, m[3], d), fc) << a.name << ": three threads split";
      std::vector<std::byte> pa(a.uncompressed_num_bytes), pc(c.uncompressed_num_bytes);
      ASSERT_EQ(ZSTD_decompress(pa.data(), pa.size(), fa.data(), fa.size()), pa.size()) << a.name;
      ASSERT_EQ(ZSTD_decompress(pc.data(), pc.size(), fc.data(), fc.size()), pc.size()) << a.name;
      EXPECT_EQ(pa, pc) << a.name;
      if (a.uncompressed_num_bytes > 2 * (16 << 10)) {
        ++split;
        EXPECT_NE(fa, fc) << a.name << ": encoded in parts, yet the same frame as unsplit";
      }
    }
  }
  EXPECT_GT(split, 0u) << "no tensor of qwen3-tiny was large enough to be split";
}

TEST(DeltaPublisherTest, UnchangedTensorsAreOmittedAndPayloadFilesRollOver) {
  TempDir dir("pub");
  std::vector<HostTensor> tensors;
  for (int i = 0; i < 4; ++i) tensors.push_back(*HostTensor::Zeros(TensorMeta{fmt::format("t{}", i), DType::kF32, {4096}}));
  HostTensorSource source(std::move(tensors));
  DeltaPublisherOptions o;
  o.sync_dir = dir / "sync";
  o.max_file_bytes = 1;  // every frame is bigger: one file per changed tensor
  auto pub = DeltaPublisher::Create(o, source.metadata());
  ASSERT_TRUE(pub.ok());
  ASSERT_TRUE((*pub)->Publish(source).ok());
  for (int i : {0, 2, 3}) source.tensors()[i].storage.data()[i * 8] = std::byte{1};
  auto st = (*pub)->Publish(source);
  ASSERT_TRUE(st.ok()) << st.status().ToString();
  auto m = ReadManifest(o.sync_dir, 2);
  ASSERT_TRUE(m.ok());
  ASSERT_EQ(m->tensors.size(), 3u);
  EXPECT_EQ(m->tensors[1].name, "t2");
  EXPECT_EQ(m->payload_files.size(), 3u);
  EXPECT_EQ(m->tensors[2].payload_file, PayloadFileName(0, 2));
  EXPECT_EQ(st->changed_bytes, 3u);
  // Nothing changed: still a new, empty version.
  auto empty = (*pub)->Publish(source);
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->version, 3);
  EXPECT_TRUE(ReadManifest(o.sync_dir, 3)->tensors.empty());
}

TEST(DeltaPublisherTest, XorsInTheBaseCheckpointsOnDiskDtypeAndSkipsNamesItLacks) {
  TempDir dir("pub");
  std::vector<HostTensor> tensors;
  tensors.push_back(*HostTensor::Zeros(TensorMeta{"a", DType::kBF16, {64, 64}}));
  tensors.push_back(*HostTensor::Zeros(TensorMeta{"lm_head.weight", DType::kBF16, {16}}));
  HostTensorSource source(std::move(tensors));
  std::vector<HostTensor> base_tensors;
  base_tensors.push_back(*HostTensor::Zeros(TensorMeta{"a", DType::kBF16, {64, 64}}));
  ASSERT_TRUE(testing::WriteCheckpoint(dir / "base", base_tensors, DType::kF32).ok());
  DeltaPublisherOptions o;
  o.sync_dir = dir / "sync";
  o.base_checkpoint = dir / "base";
  auto pub = DeltaPublisher::Create(o, source.metadata());
  ASSERT_TRUE(pub.ok()) << pub.status().ToString();
  // The base's digest, over its tensors in their on-disk dtype, is known at once.
  EXPECT_EQ((*pub)->base_digest(),
            CombineDigests({{"a", HexDigest(DigestAlgorithm::kXxh3_128, std::vector<std::byte>(64 * 64 * 4))}}));
  uint16_t one = 0x3f80;  // bf16 1.0
  std::memcpy(source.tensors()[0].storage.data() + 10, &one, 2);
  auto st = (*pub)->Publish(source);
  ASSERT_TRUE(st.ok()) << st.status().ToString();
  EXPECT_EQ(st->skipped_tensors, 1u);
  auto m = ReadManifest(o.sync_dir, 1);
  ASSERT_TRUE(m.ok());
  ASSERT_EQ(m->tensors.size(), 1u);
  EXPECT_TRUE(m->base_digest.empty());  // a base the trainer was given is checked at init
  EXPECT_EQ(m->tensors[0].dtype, DType::kF32);
  EXPECT_EQ(m->tensors[0].uncompressed_num_bytes, 64u * 64 * 4);
  std::vector<std::byte> f32(64 * 64 * 4);
  ASSERT_TRUE(Convert(source.tensors()[0].ref().bytes, DType::kBF16, f32, DType::kF32, "a").ok());
  EXPECT_EQ(m->tensors[0].checksum, HexDigest(DigestAlgorithm::kXxh3_128, f32));
  // A shape that disagrees with the base is refused up front.
  std::vector<TensorMeta> bad = {TensorMeta{"a", DType::kBF16, {32, 128}}};
  auto refused = DeltaPublisher::Create(o, bad);
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("[64, 64]"), std::string::npos) << refused.status().message();
}

TEST(DeltaPublisherTest, AFailedPassRestoresTheSnapshotAndRepublishesTheSameVersion) {
  TempDir dir("pub");
  auto trainer = Tiny();
  auto publish_all = [&](const std::string& sync, bool flaky, bool borrow) -> std::string {
    auto t = Tiny();
    DeltaPublisherOptions o;
    o.sync_dir = sync;
    o.threads = 2;
    o.borrow_source_bytes = borrow;
    auto pub = *DeltaPublisher::Create(o, t->metadata());
    EXPECT_TRUE(pub->Publish(t->source()).ok());
    EXPECT_TRUE(t->Step(1).ok());
    if (flaky) {
      wsync::testing::FaultySource f(&t->source(), {.fail_pass = -1,
                                                    .fail_at = t->metadata().size() / 2,
                                                    .fail_code = StatusCode::kUnavailable,
                                                    .fail_message = "gather of a shard failed"});
      auto failed = pub->Publish(f);
      EXPECT_EQ(failed.status().code(), StatusCode::kUnavailable);
      EXPECT_EQ(pub->version(), 1);
      EXPECT_FALSE(std::filesystem::exists(VersionDir(sync, 2)));
    }
    auto st = pub->Publish(t->source());
    EXPECT_TRUE(st.ok()) << st.status().ToString();
    EXPECT_TRUE(t->Step(2).ok());
    EXPECT_TRUE(pub->Publish(t->source()).ok());
    return *ReadFile(VersionDir(sync, 3) + "/" + PayloadFileName(0, 0));
  };
  std::string clean = publish_all(dir / "clean", false, false);
  EXPECT_EQ(publish_all(dir / "flaky", true, false), clean);
  EXPECT_EQ(publish_all(dir / "borrowed", false, true), clean);
}

// Yields each tensor of `inner` as a copy in one buffer that the next Next() overwrites,
// as a source of all-gathered or cast temporaries hands out memory it reuses.
class TemporariesSource final : public WeightSource {
 public:
  explicit TemporariesSource(WeightSource* inner) : inner_(inner) {}
  const std::vector<TensorMeta>& metadata() const override { return inner_->metadata(); }
  Result<std::unique_ptr<TensorStream>> Iterate() override {
    class Stream final : public TensorStream {
     public:
      explicit Stream(std::unique_ptr<TensorStream> inner) : inner_(std::move(inner)) {}
      Result<bool> Next(TensorRef* out) override {
        WSYNC_ASSIGN_OR_RETURN(bool more, inner_->Next(out));
        if (!more) return false;
        buffer_.resize(std::max(buffer_.size(), out->bytes.size()));
        std::memcpy(buffer_.data(), out->bytes.data(), out->bytes.size());
        out->bytes = std::span<const std::byte>(buffer_.data(), out->bytes.size());
        return true;
      }

     private:
      std::unique_ptr<TensorStream> inner_;
      std::vector<std::byte> buffer_;
    };
    WSYNC_ASSIGN_OR_RETURN(std::unique_ptr<TensorStream> inner, inner_->Iterate());
    return std::unique_ptr<TensorStream>(std::make_unique<Stream>(std::move(inner)));
  }

 private:
  WeightSource* inner_;
};

// A source of temporaries is staged whatever borrow_source_bytes says: its deltas are
// bit-exact those of the same tensors from a stable source, which is borrowed.
TEST(DeltaPublisherTest, ASourceOfTemporariesIsStagedAStableOneBorrowed) {
  TempDir dir("pub");
  auto publish_twice = [&](const std::string& sync, bool temporaries) -> std::string {
    auto t = Tiny();
    DeltaPublisherOptions o;
    o.sync_dir = sync;
    o.threads = 2;
    EXPECT_TRUE(o.borrow_source_bytes);  // the default
    auto pub = *DeltaPublisher::Create(o, t->metadata());
    TemporariesSource temp(&t->source());
    WeightSource& source = temporaries ? static_cast<WeightSource&>(temp) : t->source();
    EXPECT_EQ(source.StableRefs(), !temporaries);
    EXPECT_TRUE(pub->Publish(source).ok());
    EXPECT_TRUE(t->Step(1).ok());
    auto st = pub->Publish(source);
    EXPECT_TRUE(st.ok()) << st.status().ToString();
    return *ReadFile(VersionDir(sync, 2) + "/" + PayloadFileName(0, 0));
  };
  const std::string temporaries = publish_twice(dir / "temporaries", true);
  EXPECT_TRUE(temporaries == publish_twice(dir / "stable", false)) << "the payloads differ";
}

// A device tensor fails the publish naming it, on the first pass and on a later one, and
// the chain goes on from the version before.
TEST(DeltaPublisherTest, ADeviceTensorIsRefusedByName) {
  TempDir dir("pub");
  auto t = Tiny();
  const size_t at = t->metadata().size() / 2;
  const std::string name = t->metadata()[at].name;
  DeltaPublisherOptions o;
  o.sync_dir = dir / "sync";
  auto pub = *DeltaPublisher::Create(o, t->metadata());
  wsync::testing::FaultySource device(&t->source(), {.device_label_from = at});
  auto first = pub->Publish(device);
  ASSERT_FALSE(first.ok());
  EXPECT_EQ(first.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(first.status().message(),
            fmt::format("publishing version 1 to {}: tensor {} is on cuda:0; the delta backend publishes host "
                        "tensors: give the source's tensors on the CPU", VersionDir(o.sync_dir, 1), name));
  EXPECT_FALSE(std::filesystem::exists(VersionDir(o.sync_dir, 1) + "/" + kManifestName));
  ASSERT_TRUE(pub->Publish(t->source()).ok());
  EXPECT_TRUE(t->Step(1).ok());
  auto later = pub->Publish(device);
  ASSERT_FALSE(later.ok());
  EXPECT_EQ(later.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(later.status().message().find("tensor " + name + " is on cuda:0"), std::string::npos);
  EXPECT_EQ(pub->version(), 1);
  auto st = pub->Publish(t->source());
  EXPECT_TRUE(st.ok()) << st.status().ToString();
  EXPECT_EQ(pub->version(), 2);
}

TEST(DeltaPublisherTest, NeverRewritesAPublishedVersion) {
  TempDir dir("pub");
  auto trainer = Tiny();
  DeltaPublisherOptions o;
  o.sync_dir = dir / "sync";
  std::filesystem::create_directories(VersionDir(o.sync_dir, 1));
  ASSERT_TRUE(WriteFileAtomic(VersionDir(o.sync_dir, 1) + "/manifest.json", "{}").ok());
  auto pub = DeltaPublisher::Create(o, trainer->metadata());
  ASSERT_TRUE(pub.ok());
  EXPECT_EQ((*pub)->Publish(trainer->source()).status().code(), StatusCode::kFailedPrecondition);
}

// Flips one byte of a file in place, as a disk fault or a stray writer would.
void FlipByte(const std::string& path, off_t at) {
  int fd = ::open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0) << path;
  unsigned char b = 0;
  ASSERT_EQ(::pread(fd, &b, 1, at), 1);
  b ^= 0x5a;
  ASSERT_EQ(::pwrite(fd, &b, 1, at), 1);
  ::close(fd);
}

// The previous version lives in the trainer's state file, not in its heap: a publisher
// over a 112 MiB model leaves the process's resident set within a small fraction of the
// model after Create (the base copied in) and after publishes that change every tensor,
// while the file on disk holds every byte; during a publish, even the 96 MiB tensor's
// state is mapped a few windows at a time, never whole.
TEST(DeltaPublisherTest, ThePreviousVersionIsAFileOnDiskNotAHeapCopy) {
#ifdef WSYNC_SANITIZED
  GTEST_SKIP() << "AddressSanitizer keeps freed memory in its quarantine: the resident set says nothing about "
                  "what the publisher holds";
#endif
  TempDir dir("pub");
  constexpr size_t kTensors = 9, kElems = size_t{512} << 10, kLargeElems = 48 * kElems;  // 8 x 2 MiB, 96 MiB
  std::vector<HostTensor> tensors;
  uint64_t model = 0;
  for (size_t i = 0; i < kTensors; ++i) {
    const int64_t n = int64_t(i == 4 ? kLargeElems : kElems);
    auto t = HostTensor::Zeros(TensorMeta{fmt::format("layers.{}.weight", i), DType::kF32, {n}});
    ASSERT_TRUE(t.ok());
    for (size_t b = 0; b < t->meta.nbytes(); b += 64) t->storage.data()[b] = std::byte(b / 64 + i);
    model += t->meta.nbytes();
    tensors.push_back(std::move(*t));
  }
  ASSERT_TRUE(testing::WriteCheckpoint(dir / "base", tensors).ok());
  HostTensorSource source(std::move(tensors));
  const int64_t before = HostRssBytes();
  DeltaPublisherOptions o;
  o.sync_dir = dir / "sync";
  o.state_dir = dir / "state";
  o.base_checkpoint = dir / "base";
  o.threads = 2;
  o.borrow_source_bytes = true;  // no staging: what remains is the publisher's own
  auto pub = DeltaPublisher::Create(o, source.metadata());
  ASSERT_TRUE(pub.ok()) << pub.status().ToString();
  EXPECT_EQ((*pub)->state_path(), (dir / "state") + "/.wsync-trainer-rank0.state");
  EXPECT_GE((*pub)->state_bytes(), model);
  EXPECT_EQ(std::filesystem::file_size((*pub)->state_path()), (*pub)->state_bytes());
  EXPECT_LT(HostRssBytes() - before, int64_t(model / 8)) << "after Create";
  for (int step = 1; step <= 3; ++step) {
    for (HostTensor& t : source.tensors()) {
      for (size_t b = 0; b < t.meta.nbytes(); b += 4096) t.storage.data()[b + 1] ^= std::byte(step);
    }
    const MemoryWindow window;
    auto st = (*pub)->Publish(source);
    const MemoryPeak peak = window.Peak();
    ASSERT_TRUE(st.ok()) << st.status().ToString();
    EXPECT_EQ(st->changed_tensors, kTensors);
    EXPECT_LT(HostRssBytes() - before, int64_t(model / 8)) << "after version " << step;
    if (peak.host_exact) EXPECT_LT(peak.host_bytes, int64_t(model * 3 / 7)) << "during version " << step;
  }
  // The file is the publisher's last version, byte for byte, and goes with the publisher.
  auto file = ReadFile((*pub)->state_path());
  ASSERT_TRUE(file.ok());
  uint64_t at = TrainerStateFile::kHeaderBytes;
  for (size_t i = 0; i < kTensors; at += source.tensors()[i].meta.nbytes(), ++i) {
    std::span<const std::byte> want = source.tensors()[i].ref().bytes;
    ASSERT_TRUE(std::equal(want.begin(), want.end(), reinterpret_cast<const std::byte*>(file->data() + at)))
        << "tensor " << i;
  }
  const std::string path = (*pub)->state_path();
  pub->reset();
  EXPECT_FALSE(std::filesystem::exists(path));
}

// A state file changed behind the publisher's back (a flipped byte in a tensor, whole or
// encoded in parts; a truncated file; a header naming another version) fails the publish
// with DataLoss naming the file (and the tensor), publishes nothing, and every later
// publish is refused: a delta against the wrong bytes would reach every server.
TEST(DeltaPublisherTest, AChangedStateFileFailsThePublishNamingTheFile) {
  struct Case {
    const char* what;
    size_t threads, part_bytes;
    std::function<void(const std::string& path)> damage;
    const char* says;
  };
  const off_t body = TrainerStateFile::kHeaderBytes;
  std::vector<Case> cases = {
      {"a flipped byte", 2, 0, [&](const std::string& p) { FlipByte(p, body + 100); }, "does not hold the bytes"},
      {"a flipped byte in a part", 4, 16 << 10, [&](const std::string& p) { FlipByte(p, body + 100); }, "(part 0)"},
      {"a truncated file", 2, 0,
       [](const std::string& p) { std::filesystem::resize_file(p, std::filesystem::file_size(p) / 2); }, "bytes long"},
      {"a header naming another version", 2, 0, [](const std::string& p) { FlipByte(p, 40); }, "header"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    TempDir dir("pub");
    auto trainer = Tiny();
    DeltaPublisherOptions o;
    o.sync_dir = dir / "sync";
    o.threads = c.threads;
    o.part_bytes = c.part_bytes;
    auto pub = DeltaPublisher::Create(o, trainer->metadata());
    ASSERT_TRUE(pub.ok()) << pub.status().ToString();
    ASSERT_TRUE((*pub)->Publish(trainer->source()).ok());
    ASSERT_TRUE(trainer->Step(1).ok());
    ASSERT_TRUE((*pub)->Publish(trainer->source()).ok());
    const std::string path = (*pub)->state_path();
    c.damage(path);
    ASSERT_TRUE(trainer->Step(2).ok());
    auto failed = (*pub)->Publish(trainer->source());
    ASSERT_FALSE(failed.ok());
    EXPECT_EQ(failed.status().code(), StatusCode::kDataLoss) << failed.status().ToString();
    EXPECT_NE(failed.status().message().find(path), std::string::npos) << failed.status().message();
    EXPECT_NE(failed.status().message().find(c.says), std::string::npos) << failed.status().message();
    if (std::string(c.what).starts_with("a flipped byte")) {
      EXPECT_NE(failed.status().message().find(trainer->metadata().front().name), std::string::npos)
          << failed.status().message();
    }
    EXPECT_FALSE(std::filesystem::exists(VersionDir(o.sync_dir, 3)));
    EXPECT_EQ((*pub)->version(), 2);
    auto again = (*pub)->Publish(trainer->source());
    EXPECT_EQ(again.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_NE(again.status().message().find(path), std::string::npos) << again.status().message();
  }
}

// Two publishers never share one state file.
TEST(DeltaPublisherTest, AStateFileHasOneOwner) {
  TempDir dir("pub");
  auto trainer = Tiny();
  DeltaPublisherOptions o;
  o.sync_dir = dir / "sync";
  auto first = DeltaPublisher::Create(o, trainer->metadata());
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  // By default on the trainer's own disk, not in the (possibly remote) sync dir.
  EXPECT_EQ((*first)->state_path(), DefaultTrainerStateDir(o.sync_dir) + "/.wsync-trainer-rank0.state");
  auto second = DeltaPublisher::Create(o, trainer->metadata());
  EXPECT_EQ(second.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(second.status().message().find((*first)->state_path()), std::string::npos) << second.status().message();
  EXPECT_TRUE(std::filesystem::exists((*first)->state_path()));
  first->reset();
  EXPECT_FALSE(std::filesystem::exists(DefaultTrainerStateDir(o.sync_dir)));
}

}  // namespace
}  // namespace wsync::delta
