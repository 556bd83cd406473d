#include "planner/cost_model.h"

#include <algorithm>
#include <string_view>

#include <fmt/format.h>

namespace wsync::planner {
namespace {

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

}  // namespace

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

double HeldMissing(const TrainerSpec& t, const ModelConfig& model, int rank, const TensorMeta& m) {
  if (m.shape.size() < 2 || m.name.ends_with(".mlp.gate.weight")) return 0;  // norms, biases, routers: replicated
  const int64_t e = ExpertIndex(m.name);
  if (e < 0) return 1.0 - 1.0 / t.tp;
  const int j = rank % (t.world / t.pp);
  const int64_t per_ep = model.is_moe() ? model.num_experts / t.ep : 1;
  return e / per_ep == (j / t.etp) % t.ep ? 1.0 - 1.0 / t.etp : 1.0;
}

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

void NameBottleneck(Prediction& p, const std::vector<size_t>& overlapped) {
  const Step* worst = nullptr;
  for (size_t i : overlapped) {
    if (!worst || p.steps[i].seconds > worst->seconds) worst = &p.steps[i];
  }
  if (!worst) return;
  p.bottleneck = fmt::format("{} ({})", worst->name, worst->resource);
  p.utilisation = worst->gb_per_s > 0 && p.seconds > 0 ? worst->bytes / p.seconds / (worst->gb_per_s * kGB) : 0;
}

Result<PreparedModel> PrepareModel(const ModelConfig& travel, const Fleet& f, bool with_plans) {
  PreparedModel m;
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

int64_t MaxShard(const PreparedModel& m) { return *std::max_element(m.shard_bytes.begin(), m.shard_bytes.end()); }

int64_t ShardOf(const PreparedModel& m, const Fleet& f, int w) {
  return m.shard_bytes[w % f.servers.workers_per_deployment()];
}

ModelConfig TravelConfig(const ModelConfig& model, bool fp8) {
  ModelConfig c = model;
  if (fp8) c.dtype = DType::kF8E4M3;
  return c;
}

}  // namespace wsync::planner
