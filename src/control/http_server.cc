#include "control/http_server.h"

#include <arpa/inet.h>
#include <microhttpd.h>
#include <netdb.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdarg>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <vector>

#include <malloc.h>

#include <fmt/format.h>

#include "core/log.h"

namespace wsync {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int64_t kNoDeadline = INT64_MAX;
constexpr uint64_t kReserveBytes = uint64_t{4} << 20;
// Bodies at least this large are followed by a malloc_trim(3) once handled, so that the
// memory of a large parsed body goes back to the system instead of staying with the heap.
constexpr size_t kTrimAfterBytes = size_t{1} << 20;

int64_t NowNs() { return Clock::now().time_since_epoch().count(); }
int64_t InNs(double seconds) {
  return NowNs() + static_cast<int64_t>(seconds * 1e9);
}

// A fixed set of threads running queued tasks. Shutdown() runs what is queued, then joins.
class WorkerPool {
 public:
  explicit WorkerPool(int threads) {
    for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Loop(); });
  }
  ~WorkerPool() { Shutdown(); }

  // Runs `before` and queues `task` under the pool's lock, or returns false once shut down
  // (neither is run then).
  bool Submit(const std::function<void()>& before, std::function<void()> task) {
    std::lock_guard lock(mu_);
    if (stopped_) return false;
    before();
    tasks_.push_back(std::move(task));
    cv_.notify_one();
    return true;
  }
  void Shutdown() {
    {
      std::lock_guard lock(mu_);
      stopped_ = true;
      cv_.notify_all();
    }
    for (std::thread& t : threads_) {
      if (t.joinable()) t.join();
    }
  }

 private:
  void Loop() {
    while (true) {
      std::function<void()> task;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stopped_ || !tasks_.empty(); });
        if (tasks_.empty()) return;  // stopped and drained
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;  // GUARDED_BY(mu_)
  bool stopped_ = false;                     // GUARDED_BY(mu_)
  std::vector<std::thread> threads_;
};

// One TCP connection. `deadline` (steady clock, ns) is when the reaper cuts it.
struct ConnState {
  int fd = -1;
  std::atomic<int64_t> deadline{kNoDeadline};
};

// One request, from its request line to its reply (MHD's per-request context).
struct RequestState {
  ~RequestState() {
    if (held) held->fetch_sub(charged);
  }
  HttpRequest req;
  bool head_done = false;  // the head has been read into `req`
  // Why the request target is refused (an encoded NUL, too many query arguments), found
  // before MHD splits the query; empty when it is not.
  std::string target_refusal;
  ConnState* conn = nullptr;
  uint64_t received = 0;  // body bytes, counted as they arrive
  bool too_large = false;
  bool over_budget = false;  // the server's budget of body bytes would be passed
  // Body bytes this request holds of the server's budget, returned when it ends.
  std::atomic<uint64_t>* held = nullptr;
  uint64_t charged = 0;
  std::optional<HttpResponse> response;  // set by a worker before it resumes the connection
};

MHD_Result Queue(MHD_Connection* c, const HttpResponse& r) {
  MHD_Response* resp = MHD_create_response_from_buffer(r.body.size(), const_cast<char*>(r.body.data()),
                                                       MHD_RESPMEM_MUST_COPY);
  if (!resp) return MHD_NO;
  const std::string content_type(r.content_type);
  MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, content_type.c_str());
  if (!r.allow.empty()) MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW, std::string(r.allow).c_str());
  MHD_Result ok = MHD_queue_response(c, static_cast<unsigned int>(r.status), resp);
  MHD_destroy_response(resp);
  return ok;
}

// Query arguments with their lengths as decoded, so that a NUL inside a name or value is
// kept (and refused by the route's parser) instead of cutting it short.
MHD_Result CollectQuery(void* cls, MHD_ValueKind, const char* key, size_t key_size, const char* value,
                        size_t value_size) {
  auto* req = static_cast<HttpRequest*>(cls);
  std::string k = key ? std::string(key, key_size) : std::string();
  std::string v = value ? std::string(value, value_size) : std::string();
  req->params.emplace(k, v);
  req->query.emplace_back(std::move(k), std::move(v));
  return MHD_YES;
}

