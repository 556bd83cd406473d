#include "backends/ipc/cost.h"

#include <algorithm>

#include <fmt/format.h>

#include "plan/packing.h"

namespace wsync {
namespace {

using namespace planner;

void Predict(const PreparedModel& m, const ModelConfig& travel, const Fleet& f, const PlanOptions& o,
             const Constants& k, Prediction& p) {
  if (!f.colocated()) {
    p.applicable = false;
    p.not_applicable = "ipc needs the servers colocated with the trainer (--placement colocated)";
    return;
  }
  const Rates r = RatesOf(f.trainer_hw, k);
  const double M = static_cast<double>(m.bytes);
  const int W = f.num_workers();
  for (int w = 0; w < W; ++w) {
    if (f.worker_node(w) != f.trainer_node(0)) {
      p.applicable = false;
      p.not_applicable = "colocated servers span several hosts; the ipc plane serves one host";
      return;
    }
  }
  // A slot larger than the model with its tensors' alignment holds the model whole.
  const size_t buffer = std::min<size_t>(PackedBufferSize(m.tensors(), static_cast<size_t>(o.bucket_bytes)),
                                         m.bytes + 256 * m.tensors().size());
  auto plan = CutChunks(m.tensors(), ChunkCut{ChunkCut::Rule::kCloseBeforeOverflow, buffer, 256, "the ipc slot"});
  const double chunks = plan.ok() ? plan->chunks.size() : M / buffer;
  const bool zero_copy = f.trainer.world == 1 && !r.cpu && !o.ipc_packed;
  double shard = static_cast<double>(MaxShard(m));
  p.sent_per_trainer_rank_max = p.sent_per_trainer_rank_min = zero_copy ? 0 : m.bytes;
  p.received_per_worker_max = MaxShard(m);
  p.trainer_extra_bytes = zero_copy ? 0 : 2 * static_cast<int64_t>(buffer);
  if (r.cpu) {
    // The slot ring on a CPU host: the trainer's thread packs chunk i into slot i % 2 once
    // the workers have copied chunk i - 2 out of it; each worker's thread copies its share
    // of chunk i once chunk i is packed and its copy of i - 1 is done.
    constexpr int kSlots = 2;
    const double share = M > 0 ? shard / M : 0;
    const double out_rate = std::min({r.copy, r.host_copy / W, r.copy * r.cores / W});
    std::vector<double> packed, copied;
    double slot_bytes = 0;  // the model with each tensor's alignment in its slot
    const std::vector<Chunk> one{Chunk{0, m.tensors().size(), static_cast<size_t>(m.bytes)}};
    for (const Chunk& c : plan.ok() ? plan->chunks : one) {
      const size_t i = packed.size();
      const double start = std::max(i ? packed[i - 1] : 0, i >= kSlots ? copied[i - kSlots] : 0);
      packed.push_back(start + c.bytes / r.copy);
      copied.push_back(std::max(packed[i], i ? copied[i - 1] : 0) + c.bytes * share / out_rate);
      slot_bytes += c.bytes;
    }
    AddStep(p, "pack", "one trainer thread's memcpy into the slots", M, r.raw_copy, slot_bytes / r.copy);
    AddStep(p, "unpack", "one thread per worker copying out of the slots", shard * W, r.raw_copy,
            slot_bytes * share / out_rate);
    AddStep(p, "control", "HTTP start/update/finish", 0, 0, k.cpu_control_s);
    p.seconds = copied.back() + k.cpu_control_s;
    NameBottleneck(p, {0, 1});
    p.assumptions.push_back(fmt::format("CPU host: {} chunks through a ring of {} slots, the pack of one beside the "
                                        "copy-out of the one before",
                                        packed.size(), kSlots));
    return;
  }
  Gather g;
  for (int rank = 0; rank < f.trainer.world; ++rank) {
    Gather x = GatherInto(rank, m.tensors(), m.own, travel, f);
    if (x.nvlink_bytes + x.nic_bytes > g.nvlink_bytes + g.nic_bytes) g = x;
  }
  const double gather_s = Seconds(g.nvlink_bytes, r.nvlink) + Seconds(g.nic_bytes, r.nic);
  AddStep(p, "gather", "NVLink into each publishing rank (the whole model on every GPU)",
          g.nvlink_bytes + g.nic_bytes, r.raw_nvlink, gather_s);
  if (zero_copy) {
    AddStep(p, "unpack", "HBM copy from the trainer's tensors into the shard", shard, r.raw_copy, shard / r.copy);
    AddStep(p, "control", "HTTP start/go/finish", 0, 0, k.ipc_control_s);
    p.seconds = k.ipc_control_s + std::max(gather_s, shard / r.copy);
    NameBottleneck(p, {0, 1});
    p.assumptions.push_back("zero-copy: the one trainer rank offers its tensors in one exported block");
    return;
  }
  const double pack_unpack = (M + shard) / r.copy;
  AddStep(p, "pack", "HBM copy into the slots on every GPU", M, r.raw_copy, M / r.copy);
  AddStep(p, "unpack", "HBM copy out of the slots (time-sliced with the pack on one GPU)", shard, r.raw_copy, shard / r.copy);
  const double switches = chunks * k.ipc_switch_per_chunk_s;
  AddStep(p, "control", fmt::format("HTTP calls and {} two-process hand-offs", chunks), 0, 0, k.ipc_control_s + switches);
  p.seconds = k.ipc_control_s + switches + std::max(gather_s, pack_unpack);
  NameBottleneck(p, {0, 1, 2});
  if (pack_unpack > gather_s) {
    p.bottleneck = "pack + unpack (HBM copies of the trainer and the worker, time-sliced on one GPU)";
    p.utilisation = 2 * (M + shard) / p.seconds / (r.raw_copy * 2 * kGB);
  }
  p.assumptions.push_back("packed: every GPU's lowest trainer rank packs the whole model for its colocated worker");
}

}  // namespace

Status PredictIpcCost(const CostInput& input, Prediction& p) {
  Predict(input.model, input.travel, input.fleet, input.options, input.k, p);
  return Status::Ok();
}

std::string DescribeIpcCostOptions(const PlanOptions& options) { return options.ipc_packed ? "packed" : ""; }

}  // namespace wsync
