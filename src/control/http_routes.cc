#include "control/http_routes.h"
#include "control/route_table.h"

#include <openssl/crypto.h>
#include <openssl/sha.h>

#include <algorithm>
#include <charconv>
#include <span>
#include <exception>
#include <type_traits>

#include <fmt/format.h>

#include "control/routes.h"
#include "core/json_limits.h"
#include "core/log.h"

namespace wsync {
namespace {

// An adapter name a request may carry (receiver/lora_spec.h holds the rule for names).
constexpr size_t kMaxLoraNameBytesOnWire = 64;

using nlohmann::json;

// JSON text that never throws: bytes that are not UTF-8 (a path, a query value, a
// message quoting either) come out as U+FFFD.
std::string Dump(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

HttpResponse Response(int status, std::string body, std::string_view content_type = "application/json") {
  HttpResponse r;
  r.status = status;
  r.body = std::move(body);
  r.content_type = content_type;
  return r;
}

HttpResponse Reply(int status, const json& body) { return Response(status, Dump(body)); }

std::string Sha256(std::string_view s) {
  std::string out(SHA256_DIGEST_LENGTH, '\0');
  SHA256(reinterpret_cast<const unsigned char*>(s.data()), s.size(),
         reinterpret_cast<unsigned char*>(out.data()));
  return out;
}

// The object under `field`, which must exist and be a JSON object; borrowed from `body`.
Result<const json*> ObjectField(const json& body, const char* field) {
  auto it = body.find(field);
  if (it == body.end()) return InvalidArgument(fmt::format("missing field '{}'", field));
  if (!it->is_object()) return InvalidArgument(fmt::format("field '{}' must be an object", field));
  return &*it;
}

// The string under `field`, or `fallback` when the field is absent.
Result<std::string> StringField(const json& body, const char* field, const char* fallback) {
  auto it = body.find(field);
  if (it == body.end()) return std::string(fallback);
  if (!it->is_string()) {
    return InvalidArgument(fmt::format("field '{}' must be a string, not {}", field, it->type_name()));
  }
  return it->get<std::string>();
}

Result<bool> BoolParam(const HttpRequest& req, const char* name, bool fallback) {
  auto it = req.params.find(name);
  if (it == req.params.end()) return fallback;
  const std::string& v = it->second;
  if (v == "true" || v == "True" || v == "1") return true;
  if (v == "false" || v == "False" || v == "0") return false;
  return InvalidArgument(fmt::format("query parameter {}={} is not a boolean", name, v));
}

// An integer query parameter within [lo, hi], or `fallback` when absent.
Result<int> IntParam(const HttpRequest& req, const char* name, int fallback, int lo, int hi) {
  auto it = req.params.find(name);
  if (it == req.params.end()) return fallback;
  const std::string& v = it->second;
  int value = 0;
  auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), value);
  if (ec != std::errc() || end != v.data() + v.size() || value < lo || value > hi) {
    return InvalidArgument(fmt::format("query parameter {}={} must be an integer in [{}, {}]", name, v, lo, hi));
  }
  return value;
}

// A boolean named in the query or as a body field (a JSON boolean); the query's when both
// name it and they differ is refused, so no reading of the request is ambiguous. False
// when neither does.
Result<bool> QueryOrBodyBool(const HttpRequest& req, const json& body, const char* name) {
  WSYNC_ASSIGN_OR_RETURN(bool from_query, BoolParam(req, name, false));
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return from_query;
  if (!it->is_boolean()) {
    return InvalidArgument(fmt::format("field '{}' must be a boolean, not {}", name, it->type_name()));
  }
  bool from_body = it->get<bool>();
  if (req.params.count(name) && from_query != from_body) {
    return InvalidArgument(fmt::format("{} is {} in the query and {} in the body; name it once", name, from_query,
                                       from_body));
  }
  return from_body;
}

// The "update_info" of POST /update_weights: one object for every worker, or vLLM's list
// form, one object per worker indexed by global worker rank (the service picks its
// workers' entries and bounds the list by its world size).
Result<const json*> UpdateInfoField(const json& body) {
  auto it = body.find("update_info");
  if (it == body.end()) return InvalidArgument("missing field 'update_info'");
  if (it->is_object()) return &*it;
  if (!it->is_array()) {
    return InvalidArgument(fmt::format("field 'update_info' must be an object or a list of objects, not {}",
                                       it->type_name()));
  }
  for (size_t i = 0; i < it->size(); ++i) {
    if (!(*it)[i].is_object()) {
      return InvalidArgument(fmt::format("field 'update_info': entry {} must be an object, not {}", i,
                                         (*it)[i].type_name()));
    }
  }
  return &*it;
}

// POST /weight_checker. `action` is required. A body naming an `algorithm` asks for
// wsync's whole-HF-tensor digests (checksum, or compare with an explicit baseline);
// otherwise the request is vLLM's, over each worker's runtime parameters.
Result<json> WeightChecker(ControlService* svc, const json& b) {
  auto it = b.find("action");
  if (it == b.end()) return InvalidArgument("weight_checker needs a field 'action' (checksum, reset or compare)");
  if (!it->is_string()) return InvalidArgument("field 'action' must be a string (checksum, reset or compare)");
  const std::string action = it->get<std::string>();
  if (action != "checksum" && action != "compare" && action != "reset") {
    return InvalidArgument(fmt::format("unknown weight_checker action '{}' (field 'action': checksum, reset or compare)",
                                       action));
  }
  const json* baseline = nullptr;
  if (auto bl = b.find("baseline"); bl != b.end() && !bl->is_null()) {
    if (!bl->is_object()) return InvalidArgument("field 'baseline' must be an object of name: digest");
    for (const auto& [key, value] : bl->items()) {
      if (!value.is_string()) {
        return InvalidArgument(fmt::format("field 'baseline': the digest of {} must be a string, not {}",
                                           TextExcerpt(key), value.type_name()));
      }
    }
    baseline = &*bl;
  }
  // vLLM's words and status: a compare names its baseline (a null one is none).
  if (action == "compare" && baseline == nullptr) {
    return InvalidArgument("action='compare' requires a 'baseline' object");
  }
  if (auto lora = b.find("lora"); lora != b.end() && !lora->is_null()) {
    if (action != "checksum") return InvalidArgument("field 'lora': only action 'checksum' reads an adapter");
    WSYNC_ASSIGN_OR_RETURN(std::string name, BoundedStringField(b, "lora", "body of /weight_checker",
                                                                kMaxLoraNameBytesOnWire));
    WSYNC_ASSIGN_OR_RETURN(std::string alg_name, StringField(b, "algorithm", "xxh3_128"));
    Result<DigestAlgorithm> alg = ParseDigestAlgorithm(alg_name);
    if (!alg.ok()) return InvalidArgument(fmt::format("field 'algorithm': {}", alg.status().message()));
    return svc->LoraChecksums(name, *alg);
  }
  if (!b.contains("algorithm")) return svc->CheckRuntimeWeights(action, baseline);
  WSYNC_ASSIGN_OR_RETURN(std::string alg_name, StringField(b, "algorithm", "sha256"));
  Result<DigestAlgorithm> alg = ParseDigestAlgorithm(alg_name);
  if (!alg.ok()) return InvalidArgument(fmt::format("field 'algorithm': {}", alg.status().message()));
  if (action == "reset") {
    return InvalidArgument("weight_checker action 'reset' takes no 'algorithm' (it overwrites runtime parameters)");
  }
  WSYNC_ASSIGN_OR_RETURN(auto sums, svc->Checksums(*alg));
  if (action == "checksum") {
    json reply{{"checksums", sums}};
    if (std::vector<std::string> dropped = svc->TensorsNotHeld(); !dropped.empty()) reply["not_held"] = dropped;
    return reply;
  }
  std::vector<std::string> mismatches = DigestMismatches(sums, *baseline);
  return json{{"match", mismatches.empty()}, {"mismatches", mismatches}};
}

enum class Method { kGet, kPost };

// The top-level body fields a route reads; the parser keeps no other (a body padded with
// unread fields costs no parsed memory). A route with `all_fields` hands its body to a
// backend, which reads fields of its own.
using Fields = std::span<const std::string_view>;
constexpr std::string_view kInitFields[] = {"init_info"};
constexpr std::string_view kUpdateFields[] = {"update_info"};
constexpr std::string_view kStartFields[] = {"wsync_inline_verify", "wsync_lora"};
constexpr std::string_view kFinishFields[] = {"weight_version", "wsync_digests", "digest_algorithm"};
constexpr std::string_view kVersionFields[] = {"new_version"};
constexpr std::string_view kCheckerFields[] = {"action", "baseline", "algorithm", "lora"};
constexpr std::string_view kUnloadLoraFields[] = {"lora_name"};
constexpr std::string_view kAbortFields[] = {"request_ids"};
constexpr std::string_view kRpcFields[] = {"method"};
constexpr std::string_view kResetCacheFields[] = {"reset_running_requests", "reset_external"};
constexpr std::string_view kCompletionFields[] = {"model", "prompt", "max_tokens", "n", "stream", "request_id"};

struct Route {
  std::string_view path;
  Method method;
  HttpLane lane;
  Fields fields = {};
  bool all_fields = false;
};

constexpr HttpLane kRead = HttpLane::kRead;
constexpr HttpLane kCtl = HttpLane::kControl;
constexpr HttpLane kGen = HttpLane::kGeneration;

constexpr Route kRoutes[] = {
    {route::kInitWeightTransfer, Method::kPost, kCtl, kInitFields},
    {route::kShutdownWeightTransfer, Method::kPost, kCtl},
    {route::kStartWeightUpdate, Method::kPost, kCtl, kStartFields},
    {route::kStartDraftWeightUpdate, Method::kPost, kCtl},
    {route::kUpdateWeights, Method::kPost, kCtl, kUpdateFields},
    {route::kFinishWeightUpdate, Method::kPost, kCtl, kFinishFields},
    {route::kUpdateWeightVersion, Method::kPost, kCtl, kVersionFields},
    {route::kFetchWeights, Method::kPost, kCtl, {}, /*all_fields=*/true},
    {route::kPause, Method::kPost, kGen},
    {route::kResume, Method::kPost, kCtl},
    {route::kResetPrefixCache, Method::kPost, kCtl, kResetCacheFields},
    {route::kWeightChecker, Method::kPost, kCtl, kCheckerFields},
    {route::kGetWorldSize, Method::kGet, kRead},
    {route::kWeightInfo, Method::kGet, kRead},
    {route::kIsPaused, Method::kGet, kRead},
    {route::kHealth, Method::kGet, kRead},
    {route::kSleep, Method::kPost, kGen},
    {route::kWakeUp, Method::kPost, kCtl},
    {route::kReleaseKvCacheMemory, Method::kPost, kCtl},
    {route::kIsSleeping, Method::kGet, kRead},
    {route::kAbortRequests, Method::kPost, kCtl, kAbortFields},
    {route::kServerInfo, Method::kGet, kRead},
    {route::kMetrics, Method::kGet, kRead},
    {route::kCollectiveRpc, Method::kPost, kCtl, kRpcFields},
    {route::kCompletions, Method::kPost, kGen, kCompletionFields},
    {route::kModels, Method::kGet, kRead},
    {route::kUnloadLoraAdapter, Method::kPost, kCtl, kUnloadLoraFields},
};

const Route* FindRoute(const HttpRequest& req) {
  Method m;
  if (req.method == "GET") {
    m = Method::kGet;
  } else if (req.method == "POST") {
    m = Method::kPost;
  } else {
    return nullptr;
  }
  for (const Route& r : kRoutes) {
    if (r.method == m && req.path == r.path) return &r;
  }
  return nullptr;
}

}  // namespace

