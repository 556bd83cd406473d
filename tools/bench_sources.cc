// `wsync bench sources`: export throughput and per-rank peak memory of the trainer-rank
// sources (src/sources) for one Megatron layout and for FSDP over the same rank count.
//
// Every rank is its own process (this binary, re-run with a hidden --sources-child), so
// its peak resident memory is its own: each child generates the full synthetic model,
// lays out its shards, frees the full model, resets its peak-RSS counter
// (/proc/self/clear_refs), then times `iters` full passes (every rank drains the whole
// model, as in a sync) and reports the peak RSS above its resident shards.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "bench.h"
#include "children.h"
#include "comm/store.h"
#include "core/process_memory.h"
#include "core/parallel.h"
#include "model/config.h"
#include "sources/trainer_ranks.h"
#include "synthetic/synthetic.h"

namespace wsync::cli {
namespace {

using nlohmann::json;

Status RunChild(const BenchArgs& args) {
  // --sources-child "rank:size:store_port:prefix:layout:out_path"
  std::vector<std::string> f;
  std::stringstream ss(args.sources_child);
  for (std::string part; std::getline(ss, part, ':');) f.push_back(part);
  if (f.size() != 6) return InvalidArgument("bad --sources-child");
  const int rank = std::stoi(f[0]), size = std::stoi(f[1]);
  WSYNC_ASSIGN_OR_RETURN(ModelConfig config, LookupModel(args.model));
  WSYNC_ASSIGN_OR_RETURN(ParallelLayout layout, ParallelLayout::Parse(f[4], size));
  std::unique_ptr<WeightSource> source;
  {
    WSYNC_ASSIGN_OR_RETURN(auto full, SyntheticTrainer::FromMetadata(HfTensors(config), 1, 1));
    TrainerGroupOptions g;
    g.store_port = std::stoi(f[2]);
    g.prefix = f[3];
    g.timeout_seconds = 600;
    WSYNC_ASSIGN_OR_RETURN(auto comm, ConnectTrainerGroup(g, layout, rank));
    WSYNC_ASSIGN_OR_RETURN(source, BuildRankSource(comm, layout, &config, full->tensors(), 600));
  }
  // The full model is gone; what stays resident is this rank's shards (and the binary).
  const int64_t rss_before = HostRssBytes();
  const MemoryWindow window;
  std::vector<double> seconds;
  size_t bytes = 0;
  for (int it = 0; it < args.iters + 1; ++it) {  // pass 0 warms up
    auto t0 = std::chrono::steady_clock::now();
    WSYNC_ASSIGN_OR_RETURN(auto stream, source->Iterate());
    TensorRef t;
    bytes = 0;
    for (;;) {
      WSYNC_ASSIGN_OR_RETURN(bool more, stream->Next(&t));
      if (!more) break;
      bytes += t.bytes.size();
    }
    if (it > 0) seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  const int64_t hwm = rss_before + window.Peak().host_bytes;
  size_t buffers = 0;
  if (auto* m = dynamic_cast<SourceMemory*>(source.get())) buffers = m->peak_buffer_bytes();
  json out = {{"rank", rank}, {"bytes", bytes}, {"seconds", seconds}, {"rss_before", rss_before},
              {"peak_rss", hwm}, {"buffers", buffers}};
  std::ofstream(f[5]) << out.dump();
  return Status::Ok();
}

struct LayoutResult {
  std::string layout;
  std::vector<json> ranks;
};

Result<LayoutResult> RunLayout(const BenchArgs& args, const std::string& layout, int ranks,
                               const std::string& dir) {
  WSYNC_ASSIGN_OR_RETURN(auto store, StoreServer::Start("127.0.0.1", 0));
  const std::string prefix = fmt::format("bench-sources-{:x}", std::random_device{}());
  std::vector<std::unique_ptr<Subprocess>> children;
  for (int r = 0; r < ranks; ++r) {
    std::string spec = fmt::format("{}:{}:{}:{}:{}:{}/{}-{}.json", r, ranks, store->port(), prefix,
                                   layout, dir, layout, r);
    SpawnOptions o;
    o.args = {"bench", "sources", "--model", args.model, "--iters", std::to_string(args.iters),
              "--sources-child", spec};
    WSYNC_ASSIGN_OR_RETURN(std::unique_ptr<Subprocess> child, Subprocess::Spawn(SelfExe(), std::move(o)));
    children.push_back(std::move(child));
  }
  LayoutResult result{layout, {}};
  bool failed = false;
  for (auto& child : children) {
    std::optional<ExitStatus> st = child->Wait(Deadline::InSeconds(1800));
    failed |= !st || !st->success();
  }
  if (failed) return Internal(fmt::format("a rank of layout {} failed (its error is above)", layout));
  for (int r = 0; r < ranks; ++r) {
    std::ifstream f(fmt::format("{}/{}-{}.json", dir, layout, r));
    result.ranks.push_back(json::parse(f));
  }
  return result;
}

}  // namespace

int RunBenchSources(const BenchArgs& args) {
  if (!args.sources_child.empty()) {
    Status s = RunChild(args);
    if (!s.ok()) fmt::print(stderr, "bench sources rank: {}\n", s.message());
    return s.ok() ? 0 : 1;
  }
  auto config = LookupModel(args.model);
  if (!config.ok()) {
    fmt::print(stderr, "{}\n", config.status().message());
    return 1;
  }
  int ranks = args.trainer_ranks, tp = 0, pp = 0, ep = 0;
  if (ranks <= 0) {
    ranks = std::sscanf(args.trainer_layout.c_str(), "tp%dpp%dep%d", &tp, &pp, &ep) == 3 ? tp * pp * ep : 4;
  }
  if (auto layout = ParallelLayout::Parse(args.trainer_layout, ranks); !layout.ok()) {
    fmt::print(stderr, "{}\n", layout.status().message());
    return 1;
  }
  auto dir = MakeTempDir("bench-sources");
  if (!dir.ok()) return 1;
  const double model_gb = ModelBytes(*config) / 1e9;
  fmt::print("model {} ({:.3f} GB bf16), {} trainer ranks as processes, {} timed passes each\n",
             config->name, model_gb, ranks, args.iters);
  fmt::print("{:>12} {:>5} {:>10} {:>9} {:>10} {:>12} {:>12} {:>11}\n", "layout", "rank",
             "export s", "GB/s", "shards MB", "peak RSS MB", "above MB", "buffers MB");
  std::vector<std::string> layouts = {args.trainer_layout};
  if (args.trainer_layout != "fsdp") layouts.push_back("fsdp");
  for (const std::string& l : layouts) {
    auto r = RunLayout(args, l, ranks, *dir);
    if (!r.ok()) {
      fmt::print(stderr, "{}\n", r.status().message());
      return 1;
    }
    for (const json& j : r->ranks) {
      std::vector<double> s = j["seconds"];
      double best = *std::min_element(s.begin(), s.end());
      int64_t before = j["rss_before"], peak = j["peak_rss"];
      size_t bytes = j["bytes"], buffers = j["buffers"];
      fmt::print("{:>12} {:>5} {:>10.3f} {:>9.2f} {:>10.0f} {:>12.0f} {:>12.0f} {:>11.0f}\n", l,
                 j["rank"].get<int>(), best, bytes / best / 1e9, before / 1e6, peak / 1e6,
                 (peak - before) / 1e6, buffers / 1e6);
    }
  }
  fmt::print("(export s: fastest full pass on that rank; GB/s: model bytes / that; shards MB: RSS\n"
             " with only the rank's shards resident; above MB: peak RSS during the passes above that)\n");
  return 0;
}

}  // namespace wsync::cli
