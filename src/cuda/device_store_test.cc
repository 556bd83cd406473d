// Worker stores and trainer sources on a CUDA device, checked against the same loads into
// host stores: Load from host and from device tensors, PlanLoad's copy list run by the
// batched copy kernel, CopyToHost, DeviceTensorSource, and the errors for wrong devices.
// Skips without a GPU; without the installed runtime a CUDA store is a clear error.
#include <algorithm>
#include <cstring>

#include <gtest/gtest.h>

#include "cuda/batched_copy.h"
#include "cuda/device.h"
#include "cuda/runtime.h"
#include "model/worker_store.h"
#include "wsync/source.h"

namespace wsync {
namespace {

std::vector<HostTensor> Filled(const ModelConfig& c, uint64_t seed) {
  std::vector<HostTensor> out;
  uint64_t x = seed;
  for (TensorMeta m : HfTensors(c)) {
    HostTensor h = *HostTensor::Zeros(std::move(m));
    for (size_t i = 0; i < h.meta.nbytes(); ++i) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      h.storage.data()[i] = static_cast<std::byte>(x >> 56);
    }
    out.push_back(std::move(h));
  }
  return out;
}

void ExpectSameParams(const WorkerStore& host, const WorkerStore& gpu) {
  auto back = gpu.CopyToHost();
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  ASSERT_EQ(host.params().size(), (*back)->params().size());
  for (size_t i = 0; i < host.params().size(); ++i) {
    const size_t n = host.params()[i].meta.nbytes();
    EXPECT_EQ(std::memcmp(host.param_data(i), (*back)->param_data(i), n), 0) << host.params()[i].meta.name;
  }
}

class DeviceStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    cuda::InstallDeviceRuntime();
    if (cuda::DeviceCount() < 1) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_F(DeviceStoreTest, LoadsFromHostAndDeviceMatchAHostStore) {
  const ModelConfig c = *LookupModel("qwen3-tiny");
  const std::vector<HostTensor> hf = Filled(c, 7);
  Device gpu{Device::Kind::kCuda, 0};
  auto src = DeviceTensorSource::Create(gpu, HfTensors(c));
  ASSERT_TRUE(src.ok()) << src.status().ToString();
  ASSERT_TRUE((*src)->Upload(hf).ok());
  for (int tp : {1, 2}) {
    for (int r = 0; r < tp; ++r) {
      SCOPED_TRACE("tp " + std::to_string(tp) + " rank " + std::to_string(r));
      auto host = *WorkerStore::Create(c, r, tp);
      auto from_host = WorkerStore::Create(c, r, tp, gpu);
      ASSERT_TRUE(from_host.ok()) << from_host.status().ToString();
      auto from_device = *WorkerStore::Create(c, r, tp, gpu);
      auto batched = *WorkerStore::Create(c, r, tp, gpu);
      EXPECT_EQ((*from_host)->device(), gpu);
      auto stream = *(*src)->Iterate();
      std::vector<WorkerStore::ByteCopy> plan;
      TensorRef t;
      for (size_t i = 0; i < hf.size(); ++i) {
        ASSERT_TRUE(host->Load(hf[i].ref()).ok());
        ASSERT_TRUE((*from_host)->Load(hf[i].ref()).ok());
        ASSERT_TRUE(*stream->Next(&t));
        EXPECT_EQ(t.device, gpu);
        ASSERT_TRUE(from_device->Load(t).ok()) << t.name;
        ASSERT_TRUE(batched->PlanLoad(t, &plan).ok()) << t.name;
      }
      std::vector<cuda::CopyOp> ops;
      for (const auto& op : plan) ops.push_back({op.src, op.dst, op.bytes});
      auto copy = cuda::CopyPlan::Create(ops);
      ASSERT_TRUE(copy.ok()) << copy.status().ToString();
      ASSERT_TRUE((*copy)->Launch(nullptr).ok());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      ExpectSameParams(*host, **from_host);
      ExpectSameParams(*host, *from_device);
      ExpectSameParams(*host, *batched);
    }
  }
}

TEST_F(DeviceStoreTest, WrongDevicesAndHostReadBackAreClearErrors) {
  const ModelConfig c = *LookupModel("qwen3-tiny");
  const std::vector<HostTensor> hf = Filled(c, 8);
  Device gpu{Device::Kind::kCuda, 0};
  auto store = *WorkerStore::Create(c, 0, 1, gpu);
  // A host store does not load device tensors.
  auto src = *DeviceTensorSource::Create(gpu, HfTensors(c));
  ASSERT_TRUE(src->Upload(hf).ok());
  auto stream = *src->Iterate();
  TensorRef t;
  ASSERT_TRUE(*stream->Next(&t));
  auto host = *WorkerStore::Create(c, 0, 1);
  Status s = host->Load(t);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("cuda:0"), std::string::npos) << s.ToString();
  // Whole-tensor read-back takes host stores only; digests read a CUDA store in blocks
  // and equal a host store's.
  const WorkerStore* group[] = {store.get()};
  std::vector<std::byte> whole(hf[0].meta.nbytes());
  EXPECT_EQ(ReadBackHf(group, hf[0].meta.name, whole).code(), StatusCode::kFailedPrecondition);
  for (const HostTensor& h : hf) {
    ASSERT_TRUE(store->Load(h.ref()).ok());
    ASSERT_TRUE(host->Load(h.ref()).ok());
  }
  const WorkerStore* host_group[] = {host.get()};
  auto digests = AllHfDigests(group, DigestAlgorithm::kXxh3_128, 4);
  ASSERT_TRUE(digests.ok()) << digests.status().ToString();
  EXPECT_EQ(*digests, *AllHfDigests(host_group, DigestAlgorithm::kXxh3_128, 1));
  // A device beyond the machine's is CUDA's own error, not a crash.
  auto far = WorkerStore::Create(c, 0, 1, Device{Device::Kind::kCuda, cuda::DeviceCount() + 3});
  EXPECT_FALSE(far.ok());
}

