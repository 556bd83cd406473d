#include "planner/calibration.h"

#include <map>
#include <string_view>

#include <fmt/format.h>

namespace wsync::planner {
namespace {

double Get(std::string_view key) {
  for (const Measurement& m : Measurements()) {
    if (key == m.key) return m.value;
  }
  return 0;  // unreachable: every key below is in the table (calibration_test checks)
}

struct Derivation {
  const char* constant;
  const char* formula;
  double value;
};

std::vector<Derivation> Derive() {
  const double raw_bcast = Get("nccl_raw_broadcast_gb_per_s");
  const double nvlink = Get("h200_nvlink_gb_per_s");
  const double data_ms = Get("nccl_engine_data_ms");
  const double raw_ms = Get("nccl_raw_ms");
  const double chunks = Get("nccl_chunks");
  const double sync_ms = Get("nccl_engine_sync_ms");
  const double copy_gb = Get("d2d_copy_gib") * 1.073741824 / (Get("d2d_copy_ms") / 1000);
  const double hbm = Get("h200_hbm_gb_per_s");
  const double two_proc = Get("ipc_packed_two_process_ms");
  const double one_proc = Get("ipc_packed_one_process_ms");
  const double ipc_chunks = Get("ipc_packed_chunks");
  const double ipc_engine = Get("ipc_packed_engine_ms");
  const double pub_wall = Get("delta_publish_wall_gb_per_s");
  const double pub_core = Get("delta_publish_gb_per_core");
  const double apply_wall = Get("delta_apply_wall_gb_per_s");
  const double apply_core = Get("delta_apply_gb_per_core");
  const double reload_s = Get("delta_reload_s");
  const double model_gb = Get("delta_model_gb");
  const double workers = Get("delta_workers");
  const double all_copy = Get("h200_host_all_core_copy_gb_per_s");
  const double vm_cores = Get("vm_cores");
  const double vm_chain = (vm_cores * Get("vm_raw_chain_2_hops_s") / (2 * model_gb) +
                           vm_cores * Get("vm_raw_chain_4_hops_s") / (4 * model_gb)) / 2;
  const double host_2 = Get("h200_host_raw_chain_2_hops_s") / model_gb;
  const double host_4 = Get("h200_host_raw_chain_4_hops_s") / model_gb;
  return {
      {"link_efficiency", "nccl_raw_broadcast_gb_per_s / h200_nvlink_gb_per_s", raw_bcast / nvlink},
      {"nccl_chunk_turnaround_s", "(nccl_engine_data_ms - nccl_raw_ms) / nccl_chunks / 1000",
       (data_ms - raw_ms) / chunks / 1000},
      {"gpu_control_s", "(nccl_engine_sync_ms - nccl_engine_data_ms) / 1000", (sync_ms - data_ms) / 1000},
      {"hbm_copy_efficiency", "d2d_copy_gib * 1.0737 / (d2d_copy_ms / 1000) / (h200_hbm_gb_per_s / 2)",
       copy_gb / (hbm / 2)},
      {"ipc_switch_per_chunk_s", "(ipc_packed_two_process_ms - ipc_packed_one_process_ms) / ipc_packed_chunks / 1000",
       (two_proc - one_proc) / ipc_chunks / 1000},
      {"ipc_control_s", "(ipc_packed_engine_ms - ipc_packed_two_process_ms) / 1000", (ipc_engine - two_proc) / 1000},
      {"delta_publish_gb_per_core", "delta_publish_gb_per_core", pub_core},
      {"delta_publish_cores", "delta_publish_wall_gb_per_s / delta_publish_gb_per_core", pub_wall / pub_core},
      {"delta_apply_gb_per_core", "delta_apply_gb_per_core", apply_core},
      {"delta_apply_cores", "delta_apply_wall_gb_per_s / delta_apply_gb_per_core", apply_wall / apply_core},
      {"delta_core_copy_gb_per_s", "h200_host_core_copy_gb_per_s", Get("h200_host_core_copy_gb_per_s")},
      {"delta_reload_efficiency", "delta_model_gb * delta_workers / delta_reload_s / h200_host_all_core_copy_gb_per_s",
       model_gb * workers / reload_s / all_copy},
      {"delta_payload_ratio", "delta_payload_percent / 100", Get("delta_payload_percent") / 100},
      {"loopback_hop_core_s_per_gb",
       "mean of vm_cores * vm_raw_chain_H_hops_s / (H * delta_model_gb) over H = 2, 4", vm_chain},
      {"loopback_chain_hop_s_per_gb",
       "(h200_host_raw_chain_4_hops_s - h200_host_raw_chain_2_hops_s) / 2 / delta_model_gb", (host_4 - host_2) / 2},
      {"loopback_chain_s_per_gb", "h200_host_raw_chain_2_hops_s / delta_model_gb - 2 * loopback_chain_hop_s_per_gb",
       host_2 - (host_4 - host_2)},
      {"cpu_control_s", "http_three_calls_us / 1e6", Get("http_three_calls_us") / 1e6},
      {"pcie_efficiency", "pcie_practical_fraction", Get("pcie_practical_fraction")},
  };
}

}  // namespace

const std::vector<Measurement>& Measurements() {
  static const std::vector<Measurement> kTable = {
      {"nccl_raw_broadcast_gb_per_s", 368.9, "GB/s",
       "benchmarks.md 'broadcast on GPUs', session 3: raw ncclBroadcast of the 12 chunks, 44.40 ms"},
      {"nccl_raw_ms", 44.40, "ms", "same row"},
      {"nccl_engine_data_ms", 51.2, "ms", "same section, session 3: data 50.9-51.5 ms (midpoint)"},
      {"nccl_engine_sync_ms", 52.2, "ms", "same section, session 3: engine sync median"},
      {"nccl_chunks", 12, "chunks", "same section: qwen3-8b at 1 GiB, vLLM's cut"},
      {"h200_nvlink_gb_per_s", 450, "GB/s", "data/hardware/nvidia-h200-x2.json nvlink_gb_per_s"},
      {"h200_hbm_gb_per_s", 4800, "GB/s", "data/hardware/nvidia-h200.json hbm_gb_per_s"},
      {"d2d_copy_gib", 8, "GiB", "benchmarks.md 'ipc', GPU table: device-to-device copy floor, 8 GiB"},
      {"d2d_copy_ms", 4.02, "ms", "same row: 8 GiB in 4.02 ms"},
      {"ipc_packed_one_process_ms", 16.25, "ms",
       "benchmarks.md 'Packed: what two processes can reach': both copies in one process, 16.24/16.26"},
      {"ipc_packed_two_process_ms", 18.50, "ms", "same table: two processes, region hand-off, 18.52/18.49"},
      {"ipc_packed_engine_ms", 18.99, "ms", "same table: the engine start .. finish over HTTP"},
      {"ipc_packed_chunks", 14, "chunks", "same section: qwen3-8b, 1.155 GB slots"},
      {"delta_publish_wall_gb_per_s", 11.75, "GB/s",
       "benchmarks.md 'Planner inputs on the H200 host': bench delta, publish wall on 16 threads 11.813/11.690"},
      {"delta_publish_gb_per_core", 1.247, "GB/s", "same table: publish per core 1.279/1.215"},
      {"delta_apply_wall_gb_per_s", 9.20, "GB/s", "same table: fetch + apply 9.220/9.185"},
      {"delta_apply_gb_per_core", 2.649, "GB/s", "same table: apply per core 2.613/2.684"},
      {"delta_reload_s", 0.072, "s", "same table: reload (paused) 0.075/0.069"},
      {"delta_model_gb", 1.192, "GB", "qwen3-0.6b bf16"},
      {"delta_workers", 2, "workers", "bench delta default: 2 servers x TP=1 on the host"},
      {"delta_payload_percent", 3.05, "%", "same table: compressed payload / model bytes, default step"},
      {"h200_host_core_copy_gb_per_s", 5.907, "GB/s",
       "same section: bench ipc's one-thread memcpy floor, 5.907/6.185/5.381 (median)"},
      {"h200_host_all_core_copy_gb_per_s", 28.66, "GB/s",
       "same section: bench ipc's 16-thread memcpy floor, 28.664/26.417/29.856 (median)"},
      {"h200_host_raw_chain_2_hops_s", 0.378, "s",
       "same section: bench broadcast --servers 2, raw chained Gloo send/recv (3 ranks)"},
      {"h200_host_raw_chain_4_hops_s", 0.470, "s", "same section: bench broadcast --servers 2 --tp 2, raw chain (5 ranks)"},
      {"vm_raw_chain_2_hops_s", 0.648, "s",
       "benchmarks.md 'Own CPU runs re-measured on a quiet VM': bench broadcast --servers 2, raw chain"},
      {"vm_raw_chain_4_hops_s", 1.066, "s", "same table: bench broadcast --servers 2 --tp 2, raw chain"},
      {"vm_cores", 2, "cores", "the 2-core VM"},
      {"http_three_calls_us", 298.5, "us",
       "benchmarks.md 'control plane': the three calls of one sync, libmicrohttpd, load 6-7"},
      {"pcie_practical_fraction", 0.7, "fraction",
       "not measured here: perf_anchors.md section 2, PCIe Gen5 'real-world typically 20-40% below peak' (midpoint)"},
  };
  return kTable;
}

Constants Calibrate() {
  std::map<std::string_view, double> v;
  for (const Derivation& d : Derive()) v[d.constant] = d.value;
  Constants c;
  c.link_efficiency = v["link_efficiency"];
  c.nccl_chunk_turnaround_s = v["nccl_chunk_turnaround_s"];
  c.gpu_control_s = v["gpu_control_s"];
  c.hbm_copy_efficiency = v["hbm_copy_efficiency"];
  c.ipc_switch_per_chunk_s = v["ipc_switch_per_chunk_s"];
  c.ipc_control_s = v["ipc_control_s"];
  c.delta_publish_gb_per_core = v["delta_publish_gb_per_core"];
  c.delta_publish_cores = v["delta_publish_cores"];
  c.delta_apply_gb_per_core = v["delta_apply_gb_per_core"];
  c.delta_apply_cores = v["delta_apply_cores"];
  c.delta_core_copy_gb_per_s = v["delta_core_copy_gb_per_s"];
  c.delta_reload_efficiency = v["delta_reload_efficiency"];
  c.delta_payload_ratio = v["delta_payload_ratio"];
  c.loopback_hop_core_s_per_gb = v["loopback_hop_core_s_per_gb"];
  c.loopback_chain_s_per_gb = v["loopback_chain_s_per_gb"];
  c.loopback_chain_hop_s_per_gb = v["loopback_chain_hop_s_per_gb"];
  c.cpu_control_s = v["cpu_control_s"];
  c.pcie_efficiency = v["pcie_efficiency"];
  return c;
}

std::string CalibrationReport() {
  std::string out = "### Inputs (docs/benchmarks.md)\n\n| input | value | unit | source |\n|---|---|---|---|\n";
  for (const Measurement& m : Measurements()) {
    out += fmt::format("| {} | {:g} | {} | {} |\n", m.key, m.value, m.unit, m.source);
  }
  out += "\n### Constants\n\n| constant | formula | value |\n|---|---|---|\n";
  for (const Derivation& d : Derive()) out += fmt::format("| {} | {} | {:.6g} |\n", d.constant, d.formula, d.value);
  return out;
}

}  // namespace wsync::planner