std::vector<std::string> DigestMismatches(const std::map<std::string, std::string>& current,
                                          const nlohmann::json& baseline) {
  std::vector<std::string> out;
  for (const auto& [key, value] : baseline.items()) {
    auto it = current.find(key);
    if (it == current.end() || !value.is_string() || value.get_ref<const std::string&>() != it->second) {
      out.push_back(key);
    }
  }
  for (const auto& [key, _] : current) {
    if (!baseline.contains(key)) out.push_back(key);
  }
  std::sort(out.begin(), out.end());  // vLLM sorts them
  return out;
}

int HttpStatusFor(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return 200;
    case StatusCode::kInvalidArgument: return 400;
    case StatusCode::kUnauthenticated: return 401;
    case StatusCode::kNotFound: return 404;
    case StatusCode::kFailedPrecondition: return 409;
    case StatusCode::kPayloadTooLarge: return 413;
    case StatusCode::kUnimplemented: return 501;
    case StatusCode::kUnavailable: return 503;
    case StatusCode::kDeadlineExceeded: return 504;
    case StatusCode::kDataLoss:
    case StatusCode::kAborted:
    case StatusCode::kInternal: return 500;
  }
  return 500;
}

StatusCode StatusCodeForHttp(int s) {
  switch (s) {
    case 400: case 422: return StatusCode::kInvalidArgument;
    case 401: case 403: return StatusCode::kUnauthenticated;
    case 404: return StatusCode::kNotFound;
    case 409: return StatusCode::kFailedPrecondition;
    case 413: return StatusCode::kPayloadTooLarge;
    case 501: return StatusCode::kUnimplemented;
    case 503: return StatusCode::kUnavailable;
    case 504: return StatusCode::kDeadlineExceeded;
    default: return StatusCode::kInternal;
  }
}

