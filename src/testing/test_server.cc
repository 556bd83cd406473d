#include "testing/test_server.h"

#include <gtest/gtest.h>

#include "core/digest.h"

namespace wsync::testing {

Result<TestServer> TestServer::Start(const InferenceServerOptions& options,
                                     const InferenceServer::BackendMaker& make_backend,
                                     const HttpServerOptions& http_options) {
  TestServer s;
  WSYNC_ASSIGN_OR_RETURN(s.service, InferenceServer::Create(options, make_backend));
  WSYNC_ASSIGN_OR_RETURN(s.http, HttpControlServer::Start(http_options, s.service.get()));
  s.service->set_url(s.http->url());
  return s;
}

void ExpectServerHolds(InferenceServer& server, WeightSource& source) {
  auto sums = server.Checksums(DigestAlgorithm::kXxh3_128);
  ASSERT_TRUE(sums.ok()) << sums.status().ToString();
  auto stream = source.Iterate();
  ASSERT_TRUE(stream.ok()) << stream.status().ToString();
  TensorRef t;
  size_t n = 0;
  while (true) {
    Result<bool> more = (*stream)->Next(&t);
    ASSERT_TRUE(more.ok()) << more.status().ToString();
    if (!*more) break;
    EXPECT_EQ((*sums)[std::string(t.name)], HexDigest(DigestAlgorithm::kXxh3_128, t.bytes)) << t.name;
    ++n;
  }
  EXPECT_EQ(n, sums->size());
}

void ExpectServerHolds(InferenceServer& server, const std::vector<HostTensor>& tensors) {
  auto sums = server.Checksums(DigestAlgorithm::kXxh3_128);
  ASSERT_TRUE(sums.ok()) << sums.status().ToString();
  for (const HostTensor& t : tensors) {
    EXPECT_EQ((*sums)[t.meta.name], HexDigest(DigestAlgorithm::kXxh3_128, t.storage.span().first(t.meta.nbytes())))
        << t.meta.name;
  }
  EXPECT_EQ(tensors.size(), sums->size());
}

}  // namespace wsync::testing
