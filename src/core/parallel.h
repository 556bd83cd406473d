// ParallelFor: split [0, n) across up to `threads` std::threads and wait for all.
// Used for the memory-bound hot loops (synthetic weights, digests, shard copies).
// The body must be thread-safe for disjoint ranges; blocks until every range is done.
#pragma once

#if defined(__linux__)
#include <sched.h>
#endif

#include <algorithm>
#include <cstddef>
#include <functional>
#include <thread>
#include <vector>

#include "core/cpu_limit.h"

namespace wsync {

// The CPUs this process may run on (its affinity mask: taskset, a cgroup cpuset), else
// every CPU of the machine, capped by its cgroup's CPU quota (a container's CPU limit,
// read once): a server pinned to 8 of 64 cores, or limited to 8 CPUs, gets 8 threads.
inline size_t DefaultThreads() {
  size_t n = std::max<size_t>(1, std::thread::hardware_concurrency());
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) n = static_cast<size_t>(CPU_COUNT(&set));
  static const size_t quota = CgroupCpuLimit();
  if (quota > 0) n = std::min(n, quota);
#endif
  return n;
}

// body(begin, end) is called once per non-empty range.
inline void ParallelFor(size_t n, size_t threads,
                        const std::function<void(size_t, size_t)>& body) {
  threads = std::max<size_t>(1, std::min(threads, n));
  if (threads <= 1) {
    if (n > 0) body(0, n);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  size_t step = (n + threads - 1) / threads;
  for (size_t t = 1; t < threads; ++t) {
    size_t b = t * step, e = std::min(n, b + step);
    if (b < e) pool.emplace_back(body, b, e);
  }
  body(0, std::min(n, step));
  for (auto& th : pool) th.join();
}

}  // namespace wsync
