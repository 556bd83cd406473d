#pragma once

#include <string>
#include <vector>

namespace wsync::cli {

struct BenchArgs {
  std::string what;
  std::string model = "qwen3-0.6b";
  int servers = 2;
  int tp = 1;
  int iters = 3;
  double bucket_gb = 1.0;
  int steps = 5;
  // `bench delta`: write the local checkpoint back to disk before each step, as the
  // kernel does by itself when steps are more than ~30 s apart (vm.dirty_expire_centisecs).
  bool write_back = false;
  // `bench delta`: DeltaPublisherOptions::borrow_source_bytes (`--borrow-source on|off`):
  // the synthetic source's tensors read in place, or staged as for a source of temporaries.
  bool borrow_source = true;
  // `bench ipc`: where the trainer's tensors and the server's shards live (cpu or cuda:N).
  std::string device = "cpu";
  // `bench sources` (tools/bench_sources.cc): the Megatron layout to compare with FSDP,
  // ranks (0: tp*pp*ep, or 4 for fsdp), and the hidden spec of one rank process.
  std::string trainer_layout = "tp2pp2ep1";
  int trainer_ranks = 0;
  // broadcast, ipc, delta, sharded: TrainerOptions::inline_verify of the bench's trainer
  // (`--inline-verify on|off`), to measure what in-line verification costs.
  bool inline_verify = true;
  // sharded: ShardedTrainerOptions::concurrent_stages, "on", "off" or "both" (each timed on
  // a fresh fleet in this run).
  std::string concurrent_stages = "both";
  // sharded: ShardedTrainerOptions::receive_staging_mb of the concurrent run (0: none).
  int receive_staging_mb = 0;
  // sharded: also time the nccl broadcast on a fresh fleet (`--baseline on|off`).
  bool baseline = true;
  std::string sources_child;
};

int RunBench(const BenchArgs& args);
// `wsync bench delta` (tools/bench_delta.cc).
int RunBenchDelta(const BenchArgs& args);
// `wsync bench sources` (tools/bench_sources.cc).
int RunBenchSources(const BenchArgs& args);
int RunBenchIpc(const BenchArgs& args);  // `wsync bench ipc` (tools/bench_ipc.cc)
int RunBenchSharded(const BenchArgs& args);  // `wsync bench sharded` (tools/bench_sharded.cc)
int RunBenchFp8(const BenchArgs& args);      // `wsync bench fp8` (tools/bench_fp8.cc)

// One receiving rank of the raw-broadcast baseline (hidden `bench-rank` command).
struct BenchRankArgs {
  std::string store_host = "127.0.0.1";
  int store_port = 0;
  std::string prefix;
  int rank = 1;
  int size = 2;
  std::string algorithm = "gloo";
  std::string chunks;  // comma-separated chunk sizes in bytes
  int iters = 1;
};
int RunBenchRank(const BenchRankArgs& args);

// The median of `v` (the upper one of an even count); 0 when empty.
double Median(std::vector<double> v);

}  // namespace wsync::cli
