// `wsync bench ipc`: the whole colocated `ipc` sync (start .. finish, HTTP control plane,
// shared-memory staging ring, every worker loading its shards) against plain memcpy of
// the same bytes in the same run: one thread (what one receiving worker's copy-out costs
// at best) and all cores. A packed sync copies every byte twice (pack, then load), so on
// a host where the trainer's packing overlaps the workers' loads the sync can approach
// the one-thread memcpy floor, not beat it.
#include <algorithm>
#include <chrono>
#include <cstring>

#include <fmt/format.h>

#include "bench.h"
#include "children.h"
#include "core/parallel.h"
#include "model/config.h"
#include "trainer/synthetic.h"
#include "wsync/trainer.h"

namespace wsync::cli {
namespace {

using Clock = std::chrono::steady_clock;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Times `iters` copies of every tensor into one destination buffer (warmed first).
Result<std::vector<double>> MemcpyFloor(const std::vector<HostTensor>& tensors, size_t bytes, size_t threads,
                                        int iters) {
  WSYNC_ASSIGN_OR_RETURN(HostBuffer dst, HostBuffer::Allocate(bytes));
  std::vector<double> times;
  for (int i = 0; i <= iters; ++i) {  // iteration 0 touches the pages, as the engine's sync 0 does
    auto t0 = Clock::now();
    size_t offset = 0;
    for (const HostTensor& t : tensors) {
      std::span<const std::byte> src = t.storage.span().first(t.meta.nbytes());
      constexpr size_t kPiece = size_t{8} << 20;
      size_t pieces = (src.size() + kPiece - 1) / kPiece;
      ParallelFor(pieces, threads, [&](size_t b, size_t e) {
        size_t from = b * kPiece, to = std::min(src.size(), e * kPiece);
        std::memcpy(dst.data() + offset + from, src.data() + from, to - from);
      });
      offset += src.size();
    }
    if (i > 0) times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return times;
}

}  // namespace

int RunBenchIpc(const BenchArgs& a) {
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
    auto c = StartServer({"--model", a.model, "--tp", std::to_string(a.tp), "--backend", "ipc", "--timeout", "600"},
                         fmt::format("{}/server{}.log", *dir, i), Deadline::InSeconds(120));
    if (!c.ok()) return fail(c.status());
    servers.push_back(*c);
  }
  TrainerOptions o;
  o.backend = "ipc";
  for (const Child& c : servers) o.servers.push_back(c.url);
  o.bucket_gb = a.bucket_gb;
  o.timeout_seconds = 600;
  auto engine = CreateTrainerEngine(o);
  if (!engine.ok()) return fail(engine.status());
  if (Status s = (*engine)->Init(meta); !s.ok()) return fail(s);
  std::vector<double> sync_times, transfer_times;
  size_t bytes = 0, chunks = 0;
  for (int i = 0; i <= a.iters; ++i) {  // sync 0 warms up (first touch of every page)
    auto st = (*engine)->SendWeights((*trainer)->source(), std::nullopt);
    if (!st.ok()) return fail(st.status());
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
