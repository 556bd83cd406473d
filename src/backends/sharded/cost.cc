#include "backends/sharded/cost.h"

#include <algorithm>
#include <map>

#include <fmt/format.h>

namespace wsync {
namespace {

using namespace planner;

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

Status Predict(const PreparedModel& m, const ModelConfig& travel, const Fleet& f, const PlanOptions& o,
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

Status PredictShardedCost(const CostInput& input, Prediction& p) {
  return Predict(input.model, input.travel, input.fleet, input.options, input.k, p);
}

bool ShardedCostReadsPlans(const Fleet& fleet) {
  return fleet.trainer_hw.gpus_per_node > 0 && fleet.server_hw.gpus_per_node > 0;
}

std::string DescribeShardedCostOptions(const PlanOptions& options) {
  return fmt::format("lookahead {}{}", options.lookahead, options.concurrent_stages ? "" : ", stages in turn");
}

}  // namespace wsync
