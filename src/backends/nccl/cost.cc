#include "backends/nccl/cost.h"

#include <algorithm>

#include <fmt/format.h>

#include "plan/packing.h"

namespace wsync {
namespace {

using namespace planner;

// The nccl plane streams a chunk in pieces of this size (its piece_mb option's default).
constexpr double kPieceBytes = 256.0 * (1 << 20);

void Predict(const PreparedModel& m, const ModelConfig& travel, const Fleet& f, const PlanOptions& o,
             const Constants& k, Prediction& p) {
  const Rates rt = RatesOf(f.trainer_hw, k), rs = RatesOf(f.server_hw, k);
  const double M = static_cast<double>(m.bytes);
  const size_t buffer = PackedBufferSize(m.tensors(), static_cast<size_t>(o.bucket_bytes));
  const auto plan = PlanChunks(m.tensors(), buffer);
  const double chunks = plan.ok() ? plan->chunks.size() : 1;
  const int W = f.num_workers();
  p.sent_per_trainer_rank_max = m.bytes;
  p.sent_per_trainer_rank_min = f.trainer.world > 1 ? 0 : m.bytes;
  p.received_per_worker_max = m.bytes;
  p.trainer_extra_bytes = 2 * static_cast<int64_t>(buffer);
  p.worker_extra_bytes = 2 * static_cast<int64_t>(buffer);
  p.assumptions.push_back("trainer rank 0 alone sends; it first receives what it does not hold (other ranks drain their pass)");
  if (rt.cpu && rs.cpu) {
    // One host, a Gloo chain over loopback: trainer rank 0 packs each tensor into the
    // buffer and the chain forwards it in pieces while the next is packed; every worker
    // copies its shard out as pieces land. The sync is the larger of the host's CPU work
    // spread over its cores and the chain's streaming time.
    double unpack = 0;
    for (int w = 0; w < W; ++w) unpack += static_cast<double>(ShardOf(m, f, w));
    const double hop_bytes = M * W;  // each of the W hops carries the model once
    const double copy_core_s = (M + unpack) / rt.copy;
    const double hop_core_s = hop_bytes / kGB * k.loopback_hop_core_s_per_gb;
    const double cpu_s = (copy_core_s + hop_core_s) / rt.cores;
    const double first = m.tensors().empty() ? 0 : static_cast<double>(m.tensors().front().nbytes());
    const double chain_s = M / kGB * (k.loopback_chain_s_per_gb + k.loopback_chain_hop_s_per_gb * W);
    const double stream_s = first / rt.copy + chain_s;
    AddStep(p, "pack", "one trainer thread's memcpy into the buffer", M, rt.raw_copy, M / rt.copy);
    AddStep(p, "wire", fmt::format("loopback chain through {} workers ({:.2f} core-s of sends and receives)", W, hop_core_s),
            hop_bytes, 0, stream_s);
    AddStep(p, "unpack", "memcpy into the shards, one thread per worker", unpack, rt.raw_copy, unpack / rt.copy / W);
    AddStep(p, "control", "HTTP start/update/finish", 0, 0, k.cpu_control_s);
    p.seconds = std::max(cpu_s, stream_s) + k.cpu_control_s;
    if (cpu_s >= stream_s) {
      p.bottleneck = fmt::format("host CPU ({} cores: copies {:.2f} core-s, loopback sends and receives {:.2f} core-s)",
                                 rt.cores, copy_core_s, hop_core_s);
      p.utilisation = cpu_s / p.seconds;
    } else {
      p.bottleneck = fmt::format("loopback chain's streaming through {} hops", W);
      p.utilisation = stream_s / p.seconds;
    }
    p.assumptions.push_back("CPU-only host: every copy and every hop's send and receive share the host's cores; "
                            "the chain streams at the calibrated loopback rate when cores are free");
    return;
  }
  p.assumptions.push_back(fmt::format("{} chunks of vLLM's packed cut at {} bytes, each completed before the next (calibrated turn-around)",
                                      chunks, buffer));
  const Gather g = GatherInto(0, m.tensors(), m.own, travel, f);
  bool all_local = true;
  for (int w = 0; w < W; ++w) all_local = all_local && f.worker_node(w) == f.trainer_node(0);
  if (!all_local && (rt.nic <= 0 || rs.nic <= 0)) {
    p.applicable = false;
    p.not_applicable = "servers on other nodes, but a profile has no NIC";
    return;
  }
  const double wire_rate = all_local ? rt.nvlink : std::min(rt.nic, rs.nic);
  const double wire_raw = all_local ? rt.raw_nvlink : std::min(rt.raw_nic, rs.raw_nic);
  const double gather_s = Seconds(g.nvlink_bytes, rt.nvlink) + Seconds(g.nic_bytes, rt.nic);
  AddStep(p, "gather", "NVLink and NIC into trainer rank 0", g.nvlink_bytes + g.nic_bytes,
          g.nic_bytes > 0 ? rt.raw_nic : rt.raw_nvlink, gather_s);
  AddStep(p, "pack", "HBM copy on trainer rank 0", M, rt.raw_copy, M / rt.copy);
  AddStep(p, "wire", all_local ? "NVLink ring from trainer rank 0" : "NIC of trainer rank 0 (the ring's slowest hop)",
          M, wire_raw, M / wire_rate);
  const double shard = static_cast<double>(MaxShard(m));
  AddStep(p, "unpack", "HBM copy on each worker", shard, rs.raw_copy, shard / rs.copy);
  const double control = k.gpu_control_s + chunks * k.nccl_chunk_turnaround_s;
  const double fill = 2 * std::min(kPieceBytes, M) / rt.copy;
  AddStep(p, "control", fmt::format("HTTP calls and {} chunk turn-arounds", chunks), 0, 0, control + fill);
  p.seconds = control + fill + std::max({gather_s, M / rt.copy, M / wire_rate, shard / rs.copy});
  NameBottleneck(p, {0, 1, 2, 3});
  if (!all_local) p.assumptions.push_back("the broadcast ring leaves trainer rank 0 through its one NIC");
}

}  // namespace

Status PredictNcclCost(const CostInput& input, Prediction& p) {
  Predict(input.model, input.travel, input.fleet, input.options, input.k, p);
  return Status::Ok();
}

}  // namespace wsync
