// Running a backend's work on its workers' own threads.
//
// A receiver backend lands bytes in each worker's shards on that worker's thread
// (WorkerThread: CUDA's current device is per thread). RunOnEveryWorker posts one task
// per worker, waits for all of them and returns the first failure in worker order, named
// by the worker's label ("http://127.0.0.1:8001 worker dp0/tp1") unless the task's
// message names it already. Tasks borrow the caller's state, so the fan-out waits for
// every task however long it runs: each task bounds its own waits by `deadline`, and one
// that runs kLateWorkerGraceSeconds past it is logged once, by name, as it keeps
// waiting. Thread-safe; blocks the caller until every task has ended.
#pragma once

#include <cstddef>
#include <functional>
#include <string_view>
#include <vector>

#include "core/deadline.h"
#include "receiver/backend.h"
#include "wsync/status.h"

namespace wsync {

// Seconds past its deadline after which a worker's task is reported as late.
inline constexpr double kLateWorkerGraceSeconds = 5;

// Runs task(i, workers[i]) on every worker's thread; `what` names the work in logs
// ("update", "init").
Status RunOnEveryWorker(const std::vector<ReceiverWorker>& workers, std::string_view what, Deadline deadline,
                        const std::function<Status(size_t index, const ReceiverWorker& worker)>& task);

// Runs `task` on one worker's thread (where its device is current) and waits for it;
// returns the task's Status as it is (the caller names the worker in its own words).
Status RunOnWorker(const ReceiverWorker& worker, std::function<Status()> task);

}  // namespace wsync
