#include "server/server_metrics.h"

#include <algorithm>
#include <utility>
#include <vector>

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

namespace wsync {
namespace {

constexpr WeightOperation kAllOperations[] = {WeightOperation::kInit, WeightOperation::kStart,
                                              WeightOperation::kStartDraft, WeightOperation::kUpdate,
                                              WeightOperation::kFinish};
constexpr std::string_view kOutcomes[] = {"ok", "refused", "failed"};
constexpr std::string_view kChecks[] = {"data", "replicas", "compare", "inline"};
// vLLM's buckets for the operation durations, in seconds.
const std::vector<double> kDurationBuckets = {0.01, 0.1, 1, 10, 30, 60, 120, 300, 600};

int OutcomeIndex(StatusCode code) {
  const std::string_view name = OutcomeName(code);
  return static_cast<int>(std::find(std::begin(kOutcomes), std::end(kOutcomes), name) - std::begin(kOutcomes));
}

prometheus::ClientMetric Sample(prometheus::Labels labels, double value, prometheus::MetricType type) {
  prometheus::ClientMetric m;
  for (auto& [name, v] : labels) m.label.push_back({name, v});
  if (type == prometheus::MetricType::Counter) {
    m.counter.value = value;
  } else {
    m.gauge.value = value;
  }
  return m;
}

}  // namespace

std::string_view WeightOperationName(WeightOperation op) {
  switch (op) {
    case WeightOperation::kInit: return "init";
    case WeightOperation::kStart: return "start";
    case WeightOperation::kStartDraft: return "start_draft";
    case WeightOperation::kUpdate: return "update";
    case WeightOperation::kFinish: return "finish";
  }
  return "unknown";
}

std::string_view OutcomeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "ok";
    case StatusCode::kInvalidArgument:
    case StatusCode::kFailedPrecondition:
    case StatusCode::kAborted: return "refused";
    default: return "failed";
  }
}

struct ServerMetrics::Instruments {
  prometheus::Histogram* duration[kWeightOperations];
  prometheus::Gauge* in_flight[kWeightOperations];
  prometheus::Counter* outcomes[kWeightOperations][3];
  prometheus::Counter* tensors;
  prometheus::Counter* bytes;
  prometheus::Counter* checks[std::size(kChecks)];
};

ServerMetrics::ServerMetrics(std::string backend, std::string model)
    : backend_(std::move(backend)),
      model_(std::move(model)),
      registry_(std::make_shared<prometheus::Registry>()),
      instruments_(std::make_unique<Instruments>()) {
  using prometheus::BuildCounter;
  const prometheus::Labels base{{"backend", backend_}, {"model", model_}};
  auto with = [&](const char* name, std::string_view value) {
    prometheus::Labels l = base;
    l.emplace(name, std::string(value));
    return l;
  };
  auto& duration = prometheus::BuildHistogram()
                       .Name("vllm:rl_weight_update_operation_duration_seconds")
                       .Help("Duration of one weight-transfer operation.")
                       .Register(*registry_);
  auto& in_flight = prometheus::BuildGauge()
                        .Name("vllm:rl_weight_update_operations_in_flight")
                        .Help("Weight-transfer operations currently awaited.")
                        .Register(*registry_);
  auto& outcomes = BuildCounter()
                       .Name("wsync_weight_update_operations_total")
                       .Help("Weight-transfer operations answered, by outcome (ok, refused, failed).")
                       .Register(*registry_);
  // Every sample exists from the start, at 0, so that a rate over the first event works.
  for (WeightOperation op : kAllOperations) {
    const int i = static_cast<int>(op);
    const prometheus::Labels only_op{{"operation", std::string(WeightOperationName(op))}};
    instruments_->duration[i] = &duration.Add(only_op, kDurationBuckets);
    instruments_->in_flight[i] = &in_flight.Add(only_op);
    for (int o = 0; o < 3; ++o) {
      prometheus::Labels l = with("operation", WeightOperationName(op));
      l.emplace("outcome", std::string(kOutcomes[o]));
      instruments_->outcomes[i][o] = &outcomes.Add(l);
    }
  }
  instruments_->tensors = &BuildCounter()
                               .Name("wsync_weight_update_received_tensors_total")
                               .Help("Full HF tensors landed by updates that succeeded.")
                               .Register(*registry_)
                               .Add(base);
  instruments_->bytes = &BuildCounter()
                             .Name("wsync_weight_update_received_bytes_total")
                             .Help("Bytes of the full HF tensors landed by updates that succeeded.")
                             .Register(*registry_)
                             .Add(base);
  auto& checks = BuildCounter()
                     .Name("wsync_verification_failures_total")
                     .Help("Verification failures, by the check that found them (data, replicas, compare, inline).")
                     .Register(*registry_);
  for (size_t c = 0; c < std::size(kChecks); ++c) instruments_->checks[c] = &checks.Add(with("check", kChecks[c]));
}

