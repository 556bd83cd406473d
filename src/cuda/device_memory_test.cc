// GPU tests of src/cuda: device names, the batched copy, and device memory shared with
// another process (this test binary, started again as the "child" with its orders in the
// environment). Every test that needs a GPU skips cleanly without one.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/subprocess.h"
#include "cuda/batched_copy.h"
#include "cuda/device.h"
#include "cuda/device_memory.h"

namespace wsync::cuda {
namespace {

using nlohmann::json;

#define SKIP_WITHOUT_GPU() \
  if (DeviceCount() == 0) GTEST_SKIP() << "no CUDA device"

// Runs this binary again with `filter` and WSYNC_CUDA_CHILD=`orders`; returns its exit
// status and stdout.
std::pair<int, std::string> RunChild(const std::string& filter, const json& orders) {
  SpawnOptions o;
  o.args = {"--gtest_filter=" + filter};
  o.env = {{"WSYNC_CUDA_CHILD", orders.dump()}};
  o.capture_stdout = true;
  auto child = Subprocess::Spawn(SelfExe(), std::move(o));
  if (!child.ok()) return {-1, child.status().ToString()};
  std::optional<ExitStatus> st = (*child)->Wait(Deadline::InSeconds(600));
  if (!st) return {-1, "the child ran past 600 s:\n" + (*child)->Stdout()};
  return {st->ShellCode(), (*child)->Stdout()};
}

std::optional<json> ChildOrders() {
  const char* v = std::getenv("WSYNC_CUDA_CHILD");
  if (v == nullptr) return std::nullopt;
  return json::parse(v);
}

TEST(CudaDevice, UuidsAreFormattedLikeNvidiaSmi) {
  unsigned char b[16];
  for (int i = 0; i < 16; ++i) b[i] = static_cast<unsigned char>(i * 17);
  EXPECT_EQ(FormatGpuUuid(b), "GPU-00112233-4455-6677-8899-aabbccddeeff");
  EXPECT_GE(DeviceCount(), 0);  // never an error, GPU or not
}

TEST(CudaDevice, EveryDeviceHasAStableUuid) {
  SKIP_WITHOUT_GPU();
  auto a = GpuUuid(0), b = GpuUuid(0);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(*a, *b);
  EXPECT_TRUE(std::regex_match(*a, std::regex("GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"))) << *a;
  EXPECT_FALSE(GpuUuid(DeviceCount()).ok());
}

TEST(BatchedCopy, OneLaunchCopiesAlignedAndUnalignedPiecesExactly) {
  SKIP_WITHOUT_GPU();
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  constexpr size_t kBytes = size_t{64} << 20;
  std::vector<unsigned char> host(kBytes);
  std::mt19937_64 rng(3);
  for (auto& c : host) c = static_cast<unsigned char>(rng());
  void *src = nullptr, *dst = nullptr, *want = nullptr;
  ASSERT_EQ(cudaMalloc(&src, kBytes), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dst, kBytes), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&want, kBytes), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(src, host.data(), kBytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemset(dst, 0, kBytes), cudaSuccess);
  ASSERT_EQ(cudaMemset(want, 0, kBytes), cudaSuccess);
  // Pieces of every size class, aligned and not, in a shuffled order of destinations.
  std::vector<CopyOp> ops;
  size_t s = 0, d = kBytes / 2;
  for (size_t size : {size_t{1}, size_t{15}, size_t{16}, size_t{4096}, size_t{3} << 20, size_t{256} << 10,
                      (size_t{5} << 20) + 7, size_t{12345}}) {
    ops.push_back({static_cast<char*>(src) + s, static_cast<char*>(dst) + d, size});
    ASSERT_EQ(cudaMemcpy(static_cast<char*>(want) + d, static_cast<char*>(src) + s, size, cudaMemcpyDeviceToDevice),
              cudaSuccess);
    s += size + 3;
    d = (d + size + 256) % (kBytes - (size_t{6} << 20));
  }
  auto plan = CopyPlan::Create(ops);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  Status launched = (*plan)->Launch(nullptr);
  ASSERT_TRUE(launched.ok()) << launched.ToString();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  auto got = DeviceChecksum(dst, kBytes, nullptr), expected = DeviceChecksum(want, kBytes, nullptr);
  ASSERT_TRUE(got.ok() && expected.ok());
  EXPECT_EQ(*got, *expected);
  cudaFree(src);
  cudaFree(dst);
  cudaFree(want);
}

// The child half: opens the parent's memory, checks its checksum, then opens and closes
// it 100 more times and checks that the device's free memory did not shrink.
TEST(DeviceMemoryChild, OpensChecksAndReopens) {
  auto orders = ChildOrders();
  if (!orders) GTEST_SKIP() << "started by DeviceMemory tests only";
  auto kind = *ParseExportKind((*orders)["kind"].get<std::string>());
  size_t bytes = (*orders)["bytes"].get<size_t>();
  auto m = ImportedDeviceMemory::Open(0, kind, (*orders)["handle"], bytes);
  if (!m.ok() && m.status().message().find("pidfd_getfd") != std::string::npos) {
    GTEST_SKIP() << m.status().ToString();
  }
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  auto sum = DeviceChecksum((*m)->data(), bytes, nullptr);
  ASSERT_TRUE(sum.ok()) << sum.status().ToString();
  EXPECT_EQ(*sum, (*orders)["checksum"].get<uint64_t>());
  m->reset();
  size_t free0 = 0, free1 = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free0, &total), cudaSuccess);
  for (int i = 0; i < 100; ++i) {
    auto again = ImportedDeviceMemory::Open(0, kind, (*orders)["handle"], bytes);
    ASSERT_TRUE(again.ok()) << "reopen " << i << ": " << again.status().ToString();
  }
  ASSERT_EQ(cudaMemGetInfo(&free1, &total), cudaSuccess);
  EXPECT_LE(free0 - std::min(free0, free1), size_t{4} << 20) << "100 open/close cycles leaked device memory";
  std::printf("child ok\n");
}

