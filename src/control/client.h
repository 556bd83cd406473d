// FanOutClient: the trainer's side of the control plane.
//
// Every call goes to every server concurrently, waits for all of them (bounded by a
// Deadline) and fails with the first server's error (in server order), carrying the
// server's own message: "http://127.0.0.1:8001: POST /update_weights -> 400: shape of
// ...". Connections are kept alive (with TCP_NODELAY) and reused while they have been idle
// less than kReuseIdleSeconds, well inside the idle timeouts of HTTP servers (5 s for
// cpp-httplib and uvicorn), so that the calls of one sync do not each pay a TCP connect
// and a server-side accept; a connection idle longer (over a training step) is closed and
// a fresh one made. A request is never retried once it may have reached the server,
// because a half-done stateful call must not be repeated: only a reused connection that
// fails while the request is being written is replaced, once. Thread-safe; a fan-out to
// several servers runs each request on its own thread, so a call that times out leaves
// them to finish in the background without blocking the caller (a blocking call to one
// server runs on the caller's thread).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/deadline.h"
#include "wsync/status.h"

namespace wsync {

inline constexpr double kReuseIdleSeconds = 2;

struct ClientOptions {
  std::string api_key;                 // sent as `Authorization: Bearer KEY` when set
  double connect_timeout_seconds = 10;  // per TCP connect; also bounded by the deadline
};

// StatusCodeForHttp (a non-2xx reply's Status) lives beside HttpStatusFor in
// control/http_routes.h.

class FanOutClient {
 public:
  FanOutClient(std::vector<std::string> server_urls, ClientOptions options);

  const std::vector<std::string>& urls() const { return urls_; }
  class Connections;  // the idle kept-alive connections (client.cc)

  // A fan-out in flight. Wait() returns every server's JSON reply, or the first error.
  class Pending {
   public:
    virtual ~Pending() = default;
    virtual Result<std::vector<nlohmann::json>> Wait(Deadline deadline) = 0;
    // True once every server has answered (or failed).
    virtual bool Done() const = 0;
    // True once any server has failed; lets a caller stop early.
    virtual bool AnyFailed() const = 0;
  };

  Result<std::vector<nlohmann::json>> Get(const std::string& path, Deadline deadline) const;
  Result<std::vector<nlohmann::json>> Post(const std::string& path, const nlohmann::json& body,
                                           Deadline deadline) const;
  // One body per server, in server order (per-server init payloads).
  Result<std::vector<nlohmann::json>> PostEach(const std::string& path,
                                               std::vector<nlohmann::json> bodies,
                                               Deadline deadline) const;
  // Starts a POST to every server and returns at once.
  std::shared_ptr<Pending> PostAsync(const std::string& path, std::vector<nlohmann::json> bodies,
                                     Deadline deadline) const;
  // The same, with one already-serialized JSON body for every server (a trainer keeps the
  // serialized update_info of an unchanged tensor list across syncs: no dump, no copies).
  std::shared_ptr<Pending> PostAsync(const std::string& path, std::shared_ptr<const std::string> body,
                                     Deadline deadline) const;
  // One path and one body per server, in server order (a fleet of wsync servers and vLLM
  // ones, which take some steps as collective RPCs).
  std::shared_ptr<Pending> PostAsync(std::vector<std::string> paths, std::vector<nlohmann::json> bodies,
                                     Deadline deadline) const;

 private:
  // One body per server; null for none (GET). `blocking`: the caller waits at once, so a
  // single server's request may run on the caller's thread.
  // `paths`: one for every server, or one per server.
  std::shared_ptr<Pending> Start(const std::string& method, const std::vector<std::string>& paths,
                                 std::vector<std::shared_ptr<const std::string>> bodies, Deadline deadline,
                                 bool blocking = false) const;
  static std::vector<std::shared_ptr<const std::string>> Serialize(const std::vector<nlohmann::json>& bodies);
  std::vector<std::string> urls_;
  ClientOptions options_;
  std::shared_ptr<Connections> connections_;  // shared with requests still running
};

}  // namespace wsync
