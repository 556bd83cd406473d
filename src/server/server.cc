#include "wsync/server.h"

#include <algorithm>
#include <condition_variable>
#include <mutex>

#include "control/http_server.h"
#include "receiver/backend.h"
#include "server/inference_server.h"

namespace wsync {

struct Server::Impl {
  std::unique_ptr<InferenceServer> service;
  std::unique_ptr<HttpControlServer> http;
  std::string url;
  std::mutex mu;
  std::condition_variable stopped_cv;
  bool stopped = false;  // GUARDED_BY(mu)
};

Server::Server(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<Server>> Server::Start(const ServerOptions& options) {
  auto impl = std::make_unique<Impl>();
  InferenceServerOptions inference = options.inference;
  if (inference.max_requests == 0) {
    // Keep up to 8 HTTP worker threads (half of a small pool) for the control plane.
    const int threads = std::max(1, options.http.worker_threads);
    inference.max_requests = std::max(1, threads - std::min(8, threads / 2));
  }
  WSYNC_ASSIGN_OR_RETURN(impl->service, InferenceServer::Create(inference, CreateReceiverBackend));
  WSYNC_ASSIGN_OR_RETURN(impl->http, HttpControlServer::Start(options.http, impl->service.get()));
  impl->url = impl->http->url();
  impl->service->set_url(impl->url);
  return std::unique_ptr<Server>(new Server(std::move(impl)));
}

Server::~Server() { Stop(); }

const std::string& Server::url() const { return impl_->url; }

nlohmann::json Server::Health() const { return impl_->service->Health(); }

int Server::num_workers() const { return static_cast<int>(impl_->service->num_workers()); }

void Server::Serve() {
  std::unique_lock lock(impl_->mu);
  impl_->stopped_cv.wait(lock, [&] { return impl_->stopped; });
}

void Server::Stop() {
  impl_->service->StopGenerating();  // completions in flight end now instead of holding the stop
  impl_->http->Stop();  // idempotent; in-flight calls finish before it returns
  {
    std::lock_guard lock(impl_->mu);
    impl_->stopped = true;
  }
  impl_->stopped_cv.notify_all();
}

std::vector<std::string> ServerBackendNames() { return ReceiverBackendNames(); }

}  // namespace wsync
