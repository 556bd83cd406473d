#include "core/cpu_limit.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <vector>

namespace wsync {
namespace {

namespace fs = std::filesystem;

std::optional<std::string> ReadSmall(const fs::path& p) {
  std::ifstream in(p);
  if (!in) return std::nullopt;
  std::string s;
  std::getline(in, s);
  return s;
}

std::optional<double> Number(const std::string& s) {
  try {
    size_t used = 0;
    double v = std::stod(s, &used);
    return used > 0 ? std::optional<double>(v) : std::nullopt;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

// CPUs the one cgroup directory `dir` allows, if it sets a quota.
std::optional<double> QuotaAt(const fs::path& dir, bool v2) {
  if (v2) {
    std::optional<std::string> line = ReadSmall(dir / "cpu.max");  // "max 100000" or "250000 100000"
    if (!line) return std::nullopt;
    std::istringstream words(*line);
    std::string quota, period;
    words >> quota >> period;
    std::optional<double> q = Number(quota), p = Number(period);
    if (quota == "max" || !q || !p || *q <= 0 || *p <= 0) return std::nullopt;
    return *q / *p;
  }
  std::optional<std::string> quota = ReadSmall(dir / "cpu.cfs_quota_us"), period = ReadSmall(dir / "cpu.cfs_period_us");
  if (!quota || !period) return std::nullopt;
  std::optional<double> q = Number(*quota), p = Number(*period);
  if (!q || !p || *q <= 0 || *p <= 0) return std::nullopt;  // -1: no quota
  return *q / *p;
}

// The smallest quota on the way from `root`/`path` up to `root`.
std::optional<double> SmallestQuota(const fs::path& root, const std::string& path, bool v2) {
  std::optional<double> best;
  fs::path rel = fs::path(path).relative_path();
  for (;;) {
    std::optional<double> q = QuotaAt(root / rel, v2);
    if (q && (!best || *q < *best)) best = q;
    if (rel.empty()) return best;
    rel = rel.parent_path();
  }
}

}  // namespace

size_t CgroupCpuLimit(const std::string& proc_self_cgroup, const std::string& cgroup_root) {
  std::ifstream in(proc_self_cgroup);
  if (!in) return 0;
  std::optional<double> best;
  auto take = [&](std::optional<double> q) {
    if (q && (!best || *q < *best)) best = q;
  };
  std::string line;
  while (std::getline(in, line)) {  // "hierarchy-id:controllers:path"
    size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    if (line.compare(0, a, "0") == 0 && controllers.empty()) {  // cgroup v2
      take(SmallestQuota(cgroup_root, path, /*v2=*/true));
      continue;
    }
    std::istringstream names(controllers);  // cgroup v1: "cpu,cpuacct" mounted under either name
    for (std::string name; std::getline(names, name, ',');) {
      if (name != "cpu") continue;
      for (const std::string& mount : {controllers, std::string("cpu")}) {
        if (fs::exists(fs::path(cgroup_root) / mount)) {
          take(SmallestQuota(fs::path(cgroup_root) / mount, path, /*v2=*/false));
          break;
        }
      }
    }
  }
  return best ? static_cast<size_t>(std::max(1.0, std::ceil(*best))) : 0;
}

}  // namespace wsync
