// Worker stores and trainer sources on a CUDA device, checked against the same loads into
// host stores: Load from host and from device tensors, PlanLoad's copy list run by the
// batched copy kernel, CopyToHost, DeviceTensorSource, and the errors for wrong devices.
// Skips without a GPU; without the installed runtime a CUDA store is a clear error.
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
  // Read-back functions take host stores only.
  const WorkerStore* group[] = {store.get()};
  auto digests = AllHfDigests(group, DigestAlgorithm::kXxh3_128, 1);
  EXPECT_EQ(digests.status().code(), StatusCode::kFailedPrecondition) << digests.status().ToString();
  // A device beyond the machine's is CUDA's own error, not a crash.
  auto far = WorkerStore::Create(c, 0, 1, Device{Device::Kind::kCuda, cuda::DeviceCount() + 3});
  EXPECT_FALSE(far.ok());
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
