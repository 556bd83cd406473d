#include "planner/published.h"

#include <chrono>
#include <cmath>
#include <regex>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "backends/delta/descriptor.h"
#include "backends/ipc/descriptor.h"
#include "backends/nccl/descriptor.h"
#include "backends/sharded/descriptor.h"

namespace wsync::planner {
namespace {

PlanOptions Options(double bucket_gib = 1.0, int lookahead = 1, bool ipc_packed = false) {
  PlanOptions o;
  o.bucket_bytes = static_cast<int64_t>(bucket_gib * (int64_t{1} << 30));
  o.lookahead = lookahead;
  o.ipc_packed = ipc_packed;
  return o;
}

// A sharded system whose pipeline stages take turns (vLLM/Ray RDT).
PlanOptions InTurn(PlanOptions o) {
  o.concurrent_stages = false;
  return o;
}

std::string Seconds(double s) {
  if (s <= 0) return "-";
  return s < 0.1 ? fmt::format("{:.1f} ms", s * 1000) : fmt::format("{:.2f} s", s);
}

std::string GB(double b) { return fmt::format("{:.1f}", b / 1e9); }

std::string Published(const PublishedCase& c) {
  if (c.published_hi > c.published_lo) return fmt::format("{}-{}", Seconds(c.published_lo), Seconds(c.published_hi));
  return Seconds(c.published_lo);
}

}  // namespace

const std::vector<PublishedCase>& PublishedCases() {
  using P = Placement;
  const BackendDescriptor *nccl = &NcclBackend(), *ipc = &IpcBackend(), *delta = &DeltaBackend(),
                          *sharded = &ShardedBackend();
  static const std::vector<PublishedCase> kCases = {
      {"rdt-qwen3-nccl", "vLLM RDT blog: NCCL broadcast baseline",
       "vLLM blog 2026-08-22 rdt-weight-transfer (perf_anchors.md row 15)", false, "qwen3-235b-a22b",
       "tp4pp2ep8:16@h100", "1x(1,16,16)@h100", P::kDisaggregated, nccl, Options(), false, 64.72, 64.72,
       "the rank-0 funnel: gathering full tensors and broadcasting them to every rank", false,
       "wsync's nccl backend: rank 0 gathers the model and broadcasts vLLM's packed 1 GiB chunks to the 16 "
       "workers. The blog's baseline path (per-tensor or packed, its bucket) is not described."},
      {"rdt-qwen3-v2", "vLLM RDT blog: sharded, local per stage (V2, not pipelined)",
       "vLLM blog 2026-08-22 (perf_anchors.md row 15)", false, "qwen3-235b-a22b", "tp4pp2ep8:16@h100",
       "1x(1,16,16)@h100", P::kDisaggregated, sharded, InTurn(Options(1.0, 0)), false, 5.61, 5.61,
       "PP stages serialized by layerwise reload; gather per stage", true,
       "wsync's sharded backend with lookahead 0 (each layer group gathered, sent and landed before the next)."},
      {"rdt-qwen3-pipelined", "vLLM RDT blog: sharded, pipelined (final)",
       "vLLM blog 2026-08-22 (perf_anchors.md row 15)", false, "qwen3-235b-a22b", "tp4pp2ep8:16@h100",
       "1x(1,16,16)@h100", P::kDisaggregated, sharded, InTurn(Options()), false, 3.49, 3.49,
       "PP stages serialized by layerwise-reload memory", true,
       "wsync's sharded backend (lookahead 1): gather, pack, wire and unpack of consecutive layer groups overlap."},
      {"rdt-kimi-k2", "vLLM RDT blog: Kimi-K2 sharded, 32 trainer nodes to 4 replicas",
       "vLLM blog 2026-08-22 (perf_anchors.md row 14)", false, "kimi-k2", "tp8pp8ep32:256@h100",
       "4x(32,1,32)@h100", P::kDisaggregated, sharded, InTurn(Options()), false, 7.53, 7.53,
       "PP stages serialized (their speed of light 1.25 s, 5 s with serialized stages)", true,
       "BF16, 7.9 TB moved in all. wsync's sharded backend; EP32 over each TP32 deployment."},
      {"ckpt-engine-qwen3", "checkpoint-engine README: Qwen3-235B-A22B broadcast, 8xH800 TP8",
       "MoonshotAI/checkpoint-engine README (perf_anchors.md row 4)", false, "qwen3-235b-a22b", "fsdp:8@h800",
       "1x(8,1,1)@h800", P::kColocated, ipc, Options(), false, 6.22, 6.22, "", true,
       "Colocated: the parameter server's shards are spread over the 8 GPUs (fsdp:8); wsync's ipc backend: each "
       "GPU's publisher gathers the whole model over NVLink and packs it for its worker. checkpoint-engine "
       "instead copies host to device and runs vLLM's load_weights, which wsync does not model. The authors "
       "name no bottleneck (the anchors' compiler estimates broadcast + reload)."},
      {"ckpt-engine-glm45-air", "checkpoint-engine README: GLM-4.5-Air broadcast, 8xH800 TP8",
       "MoonshotAI/checkpoint-engine README (perf_anchors.md row 3)", false, "glm-4.5-air", "fsdp:8@h800",
       "1x(8,1,1)@h800", P::kColocated, ipc, Options(), false, 3.47, 3.47, "", true,
       "As the Qwen3-235B row; GLM-4.5-Air's MTP layer is in the stream (the checkpoint holds it) and dropped "
       "by servers without a drafter; its copies of embed_tokens and lm_head are not sent."},
      {"ckpt-engine-dsv3-fp8", "checkpoint-engine README: DeepSeek-V3.1 FP8, 16xH20 TP16",
       "MoonshotAI/checkpoint-engine README (perf_anchors.md row 5)", false, "deepseek-v3", "fsdp:16@h20",
       "1x(16,1,1)@h20", P::kColocated, ipc, Options(), true, 10.19, 10.19, "", true,
       "One TP16 instance over two nodes: wsync's ipc plane serves one host, so wsync has no colocated "
       "backend for it."},
      {"nemo-rl-reshard", "NeMo-RL nccl_reshard: Qwen3-235B TP4xPP8xEP16 to TP8xDP16",
       "issue 19 (NeMo-RL reshard figure, 4.56-4.85 s; NVIDIA-NeMo/RL PRs #2413, #2971, #3720)", false,
       "qwen3-235b-a22b", "tp4pp8ep16:128@h100", "16x(8,1,1)@h100", P::kDisaggregated, sharded, Options(), false,
       4.56, 4.85, "", false,
       "DGX H100 (the PRs' runs). wsync's sharded backend stands in for nccl_reshard, which differs in ways its "
       "sources leave open: it moves the dominant tensors shard to shard (95% of the bytes for Qwen3-30B) and the "
       "rest by a packed broadcast; it runs one reshard lane per pipeline stage (PR #3720), and whether the 8 "
       "lanes send at once is not stated. wsync's plan has them send at once, as its sharded backend's lanes do "
       "(the figure below); taking turns, the same per-rank bytes would take about 11.9 s. The figure is from "
       "the Python fallback path "
       "(xferdtensor_python_impl)."},
      // wsync's own runs (docs/benchmarks.md).
      {"own-cpu-broadcast-tp1", "wsync bench broadcast, 2 servers x TP=1 (CPU, Gloo), 2-core VM",
       "docs/benchmarks.md 'Own CPU runs re-measured on a quiet VM'", true, "qwen3-0.6b", "fsdp:1@vm2",
       "2x(1,1,1)@vm2", P::kPacked, nccl, Options(), false, 0.874, 0.874, "", true,
       "A prediction: the VM's one-thread memcpy and the loopback hop's CPU cost (the mean of this run's and the "
       "TP=2 run's raw Gloo chains) enter; the engine's pack, unpack and overlap are the model's."},
      {"own-cpu-broadcast-tp2", "wsync bench broadcast, 2 servers x TP=2 (CPU, Gloo), 2-core VM",
       "docs/benchmarks.md 'Own CPU runs re-measured on a quiet VM'", true, "qwen3-0.6b", "fsdp:1@vm2",
       "2x(2,1,1)@vm2", P::kPacked, nccl, Options(), false, 1.301, 1.301, "", true, "A prediction, as above."},
      {"own-cpu-broadcast-host-tp1", "wsync bench broadcast, 2 servers x TP=1 (CPU, Gloo), 16-core H200 host",
       "docs/benchmarks.md 'Planner inputs on the H200 host and the VM'", true, "qwen3-0.6b",
       "fsdp:1@nvidia-h200-host", "2x(1,1,1)@nvidia-h200-host", P::kPacked, nccl, Options(), false, 0.422, 0.422,
       "", true,
       "Partly calibrated: the raw Gloo chains of this run and the TP=2 run set the chain's streaming rate; the "
       "engine's overhead over them (packing the first tensor before the wire starts) is the model's."},
      {"own-cpu-broadcast-host-tp2", "wsync bench broadcast, 2 servers x TP=2 (CPU, Gloo), 16-core H200 host",
       "docs/benchmarks.md 'Planner inputs on the H200 host and the VM'", true, "qwen3-0.6b",
       "fsdp:1@nvidia-h200-host", "2x(2,1,1)@nvidia-h200-host", P::kPacked, nccl, Options(), false, 0.516, 0.516,
       "", true, "Partly calibrated, as above."},
      {"own-cpu-ipc", "wsync bench ipc, TP=1, 1 GiB slots (CPU), 2-core VM",
       "docs/benchmarks.md 'Own CPU runs re-measured on a quiet VM'", true, "qwen3-0.6b", "fsdp:1@vm2",
       "1x(1,1,1)@vm2", P::kColocated, ipc, Options(), false, 0.287, 0.287, "", true,
       "A prediction from the VM's one-thread memcpy alone: the slot ring's chunk pipeline (1.074 + 0.118 GB)."},
      {"own-cpu-ipc-quarter", "wsync bench ipc, TP=1, 0.25 GiB slots (CPU), 2-core VM",
       "docs/benchmarks.md 'Own CPU runs re-measured on a quiet VM'", true, "qwen3-0.6b", "fsdp:1@vm2",
       "1x(1,1,1)@vm2", P::kColocated, ipc, Options(0.25), false, 0.203, 0.203, "", true,
       "A prediction, as above, with smaller slots: the pack of one chunk runs beside the copy-out of the one "
       "before."},
      {"own-cpu-ipc-host", "wsync bench ipc, TP=1, 1 GiB slots (CPU), 16-core H200 host",
       "docs/benchmarks.md 'Planner inputs on the H200 host and the VM'", true, "qwen3-0.6b",
       "fsdp:1@nvidia-h200-host", "1x(1,1,1)@nvidia-h200-host", P::kColocated, ipc, Options(), false, 0.359,
       0.368, "", true, "A prediction from the host's one-thread memcpy alone."},
      {"own-cpu-ipc-host-quarter", "wsync bench ipc, TP=1, 0.25 GiB slots (CPU), 16-core H200 host",
       "docs/benchmarks.md 'Planner inputs on the H200 host and the VM'", true, "qwen3-0.6b",
       "fsdp:1@nvidia-h200-host", "1x(1,1,1)@nvidia-h200-host", P::kColocated, ipc, Options(0.25), false, 0.238,
       0.238, "", true, "A prediction, as above."},
      {"own-gpu-nccl", "wsync push/serve nccl, qwen3-8b, 2x H200", "docs/benchmarks.md 'broadcast on GPUs', session 3",
       true, "qwen3-8b", "fsdp:1@nvidia-h200-x2", "1x(1,1,1)@nvidia-h200-x2", P::kPacked, nccl, Options(),
       false, 0.0522, 0.0522, "", true,
       "The calibration run itself: link efficiency, turn-around and control plane come from it, so agreement "
       "is by construction."},
      {"own-gpu-ipc-zero-copy", "wsync bench ipc zero-copy (cuMem source), qwen3-8b, 1x H200",
       "docs/benchmarks.md 'ipc', last table of session 3", true, "qwen3-8b", "fsdp:1@nvidia-h200",
       "1x(1,1,1)@nvidia-h200", P::kColocated, ipc, Options(1.155), false, 0.00884, 0.00906, "", true,
       "A prediction from the copy floor's efficiency and the packed runs' control plane."},
      {"own-gpu-ipc-packed", "wsync bench ipc packed (cuda_ipc slots), qwen3-8b, 1x H200",
       "docs/benchmarks.md 'ipc', last table of session 3", true, "qwen3-8b", "fsdp:1@nvidia-h200",
       "1x(1,1,1)@nvidia-h200", P::kColocated, ipc, Options(1.155, 1, true), false, 0.01934, 0.01943, "", true,
       "Partly calibrated: the per-chunk hand-off cost comes from the two-process probe of the same section."},
      {"own-delta-h200-host", "wsync bench delta, 2 CPU servers, 16-core H200 host",
       "docs/benchmarks.md 'Planner inputs on the H200 host and the VM'", true, "qwen3-0.6b",
       "fsdp:1@nvidia-h200-host", "2x(1,1,1)@nvidia-h200-host", P::kPacked, delta, Options(), false, 0.305,
       0.309, "", true,
       "The calibration run itself (publish, apply and reload rates), so agreement is by construction."},
      {"own-delta-vm", "wsync bench delta, 2 CPU servers, 2-core VM",
       "docs/benchmarks.md 'Own CPU runs re-measured on a quiet VM'", true, "qwen3-0.6b", "fsdp:1@vm2",
       "2x(1,1,1)@vm2", P::kPacked, delta, Options(), false, 0.59, 0.68, "", true,
       "A prediction from the H200 host's calibration: its per-core codec rates scaled by the VM's one-thread "
       "memcpy against the host's (8.0 / 5.9), on the VM's 2 cores; the reload at the VM's all-core memcpy."},
  };
  return kCases;
}

Result<std::vector<CaseResult>> RunPublishedCases(const Constants& k, const std::string& hardware_dir) {
  std::vector<CaseResult> out;
  for (const PublishedCase& c : PublishedCases()) {
    const auto start = std::chrono::steady_clock::now();
    WSYNC_ASSIGN_OR_RETURN(ModelConfig model, LookupModel(c.model));
    WSYNC_ASSIGN_OR_RETURN(Fleet fleet, BuildFleet(c.trainer, c.servers, c.placement, hardware_dir));
    auto p = Predict(TravelConfig(model, c.fp8), fleet, c.backend->name, c.options, k);
    if (!p.ok()) return Status(p.status().code(), fmt::format("case {}: {}", c.id, p.status().message()));
    CaseResult r;
    r.c = &c;
    r.prediction = std::move(*p);
    r.plan_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double s = r.prediction.seconds;
    const double ref = s < c.published_lo ? c.published_lo : (s > c.published_hi ? c.published_hi : s);
    r.error = r.prediction.applicable ? (s - ref) / ref : 0;
    out.push_back(std::move(r));
  }
  return out;
}

std::string RenderComparison(const std::vector<CaseResult>& results) {
  std::string out;
  for (bool own : {false, true}) {
    out += own ? "\n### wsync's own measured runs (goal: within 15%)\n\n"
               : "### Published results (goal: within 25% where the setup is fully described)\n\n";
    out += "| case | model | trainer | servers | backend | published | predicted | error | bottleneck (predicted) "
           "| authors' bottleneck | planned in |\n|---|---|---|---|---|---|---|---|---|---|---|\n";
    for (const CaseResult& r : results) {
      if (r.c->own != own) continue;
      const Prediction& p = r.prediction;
      std::string backend = BackendWithOptions(*r.c->backend, r.c->options);
      if (r.c->fp8) backend += ", fp8";
      out += fmt::format("| {} | {} | `{}` | `{}` {} | {} | {} | {} | {} | {} | {} | {:.2f} s |\n", r.c->id,
                         r.c->model, r.c->trainer, r.c->servers, PlacementName(r.c->placement), backend,
                         Published(*r.c), p.applicable ? Seconds(p.seconds) : "n/a",
                         p.applicable ? fmt::format("{:+.0f}%{}", 100 * r.error, r.c->fully_described ? "" : " (setup not fully described)") : "-",
                         p.applicable ? fmt::format("{} at {:.0f}%", p.bottleneck, 100 * p.utilisation) : p.not_applicable,
                         r.c->authors_bottleneck.empty() ? "not named" : r.c->authors_bottleneck, r.plan_seconds);
    }
  }
  out += "\n### Each case's assumptions\n\n";
  for (const CaseResult& r : results) {
    const Prediction& p = r.prediction;
    out += fmt::format("- **{}** ({}; {}). {}", r.c->id, r.c->title, r.c->source, r.c->notes);
    if (p.applicable) {
      out += fmt::format(" Bytes: sent per trainer rank {}-{} GB, received per worker {} GB; extra memory "
                         "trainer {} GB, worker {} GB. Model assumptions: {}.",
                         GB(p.sent_per_trainer_rank_min), GB(p.sent_per_trainer_rank_max), GB(p.received_per_worker_max),
                         GB(p.trainer_extra_bytes), GB(p.worker_extra_bytes), fmt::join(p.assumptions, "; "));
    }
    out += "\n";
  }
  return out;
}

std::string ComparisonCsv(const std::vector<CaseResult>& results) {
  std::string out = "id,own,backend,published_lo,published_hi,predicted\n";
  for (const CaseResult& r : results) {
    if (!r.prediction.applicable) continue;
    out += fmt::format("{},{},{},{},{},{}\n", r.c->id, r.c->own ? 1 : 0, r.c->backend->name,
                       r.c->published_lo, r.c->published_hi, r.prediction.seconds);
  }
  return out;
}

Result<std::string> SpliceBlock(std::string_view doc, std::string_view name, std::string_view block) {
  const std::string begin = fmt::format("<!-- BEGIN {} -->\n", name), end = fmt::format("<!-- END {} -->\n", name);
  const size_t b = doc.find(begin), e = doc.find(end);
  if (b == std::string_view::npos || e == std::string_view::npos) {
    return InvalidArgument(fmt::format("marker '{}' not found: the block goes between a line '{}' and a line '{}'",
                                       name, begin.substr(0, begin.size() - 1), end.substr(0, end.size() - 1)));
  }
  if (doc.find(begin, b + 1) != std::string_view::npos || doc.find(end, e + 1) != std::string_view::npos) {
    return InvalidArgument(fmt::format("marker '{}' appears more than once", name));
  }
  if (e < b) return InvalidArgument(fmt::format("marker '{}': END comes before BEGIN", name));
  std::string out(doc.substr(0, b + begin.size()));
  out += block;
  if (!block.empty() && block.back() != '\n') out += '\n';
  out += doc.substr(e);
  return out;
}

std::string MaskTimings(std::string_view text) {
  static const std::regex kMemory(R"(\| [0-9]+\.[0-9]+ s \| [0-9]+\.[0-9]+ s \| [0-9]+ MB \|$)",
                                  std::regex::multiline);
  static const std::regex kColumn(R"(\| [0-9]+\.[0-9]+ s \|$)", std::regex::multiline);
  static const std::regex kTotal(R"(All cases planned in [0-9]+\.[0-9]+ s\.)");
  std::string out = std::regex_replace(std::string(text), kMemory, "| (time) | (time) | (memory) |");
  out = std::regex_replace(out, kColumn, "| (time) |");
  return std::regex_replace(out, kTotal, "All cases planned in (time).");
}

}  // namespace wsync::planner
