// WorkerThread: one long-lived thread per inference worker that runs its tasks in order.
//
// Each worker of a server (one per TP x DP rank) owns one. Work that must run "on the
// worker" (joining a collective, copying into its shards, and on GPU, anything after
// cudaSetDevice, which is per thread) is posted here. Post() is thread-safe and returns a
// future; tasks run one at a time in FIFO order. The destructor drains and joins.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <string>
#include <thread>

#include "wsync/status.h"

namespace wsync {

class WorkerThread {
 public:
  explicit WorkerThread(std::string name);
  ~WorkerThread();
  WorkerThread(const WorkerThread&) = delete;
  WorkerThread& operator=(const WorkerThread&) = delete;

  std::future<Status> Post(std::function<Status()> task);
  const std::string& name() const { return name_; }

 private:
  void Loop();

  std::string name_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::packaged_task<Status()>> tasks_;  // GUARDED_BY(mu_)
  bool stopping_ = false;                           // GUARDED_BY(mu_)
  std::thread thread_;
};

}  // namespace wsync
