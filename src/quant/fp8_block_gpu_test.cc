// The CUDA kernel of cuda/fp8_block_kernels.h against QuantizeFp8Blocks on the CPU, bit for
// bit: bf16 / f16 / f32, full and partial tiles, unaligned inputs (scalar path), tiny,
// huge and non-finite blocks, stacked matrices; and QuantizeFp8ParamOnDevice against
// QuantizeFp8Param for every quantized parameter of a sharded MoE model, and its errors.
// Skips without a CUDA device.
#include <cuda_runtime_api.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "core/dtype_convert.h"
#include "cuda/fp8_block_kernels.h"
#include "model/sharding.h"
#include "quant/fp8_block.h"
#include "quant/fp8_device.h"
#include "quant/fp8_sharding.h"

namespace wsync {
namespace {

using cuda::kernels::Fp8Input;

#define ASSERT_CUDA(expr) ASSERT_EQ((expr), cudaSuccess) << #expr << ": " << cudaGetErrorString(cudaGetLastError())

class Fp8BlockGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n < 1) GTEST_SKIP() << "no CUDA device";
    ASSERT_CUDA(cudaStreamCreate(&stream_));
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  // Quantizes `src` on the CPU and on the GPU (its device copy starting `offset` bytes into
  // an allocation) and compares both outputs byte for byte.
  void ExpectSame(const std::vector<std::byte>& src, DType dtype, Fp8MatrixShape shape, size_t offset = 0) {
    SCOPED_TRACE(::testing::Message() << TorchName(dtype) << " [" << shape.count << ", " << shape.rows << ", "
                                      << shape.cols << "] offset " << offset);
    std::vector<uint8_t> q(shape.elements());
    std::vector<float> s(shape.scales());
    ASSERT_TRUE(QuantizeFp8Blocks(src, dtype, shape, q, s, 2, "cpu").ok());
    void* d_src = nullptr;
    unsigned char* d_q = nullptr;
    float* d_s = nullptr;
    ASSERT_CUDA(cudaMalloc(reinterpret_cast<void**>(&d_src), src.size() + offset));
    ASSERT_CUDA(cudaMalloc(reinterpret_cast<void**>(&d_q), q.size() + offset));
    ASSERT_CUDA(cudaMalloc(reinterpret_cast<void**>(&d_s), s.size() * sizeof(float)));
    ASSERT_CUDA(cudaMemcpy(static_cast<char*>(d_src) + offset, src.data(), src.size(), cudaMemcpyHostToDevice));
    const Fp8Input in = dtype == DType::kBF16 ? Fp8Input::kBF16 : dtype == DType::kF16 ? Fp8Input::kF16 : Fp8Input::kF32;
    ASSERT_CUDA(cuda::kernels::LaunchFp8BlockQuantize(static_cast<char*>(d_src) + offset, in, shape.count, shape.rows,
                                                      shape.cols, d_q + offset, d_s, stream_));
    ASSERT_CUDA(cudaStreamSynchronize(stream_));
    std::vector<uint8_t> gq(q.size());
    std::vector<float> gs(s.size());
    ASSERT_CUDA(cudaMemcpy(gq.data(), d_q + offset, gq.size(), cudaMemcpyDeviceToHost));
    ASSERT_CUDA(cudaMemcpy(gs.data(), d_s, gs.size() * sizeof(float), cudaMemcpyDeviceToHost));
    cudaFree(d_src);
    cudaFree(d_q);
    cudaFree(d_s);
    EXPECT_EQ(std::memcmp(gq.data(), q.data(), q.size()), 0);
    EXPECT_EQ(std::memcmp(gs.data(), s.data(), s.size() * sizeof(float)), 0);
  }

  cudaStream_t stream_ = nullptr;
};

