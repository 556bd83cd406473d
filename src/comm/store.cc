#include "comm/store.h"

#include <fmt/format.h>
#include <gloo/common/error.h>
#include <httplib.h>

#include <algorithm>
#include <cstdio>

namespace wsync {
namespace {

constexpr auto kMinPoll = std::chrono::milliseconds(5);
constexpr auto kMaxPoll = std::chrono::milliseconds(100);
// Upper bound on one HTTP exchange; a store request moves at most ~1 MB on a LAN.
constexpr auto kRequestTimeout = std::chrono::milliseconds(2000);

// Percent-encodes everything outside [A-Za-z0-9._-/] so any key is a valid path.
std::string EncodePath(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '.' || c == '_' || c == '-' || c == '/') {
      out.push_back(static_cast<char>(c));
    } else {
      out += fmt::format("%{:02X}", c);
    }
  }
  return out;
}

// A client whose connect/read/write timeouts end no later than `deadline`
// (at least 1 ms, so an expired deadline still gets one quick attempt).
std::unique_ptr<httplib::Client> MakeClient(const std::string& host, int port, Deadline deadline) {
  auto cli = std::make_unique<httplib::Client>(host, port);
  auto t = std::clamp(deadline.remaining(), std::chrono::milliseconds(1), kRequestTimeout);
  auto sec = static_cast<time_t>(t.count() / 1000);
  auto usec = static_cast<time_t>((t.count() % 1000) * 1000);
  cli->set_connection_timeout(sec, usec);
  cli->set_read_timeout(sec, usec);
  cli->set_write_timeout(sec, usec);
  cli->set_keep_alive(false);
  cli->set_url_encode(false);
  return cli;
}

const httplib::Headers& CloseHeaders() {
  static const httplib::Headers h = {{"Connection", "close"}};
  return h;
}

// Sleeps for the current backoff step (never past the deadline) and doubles it.
void Backoff(std::chrono::milliseconds& step, Deadline deadline) {
  std::this_thread::sleep_for(std::min(step, deadline.remaining()));
  step = std::min(step * 2, kMaxPoll);
}

std::string JoinKeys(const std::vector<std::string>& keys) {
  std::string out;
  for (const auto& k : keys) out += (out.empty() ? "'" : ", '") + k + "'";
  return out;
}

}  // namespace

// ---------------------------------------------------------------- StoreServer

Result<std::unique_ptr<StoreServer>> StoreServer::Start(const std::string& host, int port) {
  auto server = std::make_unique<httplib::Server>();
  int bound = port;
  if (port == 0) {
    bound = server->bind_to_any_port(host);
    if (bound < 0) return Unavailable(fmt::format("store: cannot bind {}:<any port>", host));
  } else if (!server->bind_to_port(host, port)) {
    return Unavailable(fmt::format("store: cannot bind {}:{} (in use?)", host, port));
  }
  std::unique_ptr<StoreServer> self(new StoreServer(host, bound, std::move(server)));
  self->InstallRoutes();
  // The socket already listens, so clients may connect before this thread runs.
  self->thread_ = std::thread([s = self->server_.get()] { s->listen_after_bind(); });
  // httplib's stop() is a no-op until the accept loop runs; wait for it so that the
  // destructor can always stop the server. listen_after_bind sets it on entry.
  while (!self->server_->is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return self;
}

StoreServer::StoreServer(std::string host, int port, std::unique_ptr<httplib::Server> server)
    : host_(std::move(host)), port_(port), server_(std::move(server)) {}

StoreServer::~StoreServer() {
  server_->stop();
  if (thread_.joinable()) thread_.join();
}

void StoreServer::InstallRoutes() {
  server_->set_payload_max_length(kMaxValueBytes);
  server_->set_read_timeout(5, 0);
  server_->set_write_timeout(5, 0);
  server_->set_keep_alive_max_count(1);
  server_->Put("/store/(.+)", [this](const httplib::Request& req, httplib::Response& res) {
    std::lock_guard<std::mutex> lock(mu_);
    values_[req.matches[1]] = req.body;
    res.status = 200;
  });
  server_->Get("/store/(.+)", [this](const httplib::Request& req, httplib::Response& res) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = values_.find(req.matches[1]);
    if (it == values_.end()) {
      res.status = 404;
      return;
    }
    res.set_content(it->second.data(), it->second.size(), "application/octet-stream");
  });
  server_->Delete("/store/(.+)", [this](const httplib::Request& req, httplib::Response& res) {
    std::lock_guard<std::mutex> lock(mu_);
    res.status = values_.erase(req.matches[1]) ? 200 : 404;
  });
}

void StoreServer::ErasePrefix(const std::string& prefix) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = values_.lower_bound(prefix);
  while (it != values_.end() && it->first.compare(0, prefix.size(), prefix) == 0) {
    it = values_.erase(it);
  }
}

size_t StoreServer::key_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return values_.size();
}

// ---------------------------------------------------------------- StoreClient

StoreClient::StoreClient(std::string host, int port, std::string prefix)
    : host_(std::move(host)), port_(port), prefix_(std::move(prefix)) {}

std::string StoreClient::url() const { return fmt::format("http://{}:{}", host_, port_); }

std::string StoreClient::Path(const std::string& key) const {
  return "/store/" + EncodePath(prefix_ + "/" + key);
}