ServerMetrics::~ServerMetrics() = default;

void ServerMetrics::Record(WeightOperation op, double seconds, StatusCode outcome) {
  const int i = static_cast<int>(op);
  instruments_->duration[i]->Observe(std::max(0.0, seconds));
  instruments_->outcomes[i][OutcomeIndex(outcome)]->Increment();
}

void ServerMetrics::AddReceived(uint64_t tensors, uint64_t bytes) {
  instruments_->tensors->Increment(static_cast<double>(tensors));
  instruments_->bytes->Increment(static_cast<double>(bytes));
}

void ServerMetrics::VerificationFailed(Check check) { instruments_->checks[static_cast<int>(check)]->Increment(); }

ServerMetrics::InFlight::InFlight(ServerMetrics* owner, WeightOperation op)
    : owner_(owner), op_(op), started_(Clock::now()) {
  owner_->instruments_->in_flight[static_cast<int>(op_)]->Increment();
}

ServerMetrics::InFlight::~InFlight() {
  owner_->instruments_->in_flight[static_cast<int>(op_)]->Decrement();
  owner_->Record(op_, std::chrono::duration<double>(Clock::now() - started_).count(), outcome);
}

std::string ServerMetrics::Text(const State& state) const {
  using prometheus::MetricType;
  std::vector<prometheus::MetricFamily> families = registry_->Collect();
  const prometheus::Labels base{{"backend", backend_}, {"model", model_}};
  auto family = [&](const char* name, const char* help, MetricType type) -> prometheus::MetricFamily& {
    families.push_back(prometheus::MetricFamily{name, help, type, {}});
    return families.back();
  };
  auto one = [&](const char* name, const char* help, MetricType type, double value) {
    family(name, help, type).metric.push_back(Sample(base, value, type));
  };
  auto with = [&](const char* name, const std::string& value) {
    prometheus::Labels l = base;
    l.emplace(name, value);
    return l;
  };
  const ReceiverSession::Snapshot& s = state.session;
  one("wsync_weight_update_sessions_started_total",
      "Weight-update sessions opened (a start or start_draft answered OK).", MetricType::Counter,
      s.started_sessions);
  one("wsync_weight_update_sessions_finished_total",
      "Weight-update sessions finished (finish_weight_update answered OK).", MetricType::Counter,
      s.finished_sessions);
  auto& failed = family("wsync_weight_update_sessions_failed_total",
                        "Weight-update sessions that ended without finishing, by reason.", MetricType::Counter);
  const std::pair<const char*, int> reasons[] = {{"update_failed", s.failed_update_sessions},
                                                 {"finish_failed", s.failed_finish_sessions},
                                                 {"expired", s.expired_sessions},
                                                 {"taken_over", s.taken_over_sessions}};
  for (const auto& [reason, count] : reasons) {
    failed.metric.push_back(Sample(with("reason", reason), count, MetricType::Counter));
  }
  one("wsync_weight_update_session_active", "1 while a weight-update session is open.", MetricType::Gauge,
      s.active ? 1 : 0);
  one("wsync_weights_consistent", "1 unless bytes of an unfinished session (or a reset) may be in the weights.",
      MetricType::Gauge, s.consistent ? 1 : 0);
  family("wsync_weight_version_info", "The weight version served, as the label 'version'.", MetricType::Gauge)
      .metric.push_back(Sample(with("version", state.weight_version), 1, MetricType::Gauge));
  one("wsync_generation_paused", "1 while generation is paused (/pause).", MetricType::Gauge, state.paused ? 1 : 0);
  const prometheus::Labels model_name{{"model_name", model_}};
  family("vllm:num_requests_running", "Number of requests in model execution batches.", MetricType::Gauge)
      .metric.push_back(Sample(model_name, static_cast<double>(state.requests_running), MetricType::Gauge));
  family("vllm:num_requests_waiting", "Number of requests waiting to be processed.", MetricType::Gauge)
      .metric.push_back(Sample(model_name, static_cast<double>(state.requests_waiting), MetricType::Gauge));

  std::sort(families.begin(), families.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  for (prometheus::MetricFamily& f : families) {
    std::sort(f.metric.begin(), f.metric.end(), [](const auto& a, const auto& b) { return a.label < b.label; });
  }
  return prometheus::TextSerializer().Serialize(families);
}

}  // namespace wsync
