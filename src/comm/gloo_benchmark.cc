// gloo_benchmark: times Communicator::Broadcast over Gloo on this host.
//
//   gloo_benchmark --ranks 3 --mib 512 --iters 5 [--algorithm chain|binomial|gloo]
//                  [--chunk-mib 4] [--threads] [--verify]
//
// Starts a rendezvous store, then runs every rank as a separate process (default) or as
// a thread of this process (--threads). Each iteration starts together (an all-reduce
// barrier) and is timed on every rank; the reported time is the slowest rank's, and
// GB/s is bytes / that time (10^9 bytes), i.e. the rate each receiver got the data.
// `--algorithm gloo` is the raw gloo::broadcast baseline.
#include <fmt/format.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <thread>
#include <vector>

#include "comm/gloo_communicator.h"
#include "comm/store.h"
#include "comm/testing.h"
#include "core/subprocess.h"

namespace wsync {
namespace {

struct Config {
  int ranks = 2;
  size_t mib = 512;
  int iters = 5;
  std::string algorithm = "chain";
  size_t chunk_mib = 4;
  bool threads = false;
  bool verify = false;
  int port = 0;
  std::string prefix;
};

GlooBroadcastAlgorithm ParseAlgorithm(const std::string& s) {
  if (s == "binomial") return GlooBroadcastAlgorithm::kBinomial;
  if (s == "gloo") return GlooBroadcastAlgorithm::kGlooBaseline;
  return GlooBroadcastAlgorithm::kChain;
}

// One rank's part; rank 0 is the root and prints the results.
Status RunRank(const Config& cfg, int rank) {
  GlooOptions o;
  o.store_port = cfg.port;
  o.prefix = cfg.prefix;
  o.rank = rank;
  o.size = cfg.ranks;
  o.connect_deadline = Deadline::InSeconds(60);
  o.op_timeout = std::chrono::seconds(120);
  o.chunk_bytes = cfg.chunk_mib << 20;
  o.algorithm = ParseAlgorithm(cfg.algorithm);
  WSYNC_ASSIGN_OR_RETURN(auto comm, ConnectGloo(o));

  const size_t bytes = cfg.mib << 20;
  std::vector<std::byte> buf(bytes);
  if (rank == 0) testing::FillPattern(buf, 7);
  std::vector<double> seconds;
  for (int it = -1; it < cfg.iters; ++it) {  // iteration -1 warms up
    std::vector<int64_t> barrier(1);
    WSYNC_RETURN_IF_ERROR(
        comm->AllReduceSum(std::span<int64_t>(barrier), Deadline::InSeconds(120)));
    auto t0 = std::chrono::steady_clock::now();
    WSYNC_RETURN_IF_ERROR(comm->Broadcast(buf, 0, Deadline::InSeconds(600)));
    float dt = std::chrono::duration<float>(std::chrono::steady_clock::now() - t0).count();
    if (cfg.verify && rank != 0 && testing::FirstMismatch(buf, 7) >= 0) {
      return DataLoss(fmt::format("rank {}: broadcast data differs from the root's", rank));
    }
    std::vector<float> times(cfg.ranks, 0.0f);
    times[rank] = dt;
    WSYNC_RETURN_IF_ERROR(comm->AllReduceSum(std::span<float>(times), Deadline::InSeconds(120)));
    if (it >= 0) seconds.push_back(*std::max_element(times.begin(), times.end()));
  }
  if (rank == 0 && !seconds.empty()) {
    std::sort(seconds.begin(), seconds.end());
    double median = seconds[seconds.size() / 2];
    fmt::print(
        "gloo broadcast {} MiB, {} ranks ({}), algorithm {}{}: "
        "median {:.3f} s = {:.2f} GB/s per receiver, best {:.2f} GB/s{}\n",
        cfg.mib, cfg.ranks, cfg.threads ? "threads" : "processes", cfg.algorithm,
        cfg.algorithm == "gloo" ? "" : fmt::format(", chunk {} MiB", cfg.chunk_mib),
        median, bytes / median / 1e9, bytes / seconds.front() / 1e9,
        cfg.verify ? ", verified" : "");
  }
  return Status::Ok();
}

}  // namespace
}  // namespace wsync

int main(int argc, char** argv) {
  wsync::Config cfg;
  int child_rank = -1;
  CLI::App app{"Times Gloo broadcast between ranks on this host"};
  app.add_option("--ranks", cfg.ranks, "group size (root plus receivers)");
  app.add_option("--mib", cfg.mib, "bytes per broadcast, MiB");
  app.add_option("--iters", cfg.iters, "timed iterations (after one warm-up)");
  app.add_option("--algorithm", cfg.algorithm, "chain | binomial | gloo (raw gloo::broadcast)");
  app.add_option("--chunk-mib", cfg.chunk_mib, "pipelining piece size, MiB");
  app.add_flag("--threads", cfg.threads, "ranks as threads of one process");
  app.add_flag("--verify", cfg.verify, "check every received byte");
  app.add_option("--child-rank", child_rank)->group("");
  app.add_option("--port", cfg.port)->group("");
  app.add_option("--prefix", cfg.prefix)->group("");
  CLI11_PARSE(app, argc, argv);

  if (child_rank >= 0) {
    wsync::Status s = wsync::RunRank(cfg, child_rank);
    if (!s.ok()) std::fprintf(stderr, "rank %d: %s\n", child_rank, s.ToString().c_str());
    return s.ok() ? 0 : 1;
  }
  auto server = wsync::StoreServer::Start("127.0.0.1", 0);
  if (!server.ok()) {
    std::fprintf(stderr, "%s\n", server.status().ToString().c_str());
    return 1;
  }
  cfg.port = (*server)->port();
  cfg.prefix = fmt::format("bench-{}", ::getpid());
  int failures = 0;
  if (cfg.threads) {
    std::vector<std::thread> threads;
    std::vector<wsync::Status> results(cfg.ranks);
    for (int r = 0; r < cfg.ranks; ++r) {
      threads.emplace_back([&, r] { results[r] = wsync::RunRank(cfg, r); });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < cfg.ranks; ++r) {
      if (!results[r].ok()) {
        std::fprintf(stderr, "rank %d: %s\n", r, results[r].ToString().c_str());
        ++failures;
      }
    }
    return failures ? 1 : 0;
  }
  std::vector<std::unique_ptr<wsync::Subprocess>> children;
  for (int r = 0; r < cfg.ranks; ++r) {
    std::vector<std::string> args = {"--child-rank",
                                     std::to_string(r),
                                     "--port",
                                     std::to_string(cfg.port),
                                     "--prefix",
                                     cfg.prefix,
                                     "--ranks",
                                     std::to_string(cfg.ranks),
                                     "--mib",
                                     std::to_string(cfg.mib),
                                     "--iters",
                                     std::to_string(cfg.iters),
                                     "--algorithm",
                                     cfg.algorithm,
                                     "--chunk-mib",
                                     std::to_string(cfg.chunk_mib)};
    if (cfg.verify) args.push_back("--verify");
    wsync::SpawnOptions o;
    o.args = std::move(args);
    auto child = wsync::Subprocess::Spawn(wsync::SelfExe(), std::move(o));
    if (!child.ok()) {
      std::fprintf(stderr, "rank %d: %s\n", r, child.status().ToString().c_str());
      ++failures;
      continue;
    }
    children.push_back(std::move(*child));
  }
  for (auto& child : children) {
    auto st = child->Wait(wsync::Deadline::InSeconds(1800));
    if (!st || !st->success()) ++failures;
  }
  return failures ? 1 : 0;
}