class DeviceMemory : public ::testing::TestWithParam<ExportKind> {};

TEST_P(DeviceMemory, ExportedMemoryOpensInAnotherProcessBitExact) {
  SKIP_WITHOUT_GPU();
  constexpr size_t kBytes = size_t{96} << 20;
  auto m = ExportedDeviceMemory::Allocate(0, kBytes, GetParam());
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_GE((*m)->size(), kBytes);
  std::vector<unsigned char> host(kBytes);
  for (size_t i = 0; i < kBytes; ++i) host[i] = static_cast<unsigned char>(i * 131 + (i >> 13));
  ASSERT_EQ(cudaMemcpy((*m)->data(), host.data(), kBytes, cudaMemcpyHostToDevice), cudaSuccess);
  auto sum = DeviceChecksum((*m)->data(), kBytes, nullptr);
  ASSERT_TRUE(sum.ok());
  json orders = {{"kind", std::string(ExportKindName(GetParam()))}, {"handle", (*m)->Handle()},
                 {"bytes", kBytes}, {"checksum", *sum}};
  auto [code, out] = RunChild("DeviceMemoryChild.*", orders);
  EXPECT_EQ(code, 0) << out;
  if (out.find("child ok") == std::string::npos) std::printf("child output:\n%s\n", out.c_str());
}

// Memory from cuMemCreate (a trainer with expandable segments) has no CUDA IPC handle:
// ExportExisting sends it as its allocation's fd, names it stably across exports, and
// another process opens it bit-exact.
TEST(DeviceMemoryExisting, CuMemAllocationsGoOutAsTheirFdAndOpenBitExact) {
  SKIP_WITHOUT_GPU();
  constexpr size_t kBytes = size_t{64} << 20;
  auto owner = ExportedDeviceMemory::Allocate(0, kBytes, ExportKind::kCuMemFd);  // cuMemCreate + map
  ASSERT_TRUE(owner.ok()) << owner.status().ToString();
  std::vector<unsigned char> host(kBytes);
  for (size_t i = 0; i < kBytes; ++i) host[i] = static_cast<unsigned char>(i * 29 + (i >> 11));
  ASSERT_EQ(cudaMemcpy((*owner)->data(), host.data(), kBytes, cudaMemcpyHostToDevice), cudaSuccess);
  const auto* inside = static_cast<const unsigned char*>((*owner)->data()) + 4096;
  auto a = ExportedDeviceMemory::ExportExisting(0, inside);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ((*a)->kind(), ExportKind::kCuMemFd);
  EXPECT_EQ((*a)->base_offset(), 4096u);
  auto b = ExportedDeviceMemory::ExportExisting(0, (*owner)->data());
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ((*a)->Identity(), (*b)->Identity());  // one allocation, whatever the fds
  EXPECT_NE((*a)->Handle()["fd"], (*b)->Handle()["fd"]);
  EXPECT_GE((*a)->Handle()["bytes"].get<size_t>(), kBytes);
  // A cudaMalloc allocation is another allocation, and goes out as cuda_ipc.
  void* plain = nullptr;
  ASSERT_EQ(cudaMalloc(&plain, 1 << 20), cudaSuccess);
  auto c = ExportedDeviceMemory::ExportExisting(0, plain);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ((*c)->kind(), ExportKind::kCudaIpc);
  EXPECT_NE((*c)->Identity(), (*a)->Identity());
  c->reset();
  cudaFree(plain);

  auto sum = DeviceChecksum((*owner)->data(), kBytes, nullptr);
  ASSERT_TRUE(sum.ok());
  json orders = {{"kind", "cuda_fd"}, {"handle", (*a)->Handle()}, {"bytes", kBytes}, {"checksum", *sum}};
  auto [code, out] = RunChild("DeviceMemoryChild.*", orders);
  EXPECT_EQ(code, 0) << out;
  EXPECT_NE(out.find("child ok"), std::string::npos) << out;
  // The exports go first: the allocation is the owner's to free.
  a->reset();
  b->reset();
}

