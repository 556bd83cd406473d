// `wsync bench broadcast`: the whole `nccl` (Gloo) sync against a raw broadcast of the
// same bytes between the same number of processes, in the same run.
#include "bench.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

#include <fmt/format.h>

#include "children.h"
#include "comm/gloo_communicator.h"
#include "comm/store.h"
#include "core/process_memory.h"
#include "core/stopwatch.h"
#include "model/config.h"
#include "plan/packing.h"
#include "synthetic/synthetic.h"
#include "wsync/trainer.h"

namespace wsync::cli {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

namespace {

using Clock = std::chrono::steady_clock;

GlooBroadcastAlgorithm AlgorithmOf(const std::string& name) {
  if (name == "chain") return GlooBroadcastAlgorithm::kChain;
  if (name == "binomial") return GlooBroadcastAlgorithm::kBinomial;
  return GlooBroadcastAlgorithm::kGlooBaseline;
}

std::vector<size_t> ParseChunks(const std::string& s) {
  std::vector<size_t> out;
  size_t start = 0;
  while (start < s.size()) {
    size_t comma = s.find(',', start);
    out.push_back(std::stoull(s.substr(start, comma - start)));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

// Times `iters` broadcasts of `chunks` from rank 0 to `receivers` child processes.
Result<std::vector<double>> RawBroadcast(const std::string& algorithm, int receivers,
                                         const std::vector<size_t>& chunks, int iters) {
  WSYNC_ASSIGN_OR_RETURN(auto store, StoreServer::Start("127.0.0.1", 0));
  std::string prefix = fmt::format("bench-{}-{}", algorithm, getpid());
  std::string chunk_list;
  size_t max_chunk = 0;
  for (size_t c : chunks) {
    chunk_list += (chunk_list.empty() ? "" : ",") + std::to_string(c);
    max_chunk = std::max(max_chunk, c);
  }
  std::vector<std::unique_ptr<Subprocess>> ranks;
  for (int r = 1; r <= receivers; ++r) {
    SpawnOptions o;
    o.args = {"bench-rank", "--store-port", std::to_string(store->port()), "--prefix", prefix, "--rank",
              std::to_string(r), "--size", std::to_string(receivers + 1), "--algorithm", algorithm,
              "--chunks", chunk_list, "--iters", std::to_string(iters)};
    WSYNC_ASSIGN_OR_RETURN(std::unique_ptr<Subprocess> rank, Subprocess::Spawn(SelfExe(), std::move(o)));
    ranks.push_back(std::move(rank));
  }
  GlooOptions g;
  g.store_port = store->port();
  g.prefix = prefix;
  g.rank = 0;
  g.size = receivers + 1;
  g.algorithm = AlgorithmOf(algorithm);
  g.connect_deadline = Deadline::InSeconds(60);
  auto comm = ConnectGloo(g);
  std::vector<double> times;
  if (comm.ok()) {
    auto buf = HostBuffer::Allocate(max_chunk);
    if (!buf.ok()) return buf.status();
    std::fill_n(buf->data(), buf->size(), std::byte{0x5a});
    for (int i = 0; i <= iters; ++i) {  // iteration 0 warms buffers up, as the engine's sync 0 does
      auto t0 = Clock::now();
      for (size_t c : chunks) {
        Status s = (*comm)->Broadcast(buf->span().first(c), 0, Deadline::InSeconds(600));
        if (!s.ok()) return s;
      }
      if (i > 0) times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
  }
  for (auto& rank : ranks) rank->Wait(Deadline::InSeconds(600));
  if (!comm.ok()) return comm.status();
  return times;
}

// What a process has used so far: minor page faults and CPU seconds (user + system),
// from /proc/<pid>/stat (zeros if it cannot be read).
struct Usage {
  double minor_faults = 0;
  double cpu_seconds = 0;
  Usage& operator+=(const Usage& o) {
    minor_faults += o.minor_faults;
    cpu_seconds += o.cpu_seconds;
    return *this;
  }
  Usage operator-(const Usage& o) const { return {minor_faults - o.minor_faults, cpu_seconds - o.cpu_seconds}; }
};

Usage UsageOf(pid_t pid) {
  std::ifstream in(fmt::format("/proc/{}/stat", pid));
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  size_t p = stat.rfind(')');  // the command name may hold spaces
  if (p == std::string::npos || p + 2 > stat.size()) return {};
  // Fields from 3 (state) on: minflt is field 10, utime and stime are 14 and 15.
  std::istringstream fields(stat.substr(p + 2));
  std::vector<std::string> f((std::istream_iterator<std::string>(fields)), std::istream_iterator<std::string>());
  if (f.size() < 13) return {};
  const double tick = static_cast<double>(sysconf(_SC_CLK_TCK));
  return {std::stod(f[7]), (std::stod(f[11]) + std::stod(f[12])) / tick};
}

// The trainer (this process) and the servers together.
struct FleetUsage {
  Usage trainer, servers;
  static FleetUsage Now(const std::vector<Child>& children) {
    FleetUsage u{UsageOf(getpid()), {}};
    for (const Child& c : children) if (c.process) u.servers += UsageOf(c.process->pid());
    return u;
  }
  FleetUsage operator-(const FleetUsage& o) const { return {trainer - o.trainer, servers - o.servers}; }
};

}  // namespace

int RunBenchRank(const BenchRankArgs& a) {
  GlooOptions g;
  g.store_host = a.store_host;
  g.store_port = a.store_port;
  g.prefix = a.prefix;
  g.rank = a.rank;
  g.size = a.size;
  g.algorithm = AlgorithmOf(a.algorithm);
  g.connect_deadline = Deadline::InSeconds(60);
  auto comm = ConnectGloo(g);
  if (!comm.ok()) {
    fmt::print(stderr, "bench-rank {}: {}\n", a.rank, comm.status().ToString());
    return 1;
  }
  std::vector<size_t> chunks = ParseChunks(a.chunks);
  auto buf = HostBuffer::Allocate(*std::max_element(chunks.begin(), chunks.end()));
  if (!buf.ok()) return 1;
  for (int i = 0; i <= a.iters; ++i) {
    for (size_t c : chunks) {
      Status s = (*comm)->Broadcast(buf->span().first(c), 0, Deadline::InSeconds(600));
      if (!s.ok()) {
        fmt::print(stderr, "bench-rank {}: {}\n", a.rank, s.ToString());
        return 1;
      }
    }
  }
  return 0;
}

int RunBench(const BenchArgs& a) {
  auto config = LookupModel(a.model);
  if (!config.ok()) {
    fmt::print(stderr, "wsync bench: error: {}\n", config.status().message());
    return 1;
  }
  std::vector<TensorMeta> meta = HfTensors(*config);
  auto trainer = SyntheticTrainer::FromMetadata(meta, 7, 0);
  if (!trainer.ok()) {
    fmt::print(stderr, "wsync bench: error: {}\n", trainer.status().message());
    return 1;
  }
  auto dir = MakeTempDir("bench");
  std::vector<Child> servers;
  auto fail = [&](const Status& s) {
    for (Child& c : servers) StopChild(c);
    fmt::print(stderr, "wsync bench: error: {}\n", s.ToString());
    return 1;
  };
  for (int i = 0; i < a.servers; ++i) {
    auto c = StartServer({"--model", a.model, "--tp", std::to_string(a.tp)},
                         fmt::format("{}/server{}.log", *dir, i), Deadline::InSeconds(120));
    if (!c.ok()) return fail(c.status());
    servers.push_back(*c);
  }
  TrainerOptions o;
  for (const Child& c : servers) o.servers.push_back(c.url);
  o.bucket_gb = a.bucket_gb;
  o.inline_verify = a.inline_verify;
  auto engine = CreateTrainerEngine(o);
  if (!engine.ok()) return fail(engine.status());
  Stopwatch init_watch;
  if (Status s = (*engine)->Init(meta); !s.ok()) return fail(s);
  const double init_s = init_watch.seconds();
  // Sync 0 is reported on its own: users sync right after Init too, so it counts.
  std::vector<double> engine_times;
  std::vector<FleetUsage> later_usage;
  double first_s = 0;
  FleetUsage first_usage;
  size_t bytes = 0;
  MemoryPeak peak;  // the largest over the syncs
  for (int i = 0; i <= a.iters; ++i) {
    const FleetUsage before = FleetUsage::Now(servers);
    const MemoryWindow window;
    auto st = (*engine)->SendWeights((*trainer)->source(), std::nullopt);
    if (!st.ok()) return fail(st.status());
    peak.Include(window.Peak());
    const FleetUsage used = FleetUsage::Now(servers) - before;
    bytes = st->bytes;
    if (i == 0) {
      first_s = st->seconds;
      first_usage = used;
    } else {
      engine_times.push_back(st->seconds);
      later_usage.push_back(used);
    }
  }
  (*engine)->Shutdown();
  for (Child& c : servers) StopChild(c);
  servers.clear();

  auto plan = PlanChunks(meta, PackedBufferSize(meta, static_cast<size_t>(a.bucket_gb * (1u << 30))));
  std::vector<size_t> chunks;
  for (const Chunk& c : plan->chunks) chunks.push_back(c.bytes);
  int receivers = a.servers * a.tp;
  double engine_s = Median(engine_times);
  fmt::print("wsync bench broadcast: {} ({:.3f} GB), {} server(s) x TP={} ({} receiving ranks), "
             "{} chunk(s), median of {} syncs after sync 0\n",
             config->name, bytes / 1e9, a.servers, a.tp, receivers, chunks.size(), a.iters);
  fmt::print("{:<44} {:>9} {:>8} {:>12}\n", "what", "seconds", "GB/s", "engine/this");
  fmt::print("{:<44} {:>9.3f} {:>8.3f} {:>12}\n", "wsync sync (start..finish, HTTP + Gloo)", engine_s,
             bytes / engine_s / 1e9, "1.00");
  fmt::print("{:<44} {:>9.3f} {:>8.3f} {:>12}\n", "wsync sync 0, the first after Init", first_s,
             bytes / first_s / 1e9, fmt::format("{:.2f}x", first_s / engine_s));
  fmt::print("{:<44} {:>9.3f} {:>8} {:>12}\n", "wsync Init (group, staging buffers)", init_s, "-", "-");
  fmt::print("trainer memory: RSS {:.1f} MB for a {:.1f} MB model; peak extra per sync: host {:.1f} MB, "
             "device {:.1f} MB\n",
             HostRssBytes() / 1e6, bytes / 1e6, peak.host_bytes / 1e6, peak.device_bytes / 1e6);
  auto median_of = [&](auto field) {
    std::vector<double> v;
    for (const FleetUsage& u : later_usage) v.push_back(field(u));
    return Median(v);
  };
  for (const auto& entry : {std::pair{"trainer", &FleetUsage::trainer}, std::pair{"servers", &FleetUsage::servers}}) {
    const char* who = entry.first;
    Usage FleetUsage::*part = entry.second;  // a plain variable: lambdas capture it
    fmt::print("{}, sync 0 / later syncs (median): {:.0f} / {:.0f} minor page faults, {:.2f} / {:.2f} CPU seconds\n",
               who, (first_usage.*part).minor_faults,
               median_of([&](const FleetUsage& u) { return (u.*part).minor_faults; }),
               (first_usage.*part).cpu_seconds,
               median_of([&](const FleetUsage& u) { return (u.*part).cpu_seconds; }));
  }
  for (std::string alg : {"gloo", "chain"}) {
    auto raw = RawBroadcast(alg, receivers, chunks, a.iters);
    if (!raw.ok()) return fail(raw.status());
    double raw_s = Median(*raw);
    std::string label = alg == "gloo" ? "raw gloo::broadcast, same chunks (baseline)"
                                      : "raw chained Gloo send/recv, same chunks";
    fmt::print("{:<44} {:>9.3f} {:>8.3f} {:>11.1f}%\n", label, raw_s, bytes / raw_s / 1e9,
               100 * raw_s / engine_s);
  }
  return 0;
}

}  // namespace wsync::cli