const std::string* HttpRequest::header(std::string_view lower_name) const {
  auto it = headers.find(std::string(lower_name));
  return it == headers.end() ? nullptr : &it->second;
}

// The last /update_weights body parsed, kept so that a trainer sending the same update_info
// every sync (the same tensor list, step after step) pays for parsing it once (parsing lies
// on the critical path of every sync). Only that route's bodies are kept, only bodies the
// route accepted, and only up to a size whose parsed form stays within a small multiple of
// the body limit (a parsed body takes about 17 times its text); only byte-identical bodies
// hit; the parsed value is shared read-only. Replacing the entry frees the old one.
class HttpRouter::BodyCache {
 public:
  static constexpr size_t kMinBytes = 4096;
  static constexpr size_t kMaxBytes = size_t{16} << 20;
  static bool Holds(size_t body_bytes, size_t max_body_bytes) {
    return body_bytes >= kMinBytes && body_bytes <= std::min(kMaxBytes, max_body_bytes / 8);
  }
  std::shared_ptr<const json> Find(const std::string& body) {
    std::lock_guard lock(mu_);
    if (body_ != body) return nullptr;
    return parsed_;
  }
  void Put(const std::string& body, std::shared_ptr<const json> parsed) {
    std::string old_body;
    std::shared_ptr<const json> old_parsed;
    {
      std::lock_guard lock(mu_);
      old_body.swap(body_);
      old_parsed.swap(parsed_);
      body_ = body;
      parsed_ = std::move(parsed);
    }
    // The replaced entry is freed here, outside the lock.
  }