TEST_P(DeviceMemory, BadHandlesAreClearErrors) {
  SKIP_WITHOUT_GPU();
  auto r = ImportedDeviceMemory::Open(0, GetParam(), json::array(), 16);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  if (GetParam() == ExportKind::kCudaIpc) {
    r = ImportedDeviceMemory::Open(0, GetParam(), json{{"handle_b64", "AAAA"}}, 16);
    EXPECT_NE(r.status().message().find("handle_b64 has 4 characters"), std::string::npos) << r.status().ToString();
    std::string garbage(88, 'Q');
    garbage[86] = garbage[87] = '=';
    r = ImportedDeviceMemory::Open(0, GetParam(), json{{"handle_b64", garbage}}, 16);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("cudaIpcOpenMemHandle"), std::string::npos) << r.status().ToString();
  } else {
    // A pid that has exited: the child below is reaped before its pid is used.
    auto exited = Subprocess::Fork([] { return 0; });
    ASSERT_TRUE(exited.ok()) << exited.status().ToString();
    ASSERT_TRUE((*exited)->Wait(Deadline::InSeconds(30)).has_value());
    pid_t gone = (*exited)->pid();
    r = ImportedDeviceMemory::Open(0, GetParam(), json{{"pid", gone}, {"fd", 3}, {"bytes", 16}}, 16);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("pidfd_open"), std::string::npos) << r.status().ToString();
    r = ImportedDeviceMemory::Open(0, GetParam(), json{{"pid", getpid()}, {"fd", 3}, {"bytes", 8}}, 16);
    EXPECT_NE(r.status().message().find("exports 8 bytes, 16 are needed"), std::string::npos) << r.status().ToString();
    // Integers at their exact width: 4294967297 is not pid 1, -1 is no fd.
    r = ImportedDeviceMemory::Open(0, GetParam(), json{{"pid", uint64_t{4294967297}}, {"fd", 3}, {"bytes", 16}}, 16);
    EXPECT_NE(r.status().message().find("integer 'pid' within"), std::string::npos) << r.status().ToString();
    r = ImportedDeviceMemory::Open(0, GetParam(), json{{"pid", getpid()}, {"fd", -1}, {"bytes", 16}}, 16);
    EXPECT_NE(r.status().message().find("integer 'fd' within"), std::string::npos) << r.status().ToString();
  }
}

TEST_P(DeviceMemory, HandleOfAnExporterThatExitedDoesNotOpen) {
  SKIP_WITHOUT_GPU();
  auto [code, out] = RunChild("DeviceMemoryExporter.*", json{{"kind", std::string(ExportKindName(GetParam()))}});
  ASSERT_EQ(code, 0) << out;
  auto at = out.find("handle=");
  ASSERT_NE(at, std::string::npos) << out;
  json handle = json::parse(out.substr(at + 7, out.find('\n', at) - at - 7));
  auto r = ImportedDeviceMemory::Open(0, GetParam(), handle, 1 << 20);
  EXPECT_FALSE(r.ok()) << "opened the memory of a process that has exited";
  if (!r.ok()) std::printf("as expected: %s\n", r.status().ToString().c_str());
}

TEST(DeviceMemoryExporter, ExportsPrintsAndExits) {
  auto orders = ChildOrders();
  if (!orders) GTEST_SKIP() << "started by DeviceMemory tests only";
  auto m = ExportedDeviceMemory::Allocate(0, 1 << 20, *ParseExportKind((*orders)["kind"].get<std::string>()));
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  std::printf("handle=%s\n", (*m)->Handle().dump().c_str());
}

INSTANTIATE_TEST_SUITE_P(Kinds, DeviceMemory, ::testing::Values(ExportKind::kCudaIpc, ExportKind::kCuMemFd),
                         [](const auto& info) { return std::string(info.param == ExportKind::kCudaIpc ? "CudaIpc" : "CuMemFd"); });

}  // namespace
}  // namespace wsync::cuda
