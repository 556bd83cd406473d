#include "control/client.h"

#include <httplib.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include <fmt/format.h>

#include "control/http_routes.h"
#include "core/json_limits.h"

namespace wsync {
namespace {

using nlohmann::json;

// Shared by the caller and the request threads; outlives whichever finishes last.
class FanOut final : public FanOutClient::Pending {
 public:
  explicit FanOut(std::vector<std::string> labels)
      : labels_(std::move(labels)),
        replies_(labels_.size()),
        statuses_(labels_.size()),
        done_(labels_.size(), false) {}

  void Finish(size_t i, Result<json> r) {
    std::lock_guard lock(mu_);
    if (r.ok()) {
      replies_[i] = std::move(*r);
    } else {
      statuses_[i] = r.status();
      any_failed_ = true;
    }
    done_[i] = true;
    ++finished_;
    cv_.notify_all();
  }

  Result<std::vector<json>> Wait(Deadline deadline) override {
    std::unique_lock lock(mu_);
    cv_.wait_until(lock, deadline.at(), [&] { return finished_ == done_.size(); });
    // The first cause, in server order: a server that only gave up because another one
    // refused (kAborted) is reported only when nothing else failed.
    const Status* first = nullptr;
    for (size_t i = 0; i < done_.size(); ++i) {
      if (!done_[i] || statuses_[i].ok()) continue;
      if (statuses_[i].code() != StatusCode::kAborted) return statuses_[i];
      if (first == nullptr) first = &statuses_[i];
    }
    if (first != nullptr && finished_ == done_.size()) return *first;
    if (finished_ != done_.size()) {
      std::vector<std::string> waiting;
      for (size_t i = 0; i < done_.size(); ++i) {
        if (!done_[i]) waiting.push_back(labels_[i]);
      }
      return DeadlineExceeded(fmt::format("no answer within the deadline from {}",
                                          fmt::join(waiting, ", ")));
    }
    return replies_;
  }
  bool Done() const override {
    std::lock_guard lock(mu_);
    return finished_ == done_.size();
  }
  bool AnyFailed() const override {
    std::lock_guard lock(mu_);
    return any_failed_;
  }

 private:
  const std::vector<std::string> labels_;  // server URLs, for "no answer from ..."
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<json> replies_;
  std::vector<Status> statuses_;
  std::vector<bool> done_;
  size_t finished_ = 0;
  bool any_failed_ = false;
};

// How much of an error reply's message a Status keeps: a server's reply is untrusted.
constexpr size_t kMaxReplyMessageBytes = 4096;

// An error reply's code and message. wsync servers put the Status code's name in
// error.type and the message in error.message; other servers send {"error": "..."},
// FastAPI {"detail": ...}, or text. The body is parsed depth-bounded, so the one dump
// below recurses at most kMaxJsonDepth deep.
std::pair<std::optional<StatusCode>, std::string> ErrorOf(const std::string& body) {
  Result<json> parsed = ParseUntrustedJson(body, "error reply");
  if (parsed.ok() && parsed->is_object()) {
    const json& j = *parsed;
    if (auto e = j.find("error"); e != j.end()) {
      if (e->is_string()) return {std::nullopt, TextExcerpt(e->get_ref<const std::string&>(), kMaxReplyMessageBytes)};
      if (e->is_object()) {
        std::optional<StatusCode> code;
        if (auto type = e->find("type"); type != e->end() && type->is_string()) {
          for (int c = 0; c <= static_cast<int>(StatusCode::kInternal); ++c) {
            if (StatusCodeName(static_cast<StatusCode>(c)) == type->get_ref<const std::string&>()) {
              code = static_cast<StatusCode>(c);
            }
          }
        }
        if (auto m = e->find("message"); m != e->end() && m->is_string()) {
          return {code, TextExcerpt(m->get_ref<const std::string&>(), kMaxReplyMessageBytes)};
        }
      }
    }
    if (auto d = j.find("detail"); d != j.end()) {
      return {std::nullopt, TextExcerpt(d->dump(-1, ' ', false, json::error_handler_t::replace), kMaxReplyMessageBytes)};
    }
  }
  return {std::nullopt, TextExcerpt(body, 500)};
}

}  // namespace

// Idle kept-alive connections per server URL, handed to one request at a time.
class FanOutClient::Connections {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr size_t kMaxIdlePerServer = 4;

