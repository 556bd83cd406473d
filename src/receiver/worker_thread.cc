#include "receiver/worker_thread.h"

namespace wsync {

WorkerThread::WorkerThread(std::string name) : name_(std::move(name)) {
  thread_ = std::thread([this] { Loop(); });
}

WorkerThread::~WorkerThread() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

std::future<Status> WorkerThread::Post(std::function<Status()> task) {
  std::packaged_task<Status()> pt(std::move(task));
  std::future<Status> f = pt.get_future();
  {
    std::lock_guard lock(mu_);
    tasks_.push_back(std::move(pt));
  }
  cv_.notify_one();
  return f;
}

void WorkerThread::Loop() {
  for (;;) {
    std::packaged_task<Status()> task;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stopping and drained
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
}

}  // namespace wsync
