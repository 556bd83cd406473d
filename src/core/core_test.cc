#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "core/cpu_limit.h"
#include "core/digest.h"
#include "core/parallel.h"
#include "core/process_memory.h"
#include "testing/host_backed_device.h"
#include "wsync/device_runtime.h"
#include "wsync/dtype.h"
#include "wsync/source.h"
#include "wsync/tensor.h"

namespace wsync {
namespace {

TEST(DType, NamesRoundTrip) {
  for (DType d : {DType::kBF16, DType::kF16, DType::kF32, DType::kF8E4M3, DType::kU8, DType::kI64}) {
    EXPECT_EQ(*DTypeFromTorchName(TorchName(d)), d);
    EXPECT_EQ(*DTypeFromSafetensorsName(SafetensorsName(d)), d);
  }
  EXPECT_EQ(*DTypeFromTorchName("torch.bfloat16"), DType::kBF16);
  EXPECT_EQ(ItemSize(DType::kBF16), 2u);
  EXPECT_EQ(ItemSize(DType::kF8E4M3), 1u);
  EXPECT_EQ(NcclDataTypeCode(DType::kBF16), 9);
  EXPECT_EQ(NcclDataTypeCode(DType::kF8E4M3), 10);
  auto bad = DTypeFromTorchName("bfloat17");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("bfloat17"), std::string::npos);
}

TEST(Device, Parse) {
  EXPECT_TRUE(Device::Parse("cpu")->is_cpu());
  EXPECT_EQ(Device::Parse("cuda:3")->index, 3);
  EXPECT_EQ(Device::Parse("cuda:3")->ToString(), "cuda:3");
  EXPECT_FALSE(Device::Parse("cuda:x").ok());
  EXPECT_FALSE(Device::Parse("tpu").ok());
}

// Pinned to one CPU (as taskset or a cpuset would), the default is one thread. Run in a
// thread of its own so that the test process keeps its mask.
TEST(DefaultThreads, FollowsTheAffinityMask) {
  size_t pinned = 0, all = DefaultThreads();
  std::thread t([&] {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(sched_getcpu() < 0 ? 0 : sched_getcpu(), &one);
    if (sched_setaffinity(0, sizeof(one), &one) == 0) pinned = DefaultThreads();
  });
  t.join();
  EXPECT_EQ(pinned, 1u);
  EXPECT_GE(all, 1u);
  EXPECT_EQ(DefaultThreads(), all);
}

// A fake /sys/fs/cgroup and /proc/self/cgroup in a temporary directory.
class CgroupCpuLimitTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char templ[] = "/tmp/wsync-cgroup-XXXXXX";
    ASSERT_NE(::mkdtemp(templ), nullptr);
    root_ = templ;
  }
  void TearDown() override { std::filesystem::remove_all(root_); }
  void Write(const std::string& rel, const std::string& text) {
    std::filesystem::path p = std::filesystem::path(root_) / rel;
    std::filesystem::create_directories(p.parent_path());
    std::ofstream(p) << text << "\n";
  }
  size_t Limit() { return CgroupCpuLimit(root_ + "/proc-self-cgroup", root_ + "/sys"); }
  std::string root_;
};

TEST_F(CgroupCpuLimitTest, CgroupV2TakesTheSmallestQuotaOfTheCgroupAndItsAncestorsRoundedUp) {
  Write("proc-self-cgroup", "0::/kubepods/pod1/c1");
  Write("sys/cpu.max", "max 100000");
  Write("sys/kubepods/cpu.max", "max 100000");
  Write("sys/kubepods/pod1/cpu.max", "250000 100000");  // 2.5 CPUs
  Write("sys/kubepods/pod1/c1/cpu.max", "400000 100000");
  EXPECT_EQ(Limit(), 3u);
  Write("sys/kubepods/pod1/cpu.max", "max 100000");
  EXPECT_EQ(Limit(), 4u);
  Write("sys/kubepods/pod1/c1/cpu.max", "max 100000");
  EXPECT_EQ(Limit(), 0u);  // no quota anywhere
  Write("sys/kubepods/pod1/c1/cpu.max", "5000 100000");
  EXPECT_EQ(Limit(), 1u);  // a twentieth of a CPU still gets one thread
}