MHD_Result CollectHeader(void* cls, MHD_ValueKind, const char* key, const char* value) {
  auto* m = static_cast<std::map<std::string, std::string>*>(cls);
  std::string k = key ? key : "";
  std::transform(k.begin(), k.end(), k.begin(), [](unsigned char c) { return std::tolower(c); });
  m->emplace(std::move(k), value ? value : "");
  return MHD_YES;
}

std::string PeerAddress(MHD_Connection* c) {
  const MHD_ConnectionInfo* info = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
  if (!info || !info->client_addr) return "";
  char buf[INET6_ADDRSTRLEN] = {};
  const sockaddr* sa = info->client_addr;
  if (sa->sa_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(sa)->sin_addr, buf, sizeof(buf));
  } else if (sa->sa_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr, buf, sizeof(buf));
  }
  return buf;
}

// Bytes of request bodies the server holds at once: the option, else twice the body
// limit, at least 64 MiB.
uint64_t BodyBudget(const HttpServerOptions& o) {
  if (o.body_budget_bytes > 0) return o.body_budget_bytes;
  const uint64_t limit = o.max_body_bytes;
  return std::max<uint64_t>(limit > UINT64_MAX / 2 ? UINT64_MAX : 2 * limit, uint64_t{64} << 20);
}

// The announced Content-Length, when there is one (MHD has checked its syntax).
std::optional<uint64_t> ContentLength(const HttpRequest& req) {
  const std::string* v = req.header("content-length");
  if (!v) return std::nullopt;
  uint64_t n = 0;
  for (char ch : *v) {
    if (ch < '0' || ch > '9') continue;
    if (n > (UINT64_MAX - 9) / 10) return UINT64_MAX;
    n = n * 10 + static_cast<uint64_t>(ch - '0');
  }
  return n;
}

}  // namespace

struct HttpControlServer::Impl {
  Impl(const HttpServerOptions& o, ControlService* service)
      : options(o),
        router(HttpRouterOptions{o.api_key, o.max_body_bytes}, service),
        body_budget(BodyBudget(o)),
        pool(std::max(1, o.worker_threads)),
        control_pool(kControlWorkers),
        read_pool(kReadWorkers) {}

  HttpServerOptions options;
  HttpRouter router;
  const uint64_t body_budget;
  std::atomic<uint64_t> body_bytes_held{0};  // request bodies being read or handled
  WorkerPool pool;          // HttpLane::kGeneration
  WorkerPool control_pool;  // HttpLane::kControl
  WorkerPool read_pool;     // HttpLane::kRead

  WorkerPool& PoolFor(HttpLane lane) {
    switch (lane) {
      case HttpLane::kRead: return read_pool;
      case HttpLane::kControl: return control_pool;
      case HttpLane::kGeneration: return pool;
    }
    return pool;
  }

  // Takes `n` more body bytes for `st` from the budget; false (and nothing taken) when the
  // budget would be passed.
  bool Charge(RequestState* st, uint64_t n) {
    uint64_t held = body_bytes_held.load();
    do {
      if (held + n > body_budget) return false;
    } while (!body_bytes_held.compare_exchange_weak(held, held + n));
    st->held = &body_bytes_held;
    st->charged += n;
    return true;
  }
  HttpResponse OverBudget(const HttpRequest& head) const {
    return HttpRouter::Error(Unavailable(fmt::format(
        "{}: the server holds {} bytes of request bodies, and this one would pass its budget of {} bytes "
        "(twice the body limit); retry once the calls in flight end",
        head.path, body_bytes_held.load(), body_budget)));
  }
  MHD_Daemon* daemon = nullptr;
  std::atomic<bool> stopping{false};

  // The reaper: cuts connections past their deadline (shutdown(2) of the socket; the
  // I/O thread then sees the end of the stream and closes it).
  std::mutex conns_mu;
  std::condition_variable reaper_cv;
  std::set<ConnState*> conns;  // GUARDED_BY(conns_mu): open connections
  bool reaper_stop = false;    // GUARDED_BY(conns_mu)
  std::thread reaper;

