#include "comm/store.h"

#include <gloo/common/error.h>
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

namespace wsync {
namespace {

using Clock = std::chrono::steady_clock;

std::unique_ptr<StoreServer> StartServer() {
  auto server = StoreServer::Start("127.0.0.1", 0);
  EXPECT_TRUE(server.ok()) << server.status().ToString();
  return std::move(server).value();
}

std::vector<char> Bytes(const std::string& s) { return {s.begin(), s.end()}; }

TEST(StoreTest, SetThenGet) {
  auto server = StartServer();
  EXPECT_GT(server->port(), 0);
  StoreClient client("127.0.0.1", server->port(), "session-1");
  ASSERT_TRUE(client.Set("a", Bytes("hello"), Deadline::InSeconds(5)).ok());
  auto v = client.Get("a", Deadline::InSeconds(5));
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  EXPECT_EQ(std::string(v->begin(), v->end()), "hello");
}

TEST(StoreTest, BinaryValuesAndOddKeysRoundTrip) {
  auto server = StartServer();
  StoreClient client("127.0.0.1", server->port(), "p q%/x");
  std::vector<char> value;
  for (int i = 0; i < 4096; ++i) value.push_back(static_cast<char>(i * 7));
  ASSERT_TRUE(client.Set("k ey/ü%2F", value, Deadline::InSeconds(5)).ok());
  auto v = client.Get("k ey/ü%2F", Deadline::InSeconds(5));
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  EXPECT_EQ(*v, value);
  // Empty values are values too.
  ASSERT_TRUE(client.Set("empty", {}, Deadline::InSeconds(5)).ok());
  auto e = client.Get("empty", Deadline::InSeconds(5));
  ASSERT_TRUE(e.ok());
  EXPECT_TRUE(e->empty());
}

TEST(StoreTest, PrefixesIsolateSessions) {
  auto server = StartServer();
  StoreClient a("127.0.0.1", server->port(), "sess-a");
  StoreClient b("127.0.0.1", server->port(), "sess-b");
  ASSERT_TRUE(a.Set("0", Bytes("A"), Deadline::InSeconds(5)).ok());
  auto missing = b.Missing({"0"}, Deadline::InSeconds(5));
  ASSERT_TRUE(missing.ok());
  EXPECT_EQ(*missing, std::vector<std::string>{"0"});
  server->ErasePrefix("sess-a/");
  EXPECT_EQ(server->key_count(), 0u);
}

TEST(StoreTest, GetWaitsForALaterSet) {
  auto server = StartServer();
  StoreClient client("127.0.0.1", server->port(), "s");
  std::thread writer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    EXPECT_TRUE(client.Set("late", Bytes("x"), Deadline::InSeconds(5)).ok());
  });
  auto v = client.Get("late", Deadline::InSeconds(5));
  writer.join();
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  EXPECT_TRUE(client.Wait({"late"}, Deadline::InSeconds(1)).ok());
}

TEST(StoreTest, GetOfAbsentKeyFailsAtDeadlineNamingTheKey) {
  auto server = StartServer();
  StoreClient client("127.0.0.1", server->port(), "s");
  auto start = Clock::now();
  auto v = client.Get("never-set", Deadline::InSeconds(0.5));
  double took = std::chrono::duration<double>(Clock::now() - start).count();
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(v.status().message().find("never-set"), std::string::npos) << v.status().message();
  EXPECT_GE(took, 0.45);
  EXPECT_LT(took, 1.5);
}

TEST(StoreTest, WaitListsOnlyTheMissingKeys) {
  auto server = StartServer();
  StoreClient client("127.0.0.1", server->port(), "s");
  ASSERT_TRUE(client.Set("1", Bytes("x"), Deadline::InSeconds(5)).ok());
  Status s = client.Wait({"1", "2"}, Deadline::InSeconds(0.3));
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(s.message().find("'2'"), std::string::npos) << s.message();
  EXPECT_EQ(s.message().find("'1'"), std::string::npos) << s.message();
}

TEST(StoreTest, UnreachableServerFailsAtDeadline) {
  int port;
  {
    auto server = StartServer();
    port = server->port();
  }  // stopped: nothing listens on `port` now
  StoreClient client("127.0.0.1", port, "s");
  auto start = Clock::now();
  Status s = client.Set("k", Bytes("v"), Deadline::InSeconds(0.5));
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  auto v = client.Get("k", Deadline::InSeconds(0.5));
  EXPECT_EQ(v.status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(v.status().message().find("unreachable"), std::string::npos) << v.status().message();
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 3.0);
}

TEST(HttpStoreTest, GlooInterfaceThrowsIoExceptionWithDescribedKey) {
  auto server = StartServer();
  HttpStore store("127.0.0.1", server->port(), "g", Deadline::InSeconds(5),
                  [](const std::string& key) { return "address of rank " + key; });
  store.set("0", Bytes("addr0"));
  EXPECT_EQ(store.get("0"), Bytes("addr0"));
  store.wait({"0"});
  auto start = Clock::now();
  try {
    store.wait({"3"}, std::chrono::milliseconds(300));
    FAIL() << "wait for an absent key returned";
  } catch (const gloo::IoException& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("'3'"), std::string::npos) << what;
    EXPECT_NE(what.find("address of rank 3"), std::string::npos) << what;
  }
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 1.5);
}

TEST(HttpStoreTest, StoreDeadlineBoundsGet) {
  auto server = StartServer();
  HttpStore store("127.0.0.1", server->port(), "g", Deadline::InSeconds(0.3));
  EXPECT_THROW(store.get("missing"), gloo::IoException);
}

}  // namespace
}  // namespace wsync
