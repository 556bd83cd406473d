// The public Server: it starts on a free port with the backend asked for, answers
// /health over HTTP naming that backend, refuses options that cannot work with the
// reason, and Serve() returns once Stop() runs on another thread.
#include "wsync/server.h"

#include <gtest/gtest.h>

#include <future>
#include <thread>

#include "control/client.h"
#include "testing/status_matchers.h"

namespace wsync {
namespace {

using ::testing::HasSubstr;
using testing::IsOk;
using testing::StatusIs;

TEST(Server, StartsOnAFreePortAndAnswersHealthNamingItsBackend) {
  for (const char* backend : {"nccl", "ipc", "delta"}) {
    ServerOptions o;
    o.inference.model = "qwen3-tiny";
    o.inference.tp = 2;
    o.inference.backend = backend;
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Server> server, Server::Start(o));
    EXPECT_TRUE(server->url().starts_with("http://127.0.0.1:")) << server->url();
    EXPECT_EQ(server->num_workers(), 2);
    FanOutClient client({server->url()}, {});
    Result<std::vector<nlohmann::json>> health = client.Get("/health", Deadline::InSeconds(5));
    ASSERT_THAT(health, IsOk());
    EXPECT_EQ((*health)[0]["backend"], backend);
    EXPECT_EQ(server->Health()["backend"], backend);
    EXPECT_EQ(server->Health()["tp"], 2);
  }
}

TEST(Server, OptionsThatCannotWorkAreRefusedWithTheReason) {
  ServerOptions o;
  o.inference.backend = "carrier-pigeon";
  EXPECT_THAT(Server::Start(o), StatusIs(StatusCode::kInvalidArgument, HasSubstr("unknown backend 'carrier-pigeon'")));
  o.inference.backend = "nccl";
  o.inference.tp = 0;
  EXPECT_THAT(Server::Start(o), StatusIs(StatusCode::kInvalidArgument, HasSubstr("--tp 0")));
  EXPECT_EQ(ServerBackendNames(), (std::vector<std::string>{"delta", "ipc", "nccl", "sharded"}));
}

TEST(Server, ServeReturnsOnceStopRunsAndStopIsIdempotent) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Server> server, Server::Start(ServerOptions{}));
  std::future<void> serving = std::async(std::launch::async, [&] { server->Serve(); });
  EXPECT_EQ(serving.wait_for(std::chrono::milliseconds(100)), std::future_status::timeout);
  server->Stop();
  EXPECT_EQ(serving.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  server->Stop();
  server->Serve();  // returns at once after Stop
}

}  // namespace
}  // namespace wsync
