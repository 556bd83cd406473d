// Fuzz target: the control plane's request handling (HttpRouter), fed whole requests
// without sockets, in front of a fake ControlService (it holds no weights, accepts or
// refuses by simple rules, never blocks; it fakes vLLM's sleep, abort, completion and
// runtime-checker calls by their reply shapes alone, with no weights or requests behind
// them). Input:
//   byte 0        bit 0: the router requires an API key ("k")
//   then          "METHOD TARGET\n", header lines "Name: value\n", "\n", the body
// TARGET is split at the first '?' and its query percent-decoded into parameters, as the
// server's HTTP library does (repeated names kept in order, as /wake_up's tags need).
// Every reply must be a JSON object, except /sleep's and /wake_up's empty 200 (vLLM's);
// every non-200 reply must be `{"error": {"message": <string>, "code": <status>, ...}}`.
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "control/http_routes.h"

namespace {

using nlohmann::json;
using wsync::HttpRequest;
using wsync::HttpResponse;

class FakeControlService : public wsync::ControlService {
 public:
  wsync::Status InitWeightTransfer(const json& info, const std::string&) override {
    auto it = info.find("rank_offset");
    if (it == info.end() || !it->is_number_integer()) return wsync::InvalidArgument("rank_offset");
    return wsync::Status::Ok();
  }
  wsync::Status StartWeightUpdate() override {
    if (active_) return wsync::FailedPrecondition("already active");
    active_ = true;
    return wsync::Status::Ok();
  }
  wsync::Status UpdateWeights(std::shared_ptr<const json> info) override {
    if (!active_) return wsync::FailedPrecondition("no session");
    auto it = info->find("names");
    if (it == info->end() || !it->is_array()) {
      active_ = false;
      return wsync::InvalidArgument("update_info is missing 'names'");
    }
    for (const json& n : *it) {
      if (!n.is_string()) return wsync::InvalidArgument("names must be strings");
      if (n.get<std::string>() != "w") {
        active_ = false;
        return wsync::InvalidArgument("no tensor " + n.get<std::string>());
      }
    }
    return wsync::Status::Ok();
  }
  wsync::Status FinishWeightUpdate(const std::optional<std::string>& v) override {
    if (!active_) return wsync::FailedPrecondition("no session");
    active_ = false;
    if (v) version_ = *v;
    return wsync::Status::Ok();
  }
  wsync::Result<json> FetchWeights(const json& body) override {
    auto it = body.find("version");
    if (it == body.end()) return wsync::InvalidArgument("missing version");
    return json{{"fetched", *it}};
  }
  int WorldSize(bool include_dp) const override { return include_dp ? 2 : 1; }
  std::string WeightVersion() const override { return version_; }
  void SetWeightVersion(std::string v) override { version_ = std::move(v); }
  wsync::Status Pause(std::string_view mode, bool) override {
    if (mode != "abort" && mode != "wait" && mode != "keep") {
      return wsync::InvalidArgument("unknown pause mode '" + std::string(mode) + "'");
    }
    paused_ = true;
    return wsync::Status::Ok();
  }
  wsync::Status Resume() override {
    paused_ = false;
    return wsync::Status::Ok();
  }
  bool IsPaused() const override { return paused_; }
  wsync::Result<bool> ResetPrefixCache(bool) override { return true; }
  wsync::Result<std::map<std::string, std::string>> Checksums(wsync::DigestAlgorithm a) override {
    return std::map<std::string, std::string>{{"w", std::string(wsync::DigestAlgorithmName(a))}};
  }
  json Health() const override { return {{"status", "ok"}, {"weight_version", version_}}; }
  // vLLM's runtime checker, by shape: 409 while asleep; compare gets the body's baseline.
  wsync::Result<json> CheckRuntimeWeights(std::string_view action, const json* baseline) override {
    if (asleep_) return wsync::FailedPrecondition("weight_checker: sleeping");
    if (action == "reset") return json{{"status", "reset"}};
    if (action == "checksum") return json{{"checksums", {{"dp0:pp0:pcp0:tp0:w", "00"}}}, {"engines", json::array()}};
    if (baseline == nullptr) std::abort();  // the router answers vLLM's 400 first
    return json{{"match", true}, {"mismatches", json::array()}};
  }
  wsync::Status Sleep(int level, std::string_view mode) override {
    if (level < 0 || level > 2) return wsync::InvalidArgument("level");
    if (mode != "abort" && mode != "wait" && mode != "keep") return wsync::InvalidArgument("mode");
    asleep_ = true;
    return wsync::Status::Ok();
  }
  wsync::Status WakeUp(const std::vector<std::string>& tags) override {
    for (const std::string& t : tags) {
      if (t != "weights" && t != "kv_cache" && t != "scheduling") return wsync::InvalidArgument("unknown tag " + t);
    }
    asleep_ = false;
    return wsync::Status::Ok();
  }
  bool IsSleeping() const override { return asleep_; }
  wsync::Result<int> AbortRequests(const std::vector<std::string>& ids) override { return static_cast<int>(ids.size()); }
  wsync::Result<json> Complete(const json& request) override {
    auto it = request.find("prompt");
    if (it == request.end() || !it->is_string()) return wsync::InvalidArgument("field 'prompt' must be a string");
    return json{{"object", "text_completion"}, {"choices", json::array()}};
  }
  json ServerInfo() const override { return {{"capabilities", {{"prefix_caching", false}}}}; }
  wsync::Result<std::string> Metrics() const override {
    return std::string("# TYPE wsync_weight_update_session_active gauge\nwsync_weight_update_session_active ") +
           (active_ ? "1" : "0") + "\n";
  }