 private:
  std::mutex mu_;
  std::string body_;                    // GUARDED_BY(mu_)
  std::shared_ptr<const json> parsed_;  // GUARDED_BY(mu_)
};

HttpRouter::HttpRouter(HttpRouterOptions options, ControlService* service)
    : options_(std::move(options)),
      service_(service),
      key_digest_(Sha256("Bearer " + options_.api_key)),
      cache_(std::make_shared<BodyCache>()) {}

HttpResponse HttpRouter::Error(const Status& s) {
  int code = HttpStatusFor(s.code());
  return Reply(code, json{{"error",
                           {{"message", s.message()},
                            {"type", std::string(StatusCodeName(s.code()))},
                            {"code", code}}}});
}

std::vector<RouteEntry> RouteTable() {
  std::vector<RouteEntry> out;
  for (const Route& r : kRoutes) {
    std::string_view lane = r.lane == HttpLane::kRead ? "read" : r.lane == HttpLane::kControl ? "control" : "generation";
    out.push_back(RouteEntry{r.method == Method::kGet ? "GET" : "POST", r.path, lane,
                             std::vector<std::string_view>(r.fields.begin(), r.fields.end()), r.all_fields});
  }
  return out;
}

HttpLane HttpRouter::LaneOf(const HttpRequest& head) {
  const Route* r = FindRoute(head);
  if (!r) return HttpLane::kControl;  // answered 404 at once
  if (r->lane != HttpLane::kGeneration) return r->lane;
  // /pause and /sleep wait for requests in flight only in mode 'wait'; otherwise they end
  // them, which must never queue behind the requests they end.
  if (r->path == route::kPause || r->path == route::kSleep) {
    auto it = head.params.find("mode");
    if (it == head.params.end() || it->second != "wait") return HttpLane::kControl;
  }
  return r->lane;
}