Status StoreClient::Set(const std::string& key, const std::vector<char>& value,
                        Deadline deadline) const {
  auto step = kMinPoll;
  std::string last_error;
  do {
    auto cli = MakeClient(host_, port_, deadline);
    auto res =
        cli->Put(Path(key), CloseHeaders(), value.data(), value.size(), "application/octet-stream");
    if (res && res->status == 200) return Status::Ok();
    if (res) {
      // The server answered: retrying cannot help.
      return Internal(fmt::format("store {}: PUT key '{}/{}' ({} bytes) answered HTTP {}", url(),
                                  prefix_, key, value.size(), res->status));
    }
    last_error = httplib::to_string(res.error());
    Backoff(step, deadline);
  } while (!deadline.expired());
  return Unavailable(fmt::format("store {}: cannot set key '{}/{}' before the deadline: {}", url(),
                                 prefix_, key, last_error));
}

Result<std::vector<char>> StoreClient::TryGet(const std::string& key, Deadline deadline) const {
  auto cli = MakeClient(host_, port_, deadline);
  auto res = cli->Get(Path(key), CloseHeaders());
  if (!res) {
    return Unavailable(
        fmt::format("store {} unreachable: {}", url(), httplib::to_string(res.error())));
  }
  if (res->status == 404) return NotFound(key);
  if (res->status != 200) {
    return Internal(fmt::format("store {}: GET key '{}/{}' answered HTTP {}", url(), prefix_, key,
                                res->status));
  }
  return std::vector<char>(res->body.begin(), res->body.end());
}

Result<std::vector<char>> StoreClient::Get(const std::string& key, Deadline deadline) const {
  auto start = Deadline::Clock::now();
  auto step = kMinPoll;
  Status last;
  do {
    auto r = TryGet(key, deadline);
    if (r.ok()) return r;
    last = r.status();
    if (last.code() == StatusCode::kInternal) return last;
    Backoff(step, deadline);
  } while (!deadline.expired());
  double waited = std::chrono::duration<double>(Deadline::Clock::now() - start).count();
  std::string why = last.code() == StatusCode::kUnavailable ? " (" + last.message() + ")" : "";
  return DeadlineExceeded(fmt::format("store {}: key '{}/{}' did not appear within {:.1f} s{}",
                                      url(), prefix_, key, waited, why));
}

Status StoreClient::Wait(const std::vector<std::string>& keys, Deadline deadline) const {
  auto start = Deadline::Clock::now();
  auto step = kMinPoll;
  std::vector<std::string> pending = keys;
  Status last;
  do {
    auto missing = Missing(pending, deadline);
    if (missing.ok()) {
      pending = std::move(*missing);
      if (pending.empty()) return Status::Ok();
    } else {
      last = missing.status();
      if (last.code() == StatusCode::kInternal) return last;
    }
    Backoff(step, deadline);
  } while (!deadline.expired());
  double waited = std::chrono::duration<double>(Deadline::Clock::now() - start).count();
  std::string why = last.ok() ? "" : " (" + last.message() + ")";
  return DeadlineExceeded(
      fmt::format("store {}: keys {} under '{}' did not appear within {:.1f} s{}", url(),
                  JoinKeys(pending), prefix_, waited, why));
}

Result<std::vector<std::string>> StoreClient::Missing(const std::vector<std::string>& keys,
                                                      Deadline deadline) const {
  std::vector<std::string> missing;
  for (const auto& key : keys) {
    auto r = TryGet(key, deadline);
    if (r.ok()) continue;
    if (r.status().code() != StatusCode::kNotFound) return r.status();
    missing.push_back(key);
  }
  return missing;
}

// ---------------------------------------------------------------- HttpStore

HttpStore::HttpStore(std::string host, int port, std::string prefix, Deadline deadline,
                     DescribeKey describe_key)
    : client_(std::move(host), port, std::move(prefix)),
      deadline_(deadline),
      describe_key_(std::move(describe_key)) {}

void HttpStore::Throw(const Status& status, const std::vector<std::string>& keys) const {
  std::string msg = status.message();
  if (describe_key_ && status.code() == StatusCode::kDeadlineExceeded) {
    msg += "; waiting for";
    for (const auto& k : keys) msg += " [" + describe_key_(k) + "]";
  }
  throw ::gloo::IoException(msg);
}

void HttpStore::set(const std::string& key, const std::vector<char>& data) {
  Status s = client_.Set(key, data, deadline_);
  if (!s.ok()) Throw(s, {key});
}

std::vector<char> HttpStore::get(const std::string& key) {
  auto r = client_.Get(key, deadline_);
  if (!r.ok()) Throw(r.status(), {key});
  return std::move(r).value();
}

void HttpStore::wait(const std::vector<std::string>& keys) {
  Status s = client_.Wait(keys, deadline_);
  if (!s.ok()) Throw(s, keys);
}

void HttpStore::wait(const std::vector<std::string>& keys,
                     const std::chrono::milliseconds& timeout) {
  Deadline d = timeout.count() > 0 ? deadline_.Min(Deadline::In(timeout)) : deadline_;
  Status s = client_.Wait(keys, d);
  if (!s.ok()) Throw(s, keys);
}

}  // namespace wsync
