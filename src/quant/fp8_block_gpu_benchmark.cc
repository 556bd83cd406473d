// quant_fp8_gpu_benchmark: throughput of the CUDA FP8 block quantization kernel over a
// model's linear weights, as one TP worker holds them.
//
//   quant_fp8_gpu_benchmark [--model qwen3-0.6b] [--tp 1] [--rank 0] [--iters 20] [--verify]
//
// Puts every quantized parameter of the worker on the device (random bf16), then launches
// one LaunchFp8BlockQuantize per parameter on one stream, --iters times after a warm-up,
// timed with CUDA events. GB/s is input bytes (bf16, 10^9 bytes) over the mean pass time.
// --verify compares every parameter's bytes and scales with QuantizeFp8Param on the CPU.
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "core/dtype_convert.h"
#include "core/parallel.h"
#include "cuda/fp8_block_kernels.h"
#include "model/config.h"
#include "model/sharding.h"
#include "quant/fp8_sharding.h"

namespace wsync {
namespace {

#define CHECK_CUDA(expr)                                                                       \
  do {                                                                                         \
    cudaError_t e_ = (expr);                                                                   \
    if (e_ != cudaSuccess) {                                                                   \
      fmt::print(stderr, "{}: {} ({}:{})\n", #expr, cudaGetErrorString(e_), __FILE__, __LINE__); \
      return 1;                                                                                \
    }                                                                                          \
  } while (0)

int Fail(const Status& st) {
  fmt::print(stderr, "{}\n", st.ToString());
  return 1;
}

int Run(const std::string& model, int tp, int rank, int iters, bool verify) {
  Result<ModelConfig> c = LookupModel(model);
  if (!c.ok()) return Fail(c.status());
  if (c->dtype != DType::kBF16) return Fail(InvalidArgument(fmt::format("model {} is not bf16", model)));
  Result<ShardingTable> t = ShardingTable::Build(*c, rank, tp);
  if (!t.ok()) return Fail(t.status());
  if (Status st = CheckFp8Sharding(*t); !st.ok()) return Fail(st);
  struct Param {
    int index;
    Fp8ParamLayout layout;
    std::vector<uint16_t> host;
    void* src = nullptr;
    unsigned char* q = nullptr;
    float* s = nullptr;
  };
  std::vector<Param> params;
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  int64_t in_bytes = 0;
  for (int i = 0; i < static_cast<int>(t->params().size()); ++i) {
    if (!IsFp8Param(*t, i)) continue;
    Result<Fp8ParamLayout> l = Fp8LayoutOf(*t, i);
    if (!l.ok()) return Fail(l.status());
    Param p{i, *l, std::vector<uint16_t>(l->weight.numel())};
    for (auto& x : p.host) x = FloatToBF16(normal(rng));
    CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&p.src), p.host.size() * 2));
    CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&p.q), p.host.size()));
    CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&p.s), l->scale_inv.numel() * sizeof(float)));
    CHECK_CUDA(cudaMemcpy(p.src, p.host.data(), p.host.size() * 2, cudaMemcpyHostToDevice));
    in_bytes += static_cast<int64_t>(p.host.size() * 2);
    params.push_back(std::move(p));
  }
  cudaStream_t stream;
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaStreamCreate(&stream));
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  auto pass = [&]() -> cudaError_t {
    for (Param& p : params) {
      const Fp8MatrixShape& s = p.layout.shape;
      cudaError_t e = cuda::kernels::LaunchFp8BlockQuantize(p.src, cuda::kernels::Fp8Input::kBF16, s.count, s.rows,
                                                            s.cols, p.q, p.s, stream);
      if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
  };
  CHECK_CUDA(pass());  // warm-up
  CHECK_CUDA(cudaStreamSynchronize(stream));
  CHECK_CUDA(cudaEventRecord(start, stream));
  for (int it = 0; it < iters; ++it) CHECK_CUDA(pass());
  CHECK_CUDA(cudaEventRecord(stop, stream));
  CHECK_CUDA(cudaEventSynchronize(stop));
  float ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
  const double sec = ms / 1e3 / iters;
  fmt::print("model {} tp {} rank {}: {} fp8 parameters, {:.3f} GB in (bf16)\n", model, tp, rank, params.size(),
             in_bytes / 1e9);
  fmt::print("gpu: mean of {} passes {:.3f} ms, {:.1f} GB/s of input\n", iters, sec * 1e3, in_bytes / 1e9 / sec);
  int bad = 0;
  if (verify) {
    for (Param& p : params) {
      std::vector<uint8_t> q(p.host.size()), gq(p.host.size());
      std::vector<float> s(p.layout.scale_inv.numel()), gs(s.size());
      Status st = QuantizeFp8Param(*t, p.index, std::as_bytes(std::span(p.host)), q, s, DefaultThreads());
      if (!st.ok()) return Fail(st);
      CHECK_CUDA(cudaMemcpy(gq.data(), p.q, gq.size(), cudaMemcpyDeviceToHost));
      CHECK_CUDA(cudaMemcpy(gs.data(), p.s, gs.size() * sizeof(float), cudaMemcpyDeviceToHost));
      if (q != gq || std::memcmp(s.data(), gs.data(), s.size() * sizeof(float)) != 0) {
        fmt::print(stderr, "{}: GPU bytes differ from the CPU's\n", p.layout.weight.name);
        ++bad;
      }
    }
    fmt::print("verify: {} of {} parameters identical to the CPU path\n", params.size() - bad, params.size());
  }
  for (Param& p : params) {
    cudaFree(p.src);
    cudaFree(p.q);
    cudaFree(p.s);
  }
  return bad == 0 ? 0 : 1;
}

}  // namespace
}  // namespace wsync

int main(int argc, char** argv) {
  CLI::App app{"Throughput of the CUDA FP8 block quantization kernel over a model's linear weights"};
  std::string model = "qwen3-0.6b";
  int tp = 1, rank = 0, iters = 20;
  bool verify = false;
  app.add_option("--model", model, "registered model or config.json directory (bf16)");
  app.add_option("--tp", tp, "tensor-parallel size");
  app.add_option("--rank", rank, "the worker's tp rank");
  app.add_option("--iters", iters, "timed passes over every parameter");
  app.add_flag("--verify", verify, "compare every parameter with the CPU path");
  CLI11_PARSE(app, argc, argv);
  return wsync::Run(model, tp, rank, iters, verify);
}
