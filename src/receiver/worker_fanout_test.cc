// RunOnEveryWorker: one task per worker, each on its own worker's thread; the first
// failure in worker order comes back named by that worker's label (once, not twice);
// a task running past its deadline is waited for, never abandoned.
#include "receiver/worker_fanout.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "receiver/worker_thread.h"

namespace wsync {
namespace {

class WorkerFanoutTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int i = 0; i < 3; ++i) {
      threads_.push_back(std::make_unique<WorkerThread>("tp" + std::to_string(i)));
      ReceiverWorker w;
      w.thread = threads_.back().get();
      w.tp_rank = i;
      w.label = "http://127.0.0.1:1 worker dp0/tp" + std::to_string(i);
      workers_.push_back(w);
    }
  }
  std::vector<std::unique_ptr<WorkerThread>> threads_;
  std::vector<ReceiverWorker> workers_;
};

TEST_F(WorkerFanoutTest, EveryTaskRunsOnItsWorkersThread) {
  std::vector<std::thread::id> ran(3);
  Status s = RunOnEveryWorker(workers_, "test", Deadline::InSeconds(10), [&](size_t i, const ReceiverWorker& w) {
    EXPECT_EQ(&w, &workers_[i]);
    ran[i] = std::this_thread::get_id();
    return Status::Ok();
  });
  ASSERT_TRUE(s.ok()) << s.ToString();
  for (size_t i = 0; i < ran.size(); ++i) {
    EXPECT_NE(ran[i], std::this_thread::get_id());
    for (size_t j = i + 1; j < ran.size(); ++j) EXPECT_NE(ran[i], ran[j]);
  }
  // The same thread again for the same worker.
  std::thread::id again;
  ASSERT_TRUE(RunOnWorker(workers_[1], [&] {
                again = std::this_thread::get_id();
                return Status::Ok();
              }).ok());
  EXPECT_EQ(again, ran[1]);
}

TEST_F(WorkerFanoutTest, TheFirstFailureInWorkerOrderIsNamedOnce) {
  Status s = RunOnEveryWorker(workers_, "test", Deadline::InSeconds(10), [&](size_t i, const ReceiverWorker& w) {
    if (i == 0) return Status::Ok();
    if (i == 1) return DataLoss("chunk 3/7 truncated");
    return Internal(w.label + ": out of memory");  // names itself already
  });
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_EQ(s.message(), "http://127.0.0.1:1 worker dp0/tp1: chunk 3/7 truncated");
  s = RunOnEveryWorker(workers_, "test", Deadline::InSeconds(10), [&](size_t i, const ReceiverWorker& w) {
    return i == 2 ? Internal(w.label + ": out of memory") : Status::Ok();
  });
  EXPECT_EQ(s.message(), "http://127.0.0.1:1 worker dp0/tp2: out of memory");
  // RunOnWorker leaves the naming to its caller.
  EXPECT_EQ(RunOnWorker(workers_[0], [] { return Unavailable("gone"); }).message(), "gone");
}

TEST_F(WorkerFanoutTest, ATaskPastItsDeadlineIsWaitedFor) {
  std::atomic<int> finished{0};
  Status s = RunOnEveryWorker(workers_, "test", Deadline::InSeconds(0), [&](size_t i, const ReceiverWorker&) {
    std::this_thread::sleep_for(std::chrono::milliseconds(i == 0 ? 200 : 0));
    finished.fetch_add(1);
    return Status::Ok();
  });
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(finished.load(), 3);
  EXPECT_TRUE(RunOnEveryWorker(workers_, "test", Deadline::Never(), [](size_t, const ReceiverWorker&) {
                return Status::Ok();
              }).ok());
}

}  // namespace
}  // namespace wsync
