// HardwareProfile: what the planner knows about one kind of node, as data.
//
// A profile is a small JSON file (data/hardware/<name>.json) describing one node: its
// GPUs, the links between them (NVLink), to the host (PCIe) and to other nodes (NICs),
// and its memory bandwidths. Every figure carries its source in the file's "sources"
// object, one entry per figure, so a reader can check it; the parser refuses a figure
// without one. Rates are per direction, in GB/s (10^9 bytes per second); 0 means "none"
// (a CPU-only host has gpus_per_node 0 and no GPU figures; a lone host no NICs). Profiles are
// untrusted input (a user may pass any file): every field is type- and range-checked
// and unknown fields are refused, each error naming the file and the field.
// Pure functions; thread-safe.
#pragma once

#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "wsync/status.h"

namespace wsync::planner {

struct HardwareProfile {
  std::string name;         // "h100"
  std::string description;  // "8x H100 SXM5 (DGX H100), 8x 400 Gb/s InfiniBand"
  int gpus_per_node = 8;
  double gpu_memory_gb = 0;        // HBM capacity per GPU
  double hbm_gb_per_s = 0;         // HBM bandwidth per GPU (reads + writes together)
  double nvlink_gb_per_s = 0;      // NVLink per GPU, per direction
  double pcie_gb_per_s = 0;        // host <-> GPU link per GPU, per direction
  int nics_per_node = 0;           // inter-node NICs
  double nic_gb_per_s = 0;         // per NIC, per direction
  double host_memory_gb_per_s = 0; // the node's host DRAM bandwidth (reads + writes, all cores)
  int host_cores = 0;              // CPU cores of the node
  // One core's memcpy, bytes copied per second (the CPU paths' per-thread copy rate;
  // required on CPU-only hosts, 0 where unmeasured on GPU nodes).
  double core_copy_gb_per_s = 0;
  // Field name -> where its figure comes from.
  std::map<std::string, std::string> sources;
};

// Parses a profile's JSON text; `origin` names the file in errors. Required: name,
// description, every number above, and a non-empty source for each number.
Result<HardwareProfile> ParseHardwareProfile(std::string_view json_text, std::string_view origin);

// A profile by name (looked up as <dir>/<name>.json) or by a path ending in .json.
// NotFound lists the profiles in `dir`.
Result<HardwareProfile> LoadHardwareProfile(std::string_view name_or_path, const std::string& dir);

// The profiles' directory shipped with the source tree (data/hardware).
std::string DefaultHardwareDir();

// Names of the profiles in `dir`, sorted.
std::vector<std::string> HardwareProfileNames(const std::string& dir);

}  // namespace wsync::planner
