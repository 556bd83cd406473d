// vLLM's runtime weight checker on CUDA worker stores: the digests read back in pieces
// smaller than a parameter equal those of a host store holding the same loads, and the
// random reset written through the same pieces changes every parameter and leaves no
// NaN or infinity. Skips without a GPU.
#include <cstring>

#include <gtest/gtest.h>

#include "cuda/device.h"
#include "cuda/runtime.h"
#include "model/worker_store.h"
#include "server/runtime_checker.h"

namespace wsync {
namespace {

class RuntimeCheckerGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    cuda::InstallDeviceRuntime();
    if (cuda::DeviceCount() < 1) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_F(RuntimeCheckerGpuTest, PiecewiseDigestsAndResetOfACudaStoreMatchTheHostStore) {
  const ModelConfig c = *LookupModel("qwen3-tiny");
  Device gpu{Device::Kind::kCuda, 0};
  std::vector<std::unique_ptr<WorkerStore>> host, dev;
  for (int r = 0; r < 2; ++r) {
    host.push_back(*WorkerStore::Create(c, r, 2));
    auto d = WorkerStore::Create(c, r, 2, gpu);
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    dev.push_back(std::move(*d));
  }
  uint64_t x = 11;
  for (TensorMeta m : HfTensors(c)) {
    HostTensor h = *HostTensor::Zeros(std::move(m));
    for (size_t i = 0; i < h.meta.nbytes(); ++i) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      h.storage.data()[i] = static_cast<std::byte>((x >> 56) & 0x3F);
    }
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(host[r]->Load(h.ref()).ok());
      ASSERT_TRUE(dev[r]->Load(h.ref()).ok());
    }
  }
  std::vector<RuntimeWorker> hw{{host[0].get(), 0, 0}, {host[1].get(), 0, 1}};
  std::vector<RuntimeWorker> dw{{dev[0].get(), 0, 0}, {dev[1].get(), 0, 1}};
  auto want = RuntimeParamDigests(hw, 4);
  auto got = RuntimeParamDigests(dw, 4, /*piece_bytes=*/4096 + 2);  // pieces that end mid-parameter
  ASSERT_TRUE(want.ok() && got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, *want);

  ASSERT_TRUE(RandomizeRuntimeParams(dw, 3, 4, /*piece_bytes=*/4096 + 6).ok());
  auto after = *RuntimeParamDigests(dw, 4);
  for (const auto& [key, hex] : *want) EXPECT_NE(after.at(key), hex) << key;
  for (auto& d : dev) {
    auto back = *d->CopyToHost();
    for (const HostTensor& p : back->params()) {
      auto b = p.storage.span().first(p.meta.nbytes());
      for (size_t e = 0; e + 1 < b.size(); e += 2) {
        uint16_t v = uint16_t(b[e]) | uint16_t(uint16_t(b[e + 1]) << 8);
        ASSERT_NE(v & 0x7F80, 0x7F80) << p.meta.name << " element " << e / 2;
      }
    }
  }
}

}  // namespace
}  // namespace wsync
