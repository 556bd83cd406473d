// nccl_benchmark: the raw NCCL broadcast baseline for `wsync push --backend nccl` on GPUs.
//
//   nccl_benchmark --model qwen3-8b --devices 0,1 [--bucket-gb 1] [--iters 10] [--contend]
//
// Broadcasts, from the first device to the others, exactly the chunks the nccl backend
// sends for `--model` (vLLM's packed cut at --bucket-gb), one ncclBroadcast per chunk, and
// nothing else: no packing, no unpacking, no control plane. One process drives every
// device (ncclCommInitAll). Each iteration is timed from a synchronized start to the last
// device finishing; prints every iteration and the median, in ms and GB/s (10^9 bytes).
// The engine's efficiency is this median over the engine's median sync time. --contend
// adds two more runs that copy every chunk device-to-device on each GPU while it is on the
// wire (what the engine's pack and unpack do), with NCCL's stream at normal and at the
// highest priority: how much the copies slow the wire.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "model/config.h"
#include "plan/packing.h"

namespace {

#define CHECK_CUDA(x)                                                                             \
  do {                                                                                            \
    cudaError_t e_ = (x);                                                                         \
    if (e_ != cudaSuccess) {                                                                      \
      fmt::print(stderr, "nccl_benchmark: {} -> {}\n", #x, cudaGetErrorString(e_));             \
      return 1;                                                                                   \
    }                                                                                             \
  } while (0)
#define CHECK_NCCL(x)                                                                             \
  do {                                                                                            \
    ncclResult_t r_ = (x);                                                                        \
    if (r_ != ncclSuccess) {                                                                      \
      fmt::print(stderr, "nccl_benchmark: {} -> {}\n", #x, ncclGetErrorString(r_));             \
      return 1;                                                                                   \
    }                                                                                             \
  } while (0)

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"raw NCCL broadcast of a model's packed chunks (the nccl backend's baseline)"};
  std::string model = "qwen3-8b";
  std::string devices_arg = "0,1";
  double bucket_gb = 1.0;
  int iters = 10;
  bool contend = false;
  app.add_option("--model", model, "registered model or config.json directory")->capture_default_str();
  app.add_option("--devices", devices_arg, "CUDA devices, the first is the root")->capture_default_str();
  app.add_option("--bucket-gb", bucket_gb, "packed buffer in GiB, as push --bucket-gb")->capture_default_str();
  app.add_option("--iters", iters, "timed iterations after one warm-up")->capture_default_str();
  app.add_flag("--contend", contend, "also time the broadcast against concurrent device-to-device copies");
  CLI11_PARSE(app, argc, argv);

  std::vector<int> devs;
  std::stringstream ss(devices_arg);
  for (std::string item; std::getline(ss, item, ',');) devs.push_back(std::stoi(item));
  if (devs.size() < 2) {
    fmt::print(stderr, "nccl_benchmark: give at least two --devices\n");
    return 2;
  }
  auto config = wsync::LookupModel(model);
  if (!config.ok()) {
    fmt::print(stderr, "nccl_benchmark: {}\n", config.status().message());
    return 2;
  }
  std::vector<wsync::TensorMeta> meta = wsync::HfTensors(*config);
  size_t bucket = wsync::PackedBufferSize(meta, static_cast<size_t>(bucket_gb * (1u << 30)));
  auto plan = wsync::PlanChunks(meta, bucket);
  if (!plan.ok()) {
    fmt::print(stderr, "nccl_benchmark: {}\n", plan.status().message());
    return 2;
  }
  const int n = static_cast<int>(devs.size());
  std::vector<ncclComm_t> comms(n);
  CHECK_NCCL(ncclCommInitAll(comms.data(), n, devs.data()));
  std::vector<void*> buffers(n), copies(n);
  std::vector<cudaStream_t> copy_streams(n);
  for (int i = 0; i < n; ++i) {
    CHECK_CUDA(cudaSetDevice(devs[i]));
    CHECK_CUDA(cudaMalloc(&buffers[i], plan->max_chunk_bytes));
    if (contend) {
      CHECK_CUDA(cudaMalloc(&copies[i], plan->max_chunk_bytes));
      CHECK_CUDA(cudaStreamCreateWithFlags(&copy_streams[i], cudaStreamNonBlocking));
    }
  }
  fmt::print("model {} ({:.2f} GB) in {} chunks of <= {} bytes, root cuda:{}, {} receivers\n", config->name,
             plan->total_bytes / 1e9, plan->chunks.size(), plan->max_chunk_bytes, devs[0], n - 1);
  struct Mode {
    const char* name;
    bool copies;
    bool high_priority;
  };
  std::vector<Mode> modes = {{"raw nccl broadcast", false, false}};
  if (contend) {
    modes.push_back({"with concurrent d2d copies", true, false});
    modes.push_back({"with concurrent d2d copies, nccl stream at high priority", true, true});
  }
  for (const Mode& mode : modes) {
    std::vector<cudaStream_t> streams(n);
    for (int i = 0; i < n; ++i) {
      CHECK_CUDA(cudaSetDevice(devs[i]));
      int least = 0, greatest = 0;
      CHECK_CUDA(cudaDeviceGetStreamPriorityRange(&least, &greatest));
      CHECK_CUDA(cudaStreamCreateWithPriority(&streams[i], cudaStreamNonBlocking, mode.high_priority ? greatest : least));
    }
    std::vector<double> times;
    for (int it = 0; it <= iters; ++it) {
      auto t0 = std::chrono::steady_clock::now();
      for (const wsync::Chunk& c : plan->chunks) {
        if (mode.copies) {
          for (int i = 0; i < n; ++i) {
            CHECK_CUDA(cudaSetDevice(devs[i]));
            CHECK_CUDA(cudaMemcpyAsync(copies[i], buffers[i], c.bytes, cudaMemcpyDeviceToDevice, copy_streams[i]));
          }
        }
        CHECK_NCCL(ncclGroupStart());
        for (int i = 0; i < n; ++i) {
          CHECK_NCCL(ncclBroadcast(buffers[i], buffers[i], c.bytes, ncclUint8, 0, comms[i], streams[i]));
        }
        CHECK_NCCL(ncclGroupEnd());
      }
      for (int i = 0; i < n; ++i) {
        CHECK_CUDA(cudaSetDevice(devs[i]));
        CHECK_CUDA(cudaStreamSynchronize(streams[i]));
        if (mode.copies) CHECK_CUDA(cudaStreamSynchronize(copy_streams[i]));
      }
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (it == 0) continue;  // warm-up
      times.push_back(s);
      fmt::print("{} iter {}: {:.2f} ms, {:.1f} GB/s\n", mode.name, it, s * 1e3, plan->total_bytes / s / 1e9);
    }
    std::sort(times.begin(), times.end());
    double median = times[times.size() / 2];
    fmt::print("{} median: {:.2f} ms, {:.1f} GB/s over {} iters\n", mode.name, median * 1e3,
               plan->total_bytes / median / 1e9, iters);
    for (int i = 0; i < n; ++i) cudaStreamDestroy(streams[i]);
  }
  for (int i = 0; i < n; ++i) {
    cudaSetDevice(devs[i]);
    cudaFree(buffers[i]);
    if (contend) {
      cudaFree(copies[i]);
      cudaStreamDestroy(copy_streams[i]);
    }
    ncclCommDestroy(comms[i]);
  }
  return 0;
}
