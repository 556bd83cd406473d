#include "control/http_server.h"

#include <httplib.h>

#include <map>
#include <memory>
#include <mutex>
#include <type_traits>

#include <fmt/format.h>

#include "core/deadline.h"
#include "core/log.h"

namespace wsync {
namespace {

using nlohmann::json;

void Reply(httplib::Response& res, int code, const json& body) {
  res.status = code;
  res.set_content(body.dump(), "application/json");
}

void ReplyError(httplib::Response& res, const Status& s) {
  Reply(res, HttpStatusFor(s.code()),
        json{{"error",
              {{"message", s.message()},
               {"type", std::string(StatusCodeName(s.code()))},
               {"code", HttpStatusFor(s.code())}}}});
}

// The last large body parsed on each path, kept so that a trainer sending the same
// update_info every sync (the same tensor list, step after step) pays for parsing it once:
// a 400-tensor list is ~30 KB of JSON, ~0.5 ms to parse, on the critical path of a sync.
// Only byte-identical bodies hit; the parsed value is shared read-only.
class BodyCache {
 public:
  static constexpr size_t kMinBytes = 4096;
  std::shared_ptr<const json> Find(const std::string& path, const std::string& body) {
    std::lock_guard lock(mu_);
    auto it = entries_.find(path);
    if (it == entries_.end() || it->second.first != body) return nullptr;
    return it->second.second;
  }
  void Put(const std::string& path, const std::string& body, std::shared_ptr<const json> parsed) {
    std::lock_guard lock(mu_);
    entries_[path] = {body, std::move(parsed)};
  }