 private:
  bool active_ = false;
  bool paused_ = false;
  bool asleep_ = false;
  std::string version_ = "default";
};

int Hex(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

std::string PercentDecode(std::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '%' && i + 2 < s.size() && Hex(s[i + 1]) >= 0 && Hex(s[i + 2]) >= 0) {
      out.push_back(static_cast<char>(Hex(s[i + 1]) * 16 + Hex(s[i + 2])));
      i += 2;
    } else {
      out.push_back(s[i]);
    }
  }
  return out;
}

// Splits `text` at the first `sep`: the part before, and `text` is left with the rest.
std::string_view Take(std::string_view& text, char sep) {
  size_t at = text.find(sep);
  std::string_view head = text.substr(0, at);
  text = at == std::string_view::npos ? std::string_view() : text.substr(at + 1);
  return head;
}

HttpRequest Parse(std::string_view in) {
  HttpRequest req;
  std::string_view line = Take(in, '\n');
  req.method = std::string(Take(line, ' '));
  std::string_view target = line;
  (void)wsync::HttpRouter::TargetRefusal(target);
  std::string_view path = Take(target, '?');
  req.path = PercentDecode(path);
  while (!target.empty()) {
    std::string_view pair = Take(target, '&');
    std::string_view key = Take(pair, '=');
    req.params.emplace(PercentDecode(key), PercentDecode(pair));
    req.query.emplace_back(PercentDecode(key), PercentDecode(pair));
  }
  while (!in.empty()) {
    std::string_view h = Take(in, '\n');
    if (h.empty()) break;
    std::string_view name = Take(h, ':');
    if (!h.empty() && h.front() == ' ') h.remove_prefix(1);
    std::string lower(name);
    for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    req.headers.emplace(std::move(lower), std::string(h));
  }
  req.body = std::string(in);
  req.remote_addr = "127.0.0.1";
  return req;
}

void CheckReply(const HttpResponse& r, const std::string& path = "") {
  if (r.status < 200 || r.status > 599) std::abort();
  if (r.content_type == wsync::kPrometheusContentType) {
    // Only the metrics route's 200 is text: whole lines.
    if (r.status != 200 || path != "/metrics" || r.body.empty() || r.body.back() != '\n') std::abort();
    return;
  }
  if (r.content_type != "application/json") std::abort();
  if (r.status == 200 && r.body.empty() && (path == "/sleep" || path == "/wake_up")) return;
  json j = json::parse(r.body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) std::abort();
  if (r.status == 200) return;
  auto e = j.find("error");
  if (e == j.end() || !e->is_object()) std::abort();
  auto m = e->find("message");
  auto c = e->find("code");
  if (m == e->end() || !m->is_string() || c == e->end() || *c != r.status) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  static FakeControlService service;
  static wsync::HttpRouter open_router({"", 1 << 16}, &service);
  static wsync::HttpRouter keyed_router({"k", 1 << 16}, &service);
  wsync::HttpRouter& router = (data[0] & 1) ? keyed_router : open_router;
  HttpRequest req = Parse(std::string_view(reinterpret_cast<const char*>(data) + 1, size - 1));

  std::optional<uint64_t> length;
  if (const std::string* cl = req.header("content-length")) length = std::strtoull(cl->c_str(), nullptr, 10);
  if (std::optional<HttpResponse> refused = router.Admit(req, length)) {
    if (refused->status < 400) std::abort();
    CheckReply(*refused);
  }
  CheckReply(router.TooLarge(req));
  CheckReply(router.Handle(req), req.path);
  return 0;
}
