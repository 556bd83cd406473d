// One worker of an InferenceServer: its shards, the thread that runs its tasks (with its
// device current), and where it sits in the deployment. Private to the server's sources.
#pragma once

#include <memory>

#include "model/worker_store.h"
#include "quant/fp8_sink.h"
#include "server/inference_server.h"
#include "receiver/worker_thread.h"

namespace wsync {

struct InferenceServer::Worker {
  std::unique_ptr<WorkerStore> store;
  // --quantization fp8: the sink the backends land through (it owns the fp8 weights and
  // lands the model-dtype bytes in `store`); null otherwise.
  std::unique_ptr<Fp8WorkerSink> fp8;
  WorkerSink* sink() const { return fp8 ? static_cast<WorkerSink*>(fp8.get()) : store.get(); }
  std::unique_ptr<WorkerThread> thread;
  int dp_index = 0;
  int tp_rank = 0;
  Device device;
};

}  // namespace wsync