// Random values of `dtype`: wide magnitudes, zeros, and (when `specials`) a tiny block, a
// huge value and a NaN / inf.
std::vector<std::byte> Random(DType dtype, const Fp8MatrixShape& shape, uint64_t seed, bool specials) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> expo(-30, 6);
  std::vector<float> x(shape.elements());
  for (float& v : x) v = rng() % 8 == 0 ? 0.0f : normal(rng) * std::ldexp(1.0f, expo(rng));
  if (specials && shape.rows >= 128 && shape.cols >= 256) {
    for (int64_t r = 0; r < 128; ++r) {
      for (int64_t c = 0; c < 128; ++c) x[r * shape.cols + c] *= 1e-9f;  // tile (0, 0) below the clamp
    }
    x[5 * shape.cols + 130] = 3e38f;  // tile (0, 1): huge
    if (shape.rows > 128) x[130 * shape.cols + 1] = std::numeric_limits<float>::quiet_NaN();
    if (shape.cols > 256) x[3 * shape.cols + 257] = -std::numeric_limits<float>::infinity();
  }
  std::vector<std::byte> out(x.size() * ItemSize(dtype));
  for (size_t i = 0; i < x.size(); ++i) {
    if (dtype == DType::kF32) {
      std::memcpy(&out[i * 4], &x[i], 4);
    } else {
      const uint16_t h = dtype == DType::kBF16 ? FloatToBF16(x[i]) : FloatToF16(x[i]);
      std::memcpy(&out[i * 2], &h, 2);
    }
  }
  return out;
}

TEST_F(Fp8BlockGpuTest, MatchesTheCpuBitForBit) {
  const Fp8MatrixShape shapes[] = {{1, 128, 128}, {1, 256, 1024}, {1, 300, 200}, {1, 1, 1},   {1, 129, 7},
                                   {3, 384, 320}, {1, 200, 264},  {2, 257, 136}, {1, 5, 1000}};
  uint64_t seed = 1;
  for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
    for (const Fp8MatrixShape& shape : shapes) {
      const std::vector<std::byte> src = Random(dtype, shape, seed++, true);
      ExpectSame(src, dtype, shape);
      ExpectSame(src, dtype, shape, ItemSize(dtype));  // misaligned: the scalar path
    }
  }
}

TEST_F(Fp8BlockGpuTest, ShardedParametersMatchTheCpu) {
  ModelConfig c = *LookupModel("qwen3-moe-tiny");
  c.hidden_size = 320;
  c.head_dim = 128;
  c.moe_intermediate_size = 256;
  for (int tp : {1, 2}) {
    const ShardingTable t = *ShardingTable::Build(c, tp - 1, tp);
    ASSERT_TRUE(CheckFp8Sharding(t).ok());
    for (int i = 0; i < static_cast<int>(t.params().size()); ++i) {
      if (!IsFp8Param(t, i)) continue;
      SCOPED_TRACE(t.params()[i].meta.name);
      Result<Fp8ParamLayout> l = Fp8LayoutOf(t, i);
      ASSERT_TRUE(l.ok()) << l.status().ToString();
      const std::vector<std::byte> src = Random(DType::kBF16, l->shape, i, false);
      std::vector<uint8_t> q(l->weight.numel()), gq(q.size());
      std::vector<float> s(l->scale_inv.numel()), gs(s.size());
      ASSERT_TRUE(QuantizeFp8Param(t, i, src, q, s, 2).ok());
      void* d_src = nullptr;
      uint8_t* d_q = nullptr;
      float* d_s = nullptr;
      ASSERT_CUDA(cudaMalloc(&d_src, src.size()));
      ASSERT_CUDA(cudaMalloc(reinterpret_cast<void**>(&d_q), q.size()));
      ASSERT_CUDA(cudaMalloc(reinterpret_cast<void**>(&d_s), s.size() * sizeof(float)));
      ASSERT_CUDA(cudaMemcpy(d_src, src.data(), src.size(), cudaMemcpyHostToDevice));
      const Status st = QuantizeFp8ParamOnDevice(t, i, d_src, d_q, d_s, stream_);
      ASSERT_TRUE(st.ok()) << st.ToString();
      ASSERT_CUDA(cudaStreamSynchronize(stream_));
      ASSERT_CUDA(cudaMemcpy(gq.data(), d_q, gq.size(), cudaMemcpyDeviceToHost));
      ASSERT_CUDA(cudaMemcpy(gs.data(), d_s, gs.size() * sizeof(float), cudaMemcpyDeviceToHost));
      cudaFree(d_src);
      cudaFree(d_q);
      cudaFree(d_s);
      EXPECT_EQ(gq, q);
      EXPECT_EQ(std::memcmp(gs.data(), s.data(), s.size() * sizeof(float)), 0);
    }
    const Status st = QuantizeFp8ParamOnDevice(t, t.FindParam("model.norm.weight"), nullptr, nullptr, nullptr, stream_);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("model.norm.weight"), std::string::npos) << st.message();
  }
}

}  // namespace
}  // namespace wsync