  void ReaperLoop() {
    std::unique_lock lock(conns_mu);
    while (!reaper_stop) {
      reaper_cv.wait_for(lock, std::chrono::milliseconds(100));
      int64_t now = NowNs();
      for (ConnState* c : conns) {
        if (c->deadline.load(std::memory_order_relaxed) < now) {
          c->deadline.store(kNoDeadline, std::memory_order_relaxed);
          shutdown(c->fd, SHUT_RDWR);
        }
      }
    }
  }

  static void OnConnection(void* cls, MHD_Connection* c, void** socket_context,
                           MHD_ConnectionNotificationCode code) {
    auto* self = static_cast<Impl*>(cls);
    if (code == MHD_CONNECTION_NOTIFY_STARTED) {
      auto* st = new (std::nothrow) ConnState;
      if (!st) return;
      const MHD_ConnectionInfo* info = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
      st->fd = info ? info->connect_fd : -1;
      st->deadline = InNs(self->options.header_timeout_seconds);
      std::lock_guard lock(self->conns_mu);
      if (st->fd >= 0) self->conns.insert(st);
      *socket_context = st;
    } else if (code == MHD_CONNECTION_NOTIFY_CLOSED) {
      auto* st = static_cast<ConnState*>(*socket_context);
      if (!st) return;
      {
        // MHD closes the socket after this returns; the reaper never touches it again.
        std::lock_guard lock(self->conns_mu);
        self->conns.erase(st);
      }
      delete st;
      *socket_context = nullptr;
    }
  }

  static void OnCompleted(void* cls, MHD_Connection*, void** req_cls, MHD_RequestTerminationCode) {
    auto* self = static_cast<Impl*>(cls);
    auto* st = static_cast<RequestState*>(*req_cls);
    if (!st) return;
    // The next request on this connection (or its idle time) has the header deadline.
    if (st->conn) st->conn->deadline = InNs(self->options.header_timeout_seconds);
    const bool large = st->received >= kTrimAfterBytes;
    delete st;
    *req_cls = nullptr;
    // The body and what the route parsed of it are freed by now; the heap gives the memory
    // back to the system instead of keeping it for the next large body.
    if (large) malloc_trim(0);
  }

  static void Log(void*, const char* fmt, va_list ap) {
    char buf[512];
    vsnprintf(buf, sizeof(buf), fmt, ap);
    std::string line(buf);
    while (!line.empty() && line.back() == '\n') line.pop_back();
    WSYNC_LOG_DEBUG("http: {}", line);
  }

  // MHD's URI callback: runs once the request line is read, before MHD decodes the path or
  // splits the query. Its return value is the request's context (OnRequest's *req_cls).
  static void* OnUri(void* cls, const char* uri, MHD_Connection*) {
    auto* st = new (std::nothrow) RequestState;
    if (!st) return nullptr;
    try {
      st->target_refusal = HttpRouter::TargetRefusal(uri ? uri : "");
    } catch (...) {
      st->target_refusal = "the request target could not be read";
    }
    if (!st->target_refusal.empty() && uri) {
      // The query is dropped before MHD splits it: the request is refused whatever it says,
      // and a query of many thousand arguments would exhaust the connection's memory pool
      // (MHD then closes the connection without a reply). MHD hands the request line in
      // its own writable read buffer.
      if (char* q = std::strchr(const_cast<char*>(uri), '?')) q[1] = '\0';
    }
    return st;
  }

  static MHD_Result OnRequest(void* cls, MHD_Connection* c, const char* url, const char* method,
                              const char*, const char* upload_data, size_t* upload_data_size,
                              void** req_cls) {
    auto* self = static_cast<Impl*>(cls);
    try {
      return self->Request(c, url, method, upload_data, upload_data_size, req_cls);
    } catch (...) {
      return MHD_NO;  // out of memory: drop the connection, keep serving
    }
  }

