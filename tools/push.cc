#include "push.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <set>

#include <fmt/format.h>

#include "control/session_driver.h"
#include "core/log.h"
#include "core/parallel.h"
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
void PrintHeader() {
  fmt::print("{:>5} {:>10} {:>12} {:>9} {:>8} {:>9} {:>9} {:>9} {:>9}\n", "sync", "changed", "bytes(MB)",
             "seconds", "GB/s", "chunks", "host+MB", "dev+MB", "verified");
  std::fflush(stdout);
}

void PrintRow(const SyncRow& r) {
  std::string changed = r.sync == 0 ? "initial" : fmt::format("{:.2f}%", 100 * r.changed_fraction);
  fmt::print("{:>5} {:>10} {:>12.1f} {:>9.3f} {:>8.3f} {:>9} {:>9.1f} {:>9.1f} {:>9}\n", r.sync, changed,
             r.stats.bytes / 1e6, r.stats.seconds,
             r.stats.seconds > 0 ? r.stats.bytes / r.stats.seconds / 1e9 : 0.0, r.stats.chunks,
             r.sync_memory.host_bytes / 1e6, r.sync_memory.device_bytes / 1e6, r.verified);
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

namespace {

// fn(ref, scratch) -> Result<T> for every tensor, in parallel, one scratch per thread;
// the first failure in tensor order is returned.
template <typename T, typename Fn>
Result<std::vector<T>> DigestAll(const std::vector<TensorRef>& refs, const std::vector<size_t>& which, Fn fn) {
  std::vector<T> out(refs.size());
  std::vector<Status> failed(refs.size());
  ParallelFor(which.size(), DefaultThreads(), [&](size_t b, size_t e) {
    std::vector<std::byte> scratch;
    for (size_t k = b; k < e; ++k) {
      const size_t i = which[k];
      Result<T> d = fn(refs[i], scratch);
      if (d.ok()) {
        out[i] = *std::move(d);
      } else {
        failed[i] = d.status();
      }
    }
  });
  for (Status& s : failed) WSYNC_RETURN_IF_ERROR(s);
  return out;
}

// Whether a server's checksums follow the FP8 checkpoint convention for the trainer's
// (unquantized, 2-D) tensor `m`.
bool HoldsFp8(const json& sums, const TensorMeta& m) {
  return m.shape.size() == 2 && IsFp8QuantizableDType(m.dtype) && IsFp8Quantized(m.name) &&
         sums.contains(Fp8ScaleInvName(m.name));
}

}  // namespace

Status VerifyServers(const TrainerOptions& trainer, WeightSource& source, DigestAlgorithm alg) {
  SessionDriver driver(trainer.servers, trainer.api_key, trainer.timeout_seconds);
  auto pending = driver.ChecksumsAsync(DigestAlgorithmName(alg));
  // The trainer's digests, computed while the servers compute theirs.
  const auto& meta = source.metadata();
  std::vector<TensorRef> refs;
  WSYNC_ASSIGN_OR_RETURN(auto stream, source.Iterate());
  TensorRef t;
  for (;;) {
    WSYNC_ASSIGN_OR_RETURN(bool more, stream->Next(&t));
    if (!more) break;
    refs.push_back(t);
  }
  if (refs.size() != meta.size()) return Internal("source iteration changed length");
  std::vector<size_t> every(refs.size());
  for (size_t i = 0; i < every.size(); ++i) every[i] = i;
  // Tensors on a GPU are read back in bounded blocks, one scratch per thread.
  WSYNC_ASSIGN_OR_RETURN(std::vector<std::string> mine,
                         DigestAll<std::string>(refs, every, [&](const TensorRef& r, std::vector<std::byte>& scratch) {
                           return TensorHexDigest(alg, r, scratch);
                         }));
  WSYNC_ASSIGN_OR_RETURN(std::vector<json> replies, pending->Wait(Deadline::InSeconds(trainer.timeout_seconds)));
  // Servers holding FP8 weights (serve --quantization fp8) report a quantized tensor as
  // NAME (e4m3 bytes) and NAME_scale_inv: the trainer quantizes its own tensor to match.
  std::vector<size_t> quantized;
  for (size_t i = 0; i < meta.size(); ++i) {
    if (std::ranges::any_of(replies, [&](const json& r) { return HoldsFp8(r["checksums"], meta[i]); })) {
      quantized.push_back(i);
    }
  }
  std::vector<Fp8Digests> fp8;
  if (!quantized.empty()) {
    WSYNC_ASSIGN_OR_RETURN(fp8, DigestAll<Fp8Digests>(refs, quantized,
                                                      [&](const TensorRef& r, std::vector<std::byte>& scratch) {
                                                        return Fp8TensorDigests(alg, r, scratch);
                                                      }));
  }
  for (size_t s = 0; s < replies.size(); ++s) {
    const json& sums = replies[s]["checksums"];
    // Tensors the server checks and drops (an MTP layer's on a server without a drafter).
    std::set<std::string> not_held;
    if (auto it = replies[s].find("not_held"); it != replies[s].end() && it->is_array()) {
      for (const json& n : *it) {
        if (n.is_string()) not_held.insert(n.get<std::string>());
      }
    }
    std::vector<std::string> bad;
    auto expect = [&](const std::string& name, const std::string& want) {
      if (not_held.contains(name)) return;
      auto it = sums.find(name);
      if (it == sums.end()) {
        bad.push_back(name + " (missing)");
      } else if (*it != want) {
        bad.push_back(name);
      }
    };
    for (size_t i = 0; i < meta.size(); ++i) {
      if (HoldsFp8(sums, meta[i])) {
        expect(meta[i].name, fp8[i].weight);
        expect(Fp8ScaleInvName(meta[i].name), fp8[i].scale_inv);
      } else {
        expect(meta[i].name, mine[i]);
      }
    }
    if (!bad.empty()) {
      return DataLoss(fmt::format("{}: {} of {} tensors differ from the trainer's ({}): {}{}",
                                  trainer.servers[s], bad.size(), meta.size(),
                                  DigestAlgorithmName(alg),
                                  fmt::join(bad.begin(), bad.begin() + std::min<size_t>(bad.size(), 5), ", "),
                                  bad.size() > 5 ? ", ..." : ""));
    }
  }
  return Status::Ok();
}

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
  // The sharded backend plans from the servers' model: the one the weights are of.
  if (topts.backend == "sharded" && !topts.backend_options.count("model")) {
    topts.backend_options["model"] = args.checkpoint.empty() ? args.model : args.checkpoint;
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
