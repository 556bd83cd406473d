// The vLLM 0.32 routes a live `wsync serve` shares with vLLM, over real HTTP: each case's
// exact status code and body, as docs/protocol.md's parity table lists them. GET
// /weight_info, list-form update_info (bounded by the world size, refused through the
// session like any bad payload), /weight_checker compare (vLLM's 400 without a baseline,
// sorted mismatches, vLLM's keys), /release_kv_cache_memory after a completed pause,
// /reset_prefix_cache flags from the query or the body, vLLM's /sleep and /wake_up bodies,
// /shutdown_weight_transfer_engine, validation failures as 400, a wrong method as 405, and
// the wrong-state 409s that wsync keeps.
#include <string>
#include <vector>

#include <fmt/format.h>

#include "e2e_test_base.h"

namespace wsync::e2e {
namespace {

using nlohmann::json;

class VllmParityTest : public E2eTest {
 protected:
  static json NormInfo() {
    return json{{"names", {"model.norm.weight"}}, {"dtype_names", {"bfloat16"}}, {"shapes", {{256}}}};
  }
  // The exact error body wsync serve answers.
  static json ErrorBody(int code, const std::string& type, const std::string& message) {
    return json{{"error", {{"message", message}, {"type", type}, {"code", code}}}};
  }
  static ::testing::AssertionResult Is(const HttpReply& r, int status, const json& body) {
    if (r.status == status && r.json == body) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "want " << status << " " << body.dump() << ", got " << r.Describe();
  }
};

TEST_F(VllmParityTest, SharedRoutesAnswerVllmsCodesAndBodies) {
  // TP 2 x DP 2 in one server: a world of 4 workers, global ranks dp * 2 + tp.
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("serve", {"--model", "qwen3-tiny", "--tp", "2", "--dp", "2"}));
  const std::string& u = s.url;

  // GET /weight_info: vLLM's shape and default, then what /update_weight_version set.
  EXPECT_TRUE(Is(HttpGet(u, "/weight_info"), 200, json{{"weight_version", "default"}}));
  EXPECT_TRUE(Is(HttpPostJson(u, "/update_weight_version", {{"new_version", "v7"}}), 200,
                 json{{"success", true}, {"new_version", "v7"}}));
  EXPECT_TRUE(Is(HttpGet(u, "/weight_info"), 200, json{{"weight_version", "v7"}}));
  EXPECT_TRUE(Is(HttpGet(u, "/get_world_size"), 200, json{{"world_size", 4}}));

  // List-form update_info: exactly one entry per worker of the world; refused lists end
  // the session like any refused payload.
  const std::string wrong_length =
      "update_info is a list of {} entries; vLLM's list form takes one per worker of the deployment, indexed by "
      "global worker rank, and this one has 4 (/get_world_size)";
  struct Case {
    json update_info;
    json error;
  };
  const std::vector<Case> cases = {
      {json::array({NormInfo(), NormInfo()}),
       ErrorBody(400, "INVALID_ARGUMENT", fmt::format(fmt::runtime(wrong_length), 2))},
      {json::array(), ErrorBody(400, "INVALID_ARGUMENT", fmt::format(fmt::runtime(wrong_length), 0))},
      {json(std::vector<json>(5, NormInfo())),
       ErrorBody(400, "INVALID_ARGUMENT", fmt::format(fmt::runtime(wrong_length), 5))},
      {json::array({NormInfo(), NormInfo(), NormInfo(), 3}),
       ErrorBody(400, "INVALID_ARGUMENT", "field 'update_info': entry 3 must be an object, not number")},
      {json::array({NormInfo(), json::object(), NormInfo(), NormInfo()}),
       ErrorBody(400, "INVALID_ARGUMENT",
                 "update_info entries 0 and 1 (workers of this server) differ; its backend takes one update_info "
                 "for all of its workers, so their entries must be equal")},
      {json("names"),
       ErrorBody(400, "INVALID_ARGUMENT", "field 'update_info' must be an object or a list of objects, not string")},
  };
  for (const Case& c : cases) {
    ASSERT_EQ(HttpPost(u, "/start_weight_update", "").status, 200) << c.update_info.dump();
    EXPECT_TRUE(Is(HttpPostJson(u, "/update_weights", {{"update_info", c.update_info}}), c.error.at("error").at("code"),
                   c.error))
        << c.update_info.dump();
    // A refusal the router makes (not a list of objects) leaves the session to the
    // trainer; one the server makes ends it, as a failed update does.
    if (HttpGet(u, "/health").json.value("session_active", false)) {
      ASSERT_EQ(HttpPost(u, "/finish_weight_update", "").status, 200);
    }
  }
  // Outside a session, the session's refusal comes first, list or not.
  HttpReply outside = HttpPostJson(u, "/update_weights", {{"update_info", json(std::vector<json>(4, NormInfo()))}});
  EXPECT_TRUE(IsError(outside, 409, {"start_weight_update must be called before update_weights"}));
  EXPECT_EQ(outside.json["error"]["type"], "FAILED_PRECONDITION");

