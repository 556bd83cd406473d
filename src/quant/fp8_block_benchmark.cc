// quant_fp8_benchmark: CPU throughput of FP8 block quantization over a model's linear
// weights, as one TP worker holds them.
//
//   quant_fp8_benchmark [--model qwen3-0.6b] [--tp 1] [--rank 0] [--threads N] [--iters 5]
//
// Fills every quantized parameter of the worker with random bf16 values, then quantizes
// them all (QuantizeFp8Param, one parameter after another, each split over --threads)
// --iters times. GB/s is input bytes (model dtype, 10^9 bytes) over the best iteration's
// time.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

#include "core/dtype_convert.h"
#include "core/parallel.h"
#include "model/config.h"
#include "model/sharding.h"
#include "quant/fp8_sharding.h"

namespace wsync {
namespace {

int Run(const std::string& model, int tp, int rank, size_t threads, int iters) {
  Result<ModelConfig> c = LookupModel(model);
  if (!c.ok()) return fmt::print(stderr, "{}\n", c.status().ToString()), 1;
  Result<ShardingTable> t = ShardingTable::Build(*c, rank, tp);
  if (!t.ok()) return fmt::print(stderr, "{}\n", t.status().ToString()), 1;
  if (Status st = CheckFp8Sharding(*t); !st.ok()) return fmt::print(stderr, "{}\n", st.ToString()), 1;
  struct Param {
    int index;
    std::vector<uint16_t> src;
    std::vector<uint8_t> q;
    std::vector<float> s;
  };
  std::vector<Param> params;
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  int64_t in_bytes = 0, out_bytes = 0;
  for (int i = 0; i < static_cast<int>(t->params().size()); ++i) {
    if (!IsFp8Param(*t, i)) continue;
    Result<Fp8ParamLayout> l = Fp8LayoutOf(*t, i);
    if (!l.ok()) return fmt::print(stderr, "{}\n", l.status().ToString()), 1;
    Param p{i, std::vector<uint16_t>(l->weight.numel()), std::vector<uint8_t>(l->weight.numel()),
            std::vector<float>(l->scale_inv.numel())};
    for (auto& x : p.src) x = FloatToBF16(normal(rng));
    in_bytes += static_cast<int64_t>(t->params()[i].meta.nbytes());
    out_bytes += static_cast<int64_t>(p.q.size() + p.s.size() * sizeof(float));
    params.push_back(std::move(p));
  }
  double best = 1e30;
  for (int it = 0; it < iters; ++it) {
    const auto t0 = std::chrono::steady_clock::now();
    for (Param& p : params) {
      Status st = QuantizeFp8Param(*t, p.index, std::as_bytes(std::span(p.src)), p.q, p.s, threads);
      if (!st.ok()) return fmt::print(stderr, "{}\n", st.ToString()), 1;
    }
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  fmt::print("model {} tp {} rank {}: {} fp8 parameters, {:.3f} GB in (bf16), {:.3f} GB out (e4m3 + scales)\n",
             model, tp, rank, params.size(), in_bytes / 1e9, out_bytes / 1e9);
  fmt::print("cpu threads {}: best of {} {:.3f} s, {:.2f} GB/s of input\n", threads, iters, best,
             in_bytes / 1e9 / best);
  return 0;
}

}  // namespace
}  // namespace wsync

int main(int argc, char** argv) {
  CLI::App app{"CPU throughput of FP8 block quantization over a model's linear weights"};
  std::string model = "qwen3-0.6b";
  int tp = 1, rank = 0, iters = 5;
  size_t threads = wsync::DefaultThreads();
  app.add_option("--model", model, "registered model or config.json directory");
  app.add_option("--tp", tp, "tensor-parallel size");
  app.add_option("--rank", rank, "the worker's tp rank");
  app.add_option("--threads", threads, "threads per parameter (default: this process's CPUs)");
  app.add_option("--iters", iters, "timed passes; the best is reported");
  CLI11_PARSE(app, argc, argv);
  return wsync::Run(model, tp, rank, threads, iters);
}
