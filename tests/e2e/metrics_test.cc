// GET /metrics of a live `wsync serve`, counted exactly: two verified trainer syncs; calls
// refused outside and inside a session; a runtime checker compare that finds a mismatch.
// Each is read back as the exact sample values of the Prometheus exposition.
#include <map>
#include <sstream>
#include <string>

#include <fmt/format.h>
#include <httplib.h>

#include "e2e_test_base.h"
#include "model/config.h"

namespace wsync::e2e {
namespace {

using nlohmann::json;

// Sample -> value, e.g. `wsync_weights_consistent{backend="nccl",model="qwen3-tiny"}` -> 1.
using Samples = std::map<std::string, double>;

class MetricsTest : public E2eTest {
 protected:
  // Scrapes `url`/metrics: 200, Prometheus's content type, every line a comment (HELP or
  // TYPE) or `name{labels} value`.
  Samples Scrape(const std::string& url) {
    Samples out;
    const std::string host_port = url.substr(url.find("//") + 2);
    const size_t colon = host_port.rfind(':');
    httplib::Client cli(host_port.substr(0, colon), std::stoi(host_port.substr(colon + 1)));
    cli.set_read_timeout(10, 0);
    auto r = cli.Get("/metrics");
    if (!r) {
      ADD_FAILURE() << "GET /metrics: no reply";
      return out;
    }
    EXPECT_EQ(r->status, 200) << r->body;
    EXPECT_EQ(r->get_header_value("Content-Type"), "text/plain; version=0.0.4; charset=utf-8");
    std::istringstream lines(r->body);
    for (std::string line; std::getline(lines, line);) {
      if (line.rfind("# HELP ", 0) == 0 || line.rfind("# TYPE ", 0) == 0) continue;
      const size_t space = line.rfind(' ');
      EXPECT_TRUE(space != std::string::npos && line[space - 1] == '}') << "not a sample: " << line;
      if (space == std::string::npos) continue;
      EXPECT_TRUE(out.emplace(line.substr(0, space), std::stod(line.substr(space + 1))).second)
          << "sample twice: " << line;
    }
    return out;
  }
  // The value of `name` with wsync's labels (backend, model) and `labels`, or -1 when
  // absent. Labels are written sorted by name, as the server writes them.
  double Value(const Samples& s, const std::string& name, std::map<std::string, std::string> labels = {}) {
    labels.emplace("backend", "nccl");
    labels.emplace("model", model_);
    std::string key = name + "{";
    for (const auto& [k, v] : labels) key += fmt::format("{}{}=\"{}\"", key.back() == '{' ? "" : ",", k, v);
    auto it = s.find(key + "}");
    return it == s.end() ? -1 : it->second;
  }
  // The value of sample `key` (name and labels as written), or -1 when absent.
  static double At(const Samples& s, const std::string& key) {
    auto it = s.find(key);
    return it == s.end() ? -1 : it->second;
  }
  double Ops(const Samples& s, const char* operation, const char* outcome) {
    return Value(s, "wsync_weight_update_operations_total", {{"operation", operation}, {"outcome", outcome}});
  }
  double Failed(const Samples& s, const char* reason) {
    return Value(s, "wsync_weight_update_sessions_failed_total", {{"reason", reason}});
  }

  std::string model_ = "qwen3-tiny";
};

TEST_F(MetricsTest, TwoVerifiedSyncsAreCountedExactly) {
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("s", {"--model", model_, "--timeout", "30"}));
  Samples before = Scrape(s.url);
  EXPECT_EQ(Value(before, "wsync_weight_update_sessions_started_total"), 0);
  EXPECT_EQ(Value(before, "wsync_weights_consistent"), 1);
  EXPECT_EQ(Value(before, "wsync_weight_version_info", {{"version", "default"}}), 1);

  for (uint64_t seed : {41, 42}) {
    RunResult push = Push("push_" + std::to_string(seed), {s},
                          {"--model", model_, "--seed", std::to_string(seed), "--verify", "--timeout", "30"});
    ASSERT_TRUE(push.success()) << push.description << "\n--- server ---\n" << s.process->Describe();
    EXPECT_TRUE(HasVerifiedTable(push.out, 1));
  }
  E2E_ASSERT_OK_AND_ASSIGN(ModelConfig config, LookupModel(model_));
  double tensors = 0, bytes = 0;
  for (const TensorMeta& t : HfTensors(config)) {
    tensors += 1;
    bytes += static_cast<double>(t.nbytes());
  }
  const std::string version = HttpGet(s.url, "/weight_info").json.value("weight_version", "");

