// The fan-out client against a server that answers hostile replies: a reply is as
// untrusted as a request, so deep nesting and long messages end as bounded errors.
#include "control/client.h"

#include <httplib.h>

#include <string>
#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>

namespace wsync {
namespace {

const std::string kDeep = std::string(100000, '[') + std::string(100000, ']');

TEST(FanOutClient, HostileRepliesAreBoundedErrors) {
  httplib::Server srv;
  srv.Get("/deep", [](const httplib::Request&, httplib::Response& res) {
    res.set_content(R"({"world_size": )" + kDeep + "}", "application/json");
  });
  srv.Get("/deep_error", [](const httplib::Request&, httplib::Response& res) {
    res.status = 400;
    res.set_content(R"({"detail": )" + kDeep + "}", "application/json");
  });
  srv.Get("/long_error", [](const httplib::Request&, httplib::Response& res) {
    res.status = 409;
    res.set_content(R"({"error": {"type": "FAILED_PRECONDITION", "message": ")" + std::string(100000, 'm') + "\"}}",
                    "application/json");
  });
  int port = srv.bind_to_any_port("127.0.0.1");
  ASSERT_GT(port, 0);
  std::thread serving([&] { srv.listen_after_bind(); });
  const std::string url = fmt::format("http://127.0.0.1:{}", port);
  FanOutClient client({url}, ClientOptions{});

  auto deep = client.Get("/deep", Deadline::InSeconds(30));
  ASSERT_FALSE(deep.ok());
  EXPECT_EQ(deep.status().code(), StatusCode::kInternal);
  EXPECT_NE(deep.status().message().find("reply: field 'world_size' nests deeper than 64 levels"), std::string::npos)
      << deep.status().message();

  auto deep_error = client.Get("/deep_error", Deadline::InSeconds(30));
  ASSERT_FALSE(deep_error.ok());
  EXPECT_EQ(deep_error.status().code(), StatusCode::kInvalidArgument);
  EXPECT_LT(deep_error.status().message().size(), 1000u) << deep_error.status().message();

  auto long_error = client.Get("/long_error", Deadline::InSeconds(30));
  ASSERT_FALSE(long_error.ok());
  EXPECT_EQ(long_error.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(long_error.status().message().find("... (100000 bytes)"), std::string::npos);
  EXPECT_LT(long_error.status().message().size(), 4500u);

  srv.stop();
  serving.join();
}

}  // namespace
}  // namespace wsync
