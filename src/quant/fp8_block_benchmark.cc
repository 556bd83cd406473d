// quant_fp8_benchmark: throughput of FP8 block quantization over a model's linear weights,
// as one TP worker holds them, on the CPU or (built with CUDA) on a GPU.
//
//   quant_fp8_benchmark [--model qwen3-0.6b] [--tp 1] [--rank 0] [--iters 5]
//                       [--device cpu|cuda] [--threads N] [--verify]
//
// Fills every quantized parameter of the worker with random bf16 values, then quantizes
// them all, one parameter after another, --iters times: on the CPU with QuantizeFp8Param
// (each parameter split over --threads), reporting the best pass; on `cuda` with one
// LaunchFp8BlockQuantize per parameter on one stream after a warm-up pass, timed with CUDA
// events, reporting the mean pass. GB/s is input bytes (bf16, 10^9 bytes) per second.
// --verify (cuda) compares every parameter's bytes and scales with the CPU path.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "core/dtype_convert.h"
#include "core/parallel.h"
#include "model/config.h"
#include "model/sharding.h"
#include "quant/fp8_sharding.h"

#if defined(WSYNC_FP8_BENCHMARK_CUDA)
#include <cuda_runtime_api.h>

#include "cuda/fp8_block_kernels.h"
#endif