TEST_F(CgroupCpuLimitTest, CgroupV1ReadsCfsQuotaUnderEitherMountName) {
  Write("proc-self-cgroup", "4:memory:/x\n3:cpu,cpuacct:/docker/abc\n0::/");
  Write("sys/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "150000");
  Write("sys/cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000");
  Write("sys/cpu,cpuacct/cpu.cfs_quota_us", "-1");
  Write("sys/cpu,cpuacct/cpu.cfs_period_us", "100000");
  EXPECT_EQ(Limit(), 2u);
  std::filesystem::rename(root_ + "/sys/cpu,cpuacct", root_ + "/sys/cpu");
  EXPECT_EQ(Limit(), 2u);
  Write("sys/cpu/docker/abc/cpu.cfs_quota_us", "-1");
  EXPECT_EQ(Limit(), 0u);
}

TEST_F(CgroupCpuLimitTest, MissingOrGarbledFilesMeanNoLimit) {
  EXPECT_EQ(Limit(), 0u);  // no /proc/self/cgroup
  Write("proc-self-cgroup", "garbage\n0::/a");
  EXPECT_EQ(Limit(), 0u);  // no cpu.max
  Write("sys/a/cpu.max", "lots of cpus");
  EXPECT_EQ(Limit(), 0u);
  // This machine's own cgroup parses (whatever it says).
  EXPECT_LE(CgroupCpuLimit(), 1u << 20);
}

TEST(ParallelFor, CoversEveryIndexOnce) {
  std::vector<std::atomic<int>> hits(1001);
  ParallelFor(hits.size(), 4, [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) hits[i]++;
  });
  for (size_t i = 0; i < hits.size(); ++i) ASSERT_EQ(hits[i].load(), 1) << i;
}

TEST(TaskPool, EveryTaskOfAGroupRunsBeforeWaitReturnsOnAThreadOfThePool) {
  TaskPool pool(3);
  EXPECT_EQ(pool.size(), 3u);
  std::vector<std::atomic<int>> per_thread(3);
  std::atomic<int> done{0};
  {
    TaskGroup group(pool);
    for (int i = 0; i < 200; ++i) {
      group.Submit([&](size_t thread) {
        per_thread.at(thread)++;
        done++;
      });
    }
    group.Wait();
    EXPECT_EQ(done.load(), 200);
  }
  int sum = 0;
  for (auto& n : per_thread) sum += n.load();
  EXPECT_EQ(sum, 200);
}

