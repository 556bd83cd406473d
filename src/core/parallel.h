// CPU parallelism, in one place: how many threads this process should use
// (DefaultThreads), a one-off split of a loop over fresh threads (ParallelFor), and a
// fixed pool of threads that runs submitted tasks (TaskPool, TaskGroup).
//
// ParallelFor suits the memory-bound loops that run once per sync (synthetic weights,
// digests, shard copies): its body must be thread-safe for disjoint ranges, and it
// blocks until every range is done. TaskPool suits loops that run many batches of small
// tasks (the `delta` backend's encoding and applying): its threads live as long as the
// pool, and each task gets the index of the thread running it, so callers keep
// per-thread scratch (a zstd context) without locks. TaskGroup counts the tasks of one
// batch and Wait() blocks until they have all run; tasks are pure computation over
// memory the caller keeps alive until Wait() returns, so Wait() needs no deadline.
// TaskPool::Submit and TaskGroup's calls are thread-safe; a pool's destructor runs what
// is queued, then joins.
#pragma once

#if defined(__linux__)
#include <sched.h>
#endif

#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
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

class TaskPool {
 public:
  using Task = std::function<void(size_t thread_index)>;

  explicit TaskPool(size_t threads) {
    threads = threads == 0 ? 1 : threads;
    for (size_t i = 0; i < threads; ++i) threads_.emplace_back([this, i] { Loop(i); });
  }
  ~TaskPool() {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  TaskPool(const TaskPool&) = delete;
  TaskPool& operator=(const TaskPool&) = delete;

  size_t size() const { return threads_.size(); }

  void Submit(Task task) {
    {
      std::lock_guard lock(mu_);
      tasks_.push_back(std::move(task));
    }
    cv_.notify_one();
  }

 private:
  void Loop(size_t index) {
    for (;;) {
      Task task;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || !tasks_.empty(); });
        if (tasks_.empty()) return;
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task(index);
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> tasks_;  // GUARDED_BY(mu_)
  bool stopping_ = false;   // GUARDED_BY(mu_)
  std::vector<std::thread> threads_;
};

// The tasks of one batch: Submit() through the group, then Wait() for all of them.
class TaskGroup {
 public:
  explicit TaskGroup(TaskPool& pool) : pool_(pool) {}
  ~TaskGroup() { Wait(); }

  void Submit(TaskPool::Task task) {
    {
      std::lock_guard lock(mu_);
      ++pending_;
    }
    pool_.Submit([this, task = std::move(task)](size_t thread) {
      task(thread);
      std::lock_guard lock(mu_);
      if (--pending_ == 0) cv_.notify_all();
    });
  }

  void Wait() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return pending_ == 0; });
  }

 private:
  TaskPool& pool_;
  std::mutex mu_;
  std::condition_variable cv_;
  size_t pending_ = 0;  // GUARDED_BY(mu_)
};

}  // namespace wsync
