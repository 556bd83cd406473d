#include "push.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <set>

#include <fmt/format.h>

#include "backends/descriptor.h"
#include "control/session_driver.h"
#include "core/log.h"
#include "core/parallel.h"
#include "engine/verify.h"
#include "format/safetensors.h"
#include "model/config.h"
#include "model/dropped_names.h"
#include "push_ranks.h"
#include "quant/fp8_block.h"
#include "quant/fp8_digest.h"
#include "quant/fp8_sharding.h"
#include "synthetic/synthetic.h"

namespace wsync::cli {
namespace {

using nlohmann::json;

// Progress on stderr: a rewritten line on a terminal, a line per quarter otherwise.
// `sync` is read at every call, so one printer serves every sync of a run.
std::function<void(const SyncProgress&)> ProgressPrinter(std::shared_ptr<int> current) {
  bool tty = isatty(STDERR_FILENO);
  auto last_quarter = std::make_shared<int>(-1);
  auto last_sync = std::make_shared<int>(-1);
  return [tty, current, last_quarter, last_sync](const SyncProgress& p) {
    int sync = *current;
    if (sync != *last_sync) {
      *last_sync = sync;
      *last_quarter = -1;
    }
    double frac = p.bytes_total ? static_cast<double>(p.bytes_done) / p.bytes_total : 1.0;
    if (tty) {
      fmt::print(stderr, "\r  sync {}: {:.1f}/{:.1f} MB ({:.0f}%), chunk {}/{}   ", sync,
                 p.bytes_done / 1e6, p.bytes_total / 1e6, 100 * frac, p.chunks_done, p.chunks_total);
      if (p.chunks_done == p.chunks_total) fmt::print(stderr, "\n");
    } else if (int q = static_cast<int>(frac * 4); q > *last_quarter) {
      *last_quarter = q;
      fmt::print(stderr, "  sync {}: {:.1f}/{:.1f} MB ({:.0f}%)\n", sync, p.bytes_done / 1e6,
                 p.bytes_total / 1e6, 100 * frac);
    }
  };
}

// "host+MB": this process's peak RSS above its RSS when the sync began; "dev+MB": the
// same for the device memory wsync allocated (core/process_memory.h).
// "inline": in-line verification, as "servers that verified / servers: tensors each
// verified" ("off" with --no-inline-verify).
void PrintHeader() {
  fmt::print("{:>5} {:>10} {:>12} {:>9} {:>8} {:>9} {:>9} {:>9} {:>9} {:>10}\n", "sync", "changed", "bytes(MB)",
             "seconds", "GB/s", "chunks", "host+MB", "dev+MB", "verified", "inline");
  std::fflush(stdout);
}

void PrintRow(const SyncRow& r) {
  std::string changed = r.sync == 0 ? "initial" : fmt::format("{:.2f}%", 100 * r.changed_fraction);
  const SyncStats& st = r.stats;
  const size_t servers = st.inline_verified_servers + st.inline_unverified_servers;
  const std::string inline_check =
      servers == 0 ? "off" : fmt::format("{}/{}:{}", st.inline_verified_servers, servers, st.inline_verified_tensors);
  fmt::print("{:>5} {:>10} {:>12.1f} {:>9.3f} {:>8.3f} {:>9} {:>9.1f} {:>9.1f} {:>9} {:>10}\n", r.sync, changed,
             r.stats.bytes / 1e6, r.stats.seconds,
             r.stats.seconds > 0 ? r.stats.bytes / r.stats.seconds / 1e9 : 0.0, r.stats.chunks,
             r.sync_memory.host_bytes / 1e6, r.sync_memory.device_bytes / 1e6, r.verified, inline_check);
  std::fflush(stdout);
}

// The run's memory on stderr: the model's size beside the process's resident set and the
// largest extra memory any sync or verification took.
void PrintMemorySummary(const std::vector<SyncRow>& rows, const SyntheticTrainer& trainer) {
  MemoryPeak sync, verify;
  double verify_seconds = 0;
  for (const SyncRow& r : rows) {
    verify_seconds = std::max(verify_seconds, r.verify_seconds);
    sync.Include(r.sync_memory);
    verify.Include(r.verify_memory);
  }
  size_t model = 0;
  for (const TensorMeta& m : trainer.metadata()) model += m.nbytes();
  fmt::print(stderr,
             "memory: model {:.1f} MB on {}; process RSS {:.1f} MB (peak {:.1f} MB); peak extra per sync: "
             "host {:.1f} MB, device {:.1f} MB; per verification: host {:.1f} MB, at most {:.2f} s{}\n",
             model / 1e6, trainer.device().ToString(), HostRssBytes() / 1e6, HostPeakRssBytes() / 1e6,
             sync.host_bytes / 1e6, sync.device_bytes / 1e6, verify.host_bytes / 1e6, verify_seconds,
             sync.host_exact ? "" : " (the kernel refused to reset the RSS peak: host figures are upper bounds)");
}

}  // namespace


Result<std::vector<SyncRow>> RunPush(const PushArgs& args) {
  size_t threads = args.threads ? args.threads : DefaultThreads();
  WSYNC_ASSIGN_OR_RETURN(DigestAlgorithm alg, ParseDigestAlgorithm(args.verify_algorithm));
  const bool several_ranks = args.trainer_ranks > 1 || args.trainer_layout != "fsdp";
  if (several_ranks && !args.trainer.device.is_cpu()) {
    return InvalidArgument("--trainer-ranks/--trainer-layout run on cpu; drop --device or them");
  }
  std::unique_ptr<SyntheticTrainer> trainer;
  auto t0 = std::chrono::steady_clock::now();
  if (!args.checkpoint.empty()) {
    WSYNC_ASSIGN_OR_RETURN(CheckpointDir ckpt, CheckpointDir::Open(args.checkpoint));
    fmt::print(stderr, "loading checkpoint {} ({} tensors)\n", args.checkpoint, ckpt.tensors().size());
    // What every server drops (model/dropped_names.h) is not sent; the checkpoint's own
    // config.json, when it has one, says whether lm_head is tied.
    Result<ModelConfig> own = LookupModel(args.checkpoint);
    const bool tied = own.ok() && own->tie_word_embeddings;
    std::vector<std::string> dropped;
    auto skip = [&](std::string_view name) {
      std::string_view reason = DroppedNameReason(name, tied);
      if (reason.empty()) return false;
      WSYNC_LOG_DEBUG("push: not sending {} ({})", name, reason);
      dropped.emplace_back(name);
      return true;
    };
    WSYNC_ASSIGN_OR_RETURN(trainer,
                           SyntheticTrainer::FromCheckpoint(ckpt, threads, args.seed, args.trainer.device, skip));
    if (!dropped.empty()) {
      fmt::print(stderr, "  not sending {} tensor(s) the servers drop: {}{}\n", dropped.size(),
                 fmt::join(dropped.begin(), dropped.begin() + std::min<size_t>(dropped.size(), 4), ", "),
                 dropped.size() > 4 ? ", ..." : "");
    }
  } else {
    if (args.model.empty()) return InvalidArgument("give --checkpoint DIR or --model NAME");
    WSYNC_ASSIGN_OR_RETURN(ModelConfig config, LookupModel(args.model));
    fmt::print(stderr, "generating synthetic {} weights on {} ({:.2f} GB, seed {})\n", config.name,
               args.trainer.device.ToString(), ModelBytes(config) / 1e9, args.seed);
    WSYNC_ASSIGN_OR_RETURN(trainer, SyntheticTrainer::FromMetadata(HfTensors(config), args.seed, threads,
                                                                   args.trainer.device));
  }
  fmt::print(stderr, "  ready in {:.1f} s\n",
             std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());

  TrainerOptions topts = args.trainer;
  // A backend that plans from the servers' model takes the one the weights are of.
  const BackendDescriptor* descriptor = FindBackend(topts.backend);
  if (descriptor != nullptr && !descriptor->model_option.empty() &&
      !topts.backend_options.count(std::string(descriptor->model_option))) {
    topts.backend_options[std::string(descriptor->model_option)] = args.checkpoint.empty() ? args.model : args.checkpoint;
  }
  auto current_sync = std::make_shared<int>(0);
  topts.progress = ProgressPrinter(current_sync);
  // --trainer-ranks N: rank 0 sends from its shards, ranks 1..N-1 drain theirs.
  std::unique_ptr<TrainerRanks> ranks;
  if (several_ranks) {
    std::optional<ModelConfig> config;
    auto found = LookupModel(args.checkpoint.empty() ? args.model : args.checkpoint);
    if (found.ok()) config = *found;
    fmt::print(stderr, "starting {} trainer ranks, layout {}; connecting to {} server(s)\n", args.trainer_ranks,
               args.trainer_layout, topts.servers.size());
    WSYNC_ASSIGN_OR_RETURN(ranks, TrainerRanks::Start(args.trainer_ranks, args.trainer_layout,
                                                      config ? &*config : nullptr, trainer->tensors(), topts));
  }
  // --device cuda:N: the trainer's only copy of the model lives on the GPU, stepped there
  // through small host pieces; digests read it back in bounded blocks.
  WeightSource& send_source = trainer->source();
  std::unique_ptr<TrainerEngine> engine;
  if (!ranks) {
    WSYNC_ASSIGN_OR_RETURN(engine, CreateTrainerEngine(topts));
    fmt::print(stderr, "connecting to {} server(s)\n", topts.servers.size());
    WSYNC_RETURN_IF_ERROR(engine->Init(send_source).WithContext("init_weight_transfer_engine"));
  }

  std::vector<SyncRow> rows;
  PrintHeader();
  for (int step = 0; step <= args.steps; ++step) {
    SyncRow row;
    row.sync = step;
    if (step > 0) {
      WSYNC_ASSIGN_OR_RETURN(StepStats st, trainer->Step(static_cast<uint64_t>(step)));
      row.changed_fraction = st.changed_fraction;
    }
    *current_sync = step;
    std::optional<std::string> version;
    if (step == args.steps) version = args.weight_version;
    if (ranks && step > 0) WSYNC_RETURN_IF_ERROR(ranks->Refresh(trainer->tensors()));
    {
      const MemoryWindow window;
      if (ranks) {
        WSYNC_ASSIGN_OR_RETURN(row.stats, ranks->Sync(version));
      } else {
        WSYNC_ASSIGN_OR_RETURN(row.stats, engine->SendWeights(send_source, version));
      }
      row.sync_memory = window.Peak();
    }
    row.verified = "-";
    Status verified;
    if (args.verify) {
      const MemoryWindow window;
      const auto started = std::chrono::steady_clock::now();
      verified = VerifyServers(topts, trainer->source(), alg);
      row.verify_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
      row.verify_memory = window.Peak();
      row.verified = verified.ok() ? "yes" : "NO";
    }
    PrintRow(row);
    rows.push_back(row);
    if (!verified.ok()) return verified.WithContext(fmt::format("verification after sync {}", step));
  }
  PrintMemorySummary(rows, *trainer);
  return rows;
}

}  // namespace wsync::cli
