// `wsync bench sharded`: the `sharded` backend against the `nccl` broadcast, in one run,
// with the same trainer layout and the same fleet: real server processes
// (`wsync serve --backend B`, started from this binary) and the trainer's ranks as
// threads of this process (push_ranks.h), each backend on a fresh fleet.
//
// Per backend it prints the median whole sync (start .. finish) over --iters syncs after
// the first, the bytes each worker receives and each trainer rank sends per sync (the
// sharded plan's exact counts, from the same plan library the backend runs; the broadcast
// moves the whole model to every worker, and rank 0 alone sends it once down the chain),
// the staging the trainer keeps beside its shards (sharded: lookahead + 1 layer groups of
// packed slices per rank; broadcast: the packed ring of rank 0), and this process's
// measured peak RSS growth during the syncs (VmHWM after a reset, minus RSS before).
#include <algorithm>
#include <fstream>
#include <map>
#include <string>

#include <fmt/format.h>

#include "backends/nccl/descriptor.h"
#include "backends/sharded/descriptor.h"
#include "backends/sharded/lanes.h"
#include "bench.h"
#include "children.h"
#include "core/process_memory.h"
#include "core/stopwatch.h"
#include "model/config.h"
#include "model/sharding.h"
#include "plan/packing.h"
#include "plan/sharded_plan.h"
#include "push_ranks.h"
#include "sources/groups.h"
#include "sources/layout.h"
#include "synthetic/synthetic.h"

