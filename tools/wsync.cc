// The `wsync` command: serve, push, demo, bench, plan. `wsync <command> --help` for each.
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "backends/delta/descriptor.h"
#include "backends/descriptor.h"
#include "backends/ipc/descriptor.h"
#include "backends/sharded/descriptor.h"
#include "bench.h"
#include "core/env_knobs.h"
#include "core/log.h"
#ifdef WSYNC_WITH_CUDA
#include "cuda/runtime.h"
#endif
#include "demo.h"
#include "plan.h"
#include "push.h"
#include "serve.h"
#include "wsync/server.h"

namespace {

std::vector<std::string> SplitCommas(const std::vector<std::string>& in) {
  std::vector<std::string> out;
  for (const auto& item : in) {
    size_t start = 0;
    while (start <= item.size()) {
      size_t comma = item.find(',', start);
      std::string part = item.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
      if (!part.empty()) out.push_back(part);
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
  }
  return out;
}

// Leaves without running static destructors: request threads of a failed fan-out may
// still be finishing in the background.
[[noreturn]] void Exit(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(code);
}

// `--backend-option`'s help: every backend's trainer options, from their schemas.
std::string BackendOptionHelp() {
  std::vector<std::string> backends;
  for (const wsync::BackendDescriptor* b : wsync::Backends()) {
    std::vector<std::string> keys;
    for (const wsync::BackendOptionSpec& o : b->trainer_options) {
      if (!o.hidden) keys.emplace_back(o.key);
    }
    backends.push_back(fmt::format("{} {}", b->name, fmt::join(keys, ", ")));
  }
  return fmt::format("KEY=VALUE setting of the backend (repeatable): {}", fmt::join(backends, "; "));
}

// `wsync bench WHAT`: each workload by name; a backend's own benchmark bears its name.
using BenchFn = int (*)(const wsync::cli::BenchArgs&);
const std::vector<std::pair<std::string, BenchFn>>& Benches() {
  using namespace wsync::cli;
  static const std::vector<std::pair<std::string, BenchFn>> kBenches = {
      {"broadcast", RunBench},
      {std::string(wsync::DeltaBackend().name), RunBenchDelta},
      {"sources", RunBenchSources},
      {std::string(wsync::IpcBackend().name), RunBenchIpc},
      {std::string(wsync::ShardedBackend().name), RunBenchSharded},
      {"fp8", RunBenchFp8},
  };
  return kBenches;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace wsync::cli;
  // A closed peer socket is an error where it is written (HTTP clients, Gloo pairs, the
  // rendezvous store), never a SIGPIPE that ends the process.
  ::signal(SIGPIPE, SIG_IGN);
  CLI::App app{"wsync: moves freshly trained weights from RL trainers into running inference servers"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "wsync 0.1.0");

  ServeArgs serve;
  auto* s = app.add_subcommand("serve", "run a reference inference server (vLLM-compatible weight-transfer routes)");
  s->add_option("--host", serve.host, "address to bind")->capture_default_str();
  s->add_option("--port", serve.port, "port to bind; 0 picks a free one")->capture_default_str();
  s->add_option("--model", serve.model, "registered model name or a directory with a Hugging Face config.json")->capture_default_str();
  s->add_option("--tp", serve.tp, "tensor-parallel workers per replica")->capture_default_str();
  s->add_option("--dp", serve.dp, "data-parallel size of the deployment")->capture_default_str();
  s->add_option("--dp-rank", serve.dp_rank, "host only this DP rank (external load balancing); default: all")->capture_default_str();
  s->add_option("--device", serve.device, "where shards live: cpu or cuda:N")->capture_default_str();
  s->add_option("--backend", serve.backend, "weight-transfer backend: " + wsync::BackendNamesText())->capture_default_str();
  s->add_option("--api-key", serve.api_key, "require 'Authorization: Bearer KEY' on every route but /health")->envname("WSYNC_API_KEY");
  s->add_option("--timeout", serve.timeout, "seconds any wait of the server may take")->capture_default_str();
  s->add_option("--max-body-mb", serve.max_body_mb, "largest request body in MiB (413 above)")
      ->capture_default_str()->check(CLI::Range(0.0, 1048576.0));
  s->add_option("--http-header-timeout", serve.http_header_timeout,
                "seconds for a request's headers to arrive, and for an idle kept-alive connection to send its next "
                "request; the connection is cut after that, however slowly bytes trickle in")
      ->capture_default_str()->check(CLI::PositiveNumber);
  s->add_option("--http-body-timeout", serve.http_body_timeout,
                "seconds for a request's body to arrive once its headers have; the connection is cut after that")
      ->capture_default_str()->check(CLI::PositiveNumber);
  s->add_option("--http-max-connections", serve.http_max_connections,
                "open HTTP connections at most; beyond it new connections wait in the listen queue until one closes")
      ->capture_default_str()->check(CLI::Range(1, 1 << 20));
  s->add_option("--http-threads", serve.http_threads,
                "threads for the calls that last as long as generation does (/v1/completions, /pause and /sleep "
                "with mode=wait); the trainer's session calls (init, update, finish, ...) and read-only routes such "
                "as /health have threads of their own and never wait for them")
      ->capture_default_str()->check(CLI::Range(1, 4096));
  s->add_option("--session-lease", serve.session_lease,
                "seconds a weight-update session may go without a call before it expires, so that the next "
                "trainer's start succeeds after one vanished mid-session (default: --timeout; 0: never)");
  s->add_option("--allow-store-host", serve.allowed_store_hosts,
                "nccl: a rendezvous store host the server may dial besides the init request's own peer "
                "(repeatable; '*' admits any host)");
  s->add_option("--ready-file", serve.ready_file, "write the server's URL here once it listens");
  s->add_option("--base-checkpoint", serve.base_checkpoint,
                "delta: the base checkpoint directory (version 0); init_info's base_model_path is never opened");
  s->add_option("--local-checkpoint-dir", serve.local_checkpoint_dir,
                "delta: this host's mutable copy of the checkpoint, shared by its servers (default: under $TMPDIR). "
                "On tmpfs (e.g. /dev/shm/wsync) the apply stays fastest when steps are more than 30 s apart: a disk "
                "file system writes the pages back in between and the next apply re-maps them (docs/benchmarks.md)");
  s->add_option("--ipc-shm-dir", serve.ipc_shm_dir,
                "ipc: a directory (e.g. /dev/shm) whose wsync-ipc-* files of this user a trainer may name as its "
                "region; default: only the trainer's sealed memfd (/proc/PID/fd/N) is opened (docs/security.md)");
  s->add_option("--sync-root", serve.sync_root,
                "delta: the directory every sync dir a request names (init_info / fetch_weights 'sync_dir') must lie "
                "below, also after symlinks; without it no request may name one. Requests never choose the base or "
                "local checkpoint: only the two flags above do (docs/security.md)");
  s->add_option("--token-interval-ms", serve.token_interval_ms,
                "toy generation (/v1/completions): milliseconds between a request's tokens, so requests stay in "
                "flight (0: as fast as it goes)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 3600e3));
  s->add_option("--kv-cache-mib", serve.kv_cache_mib,
                "toy generation: MiB of the prefix cache's memory pool, allocated at start (0 disables prefix caching)")
      ->capture_default_str();
  serve.init_seed = wsync::InferenceServerOptions::kDefaultInitSeed;
  s->add_option("--checkpoint", serve.checkpoint,
                "a Hugging Face safetensors checkpoint directory to load at start (every tensor of the model); "
                "default: synthetic weights from --init-seed");
  s->add_option("--init-seed", serve.init_seed, "seed of the synthetic weights at start (without --checkpoint)")
      ->capture_default_str();
  s->add_option("--offload-dir", serve.offload_dir,
                "where /sleep?level=1 keeps host weights (an unlinked file per worker); default: $TMPDIR, else /tmp");
  s->add_option("--quantization", serve.quantization,
                "none, or fp8: linear weights held as float8 e4m3 with a float32 scale per 128x128 block, quantized "
                "layer by layer as each layer's tensors land (a model/tp whose shards are off the 128 grid is refused)")
      ->capture_default_str()
      ->check(CLI::IsMember({"none", "fp8"}));
  s->add_option("--speculative", serve.speculative,
                "none, or mtp: hold the model's MTP drafter, reloaded from the same sync by every backend; its "
                "embed_tokens/lm_head are the target's memory (a model without MTP layers is refused)")
      ->capture_default_str()
      ->check(CLI::IsMember({"none", "mtp"}));
  s->add_option("--max-loras", serve.max_loras,
                "LoRA adapters held at once, by name and version, synced by lora sessions (every backend); a new name "
                "beyond N is refused until /v1/unload_lora_adapter frees one; 0: none (docs/lora.md)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  s->add_option("--fault", serve.fault, "fault injection for tests: never-join (init never joins), die-mid-update (nccl: the process SIGKILLs itself after loading one chunk), corrupt-landed (the first host worker lands model.embed_tokens.weight with one bit flipped)")->check(CLI::IsMember({"never-join", "die-mid-update", "corrupt-landed"}));

  PushArgs push;
  std::vector<std::string> servers;
  auto* p = app.add_subcommand("push", "act as a trainer: sync weights to servers, optionally over synthetic RL steps");
  p->add_option("--servers", servers, "server URLs, comma-separated, deployment-major")->required();
  p->add_option("--backend", push.trainer.backend, "weight-transfer backend: " + wsync::BackendNamesText())->capture_default_str();
  auto* ckpt = p->add_option("--checkpoint", push.checkpoint, "directory of *.safetensors to sync");
  auto* model = p->add_option("--model", push.model, "registered model or config.json directory for synthetic weights");
  ckpt->excludes(model);
  p->add_option("--seed", push.seed, "seed of the synthetic weights and steps")->capture_default_str();
  p->add_option("--steps", push.steps, "synthetic RL steps to apply, syncing after each")->capture_default_str();
  p->add_option("--data-parallel-size", push.trainer.data_parallel_size, "servers per deployment")->capture_default_str();
  p->add_option("--bucket-gb", push.trainer.bucket_gb, "packed buffer size in GiB (at least the largest tensor)")->capture_default_str();
  p->add_option("--timeout", push.trainer.timeout_seconds, "seconds any wait may take")->capture_default_str();
  p->add_flag("--verify", push.verify, "read checksums back from every server and compare");
  p->add_flag("--inline-verify,!--no-inline-verify", push.trainer.inline_verify,
              "send xxh3-128 digests of what each sync read to the servers that declare in-line verification; "
              "they refuse to finish on a mismatch (default: on)");
  p->add_option("--verify-algorithm", push.verify_algorithm, "xxh3_128 or sha256")->capture_default_str();
  p->add_option("--weight-version", push.weight_version, "weight version the servers report after the last sync");
  p->add_flag("--draft-session", push.trainer.draft_session,
              "open every sync with /start_draft_weight_update (the MTP drafter's tensors only, e.g. a --checkpoint "
              "of them); the servers' target weight version stays as it is");
  p->add_option("--api-key", push.trainer.api_key, "sent as 'Authorization: Bearer KEY'")->envname("WSYNC_API_KEY");
  std::string push_device = "cpu";
  p->add_option("--device", push_device, "where the trainer's tensors live: cpu or cuda:N")->capture_default_str();
  p->add_option("--store-host", push.trainer.store_host, "literal IPv4/IPv6 address the servers use to reach the trainer's rendezvous (servers refuse names)")->capture_default_str();
  p->add_option("--threads", push.threads, "worker threads for weights and digests (0: all cores)")->capture_default_str();
  // Each backend's own settings (TrainerOptions::backend_options): the generic flag, and
  // named flags for the common ones.
  std::vector<std::string> backend_flags;
  p->add_option("--backend-option", backend_flags, BackendOptionHelp());
  // A named flag per option a backend's schema gives one (e.g. --sync-dir for sync_dir).
  std::map<std::string, std::string> named_backend_flags;
  for (const wsync::BackendDescriptor* backend : wsync::Backends()) {
    for (const wsync::BackendOptionSpec& o : backend->trainer_options) {
      if (o.flag.empty()) continue;
      std::string help = fmt::format("{}: {}", backend->name, o.help);
      if (!o.default_value.empty()) help += fmt::format(" (default {})", o.default_value);
      p->add_option(std::string(o.flag), named_backend_flags[std::string(o.key)], help);
    }
  }
  bool unpacked = false;
  p->add_flag("--unpacked", unpacked, "one broadcast per tensor instead of packed buckets");
  p->add_option("--trainer-ranks", push.trainer_ranks, "trainer ranks, run as threads; rank 0 sends (sharded: every rank sends what it holds)")->capture_default_str();
  p->add_option("--trainer-layout", push.trainer_layout, "how ranks shard the model: fsdp or tpXppYepZ[etpW] (e.g. tp2pp2ep1, tp2pp1ep2etp2)")->capture_default_str();

  DemoArgs demo;
  auto* d = app.add_subcommand("demo", "start two TP=2 servers, push a Qwen3-0.6B-shaped model and 3 RL steps, verify each sync");
  d->add_option("--model", demo.model)->capture_default_str();
  d->add_option("--servers", demo.servers)->capture_default_str();
  d->add_option("--tp", demo.tp)->capture_default_str();
  d->add_option("--steps", demo.steps)->capture_default_str();

  BenchArgs bench;
  auto* b = app.add_subcommand("bench", "benchmarks that print numbers beside their baseline");
  std::vector<std::string> bench_names;
  for (const auto& [name, _] : Benches()) bench_names.push_back(name);
  b->add_option("what", bench.what,
                fmt::format("{}: a backend's name times that backend (beside the broadcast); fp8 times a "
                            "bf16 server against an fp8 one, and with and without an MTP drafter for a model "
                            "with MTP layers",
                            fmt::join(bench_names, ", ")))
      ->required()
      ->check(CLI::IsMember(bench_names));
  b->add_option("--model", bench.model)->capture_default_str();
  b->add_option("--servers", bench.servers, "number of servers (each --tp workers)")->capture_default_str();
  b->add_option("--tp", bench.tp)->capture_default_str();
  b->add_option("--iters", bench.iters, "timed syncs after sync 0 (broadcast also reports sync 0 and Init)")->capture_default_str();
  b->add_option("--bucket-gb", bench.bucket_gb)->capture_default_str();
  b->add_option("--steps", bench.steps, "delta: synthetic steps to publish and apply")->capture_default_str();
  b->add_flag("--write-back", bench.write_back,
              "delta: write the servers' local checkpoint back to disk before each step, as the kernel does when "
              "steps are more than ~30 s apart (otherwise steps follow each other within seconds)");
  b->add_option("--borrow-source", bench.borrow_source,
                "delta: read the source's tensors in place (on, what a host source gets) or stage a copy of each "
                "(off, what a source of temporaries gets)")
      ->capture_default_str();
  b->add_option("--device", bench.device, "ipc: cpu, or cuda:N (trainer and one TP=1 server on that GPU); fp8: where the servers' shards live")
      ->capture_default_str();
  b->add_option("--trainer-layout", bench.trainer_layout, "sources: Megatron layout compared with fsdp; sharded: the trainer's layout (fsdp, tpXppYepZ)")->capture_default_str();
  b->add_option("--trainer-ranks", bench.trainer_ranks, "sources and sharded: trainer ranks (0: sources tp*pp*ep, sharded 4)")->capture_default_str();
  b->add_option("--inline-verify", bench.inline_verify, "broadcast, ipc, delta, sharded: in-line verification of every sync (on or off)")
      ->capture_default_str();
  b->add_option("--concurrent-stages", bench.concurrent_stages,
                "sharded: receive from every pipeline stage at once (on), stage after stage (off), or time both "
                "in this run (both)")
      ->check(CLI::IsMember({"on", "off", "both"}))
      ->capture_default_str();
  b->add_option("--receive-staging-mb", bench.receive_staging_mb,
                "sharded: bound on each worker's receive staging with concurrent stages, in MB (0: none)")
      ->capture_default_str();
  b->add_option("--baseline", bench.baseline, "sharded: also time the nccl broadcast (on or off)")
      ->capture_default_str();
  b->add_option("--sources-child", bench.sources_child)->group("");  // hidden: one rank of `bench sources`

  wsync::cli::AddPlanCommand(app);
  BenchRankArgs rank;
  auto* env = app.add_subcommand("env", "list the WSYNC_* environment variables wsync reads, and their values");
  auto* br = app.add_subcommand("bench-rank", "")->group("");  // hidden: a rank of `bench`
  br->add_option("--store-host", rank.store_host);
  br->add_option("--store-port", rank.store_port)->required();
  br->add_option("--prefix", rank.prefix)->required();
  br->add_option("--rank", rank.rank)->required();
  br->add_option("--size", rank.size)->required();
  br->add_option("--algorithm", rank.algorithm);
  br->add_option("--chunks", rank.chunks)->required();
  br->add_option("--iters", rank.iters);

  CLI11_PARSE(app, argc, argv);
#ifdef WSYNC_WITH_CUDA
  wsync::cuda::InstallDeviceRuntime();
#endif

  if (br->parsed()) Exit(RunBenchRank(rank));
  if (env->parsed()) {
    for (const wsync::EnvKnob& k : wsync::kEnvKnobs) {
      const char* v = std::getenv(std::string(k.name).c_str());
      if (v != nullptr && k.name == "WSYNC_API_KEY") v = "(set)";  // a secret: never printed
      fmt::print("{:<24} {:<10} {}{}\n", k.name, v ? v : (k.fallback.empty() ? "-" : std::string(k.fallback)),
                 k.help, v ? "" : " (unset)");
    }
    Exit(0);
  }

  if (s->parsed()) {
    wsync::log::Init("serve");
    Exit(RunServe(serve));
  }
  if (p->parsed()) {
    wsync::log::Init("push");
    push.trainer.servers = SplitCommas(servers);
    push.trainer.packed = !unpacked;
    for (const auto& [key, value] : named_backend_flags) {
      if (!value.empty()) push.trainer.backend_options[key] = value;
    }
    for (const std::string& kv : backend_flags) {
      size_t eq = kv.find('=');
      if (eq == std::string::npos || eq == 0) {
        fmt::print(stderr, "wsync push: error: --backend-option {}: expected KEY=VALUE\n", kv);
        Exit(2);
      }
      push.trainer.backend_options[kv.substr(0, eq)] = kv.substr(eq + 1);
    }
    auto device = wsync::Device::Parse(push_device);
    if (!device.ok()) {
      fmt::print(stderr, "wsync push: error: {}\n", device.status().message());
      Exit(2);
    }
    push.trainer.device = *device;
    auto rows = RunPush(push);
    if (!rows.ok()) {
      fmt::print(stderr, "wsync push: error: {}\n", rows.status().message());
      Exit(1);
    }
    Exit(0);
  }
  if (d->parsed()) {
    wsync::log::Init("demo");
    Exit(RunDemo(demo));
  }
  if (b->parsed()) {
    wsync::log::Init("bench");
    for (const auto& [name, run] : Benches()) {
      if (bench.what == name) Exit(run(bench));
    }
  }
  return 0;
}