  Samples m = Scrape(s.url);
  EXPECT_EQ(Value(m, "wsync_weight_update_sessions_started_total"), 2);
  EXPECT_EQ(Value(m, "wsync_weight_update_sessions_finished_total"), 2);
  for (const char* reason : {"update_failed", "finish_failed", "expired", "taken_over"}) {
    EXPECT_EQ(Failed(m, reason), 0) << reason;
  }
  EXPECT_EQ(Value(m, "wsync_weights_consistent"), 1);
  EXPECT_EQ(Value(m, "wsync_weight_update_session_active"), 0);
  EXPECT_EQ(Value(m, "wsync_weight_version_info", {{"version", version}}), 1) << version;
  for (const char* op : {"init", "start", "update", "finish"}) {
    EXPECT_EQ(Ops(m, op, "ok"), 2) << op;
    EXPECT_EQ(Ops(m, op, "refused"), 0) << op;
    EXPECT_EQ(Ops(m, op, "failed"), 0) << op;
    const std::string label = fmt::format("{{operation=\"{}\"}}", op);
    EXPECT_EQ(At(m, "vllm:rl_weight_update_operation_duration_seconds_count" + label), 2) << op;
    EXPECT_EQ(At(m, "vllm:rl_weight_update_operation_duration_seconds_bucket{operation=\"" + std::string(op) +
                "\",le=\"+Inf\"}"), 2) << op;
    EXPECT_GT(At(m, "vllm:rl_weight_update_operation_duration_seconds_sum" + label), 0) << op;
    EXPECT_EQ(At(m, "vllm:rl_weight_update_operations_in_flight" + label), 0) << op;
  }
  EXPECT_EQ(Value(m, "wsync_weight_update_received_tensors_total"), 2 * tensors);
  EXPECT_EQ(Value(m, "wsync_weight_update_received_bytes_total"), 2 * bytes);
  for (const char* check : {"data", "replicas", "compare"}) {
    EXPECT_EQ(Value(m, "wsync_verification_failures_total", {{"check", check}}), 0) << check;
  }
  EXPECT_EQ(At(m, "vllm:num_requests_running{model_name=\"" + model_ + "\"}"), 0);
  EXPECT_EQ(Value(m, "wsync_generation_paused"), 0);
}

// On a server no trainer has joined (so a refused update reaches no data plane): calls
// refused outside and inside a session, and a runtime checker compare that mismatches.
TEST_F(MetricsTest, RefusalsAndACompareMismatchAreCountedExactly) {
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("s", {"--model", model_, "--timeout", "30"}));
  // An update outside a session is refused and ends no session.
  const json update = {{"update_info", {{"names", json::array()}, {"dtype_names", json::array()},
                                        {"shapes", json::array()}}}};
  EXPECT_EQ(HttpPostJson(s.url, "/update_weights", update).status, 409);
  Samples m = Scrape(s.url);
  EXPECT_EQ(Ops(m, "update", "refused"), 1);
  EXPECT_EQ(Ops(m, "update", "ok"), 0);
  EXPECT_EQ(Value(m, "wsync_weight_update_sessions_started_total"), 0);
  EXPECT_EQ(At(m, "vllm:rl_weight_update_operation_duration_seconds_count{operation=\"update\"}"), 1);

  // Inside a session: a second start is refused; an update naming no tensor of the model
  // is refused and ends the session, landing nothing.
  ASSERT_EQ(HttpPostJson(s.url, "/start_weight_update", json::object()).status, 200);
  EXPECT_EQ(Value(Scrape(s.url), "wsync_weight_update_session_active"), 1);
  EXPECT_EQ(HttpPostJson(s.url, "/start_weight_update", json::object()).status, 409);
  const json bad = {{"update_info", {{"names", {"no.such.tensor"}}, {"dtype_names", {"bfloat16"}},
                                     {"shapes", {{4}}}}}};
  HttpReply refused = HttpPostJson(s.url, "/update_weights", bad);
  EXPECT_EQ(refused.status, 400) << refused.Describe();
  m = Scrape(s.url);
  EXPECT_EQ(Ops(m, "start", "ok"), 1);
  EXPECT_EQ(Ops(m, "start", "refused"), 1);
  EXPECT_EQ(Ops(m, "update", "refused"), 2);
  EXPECT_EQ(Ops(m, "update", "failed"), 0);
  EXPECT_EQ(Value(m, "wsync_weight_update_sessions_started_total"), 1);
  EXPECT_EQ(Value(m, "wsync_weight_update_sessions_finished_total"), 0);
  EXPECT_EQ(Failed(m, "update_failed"), 1);
  EXPECT_EQ(Failed(m, "finish_failed"), 0);
  EXPECT_EQ(Value(m, "wsync_weight_update_session_active"), 0);
  EXPECT_EQ(Value(m, "wsync_weights_consistent"), 1);
  EXPECT_EQ(Value(m, "wsync_weight_update_received_tensors_total"), 0);
  // A finish with no session open is refused too.
  EXPECT_EQ(HttpPostJson(s.url, "/finish_weight_update", json::object()).status, 409);
  EXPECT_EQ(Ops(Scrape(s.url), "finish", "refused"), 1);

  // vLLM's runtime checker: a compare against a baseline that does not match.
  HttpReply compare = HttpPostJson(s.url, "/weight_checker",
                                   json{{"action", "compare"}, {"baseline", {{"not.a.parameter", "00"}}}});
  ASSERT_EQ(compare.status, 200) << compare.Describe();
  EXPECT_EQ(compare.json.value("match", true), false) << compare.Describe();
  m = Scrape(s.url);
  EXPECT_EQ(Value(m, "wsync_verification_failures_total", {{"check", "compare"}}), 1);
  EXPECT_EQ(Value(m, "wsync_verification_failures_total", {{"check", "data"}}), 0);
}

}  // namespace
}  // namespace wsync::e2e
