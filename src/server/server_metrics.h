// ServerMetrics: what an inference server counts for GET /metrics, and the Prometheus
// text exposition (format 0.0.4) of it.
//
// Two kinds of values. Events are recorded as they happen, into prometheus-cpp
// instruments: each weight-update operation's duration, whether it is in flight and how
// it ended, the bytes of the updates that landed, verification failures. State is read
// when a scrape asks (State): how sessions ended (ReceiverSession counts them), whether
// the weights are consistent, the weight version, the generation's queue. Text() writes
// both, families sorted by name and samples by labels, so that equal counts give equal
// text.
// Names: vLLM's own where one fits (vllm:rl_weight_update_operation_duration_seconds
// and vllm:rl_weight_update_operations_in_flight with their single `operation` label,
// vllm:num_requests_running/waiting with `model_name`), so dashboards built for vLLM
// read wsync serve unchanged; wsync's own under the prefix `wsync_`, each carrying the
// labels `backend` and `model`. docs/server.md lists every one.
// Thread-safe: any thread may record or scrape at any time; nothing blocks for longer
// than a copy of the counters.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "receiver/session.h"
#include "wsync/status.h"

namespace prometheus {
class Registry;
}  // namespace prometheus

namespace wsync {

// The weight-transfer calls whose duration vLLM measures, by its `operation` label.
enum class WeightOperation { kInit, kStart, kStartDraft, kUpdate, kFinish };
inline constexpr int kWeightOperations = 5;
// "init", "start", "start_draft", "update", "finish".
std::string_view WeightOperationName(WeightOperation op);

// How a call ended, by wsync_weight_update_operations_total's `outcome` label: "ok";
// "refused" (InvalidArgument, FailedPrecondition, Aborted: a bad payload, a call in the
// wrong session state, a peer's veto; nothing landed); "failed" (every other error).
std::string_view OutcomeName(StatusCode code);

class ServerMetrics {
 public:
  using Clock = std::chrono::steady_clock;

  // `backend` and `model` label every wsync_ metric.
  ServerMetrics(std::string backend, std::string model);
  ~ServerMetrics();
  ServerMetrics(const ServerMetrics&) = delete;
  ServerMetrics& operator=(const ServerMetrics&) = delete;

  // Runs `call` (returning a Status) as operation `op`: in flight while it runs, then its
  // duration and outcome recorded, however it ends.
  template <typename F>
  Status Measure(WeightOperation op, F&& call) {
    InFlight scope(this, op);
    Status s = call();
    scope.outcome = s.code();
    return s;
  }
  // One finished call of `op` that took `seconds` and ended with `outcome` (Measure's
  // second half; tests call it with exact durations).
  void Record(WeightOperation op, double seconds, StatusCode outcome);
  // An update that landed `tensors` full HF tensors of `bytes` bytes in all.
  void AddReceived(uint64_t tensors, uint64_t bytes);

  // What a verification failure was found by (the `check` label).
  enum class Check {
    kData,      // "data": a received payload failed its checksum (a call answered DataLoss)
    kReplicas,  // "replicas": a checksum read-back found data-parallel replicas differing
    kCompare,   // "compare": a /weight_checker compare found mismatching parameters
    kInline,    // "inline": a finish found held tensors differing from the trainer's digests
  };
  void VerificationFailed(Check check);

  // The server's state as of a scrape.
  struct State {
    ReceiverSession::Snapshot session;
    std::string weight_version;  // valid UTF-8 (it arrives in JSON), at most 256 bytes
    bool paused = false;         // generation paused (/pause)
    int64_t requests_running = 0;
    int64_t requests_waiting = 0;
  };
  // The exposition: HELP and TYPE lines, then one sample per line.
  std::string Text(const State& state) const;

 private:
  class InFlight {
   public:
    InFlight(ServerMetrics* owner, WeightOperation op);
    ~InFlight();
    InFlight(const InFlight&) = delete;
    InFlight& operator=(const InFlight&) = delete;
    StatusCode outcome = StatusCode::kInternal;  // an exception went through it

   private:
    ServerMetrics* owner_;
    WeightOperation op_;
    Clock::time_point started_;
  };
  struct Instruments;  // server_metrics.cc

  const std::string backend_;
  const std::string model_;
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<Instruments> instruments_;
};

}  // namespace wsync