TEST(Digest, KnownVectors) {
  std::string abc = "abc";
  auto bytes = std::as_bytes(std::span(abc.data(), abc.size()));
  EXPECT_EQ(HexDigest(DigestAlgorithm::kSha256, bytes),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  // xxhash.xxh3_128_hexdigest(b"") == "99aa06d3014798d86001c324468d497f"
  EXPECT_EQ(HexDigest(DigestAlgorithm::kXxh3_128, {}), "99aa06d3014798d86001c324468d497f");
  EXPECT_FALSE(ParseDigestAlgorithm("md5").ok());
}

TEST(Digest, IncrementalEqualsOneShot) {
  std::vector<std::byte> data(100000);
  for (size_t i = 0; i < data.size(); ++i) data[i] = std::byte(i * 131 % 251);
  for (auto alg : {DigestAlgorithm::kSha256, DigestAlgorithm::kXxh3_128}) {
    auto h = Hasher::Create(alg);
    h->Update(std::span(data).first(777));
    h->Update(std::span(data).subspan(777));
    EXPECT_EQ(h->FinishHex(), HexDigest(alg, data));
  }
}

TEST(Digest, CopyAndHashCopiesAndHashesEitherSide) {
  std::vector<std::byte> data(3 * kCopyHashBlockBytes + 123);
  for (size_t i = 0; i < data.size(); ++i) data[i] = std::byte(i * 131 % 251);
  for (bool destination : {false, true}) {
    std::vector<std::byte> out(data.size());
    auto h = Hasher::Create(DigestAlgorithm::kXxh3_128);
    h->Update(std::span(data).first(5));  // a stream already under way
    CopyAndHash(out.data() + 5, std::span<const std::byte>(data).subspan(5), *h, destination);
    out[0] = data[0], out[1] = data[1], out[2] = data[2], out[3] = data[3], out[4] = data[4];
    EXPECT_EQ(out, data);
    EXPECT_EQ(h->FinishHex(), HexDigest(DigestAlgorithm::kXxh3_128, data));
  }
}

std::vector<HostTensor> TwoTensors() {
  std::vector<HostTensor> v;
  v.push_back(*HostTensor::Zeros({"a", DType::kBF16, {4, 2}}));
  v.push_back(*HostTensor::Zeros({"b", DType::kF32, {3}}));
  return v;
}

TEST(Digest, TensorsOnADeviceAreReadBackInBoundedBlocks) {
  HostBackedDevice device;
  // Larger than one read-back block, and not a multiple of it.
  const size_t n = kDeviceReadBackBlockBytes * 2 + 12345;
  std::vector<std::byte> host(n);
  for (size_t i = 0; i < n; ++i) host[i] = static_cast<std::byte>((i * 131) ^ (i >> 9));
  auto mem = DeviceBuffer::Allocate(Device{Device::Kind::kCuda, 0}, n);
  ASSERT_TRUE(mem.ok()) << mem.status().ToString();
  ASSERT_TRUE(device.Copy2D(mem->data(), n, host.data(), n, n, 1).ok());
  device.largest_ = 0;
  const Shape shape{static_cast<int64_t>(n)};
  for (DigestAlgorithm alg : {DigestAlgorithm::kSha256, DigestAlgorithm::kXxh3_128}) {
    TensorRef on_device{"w", DType::kU8, shape, mem->span(), mem->device()};
    TensorRef on_host{"w", DType::kU8, shape, host, Device{}};
    std::vector<std::byte> scratch;
    auto got = TensorHexDigest(alg, on_device, scratch);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(*got, HexDigest(alg, host));
    EXPECT_EQ(*TensorHexDigest(alg, on_host, scratch), HexDigest(alg, host));
    EXPECT_EQ(scratch.size(), kDeviceReadBackBlockBytes);
  }
  EXPECT_EQ(device.largest_.load(), kDeviceReadBackBlockBytes);
}

TEST(Digest, ADeviceTensorWithoutARuntimeFailsNamingTheTensorAndDevice) {
  std::vector<std::byte> scratch;
  const Shape shape{4};
  TensorRef t{"model.norm.weight", DType::kU8, shape, {}, Device{Device::Kind::kCuda, 2}};
  auto got = TensorHexDigest(DigestAlgorithm::kSha256, t, scratch);
  ASSERT_FALSE(got.ok());
  EXPECT_NE(got.status().message().find("model.norm.weight"), std::string::npos) << got.status().ToString();
  EXPECT_NE(got.status().message().find("cuda:2"), std::string::npos) << got.status().ToString();
}

// A stream of temporaries: each Next() writes the next tensor into the memory the previous
// one lent, as a caching allocator hands a freed block to the next all-gather or cast.
class ReusingStream final : public TensorStream {
 public:
  ReusingStream(std::vector<std::vector<std::byte>> tensors, Device device)
      : tensors_(std::move(tensors)), memory_(tensors_.at(0).size()), shape_{static_cast<int64_t>(memory_.size())},
        device_(device) {}
  Result<bool> Next(TensorRef* out) override {
    if (next_ == tensors_.size()) return false;
    std::copy(tensors_[next_].begin(), tensors_[next_].end(), memory_.begin());
    ++next_;
    *out = TensorRef{"model.layers.0.mlp.up_proj.weight", DType::kU8, shape_, memory_, device_};
    return true;
  }

 private:
  std::vector<std::vector<std::byte>> tensors_;
  std::vector<std::byte> memory_;
  Shape shape_;
  Device device_;
  size_t next_ = 0;
};

// Three distinct tensors of `n` bytes.
std::vector<std::vector<std::byte>> ThreePatterns(size_t n) {
  std::vector<std::vector<std::byte>> v(3, std::vector<std::byte>(n));
  for (size_t k = 0; k < v.size(); ++k) {
    for (size_t i = 0; i < n; ++i) v[k][i] = static_cast<std::byte>(i * 7 + k * 101 + 1);
  }
  return v;
}

// Packs every tensor of `stream` back to back into `out` through `rt`, then waits for
// the copies; with `finish`, FinishCopiesFrom runs after each tensor's copy. Returns the
// waits FinishCopiesFrom made.
int PackAll(DeviceRuntime& rt, TensorStream& stream, std::span<std::byte> out, bool finish,
            const std::optional<SourceStorage>& stable) {
  int waits = 0;
  size_t off = 0;
  TensorRef t;
  while (*stream.Next(&t)) {
    EXPECT_TRUE(rt.Copy2D(out.data() + off, 0, t.bytes.data(), 0, t.bytes.size(), 1).ok());
    off += t.bytes.size();
    if (!finish) continue;
    Result<bool> waited = FinishCopiesFrom(rt, t, stable);
    EXPECT_TRUE(waited.ok()) << waited.status().ToString();
    waits += waited.ok() && *waited;
  }
  EXPECT_TRUE(rt.Synchronize().ok());
  return waits;
}

TEST(FinishCopiesFrom, CopiesFromATemporaryEndBeforeTheSourceReusesItsMemory) {
  HostBackedDevice device;
  device.DeferCopies(true);
  const Device cuda0{Device::Kind::kCuda, 0};
  const size_t n = 4096;
  const std::vector<std::vector<std::byte>> tensors = ThreePatterns(n);
  std::vector<std::byte> expected;
  for (const auto& t : tensors) expected.insert(expected.end(), t.begin(), t.end());
  {
    // Without the wait, every queued copy reads the memory after its last reuse.
    ReusingStream stream(tensors, cuda0);
    std::vector<std::byte> out(3 * n);
    EXPECT_EQ(PackAll(device, stream, out, /*finish=*/false, std::nullopt), 0);
    EXPECT_NE(out, expected);
    EXPECT_TRUE(std::equal(out.begin(), out.begin() + n, tensors[2].begin()));
  }
  ReusingStream stream(tensors, cuda0);
  std::vector<std::byte> out(3 * n);
  EXPECT_EQ(PackAll(device, stream, out, /*finish=*/true, std::nullopt), 3);
  EXPECT_EQ(out, expected);
}

TEST(FinishCopiesFrom, TensorsInTheSourcesStableStorageAreNotWaitedFor) {
  HostBackedDevice device;
  device.DeferCopies(true);
  const Device cuda0{Device::Kind::kCuda, 0};
  const size_t n = 4096;
  std::vector<std::byte> block;
  for (const auto& t : ThreePatterns(n)) block.insert(block.end(), t.begin(), t.end());
  const SourceStorage storage{block.data(), block.size(), cuda0};
  const Shape shape{static_cast<int64_t>(n)};
  std::vector<TensorRef> refs;
  for (size_t k = 0; k < 3; ++k) {
    refs.push_back({"w", DType::kU8, shape, std::span<const std::byte>(block).subspan(k * n, n), cuda0});
  }
  std::vector<std::byte> out(3 * n);
  for (size_t k = 0; k < refs.size(); ++k) {
    ASSERT_TRUE(device.Copy2D(out.data() + k * n, 0, refs[k].bytes.data(), 0, n, 1).ok());
    EXPECT_EQ(*FinishCopiesFrom(device, refs[k], storage), false) << "tensor " << k;
  }
  EXPECT_NE(out, block);  // still queued
  ASSERT_TRUE(device.Synchronize().ok());
  EXPECT_EQ(out, block);
  // Outside the block, or on another device, a tensor is waited for.
  std::vector<std::byte> elsewhere(n);
  EXPECT_EQ(*FinishCopiesFrom(device, TensorRef{"w", DType::kU8, shape, elsewhere, cuda0}, storage), true);
  EXPECT_EQ(*FinishCopiesFrom(device, TensorRef{"w", DType::kU8, shape, refs[0].bytes, Device{Device::Kind::kCuda, 1}},
                              storage),
            true);
  EXPECT_EQ(*FinishCopiesFrom(device, refs[0], std::nullopt), true);
}

TEST(MemoryWindow, MeasuresPeakHostAndDeviceGrowthFromItsStart) {
  {
    // Memory touched and freed before the window does not count in it.
    std::vector<char> before(64 << 20, 1);
    ASSERT_EQ(before[12345], 1);
  }
  NoteDeviceBytes(1000);
  const MemoryWindow window;
  MemoryPeak start = window.Peak();
  EXPECT_EQ(start.device_bytes, 0);
  const size_t big = size_t{96} << 20;
  {
    std::vector<char> touched(big);
    for (size_t i = 0; i < big; i += 4096) touched[i] = 1;
    NoteDeviceBytes(5000);
    NoteDeviceBytes(-5000);
    ASSERT_EQ(touched[4096], 1);
  }
  const MemoryPeak p = window.Peak();
  EXPECT_EQ(p.device_bytes, 5000);
  EXPECT_EQ(DeviceLiveBytes() - 1000, 0);
  if (p.host_exact) {
    // The peak holds the touched pages (not counting what the allocator kept from before).
    EXPECT_GE(p.host_bytes, static_cast<int64_t>(big) - (8 << 20));
    EXPECT_LE(p.host_bytes, static_cast<int64_t>(big) + (64 << 20));
  } else {
    GTEST_SKIP() << "this kernel refuses to reset the peak RSS";
  }
  NoteDeviceBytes(-1000);
}

TEST(CheckedStream, PassesMatchingSource) {
  HostTensorSource src(TwoTensors());
  auto stream = CheckedStream(*src.Iterate(), src.metadata());
  TensorRef t;
  EXPECT_TRUE(*stream->Next(&t));
  EXPECT_EQ(t.name, "a");
  EXPECT_EQ(t.bytes.size(), 16u);
  EXPECT_TRUE(*stream->Next(&t));
  EXPECT_FALSE(*stream->Next(&t));
}

TEST(CheckedStream, NamesMismatchedTensor) {
  HostTensorSource src(TwoTensors());
  std::vector<TensorMeta> meta = src.metadata();
  meta[1].shape = {4};
  auto stream = CheckedStream(*src.Iterate(), meta);
  TensorRef t;
  EXPECT_TRUE(*stream->Next(&t));
  auto r = stream->Next(&t);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("shape of b is [4], got [3]"), std::string::npos)
      << r.status().message();
}

