// `wsync demo`: two TP=2 qwen3-0.6b servers as child processes, a trainer pushing the
// starting weights and 3 synthetic RL steps to both, every sync verified bit-exactly.
#include "demo.h"

#include <algorithm>
#include <cstdio>
#include <vector>

#include <fmt/format.h>

#include "backends/nccl/descriptor.h"
#include "children.h"
#include "push.h"

namespace wsync::cli {

int RunDemo(const DemoArgs& a) {
  auto dir = MakeTempDir("demo");
  if (!dir.ok()) {
    fmt::print(stderr, "wsync demo: error: {}\n", dir.status().message());
    return 1;
  }
  std::vector<Child> servers;
  auto stop_all = [&] {
    for (Child& c : servers) StopChild(c);
  };
  fmt::print(stderr, "starting {} servers ({} TP={}) on free loopback ports; logs in {}\n",
             a.servers, a.model, a.tp, *dir);
  for (int i = 0; i < a.servers; ++i) {
    auto c = StartServer({"--model", a.model, "--tp", std::to_string(a.tp), "--backend", std::string(NcclBackend().name)},
                         fmt::format("{}/server{}.log", *dir, i), Deadline::InSeconds(120));
    if (!c.ok()) {
      stop_all();
      fmt::print(stderr, "wsync demo: error: {}\n", c.status().message());
      return 1;
    }
    fmt::print(stderr, "  server {} at {}\n", i, c->url);
    servers.push_back(*c);
  }
  PushArgs p;
  for (const Child& c : servers) p.trainer.servers.push_back(c.url);
  p.trainer.backend = NcclBackend().name;
  p.trainer.timeout_seconds = a.timeout;
  p.model = a.model;
  p.seed = a.seed;
  p.steps = a.steps;
  p.verify = true;
  p.weight_version = fmt::format("demo-step-{}", a.steps);
  auto rows = RunPush(p);
  fmt::print(stderr, "stopping servers\n");
  stop_all();
  if (!rows.ok()) {
    fmt::print(stderr, "wsync demo: error: {}\n", rows.status().message());
    return 1;
  }
  double total = 0;
  size_t bytes = 0;
  for (const auto& r : *rows) {
    total += r.stats.seconds;
    bytes += r.stats.bytes;
  }
  fmt::print("demo: {} syncs of {} to {} servers (TP={}), {:.2f} GB in {:.2f} s, all verified bit-exact\n",
             rows->size(), a.model, a.servers, a.tp, bytes / 1e9, total);
  if (rows->size() > 1) {
    // Sync 0 moves the same bytes as the rest and is held to the same speed.
    std::vector<double> later;
    for (size_t i = 1; i < rows->size(); ++i) later.push_back((*rows)[i].stats.seconds);
    std::ranges::sort(later);
    const double median = later[later.size() / 2];
    const double first = rows->front().stats.seconds;
    fmt::print("demo: sync 0 {:.2f} s, later syncs median {:.2f} s (sync 0 / median {:.2f})\n", first, median,
               first / median);
  }
  return 0;
}

}  // namespace wsync::cli
