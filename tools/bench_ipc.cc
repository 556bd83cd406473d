// `wsync bench ipc`: the whole colocated `ipc` sync (start .. finish, HTTP control plane,
// shared-memory staging ring, every worker loading its shards) against plain memcpy of
// the same bytes in the same run: one thread (what one receiving worker's copy-out costs
// at best) and all cores. A packed sync copies every byte twice (pack, then load), so on
// a host where the trainer's packing overlaps the workers' loads the sync can approach
// the one-thread memcpy floor, not beat it.
//
// `--device cuda:N`: the trainer's tensors in one device allocation on cuda:N (a
// DeviceTensorSource) and one TP=1 server with its shards on the same GPU. Each mode runs
// its own session, with --iters (at least 10) timed syncs after one warm-up: packed
// (exported GPU staging slots, one batched copy to pack and one to land each chunk:
// every byte crosses HBM twice) and zero-copy (the server copies straight from the
// trainer's allocation after a "go": once). Beside them, the single-copy floor: one
// device-to-device copy of the same bytes. Extra GPU memory is what the device had free
// before the session minus after its first sync (trainer staging + mappings + plans).
#include <algorithm>
#include <chrono>
#include <cstring>

#include <fmt/format.h>

#include "backends/ipc/descriptor.h"
#include "backends/ipc/device_plane.h"
#include "backends/ipc/trainer.h"
#include "bench.h"
#include "children.h"
#include "core/process_memory.h"
#include "core/parallel.h"
#include "model/config.h"
#include "push.h"

#include "engine/verify.h"
#include "synthetic/synthetic.h"
#include "wsync/device_runtime.h"
#include "wsync/source.h"
#include "wsync/trainer.h"

