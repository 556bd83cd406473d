// `wsync bench delta`: the `delta` backend over synthetic RL steps, with real server
// processes (`wsync serve --backend delta`, started from this binary; all of them on this
// host, so they share one local checkpoint as the workers of one node do).
//
// Per step: the synthetic trainer takes one step, the delta trainer publishes it (all
// cores; the source's bytes read in place, or staged with --borrow-source off) and
// drives fetch -> pause -> start -> reload -> finish -> resume. A second publisher with ONE thread publishes the same step into its
// own sync directory. "GB/s" is model bytes over wall time; "/cpu" is model bytes over
// the CPU seconds the process spent (all its threads), i.e. per-core speed that stays
// meaningful on a machine shared with other work. The baseline beside it: writing the
// whole model into the sync directory, i.e. what a storage sync without deltas moves.
#include <algorithm>
#include <chrono>
#include <filesystem>

#include <fmt/format.h>

#include "backends/delta/descriptor.h"
#include "backends/delta/fs.h"
#include "backends/delta/publisher.h"
#include "backends/delta/trainer.h"
#include "bench.h"
#include "children.h"
#include "core/process_memory.h"
#include "core/log.h"
#include "core/parallel.h"
#include "core/stopwatch.h"
#include "format/safetensors.h"
#include "model/config.h"
#include "synthetic/synthetic.h"

