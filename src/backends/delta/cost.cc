#include "backends/delta/cost.h"

#include <algorithm>
#include <map>

#include <fmt/format.h>

namespace wsync {
namespace {

using namespace planner;

// The delta codec's calibrated per-core rates hold on the calibration host; another host's
// cores run them in proportion to its one-thread memcpy (the passes stream the model
// through memory). Hosts without a measured copy rate take the calibration host's.
double CodecScale(const HardwareProfile& hw, const Constants& k) {
  return hw.core_copy_gb_per_s > 0 && k.delta_core_copy_gb_per_s > 0 ? hw.core_copy_gb_per_s / k.delta_core_copy_gb_per_s
                                                                      : 1.0;
}

void Predict(const PreparedModel& m, const Fleet& f, const Constants& k, Prediction& p) {
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

}  // namespace

Status PredictDeltaCost(const CostInput& input, Prediction& p) {
  Predict(input.model, input.fleet, input.k, p);
  return Status::Ok();
}

}  // namespace wsync
