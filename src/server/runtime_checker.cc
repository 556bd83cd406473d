#include "server/runtime_checker.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>

#include <fmt/format.h>

#include "core/digest.h"
#include "core/parallel.h"
#include "synthetic/synthetic_kernels.h"
#include "wsync/device_runtime.h"

namespace wsync {
namespace {

// One tensor a worker holds: a parameter in the model dtype, or an fp8 parameter's e4m3
// bytes or its scales.
struct ParamTask {
  const RuntimeWorker* worker;
  size_t param;       // index in the worker's table
  std::string name;   // the parameter's name as reported
  std::byte* data;    // on the store's device
  size_t bytes;
  DType dtype;
};

std::vector<ParamTask> Tasks(std::span<const RuntimeWorker> workers) {
  std::vector<ParamTask> tasks;
  for (const RuntimeWorker& w : workers) {
    const std::vector<WorkerParam>& params = w.store->table().params();
    for (size_t i = 0; i < params.size(); ++i) {
      const Fp8ParamLayout* l = w.fp8 != nullptr ? w.fp8->layout(i) : nullptr;
      if (l == nullptr) {
        tasks.push_back({&w, i, params[i].meta.name, w.store->param_data(i), params[i].meta.nbytes(), params[i].meta.dtype});
        continue;
      }
      tasks.push_back({&w, i, l->weight.name, reinterpret_cast<std::byte*>(w.fp8->mutable_weight_data(i)),
                       l->weight.nbytes(), l->weight.dtype});
      tasks.push_back({&w, i, l->scale_inv.name, reinterpret_cast<std::byte*>(w.fp8->mutable_scale_data(i)),
                       l->scale_inv.nbytes(), l->scale_inv.dtype});
    }
  }
  return tasks;
}

bool IsFloat(DType d) {
  switch (d) {
    case DType::kF16:
    case DType::kBF16:
    case DType::kF32:
    case DType::kF64:
    case DType::kF8E4M3:
    case DType::kF8E5M2: return true;
    default: return false;
  }
}

// splitmix64: the next value of the stream `state`.
uint64_t SplitMix64(uint64_t* state) {
  const uint64_t r = synthetic::Mix64(*state);
  *state += 0x9E3779B97F4A7C15ull;
  return r;
}

// Random bytes into `out`; for a float dtype, each element's top exponent bit (the bit
// below the sign, little-endian) is cleared.
void FillRandom(std::span<std::byte> out, DType dtype, uint64_t* state) {
  for (size_t i = 0; i < out.size(); i += 8) {
    uint64_t r = SplitMix64(state);
    std::memcpy(out.data() + i, &r, std::min<size_t>(8, out.size() - i));
  }
  if (!IsFloat(dtype)) return;
  const size_t item = ItemSize(dtype);
  for (size_t i = item - 1; i < out.size(); i += item) out[i] &= std::byte{0xBF};
}

// Runs body(task, scratch) for every (worker, parameter) on up to `threads` threads, each
// thread with its own host buffer of `piece_bytes` when a store is on a CUDA device; the
// first error wins.
Status ForEachParam(const std::vector<ParamTask>& tasks, size_t threads, size_t piece_bytes,
                    const std::function<Status(size_t, std::vector<std::byte>&)>& body) {
  std::mutex mu;
  Status first = Status::Ok();
  ParallelFor(tasks.size(), threads, [&](size_t b, size_t e) {
    std::vector<std::byte> scratch;
    for (size_t i = b; i < e; ++i) {
      {
        std::lock_guard lock(mu);
        if (!first.ok()) return;
      }
      const ParamTask& t = tasks[i];
      Status s = UseDeviceOnThisThread(t.worker->store->device());
      if (s.ok() && !t.worker->store->device().is_cpu() && scratch.size() < piece_bytes) scratch.resize(piece_bytes);
      if (s.ok()) s = body(i, scratch);
      if (!s.ok()) {
        std::lock_guard lock(mu);
        if (first.ok()) {
          first = s.WithContext(fmt::format("worker dp{}/tp{} parameter {}", t.worker->dp_rank, t.worker->tp_rank,
                                            t.name));
        }
        return;
      }
    }
  });
  return first;
}

}  // namespace

std::string RuntimeParamKey(int dp_rank, int tp_rank, std::string_view param) {
  return fmt::format("dp{}:pp0:pcp0:tp{}:{}", dp_rank, tp_rank, param);
}

std::vector<std::string> RuntimeParamNames(const RuntimeWorker& worker) {
  std::vector<std::string> out;
  for (const ParamTask& t : Tasks(std::span(&worker, 1))) out.push_back(t.name);
  return out;
}

Result<std::map<std::string, std::string>> RuntimeParamDigests(std::span<const RuntimeWorker> workers,
                                                               size_t threads, size_t piece_bytes) {
  std::vector<ParamTask> tasks = Tasks(workers);
  std::vector<std::string> hex(tasks.size());
  piece_bytes = std::max<size_t>(piece_bytes, 1);
  WSYNC_RETURN_IF_ERROR(ForEachParam(tasks, threads, piece_bytes, [&](size_t i, std::vector<std::byte>& scratch) -> Status {
    const ParamTask& t = tasks[i];
    const WorkerStore& store = *t.worker->store;
    const size_t n = t.bytes;
    const std::byte* data = t.data;
    auto hasher = Hasher::Create(DigestAlgorithm::kSha256);
    if (store.device().is_cpu()) {
      hasher->Update(std::span(data, n));
    } else {
      WSYNC_ASSIGN_OR_RETURN(DeviceRuntime * rt, CudaRuntimeFor(store.device()));
      for (size_t off = 0; off < n; off += piece_bytes) {
        const size_t len = std::min(piece_bytes, n - off);
        WSYNC_RETURN_IF_ERROR(rt->Copy2D(scratch.data(), len, data + off, len, len, 1));
        WSYNC_RETURN_IF_ERROR(rt->Synchronize());
        hasher->Update(std::span(scratch.data(), len));
      }
    }
    hex[i] = hasher->FinishHex();
    return Status::Ok();
  }));
  std::map<std::string, std::string> out;
  for (size_t i = 0; i < tasks.size(); ++i) {
    const RuntimeWorker& w = *tasks[i].worker;
    out.emplace(RuntimeParamKey(w.dp_rank, w.tp_rank, tasks[i].name), std::move(hex[i]));
  }
  return out;
}

Status RandomizeRuntimeParams(std::span<const RuntimeWorker> workers, uint64_t seed, size_t threads,
                              size_t piece_bytes) {
  piece_bytes = std::max<size_t>(piece_bytes, 16);
  std::vector<ParamTask> tasks = Tasks(workers);
  return ForEachParam(tasks, threads, piece_bytes, [&](size_t i, std::vector<std::byte>& scratch) -> Status {
    const ParamTask& t = tasks[i];
    WorkerStore& store = *t.worker->store;
    const size_t n = t.bytes;
    // Pieces hold whole elements, so each element's top byte is in the piece that fills it.
    const size_t item = ItemSize(t.dtype);
    const size_t piece = std::max(item, piece_bytes / item * item);
    uint64_t state = seed ^ (uint64_t(t.worker->dp_rank) << 48) ^ (uint64_t(t.worker->tp_rank) << 32) ^ i;
    std::byte* data = t.data;
    if (store.device().is_cpu()) {
      FillRandom(std::span(data, n), t.dtype, &state);
      return Status::Ok();
    }
    WSYNC_ASSIGN_OR_RETURN(DeviceRuntime * rt, CudaRuntimeFor(store.device()));
    if (scratch.size() < piece) scratch.resize(piece);
    for (size_t off = 0; off < n; off += piece) {
      const size_t len = std::min(piece, n - off);
      FillRandom(std::span(scratch.data(), len), t.dtype, &state);
      WSYNC_RETURN_IF_ERROR(rt->Copy2D(data + off, len, scratch.data(), len, len, 1));
      WSYNC_RETURN_IF_ERROR(rt->Synchronize());
    }
    return Status::Ok();
  });
}

}  // namespace wsync