namespace wsync::cli {
namespace {

struct Measured {
  double sync_s = 0;       // median after the first
  double first_s = 0;
  double init_s = 0;
  size_t peak_rss_growth = 0;
  size_t bytes = 0;         // SyncStats::bytes of rank 0
};

Result<Measured> RunBackend(const BenchArgs& a, const std::string& backend, const ModelConfig& config,
                            SyntheticTrainer& trainer, const std::string& dir, const std::string& label,
                            const std::map<std::string, std::string>& options) {
  std::vector<Child> servers;
  auto stop = [&] {
    for (Child& c : servers) StopChild(c);
  };
  for (int i = 0; i < a.servers; ++i) {
    Result<Child> c = StartServer({"--backend", backend, "--model", a.model, "--tp", std::to_string(a.tp)},
                                  fmt::format("{}/{}{}.log", dir, label, i), Deadline::InSeconds(120));
    if (!c.ok()) {
      stop();
      return c.status();
    }
    servers.push_back(*c);
  }
  TrainerOptions o;
  o.backend = backend;
  o.inline_verify = a.inline_verify;
  for (const Child& c : servers) o.servers.push_back(c.url);
  o.bucket_gb = a.bucket_gb;
  o.backend_options = options;
  if (backend == ShardedBackend().name) o.backend_options[std::string(ShardedBackend().model_option)] = a.model;
  Measured m;
  Status s = [&]() -> Status {
    Stopwatch init;
    const int ranks = std::max(1, a.trainer_ranks);
    WSYNC_ASSIGN_OR_RETURN(std::unique_ptr<TrainerRanks> t,
                           TrainerRanks::Start(ranks, a.trainer_layout, &config, trainer.tensors(), o));
    m.init_s = init.seconds();
    std::vector<double> times;
    const MemoryWindow window;
    for (int i = 0; i <= a.iters; ++i) {
      WSYNC_ASSIGN_OR_RETURN(SyncStats st, t->Sync(std::nullopt));
      m.bytes = st.bytes;
      if (i == 0) {
        m.first_s = st.seconds;
      } else {
        times.push_back(st.seconds);
      }
    }
    m.peak_rss_growth = static_cast<size_t>(window.Peak().host_bytes);
    m.sync_s = Median(times);
    return Status::Ok();
  }();
  stop();
  if (!s.ok()) return s;
  return m;
}

// The sharded plan of this fleet and layout: bytes per worker, per producer, staging.
struct PlanFigures {
  std::vector<size_t> worker_bytes;
  std::vector<size_t> producer_bytes;
  std::vector<size_t> producer_group_bytes;  // the largest group's packed sends
  // Each worker's receive staging (lanes.h), its chunks in plan order or in concurrent lanes.
  std::vector<size_t> receive_staging_in_turn;
  std::vector<size_t> receive_staging_concurrent;
  std::vector<size_t> lanes;  // per worker, when concurrent
};

Result<PlanFigures> ShardedFigures(const BenchArgs& a, const ModelConfig& config, int ranks) {
  const std::vector<TensorMeta> meta = HfTensors(config);
  std::vector<std::string> names;
  for (const TensorMeta& m : meta) names.push_back(m.name);
  WSYNC_ASSIGN_OR_RETURN(ParallelLayout layout, ParallelLayout::Parse(a.trainer_layout, ranks));
  std::vector<std::vector<bool>> held(ranks, std::vector<bool>(names.size(), true));
  if (!layout.fsdp) {
    WSYNC_ASSIGN_OR_RETURN(MegatronLayout megatron, MegatronLayout::Build(config, layout));
    for (int r = 0; r < ranks; ++r) {
      std::vector<std::string> mine = megatron.HeldNames(r);
      std::fill(held[r].begin(), held[r].end(), false);
      for (size_t i = 0; i < names.size(); ++i) {
        held[r][i] = std::find(mine.begin(), mine.end(), names[i]) != mine.end();
      }
    }
  }
  ShardedStream stream;
  stream.tensors = meta;
  WSYNC_ASSIGN_OR_RETURN(stream.ownership, ResolveOwnership(names, held));
  WSYNC_ASSIGN_OR_RETURN(std::vector<LayerGroup> groups, LayerGroups(names));
  for (const LayerGroup& g : groups) stream.group_lens.push_back(static_cast<int>(g.size()));
  stream.num_producers = ranks;
  std::vector<ConsumerPlan> plans;
  std::map<int, ShardingTable> tables;
  for (int s = 0; s < a.servers; ++s) {
    for (int j = 0; j < a.tp; ++j) {
      if (!tables.count(j)) {
        WSYNC_ASSIGN_OR_RETURN(ShardingTable t, ShardingTable::Build(config, j, a.tp));
        tables.emplace(j, std::move(t));
      }
      WSYNC_ASSIGN_OR_RETURN(ConsumerPlan p, PlanConsumer(stream, tables.at(j), {s * a.tp + j, j, a.tp}));
      plans.push_back(std::move(p));
    }
  }
  PlanFigures f;
  const int ring = TrainerOptions{}.num_buffers;
  for (const ConsumerPlan& p : plans) {
    f.worker_bytes.push_back(p.bytes());
    f.receive_staging_in_turn.push_back(ReceiveStagingBytes(SplitLanes(p, false), ring));
    const std::vector<ReceiveLane> lanes =
        SplitLanesWithin(p, ring, static_cast<size_t>(std::max(0, a.receive_staging_mb)) * 1000000);
    f.receive_staging_concurrent.push_back(ReceiveStagingBytes(lanes, ring));
    f.lanes.push_back(lanes.size());
  }
  for (int r = 0; r < ranks; ++r) {
    ProducerPlan pp = PlanProducer(r, static_cast<int>(groups.size()), plans);
    f.producer_bytes.push_back(pp.bytes_sent);
    f.producer_group_bytes.push_back(pp.max_group_bytes);
  }
  return f;
}

std::string MinMax(const std::vector<size_t>& v) {
  if (v.empty()) return "-";
  auto [lo, hi] = std::minmax_element(v.begin(), v.end());
  return *lo == *hi ? fmt::format("{:.1f}", *lo / 1e6) : fmt::format("{:.1f}..{:.1f}", *lo / 1e6, *hi / 1e6);
}

}  // namespace

int RunBenchSharded(const BenchArgs& a) {
  auto fail = [](const Status& s) {
    fmt::print(stderr, "wsync bench sharded: error: {}\n", s.ToString());
    return 1;
  };
  Result<ModelConfig> config = LookupModel(a.model);
  if (!config.ok()) return fail(config.status());
  const int ranks = a.trainer_ranks > 0 ? a.trainer_ranks : 4;
  BenchArgs args = a;
  args.trainer_ranks = ranks;
  Result<std::unique_ptr<SyntheticTrainer>> trainer = SyntheticTrainer::FromMetadata(HfTensors(*config), 7, 0);
  if (!trainer.ok()) return fail(trainer.status());
  Result<std::string> dir = MakeTempDir("bench-sharded");
  if (!dir.ok()) return fail(dir.status());
  Result<PlanFigures> figures = ShardedFigures(args, *config, ranks);
  if (!figures.ok()) return fail(figures.status());

  // What runs, each on a fresh fleet: the broadcast baseline, then sharded in each
  // stage mode asked for.
  struct Run {
    std::string label;    // in the table and the servers' log names
    std::string backend;
    std::map<std::string, std::string> options;
    bool concurrent = false;
  };
  const std::string broadcast(NcclBackend().name);
  const std::string sharded(ShardedBackend().name);
  std::vector<Run> runs;
  if (a.baseline) runs.push_back({broadcast, broadcast, {}, false});
  if (a.concurrent_stages != "on") runs.push_back({sharded + "-turns", sharded, {{"concurrent_stages", "off"}}, false});
  if (a.concurrent_stages != "off") {
    runs.push_back({sharded + "-conc", sharded,
                    {{"concurrent_stages", "on"}, {"receive_staging_mb", std::to_string(a.receive_staging_mb)}}, true});
  }
  std::map<std::string, Measured> got;
  for (const Run& run : runs) {
    fmt::print(stderr, "{}: {} servers x TP={}, {} trainer ranks ({})\n", run.label, a.servers, a.tp, ranks,
               a.trainer_layout);
    Result<Measured> m = RunBackend(args, run.backend, *config, **trainer, *dir, run.label, run.options);
    if (!m.ok()) return fail(m.status().WithContext(run.label));
    got[run.label] = *m;
  }
  const size_t model = ModelBytes(*config);
  const size_t ring = PackedBufferSize(HfTensors(*config), static_cast<size_t>(a.bucket_gb * (1u << 30)));
  const size_t broadcast_staging = kDefaultPackedNumBuffers * std::min(ring, model);  // rank 0's ring
  std::vector<size_t> sharded_staging;
  for (size_t b : figures->producer_group_bytes) sharded_staging.push_back(2 * b);  // lookahead 1: two groups
  fmt::print("wsync bench sharded: {} ({:.3f} GB), {} server(s) x TP={} ({} workers), {} trainer ranks ({}), "
             "median of {} syncs after sync 0\n",
             config->name, model / 1e9, a.servers, a.tp, a.servers * a.tp, ranks, a.trainer_layout, a.iters);
  fmt::print("{:<14} {:>9} {:>9} {:>8} {:>16} {:>18} {:>16} {:>18} {:>13}\n", "backend", "sync s", "sync 0 s",
             "init s", "MB/worker", "MB sent/rank", "staging MB/rank", "recv staging MB/w", "peak RSS +MB");
  std::vector<size_t> broadcast_sent(ranks, 0);
  broadcast_sent[0] = model;
  std::vector<size_t> broadcast_stage(ranks, 0);
  broadcast_stage[0] = broadcast_staging;
  const Measured& n = got[broadcast];
  if (a.baseline) {
    fmt::print("{:<14} {:>9.3f} {:>9.3f} {:>8.2f} {:>16.1f} {:>18} {:>16} {:>18} {:>13.1f}\n", broadcast, n.sync_s,
               n.first_s, n.init_s, model / 1e6, MinMax(broadcast_sent), MinMax(broadcast_stage), "-",
               n.peak_rss_growth / 1e6);
  }
  for (const Run& run : runs) {
    if (run.backend != sharded) continue;
    const Measured& sh = got[run.label];
    fmt::print("{:<14} {:>9.3f} {:>9.3f} {:>8.2f} {:>16} {:>18} {:>16} {:>18} {:>13.1f}\n", run.label, sh.sync_s,
               sh.first_s, sh.init_s, MinMax(figures->worker_bytes), MinMax(figures->producer_bytes),
               MinMax(sharded_staging),
               MinMax(run.concurrent ? figures->receive_staging_concurrent : figures->receive_staging_in_turn),
               sh.peak_rss_growth / 1e6);
  }
  size_t worker_max = *std::max_element(figures->worker_bytes.begin(), figures->worker_bytes.end());
  for (const Run& run : runs) {
    if (!a.baseline || run.backend != sharded) continue;
    fmt::print("{} / broadcast: sync time {:.2f}x, bytes per worker {:.2f}x (largest worker)\n", run.label,
               got[run.label].sync_s / n.sync_s, static_cast<double>(worker_max) / model);
  }
  if (got.count("sharded-turns") && got.count("sharded-conc")) {
    const auto [lo, hi] = std::minmax_element(figures->lanes.begin(), figures->lanes.end());
    fmt::print("concurrent / one stage at a time: sync time {:.2f}x ({}..{} lanes per worker)\n",
               got["sharded-conc"].sync_s / got["sharded-turns"].sync_s, *lo, *hi);
  }
  return 0;
}

}  // namespace wsync::cli