  MHD_Result Request(MHD_Connection* c, const char* url, const char* method, const char* upload_data,
                     size_t* upload_data_size, void** req_cls) {
    auto* st = static_cast<RequestState*>(*req_cls);
    if (!st || !st->head_done) {
      // The head is complete; nothing of the body has been read.
      std::unique_ptr<RequestState> owned(st ? st : new RequestState);
      *req_cls = nullptr;
      st = owned.get();
      st->head_done = true;
      st->req.method = method ? method : "";
      st->req.path = url ? url : "";
      MHD_get_connection_values_n(c, MHD_GET_ARGUMENT_KIND, CollectQuery, &st->req);
      MHD_get_connection_values(c, MHD_HEADER_KIND, CollectHeader, &st->req.headers);
      st->req.remote_addr = PeerAddress(c);
      if (const MHD_ConnectionInfo* info = MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT)) {
        st->conn = static_cast<ConnState*>(info->socket_context);
      }
      *req_cls = owned.release();
      if (st->conn) st->conn->deadline = InNs(options.body_timeout_seconds);
      std::optional<uint64_t> length = ContentLength(st->req);
      // A body a little over the limit is read and dropped, so that a client that writes
      // all of it before reading (most do) still gets its 413; a larger one is refused now
      // and the connection closed without reading it.
      const uint64_t limit = options.max_body_bytes;
      bool drain = length && *length > limit && *length - limit <= options.discard_bytes;
      if (!st->target_refusal.empty()) {
        return Queue(c, HttpRouter::Error(InvalidArgument(fmt::format("{}: {}", st->req.path, st->target_refusal))));
      }
      if (std::optional<HttpResponse> refused = router.Admit(st->req, drain ? std::nullopt : length)) {
        return Queue(c, *refused);
      }
      if (drain) {
        st->too_large = true;
      } else if (length) {
        // What was announced, up to a bound: a stalled client must not pin a large buffer.
        st->req.body.reserve(std::min<uint64_t>(*length, kReserveBytes));
      }
      return MHD_YES;
    }
    if (*upload_data_size > 0) {
      size_t n = *upload_data_size;
      *upload_data_size = 0;
      st->received += n;
      if (st->too_large || st->received > options.max_body_bytes) {
        if (!st->req.body.empty()) std::string().swap(st->req.body);
        st->too_large = true;
        // Past the limit, bytes are only counted; a body that goes on is cut off.
        uint64_t over = st->received > options.max_body_bytes ? st->received - options.max_body_bytes : 0;
        return over > options.discard_bytes ? MHD_NO : MHD_YES;
      }
      // Bytes are taken from the budget as they arrive (an announced size reserves none, so
      // connections that stall hold none of it).
      if (st->over_budget) return MHD_YES;  // counted, not kept: answered 503 at its end
      if (!Charge(st, n)) {
        std::string().swap(st->req.body);
        st->over_budget = true;
        return MHD_YES;
      }
      // Growth is capped at the body limit, so a body of unannounced size never holds a
      // buffer of twice the limit.
      std::string& body = st->req.body;
      if (body.size() + n > body.capacity()) {
        body.reserve(std::min<uint64_t>(options.max_body_bytes, std::max<uint64_t>(body.size() + n,
                                                                                    2 * body.capacity())));
      }
      body.append(upload_data, n);
      return MHD_YES;
    }
    // The body is complete, or a worker has resumed the connection with the reply.
    if (st->response) return Queue(c, *st->response);
    if (st->conn) st->conn->deadline = kNoDeadline;  // the route runs; the service bounds it
    if (st->too_large) return Queue(c, router.TooLarge(st->req));
    if (st->over_budget) return Queue(c, OverBudget(st->req));
    WorkerPool& workers = PoolFor(HttpRouter::LaneOf(st->req));
    bool queued = !stopping.load() && workers.Submit([c] { MHD_suspend_connection(c); },
                                                  [this, c, st] {
                                                    st->response = router.Handle(st->req);
                                                    // `st` belongs to the I/O thread from here on.
                                                    MHD_resume_connection(c);
                                                  });
    if (!queued) return Queue(c, HttpRouter::Error(Unavailable("the server is shutting down")));
    return MHD_YES;
  }
};