  // /weight_checker: vLLM's 400 and words for a compare without a baseline (for both
  // checkers; a null baseline is none); vLLM's keys; sorted mismatches; answered while
  // paused.
  for (const json& body : {json{{"action", "compare"}}, json{{"action", "compare"}, {"baseline", nullptr}},
                           json{{"action", "compare"}, {"algorithm", "sha256"}}}) {
    EXPECT_TRUE(Is(HttpPostJson(u, "/weight_checker", body), 400,
                   ErrorBody(400, "INVALID_ARGUMENT", "action='compare' requires a 'baseline' object")))
        << body.dump();
  }
  EXPECT_TRUE(Is(HttpPostJson(u, "/weight_checker", {{"action", "compare"}, {"baseline", {{"k", 1}}}}), 400,
                 ErrorBody(400, "INVALID_ARGUMENT", "field 'baseline': the digest of k must be a string, not number")));
  EXPECT_TRUE(IsError(HttpPostJson(u, "/weight_checker", json::object()), 400, {"needs a field 'action'"}));
  HttpReply sums = HttpPostJson(u, "/weight_checker", {{"action", "checksum"}});
  ASSERT_EQ(sums.status, 200) << sums.Describe();
  json checksums = sums.json.at("checksums");
  EXPECT_TRUE(checksums.contains("dp1:pp0:pcp0:tp1:model.norm.weight")) << sums.body.substr(0, 300);
  EXPECT_TRUE(Is(HttpPostJson(u, "/weight_checker", {{"action", "compare"}, {"baseline", checksums}}), 200,
                 json{{"match", true}, {"mismatches", json::array()}}));
  json changed = checksums;
  changed["dp1:pp0:pcp0:tp1:model.norm.weight"] = "00";
  changed["dp0:pp0:pcp0:tp0:model.norm.weight"] = "00";
  changed["zz"] = "00";
  const json sorted = {{"match", false},
                       {"mismatches",
                        {"dp0:pp0:pcp0:tp0:model.norm.weight", "dp1:pp0:pcp0:tp1:model.norm.weight", "zz"}}};
  EXPECT_TRUE(Is(HttpPostJson(u, "/weight_checker", {{"action", "compare"}, {"baseline", changed}}), 200, sorted));

  // /release_kv_cache_memory: vLLM's rules (a completed pause, everything resident) and
  // reply; the cache then sleeps until /wake_up, which resumes scheduling.
  EXPECT_TRUE(Is(HttpPost(u, "/release_kv_cache_memory", ""), 409,
                 ErrorBody(409, "FAILED_PRECONDITION",
                           "release_kv_cache_memory() requires a completed pause first (POST /pause?mode=abort or "
                           "mode=wait; paused: false, requests running: 0, waiting: 0)")));
  ASSERT_EQ(HttpPost(u, "/pause?mode=abort", "").status, 200);
  EXPECT_TRUE(Is(HttpPostJson(u, "/weight_checker", {{"action", "compare"}, {"baseline", checksums}}), 200,
                 json{{"match", true}, {"mismatches", json::array()}}));
  EXPECT_TRUE(Is(HttpPost(u, "/release_kv_cache_memory", ""), 200, json{{"status", "kv_cache_released"}}));
  EXPECT_TRUE(Is(HttpGet(u, "/is_sleeping"), 200, json{{"is_sleeping", true}}));
  EXPECT_TRUE(Is(HttpPost(u, "/release_kv_cache_memory", ""), 409,
                 ErrorBody(409, "FAILED_PRECONDITION",
                           "release_kv_cache_memory() requires all executor memory to be resident (weights awake, kv "
                           "cache discarded); POST /wake_up first")));
  EXPECT_TRUE(Is(HttpPost(u, "/wake_up?tags=kv_cache", ""), 200,
                 json{{"status", "awake"}, {"tags", {"kv_cache"}}}));
  EXPECT_TRUE(Is(HttpGet(u, "/is_paused"), 200, json{{"is_paused", false}}));

