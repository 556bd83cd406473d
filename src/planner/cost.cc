#include "planner/cost.h"

#include <algorithm>
#include <map>
#include <memory>
#include <set>
#include <span>

#include <fmt/format.h>

#include "plan/packing.h"
#include "plan/sharded_plan.h"
#include "sources/groups.h"

namespace wsync::planner {
namespace {

constexpr double kGB = 1e9;
// The nccl plane streams a chunk in pieces of this size (WSYNC_NCCL_PIECE_MB's default).
constexpr double kPieceBytes = 256.0 * (1 << 20);

// Per-direction rates in bytes per second, after calibration's efficiencies.
struct Rates {
  bool cpu = false;
  int cores = 1;
  double copy = 0;         // one GPU's HBM copy; on a CPU host, one thread's memcpy
  double host_copy = 0;    // a CPU host's memcpy on all its cores at once
  double nvlink = 0;
  double nic = 0;          // per GPU (nics / gpus of the node); per host when CPU-only
  double pcie = 0;
  double raw_nvlink = 0, raw_nic = 0, raw_copy = 0, raw_host_copy = 0;  // GB/s, for utilisation
};

Rates RatesOf(const HardwareProfile& hw, const Constants& k) {
  Rates r;
  r.cpu = hw.gpus_per_node == 0;
  r.cores = hw.host_cores;
  r.raw_host_copy = std::min(hw.host_memory_gb_per_s / 2, hw.core_copy_gb_per_s * hw.host_cores);
  r.host_copy = r.raw_host_copy * kGB;
  r.raw_copy = r.cpu ? hw.core_copy_gb_per_s : hw.hbm_gb_per_s / 2;
  r.copy = r.cpu ? r.raw_copy * kGB : r.raw_copy * k.hbm_copy_efficiency * kGB;
  r.raw_nvlink = hw.nvlink_gb_per_s;
  r.nvlink = hw.nvlink_gb_per_s * k.link_efficiency * kGB;
  const double nics_per_gpu = r.cpu ? hw.nics_per_node : double(hw.nics_per_node) / hw.gpus_per_node;
  r.raw_nic = hw.nic_gb_per_s * nics_per_gpu;
  r.nic = r.raw_nic * k.link_efficiency * kGB;
  r.pcie = hw.pcie_gb_per_s * k.pcie_efficiency * kGB;
  return r;
}

// The delta codec's calibrated per-core rates hold on the calibration host; another host's
// cores run them in proportion to its one-thread memcpy (the passes stream the model
// through memory). Hosts without a measured copy rate take the calibration host's.
double CodecScale(const HardwareProfile& hw, const Constants& k) {
  return hw.core_copy_gb_per_s > 0 && k.delta_core_copy_gb_per_s > 0 ? hw.core_copy_gb_per_s / k.delta_core_copy_gb_per_s
                                                                      : 1.0;
}

int64_t ExpertIndex(std::string_view name) {
  size_t at = name.find(".mlp.experts.");
  if (at == std::string_view::npos) return -1;
  at += 13;
  size_t end = name.find('.', at);
  int64_t e = 0;
  for (size_t i = at; i < end; ++i) {
    if (name[i] < '0' || name[i] > '9') return -1;
    e = e * 10 + (name[i] - '0');
  }
  return e;
}

struct Gather {
  double nvlink_bytes = 0;
  double nic_bytes = 0;
};

// The share of a tensor that Megatron trainer rank `rank`, one of its owners, receives from
// its TP peers in the held pass (held_plan.h): none of what it holds whole (norms, its own
// experts at etp 1), the peers' part of what its TP group splits.
double HeldMissing(const TrainerSpec& t, const ModelConfig& model, int rank, const TensorMeta& m) {
  if (m.shape.size() < 2 || m.name.ends_with(".mlp.gate.weight")) return 0;  // norms, biases, routers: replicated
  const int64_t e = ExpertIndex(m.name);
  if (e < 0) return 1.0 - 1.0 / t.tp;
  const int j = rank % (t.world / t.pp);
  const int64_t per_ep = model.is_moe() ? model.num_experts / t.ep : 1;
  return e / per_ep == (j / t.etp) % t.ep ? 1.0 - 1.0 / t.etp : 1.0;
}

// What trainer rank `rank` must receive to hold every tensor whole (the nccl sender and
// the ipc publishers drain a pass of the whole model): for FSDP the other ranks' shards;
// for Megatron its TP peers' shards of what its group holds, and whole tensors it holds
// nothing of from an owner (on its node when one is there).
Gather GatherInto(int rank, const std::vector<TensorMeta>& tensors, const Ownership& own,
                  const ModelConfig& model, const Fleet& f) {
  const TrainerSpec& t = f.trainer;
  Gather g;
  if (t.world == 1) return g;
  const int node = f.trainer_node(rank);
  int same_node = 0;
  for (int r = 0; r < t.world; ++r) same_node += r != rank && f.trainer_node(r) == node;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const double b = static_cast<double>(tensors[i].nbytes());
    if (t.fsdp) {
      g.nvlink_bytes += b * same_node / t.world;
      g.nic_bytes += b * (t.world - 1 - same_node) / t.world;
      continue;
    }
    const std::vector<int>& owners = own.owner_sets[own.name_owner_class[i]];
    if (std::binary_search(owners.begin(), owners.end(), rank)) {
      g.nvlink_bytes += b * HeldMissing(t, model, rank, tensors[i]);  // from TP peers, on this node
      continue;
    }
    bool near = false;
    for (int o : owners) near = near || f.trainer_node(o) == node;
    (near ? g.nvlink_bytes : g.nic_bytes) += b;
  }
  return g;
}

double Seconds(double bytes, double rate) { return rate > 0 ? bytes / rate : 0; }

void AddStep(Prediction& p, std::string name, std::string resource, double bytes, double gb_per_s, double seconds) {
  p.steps.push_back(Step{std::move(name), std::move(resource), bytes, gb_per_s, seconds});
}

// Names the longest of the overlapped steps as the bottleneck.
void NameBottleneck(Prediction& p, const std::vector<size_t>& overlapped) {
  const Step* worst = nullptr;
  for (size_t i : overlapped) {
    if (!worst || p.steps[i].seconds > worst->seconds) worst = &p.steps[i];
  }
  if (!worst) return;
  p.bottleneck = fmt::format("{} ({})", worst->name, worst->resource);
  p.utilisation = worst->gb_per_s > 0 && p.seconds > 0 ? worst->bytes / p.seconds / (worst->gb_per_s * kGB) : 0;
}

// What every backend's prediction reads of the model on the fleet, made once.
struct Model {
  std::shared_ptr<const HfCatalog> catalog;
  const std::vector<TensorMeta>& tensors() const { return catalog->tensors(); }
  int64_t bytes = 0;
  std::vector<int64_t> shard_bytes;  // by worker index within one deployment
  Ownership own;
  // With the sharded plane: the layer groups and one deployment's consumer plans (chunk
  // sizes only, slices dropped), by worker index.
  std::vector<LayerGroup> groups;
  std::vector<ConsumerPlan> plans;
};

// Builds each worker table of one deployment once (a worker of an EP-less deployment
// shares its TP rank's table) and, with `with_plans`, plans every worker of it on the way.
Result<Model> Load(const ModelConfig& travel, const Fleet& f, bool with_plans) {
  Model m;
  WSYNC_ASSIGN_OR_RETURN(m.catalog, HfCatalog::Make(travel));
  WSYNC_RETURN_IF_ERROR(CheckFleet(*m.catalog, f));
  for (const TensorMeta& t : m.tensors()) m.bytes += static_cast<int64_t>(t.nbytes());
  WSYNC_ASSIGN_OR_RETURN(m.own, TrainerOwnership(*m.catalog, f.trainer));
  ShardedStream stream;
  StreamIndex index;
  if (with_plans) {
    std::vector<std::string> names;
    names.reserve(m.tensors().size());
    for (const TensorMeta& t : m.tensors()) names.push_back(t.name);
    WSYNC_ASSIGN_OR_RETURN(m.groups, LayerGroups(names));
    stream.tensors = m.tensors();
    for (const LayerGroup& g : m.groups) stream.group_lens.push_back(static_cast<int>(g.size()));
    stream.ownership = m.own;
    stream.num_producers = f.trainer.world;
    WSYNC_ASSIGN_OR_RETURN(index, IndexStream(stream, m.catalog));
  }
  const ServerSpec& s = f.servers;
  const int per = s.workers_per_deployment();
  // Workers sharing a table: every worker (EP), or those of one TP rank (no EP).
  const int tables = s.ep > 1 ? per : std::min(per, s.tp);
  m.shard_bytes.assign(per, 0);
  m.plans.resize(with_plans ? per : 0);
  for (int w0 = 0; w0 < tables; ++w0) {
    WSYNC_ASSIGN_OR_RETURN(ShardingTable table, WorkerTable(m.catalog, s, w0));
    for (int b = w0; b < per; b += tables) {
      m.shard_bytes[b] = table.param_bytes();
      if (!with_plans) continue;
      WSYNC_ASSIGN_OR_RETURN(m.plans[b], PlanConsumer(stream, index, table, ConsumerSpot{b, b, per}, false));
      for (PlanChunk& c : m.plans[b].chunks) c.slices.clear();  // only sizes are needed
    }
  }
  return m;
}

int64_t MaxShard(const Model& m) { return *std::max_element(m.shard_bytes.begin(), m.shard_bytes.end()); }

int64_t ShardOf(const Model& m, const Fleet& f, int w) {
  return m.shard_bytes[w % f.servers.workers_per_deployment()];
}

void PredictNccl(const Model& m, const ModelConfig& travel, const Fleet& f, const PlanOptions& o,
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

void PredictIpc(const Model& m, const ModelConfig& travel, const Fleet& f, const PlanOptions& o,
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

void PredictDelta(const Model& m, const Fleet& f, const Constants& k, Prediction& p) {
  const Rates rs = RatesOf(f.server_hw, k);
  const double M = static_cast<double>(m.bytes);
  const double payload = M * k.delta_payload_ratio;
  const double pub_rate = k.delta_publish_gb_per_core * CodecScale(f.trainer_hw, k) *
                          std::min<double>(f.trainer_hw.host_cores, k.delta_publish_cores) * kGB;
  const double apply_rate = k.delta_apply_gb_per_core * CodecScale(f.server_hw, k) *
                            std::min<double>(f.server_hw.host_cores, k.delta_apply_cores) * kGB;
  std::map<int, double> node_shards;
  for (int w = 0; w < f.num_workers(); ++w) node_shards[f.worker_node(w)] += static_cast<double>(ShardOf(m, f, w));
  bool remote = false;
  for (const auto& [node, bytes] : node_shards) remote = remote || node != f.trainer_node(0);
  const double fetch_s = remote ? Seconds(payload, rs.nic > 0 ? rs.nic / std::max(1, f.server_hw.gpus_per_node) * std::max(1, f.server_hw.nics_per_node) : 0) : 0;
  double reload_s = 0, reload_bytes = 0;
  std::string reload_on;
  if (rs.cpu) {
    for (const auto& [node, bytes] : node_shards) {
      const double s = bytes / (rs.host_copy * k.delta_reload_efficiency);
      if (s > reload_s) reload_s = s, reload_bytes = bytes;
    }
    reload_on = fmt::format("host memcpy on all {} cores", f.server_hw.host_cores);
  } else {
    reload_bytes = static_cast<double>(MaxShard(m));
    reload_s = reload_bytes / rs.pcie;
    reload_on = "PCIe host-to-device, each GPU its own link";
  }
  p.sent_per_trainer_rank_max = static_cast<int64_t>(payload);
  p.sent_per_trainer_rank_min = f.trainer.world > 1 ? 0 : p.sent_per_trainer_rank_max;
  p.received_per_worker_max = static_cast<int64_t>(payload);
  p.trainer_extra_bytes = m.bytes;  // the publisher's base copy (host memory)
  p.worker_extra_bytes = m.bytes;   // the node's local checkpoint (host memory, per node)
  AddStep(p, "pack", "publish: XOR + compress on the trainer host", M, 0, M / pub_rate);
  AddStep(p, "wire", remote ? "sync dir read over one server NIC" : "sync dir on the local file system", payload,
          remote ? rs.raw_nic : 0, fetch_s);
  AddStep(p, "unpack", "fetch + apply into each node's local checkpoint", M, 0, M / apply_rate);
  AddStep(p, "post-process", fmt::format("reload into the shards ({})", reload_on), reload_bytes,
          rs.cpu ? rs.raw_host_copy : f.server_hw.pcie_gb_per_s, reload_s);
  AddStep(p, "control", "HTTP calls", 0, 0, k.cpu_control_s);
  p.seconds = M / pub_rate + fetch_s + M / apply_rate + reload_s + k.cpu_control_s;
  const Step* worst = &p.steps[0];
  for (const Step& s : p.steps) worst = s.seconds > worst->seconds ? &s : worst;
  p.bottleneck = fmt::format("{} ({})", worst->name, worst->resource);
  p.utilisation = 0;
  p.assumptions.push_back(fmt::format("a step changes {:.2f}% of the model's bytes after compression (wsync's synthetic step)",
                                      100 * k.delta_payload_ratio));
  p.assumptions.push_back("publish, fetch + apply and reload run one after the other; every server node keeps a full local checkpoint");
}

// The sharded sync's seconds when pipeline stages send concurrently: each stage's groups
// still go in order on its own ranks (the sum of their group times), and every resource
// serves every group that uses it (its busy time summed over all groups), so the sync
// takes the longest of those chains. `group_seconds` and `group_stage` are by group; a
// stage is the set of producers that send in the group.
double StageOverlapSeconds(const std::vector<double>& group_seconds, const std::vector<std::vector<int>>& group_stage,
                           const std::map<std::string, double>& resource_busy) {
  std::map<std::vector<int>, double> chain;
  for (size_t g = 0; g < group_seconds.size(); ++g) chain[group_stage[g]] += group_seconds[g];
  double longest = 0;
  for (const auto& [stage, seconds] : chain) longest = std::max(longest, seconds);
  for (const auto& [name, seconds] : resource_busy) longest = std::max(longest, seconds);
  return longest;
}

Status PredictSharded(const Model& m, const ModelConfig& travel, const Fleet& f, const PlanOptions& o,
                      const Constants& k, Prediction& p) {
  const Rates rt = RatesOf(f.trainer_hw, k), rs = RatesOf(f.server_hw, k);
  if (rt.cpu || rs.cpu) {
    p.applicable = false;
    p.not_applicable = "sharded on CPU-only hosts (Gloo over loopback) is not modeled";
    return Status::Ok();
  }
  const std::vector<LayerGroup>& groups = m.groups;
  const std::vector<ConsumerPlan>& plans = m.plans;
  const int per = f.servers.workers_per_deployment(), replicas = f.servers.count, P = f.trainer.world;
  const size_t G = groups.size();
  // Per group: bytes each producer sends over NIC / NVLink, and each worker (of one
  // deployment) receives.
  std::vector<std::vector<double>> send_nic(G, std::vector<double>(P)), send_nvl(G, std::vector<double>(P));
  std::vector<std::vector<double>> recv(G, std::vector<double>(per));
  std::vector<double> sent_total(P);
  int64_t max_chunk = 0, max_recv = 0, max_lanes = 0;
  for (int b = 0; b < per; ++b) {
    const ConsumerPlan& plan = plans[b];
    max_recv = std::max<int64_t>(max_recv, plan.bytes());
    max_chunk = std::max<int64_t>(max_chunk, plan.max_chunk_bytes());
    for (const PlanChunk& c : plan.chunks) {
      const double bytes = static_cast<double>(c.bytes);
      recv[c.group][b] += bytes;
      for (int r = 0; r < replicas; ++r) {
        const bool near = f.trainer_node(c.producer) == f.worker_node(r * per + b);
        (near ? send_nvl : send_nic)[c.group][c.producer] += bytes;
        sent_total[c.producer] += bytes;
      }
    }
    if (o.concurrent_stages) {
      // Concurrent lanes keep a receive buffer of each producer's largest chunk.
      std::map<int, int64_t> lane;
      for (const PlanChunk& c : plan.chunks) lane[c.producer] = std::max<int64_t>(lane[c.producer], c.bytes);
      int64_t lanes = 0;
      for (const auto& [producer, bytes] : lane) lanes += bytes;
      max_lanes = std::max(max_lanes, lanes);
    }
  }
  // The trainer's staging: the largest group of distinct packed sends, lookahead + 1 deep.
  int64_t staging = 0;
  for (int producer = 0; producer < P; ++producer) {
    staging = std::max<int64_t>(staging, PlanProducer(producer, static_cast<int>(G), plans).max_group_bytes);
  }
  // Per group: the held pass's gather on each producer.
  std::vector<std::vector<double>> gather(G, std::vector<double>(P));
  {
    size_t i = 0;
    for (size_t g = 0; g < G; ++g) {
      for (; i < groups[g].end; ++i) {
        const double b = static_cast<double>(m.tensors()[i].nbytes());
        for (int r : m.own.owner_sets[m.own.name_owner_class[i]]) {
          gather[g][r] += f.trainer.fsdp ? b * (P - 1) / P : b * HeldMissing(f.trainer, travel, r, m.tensors()[i]);
        }
      }
    }
  }
  const bool fsdp_cross_node = f.trainer.fsdp && f.trainer_nodes() > 1;
  const double gather_rate = fsdp_cross_node ? rt.nic : rt.nvlink;
  std::map<std::string, double> credit, bytes_through, raw_of, busy;
  std::vector<double> group_seconds(G);
  std::vector<std::vector<int>> group_stage(G);
  double total = 0;
  for (size_t g = 0; g < G; ++g) {
    std::string worst_name;
    double worst = 0, sum = 0;
    auto consider = [&](const std::string& name, double bytes, double rate, double raw) {
      const double s = Seconds(bytes, rate);
      sum += s;
      bytes_through[name] += bytes;
      busy[name] += s;
      raw_of[name] = raw;
      if (s > worst) worst = s, worst_name = name;
    };
    // The busiest producer and worker of the group on each resource.
    int pn = 0, pg = 0, pv = 0;
    for (int r = 1; r < P; ++r) {
      if (send_nic[g][r] > send_nic[g][pn]) pn = r;
      if (send_nvl[g][r] > send_nvl[g][pv]) pv = r;
      if (gather[g][r] > gather[g][pg]) pg = r;
    }
    int wb = 0;
    for (int b = 1; b < per; ++b) wb = recv[g][b] > recv[g][wb] ? b : wb;
    const double packed = send_nic[g][pn] + send_nvl[g][pn];
    consider(fmt::format("gather: {} on trainer rank {}", fsdp_cross_node ? "NIC" : "NVLink", pg), gather[g][pg],
             gather_rate, fsdp_cross_node ? rt.raw_nic : rt.raw_nvlink);
    consider(fmt::format("pack: HBM copy on trainer rank {}", pn), packed, rt.copy, rt.raw_copy);
    consider(fmt::format("wire: NIC egress of trainer rank {}", pn), send_nic[g][pn], rt.nic, rt.raw_nic);
    consider(fmt::format("wire: NVLink egress of trainer rank {}", pv), send_nvl[g][pv], rt.nvlink, rt.raw_nvlink);
    const bool worker_near = f.placement != Placement::kDisaggregated;
    consider(fmt::format("wire: {} ingress of worker {}", worker_near ? "NVLink" : "NIC", wb), recv[g][wb],
             worker_near ? rs.nvlink : rs.nic, worker_near ? rs.raw_nvlink : rs.raw_nic);
    consider(fmt::format("unpack: HBM copy on worker {}", wb), recv[g][wb], rs.copy, rs.raw_copy);
    const double t = o.lookahead > 0 ? worst : sum;
    credit[worst_name] += worst;
    total += t;
    group_seconds[g] = t;
    for (int r = 0; r < P; ++r) {
      if (send_nic[g][r] + send_nvl[g][r] > 0) group_stage[g].push_back(r);
    }
  }
  if (o.concurrent_stages) total = StageOverlapSeconds(group_seconds, group_stage, busy);
  const double control = k.gpu_control_s;
  p.seconds = total + control;
  // Steps: each resource's time summed over the groups where it bounds the group.
  for (const auto& [name, seconds] : credit) {
    const size_t colon = name.find(':');
    AddStep(p, name.substr(0, colon), name.substr(colon + 2), bytes_through[name], raw_of[name], seconds);
  }
  AddStep(p, "control", "HTTP start/update/finish", 0, 0, control);
  std::string best;
  for (const auto& [name, seconds] : credit) best = best.empty() || seconds > credit[best] ? name : best;
  p.bottleneck = best;
  p.utilisation = raw_of[best] > 0 ? bytes_through[best] / p.seconds / (raw_of[best] * kGB) : 0;
  if (!o.concurrent_stages && !f.trainer.fsdp && f.trainer.pp > 1 && best.find("of trainer rank") != std::string::npos) {
    p.bottleneck += fmt::format(" (groups go in order, so only one pipeline stage's {} of {} ranks send at a time)",
                                P / f.trainer.pp, P);
  }
  const auto [lo, hi] = std::minmax_element(sent_total.begin(), sent_total.end());
  p.sent_per_trainer_rank_min = static_cast<int64_t>(*lo);
  p.sent_per_trainer_rank_max = static_cast<int64_t>(*hi);
  p.received_per_worker_max = max_recv;
  p.trainer_extra_bytes = staging * (o.lookahead + 1);
  p.worker_extra_bytes = std::max(max_chunk, max_lanes);
  p.assumptions.push_back(fmt::format("{} layer groups, taken by every worker {}; a group costs its busiest resource{}",
                                      G, o.concurrent_stages ? "from every pipeline stage at once (a stage's groups in order; the longest stage or busiest resource bounds the sync)" : "in plan order",
                                      o.lookahead > 0 ? " (gather, pack, wire and unpack pipelined)" : " summed over its steps (lookahead 0)"));
  p.assumptions.push_back("every trainer GPU sends through its own NIC share; point-to-point sends at the broadcast's efficiency");
  return Status::Ok();
}

}  // namespace

std::string_view BackendName(Backend b) {
  switch (b) {
    case Backend::kNccl: return "nccl";
    case Backend::kIpc: return "ipc";
    case Backend::kDelta: return "delta";
    case Backend::kSharded: return "sharded";
  }
  return "?";
}

ModelConfig TravelConfig(const ModelConfig& model, bool fp8) {
  ModelConfig c = model;
  if (fp8) c.dtype = DType::kF8E4M3;
  return c;
}

Result<Prediction> Predict(const ModelConfig& model, const Fleet& fleet, Backend backend,
                           const PlanOptions& options, const Constants& k) {
  WSYNC_ASSIGN_OR_RETURN(std::vector<Prediction> p, PredictEach(model, fleet, {&backend, 1}, options, k));
  return std::move(p.front());
}

Result<std::vector<Prediction>> PredictEach(const ModelConfig& model, const Fleet& fleet,
                                            std::span<const Backend> backends, const PlanOptions& options,
                                            const Constants& k) {
  if (options.bucket_bytes < 1 || options.lookahead < 0) {
    WSYNC_RETURN_IF_ERROR(CheckFleet(model, fleet));
    return InvalidArgument("bucket must be positive and lookahead not negative");
  }
  // The sharded plane's plans, where it is modeled (GPUs on both sides).
  const bool with_plans = std::find(backends.begin(), backends.end(), Backend::kSharded) != backends.end() &&
                          fleet.trainer_hw.gpus_per_node > 0 && fleet.server_hw.gpus_per_node > 0;
  WSYNC_ASSIGN_OR_RETURN(Model m, Load(model, fleet, with_plans));
  std::vector<Prediction> out;
  for (Backend backend : backends) {
    Prediction& p = out.emplace_back();
    p.backend = backend;
    switch (backend) {
      case Backend::kNccl: PredictNccl(m, model, fleet, options, k, p); break;
      case Backend::kIpc: PredictIpc(m, model, fleet, options, k, p); break;
      case Backend::kDelta: PredictDelta(m, fleet, k, p); break;
      case Backend::kSharded: WSYNC_RETURN_IF_ERROR(PredictSharded(m, model, fleet, options, k, p)); break;
    }
  }
  return out;
}

}  // namespace wsync::planner
