// One worker of an InferenceServer: its shards, the thread that runs its tasks (with its
// device current), and where it sits in the deployment. Private to the server's sources.
#pragma once

#include <memory>

#include "model/worker_store.h"
#include "receiver/inference_server.h"
#include "receiver/worker_thread.h"

namespace wsync {

struct InferenceServer::Worker {
  std::unique_ptr<WorkerStore> store;
  std::unique_ptr<WorkerThread> thread;
  int dp_index = 0;
  int tp_rank = 0;
  Device device;
};

}  // namespace wsync
