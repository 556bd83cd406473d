// TestServer: an inference server and its HTTP control server inside the test's process.
//
// What `wsync serve` runs, minus the process: an InferenceServer with the backend
// `make_backend` builds, answering on 127.0.0.1 at a free port, its URL set for worker
// labels. Tests reach the server both ways: over HTTP (url()) as a trainer does, and
// directly (service) to read checksums, health and versions. Destruction stops the HTTP
// server first (in-flight calls finish), then the inference server. Tests only.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "control/http_server.h"
#include "server/inference_server.h"
#include "wsync/source.h"
#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync::testing {

struct TestServer {
  std::unique_ptr<InferenceServer> service;
  std::unique_ptr<HttpControlServer> http;  // declared last: destroyed first

  std::string url() const { return http->url(); }

  static Result<TestServer> Start(const InferenceServerOptions& options,
                                  const InferenceServer::BackendMaker& make_backend,
                                  const HttpServerOptions& http_options = {});
};

// Every tensor of one pass of `source` has the same xxh3-128 digest in `server`'s
// /weight_checker, and the server holds no other tensor.
void ExpectServerHolds(InferenceServer& server, WeightSource& source);
// The same against tensors held in memory.
void ExpectServerHolds(InferenceServer& server, const std::vector<HostTensor>& tensors);

}  // namespace wsync::testing
