// HttpControlServer: serves a ControlService over HTTP/1.1 JSON (cpp-httplib).
//
// Binds 127.0.0.1 unless told otherwise. With an API key, every route but /health needs
// `Authorization: Bearer KEY` (401 otherwise). Bodies over max_body_bytes get 413.
// Errors are `{"error": {"message", "type", "code"}}` with the status code from
// HttpStatusFor(). Start() returns once the socket is listening; the server runs on its
// own threads until Stop() or destruction. Nothing on the wire is deserialized beyond
// plain JSON.
#pragma once

#include <memory>
#include <string>
#include <thread>

#include "control/control_service.h"
#include "wsync/status.h"

namespace httplib {
class Server;
}

namespace wsync {

struct HttpServerOptions {
  std::string host = "127.0.0.1";
  int port = 0;                 // 0: pick a free port (see port())
  std::string api_key;          // empty: no authentication
  size_t max_body_bytes = size_t{256} << 20;  // 256 MiB: room for MoE update_info lists
};

// The HTTP status code for a Status code; the one place this mapping lives.
int HttpStatusFor(StatusCode code);

class HttpControlServer {
 public:
  static Result<std::unique_ptr<HttpControlServer>> Start(const HttpServerOptions& options,
                                                          ControlService* service);
  ~HttpControlServer();

  int port() const { return port_; }
  std::string url() const;
  // Stops accepting, finishes in-flight requests, joins the listener thread.
  void Stop();

 private:
  HttpControlServer() = default;
  void Routes();

  HttpServerOptions options_;
  ControlService* service_ = nullptr;
  std::unique_ptr<httplib::Server> server_;
  std::thread listener_;
  int port_ = 0;
};

}  // namespace wsync