TEST(CheckedStream, MissingAndExtraTensors) {
  HostTensorSource src(TwoTensors());
  std::vector<TensorMeta> longer = src.metadata();
  longer.push_back({"c", DType::kF32, {1}});
  auto s1 = CheckedStream(*src.Iterate(), longer);
  TensorRef t;
  (void)*s1->Next(&t);
  (void)*s1->Next(&t);
  auto r1 = s1->Next(&t);
  ASSERT_FALSE(r1.ok());
  EXPECT_NE(r1.status().message().find("first missing: c"), std::string::npos);

  std::vector<TensorMeta> shorter = {src.metadata()[0]};
  auto s2 = CheckedStream(*src.Iterate(), shorter);
  (void)*s2->Next(&t);
  auto r2 = s2->Next(&t);
  ASSERT_FALSE(r2.ok());
  EXPECT_NE(r2.status().message().find("yielded b beyond"), std::string::npos);
}

}  // namespace
// Without an installed CUDA runtime (this binary links none), every CUDA request is a
// clear Unimplemented naming the device, and cpu needs nothing.
TEST(DeviceRuntime, CudaWithoutAnInstalledRuntimeIsUnimplementedNamingTheDevice) {
  Device gpu{Device::Kind::kCuda, 3};
  auto rt = CudaRuntimeFor(gpu);
  EXPECT_EQ(rt.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(rt.status().message().find("cuda:3"), std::string::npos) << rt.status().ToString();
  EXPECT_EQ(CudaRuntimeFor(Device{}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(UseDeviceOnThisThread(Device{}).ok());
  EXPECT_EQ(UseDeviceOnThisThread(gpu).code(), StatusCode::kUnimplemented);
  auto buffer = DeviceBuffer::Allocate(gpu, 1024);
  EXPECT_EQ(buffer.status().code(), StatusCode::kUnimplemented);
  auto source = DeviceTensorSource::Create(gpu, {TensorMeta{"w", DType::kBF16, {4}}});
  EXPECT_EQ(source.status().code(), StatusCode::kUnimplemented);
}

}  // namespace wsync