Result<std::unique_ptr<HttpControlServer>> HttpControlServer::Start(const HttpServerOptions& options,
                                                                    ControlService* service) {
  // A peer that closes its socket must cost a write error, never the process: the data
  // planes (Gloo's pairs among them) write to sockets without MSG_NOSIGNAL.
  ::signal(SIGPIPE, SIG_IGN);
  std::unique_ptr<HttpControlServer> s(new HttpControlServer());
  s->options_ = options;
  s->impl_ = std::make_unique<Impl>(options, service);
  Impl& impl = *s->impl_;

  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  if (int rc = getaddrinfo(options.host.c_str(), nullptr, &hints, &res); rc != 0 || !res) {
    return Unavailable(fmt::format("cannot listen on {}:{}: {}", options.host, options.port, gai_strerror(rc)));
  }
  sockaddr_storage addr{};
  std::memcpy(&addr, res->ai_addr, std::min<size_t>(res->ai_addrlen, sizeof(addr)));
  freeaddrinfo(res);
  unsigned int flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_EPOLL | MHD_ALLOW_SUSPEND_RESUME |
                       MHD_USE_ERROR_LOG;
  auto port = static_cast<uint16_t>(options.port);
  if (addr.ss_family == AF_INET6) {
    flags |= MHD_USE_IPv6;
    reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port = htons(port);
  } else {
    reinterpret_cast<sockaddr_in*>(&addr)->sin_port = htons(port);
  }
  auto idle = static_cast<unsigned int>(
      std::ceil(std::max({1.0, options.header_timeout_seconds, options.body_timeout_seconds})));
  impl.daemon = MHD_start_daemon(
      flags, port, nullptr, nullptr, &Impl::OnRequest, &impl,
      MHD_OPTION_SOCK_ADDR, reinterpret_cast<sockaddr*>(&addr),
      MHD_OPTION_CONNECTION_TIMEOUT, idle,
      MHD_OPTION_CONNECTION_LIMIT, static_cast<unsigned int>(std::max(1, options.max_connections)),
      MHD_OPTION_CONNECTION_MEMORY_LIMIT, static_cast<size_t>(128 << 10),
      MHD_OPTION_LISTENING_ADDRESS_REUSE, 1u,
      MHD_OPTION_NOTIFY_COMPLETED, &Impl::OnCompleted, &impl,
      MHD_OPTION_NOTIFY_CONNECTION, &Impl::OnConnection, &impl,
      MHD_OPTION_URI_LOG_CALLBACK, &Impl::OnUri, &impl,
      MHD_OPTION_EXTERNAL_LOGGER, &Impl::Log, &impl,
      MHD_OPTION_END);
  if (!impl.daemon) {
    return Unavailable(fmt::format("cannot listen on {}:{}", options.host, options.port));
  }
  const MHD_DaemonInfo* info = MHD_get_daemon_info(impl.daemon, MHD_DAEMON_INFO_BIND_PORT);
  s->port_ = info && info->port ? info->port : options.port;
  impl.reaper = std::thread([&impl] { impl.ReaperLoop(); });
  return s;
}

HttpControlServer::~HttpControlServer() { Stop(); }

std::string HttpControlServer::url() const {
  return fmt::format("http://{}:{}", options_.host, port_);
}

void HttpControlServer::Stop() {
  if (!impl_) return;
  Impl& impl = *impl_;
  impl.stopping = true;
  MHD_socket listen_fd = MHD_INVALID_SOCKET;
  if (impl.daemon) listen_fd = MHD_quiesce_daemon(impl.daemon);
  // In-flight calls finish and resume their connections before the daemon goes.
  impl.pool.Shutdown();
  impl.control_pool.Shutdown();
  impl.read_pool.Shutdown();
  if (impl.daemon) MHD_stop_daemon(impl.daemon);
  impl.daemon = nullptr;
  if (listen_fd != MHD_INVALID_SOCKET) close(listen_fd);
  {
    std::lock_guard lock(impl.conns_mu);
    impl.reaper_stop = true;
    impl.reaper_cv.notify_all();
  }
  if (impl.reaper.joinable()) impl.reaper.join();
  impl_.reset();
}

}  // namespace wsync
