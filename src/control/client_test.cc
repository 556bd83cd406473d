// The fan-out client against a server that answers hostile replies: a reply is as
// untrusted as a request, so deep nesting and long messages end as bounded errors.
#include "control/client.h"

#include <arpa/inet.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
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

// Answers each connection's first request with an error, as a keep-alive reply, and
// closes the connection a moment later (as uvicorn does when the app answered without
// reading the whole request); `served` counts the requests. Connections are served one
// after another.
class ClosingServer {
 public:
  ClosingServer() {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    if (::bind(fd_, reinterpret_cast<sockaddr*>(&addr), len) != 0 || ::listen(fd_, 8) != 0 ||
        ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      return;
    }
    port_ = ntohs(addr.sin_port);
    thread_ = std::thread([this] {
      for (;;) {
        int c = ::accept(fd_, nullptr, nullptr);
        if (c < 0) return;
        std::string got;
        char buf[4096];
        while (got.find("\r\n\r\n") == std::string::npos) {
          ssize_t n = ::recv(c, buf, sizeof(buf), 0);
          if (n <= 0) break;
          got.append(buf, static_cast<size_t>(n));
        }
        const std::string body = R"({"error": "Worker failed"})";
        const std::string reply = fmt::format(
            "HTTP/1.1 500 \r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{}",
            body.size(), body);
        // Counted before the reply goes out, so a client that has its answer sees the count.
        ++served;
        (void)::send(c, reply.data(), reply.size(), MSG_NOSIGNAL);
        // As uvicorn may: the socket closes a moment after the reply, so that a request
        // written into the connection meanwhile is taken and never answered.
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        ::close(c);
      }
    });
  }
  ~ClosingServer() {
    ::shutdown(fd_, SHUT_RDWR);
    ::close(fd_);
    if (thread_.joinable()) thread_.join();
  }
  int port() const { return port_; }
  std::atomic<int> served{0};

 private:
  int fd_ = -1;
  int port_ = 0;
  std::thread thread_;
};

TEST(FanOutClient, AConnectionThatGotAnErrorReplyIsNotReused) {
  // The request after an error reply goes out on a new connection and reaches the server.
  ClosingServer server;
  ASSERT_GT(server.port(), 0);
  FanOutClient client({fmt::format("http://127.0.0.1:{}", server.port())}, ClientOptions{});
  for (int round = 1; round <= 3; ++round) {
    auto failed = client.Post("/finish_weight_update", nlohmann::json::object(), Deadline::InSeconds(30));
    ASSERT_FALSE(failed.ok());
    EXPECT_NE(failed.status().message().find("-> 500: Worker failed"), std::string::npos) << failed.status().message();
    EXPECT_EQ(server.served.load(), round);
  }
}

}  // namespace
}  // namespace wsync
