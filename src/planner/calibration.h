// Calibration: the cost model's per-step constants, derived from wsync's own measured runs.
//
// Each constant is computed from named measurements in docs/benchmarks.md (the section
// and the row are quoted beside each input), never fitted to a published case. The
// inputs are data here; `wsync plan --calibrate` prints every input, its source and the
// arithmetic that turns the inputs into the constants, so the calibration is reproducible
// and checkable by hand. Pure functions; thread-safe.
#pragma once

#include <string>
#include <vector>

namespace wsync::planner {

// One measured figure from docs/benchmarks.md.
struct Measurement {
  const char* key;
  double value;
  const char* unit;
  const char* source;  // section and row of docs/benchmarks.md
};

const std::vector<Measurement>& Measurements();

struct Constants {
  // NCCL broadcast efficiency: achieved / per-direction link rate (raw ncclBroadcast over
  // NVLink). Also used for NICs and for point-to-point sends, for want of a measurement.
  double link_efficiency = 0;
  // Host turn-around between broadcast chunks (the nccl plane completes chunk k before
  // enqueueing k+1), seconds per chunk.
  double nccl_chunk_turnaround_s = 0;
  // Control plane of a GPU sync (start, preflight, update reply, finish), seconds.
  double gpu_control_s = 0;
  // Device-to-device copy rate / (HBM bandwidth / 2).
  double hbm_copy_efficiency = 0;
  // ipc packed: two processes' kernels time-slicing one GPU, seconds per chunk.
  double ipc_switch_per_chunk_s = 0;
  // ipc control plane (HTTP start .. finish around the copies), seconds.
  double ipc_control_s = 0;
  // delta: the codec's rates per core on the calibration host, the cores' worth its
  // parallel stages reach there, and that host's one-thread memcpy (other hosts scale the
  // per-core rates by theirs).
  double delta_publish_gb_per_core = 0;
  double delta_publish_cores = 0;
  double delta_apply_gb_per_core = 0;
  double delta_apply_cores = 0;
  double delta_core_copy_gb_per_s = 0;
  // The reload's rate over the host's all-core memcpy (it copies the mapped local
  // checkpoint into the shards in pieces on every core).
  double delta_reload_efficiency = 0;
  double delta_payload_ratio = 0;  // compressed payload / model bytes per step
  // Gloo over loopback: core-seconds one hop's send and receive cost per GB (a host whose
  // cores are all busy), and the time per GB a chain of H hops streams in when cores are
  // free: loopback_chain_s_per_gb + H * loopback_chain_hop_s_per_gb.
  double loopback_hop_core_s_per_gb = 0;
  double loopback_chain_s_per_gb = 0;
  double loopback_chain_hop_s_per_gb = 0;
  // Control plane of a CPU sync (the three HTTP calls), seconds.
  double cpu_control_s = 0;
  // PCIe host-to-device efficiency (achieved / link rate).
  double pcie_efficiency = 0;
};

// The constants from Measurements().
Constants Calibrate();

// Markdown at docs/plan.md's level (### headings): every input with its source, then every
// constant with its formula and value.
std::string CalibrationReport();

}  // namespace wsync::planner