  // /sleep and /wake_up: vLLM's bodies.
  EXPECT_TRUE(Is(HttpPost(u, "/sleep?level=1", ""), 200, json{{"status", "sleeping"}, {"level", 1}}));
  EXPECT_TRUE(IsError(HttpPostJson(u, "/weight_checker", {{"action", "checksum"}}), 409, {"sleeping"}));
  EXPECT_TRUE(Is(HttpPost(u, "/wake_up", ""), 200, json{{"status", "awake"}, {"tags", nullptr}}));
  EXPECT_TRUE(IsError(HttpPost(u, "/sleep?level=3", ""), 400, {"level=3"}));

  // /reset_prefix_cache: each flag from the query or the body.
  const json ok = {{"success", true}};
  EXPECT_TRUE(Is(HttpPost(u, "/reset_prefix_cache", ""), 200, ok));
  EXPECT_TRUE(Is(HttpPost(u, "/reset_prefix_cache?reset_running_requests=true", ""), 200, ok));
  EXPECT_TRUE(Is(HttpPostJson(u, "/reset_prefix_cache", {{"reset_running_requests", true}}), 200, ok));
  const json running = {{"reset_running_requests", true}};
  EXPECT_TRUE(Is(HttpPostJson(u, "/reset_prefix_cache?reset_running_requests=false", running), 400,
                 ErrorBody(400, "INVALID_ARGUMENT",
                           "reset_running_requests is false in the query and true in the body; name it once")));
  EXPECT_TRUE(Is(HttpPostJson(u, "/reset_prefix_cache", {{"reset_external", "yes"}}), 400,
                 ErrorBody(400, "INVALID_ARGUMENT", "field 'reset_external' must be a boolean, not string")));

  // Validation failures are 400, as vLLM's handler answers them (not FastAPI's 422).
  EXPECT_TRUE(IsError(HttpPost(u, "/update_weights", "{\"update_info\": "), 400, {"malformed JSON"}));
  EXPECT_TRUE(Is(HttpPostJson(u, "/update_weights", json::object()), 400,
                 ErrorBody(400, "INVALID_ARGUMENT", "missing field 'update_info'")));
  EXPECT_TRUE(IsError(HttpPostJson(u, "/finish_weight_update", {{"weight_version", 3}}), 400, {"weight_version"}));
  EXPECT_TRUE(IsError(HttpPostJson(u, "/update_weight_version", json::object()), 400, {"new_version"}));

  // A route's path under another method is vLLM's 405; an unknown path 404.
  EXPECT_TRUE(Is(HttpGet(u, "/update_weights"), 405,
                 ErrorBody(405, "METHOD_NOT_ALLOWED", "GET /update_weights: method not allowed; use POST")));
  EXPECT_TRUE(Is(HttpPost(u, "/weight_info", ""), 405,
                 ErrorBody(405, "METHOD_NOT_ALLOWED", "POST /weight_info: method not allowed; use GET")));
  EXPECT_TRUE(Is(HttpGet(u, "/no_such_route"), 404,
                 ErrorBody(404, "NOT_FOUND", "no route GET /no_such_route")));

  // Wrong session state: wsync keeps 409 where vLLM's RPC layer answers 500.
  ASSERT_EQ(HttpPost(u, "/start_weight_update", "").status, 200);
  HttpReply twice = HttpPost(u, "/start_weight_update", "");
  EXPECT_TRUE(IsError(twice, 409, {"start_weight_update called while a weight update is already active"}));
  EXPECT_EQ(twice.json["error"]["type"], "FAILED_PRECONDITION");
  ASSERT_EQ(HttpPost(u, "/finish_weight_update", "").status, 200);
  EXPECT_TRUE(Is(HttpPost(u, "/finish_weight_update", ""), 409,
                 ErrorBody(409, "FAILED_PRECONDITION",
                           "finish_weight_update called without an active weight update; call start_weight_update "
                           "first")));

  // /shutdown_weight_transfer_engine: refused inside a session in vLLM's words (wsync's 409),
  // else the data plane is released (an update then needs a new init).
  ASSERT_EQ(HttpPost(u, "/start_weight_update", "").status, 200);
  EXPECT_TRUE(Is(HttpPost(u, "/shutdown_weight_transfer_engine", ""), 409,
                 ErrorBody(409, "FAILED_PRECONDITION", "Cannot release a trainer connection during a weight update")));
  ASSERT_EQ(HttpPost(u, "/finish_weight_update", "").status, 200);
  EXPECT_TRUE(Is(HttpPost(u, "/shutdown_weight_transfer_engine", ""), 200,
                 json{{"message", "Weight transfer shut down"}}));
  ExpectCleanShutdown(s);
}

}  // namespace
}  // namespace wsync::e2e