 private:
  std::mutex mu_;
  std::map<std::string, std::pair<std::string, std::shared_ptr<const json>>> entries_;  // GUARDED_BY(mu_)
};

// Parses the body as a JSON object; an empty body is `{}` when allowed.
Result<std::shared_ptr<const json>> ParseBody(const httplib::Request& req, bool allow_empty, BodyCache& cache) {
  if (req.body.empty()) {
    if (allow_empty) return std::make_shared<const json>(json::object());
    return InvalidArgument(fmt::format("{} needs a JSON body", req.path));
  }
  const bool cacheable = req.body.size() >= BodyCache::kMinBytes;
  if (cacheable) {
    if (auto hit = cache.Find(req.path, req.body)) return hit;
  }
  json body = json::parse(req.body, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded()) {
    return InvalidArgument(fmt::format("malformed JSON body for {}", req.path));
  }
  if (!body.is_object()) {
    return InvalidArgument(fmt::format("body of {} must be a JSON object", req.path));
  }
  auto parsed = std::make_shared<const json>(std::move(body));
  if (cacheable) cache.Put(req.path, req.body, parsed);
  return parsed;
}

// The object under `field`, which must exist and be a JSON object; borrowed from `body`.
Result<const json*> ObjectField(const json& body, const char* field) {
  auto it = body.find(field);
  if (it == body.end()) return InvalidArgument(fmt::format("missing field '{}'", field));
  if (!it->is_object()) return InvalidArgument(fmt::format("field '{}' must be an object", field));
  return &*it;
}

bool ConstantTimeEquals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

Result<bool> BoolParam(const httplib::Request& req, const char* name, bool fallback) {
  if (!req.has_param(name)) return fallback;
  std::string v = req.get_param_value(name);
  if (v == "true" || v == "True" || v == "1") return true;
  if (v == "false" || v == "False" || v == "0") return false;
  return InvalidArgument(fmt::format("query parameter {}={} is not a boolean", name, v));
}

}  // namespace

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

Result<std::unique_ptr<HttpControlServer>> HttpControlServer::Start(
    const HttpServerOptions& options, ControlService* service) {
  std::unique_ptr<HttpControlServer> s(new HttpControlServer());
  s->options_ = options;
  s->service_ = service;
  s->server_ = std::make_unique<httplib::Server>();
  // Long calls (init, update) each hold a thread for their whole duration.
  s->server_->new_task_queue = [] { return new httplib::ThreadPool(32); };
  s->server_->set_payload_max_length(options.max_body_bytes);
  s->server_->set_read_timeout(30, 0);
  // Trainers keep their connections alive across the calls of a sync (see client.h) and
  // close them when idle; small replies go out at once.
  s->server_->set_tcp_nodelay(true);
  s->server_->set_keep_alive_max_count(1 << 20);
  s->Routes();
  int port = options.port == 0 ? s->server_->bind_to_any_port(options.host)
                               : (s->server_->bind_to_port(options.host, options.port)
                                      ? options.port
                                      : -1);
  if (port <= 0) {
    return Unavailable(fmt::format("cannot listen on {}:{}", options.host, options.port));
  }
  s->port_ = port;
  s->listener_ = std::thread([srv = s->server_.get()] { srv->listen_after_bind(); });
  // stop() before the accept loop runs would be lost; return only once it is running.
  Deadline ready = Deadline::InSeconds(10);
  while (!s->server_->is_running() && !ready.expired()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return s;
}

HttpControlServer::~HttpControlServer() { Stop(); }

std::string HttpControlServer::url() const {
  return fmt::format("http://{}:{}", options_.host, port_);
}

void HttpControlServer::Stop() {
  if (server_) server_->stop();
  if (listener_.joinable()) listener_.join();
}

void HttpControlServer::Routes() {
  httplib::Server& srv = *server_;
  ControlService* svc = service_;

  srv.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (options_.api_key.empty() || req.path == "/health") {
      return httplib::Server::HandlerResponse::Unhandled;
    }
    std::string auth = req.get_header_value("Authorization");
    if (!ConstantTimeEquals(auth, "Bearer " + options_.api_key)) {
      ReplyError(res, Unauthenticated(fmt::format(
                          "{} needs 'Authorization: Bearer <api key>'", req.path)));
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });
  srv.set_error_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    if (res.status == 413) {
      ReplyError(res, PayloadTooLarge(fmt::format("body of {} exceeds {} bytes", req.path,
                                                  options_.max_body_bytes)));
    } else if (res.status == 404) {
      ReplyError(res, NotFound(fmt::format("no route {} {}", req.method, req.path)));
    } else {
      Reply(res, res.status, json{{"error", {{"message", "request failed"}, {"code", res.status}}}});
    }
  });
  srv.set_exception_handler([](const httplib::Request& req, httplib::Response& res,
                               std::exception_ptr ep) {
    std::string what = "unknown exception";
    try {
      if (ep) std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    WSYNC_LOG_ERROR("{} {}: {}", req.method, req.path, what);
    ReplyError(res, Internal(fmt::format("{} failed: {}", req.path, what)));
  });

  // Runs `fn(req, body)` for a POST route and answers its JSON on success; `fn` takes the
  // body as `const json&`, or as the shared parsed object when it keeps it.
  auto cache = std::make_shared<BodyCache>();
  auto post = [&srv, cache](const char* path, bool allow_empty, auto fn) {
    srv.Post(path, [allow_empty, fn, cache](const httplib::Request& req, httplib::Response& res) {
      Result<std::shared_ptr<const json>> body = ParseBody(req, allow_empty, *cache);
      if (!body.ok()) return ReplyError(res, body.status());
      Result<json> out = [&] {
        if constexpr (std::is_invocable_v<decltype(fn), const httplib::Request&, std::shared_ptr<const json>>) {
          return fn(req, *body);
        } else {
          return fn(req, **body);
        }
      }();
      if (!out.ok()) return ReplyError(res, out.status());
      Reply(res, 200, *out);
    });
  };

  post("/init_weight_transfer_engine", false, [svc](const httplib::Request& req, const json& b) -> Result<json> {
    WSYNC_ASSIGN_OR_RETURN(const json* info, ObjectField(b, "init_info"));
    WSYNC_RETURN_IF_ERROR(svc->InitWeightTransfer(*info, req.remote_addr));
    return json{{"message", "Weight transfer initialized"}};
  });
  post("/start_weight_update", true, [svc](const httplib::Request&, const json&) -> Result<json> {
    WSYNC_RETURN_IF_ERROR(svc->StartWeightUpdate());
    return json{{"message", "Weight update started"}};
  });
  post("/start_draft_weight_update", true, [](const httplib::Request&, const json&) -> Result<json> {
    return InvalidArgument("this server has no draft model");
  });
  post("/update_weights", false, [svc](const httplib::Request&, std::shared_ptr<const json> b) -> Result<json> {
    WSYNC_ASSIGN_OR_RETURN(const json* info, ObjectField(*b, "update_info"));
    // The field shares the body's lifetime, and its identity: the same body, the same info.
    WSYNC_RETURN_IF_ERROR(svc->UpdateWeights(std::shared_ptr<const json>(std::move(b), info)));
    return json{{"message", "Weights updated"}};
  });
  post("/finish_weight_update", true, [svc](const httplib::Request&, const json& b) -> Result<json> {
    std::optional<std::string> version;
    if (auto it = b.find("weight_version"); it != b.end() && !it->is_null()) {
      if (!it->is_string()) return InvalidArgument("field 'weight_version' must be a string");
      version = it->get<std::string>();
    }
    WSYNC_RETURN_IF_ERROR(svc->FinishWeightUpdate(version));
    return json{{"message", "Weight update finished"}};
  });
  post("/update_weight_version", false, [svc](const httplib::Request&, const json& b) -> Result<json> {
    auto it = b.find("new_version");
    if (it == b.end() || !it->is_string()) {
      return InvalidArgument("field 'new_version' must be a string");
    }
    svc->SetWeightVersion(it->get<std::string>());
    return json{{"success", true}, {"new_version", *it}};
  });
  post("/fetch_weights", false, [svc](const httplib::Request&, const json& b) -> Result<json> {
    return svc->FetchWeights(b);
  });
  post("/pause", true, [svc](const httplib::Request& req, const json&) -> Result<json> {
    std::string mode = req.has_param("mode") ? req.get_param_value("mode") : "abort";
    WSYNC_ASSIGN_OR_RETURN(bool clear_cache, BoolParam(req, "clear_cache", false));
    WSYNC_RETURN_IF_ERROR(svc->Pause(mode, clear_cache));
    return json{{"message", "Generation paused"}, {"mode", mode}};
  });
  post("/resume", true, [svc](const httplib::Request&, const json&) -> Result<json> {
    WSYNC_RETURN_IF_ERROR(svc->Resume());
    return json{{"message", "Generation resumed"}};
  });
  post("/reset_prefix_cache", true, [svc](const httplib::Request&, const json&) -> Result<json> {
    WSYNC_RETURN_IF_ERROR(svc->ResetPrefixCache());
    return json{{"message", "Prefix cache reset"}};
  });
  post("/weight_checker", false, [svc](const httplib::Request&, const json& b) -> Result<json> {
    std::string action = b.value("action", std::string("checksum"));
    if (action != "checksum" && action != "compare") {
      return InvalidArgument(fmt::format("unknown weight_checker action '{}'", action));
    }
    WSYNC_ASSIGN_OR_RETURN(DigestAlgorithm alg,
                           ParseDigestAlgorithm(b.value("algorithm", std::string("sha256"))));
    WSYNC_ASSIGN_OR_RETURN(auto sums, svc->Checksums(alg));
    if (action == "checksum") return json{{"checksums", sums}};
    WSYNC_ASSIGN_OR_RETURN(const json* baseline_field, ObjectField(b, "baseline"));
    const json& baseline = *baseline_field;
    json mismatches = json::array();
    for (const auto& [name, hex] : sums) {
      auto it = baseline.find(name);
      if (it == baseline.end() || *it != hex) mismatches.push_back(name);
    }
    for (const auto& [name, _] : baseline.items()) {
      if (!sums.contains(name)) mismatches.push_back(name);
    }
    return json{{"match", mismatches.empty()}, {"mismatches", mismatches}};
  });

  srv.Get("/get_world_size", [svc](const httplib::Request& req, httplib::Response& res) {
    Result<bool> include_dp = BoolParam(req, "include_dp", true);
    if (!include_dp.ok()) return ReplyError(res, include_dp.status());
    Reply(res, 200, json{{"world_size", svc->WorldSize(*include_dp)}});
  });
  srv.Get("/weight_info", [svc](const httplib::Request&, httplib::Response& res) {
    Reply(res, 200, json{{"weight_version", svc->WeightVersion()}});
  });
  srv.Get("/is_paused", [svc](const httplib::Request&, httplib::Response& res) {
    Reply(res, 200, json{{"is_paused", svc->IsPaused()}});
  });
  srv.Get("/health", [svc](const httplib::Request&, httplib::Response& res) {
    Reply(res, 200, svc->Health());
  });
}

}  // namespace wsync