namespace wsync::cli {
namespace {

using Clock = std::chrono::steady_clock;

struct Row {
  double changed = 0, ratio = 0, compressed_mb = 0;
  double publish_s = 0, publish_gbps = 0, publish_core_gbps = 0, one_thread_gbps = 0;
  double fetch_s = 0, fetch_gbps = 0, apply_core_gbps = 0, reload_s = 0, sync_s = 0;
};

Status Run(const BenchArgs& a, std::vector<Child>& servers) {
  WSYNC_ASSIGN_OR_RETURN(ModelConfig config, LookupModel(a.model));
  std::vector<TensorMeta> meta = HfTensors(config);
  size_t threads = DefaultThreads();
  WSYNC_ASSIGN_OR_RETURN(auto trainer, SyntheticTrainer::FromMetadata(meta, 7, threads));
  WSYNC_ASSIGN_OR_RETURN(std::string dir, MakeTempDir("bench-delta"));
  std::string base = dir + "/base", sync = dir + "/sync", sync1 = dir + "/sync-1thread";
  std::filesystem::create_directories(base);
  std::vector<TensorRef> refs;
  for (const HostTensor& t : trainer->tensors()) refs.push_back(t.ref());
  auto tb = Clock::now();
  WSYNC_RETURN_IF_ERROR(WriteSafetensors(base + "/model.safetensors", refs));
  double baseline_s = SecondsSince(tb);  // the whole model into storage, fsynced: the no-delta baseline
  uint64_t model_bytes = 0;
  for (const TensorMeta& m : meta) model_bytes += m.nbytes();

  for (int i = 0; i < a.servers; ++i) {
    WSYNC_ASSIGN_OR_RETURN(Child c, StartServer({"--model", a.model, "--tp", std::to_string(a.tp), "--backend", std::string(DeltaBackend().name),
                                                 "--base-checkpoint", base, "--local-checkpoint-dir", dir + "/local",
                                                 "--sync-root", dir},
                                                fmt::format("{}/server{}.log", dir, i), Deadline::InSeconds(120)));
    servers.push_back(c);
  }
  TrainerOptions o;
  for (const Child& c : servers) o.servers.push_back(c.url);
  o.backend = DeltaBackend().name;
  o.inline_verify = a.inline_verify;
  o.timeout_seconds = 600;
  DeltaTrainerOptions d;
  d.sync_dir = sync;
  d.base_checkpoint = base;
  d.borrow_source_bytes = a.borrow_source;
  WSYNC_ASSIGN_OR_RETURN(auto engine, NewDeltaTrainer(o, d));
  WSYNC_RETURN_IF_ERROR(engine->Init(meta));
  delta::DeltaPublisherOptions one;
  one.sync_dir = sync1;
  one.base_checkpoint = base;
  one.threads = 1;
  one.borrow_source_bytes = a.borrow_source;
  WSYNC_ASSIGN_OR_RETURN(auto single, delta::DeltaPublisher::Create(one, meta));

  fmt::print("wsync bench delta: {} ({:.3f} GB bf16), {} step(s), {} server process(es) x TP={} sharing one local "
             "checkpoint, {} core(s){}{}\n", config.name, model_bytes / 1e9, a.steps, a.servers, a.tp, threads,
             a.write_back ? "; the local checkpoint written back to disk before each step" : "",
             a.borrow_source ? "" : "; every source tensor staged (--borrow-source off)");
  fmt::print("{:>4} {:>8} {:>9} {:>7} | {:>8} {:>7} {:>8} {:>9} | {:>8} {:>7} {:>9} | {:>8} {:>7}\n", "step", "changed",
             "compr MB", "compr%", "publish", "GB/s", "GB/s/cpu", "1-thr /cpu", "fetch+ap", "GB/s", "apply/cpu",
             "reload", "sync");
  std::vector<Row> rows;
  MemoryPeak peak;  // the trainer's, the largest over the syncs
  // This process's peak RSS: VmHWM, read before each window resets it.
  int64_t process_peak = HostPeakRssBytes();
  for (int step = 1; step <= a.steps; ++step) {
    if (a.write_back && step > 1) WSYNC_RETURN_IF_ERROR(delta::WriteBackTree(dir + "/local/weights"));
    WSYNC_ASSIGN_OR_RETURN(StepStats st, trainer->Step(static_cast<uint64_t>(step)));
    const MemoryWindow window;
    WSYNC_ASSIGN_OR_RETURN(SyncStats sync_stats, engine->SendWeights(trainer->source(), std::to_string(step)));
    peak.Include(window.Peak());
    const DeltaSyncReport& rep = engine->last_report();
    WSYNC_ASSIGN_OR_RETURN(delta::PublishStats p1, single->Publish(trainer->source()));
    process_peak = std::max(process_peak, HostPeakRssBytes());
    const delta::PublishStats& p = rep.publish;
    Row r;
    r.changed = st.changed_fraction;
    r.compressed_mb = p.compressed_bytes / 1e6;
    r.ratio = double(p.compressed_bytes) / p.model_bytes;
    r.publish_s = p.seconds;
    r.publish_gbps = p.model_bytes / p.seconds / 1e9;
    r.publish_core_gbps = p.model_bytes / p.cpu_seconds / 1e9;
    r.one_thread_gbps = p1.model_bytes / p1.cpu_seconds / 1e9;
    r.fetch_s = rep.fetch_seconds;
    r.fetch_gbps = p.model_bytes / rep.fetch_seconds / 1e9;
    // CPU time of the server processes during the fetch: decompress + XOR + verify.
    double fetch_cpu = 0, apply_cpu = 0, remapped_gb = 0;
    for (const auto& reply : rep.fetch_replies) {
      fetch_cpu += reply["stats"].value("cpu_s", 0.0);
      apply_cpu += reply["stats"].value("apply_cpu_s", 0.0);
      remapped_gb += reply["stats"].value("remapped_bytes", uint64_t{0}) / 1e9;
    }
    WSYNC_LOG_INFO("bench delta: step {}: servers' CPU during the fetch {:.3f} s, {:.3f} s of it in the apply threads; "
                   "{:.3f} GB re-mapped after a write-back", step, fetch_cpu, apply_cpu, remapped_gb);
    r.apply_core_gbps = fetch_cpu > 0 ? p.model_bytes / fetch_cpu / 1e9 : 0;
    r.reload_s = rep.update_seconds;
    r.sync_s = sync_stats.seconds;
    fmt::print("{:>4} {:>7.2f}% {:>9.1f} {:>6.2f}% | {:>7.3f}s {:>7.3f} {:>8.3f} {:>10.3f} | {:>7.3f}s {:>7.3f} "
               "{:>9.3f} | {:>7.3f}s {:>6.2f}s\n", step, 100 * r.changed, r.compressed_mb, 100 * r.ratio, r.publish_s,
               r.publish_gbps, r.publish_core_gbps, r.one_thread_gbps, r.fetch_s, r.fetch_gbps, r.apply_core_gbps,
               r.reload_s, r.sync_s);
    rows.push_back(r);
  }
  auto med = [&](double Row::*f) {
    std::vector<double> v;
    for (const Row& r : rows) v.push_back(r.*f);
    return Median(v);
  };
  fmt::print("\nmedians over {} steps:\n", rows.size());
  fmt::print("  compressed payload      {:6.2f}% of model bytes            (goal <= 5%)\n", 100 * med(&Row::ratio));
  fmt::print("  publish                 {:6.3f} GB/s wall on {} thread(s); per core (CPU time) {:.3f} GB/s, one "
             "thread alone {:.3f} GB/s   (goal >= 1.5 GB/s per core)\n", med(&Row::publish_gbps), threads,
             med(&Row::publish_core_gbps), med(&Row::one_thread_gbps));
  fmt::print("  fetch + apply           {:6.3f} GB/s wall; per core (CPU time) {:.3f} GB/s   (goal >= 3 GB/s per core)\n",
             med(&Row::fetch_gbps), med(&Row::apply_core_gbps));
  fmt::print("  reload (paused)         {:6.3f} s\n", med(&Row::reload_s));
  fmt::print("  whole sync              {:6.3f} s\n", med(&Row::sync_s));
  fmt::print("  trainer memory          RSS {:.1f} MB, peak {:.1f} MB (this process: the trainer's weights and both "
             "publishers); peak extra per sync: host {:.1f} MB\n", HostRssBytes() / 1e6, process_peak / 1e6,
             peak.host_bytes / 1e6);
  fmt::print("  baseline: whole model written to the sync dir (no delta): {:.3f} s, {:.3f} GB/s; SkyRL's delta "
             "publish anchor: ~2.6 GB/s across a whole node\n", baseline_s, model_bytes / baseline_s / 1e9);
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return Status::Ok();
}

}  // namespace

int RunBenchDelta(const BenchArgs& a) {
  std::vector<Child> servers;
  Status s = Run(a, servers);
  for (Child& c : servers) StopChild(c);
  if (!s.ok()) {
    fmt::print(stderr, "wsync bench delta: error: {}\n", s.ToString());
    return 1;
  }
  return 0;
}

}  // namespace wsync::cli