// Sleep of a CUDA store, as vLLM's CuMemAllocator does it: level 1 copies the bytes to
// host memory and releases the physical memory (the device's free memory rises by the
// store's size) while every parameter keeps its address; wake maps memory back at the
// same addresses (free memory falls back) with the same bytes; level 2 wakes as zeros.
TEST_F(DeviceStoreTest, SleepReleasesDeviceMemoryInPlaceAndWakeRestoresTheBytes) {
  const ModelConfig c = *LookupModel("qwen3-0.6b");
  Device gpu{Device::Kind::kCuda, 0};
  DeviceRuntime* rt = *CudaRuntimeFor(gpu);
  ASSERT_TRUE(rt->SetDevice(0).ok());
  auto made = WorkerStore::Create(c, 0, 1, gpu);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  WorkerStore& store = **made;
  const size_t bytes = store.param_bytes();
  ASSERT_GT(bytes, size_t{1} << 30);
  std::vector<std::byte*> addresses;
  for (size_t i = 0; i < store.table().params().size(); ++i) {
    addresses.push_back(store.param_data(i));
    const size_t n = store.table().params()[i].meta.nbytes();
    std::vector<uint64_t> pattern((n + 7) / 8);
    for (size_t k = 0; k < pattern.size(); ++k) pattern[k] = (uint64_t{i} << 40) ^ (k * 0x9e3779b97f4a7c15ull) ^ 1;
    ASSERT_TRUE(rt->Copy2D(store.param_data(i), n, pattern.data(), n, n, 1).ok());
  }
  ASSERT_TRUE(rt->Synchronize().ok());
  auto expected = store.CopyToHost();
  ASSERT_TRUE(expected.ok()) << expected.status().ToString();
  auto free_bytes = [&] { return rt->GetMemoryInfo(0)->free_bytes; };
  const double slack = 0.05 * static_cast<double>(bytes);

  const size_t awake = free_bytes();
  ASSERT_TRUE(store.Offload("", 1).ok());
  EXPECT_EQ(store.residency(), WorkerStore::Residency::kOffloaded);
  EXPECT_EQ(store.resident_bytes(), 0u);
  EXPECT_EQ(store.offloaded_bytes(), bytes);
  const size_t asleep = free_bytes();
  EXPECT_GE(static_cast<double>(asleep), static_cast<double>(awake + bytes) - slack) << awake << " -> " << asleep;
  EXPECT_EQ(store.CopyToHost().status().code(), StatusCode::kFailedPrecondition);

  ASSERT_TRUE(store.Restore(1).ok());
  const size_t woken = free_bytes();
  EXPECT_LE(static_cast<double>(woken), static_cast<double>(asleep - bytes) + slack) << asleep << " -> " << woken;
  for (size_t i = 0; i < addresses.size(); ++i) EXPECT_EQ(store.param_data(i), addresses[i]);
  ExpectSameParams(**expected, store);

  ASSERT_TRUE(store.Discard().ok());
  EXPECT_GE(static_cast<double>(free_bytes()), static_cast<double>(woken + bytes) - slack);
  ASSERT_TRUE(store.Restore(1).ok());
  auto zeros = store.CopyToHost();
  ASSERT_TRUE(zeros.ok()) << zeros.status().ToString();
  for (size_t i = 0; i < addresses.size(); ++i) {
    EXPECT_EQ(store.param_data(i), addresses[i]);
    std::span<const std::byte> p = (*zeros)->params()[i].storage.span();
    EXPECT_TRUE(std::all_of(p.begin(), p.end(), [](std::byte b) { return b == std::byte{0}; })) << i;
  }
  // The woken store loads as before.
  const std::vector<HostTensor> hf = Filled(*LookupModel("qwen3-tiny"), 9);
  auto small = *WorkerStore::Create(*LookupModel("qwen3-tiny"), 0, 1, gpu);
  ASSERT_TRUE(small->Offload("", 1).ok());
  EXPECT_EQ(small->Load(hf[0].ref()).code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(small->Restore(1).ok());
  EXPECT_TRUE(small->Load(hf[0].ref()).ok());
}

TEST(DeviceRuntimeMissing, CudaStoreWithoutInstalledRuntimeIsUnimplemented) {
  InstallCudaRuntime(nullptr);
  auto s = WorkerStore::Create(*LookupModel("qwen3-tiny"), 0, 1, Device{Device::Kind::kCuda, 0});
  EXPECT_EQ(s.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(s.status().message().find("cuda:0"), std::string::npos) << s.status().ToString();
  cuda::InstallDeviceRuntime();
}

}  // namespace
}  // namespace wsync
