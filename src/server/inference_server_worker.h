// One worker of an InferenceServer: its shards, the thread that runs its tasks (with its
// device current), and where it sits in the deployment. Private to the server's sources.
#pragma once

#include <exception>
#include <memory>

#include <fmt/format.h>

#include "model/worker_store.h"
#include "quant/fp8_sink.h"
#include "receiver/lora_store.h"
#include "server/inference_server.h"
#include "core/log.h"
#include "receiver/worker_thread.h"

namespace wsync {

struct InferenceServer::Worker {
  std::unique_ptr<WorkerStore> store;
  // --quantization fp8: the sink the backends land through (it owns the fp8 weights and
  // lands the model-dtype bytes in `store`); null otherwise.
  std::unique_ptr<Fp8WorkerSink> fp8;
  WorkerSink* sink() const { return fp8 ? static_cast<WorkerSink*>(fp8.get()) : store.get(); }
  // The LoRA adapters this worker holds and the staging of the next version.
  std::unique_ptr<LoraStore> lora;
  std::unique_ptr<WorkerThread> thread;
  int dp_index = 0;
  int tp_rank = 0;
  Device device;
};

// Runs one backend call: an exception it throws (a bug, or an allocation that failed)
// becomes Internal naming the route, so that it reaches the trainer as a 500 and the
// call's ReceiverSession::Call still frees the server.
template <typename F>
auto CatchAll(const char* route, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const std::exception& e) {
    WSYNC_LOG_ERROR("{} threw: {}", route, e.what());
    return Internal(fmt::format("{} failed: {}", route, e.what()));
  } catch (...) {
    WSYNC_LOG_ERROR("{} threw a non-standard exception", route);
    return Internal(fmt::format("{} failed: unknown exception", route));
  }
}

}  // namespace wsync
