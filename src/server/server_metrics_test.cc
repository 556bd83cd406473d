// The /metrics exposition, exactly: which families appear and in what order, every
// sample of them with its labels and value, label escaping, and what Measure records
// while a call runs and after it ends.
#include "server/server_metrics.h"

#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

namespace wsync {
namespace {

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

// The HELP, TYPE and sample lines of family `name`, each ending in a newline.
std::string Family(const std::string& text, const std::string& name) {
  std::string out;
  bool in = false;
  for (const std::string& line : Lines(text)) {
    if (line.rfind("# HELP ", 0) == 0) in = line.rfind("# HELP " + name + " ", 0) == 0;
    if (in) out += line + "\n";
  }
  return out;
}

// The sample lines of `text` that contain `needle`.
std::string Samples(const std::string& text, const std::string& needle) {
  std::string out;
  for (const std::string& line : Lines(text)) {
    if (line[0] != '#' && line.find(needle) != std::string::npos) out += line + "\n";
  }
  return out;
}

class ServerMetricsTest : public ::testing::Test {
 protected:
  ServerMetrics metrics_{"nccl", "qwen3-toy"};
};

TEST_F(ServerMetricsTest, FamiliesAreSortedByName) {
  std::vector<std::string> names;
  for (const std::string& line : Lines(metrics_.Text({}))) {
    if (line.rfind("# TYPE ", 0) == 0) names.push_back(line.substr(7));
  }
  EXPECT_EQ(names, (std::vector<std::string>{
                       "vllm:num_requests_running gauge",
                       "vllm:num_requests_waiting gauge",
                       "vllm:rl_weight_update_operation_duration_seconds histogram",
                       "vllm:rl_weight_update_operations_in_flight gauge",
                       "wsync_generation_paused gauge",
                       "wsync_verification_failures_total counter",
                       "wsync_weight_update_operations_total counter",
                       "wsync_weight_update_received_bytes_total counter",
                       "wsync_weight_update_received_tensors_total counter",
                       "wsync_weight_update_session_active gauge",
                       "wsync_weight_update_sessions_failed_total counter",
                       "wsync_weight_update_sessions_finished_total counter",
                       "wsync_weight_update_sessions_started_total counter",
                       "wsync_weight_version_info gauge",
                       "wsync_weights_consistent gauge",
                   }));
}

TEST_F(ServerMetricsTest, EventsAreCountedExactly) {
  metrics_.Record(WeightOperation::kStart, 0.002, StatusCode::kOk);
  metrics_.Record(WeightOperation::kUpdate, 0.5, StatusCode::kOk);
  metrics_.Record(WeightOperation::kUpdate, 0.25, StatusCode::kFailedPrecondition);
  metrics_.Record(WeightOperation::kFinish, 12, StatusCode::kDataLoss);
  metrics_.AddReceived(3, 4096);
  metrics_.AddReceived(2, 1024);
  metrics_.VerificationFailed(ServerMetrics::Check::kData);
  const std::string text = metrics_.Text({});

  EXPECT_EQ(Samples(text, "operation=\"update\""),
            "vllm:rl_weight_update_operation_duration_seconds_count{operation=\"update\"} 2\n"
            "vllm:rl_weight_update_operation_duration_seconds_sum{operation=\"update\"} 0.75\n"
            "vllm:rl_weight_update_operation_duration_seconds_bucket{operation=\"update\",le=\"0.01\"} 0\n"
            "vllm:rl_weight_update_operation_duration_seconds_bucket{operation=\"update\",le=\"0.1\"} 0\n"
            "vllm:rl_weight_update_operation_duration_seconds_bucket{operation=\"update\",le=\"1\"} 2\n"
            "vllm:rl_weight_update_operation_duration_seconds_bucket{operation=\"update\",le=\"10\"} 2\n"
            "vllm:rl_weight_update_operation_duration_seconds_bucket{operation=\"update\",le=\"30\"} 2\n"
            "vllm:rl_weight_update_operation_duration_seconds_bucket{operation=\"update\",le=\"60\"} 2\n"
            "vllm:rl_weight_update_operation_duration_seconds_bucket{operation=\"update\",le=\"120\"} 2\n"
            "vllm:rl_weight_update_operation_duration_seconds_bucket{operation=\"update\",le=\"300\"} 2\n"
            "vllm:rl_weight_update_operation_duration_seconds_bucket{operation=\"update\",le=\"600\"} 2\n"
            "vllm:rl_weight_update_operation_duration_seconds_bucket{operation=\"update\",le=\"+Inf\"} 2\n"
            "vllm:rl_weight_update_operations_in_flight{operation=\"update\"} 0\n"
            "wsync_weight_update_operations_total{backend=\"nccl\",model=\"qwen3-toy\",operation=\"update\","
            "outcome=\"failed\"} 0\n"
            "wsync_weight_update_operations_total{backend=\"nccl\",model=\"qwen3-toy\",operation=\"update\","
            "outcome=\"ok\"} 1\n"
            "wsync_weight_update_operations_total{backend=\"nccl\",model=\"qwen3-toy\",operation=\"update\","
            "outcome=\"refused\"} 1\n");
  EXPECT_EQ(Samples(text, "_sum{"),
            "vllm:rl_weight_update_operation_duration_seconds_sum{operation=\"finish\"} 12\n"
            "vllm:rl_weight_update_operation_duration_seconds_sum{operation=\"init\"} 0\n"
            "vllm:rl_weight_update_operation_duration_seconds_sum{operation=\"start\"} 0.002\n"
            "vllm:rl_weight_update_operation_duration_seconds_sum{operation=\"start_draft\"} 0\n"
            "vllm:rl_weight_update_operation_duration_seconds_sum{operation=\"update\"} 0.75\n");
  EXPECT_EQ(Samples(text, "operation=\"finish\",outcome"),
            "wsync_weight_update_operations_total{backend=\"nccl\",model=\"qwen3-toy\",operation=\"finish\","
            "outcome=\"failed\"} 1\n"
            "wsync_weight_update_operations_total{backend=\"nccl\",model=\"qwen3-toy\",operation=\"finish\","
            "outcome=\"ok\"} 0\n"
            "wsync_weight_update_operations_total{backend=\"nccl\",model=\"qwen3-toy\",operation=\"finish\","
            "outcome=\"refused\"} 0\n");
  EXPECT_EQ(Family(text, "wsync_weight_update_received_bytes_total") +
                Family(text, "wsync_weight_update_received_tensors_total"),
            "# HELP wsync_weight_update_received_bytes_total Bytes of the full HF tensors landed by updates that "
            "succeeded.\n"
            "# TYPE wsync_weight_update_received_bytes_total counter\n"
            "wsync_weight_update_received_bytes_total{backend=\"nccl\",model=\"qwen3-toy\"} 5120\n"
            "# HELP wsync_weight_update_received_tensors_total Full HF tensors landed by updates that succeeded.\n"
            "# TYPE wsync_weight_update_received_tensors_total counter\n"
            "wsync_weight_update_received_tensors_total{backend=\"nccl\",model=\"qwen3-toy\"} 5\n");
  EXPECT_EQ(Family(text, "wsync_verification_failures_total"),
            "# HELP wsync_verification_failures_total Verification failures, by the check that found them (data, "
            "replicas, compare, inline).\n"
            "# TYPE wsync_verification_failures_total counter\n"
            "wsync_verification_failures_total{backend=\"nccl\",check=\"compare\",model=\"qwen3-toy\"} 0\n"
            "wsync_verification_failures_total{backend=\"nccl\",check=\"data\",model=\"qwen3-toy\"} 1\n"
            "wsync_verification_failures_total{backend=\"nccl\",check=\"inline\",model=\"qwen3-toy\"} 0\n"
            "wsync_verification_failures_total{backend=\"nccl\",check=\"replicas\",model=\"qwen3-toy\"} 0\n");
}

TEST_F(ServerMetricsTest, StateIsReadAsOfTheScrape) {
  ServerMetrics::State s;
  s.session.active = true;
  s.session.consistent = false;
  s.session.started_sessions = 7;
  s.session.finished_sessions = 2;
  s.session.failed_update_sessions = 1;
  s.session.failed_finish_sessions = 1;
  s.session.expired_sessions = 1;
  s.session.taken_over_sessions = 1;
  s.paused = true;
  s.requests_running = 3;
  s.requests_waiting = 4;
  s.weight_version = "step-9";
  const std::string text = metrics_.Text(s);
  EXPECT_EQ(Family(text, "wsync_weight_update_sessions_failed_total") +
                Family(text, "wsync_weight_update_sessions_finished_total") +
                Family(text, "wsync_weight_update_sessions_started_total"),
            "# HELP wsync_weight_update_sessions_failed_total Weight-update sessions that ended without finishing, by "
            "reason.\n"
            "# TYPE wsync_weight_update_sessions_failed_total counter\n"
            "wsync_weight_update_sessions_failed_total{backend=\"nccl\",model=\"qwen3-toy\",reason=\"expired\"} 1\n"
            "wsync_weight_update_sessions_failed_total{backend=\"nccl\",model=\"qwen3-toy\",reason=\"finish_failed\"} "
            "1\n"
            "wsync_weight_update_sessions_failed_total{backend=\"nccl\",model=\"qwen3-toy\",reason=\"taken_over\"} 1\n"
            "wsync_weight_update_sessions_failed_total{backend=\"nccl\",model=\"qwen3-toy\",reason=\"update_failed\"} "
            "1\n"
            "# HELP wsync_weight_update_sessions_finished_total Weight-update sessions finished "
            "(finish_weight_update answered OK).\n"
            "# TYPE wsync_weight_update_sessions_finished_total counter\n"
            "wsync_weight_update_sessions_finished_total{backend=\"nccl\",model=\"qwen3-toy\"} 2\n"
            "# HELP wsync_weight_update_sessions_started_total Weight-update sessions opened (a start or start_draft "
            "answered OK).\n"
            "# TYPE wsync_weight_update_sessions_started_total counter\n"
            "wsync_weight_update_sessions_started_total{backend=\"nccl\",model=\"qwen3-toy\"} 7\n");
  // Every sample belongs to one of the families, in name order.
  EXPECT_EQ(Samples(text, "} "),
            Samples(text, "vllm:num_requests") + Samples(text, "vllm:rl_weight_update_") +
                Samples(text, "wsync_generation_paused") + Samples(text, "wsync_verification") +
                Samples(text, "wsync_weight_update_operations") + Samples(text, "wsync_weight_update_received") +
                Samples(text, "wsync_weight_update_session") + Samples(text, "wsync_weight_version") +
                Samples(text, "wsync_weights_"));
  EXPECT_EQ(Samples(text, "vllm:num_requests") + Samples(text, "wsync_generation_paused") +
                Samples(text, "wsync_weight_update_session_active") + Samples(text, "wsync_weight_version") +
                Samples(text, "wsync_weights_"),
            "vllm:num_requests_running{model_name=\"qwen3-toy\"} 3\n"
            "vllm:num_requests_waiting{model_name=\"qwen3-toy\"} 4\n"
            "wsync_generation_paused{backend=\"nccl\",model=\"qwen3-toy\"} 1\n"
            "wsync_weight_update_session_active{backend=\"nccl\",model=\"qwen3-toy\"} 1\n"
            "wsync_weight_version_info{backend=\"nccl\",model=\"qwen3-toy\",version=\"step-9\"} 1\n"
            "wsync_weights_consistent{backend=\"nccl\",model=\"qwen3-toy\"} 0\n");
}

// Label values escape backslash, double quote and newline (text format 0.0.4).
TEST_F(ServerMetricsTest, TheVersionLabelIsEscaped) {
  ServerMetrics::State s;
  s.weight_version = "step \"7\"\\n\nnext";
  EXPECT_EQ(Samples(metrics_.Text(s), "version="),
            "wsync_weight_version_info{backend=\"nccl\",model=\"qwen3-toy\","
            "version=\"step \\\"7\\\"\\\\n\\nnext\"} 1\n");
  ServerMetrics odd{"a\"b", "c\\d"};
  EXPECT_EQ(Samples(odd.Text({}), "wsync_weights_consistent"),
            "wsync_weights_consistent{backend=\"a\\\"b\",model=\"c\\\\d\"} 1\n");
}

TEST_F(ServerMetricsTest, MeasureCountsTheCallInFlightThenItsOutcome) {
  std::string during;
  Status s = metrics_.Measure(WeightOperation::kInit, [&] {
    during = metrics_.Text({});
    return InvalidArgument("init_info of another backend");
  });
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Samples(during, "in_flight{operation=\"init\"}"),
            "vllm:rl_weight_update_operations_in_flight{operation=\"init\"} 1\n");
  EXPECT_EQ(Samples(during, "_count{operation=\"init\"}"),
            "vllm:rl_weight_update_operation_duration_seconds_count{operation=\"init\"} 0\n");
  const std::string after = metrics_.Text({});
  EXPECT_EQ(Samples(after, "in_flight{operation=\"init\"}"),
            "vllm:rl_weight_update_operations_in_flight{operation=\"init\"} 0\n");
  EXPECT_EQ(Samples(after, "_count{operation=\"init\"}"),
            "vllm:rl_weight_update_operation_duration_seconds_count{operation=\"init\"} 1\n");
  EXPECT_EQ(Samples(after, "operation=\"init\",outcome=\"refused\""),
            "wsync_weight_update_operations_total{backend=\"nccl\",model=\"qwen3-toy\",operation=\"init\","
            "outcome=\"refused\"} 1\n");
  EXPECT_EQ(OutcomeName(StatusCode::kAborted), "refused");
  EXPECT_EQ(OutcomeName(StatusCode::kDeadlineExceeded), "failed");
  EXPECT_EQ(OutcomeName(StatusCode::kDataLoss), "failed");
}

}  // namespace
}  // namespace wsync