  // A connection to `url`: an idle one used less than kReuseIdleSeconds ago, else a new
  // one. `reused` says which.
  std::unique_ptr<httplib::Client> Take(const std::string& url, bool* reused) {
    std::vector<std::unique_ptr<httplib::Client>> stale;  // closed outside the lock
    std::unique_ptr<httplib::Client> c;
    {
      std::lock_guard lock(mu_);
      std::vector<Idle>& idle = idle_[url];
      auto fresh = Clock::now() - std::chrono::duration_cast<Clock::duration>(
                                      std::chrono::duration<double>(kReuseIdleSeconds));
      while (!idle.empty()) {
        Idle last = std::move(idle.back());
        idle.pop_back();
        if (last.since >= fresh) {
          c = std::move(last.client);
          break;
        }
        stale.push_back(std::move(last.client));
      }
      for (Idle& i : idle) {  // older than the one taken
        if (i.since < fresh) stale.push_back(std::move(i.client));
      }
      std::erase_if(idle, [](const Idle& i) { return i.client == nullptr; });
    }
    *reused = c != nullptr;
    if (c) return c;
    c = std::make_unique<httplib::Client>(url);
    c->set_keep_alive(true);
    c->set_tcp_nodelay(true);
    return c;
  }
  // Back after a request that got a whole reply.
  void Give(const std::string& url, std::unique_ptr<httplib::Client> c) {
    std::lock_guard lock(mu_);
    std::vector<Idle>& idle = idle_[url];
    if (idle.size() < kMaxIdlePerServer) idle.push_back(Idle{std::move(c), Clock::now()});
  }