std::string HttpRouter::TargetRefusal(std::string_view target) {
  for (size_t i = 0; i + 2 < target.size(); ++i) {
    if (target[i] == '%' && target[i + 1] == '0' && target[i + 2] == '0') {
      return "the request target holds an encoded NUL byte (%00), which no path or query value may hold";
    }
  }
  size_t q = target.find('?');
  if (q == std::string_view::npos) return "";
  size_t args = 1 + static_cast<size_t>(std::count(target.begin() + q, target.end(), '&'));
  if (args > kMaxQueryArgs) {
    return fmt::format("the query has {} arguments, more than the limit of {}", args, kMaxQueryArgs);
  }
  return "";
}

Result<json> HttpRouter::ParseBody(std::string_view path, std::string_view body) {
  const std::string what = fmt::format("body of {}", path);
  const Route* r = nullptr;
  for (const Route& candidate : kRoutes) {
    if (candidate.method == Method::kPost && candidate.path == path) r = &candidate;
  }
  WSYNC_ASSIGN_OR_RETURN(json parsed, r && r->all_fields ? ParseUntrustedJson(body, what)
                                                         : ParseUntrustedObject(body, what, r ? r->fields : Fields{}));
  if (!parsed.is_object()) return InvalidArgument(fmt::format("{} must be a JSON object", what));
  return parsed;
}

// Both sides are hashed to fixed-size digests first, so the comparison takes the same
// time whatever the header's length or content.
bool HttpRouter::Authorized(const HttpRequest& head) const {
  if (options_.api_key.empty() || head.path == route::kHealth) return true;
  const std::string* auth = head.header("authorization");
  std::string digest = Sha256(auth ? *auth : std::string_view());
  return CRYPTO_memcmp(digest.data(), key_digest_.data(), SHA256_DIGEST_LENGTH) == 0;
}

std::optional<HttpResponse> HttpRouter::Admit(const HttpRequest& head,
                                              std::optional<uint64_t> content_length) const noexcept {
  try {
    if (!Authorized(head)) {
      return Error(Unauthenticated(fmt::format("{} needs 'Authorization: Bearer <api key>'", head.path)));
    }
    if (!FindRoute(head)) {
      for (const Route& r : kRoutes) {
        if (r.path != head.path) continue;
        const std::string_view allowed = r.method == Method::kGet ? "GET" : "POST";
        HttpResponse refused = Reply(405, json{{"error",
                                                {{"message", fmt::format("{} {}: method not allowed; use {}",
                                                                         head.method, head.path, allowed)},
                                                 {"type", "METHOD_NOT_ALLOWED"},
                                                 {"code", 405}}}});
        refused.allow = allowed;
        return refused;
      }
      return Error(NotFound(fmt::format("no route {} {}", head.method, head.path)));
    }
    if (content_length && *content_length > options_.max_body_bytes) return TooLarge(head);
    if (const std::string* enc = head.header("content-encoding"); enc && *enc != "identity" && !enc->empty()) {
      HttpResponse r = Reply(415, json{{"error",
                                        {{"message", fmt::format("{}: Content-Encoding '{}' is not accepted; "
                                                                 "send the body unencoded",
                                                                 head.path, *enc)},
                                         {"type", "UNSUPPORTED_MEDIA_TYPE"},
                                         {"code", 415}}}});
      return r;
    }
    return std::nullopt;
  } catch (...) {
    return Error(Internal("request head could not be checked"));
  }
}

