// cuda_ipc_benchmark: the `ipc` backend's GPU data plane between two processes on one GPU,
// against the single-copy floor measured in the same run.
//
// The trainer process (this one) holds a model's tensors in one device allocation (256-byte
// aligned, as the protocol lays chunks out) and starts a receiver process (this binary
// again, `--child ORDERS`) that holds the same layout as its "shards". They hand chunks
// off through the protocol's shared control region (backends/ipc/region.h: per-slot
// sequence numbers, per-reader acknowledgements, futex sleeps), exactly as the engines do;
// the HTTP control plane is left out. Modes:
//   packed     num_slots staging slots of --bucket-gb exported ONCE (cuda_ipc or cuda_fd);
//              per chunk the trainer packs (one batched-copy launch), synchronizes, and
//              publishes; the receiver copies out (one launch), synchronizes, and acks.
//              Every byte crosses HBM twice: the floor is 2x the single copy.
//   zero-copy  the trainer exports its tensors' allocation ONCE; per sync it publishes one
//              "go" and the receiver copies straight from the trainer's tensors into its
//              shards in one batched launch: every byte crosses HBM once.
// Reported: median sync time over --iters syncs (after one warm-up), the single-copy floor
// (one cudaMemcpyAsync of all the bytes, timed with events), the receiver's one-time open
// cost, peak extra GPU memory on each side, a checksum proof that the receiver holds the
// trainer's bytes, and (--leak-syncs N) device memory and open fds before and after N more
// syncs. Prints one JSON line per mode at the end.
#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "backends/ipc/protocol.h"
#include "backends/ipc/region.h"
#include "core/subprocess.h"
#include "cuda/batched_copy.h"
#include "cuda/cuda_check.h"
#include "cuda/device.h"
#include "cuda/device_memory.h"
#include "model/config.h"

namespace wsync::cuda {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

struct Args {
  std::string model = "qwen3-8b";
  int device = 0;
  int iters = 10;
  double bucket_gb = 1.24;
  int slots = 2;
  std::string kind = "cuda_ipc";
  std::string mode = "all";  // packed, zero-copy, all
  std::string copy = "plan";  // plan (one batched launch) or memcpy (one cudaMemcpyAsync per tensor)
  int leak_syncs = 0;
  std::string child;  // hidden: the receiver's orders
};

struct Layout {
  std::vector<TensorMeta> meta;
  std::vector<uint64_t> offsets;  // of each tensor in the flat allocation
  uint64_t bytes = 0;             // the flat allocation
  uint64_t payload = 0;           // sum of tensor bytes
};

Layout MakeLayout(const std::string& model) {
  Layout l;
  l.meta = HfTensors(*LookupModel(model));
  for (const TensorMeta& t : l.meta) {
    l.bytes = (l.bytes + kIpcAlignment - 1) / kIpcAlignment * kIpcAlignment;
    l.offsets.push_back(l.bytes);
    l.bytes += t.nbytes();
    l.payload += t.nbytes();
  }
  l.bytes = (l.bytes + 255) / 256 * 256;
  return l;
}

size_t FreeDeviceMemory() {
  size_t free = 0, total = 0;
  cudaMemGetInfo(&free, &total);
  return free;
}

int OpenFds() {
  int n = 0;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (readdir(d) != nullptr) ++n;
    closedir(d);
  }
  return n;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Copies per chunk and slot, either as one batched launch or one memcpy per op.
class Copier {
 public:
  static Result<Copier> Make(std::vector<CopyOp> ops, bool batched) {
    Copier c;
    c.ops_ = std::move(ops);
    if (batched) {
      WSYNC_ASSIGN_OR_RETURN(c.plan_, CopyPlan::Create(c.ops_));
    }
    return c;
  }
  Status Run(cudaStream_t s) const {
    if (plan_) return plan_->Launch(s);
    for (const CopyOp& op : ops_) WSYNC_CUDA_CHECK(cudaMemcpyAsync(op.dst, op.src, op.bytes, cudaMemcpyDeviceToDevice, s));
    return Status::Ok();
  }

