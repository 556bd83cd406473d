// How many CPUs' worth of time this process may use, for sizing thread pools.
#pragma once

#include <cstddef>
#include <string>

namespace wsync {

// The CPU quota of the process's cgroup, in whole CPUs rounded up: the smallest of the
// cgroup's and its ancestors' cgroup v2 `cpu.max` ("QUOTA PERIOD"), or of cgroup v1's
// `cpu.cfs_quota_us` / `cpu.cfs_period_us`. A container limited to 8 CPUs on a 128-core
// node sees 128 CPUs, and 128 threads there burn the quota in a sixteenth of each period
// and then all stall. 0 when there is no quota or it cannot be read. The paths are
// parameters for tests.
size_t CgroupCpuLimit(const std::string& proc_self_cgroup = "/proc/self/cgroup",
                      const std::string& cgroup_root = "/sys/fs/cgroup");

}  // namespace wsync