 private:
  struct Idle {
    std::unique_ptr<httplib::Client> client;
    Clock::time_point since;
  };
  std::mutex mu_;
  std::map<std::string, std::vector<Idle>> idle_;  // GUARDED_BY(mu_); most recent last
};

namespace {

// What a failed request met, in words a user acts on.
std::string DescribeHttpError(httplib::Error err) {
  switch (err) {
    case httplib::Error::Connection:
      return "connection refused (no server listening there, or the host cannot be reached)";
    case httplib::Error::ConnectionTimeout: return "connection timed out";
    case httplib::Error::Read: return "the connection closed before a reply (the server died or dropped it)";
    case httplib::Error::Write: return "the connection closed while sending the request";
    default: return httplib::to_string(err);
  }
}

bool ClosesConnection(const httplib::Response& res) {
  std::string v = res.get_header_value("Connection");
  std::ranges::transform(v, v.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return v.find("close") != std::string::npos;
}

Result<json> DoRequest(FanOutClient::Connections& connections, const std::string& url, const std::string& method,
                       const std::string& path, const std::string* body, const ClientOptions& options,
                       Deadline deadline) {
  std::string what = fmt::format("{}: {} {}", url, method, path);
  httplib::Headers headers;
  if (!options.api_key.empty()) headers.emplace("Authorization", "Bearer " + options.api_key);
  bool reused = false;
  std::unique_ptr<httplib::Client> cli;
  httplib::Result res(nullptr, httplib::Error::Unknown);
  for (int attempt = 0; attempt < 2; ++attempt) {
    cli = connections.Take(url, &reused);
    double left = std::max(0.001, deadline.remaining_seconds());
    auto connect = std::chrono::duration<double>(std::min(left, options.connect_timeout_seconds));
    cli->set_connection_timeout(std::chrono::duration_cast<std::chrono::microseconds>(connect));
    auto io = std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::duration<double>(left));
    cli->set_read_timeout(io);
    cli->set_write_timeout(io);
    res = method == "GET" ? cli->Get(path, headers)
                          : cli->Post(path, headers, body == nullptr ? std::string() : *body, "application/json");
    // A kept-alive connection the server closed meanwhile fails while the request is
    // written, before the server can have acted on it: once more on a new connection.
    if (res || !reused || res.error() != httplib::Error::Write) break;
  }
  // Only a connection whose last reply was a success is reused: a server may close the
  // connection right after an error reply (uvicorn does when the app answered without
  // reading the whole request), and a request written into it before the close arrives
  // is never answered.
  if (res && res->status >= 200 && res->status < 300 && !ClosesConnection(*res)) {
    connections.Give(url, std::move(cli));
  }
  if (!res) {
    auto err = res.error();
    if (err == httplib::Error::Read && deadline.expired()) {
      return DeadlineExceeded(fmt::format("{}: no answer within the deadline", what));
    }
    return Unavailable(fmt::format("{}: {}", what, DescribeHttpError(err)));
  }
  if (res->status < 200 || res->status >= 300) {
    auto [code, message] = ErrorOf(res->body);
    return Status(code.value_or(StatusCodeForHttp(res->status)),
                  fmt::format("{} -> {}: {}", what, res->status, message));
  }
  if (res->body.empty()) return json::object();
  Result<json> j = ParseUntrustedJson(res->body, "reply");
  if (!j.ok()) return Internal(fmt::format("{}: {}", what, j.status().message()));
  return std::move(*j);
}

}  // namespace

FanOutClient::FanOutClient(std::vector<std::string> urls, ClientOptions options)
    : urls_(std::move(urls)), options_(std::move(options)), connections_(std::make_shared<Connections>()) {
  for (auto& u : urls_) {
    while (!u.empty() && u.back() == '/') u.pop_back();
    if (u.find("://") == std::string::npos) u = "http://" + u;
  }
}

std::vector<std::shared_ptr<const std::string>> FanOutClient::Serialize(const std::vector<json>& bodies) {
  std::vector<std::shared_ptr<const std::string>> out;
  out.reserve(bodies.size());
  for (const json& b : bodies) out.push_back(b.is_null() ? nullptr : std::make_shared<const std::string>(b.dump()));
  return out;
}

std::shared_ptr<FanOutClient::Pending> FanOutClient::Start(const std::string& method,
                                                           const std::vector<std::string>& paths,
                                                           std::vector<std::shared_ptr<const std::string>> bodies,
                                                           Deadline deadline, bool blocking) const {
  auto fan = std::make_shared<FanOut>(urls_);
  auto path_of = [&](size_t i) -> const std::string& { return paths.size() == 1 ? paths[0] : paths[i]; };
  if (blocking && urls_.size() == 1) {  // no thread to start and join
    fan->Finish(0, DoRequest(*connections_, urls_[0], method, path_of(0), bodies[0].get(), options_, deadline));
    return fan;
  }
  for (size_t i = 0; i < urls_.size(); ++i) {
    std::thread([fan, i, connections = connections_, url = urls_[i], method, path = path_of(i),
                 body = std::move(bodies[i]), options = options_, deadline] {
      fan->Finish(i, DoRequest(*connections, url, method, path, body.get(), options, deadline));
    }).detach();
  }
  return fan;
}

Result<std::vector<json>> FanOutClient::Get(const std::string& path, Deadline deadline) const {
  return Start("GET", {path}, std::vector<std::shared_ptr<const std::string>>(urls_.size()), deadline, true)
      ->Wait(deadline);
}

Result<std::vector<json>> FanOutClient::Post(const std::string& path, const json& body,
                                             Deadline deadline) const {
  auto serialized = body.is_null() ? nullptr : std::make_shared<const std::string>(body.dump());
  return Start("POST", {path}, std::vector<std::shared_ptr<const std::string>>(urls_.size(), serialized), deadline,
               true)
      ->Wait(deadline);
}

Result<std::vector<json>> FanOutClient::PostEach(const std::string& path, std::vector<json> bodies,
                                                 Deadline deadline) const {
  if (bodies.size() != urls_.size()) {
    return Internal(fmt::format("{} bodies for {} servers", bodies.size(), urls_.size()));
  }
  return Start("POST", {path}, Serialize(bodies), deadline, true)->Wait(deadline);
}

std::shared_ptr<FanOutClient::Pending> FanOutClient::PostAsync(const std::string& path,
                                                               std::vector<json> bodies,
                                                               Deadline deadline) const {
  bodies.resize(urls_.size());
  return Start("POST", {path}, Serialize(bodies), deadline);
}

std::shared_ptr<FanOutClient::Pending> FanOutClient::PostAsync(const std::string& path,
                                                               std::shared_ptr<const std::string> body,
                                                               Deadline deadline) const {
  return Start("POST", {path}, std::vector<std::shared_ptr<const std::string>>(urls_.size(), std::move(body)),
               deadline);
}

std::shared_ptr<FanOutClient::Pending> FanOutClient::PostAsync(std::vector<std::string> paths,
                                                               std::vector<json> bodies,
                                                               Deadline deadline) const {
  paths.resize(urls_.size());
  bodies.resize(urls_.size());
  return Start("POST", paths, Serialize(bodies), deadline);
}

}  // namespace wsync
