// HttpRouter: the control plane's request -> response logic, without sockets.
//
// The HTTP server (http_server.h) turns bytes into an HttpRequest and sends back the
// HttpResponse; everything between (the API key check, body admission, JSON parsing, route
// dispatch into a ControlService, the error JSON) lives here, so that unit tests and the
// fuzz target (http_routes_fuzz.cc) drive exactly what the server runs.
//
// A request goes through two steps. Admit() looks at the head alone (method, path,
// headers, announced body size) and refuses what needs no body to refuse: 401 without the
// key, 404 for no route, 405 (with Allow) for a route's path under another method, as
// vLLM's server answers it, 413 for a Content-Length over the limit, 415 for a
// Content-Encoding other than identity. The server calls it before reading any body, and
// TooLarge() when a body of unannounced size (chunked) passes the limit. Handle() runs the
// whole request, Admit() included. Neither ever throws: any exception, from parsing or from
// the service, becomes a 500 JSON reply, and every reply is valid UTF-8 JSON whatever bytes
// the request held (invalid sequences become U+FFFD), except GET /metrics's 200, which is
// Prometheus text (kPrometheusContentType).
//
// Errors are `{"error": {"message", "type", "code"}}`, the status from HttpStatusFor().
// Thread-safe: Handle() may run on many threads at once (the service must be thread-safe,
// see control_service.h).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "control/control_service.h"
#include "wsync/status.h"

namespace wsync {

// Query arguments a request may carry; more is a 400 (HttpRouter::TargetRefusal).
inline constexpr size_t kMaxQueryArgs = 64;

// The HTTP status code for a Status code, and back: the one place the mapping lives,
// used by every HTTP front (the C++ server here, the Python fronts through the binding's
// http_status_for) and by the trainer's client.
int HttpStatusFor(StatusCode code);
// The Status a non-2xx HTTP reply maps to (the inverse of HttpStatusFor; 422 and 403 as
// other servers answer them).
StatusCode StatusCodeForHttp(int http_status);

struct HttpRequest {
  std::string method;  // "GET", "POST", ...
  std::string path;    // percent-decoded, without the query; arbitrary bytes
  // Query parameters, percent-decoded; the first of repeated names wins.
  std::map<std::string, std::string> params;
  // Every query parameter in request order, repeated names included (/wake_up?tags=a&tags=b).
  std::vector<std::pair<std::string, std::string>> query;
  // Header names lower-cased; the first of repeated names wins.
  std::map<std::string, std::string> headers;
  std::string body;
  std::string remote_addr;  // the TCP peer's IP address, "127.0.0.1" or "::1"; may be empty

  // The value of a header (name in lower case), or nullptr.
  const std::string* header(std::string_view lower_name) const;
};

// Which set of server threads runs a route, so that no kind of call can take the threads
// another kind needs (http_server.h says how many each has).
enum class HttpLane {
  kRead,        // GET routes that only read state (/health, /weight_info, /metrics, ...)
  kControl,     // the trainer's session and control calls: init, start, update, finish,
                // versions, the checker, resume, abort, pause/sleep other than mode=wait
  kGeneration,  // calls that last as long as generation does: /v1/completions, and
                // /pause and /sleep with mode=wait
};

// The Content-Type of GET /metrics: Prometheus's text exposition format.
inline constexpr std::string_view kPrometheusContentType = "text/plain; version=0.0.4; charset=utf-8";

struct HttpResponse {
  int status = 200;
  std::string body;  // valid UTF-8: JSON, unless content_type says otherwise
  std::string_view content_type = "application/json";  // a literal: the reply never owns it
  std::string_view allow;  // the Allow header of a 405 ("GET" or "POST"), a literal; empty: none
};

struct HttpRouterOptions {
  std::string api_key;                        // empty: no authentication
  size_t max_body_bytes = size_t{256} << 20;  // bodies over this are 413
};

class HttpRouter {
 public:
  HttpRouter(HttpRouterOptions options, ControlService* service);

  // A refusal decided from the head alone, or nullopt to read the body. `content_length`
  // is the announced size, nullopt when none was given (chunked, or no body).
  std::optional<HttpResponse> Admit(const HttpRequest& head,
                                    std::optional<uint64_t> content_length) const noexcept;
  // The 413 for a body that passed max_body_bytes while it arrived.
  HttpResponse TooLarge(const HttpRequest& head) const noexcept;
  // The reply to a whole request. May block for as long as the service call does (an init
  // rendezvous, an update), unless LaneOf() says the route only reads state (kRead).
  HttpResponse Handle(const HttpRequest& req) noexcept;
  // The lane of a request, from its head (method, path, query).
  static HttpLane LaneOf(const HttpRequest& head);
  // The JSON body of a POST to `path` as the route reads it: depth-bounded, and only the
  // top-level fields the route reads are built (the rest are skipped by the parser);
  // InvalidArgument naming "body of PATH" for malformed text, excessive nesting, or a body
  // that is not an object.
  static Result<nlohmann::json> ParseBody(std::string_view path, std::string_view body);

  // Why a request target (the request line's path and query as received, still
  // percent-encoded) is refused with a 400, or "" when it is not. A NUL byte would cut a C
  // string short (`/sleep?level=1%00x` read as level=1), so an encoded one is refused
  // anywhere in the target; a query of more than kMaxQueryArgs arguments is refused before
  // it is split.
  static std::string TargetRefusal(std::string_view target);

  // A JSON error reply; `message` may hold any bytes.
  static HttpResponse Error(const Status& status);

  const HttpRouterOptions& options() const { return options_; }

 private:
  class BodyCache;
  HttpResponse Dispatch(const HttpRequest& req);
  bool Authorized(const HttpRequest& head) const;

  HttpRouterOptions options_;
  ControlService* service_;
  std::string key_digest_;  // SHA-256 of "Bearer " + api_key
  std::shared_ptr<BodyCache> cache_;
};

}  // namespace wsync
