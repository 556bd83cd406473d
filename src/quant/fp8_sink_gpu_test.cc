// Fp8WorkerSink on a CUDA store against the same updates into a host store: the layers
// quantized on the device's side stream as they land (Load), read back in
// row blocks, give the host sink's FP8 checkpoint digests bit for bit; a partial update
// requantizes only its layer. Skips without a GPU.
#include <cstring>
#include <random>

#include <gtest/gtest.h>

#include "cuda/device.h"
#include "cuda/runtime.h"
#include "quant/fp8_sink.h"

namespace wsync {
namespace {

// Finite bf16 values of a few magnitudes (the top exponent bit cleared, and scaled down).
std::vector<std::byte> Values(const TensorMeta& m, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::byte> out(m.nbytes());
  for (size_t i = 0; i + 1 < out.size(); i += 2) {
    const uint16_t b = static_cast<uint16_t>(rng()) & 0xbfff;
    std::memcpy(out.data() + i, &b, 2);
  }
  return out;
}

TEST(Fp8WorkerSinkGpu, DeviceLayersMatchTheHostSinkBitForBit) {
  cuda::InstallDeviceRuntime();
  if (cuda::DeviceCount() < 1) GTEST_SKIP() << "no CUDA device";
  ModelConfig c = *LookupModel("qwen3-moe-tiny");  // head_dim 128, moe 256: on the grid at tp 2
  c.name = "moe-tiny-hd128";
  c.head_dim = 128;
  c.moe_intermediate_size = 256;
  constexpr int kTp = 2;
  const Device gpu{Device::Kind::kCuda, 0};
  std::vector<std::unique_ptr<WorkerStore>> stores;
  std::vector<std::unique_ptr<Fp8WorkerSink>> host, dev;
  for (int on_gpu = 0; on_gpu < 2; ++on_gpu) {
    for (int r = 0; r < kTp; ++r) {
      auto store = WorkerStore::Create(c, r, kTp, on_gpu ? gpu : Device{});
      ASSERT_TRUE(store.ok()) << store.status().ToString();
      auto sink = Fp8WorkerSink::Create(store->get(), 2);
      ASSERT_TRUE(sink.ok()) << sink.status().ToString();
      stores.push_back(std::move(store).value());
      (on_gpu ? dev : host).push_back(std::move(sink).value());
    }
  }
  std::vector<const Fp8WorkerSink*> hg, dg;
  for (auto& s : host) hg.push_back(s.get());
  for (auto& s : dev) dg.push_back(s.get());
  const ShardingTable& t0 = stores[0]->table();
  for (int update = 0; update < 2; ++update) {
    for (auto* group : {&host, &dev}) {
      for (auto& s : *group) s->BeginUpdate();
    }
    uint32_t seed = 1000 * update;
    for (const TensorMeta& m : t0.hf_tensors()) {
      ++seed;
      if (update == 1 && !m.name.starts_with("model.layers.1.")) continue;
      const std::vector<std::byte> bytes = Values(m, seed);
      for (auto* group : {&host, &dev}) {
        for (auto& s : *group) {
          ASSERT_TRUE(s->Load(TensorRef{m.name, m.dtype, m.shape, bytes, Device{}}).ok());
          ASSERT_TRUE(s->ChunkLanded().ok());
        }
      }
    }
    for (auto* group : {&host, &dev}) {
      for (auto& s : *group) ASSERT_TRUE(s->FinishUpdate().ok());
    }
    auto want = AllFp8HfDigests(hg, DigestAlgorithm::kSha256, 2);
    auto got = AllFp8HfDigests(dg, DigestAlgorithm::kSha256, 2);
    ASSERT_TRUE(want.ok()) << want.status().ToString();
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(*got, *want) << "update " << update;
  }
}

}  // namespace
}  // namespace wsync
