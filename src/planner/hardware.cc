#include "planner/hardware.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "core/json_limits.h"

namespace wsync::planner {
namespace {

// Far above any node that exists; low enough that no product of them overflows a double
// into infinity or a count into an unreasonable loop.
constexpr double kMaxRate = 1e6;      // GB/s
constexpr double kMaxMemory = 1e5;    // GB
constexpr int kMaxCount = 1024;

struct NumberField {
  const char* name;
  double max;
  bool integer;
};

constexpr NumberField kNumbers[] = {
    {"gpus_per_node", kMaxCount, true},        {"gpu_memory_gb", kMaxMemory, false},
    {"hbm_gb_per_s", kMaxRate, false},         {"nvlink_gb_per_s", kMaxRate, false},
    {"pcie_gb_per_s", kMaxRate, false},        {"nics_per_node", kMaxCount, true},
    {"nic_gb_per_s", kMaxRate, false},         {"host_memory_gb_per_s", kMaxRate, false},
    {"host_cores", kMaxCount, true},           {"core_copy_gb_per_s", kMaxRate, false},
};

Status Bad(std::string_view origin, const std::string& what) {
  return InvalidArgument(fmt::format("{}: {}", origin, what));
}

}  // namespace

Result<HardwareProfile> ParseHardwareProfile(std::string_view json_text, std::string_view origin) {
  WSYNC_ASSIGN_OR_RETURN(nlohmann::json j, ParseUntrustedJson(json_text, origin));
  if (!j.is_object()) return Bad(origin, "not a JSON object");
  std::set<std::string> known{"name", "description", "sources"};
  for (const NumberField& f : kNumbers) known.insert(f.name);
  for (const auto& [key, value] : j.items()) {
    if (!known.count(key)) return Bad(origin, fmt::format("unknown field {}", TextExcerpt(key)));
  }
  HardwareProfile p;
  for (const char* field : {"name", "description"}) {
    auto it = j.find(field);
    if (it == j.end() || !it->is_string() || it->get<std::string>().empty()) {
      return Bad(origin, fmt::format("field {} must be a non-empty string", field));
    }
    (std::string_view(field) == "name" ? p.name : p.description) = it->get<std::string>();
  }
  auto sources = j.find("sources");
  if (sources == j.end() || !sources->is_object()) {
    return Bad(origin, "field sources must be an object naming each figure's source");
  }
  for (const auto& item : sources->items()) {
    const std::string& key = item.key();
    const nlohmann::json& value = item.value();
    bool is_number = std::any_of(std::begin(kNumbers), std::end(kNumbers),
                                 [&](const NumberField& f) { return key == f.name; });
    if (!is_number) return Bad(origin, fmt::format("sources names {}, which is not a figure", TextExcerpt(key)));
    if (!value.is_string() || value.get<std::string>().empty()) {
      return Bad(origin, fmt::format("sources.{} must be a non-empty string", key));
    }
    p.sources[key] = value.get<std::string>();
  }
  for (const NumberField& f : kNumbers) {
    auto it = j.find(f.name);
    if (it == j.end()) return Bad(origin, fmt::format("missing field {}", f.name));
    if (!it->is_number()) return Bad(origin, fmt::format("field {} must be a number, got {}", f.name, JsonExcerpt(*it)));
    const double v = it->get<double>();
    if (!(v >= 0) || v > f.max) {
      return Bad(origin, fmt::format("field {} is {}, must be in [0, {}]", f.name, JsonExcerpt(*it), f.max));
    }
    if (f.integer && !it->is_number_integer()) {
      return Bad(origin, fmt::format("field {} must be an integer, got {}", f.name, JsonExcerpt(*it)));
    }
    if (!p.sources.count(f.name)) return Bad(origin, fmt::format("field {} has no entry in sources", f.name));
    const std::string_view n = f.name;
    if (n == "gpus_per_node") p.gpus_per_node = static_cast<int>(v);
    else if (n == "gpu_memory_gb") p.gpu_memory_gb = v;
    else if (n == "hbm_gb_per_s") p.hbm_gb_per_s = v;
    else if (n == "nvlink_gb_per_s") p.nvlink_gb_per_s = v;
    else if (n == "pcie_gb_per_s") p.pcie_gb_per_s = v;
    else if (n == "nics_per_node") p.nics_per_node = static_cast<int>(v);
    else if (n == "nic_gb_per_s") p.nic_gb_per_s = v;
    else if (n == "host_memory_gb_per_s") p.host_memory_gb_per_s = v;
    else if (n == "host_cores") p.host_cores = static_cast<int>(v);
    else if (n == "core_copy_gb_per_s") p.core_copy_gb_per_s = v;
  }
  // Zero means "none": a CPU-only host has no GPU figures, a single host no NICs.
  const bool gpus = p.gpus_per_node > 0;
  const std::pair<const char*, double> gpu_figures[] = {{"gpu_memory_gb", p.gpu_memory_gb},
                                                        {"hbm_gb_per_s", p.hbm_gb_per_s},
                                                        {"nvlink_gb_per_s", p.nvlink_gb_per_s},
                                                        {"pcie_gb_per_s", p.pcie_gb_per_s}};
  for (const auto& [field, value] : gpu_figures) {
    if (gpus != (value > 0)) {
      return Bad(origin, fmt::format("field {} is {}: it must be positive when gpus_per_node is, "
                                     "and 0 when gpus_per_node is 0",
                                     field, value));
    }
  }
  if ((p.nics_per_node > 0) != (p.nic_gb_per_s > 0)) {
    return Bad(origin, "fields nics_per_node and nic_gb_per_s must both be positive or both 0");
  }
  if (p.host_cores < 1 || !(p.host_memory_gb_per_s > 0)) {
    return Bad(origin, "fields host_cores and host_memory_gb_per_s must be positive");
  }
  if (!gpus && !(p.core_copy_gb_per_s > 0)) {
    return Bad(origin, "field core_copy_gb_per_s must be positive on a CPU-only host (gpus_per_node 0)");
  }
  return p;
}

std::string DefaultHardwareDir() { return WSYNC_HARDWARE_DIR; }

std::vector<std::string> HardwareProfileNames(const std::string& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    if (e.path().extension() == ".json") names.push_back(e.path().stem().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

Result<HardwareProfile> LoadHardwareProfile(std::string_view name_or_path, const std::string& dir) {
  namespace fs = std::filesystem;
  const bool is_path = name_or_path.ends_with(".json");
  fs::path file = is_path ? fs::path(name_or_path) : fs::path(dir) / fmt::format("{}.json", name_or_path);
  std::error_code ec;
  if (!fs::is_regular_file(file, ec)) {
    if (is_path) return NotFound(fmt::format("hardware profile {} does not exist", file.string()));
    return NotFound(fmt::format("unknown hardware '{}' (profiles in {}: {})", name_or_path, dir,
                                fmt::join(HardwareProfileNames(dir), ", ")));
  }
  // A profile is a few hundred bytes; refuse anything that could not be one.
  constexpr uintmax_t kMaxProfileBytes = 1 << 20;
  if (fs::file_size(file, ec) > kMaxProfileBytes) {
    return InvalidArgument(fmt::format("{}: over {} bytes, not a hardware profile", file.string(), kMaxProfileBytes));
  }
  std::ifstream in(file, std::ios::binary);
  if (!in) return InvalidArgument(fmt::format("cannot open {}", file.string()));
  std::stringstream text;
  text << in.rdbuf();
  return ParseHardwareProfile(text.str(), file.string());
}

}  // namespace wsync::planner
