// HttpControlServer: serves a ControlService over HTTP/1.1 JSON (libmicrohttpd); GET
// /metrics answers Prometheus text.
//
// Binds 127.0.0.1 unless told otherwise. The routes, the API key check and the error JSON
// are HttpRouter's (http_routes.h); this class moves bytes. One epoll thread reads every
// connection, so a connection that stalls costs a socket, never a thread: /health and the
// next sync are served while any number of connections (up to max_connections) dawdle.
// What the server enforces, per request:
//  - the head: 401 / 404 / 415 (Content-Encoding other than identity) and 413 (announced
//    Content-Length more than discard_bytes over max_body_bytes) go out before any body
//    byte is read, and the connection is closed after them;
//  - the size: a body is counted as it arrives, whether announced or chunked, and dropped
//    once past max_body_bytes; it is answered 413 when it ends (so a client that writes
//    its whole body before reading sees the 413), or the connection is cut once it runs
//    discard_bytes past the limit;
//  - the time: headers must be complete within header_timeout_seconds of the connection's
//    start or of its previous reply (an idle keep-alive connection is closed then too);
//    a body within body_timeout_seconds of its headers; either way the connection is cut,
//    however slowly bytes trickle in.
// No route runs on the I/O thread: each runs on a worker while its connection is
// suspended, so a call that blocks for minutes (an init rendezvous, an update) holds one
// worker and nothing else. Workers come in three sets, one per HttpLane (http_routes.h):
// worker_threads for the calls that last as long as generation does (/v1/completions,
// /pause and /sleep with mode=wait), kControlWorkers for the trainer's session and
// control calls, kReadWorkers for the routes that only read state (GET /health,
// /weight_info, /is_paused, /get_world_size, /metrics, ...). So however many completions and waiting
// pauses are in flight, a sync's init/start/update/finish has a worker, /health answers,
// and a service call that blocks where it should not stalls only its own lane.
// Memory: the bodies being read or handled at once hold at most twice max_body_bytes (at
// least 64 MiB), counted as bytes arrive; a body that would pass that budget is read to
// its end without being kept and answered 503. A chunked body's buffer grows to the body
// limit at most. After a large body is handled the heap's free memory is returned to the
// system. The request target is refused (400) when it holds an encoded NUL (%00) or more
// than kMaxQueryArgs query arguments.
// A reaper thread enforces the deadlines (shutdown(2) of a late connection's socket).
// Start() returns once the socket is listening; Stop() stops accepting, lets in-flight
// calls finish, and joins every thread.
// Protocol errors found by the library itself (a malformed request line, headers over
// its memory limit) get the library's own small non-JSON replies.
#pragma once

#include <memory>
#include <string>

#include "control/control_service.h"
#include "control/http_routes.h"
#include "wsync/server.h"
#include "wsync/status.h"

namespace wsync {

// Threads for the read-only routes (GET /health, ...), apart from worker_threads.
inline constexpr int kReadWorkers = 2;
// Threads for the trainer's session and control calls (HttpLane::kControl), apart from
// worker_threads: completions and waiting pauses can never take them.
inline constexpr int kControlWorkers = 8;

// HttpServerOptions (the listening address, limits and deadlines) is public: wsync/server.h.

class HttpControlServer {
 public:
  static Result<std::unique_ptr<HttpControlServer>> Start(const HttpServerOptions& options,
                                                          ControlService* service);
  ~HttpControlServer();

  int port() const { return port_; }
  std::string url() const;
  // Stops accepting, finishes in-flight requests, joins every thread. Idempotent.
  void Stop();

  struct Impl;  // http_server.cc

 private:
  HttpControlServer() = default;

  HttpServerOptions options_;
  std::unique_ptr<Impl> impl_;
  int port_ = 0;
};

}  // namespace wsync