HttpResponse HttpRouter::TooLarge(const HttpRequest& head) const noexcept {
  try {
    return Error(PayloadTooLarge(fmt::format("body of {} exceeds {} bytes", head.path, options_.max_body_bytes)));
  } catch (...) {
    return Response(413, R"({"error":{"message":"body too large","type":"PAYLOAD_TOO_LARGE","code":413}})");
  }
}

HttpResponse HttpRouter::Handle(const HttpRequest& req) noexcept {
  try {
    std::optional<uint64_t> length = req.body.size();
    if (std::optional<HttpResponse> refused = Admit(req, length)) return std::move(*refused);
    return Dispatch(req);
  } catch (const std::exception& e) {
    try {
      WSYNC_LOG_ERROR("{} {}: {}", req.method, req.path, e.what());
      return Error(Internal(fmt::format("{} failed: {}", req.path, e.what())));
    } catch (...) {
    }
  } catch (...) {
  }
  return Response(500, R"({"error":{"message":"internal error","type":"INTERNAL","code":500}})");
}

HttpResponse HttpRouter::Dispatch(const HttpRequest& req) {
  ControlService* svc = service_;
  const std::string& path = req.path;

  if (req.method == "GET") {
    if (path == route::kGetWorldSize) {
      Result<bool> include_dp = BoolParam(req, "include_dp", true);
      if (!include_dp.ok()) return Error(include_dp.status());
      return Reply(200, json{{"world_size", svc->WorldSize(*include_dp)}});
    }
    if (path == route::kWeightInfo) return Reply(200, json{{"weight_version", svc->WeightVersion()}});
    if (path == route::kIsPaused) return Reply(200, json{{"is_paused", svc->IsPaused()}});
    if (path == route::kHealth) return Reply(200, svc->Health());
    if (path == route::kIsSleeping) return Reply(200, json{{"is_sleeping", svc->IsSleeping()}});
    if (path == route::kServerInfo) return Reply(200, svc->ServerInfo());
    if (path == route::kModels) {
      Result<json> models = svc->Models();
      if (!models.ok()) return Error(models.status());
      return Reply(200, *models);
    }
    if (path == route::kMetrics) {
      Result<std::string> text = svc->Metrics();
      if (!text.ok()) return Error(text.status());
      return Response(200, std::move(*text), kPrometheusContentType);
    }
    return Error(NotFound(fmt::format("no route {} {}", req.method, path)));
  }

  // POST: the body is a JSON object; an empty body is `{}` where the route allows it.
  static constexpr std::string_view kEmptyOk[] = {route::kShutdownWeightTransfer, route::kStartWeightUpdate,
                                                  route::kStartDraftWeightUpdate, route::kFinishWeightUpdate,
                                                  route::kPause, route::kResume, route::kResetPrefixCache,
                                                  route::kSleep, route::kWakeUp, route::kReleaseKvCacheMemory,
                                                  route::kAbortRequests};
  bool allow_empty = false;
  for (std::string_view p : kEmptyOk) allow_empty |= path == p;
  std::shared_ptr<const json> body;
  bool cacheable = path == route::kUpdateWeights && BodyCache::Holds(req.body.size(), options_.max_body_bytes);
  bool from_cache = false;
  if (req.body.empty()) {
    if (!allow_empty) return Error(InvalidArgument(fmt::format("{} needs a JSON body", path)));
    body = std::make_shared<const json>(json::object());
  } else {
    if (cacheable) from_cache = (body = cache_->Find(req.body)) != nullptr;
    if (!body) {
      Result<json> parsed = ParseBody(path, req.body);
      if (!parsed.ok()) return Error(parsed.status());
      body = std::make_shared<const json>(std::move(*parsed));
    }
  }
  const json& b = *body;

  Result<json> out = [&]() -> Result<json> {
    if (path == route::kInitWeightTransfer) {
      WSYNC_ASSIGN_OR_RETURN(const json* info, ObjectField(b, "init_info"));
      WSYNC_LOG_DEBUG("init_weight_transfer_engine from {}", req.remote_addr);
      WSYNC_RETURN_IF_ERROR(svc->InitWeightTransfer(*info, req.remote_addr));
      return json{{"message", "Weight transfer initialized"}};
    }
    if (path == route::kShutdownWeightTransfer) {
      WSYNC_RETURN_IF_ERROR(svc->ShutdownWeightTransfer());
      return json{{"message", "Weight transfer shut down"}};
    }
    if (path == route::kStartWeightUpdate) {
      auto it = b.find("wsync_inline_verify");
      if (it != b.end() && !it->is_null() && !it->is_boolean()) {
        return InvalidArgument("field 'wsync_inline_verify' must be a boolean");
      }
      const bool inline_verify = it != b.end() && it->is_boolean() && it->get<bool>();
      if (auto lora = b.find("wsync_lora"); lora != b.end() && !lora->is_null()) {
        WSYNC_RETURN_IF_ERROR(svc->StartLoraWeightUpdate(*lora, inline_verify));
        return json{{"message", "LoRA adapter update started"}};
      }
      WSYNC_RETURN_IF_ERROR(inline_verify ? svc->StartWeightUpdateInlineVerified() : svc->StartWeightUpdate());
      return json{{"message", "Weight update started"}};
    }
    if (path == route::kStartDraftWeightUpdate) {
      WSYNC_RETURN_IF_ERROR(svc->StartDraftWeightUpdate());
      return json{{"message", "Draft weight update started"}};
    }
    if (path == route::kUpdateWeights) {
      WSYNC_ASSIGN_OR_RETURN(const json* info, UpdateInfoField(b));
      // The field shares the body's lifetime, and its identity: the same body, the same info.
      WSYNC_RETURN_IF_ERROR(svc->UpdateWeights(std::shared_ptr<const json>(body, info)));
      return json{{"message", "Weights updated"}};
    }
    if (path == route::kFinishWeightUpdate) {
      std::optional<std::string> version;
      if (auto it = b.find("weight_version"); it != b.end() && !it->is_null()) {
        WSYNC_ASSIGN_OR_RETURN(version, BoundedStringField(b, "weight_version", "body of /finish_weight_update",
                                                           kMaxWeightVersionBytes));
      }
      auto digests = b.find("wsync_digests");
      if (digests == b.end() || digests->is_null()) {
        WSYNC_RETURN_IF_ERROR(svc->FinishWeightUpdate(version));
        return json{{"message", "Weight update finished"}};
      }
      if (!digests->is_object()) return InvalidArgument("field 'wsync_digests' must be an object {name: hex}");
      WSYNC_ASSIGN_OR_RETURN(std::string algorithm, BoundedStringField(b, "digest_algorithm",
                                                                       "body of /finish_weight_update", 32));
      WSYNC_ASSIGN_OR_RETURN(json reply, svc->FinishWeightUpdateVerified(version, *digests, algorithm));
      reply["message"] = "Weight update finished";
      return reply;
    }
    if (path == route::kUpdateWeightVersion) {
      auto it = b.find("new_version");
      if (it == b.end() || !it->is_string()) return InvalidArgument("field 'new_version' must be a string");
      WSYNC_ASSIGN_OR_RETURN(std::string version, BoundedStringField(b, "new_version", "body of /update_weight_version",
                                                                     kMaxWeightVersionBytes));
      svc->SetWeightVersion(version);
      return json{{"success", true}, {"new_version", version}};
    }
    if (path == route::kFetchWeights) return svc->FetchWeights(b);
    if (path == route::kPause) {
      auto it = req.params.find("mode");
      std::string mode = it == req.params.end() ? "abort" : it->second;
      // vLLM's defaults and replies (reference/vllm_weight_transfer.md, /pause and /resume).
      WSYNC_ASSIGN_OR_RETURN(bool clear_cache, BoolParam(req, "clear_cache", true));
      WSYNC_RETURN_IF_ERROR(svc->Pause(mode, clear_cache));
      return json{{"status", "paused"}};
    }
    if (path == route::kResume) {
      WSYNC_RETURN_IF_ERROR(svc->Resume());
      return json{{"status", "resumed"}};
    }
    if (path == route::kResetPrefixCache) {
      WSYNC_ASSIGN_OR_RETURN(bool running, QueryOrBodyBool(req, b, "reset_running_requests"));
      WSYNC_ASSIGN_OR_RETURN(bool external, QueryOrBodyBool(req, b, "reset_external"));
      (void)external;  // no external (connector) cache here
      WSYNC_ASSIGN_OR_RETURN(bool success, svc->ResetPrefixCache(running));
      return json{{"success", success}};
    }
    if (path == route::kWeightChecker) return WeightChecker(svc, b);
    if (path == route::kSleep) {
      WSYNC_ASSIGN_OR_RETURN(int level, IntParam(req, "level", 1, 0, 2));
      auto it = req.params.find("mode");
      WSYNC_RETURN_IF_ERROR(svc->Sleep(level, it == req.params.end() ? "abort" : it->second));
      return json{{"status", "sleeping"}, {"level", level}};
    }
    if (path == route::kWakeUp) {
      std::vector<std::string> tags;
      for (const auto& [name, value] : req.query) {
        if (name == "tags") tags.push_back(value);
      }
      WSYNC_RETURN_IF_ERROR(svc->WakeUp(tags));
      return json{{"status", svc->IsSleeping() ? "sleeping" : "awake"},
                  {"tags", tags.empty() ? json(nullptr) : json(tags)}};
    }
    if (path == route::kReleaseKvCacheMemory) {
      WSYNC_RETURN_IF_ERROR(svc->ReleaseKvCacheMemory());
      return json{{"status", "kv_cache_released"}};
    }
    if (path == route::kAbortRequests) {
      std::vector<std::string> ids;
      if (auto it = b.find("request_ids"); it != b.end() && !it->is_null()) {
        if (!it->is_array()) return InvalidArgument("field 'request_ids' must be a list of strings");
        for (size_t i = 0; i < it->size(); ++i) {
          const json& id = (*it)[i];
          if (!id.is_string()) return InvalidArgument("field 'request_ids' must be a list of strings");
          if (id.get_ref<const std::string&>().size() > kMaxRequestIdBytes) {
            return InvalidArgument(fmt::format("field 'request_ids': entry {} is {} bytes, over the limit of {}", i,
                                               id.get_ref<const std::string&>().size(), kMaxRequestIdBytes));
          }
          ids.push_back(id.get<std::string>());
        }
      }
      WSYNC_ASSIGN_OR_RETURN(int aborted, svc->AbortRequests(ids));
      return json{{"status", "aborted"}, {"aborted", aborted}};
    }
    if (path == route::kCollectiveRpc) {
      WSYNC_ASSIGN_OR_RETURN(std::string method, StringField(b, "method", ""));
      if (method.empty()) return InvalidArgument("collective_rpc needs a string field 'method'");
      return Unimplemented(fmt::format(
          "collective_rpc '{}': this server dispatches no worker methods by name; it runs only its named "
          "routes ({}, {}, {}, {}, {}, {}, {}, ...)",
          method, route::kInitWeightTransfer, route::kStartWeightUpdate, route::kUpdateWeights,
          route::kFinishWeightUpdate, route::kSleep, route::kWakeUp, route::kWeightChecker));
    }
    if (path == route::kCompletions) return svc->Complete(b);
    if (path == route::kUnloadLoraAdapter) {
      WSYNC_ASSIGN_OR_RETURN(std::string name, BoundedStringField(b, "lora_name", "body of /v1/unload_lora_adapter",
                                                                  kMaxLoraNameBytesOnWire));
      if (name.empty()) return InvalidArgument("/v1/unload_lora_adapter needs a string field 'lora_name'");
      WSYNC_RETURN_IF_ERROR(svc->UnloadLoraAdapter(name));
      return json{{"message", fmt::format("LoRA adapter {} unloaded", name)}};
    }
    return NotFound(fmt::format("no route {} {}", req.method, path));
  }();

  // Only a body its route accepted stays cached: a refused one, however large, is let go.
  if (cacheable && !from_cache && out.ok()) cache_->Put(req.body, body);
  if (!out.ok()) return Error(out.status());
  if (out->is_null()) return Response(200, "");  // an empty 200
  return Reply(200, *out);
}

}  // namespace wsync