 private:
  std::vector<CopyOp> ops_;
  std::shared_ptr<CopyPlan> plan_;
};

// Pack (trainer) or unpack (receiver) copiers: [chunk][slot].
Result<std::vector<std::vector<Copier>>> ChunkCopiers(const Layout& l, const IpcPlan& plan, std::byte* flat,
                                                      std::byte* staging, uint64_t stride, int slots, bool pack,
                                                      bool batched) {
  std::vector<std::vector<Copier>> out(plan.chunk_ends.size());
  for (size_t k = 0; k < plan.chunk_ends.size(); ++k) {
    for (int s = 0; s < slots; ++s) {
      std::vector<CopyOp> ops;
      for (size_t i = k == 0 ? 0 : plan.chunk_ends[k - 1]; i < plan.chunk_ends[k]; ++i) {
        std::byte* model_at = flat + l.offsets[i];
        std::byte* slot_at = staging + s * stride + plan.tensor_offsets[i];
        ops.push_back(pack ? CopyOp{model_at, slot_at, l.meta[i].nbytes()} : CopyOp{slot_at, model_at, l.meta[i].nbytes()});
      }
      WSYNC_ASSIGN_OR_RETURN(Copier c, Copier::Make(std::move(ops), batched));
      out[k].push_back(std::move(c));
    }
  }
  return out;
}

// Every tensor of `flat` filled with pseudo-random bytes; padding stays zero.
Status FillModel(const Layout& l, std::byte* flat) {
  constexpr size_t kBlock = size_t{64} << 20;
  std::vector<unsigned char> host(kBlock);
  std::mt19937_64 rng(42);
  for (auto& c : host) c = static_cast<unsigned char>(rng());
  void* block = nullptr;
  WSYNC_CUDA_CHECK(cudaMalloc(&block, kBlock));
  WSYNC_CUDA_CHECK(cudaMemcpy(block, host.data(), kBlock, cudaMemcpyHostToDevice));
  WSYNC_CUDA_CHECK(cudaMemset(flat, 0, l.bytes));
  std::vector<CopyOp> ops;
  for (size_t i = 0; i < l.meta.size(); ++i) {
    for (uint64_t off = 0; off < l.meta[i].nbytes(); off += kBlock / 2) {
      uint64_t n = std::min<uint64_t>(kBlock / 2, l.meta[i].nbytes() - off);
      uint64_t from = ((i * 7919 + off / 4096) * 4096) % (kBlock / 2);
      ops.push_back({static_cast<std::byte*>(block) + from, flat + l.offsets[i] + off, n});
    }
  }
  WSYNC_ASSIGN_OR_RETURN(auto plan, CopyPlan::Create(ops));
  WSYNC_RETURN_IF_ERROR(plan->Launch(nullptr));
  WSYNC_CUDA_CHECK(cudaDeviceSynchronize());
  cudaFree(block);
  return Status::Ok();
}

// ---- receiver ---------------------------------------------------------------------

Status RunChild(const Args& a) {
  json o = json::parse(a.child);
  Layout l = MakeLayout(o["model"]);
  bool zero_copy = o["mode"] == "zero-copy";
  WSYNC_CUDA_CHECK(cudaSetDevice(a.device));
  cudaStream_t stream;
  WSYNC_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  void* shards = nullptr;
  WSYNC_CUDA_CHECK(cudaMalloc(&shards, l.bytes));
  WSYNC_CUDA_CHECK(cudaMemset(shards, 0, l.bytes));
  WSYNC_CUDA_CHECK(cudaDeviceSynchronize());
  WSYNC_ASSIGN_OR_RETURN(IpcInitInfo info, IpcInitInfo::Parse(o["init_info"]));
  WSYNC_ASSIGN_OR_RETURN(std::string uuid, GpuUuid(a.device));
  WSYNC_ASSIGN_OR_RETURN(const IpcBufferDesc* entry, info.FindBuffer(uuid));
  size_t free_before = FreeDeviceMemory();
  auto t_open = Clock::now();
  WSYNC_ASSIGN_OR_RETURN(std::unique_ptr<IpcRegion> region, IpcRegion::Open(info));
  WSYNC_ASSIGN_OR_RETURN(ExportKind kind, ParseExportKind(entry->kind));
  uint64_t mapped = zero_copy ? l.bytes : entry->offset + entry->stride * info.num_slots;
  WSYNC_ASSIGN_OR_RETURN(auto remote, ImportedDeviceMemory::Open(a.device, kind, entry->handle, mapped));
  double open_s = std::chrono::duration<double>(Clock::now() - t_open).count();
  std::byte* base = static_cast<std::byte*>(remote->data()) + entry->offset;
  bool batched = o["copy"] == "plan";
  std::vector<std::vector<Copier>> unpack;
  std::optional<Copier> go;
  IpcPlan plan;
  if (zero_copy) {
    std::vector<CopyOp> ops;
    for (size_t i = 0; i < l.meta.size(); ++i) {
      ops.push_back({base + l.offsets[i], static_cast<std::byte*>(shards) + l.offsets[i], l.meta[i].nbytes()});
    }
    WSYNC_ASSIGN_OR_RETURN(go, Copier::Make(std::move(ops), batched));
  } else {
    WSYNC_ASSIGN_OR_RETURN(plan, PlanIpcChunks(l.meta, info.slot_bytes));
    WSYNC_ASSIGN_OR_RETURN(unpack, ChunkCopiers(l, plan, static_cast<std::byte*>(shards), base, entry->stride,
                                                info.num_slots, false, batched));
  }
  size_t extra = free_before - std::min(free_before, FreeDeviceMemory());
  region->Attach(0, static_cast<uint32_t>(getpid()));

  int syncs = o["syncs"].get<int>(), leak_from = o["leak_from"].get<int>();
  uint64_t chunks = zero_copy ? 1 : plan.chunk_ends.size();
  size_t leak_free0 = 0;
  int leak_fds0 = 0;
  for (int s = 0; s < syncs; ++s) {
    if (s == leak_from) {
      leak_free0 = FreeDeviceMemory();
      leak_fds0 = OpenFds();
    }
    for (uint64_t k = 0; k < chunks; ++k) {
      uint64_t seq = 1 + s * chunks + k;
      WSYNC_RETURN_IF_ERROR(region->WaitPublished(seq, s + 1, Deadline::InSeconds(60), fmt::format("chunk {} of sync {}", k, s)));
      if (zero_copy) {
        WSYNC_RETURN_IF_ERROR(go->Run(stream));
      } else {
        WSYNC_RETURN_IF_ERROR(unpack[k][seq % info.num_slots].Run(stream));
      }
      WSYNC_CUDA_CHECK(cudaStreamSynchronize(stream));
      region->Ack(0, seq);
    }
  }
  WSYNC_ASSIGN_OR_RETURN(uint64_t sum, DeviceChecksum(shards, l.bytes, stream));
  json report = {{"open_s", open_s}, {"extra_bytes", extra}, {"checksum", sum}};
  if (leak_from < syncs) {
    report["leak_free_delta"] = static_cast<int64_t>(leak_free0) - static_cast<int64_t>(FreeDeviceMemory());
    report["leak_fd_delta"] = OpenFds() - leak_fds0;
  }
  std::printf("REPORT %s\n", report.dump().c_str());
  std::fflush(stdout);
  return Status::Ok();
}

// ---- trainer ----------------------------------------------------------------------

Result<std::unique_ptr<Subprocess>> SpawnChild(const Args& a, const json& orders) {
  SpawnOptions o;
  o.args = {"--device", std::to_string(a.device), "--child", orders.dump()};
  o.capture_stdout = true;  // its REPORT line
  return Subprocess::Spawn(SelfExe(), std::move(o));
}

Result<json> WaitChild(Subprocess& c) {
  std::optional<ExitStatus> st = c.Wait(Deadline::InSeconds(600));
  std::string text = c.Stdout();
  auto at = text.find("REPORT ");
  if (!st || at == std::string::npos || !st->success()) {
    return Internal(fmt::format("receiver process failed ({}): {}", st ? st->ToString() : "ran past 600 s", text));
  }
  return json::parse(text.substr(at + 7, text.find('\n', at) - at - 7));
}

Result<json> RunMode(const Args& a, const std::string& mode, const Layout& l, ExportedDeviceMemory& source,
                     uint64_t source_sum, double floor_s) {
  bool zero_copy = mode == "zero-copy";
  WSYNC_ASSIGN_OR_RETURN(ExportKind kind, ParseExportKind(a.kind));
  WSYNC_ASSIGN_OR_RETURN(std::string uuid, GpuUuid(a.device));
  uint64_t slot_bytes = IpcSlotBytes(l.meta, static_cast<uint64_t>(a.bucket_gb * 1e9));
  IpcRegionOptions ro;
  ro.session = NewSessionId();
  ro.num_slots = a.slots;
  ro.slot_bytes = slot_bytes;
  ro.reader_count = 1;
  ro.slots_in_region = false;
  WSYNC_ASSIGN_OR_RETURN(std::unique_ptr<IpcRegion> region, IpcRegion::Create(ro));
  size_t free_before = FreeDeviceMemory();
  std::unique_ptr<ExportedDeviceMemory> staging;
  IpcBufferDesc desc;
  desc.kind = a.kind;
  desc.stride = region->slot_stride();
  if (zero_copy) {
    desc.handle = source.Handle();
    desc.stride = std::max<uint64_t>(desc.stride, slot_bytes);
  } else {
    WSYNC_ASSIGN_OR_RETURN(staging, ExportedDeviceMemory::Allocate(a.device, region->slot_stride() * a.slots, kind));
    desc.handle = staging->Handle();
  }
  size_t trainer_extra = free_before - std::min(free_before, FreeDeviceMemory());
  IpcInitInfo info;
  info.session = region->session();
  info.control_path = region->path();
  info.control_bytes = region->bytes();
  info.num_slots = region->num_slots();
  info.slot_bytes = region->slot_bytes();
  info.reader_count = 1;
  info.buffers[uuid] = desc;
  int warmup = 1;
  int syncs = warmup + a.iters + a.leak_syncs;
  json orders = {{"model", a.model}, {"mode", mode}, {"copy", a.copy}, {"init_info", info.ToJson()},
                 {"syncs", syncs}, {"leak_from", a.leak_syncs > 0 ? warmup + a.iters : syncs}};
  WSYNC_ASSIGN_OR_RETURN(std::unique_ptr<Subprocess> child, SpawnChild(a, orders));
  Deadline ready = Deadline::InSeconds(120);
  while (region->reader_pid(0) == 0) {
    if (ready.expired()) return DeadlineExceeded("the receiver process did not attach within 120 s");
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  cudaStream_t stream;
  WSYNC_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::byte* flat = static_cast<std::byte*>(source.data());
  IpcPlan plan;
  std::vector<std::vector<Copier>> pack;
  if (!zero_copy) {
    WSYNC_ASSIGN_OR_RETURN(plan, PlanIpcChunks(l.meta, slot_bytes));
    WSYNC_ASSIGN_OR_RETURN(pack, ChunkCopiers(l, plan, flat, static_cast<std::byte*>(staging->data()),
                                              region->slot_stride(), a.slots, true, a.copy == "plan"));
  }
  uint64_t chunks = zero_copy ? 1 : plan.chunk_ends.size();
  std::vector<double> times;
  for (int s = 0; s < syncs; ++s) {
    auto t0 = Clock::now();
    for (uint64_t k = 0; k < chunks; ++k) {
      uint64_t seq = 1 + s * chunks + k;
      WSYNC_RETURN_IF_ERROR(region->WaitAcked(seq > uint64_t(a.slots) ? seq - a.slots : 0, Deadline::InSeconds(60),
                                              nullptr, nullptr));
      if (!zero_copy) {
        WSYNC_RETURN_IF_ERROR(pack[k][seq % a.slots].Run(stream));
        WSYNC_CUDA_CHECK(cudaStreamSynchronize(stream));
      }
      region->Publish(seq, zero_copy ? 0 : plan.chunk_bytes[k]);
    }
    WSYNC_RETURN_IF_ERROR(region->WaitAcked(s * chunks + chunks, Deadline::InSeconds(60), nullptr, nullptr));
    if (s >= warmup && s < warmup + a.iters) times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  WSYNC_ASSIGN_OR_RETURN(json report, WaitChild(*child));
  double med = Median(times);
  json out = {{"mode", mode},
              {"kind", a.kind},
              {"copy", a.copy},
              {"model", a.model},
              {"bytes", l.payload},
              {"chunks", chunks},
              {"slot_bytes", zero_copy ? 0 : slot_bytes},
              {"median_s", med},
              {"min_s", *std::min_element(times.begin(), times.end())},
              {"GBps", l.payload / med / 1e9},
              {"floor_s", floor_s},
              {"floor_ratio", med / floor_s},
              {"receiver_open_s", report["open_s"]},
              {"trainer_extra_gpu_bytes", trainer_extra},
              {"receiver_extra_gpu_bytes", report["extra_bytes"]},
              {"checksum_ok", report["checksum"].get<uint64_t>() == source_sum}};
  if (report.contains("leak_free_delta")) {
    out["leak_syncs"] = a.leak_syncs;
    out["receiver_free_bytes_lost"] = report["leak_free_delta"];
    out["receiver_fds_gained"] = report["leak_fd_delta"];
  }
  cudaStreamDestroy(stream);
  return out;
}

// A packed sync's reference without a second process: the same chunks packed into the
// same slots and copied out again into a second copy of the model, both launches of a chunk
// back to back on one stream of this process. Every byte still crosses HBM twice, but no
// hand-off waits and no GPU time-slicing between two processes' contexts (the two copies
// of a colocated sync never run concurrently without MPS), so this is what a packed sync
// could reach if the hand-off cost nothing.
Result<double> PackedInOneProcess(const Args& a, const Layout& l, std::byte* flat) {
  uint64_t slot_bytes = IpcSlotBytes(l.meta, static_cast<uint64_t>(a.bucket_gb * 1e9));
  WSYNC_ASSIGN_OR_RETURN(IpcPlan plan, PlanIpcChunks(l.meta, slot_bytes));
  slot_bytes = (slot_bytes + kIpcAlignment - 1) / kIpcAlignment * kIpcAlignment;  // the slots' stride
  void* staging = nullptr;
  void* shards = nullptr;
  WSYNC_CUDA_CHECK(cudaMalloc(&staging, slot_bytes * a.slots));
  WSYNC_CUDA_CHECK(cudaMalloc(&shards, l.bytes));
  WSYNC_CUDA_CHECK(cudaMemset(shards, 0, l.bytes));  // padding as in the source
  auto release = [&] {
    cudaFree(staging);
    cudaFree(shards);
  };
  auto pack = ChunkCopiers(l, plan, flat, static_cast<std::byte*>(staging), slot_bytes, a.slots, true, a.copy == "plan");
  auto unpack = ChunkCopiers(l, plan, static_cast<std::byte*>(shards), static_cast<std::byte*>(staging), slot_bytes,
                             a.slots, false, a.copy == "plan");
  if (!pack.ok() || !unpack.ok()) {
    release();
    return !pack.ok() ? pack.status() : unpack.status();
  }
  std::vector<double> times;
  for (int s = 0; s < 1 + a.iters; ++s) {
    auto t0 = Clock::now();
    for (size_t k = 0; k < plan.chunk_ends.size(); ++k) {
      int slot = static_cast<int>((s * plan.chunk_ends.size() + k) % a.slots);
      WSYNC_RETURN_IF_ERROR((*pack)[k][slot].Run(nullptr));
      WSYNC_RETURN_IF_ERROR((*unpack)[k][slot].Run(nullptr));
    }
    WSYNC_CUDA_CHECK(cudaDeviceSynchronize());
    if (s >= 1) times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  WSYNC_ASSIGN_OR_RETURN(uint64_t got, DeviceChecksum(shards, l.bytes, nullptr));
  WSYNC_ASSIGN_OR_RETURN(uint64_t want, DeviceChecksum(flat, l.bytes, nullptr));
  release();
  if (got != want) return DataLoss("packed in one process: the copied model differs from the source");
  return Median(times);
}

Status Run(const Args& a) {
  Layout l = MakeLayout(a.model);
  WSYNC_CUDA_CHECK(cudaSetDevice(a.device));
  WSYNC_ASSIGN_OR_RETURN(ExportKind kind, ParseExportKind(a.kind));
  WSYNC_ASSIGN_OR_RETURN(auto source, ExportedDeviceMemory::Allocate(a.device, l.bytes, kind));
  std::byte* flat = static_cast<std::byte*>(source->data());
  WSYNC_RETURN_IF_ERROR(FillModel(l, flat));
  WSYNC_ASSIGN_OR_RETURN(uint64_t sum, DeviceChecksum(flat, l.bytes, nullptr));

  // The single-copy floor: one copy of the same bytes, device to device.
  void* scratch = nullptr;
  WSYNC_CUDA_CHECK(cudaMalloc(&scratch, l.payload));
  cudaEvent_t e0, e1;
  WSYNC_CUDA_CHECK(cudaEventCreate(&e0));
  WSYNC_CUDA_CHECK(cudaEventCreate(&e1));
  std::vector<double> floor;
  for (int i = 0; i < 3 + a.iters; ++i) {
    WSYNC_CUDA_CHECK(cudaEventRecord(e0));
    WSYNC_CUDA_CHECK(cudaMemcpyAsync(scratch, flat, l.payload, cudaMemcpyDeviceToDevice));
    WSYNC_CUDA_CHECK(cudaEventRecord(e1));
    WSYNC_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    WSYNC_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    if (i >= 3) floor.push_back(ms / 1e3);
  }
  cudaFree(scratch);
  double floor_s = Median(floor);
  fmt::print(stderr, "{}: {:.2f} GB in {} tensors; single-copy floor {:.2f} ms ({:.0f} GB/s copied)\n", a.model,
             l.payload / 1e9, l.meta.size(), floor_s * 1e3, l.payload / floor_s / 1e9);
  WSYNC_ASSIGN_OR_RETURN(double one_process_s, PackedInOneProcess(a, l, flat));
  fmt::print(stderr, "packed, both copies in this process (no hand-off): {:.2f} ms ({:.2f}x the floor)\n",
             one_process_s * 1e3, one_process_s / floor_s);
  std::printf("%s\n", json{{"mode", "packed-one-process"}, {"median_s", one_process_s},
                            {"floor_ratio", one_process_s / floor_s}}.dump().c_str());
  std::vector<std::string> modes = a.mode == "all" ? std::vector<std::string>{"packed", "zero-copy"}
                                                   : std::vector<std::string>{a.mode};
  for (const std::string& mode : modes) {
    WSYNC_ASSIGN_OR_RETURN(json r, RunMode(a, mode, l, *source, sum, floor_s));
    fmt::print(stderr, "{:>9}: median {:.2f} ms ({:.0f} GB/s), {:.2f}x the floor, checksum {}\n", mode,
               r["median_s"].get<double>() * 1e3, r["GBps"].get<double>(), r["floor_ratio"].get<double>(),
               r["checksum_ok"].get<bool>() ? "ok" : "MISMATCH");
    std::printf("%s\n", r.dump().c_str());
    std::fflush(stdout);
    if (!r["checksum_ok"].get<bool>()) return DataLoss(fmt::format("{}: the receiver's bytes differ", mode));
  }
  return Status::Ok();
}

}  // namespace
}  // namespace wsync::cuda

int main(int argc, char** argv) {
  wsync::cuda::Args a;
  CLI::App app{"cuda_ipc_benchmark: the ipc backend's GPU data plane between two processes on one GPU"};
  app.add_option("--model", a.model)->capture_default_str();
  app.add_option("--device", a.device, "CUDA device ordinal")->capture_default_str();
  app.add_option("--iters", a.iters, "timed syncs after one warm-up")->capture_default_str();
  app.add_option("--bucket-gb", a.bucket_gb, "packed: staging slot size in GB (1e9 bytes)")->capture_default_str();
  app.add_option("--slots", a.slots, "packed: staging slots")->capture_default_str();
  app.add_option("--kind", a.kind, "cuda_ipc or cuda_fd")->capture_default_str();
  app.add_option("--mode", a.mode, "packed, zero-copy or all")->capture_default_str();
  app.add_option("--copy", a.copy, "plan (one batched launch per chunk) or memcpy (one per tensor)")->capture_default_str();
  app.add_option("--leak-syncs", a.leak_syncs, "after the timed syncs, this many more with memory/fd accounting")
      ->capture_default_str();
  app.add_option("--child", a.child)->group("");
  CLI11_PARSE(app, argc, argv);
  if (wsync::cuda::DeviceCount() == 0) {
    std::fprintf(stderr, "cuda_ipc_benchmark: no CUDA device\n");
    return 2;
  }
  wsync::Status s = a.child.empty() ? wsync::cuda::Run(a) : wsync::cuda::RunChild(a);
  if (!s.ok()) {
    std::fprintf(stderr, "cuda_ipc_benchmark%s: error: %s\n", a.child.empty() ? "" : " (receiver)", s.ToString().c_str());
    return 1;
  }
  return 0;
}
