// Rendezvous store over HTTP: where the ranks of a communicator meet.
//
// Ranks in different processes or hosts publish small values (Gloo pair addresses, an
// NCCL unique id) under string keys and wait for each other's. Three types:
//
//   StoreServer  a tiny in-memory key-value server (PUT/GET/DELETE on /store/<key>,
//                raw bytes as application/octet-stream, 404 when missing). One per
//                group, usually hosted by the trainer's sender process. Its handlers run
//                on httplib's thread pool; Start() and the destructor block briefly.
//   StoreClient  Status-returning client for one server and one key prefix: every key
//                is sent as <prefix>/<key>, so sessions sharing a server never see each
//                other's keys. Get/Wait poll with backoff (5 ms doubling to 100 ms) until
//                the key appears or the deadline passes. Every HTTP request has connect
//                and read timeouts and `Connection: close`. Thread-safe (no shared state
//                beyond immutable configuration).
//   HttpStore    the StoreClient as a gloo::rendezvous::Store for connectFullMesh. Gloo
//                expects exceptions, so failures throw gloo::IoException whose message
//                names the missing keys (through describe_key). Waits end at the earlier
//                of the store's deadline and the timeout Gloo passes.
#pragma once

#include <gloo/rendezvous/store.h>

#include <chrono>
#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/deadline.h"
#include "wsync/status.h"

namespace httplib {
class Server;
}

namespace wsync {

class StoreServer {
 public:
  // Largest value accepted (bytes); bigger PUTs get 413.
  static constexpr size_t kMaxValueBytes = 1 << 20;

  // Binds `host`:`port` (port 0 picks a free one) and serves on a background thread.
  // Fails with kUnavailable when the address cannot be bound.
  static Result<std::unique_ptr<StoreServer>> Start(const std::string& host, int port);

  // Stops the server and joins its thread; in-flight requests finish first.
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  const std::string& host() const { return host_; }
  int port() const { return port_; }

  // Drops every key that starts with `prefix` (a finished session's keys). Thread-safe.
  void ErasePrefix(const std::string& prefix);
  // Number of keys held, for tests and diagnostics. Thread-safe.
  size_t key_count() const;

 private:
  StoreServer(std::string host, int port, std::unique_ptr<httplib::Server> server);
  void InstallRoutes();

  std::string host_;
  int port_;
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  mutable std::mutex mu_;
  std::map<std::string, std::string> values_;  // GUARDED_BY(mu_)
};

class StoreClient {
 public:
  // `prefix` must be non-empty and use only [A-Za-z0-9._-/]; keys likewise.
  StoreClient(std::string host, int port, std::string prefix);

  // Stores `value` under `key`, retrying unreachable-server errors until `deadline`.
  Status Set(const std::string& key, const std::vector<char>& value, Deadline deadline) const;
  // The value of `key`, polling until it exists. kDeadlineExceeded names the key.
  Result<std::vector<char>> Get(const std::string& key, Deadline deadline) const;
  // Blocks until every key exists. kDeadlineExceeded lists the keys still missing.
  Status Wait(const std::vector<std::string>& keys, Deadline deadline) const;
  // One non-blocking look: the subset of `keys` absent right now (order kept).
  Result<std::vector<std::string>> Missing(const std::vector<std::string>& keys,
                                           Deadline deadline) const;

  // "http://host:port".
  std::string url() const;
  const std::string& prefix() const { return prefix_; }

 private:
  // One GET: the value, kNotFound when absent, kUnavailable when the server is unreachable.
  Result<std::vector<char>> TryGet(const std::string& key, Deadline deadline) const;
  std::string Path(const std::string& key) const;

  std::string host_;
  int port_;
  std::string prefix_;
};

// Names a key for error messages, e.g. "3" -> "3 (address of rank 3 (server ...))".
using DescribeKey = std::function<std::string(const std::string& key)>;

class HttpStore : public gloo::rendezvous::Store {
 public:
  // Every operation gives up at `deadline` (or earlier when Gloo passes a timeout).
  HttpStore(std::string host, int port, std::string prefix, Deadline deadline,
            DescribeKey describe_key = nullptr);

  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

  const StoreClient& client() const { return client_; }

 private:
  [[noreturn]] void Throw(const Status& status, const std::vector<std::string>& keys) const;

  StoreClient client_;
  Deadline deadline_;
  DescribeKey describe_key_;
};

}  // namespace wsync
