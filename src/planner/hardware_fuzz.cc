// Fuzz target: a hardware profile (data/hardware/*.json or a user's file).
// ParseHardwareProfile() either refuses it or yields figures inside their ranges.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "planner/hardware.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  auto p = wsync::planner::ParseHardwareProfile(text, "profile.json");
  if (!p.ok()) return 0;
  const double figures[] = {p->gpu_memory_gb, p->hbm_gb_per_s, p->nvlink_gb_per_s, p->pcie_gb_per_s,
                            p->nic_gb_per_s, p->host_memory_gb_per_s, p->core_copy_gb_per_s};
  for (double v : figures) {
    if (!(v >= 0 && v <= 1e6)) std::abort();
  }
  if (p->gpus_per_node < 0 || p->nics_per_node < 0 || p->host_cores < 1) std::abort();
  if ((p->gpus_per_node > 0) != (p->hbm_gb_per_s > 0)) std::abort();
  if (p->gpus_per_node == 0 && !(p->core_copy_gb_per_s > 0)) std::abort();
  if (p->sources.size() != 10) std::abort();
  return 0;
}
