// TaskPool: a fixed set of threads that run submitted tasks in FIFO order, for the
// `delta` backend's CPU-bound loops (encoding on the trainer, applying on the receiver).
//
// Each task gets the index of the thread running it, so callers keep per-thread scratch
// (a zstd context) without locks. TaskGroup counts the tasks of one batch and Wait()
// blocks until they have all run; tasks are pure computation over memory the caller
// keeps alive until Wait() returns, so Wait() needs no deadline. Submit() and Wait() are
// thread-safe; the destructor runs what is queued, then joins.
#pragma once

#include <time.h>

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace wsync::delta {

// CPU seconds this process has used (all threads): per-core throughput is bytes over
// this, whatever else shares the machine.
inline double ProcessCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

// CPU seconds the calling thread has used.
inline double ThreadCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
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

}  // namespace wsync::delta
