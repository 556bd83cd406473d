#include "receiver/worker_fanout.h"

#include <future>

#include "core/log.h"
#include "receiver/worker_thread.h"

namespace wsync {
namespace {

Status Named(Status s, const ReceiverWorker& w) {
  if (s.ok() || w.label.empty() || s.message().find(w.label) != std::string::npos) return s;
  return s.WithContext(w.label);
}

}  // namespace

Status RunOnEveryWorker(const std::vector<ReceiverWorker>& workers, std::string_view what, Deadline deadline,
                        const std::function<Status(size_t, const ReceiverWorker&)>& task) {
  std::vector<std::future<Status>> futures;
  futures.reserve(workers.size());
  for (size_t i = 0; i < workers.size(); ++i) {
    futures.push_back(workers[i].thread->Post([&task, &workers, i] { return task(i, workers[i]); }));
  }
  const bool bounded = deadline.at() != Deadline::Clock::time_point::max();
  const auto late = deadline.at() + std::chrono::duration_cast<Deadline::Clock::duration>(
                                        std::chrono::duration<double>(bounded ? kLateWorkerGraceSeconds : 0));
  Status first;
  for (size_t i = 0; i < futures.size(); ++i) {
    if (bounded && futures[i].wait_until(late) == std::future_status::timeout) {
      WSYNC_LOG_ERROR("{}: {} is still running {} s past its deadline; waiting for it", what, workers[i].label,
                      kLateWorkerGraceSeconds);
    }
    Status s = Named(futures[i].get(), workers[i]);
    if (first.ok() && !s.ok()) first = std::move(s);
  }
  return first;
}

Status RunOnWorker(const ReceiverWorker& worker, std::function<Status()> task) {
  return worker.thread->Post(std::move(task)).get();
}

}  // namespace wsync