namespace wsync {
namespace {

struct Options {
  std::string model = "qwen3-0.6b";
  int tp = 1;
  int rank = 0;
  int iters = 5;
  std::string device = "cpu";
  size_t threads = DefaultThreads();
  bool verify = false;
};

// One quantized parameter: its bf16 input and CPU outputs.
struct Param {
  int index;
  Fp8ParamLayout layout;
  std::vector<uint16_t> src;
  std::vector<uint8_t> q;
  std::vector<float> s;
};

int Fail(const Status& st) {
  fmt::print(stderr, "{}\n", st.ToString());
  return 1;
}

Status QuantizeOnCpu(const ShardingTable& t, std::vector<Param>& params, size_t threads) {
  for (Param& p : params) {
    WSYNC_RETURN_IF_ERROR(QuantizeFp8Param(t, p.index, std::as_bytes(std::span(p.src)), p.q, p.s, threads));
  }
  return Status::Ok();
}

#if defined(WSYNC_FP8_BENCHMARK_CUDA)
Status Cuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::Ok();
  return Unavailable(fmt::format("{}: {}", what, cudaGetErrorString(e)));
}

// Mean seconds of one pass over every parameter on the GPU; with `verify`, compares each
// parameter with the CPU path.
Result<double> RunOnGpu(const ShardingTable& t, std::vector<Param>& params, int iters, bool verify) {
  struct DeviceParam {
    void* src = nullptr;
    void* q = nullptr;
    void* s = nullptr;
  };
  std::vector<DeviceParam> dev(params.size());
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  auto free_all = [&] {
    for (DeviceParam& d : dev) cudaFree(d.src), cudaFree(d.q), cudaFree(d.s);
    if (start != nullptr) cudaEventDestroy(start);
    if (stop != nullptr) cudaEventDestroy(stop);
    if (stream != nullptr) cudaStreamDestroy(stream);
  };
  auto run = [&]() -> Result<double> {
    for (size_t i = 0; i < params.size(); ++i) {
      const Param& p = params[i];
      WSYNC_RETURN_IF_ERROR(Cuda(cudaMalloc(&dev[i].src, p.src.size() * 2), "cudaMalloc"));
      WSYNC_RETURN_IF_ERROR(Cuda(cudaMalloc(&dev[i].q, p.q.size()), "cudaMalloc"));
      WSYNC_RETURN_IF_ERROR(Cuda(cudaMalloc(&dev[i].s, p.s.size() * sizeof(float)), "cudaMalloc"));
      WSYNC_RETURN_IF_ERROR(
          Cuda(cudaMemcpy(dev[i].src, p.src.data(), p.src.size() * 2, cudaMemcpyHostToDevice), "cudaMemcpy"));
    }
    WSYNC_RETURN_IF_ERROR(Cuda(cudaStreamCreate(&stream), "cudaStreamCreate"));
    WSYNC_RETURN_IF_ERROR(Cuda(cudaEventCreate(&start), "cudaEventCreate"));
    WSYNC_RETURN_IF_ERROR(Cuda(cudaEventCreate(&stop), "cudaEventCreate"));
    auto pass = [&]() -> Status {
      for (size_t i = 0; i < params.size(); ++i) {
        const Fp8MatrixShape& s = params[i].layout.shape;
        WSYNC_RETURN_IF_ERROR(Cuda(cuda::kernels::LaunchFp8BlockQuantize(
                                       dev[i].src, cuda::kernels::Fp8Input::kBF16, s.count, s.rows, s.cols,
                                       static_cast<unsigned char*>(dev[i].q), static_cast<float*>(dev[i].s), stream),
                                   params[i].layout.weight.name.c_str()));
      }
      return Status::Ok();
    };
    WSYNC_RETURN_IF_ERROR(pass());  // warm-up
    WSYNC_RETURN_IF_ERROR(Cuda(cudaStreamSynchronize(stream), "warm-up pass"));
    WSYNC_RETURN_IF_ERROR(Cuda(cudaEventRecord(start, stream), "cudaEventRecord"));
    for (int it = 0; it < iters; ++it) WSYNC_RETURN_IF_ERROR(pass());
    WSYNC_RETURN_IF_ERROR(Cuda(cudaEventRecord(stop, stream), "cudaEventRecord"));
    WSYNC_RETURN_IF_ERROR(Cuda(cudaEventSynchronize(stop), "timed passes"));
    float ms = 0;
    WSYNC_RETURN_IF_ERROR(Cuda(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime"));
    if (verify) {
      WSYNC_RETURN_IF_ERROR(QuantizeOnCpu(t, params, DefaultThreads()));
      size_t same = 0;
      for (size_t i = 0; i < params.size(); ++i) {
        std::vector<uint8_t> q(params[i].q.size());
        std::vector<float> s(params[i].s.size());
        WSYNC_RETURN_IF_ERROR(Cuda(cudaMemcpy(q.data(), dev[i].q, q.size(), cudaMemcpyDeviceToHost), "cudaMemcpy"));
        WSYNC_RETURN_IF_ERROR(
            Cuda(cudaMemcpy(s.data(), dev[i].s, s.size() * sizeof(float), cudaMemcpyDeviceToHost), "cudaMemcpy"));
        const bool equal = q == params[i].q && std::memcmp(s.data(), params[i].s.data(), s.size() * 4) == 0;
        if (!equal) fmt::print(stderr, "{}: GPU bytes differ from the CPU's\n", params[i].layout.weight.name);
        same += equal;
      }
      fmt::print("verify: {} of {} parameters identical to the CPU path\n", same, params.size());
      if (same != params.size()) return DataLoss("GPU and CPU quantization differ");
    }
    return ms / 1e3 / iters;
  };
  Result<double> r = run();
  free_all();
  return r;
}
#endif

int Run(const Options& o) {
  Result<ModelConfig> c = LookupModel(o.model);
  if (!c.ok()) return Fail(c.status());
  if (c->dtype != DType::kBF16) return Fail(InvalidArgument(fmt::format("model {} is not bf16", o.model)));
  Result<ShardingTable> t = ShardingTable::Build(*c, o.rank, o.tp);
  if (!t.ok()) return Fail(t.status());
  if (Status st = CheckFp8Sharding(*t); !st.ok()) return Fail(st);
  std::vector<Param> params;
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  int64_t in_bytes = 0;
  for (int i = 0; i < static_cast<int>(t->params().size()); ++i) {
    if (!IsFp8Param(*t, i)) continue;
    Result<Fp8ParamLayout> l = Fp8LayoutOf(*t, i);
    if (!l.ok()) return Fail(l.status());
    Param p{i, *l, std::vector<uint16_t>(l->weight.numel()), std::vector<uint8_t>(l->weight.numel()),
            std::vector<float>(l->scale_inv.numel())};
    for (auto& x : p.src) x = FloatToBF16(normal(rng));
    in_bytes += static_cast<int64_t>(p.src.size() * 2);
    params.push_back(std::move(p));
  }
  fmt::print("model {} tp {} rank {}: {} fp8 parameters, {:.3f} GB in (bf16)\n", o.model, o.tp, o.rank,
             params.size(), in_bytes / 1e9);
  if (o.device == "cpu") {
    double best = 1e30;
    for (int it = 0; it < o.iters; ++it) {
      const auto t0 = std::chrono::steady_clock::now();
      if (Status st = QuantizeOnCpu(*t, params, o.threads); !st.ok()) return Fail(st);
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    fmt::print("cpu threads {}: best of {} passes {:.3f} s, {:.2f} GB/s of input\n", o.threads, o.iters, best,
               in_bytes / 1e9 / best);
    return 0;
  }
#if defined(WSYNC_FP8_BENCHMARK_CUDA)
  if (o.device == "cuda") {
    Result<double> sec = RunOnGpu(*t, params, o.iters, o.verify);
    if (!sec.ok()) return Fail(sec.status());
    fmt::print("cuda: mean of {} passes {:.3f} ms, {:.1f} GB/s of input\n", o.iters, *sec * 1e3,
               in_bytes / 1e9 / *sec);
    return 0;
  }
#endif
  return Fail(Unavailable(fmt::format("device {} is not built into this binary", o.device)));
}

}  // namespace
}  // namespace wsync

int main(int argc, char** argv) {
  CLI::App app{"Throughput of FP8 block quantization over a model's linear weights"};
  wsync::Options o;
  app.add_option("--model", o.model, "registered model or config.json directory (bf16)");
  app.add_option("--tp", o.tp, "tensor-parallel size");
  app.add_option("--rank", o.rank, "the worker's tp rank");
  app.add_option("--iters", o.iters, "timed passes over every parameter");
  app.add_option("--device", o.device, "cpu, or cuda when built with CUDA");
  app.add_option("--threads", o.threads, "CPU threads per parameter (default: this process's CPUs)");
  app.add_flag("--verify", o.verify, "cuda: compare every parameter with the CPU path");
  CLI11_PARSE(app, argc, argv);
  return wsync::Run(o);
}