namespace wsync::cli {
namespace {

using Clock = std::chrono::steady_clock;

// Times `iters` copies of every tensor into one destination buffer (warmed first). The
// threads split the whole model's 8 MiB pieces between them, so small tensors do not run
// on one thread alone.
Result<std::vector<double>> MemcpyFloor(const std::vector<HostTensor>& tensors, size_t bytes, size_t threads,
                                        int iters) {
  WSYNC_ASSIGN_OR_RETURN(HostBuffer dst, HostBuffer::Allocate(bytes));
  struct Piece {
    const std::byte* src;
    size_t offset, size;
  };
  constexpr size_t kPiece = size_t{8} << 20;
  std::vector<Piece> pieces;
  size_t offset = 0;
  for (const HostTensor& t : tensors) {
    std::span<const std::byte> src = t.storage.span().first(t.meta.nbytes());
    for (size_t from = 0; from < src.size(); from += kPiece) {
      pieces.push_back({src.data() + from, offset + from, std::min(kPiece, src.size() - from)});
    }
    offset += src.size();
  }
  std::vector<double> times;
  for (int i = 0; i <= iters; ++i) {  // iteration 0 touches the pages, as the engine's sync 0 does
    auto t0 = Clock::now();
    ParallelFor(pieces.size(), threads, [&](size_t b, size_t e) {
      for (size_t p = b; p < e; ++p) std::memcpy(dst.data() + pieces[p].offset, pieces[p].src, pieces[p].size);
    });
    if (i > 0) times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return times;
}

struct GpuModeResult {
  std::string mode;
  double sync_s = 0, transfer_s = 0;
  size_t chunks = 0;
  int64_t extra_bytes = 0;
};

// One session of `mode` against the server: Init, a warm-up sync, `iters` timed syncs.
Result<GpuModeResult> RunGpuMode(const std::string& url, const Device& device, DeviceTensorSource& source,
                                 const BenchArgs& a, int iters, IpcTrainerOptions::Mode mode, const char* name,
                                 const std::string& export_kind) {
  TrainerOptions o;
  o.backend = IpcBackend().name;
  o.inline_verify = a.inline_verify;
  o.servers = {url};
  o.device = device;
  o.bucket_gb = a.bucket_gb;
  o.timeout_seconds = 600;
  IpcTrainerOptions ipc;
  ipc.mode = mode;
  ipc.export_kind = export_kind;
  WSYNC_ASSIGN_OR_RETURN(auto free0, IpcDeviceMemoryInfo(device));
  WSYNC_ASSIGN_OR_RETURN(auto engine, CreateIpcTrainerWith(o, ipc));
  WSYNC_RETURN_IF_ERROR(engine->Init(source.metadata()));
  GpuModeResult r;
  r.mode = name;
  std::vector<double> sync_times, transfer_times;
  for (int i = 0; i <= iters; ++i) {
    WSYNC_ASSIGN_OR_RETURN(SyncStats st, engine->SendWeights(source, std::nullopt));
    if (i == 0) {
      WSYNC_ASSIGN_OR_RETURN(auto free1, IpcDeviceMemoryInfo(device));
      r.extra_bytes = static_cast<int64_t>(free0.first) - static_cast<int64_t>(free1.first);
      continue;
    }
    sync_times.push_back(st.seconds);
    transfer_times.push_back(st.transfer_seconds);
    r.chunks = st.chunks;
  }
  engine->Shutdown();
  r.sync_s = Median(sync_times);
  r.transfer_s = Median(transfer_times);
  return r;
}

// The single-copy floor: one device-to-device copy of `bytes` (timed on the host around
// the copy and its synchronization).
Result<double> DeviceCopyFloor(const DeviceTensorSource& source, size_t bytes, int iters) {
  WSYNC_ASSIGN_OR_RETURN(DeviceBuffer scratch, DeviceBuffer::Allocate(source.device(), bytes));
  WSYNC_ASSIGN_OR_RETURN(DeviceRuntime * rt, CudaRuntimeFor(source.device()));
  WSYNC_RETURN_IF_ERROR(rt->SetDevice(source.device().index));
  std::vector<double> times;
  for (int i = 0; i < iters + 3; ++i) {
    auto t0 = Clock::now();
    WSYNC_RETURN_IF_ERROR(rt->Copy2D(scratch.data(), 0, source.device_buffer().data(), 0, bytes, 1));
    WSYNC_RETURN_IF_ERROR(rt->Synchronize());
    if (i >= 3) times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return Median(times);
}

int RunBenchIpcGpu(const BenchArgs& a, const Device& device) {
  std::vector<Child> servers;
  auto fail = [&](const Status& s) {
    for (Child& c : servers) StopChild(c);
    fmt::print(stderr, "wsync bench ipc: error: {}\n", s.ToString());
    return 1;
  };
  auto config = LookupModel(a.model);
  if (!config.ok()) return fail(config.status());
  const int iters = std::max(a.iters, 10);
  std::vector<TensorMeta> meta = HfTensors(*config);
  size_t bytes = 0;
  for (const TensorMeta& t : meta) bytes += t.nbytes();
  // The host copy stays only to verify the server's bytes after each mode's syncs.
  auto trainer = SyntheticTrainer::FromMetadata(meta, 7, 0);
  if (!trainer.ok()) return fail(trainer.status());
  auto made = DeviceTensorSource::Create(device, meta);
  if (!made.ok()) return fail(made.status());
  std::unique_ptr<DeviceTensorSource> source = std::move(*made);
  if (Status s = source->Upload((*trainer)->tensors()); !s.ok()) return fail(s);
  auto dir = MakeTempDir("bench-ipc");
  if (!dir.ok()) return fail(dir.status());
  auto c = StartServer({"--model", a.model, "--tp", "1", "--device", device.ToString(), "--backend", std::string(IpcBackend().name),
                        "--timeout", "600"},
                       fmt::format("{}/server.log", *dir), Deadline::InSeconds(300));
  if (!c.ok()) return fail(c.status());
  servers.push_back(*c);
  std::vector<GpuModeResult> results;
  uint64_t step = 0;
  // The same source from cuMemCreate, as a trainer with expandable segments holds it:
  // zero-copy then exports it as cuda_fd, whose mappings copy at full speed.
  auto vmm = DeviceTensorSource::Create(device, meta, DeviceAllocator::kVirtualMemory);
  if (!vmm.ok()) return fail(vmm.status().WithContext("a cuMemCreate source"));
  struct Run {
    IpcTrainerOptions::Mode mode;
    const char* name;
    DeviceTensorSource* source;
    const char* export_kind;  // of the packed slots
  };
  using Mode = IpcTrainerOptions::Mode;
  for (auto [mode, name, run_source, export_kind] :
       {Run{Mode::kPacked, "packed, cuda_ipc slots", source.get(), "cuda_ipc"},
        Run{Mode::kPacked, "packed, cuda_fd slots", source.get(), "cuda_fd"},
        Run{Mode::kZeroCopy, "zero-copy", source.get(), "cuda_ipc"},
        Run{Mode::kZeroCopy, "zero-copy, cuMem source", vmm->get(), "cuda_ipc"}}) {
    if (step > 0) {  // new weights, so that this mode's verification proves its own bytes
      if (auto st = (*trainer)->Step(step); !st.ok()) return fail(st.status());
      if (Status s = run_source->Upload((*trainer)->tensors()); !s.ok()) return fail(s);
    }
    ++step;
    auto r = RunGpuMode(servers[0].url, device, *run_source, a, iters, mode, name, export_kind);
    if (!r.ok()) return fail(r.status().WithContext(fmt::format("{} (server log {})", name, servers[0].log_path)));
    TrainerOptions v;
    v.servers = {servers[0].url};
    v.timeout_seconds = 600;
    if (Status s = VerifyServers(v, (*trainer)->source(), DigestAlgorithm::kXxh3_128); !s.ok()) {
      return fail(s.WithContext(fmt::format("verifying the server after the {} syncs", name)));
    }
    fmt::print(stderr, "{}: the server's checksums equal the trainer's\n", name);
    results.push_back(*r);
  }
  for (Child& s : servers) StopChild(s);
  servers.clear();
  auto floor = DeviceCopyFloor(*source, bytes, iters);
  if (!floor.ok()) return fail(floor.status());
  fmt::print("wsync bench ipc: {} ({:.3f} GB, {} tensors) on {}: trainer and one TP=1 server colocated, bucket {} "
             "GiB, median of {} timed sync(s) after 1 warm-up; every mode verified by checksums\n",
             config->name, bytes / 1e9, meta.size(), device.ToString(), a.bucket_gb, iters);
  fmt::print("{:<52} {:>7} {:>9} {:>9} {:>8} {:>11} {:>12}\n", "what", "chunks", "sync ms", "data ms", "GB/s",
             "x floor", "extra GPU GB");
  for (const GpuModeResult& r : results) {
    fmt::print("{:<52} {:>7} {:>9.2f} {:>9.2f} {:>8.0f} {:>11.2f} {:>12.3f}\n",
               fmt::format("wsync ipc {} (start..finish)", r.mode), r.chunks, r.sync_s * 1e3, r.transfer_s * 1e3,
               bytes / r.sync_s / 1e9, r.sync_s / *floor, r.extra_bytes / 1e9);
  }
  fmt::print("{:<52} {:>7} {:>9.2f} {:>9.2f} {:>8.0f} {:>11.2f} {:>12}\n", "single device-to-device copy (floor)", 1,
             *floor * 1e3, *floor * 1e3, bytes / *floor / 1e9, 1.0, "");
  fmt::print("(sync = start_weight_update .. finish_weight_update answered; data = update_weights with the data "
             "plane; GB/s of the model's bytes per sync)\n");
  return 0;
}

}  // namespace

int RunBenchIpc(const BenchArgs& a) {
  auto device = Device::Parse(a.device);
  if (!device.ok()) {
    fmt::print(stderr, "wsync bench ipc: error: {}\n", device.status().message());
    return 1;
  }
  if (!device->is_cpu()) return RunBenchIpcGpu(a, *device);
  auto config = LookupModel(a.model);
  if (!config.ok()) {
    fmt::print(stderr, "wsync bench ipc: error: {}\n", config.status().message());
    return 1;
  }
  std::vector<TensorMeta> meta = HfTensors(*config);
  auto trainer = SyntheticTrainer::FromMetadata(meta, 7, 0);
  if (!trainer.ok()) {
    fmt::print(stderr, "wsync bench ipc: error: {}\n", trainer.status().message());
    return 1;
  }
  auto dir = MakeTempDir("bench-ipc");
  std::vector<Child> servers;
  auto fail = [&](const Status& s) {
    for (Child& c : servers) StopChild(c);
    fmt::print(stderr, "wsync bench ipc: error: {}\n", s.ToString());
    return 1;
  };
  if (!dir.ok()) return fail(dir.status());
  for (int i = 0; i < a.servers; ++i) {
    auto c = StartServer({"--model", a.model, "--tp", std::to_string(a.tp), "--backend", std::string(IpcBackend().name), "--timeout", "600"},
                         fmt::format("{}/server{}.log", *dir, i), Deadline::InSeconds(120));
    if (!c.ok()) return fail(c.status());
    servers.push_back(*c);
  }
  TrainerOptions o;
  o.backend = IpcBackend().name;
  for (const Child& c : servers) o.servers.push_back(c.url);
  o.bucket_gb = a.bucket_gb;
  o.timeout_seconds = 600;
  auto engine = CreateTrainerEngine(o);
  if (!engine.ok()) return fail(engine.status());
  if (Status s = (*engine)->Init(meta); !s.ok()) return fail(s);
  std::vector<double> sync_times, transfer_times;
  size_t bytes = 0, chunks = 0;
  MemoryPeak peak;  // the trainer's, the largest over the syncs
  for (int i = 0; i <= a.iters; ++i) {  // sync 0 warms up (first touch of every page)
    const MemoryWindow window;
    auto st = (*engine)->SendWeights((*trainer)->source(), std::nullopt);
    if (!st.ok()) return fail(st.status());
    peak.Include(window.Peak());
    bytes = st->bytes;
    chunks = st->chunks;
    if (i > 0) {
      sync_times.push_back(st->seconds);
      transfer_times.push_back(st->transfer_seconds);
    }
  }
  (*engine)->Shutdown();
  for (Child& c : servers) StopChild(c);
  servers.clear();

  size_t threads = DefaultThreads();
  auto one = MemcpyFloor((*trainer)->tensors(), bytes, 1, a.iters);
  if (!one.ok()) return fail(one.status());
  auto all = MemcpyFloor((*trainer)->tensors(), bytes, threads, a.iters);
  if (!all.ok()) return fail(all.status());
  double sync_s = Median(sync_times), transfer_s = Median(transfer_times);
  double one_s = Median(*one), all_s = Median(*all);
  fmt::print("wsync bench ipc: {} ({:.3f} GB), {} server(s) x TP={} on this host, {} chunk(s) per sync "
             "(bucket {} GiB), {} timed sync(s) after 1 warm-up, median, {} core(s)\n",
             config->name, bytes / 1e9, a.servers, a.tp, chunks, a.bucket_gb, a.iters, threads);
  fmt::print("trainer memory: RSS {:.1f} MB for a {:.1f} MB model; peak extra per sync: host {:.1f} MB, "
             "device {:.1f} MB\n", HostRssBytes() / 1e6, bytes / 1e6, peak.host_bytes / 1e6, peak.device_bytes / 1e6);
  fmt::print("{:<52} {:>9} {:>8} {:>12}\n", "what", "seconds", "GB/s", "floor/this");
  fmt::print("{:<52} {:>9.3f} {:>8.3f} {:>11.0f}%\n", "wsync ipc sync (start..finish, HTTP + shm ring)", sync_s,
             bytes / sync_s / 1e9, 100 * one_s / sync_s);
  fmt::print("{:<52} {:>9.3f} {:>8.3f} {:>11.0f}%\n", "  of which update_weights + data plane", transfer_s,
             bytes / transfer_s / 1e9, 100 * one_s / transfer_s);
  fmt::print("{:<52} {:>9.3f} {:>8.3f} {:>12}\n", "memcpy of the same bytes, 1 thread (floor)", one_s, bytes / one_s / 1e9,
             "100%");
  fmt::print("{:<52} {:>9.3f} {:>8.3f} {:>12}\n", fmt::format("memcpy of the same bytes, {} threads", threads), all_s,
             bytes / all_s / 1e9, "");
  return 0;
}

}  // namespace wsync::cli
