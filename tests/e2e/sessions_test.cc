// Hostile init payloads and vanished trainers against a live `wsync serve`: integers
// that do not fit, ports out of range and rendezvous stores on other hosts are refused at
// once with 400 naming the field (nothing is dialled); a session whose trainer vanished
// expires after --session-lease; and after every one of these the server takes the next
// trainer's sync, bit-exact.
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "core/parallel.h"
#include "e2e_test_base.h"
#include "format/safetensors.h"
#include "model/config.h"
#include "synthetic/synthetic.h"

namespace wsync::e2e {
namespace {

using nlohmann::json;

// A TCP listener on every interface that counts the connections made to it.
class Listener {
 public:
  Listener() {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    socklen_t len = sizeof(a);
    if (fd_ < 0 || ::bind(fd_, reinterpret_cast<sockaddr*>(&a), len) != 0 || ::listen(fd_, 16) != 0 ||
        ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
      ADD_FAILURE() << "listener: " << std::strerror(errno);
      return;
    }
    port_ = ntohs(a.sin_port);
  }
  ~Listener() {
    if (fd_ >= 0) ::close(fd_);
  }
  int port() const { return port_; }
  // Connections accepted within `seconds`.
  int Accepted(double seconds) {
    int n = 0;
    auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (std::chrono::steady_clock::now() < end) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 50) == 1) {
        int c = ::accept(fd_, nullptr, nullptr);
        if (c >= 0) {
          ++n;
          ::close(c);
        }
      }
    }
    return n;
  }

 private:
  int fd_ = -1;
  int port_ = 0;
};

// This host's first non-loopback IPv4 address; empty when it has none.
std::string OwnNonLoopbackAddress() {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return "";
  std::string out;
  for (ifaddrs* i = list; i != nullptr && out.empty(); i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET || (i->ifa_flags & IFF_LOOPBACK) ||
        !(i->ifa_flags & IFF_UP)) {
      continue;
    }
    char buf[INET_ADDRSTRLEN] = {};
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, buf, sizeof(buf));
    out = buf;
  }
  freeifaddrs(list);
  return out;
}

class SessionsTest : public E2eTest {
 protected:
  // A Gloo init payload of the nccl backend with `field` set to `value`.
  static json GlooInit(int port, const std::string& field = "", json value = nullptr) {
    json info = {{"rank_offset", 1},          {"world_size", 2},        {"gloo_store_host", "127.0.0.1"},
                 {"gloo_store_port", port},   {"gloo_prefix", "hostile/1"}, {"timeout_seconds", 3}};
    if (!field.empty()) info[field] = std::move(value);
    return json{{"init_info", info}};
  }
  static double Seconds(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  // A full trainer sync with verification, then the servers' checksums.
  void ExpectPushSyncs(const Server& s, uint64_t seed, const std::string& name) {
    RunResult push = Push(name, {s}, {"--model", "qwen3-tiny", "--seed", std::to_string(seed), "--verify",
                                      "--timeout", "30"});
    ASSERT_TRUE(push.success()) << push.description << "\n--- server ---\n" << s.process->Describe();
    EXPECT_TRUE(HasVerifiedTable(push.out, 1));
    E2E_ASSERT_OK_AND_ASSIGN(Digests want, ExpectedSyntheticDigests("qwen3-tiny", seed, 0, DigestAlgorithm::kXxh3_128));
    ExpectServersHold({s}, want, DigestAlgorithm::kXxh3_128);
  }
};

// Integers that do not fit, ports out of range, a world of 2^31-1 ranks: each is 400 at
// once naming the field and value, and the server takes the next sync.
TEST_F(SessionsTest, HostileInitIntegersAreRefusedAtOnceAndTheServerTakesTheNextSync) {
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("s", {"--model", "qwen3-tiny", "--tp", "2", "--timeout", "10"}));
  Listener store;  // nothing may dial it: every payload below is refused before any dial
  struct Case {
    const char* field;
    json value;
    std::vector<std::string> needles;
  };
  const Case cases[] = {
      {"world_size", 2147483647, {"world_size", "2147483647", "65536"}},
      {"world_size", int64_t{4294967297}, {"world_size", "4294967297"}},
      {"world_size", 20000000, {"world_size", "20000000"}},
      {"rank_offset", int64_t{4294967297}, {"rank_offset", "4294967297"}},
      {"gloo_store_port", -7, {"gloo_store_port", "-7", "65535"}},
      {"gloo_store_port", int64_t{4294967296} + store.port(), {"gloo_store_port"}},
      {"packed_num_buffers", int64_t{4294967297}, {"packed_num_buffers", "4294967297"}},
  };
  for (const Case& c : cases) {
    auto t0 = std::chrono::steady_clock::now();
    HttpReply r = HttpPostJson(s.url, "/init_weight_transfer_engine", GlooInit(store.port(), c.field, c.value));
    EXPECT_EQ(r.status, 400) << c.field << "=" << c.value.dump() << " " << r.Describe();
    for (const std::string& n : c.needles) {
      EXPECT_NE(r.ErrorMessage().find(n), std::string::npos)
          << c.field << "=" << c.value.dump() << ": message does not name '" << n << "': " << r.Describe();
    }
    EXPECT_LT(Seconds(t0), 2.0) << c.field << "=" << c.value.dump() << " was not refused at once";
    HttpReply h = HttpGet(s.url, "/health", "", 5);
    ASSERT_EQ(h.status, 200) << "after " << c.field << "=" << c.value.dump() << ": " << s.process->Describe();
  }
  EXPECT_EQ(store.Accepted(0.5), 0) << "a refused init dialled the store";
  ExpectPushSyncs(s, 31, "push_after_hostile_ints");
}

// The rendezvous store must be on the init request's own host: a loopback trainer may not
// point the server at another address (here this host's own LAN address, where a listener
// waits), unless --allow-store-host admits it.
TEST_F(SessionsTest, StoreHostsOtherThanThePeerAreNotDialledUnlessAllowed) {
  const std::string lan = OwnNonLoopbackAddress();
  if (lan.empty()) GTEST_SKIP() << "this host has no non-loopback IPv4 address";
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("s", {"--model", "qwen3-tiny", "--timeout", "10"}));
  Listener store;
  auto t0 = std::chrono::steady_clock::now();
  HttpReply r = HttpPostJson(s.url, "/init_weight_transfer_engine", GlooInit(store.port(), "gloo_store_host", lan));
  EXPECT_EQ(r.status, 400) << r.Describe();
  EXPECT_NE(r.ErrorMessage().find("--allow-store-host"), std::string::npos) << r.Describe();
  EXPECT_NE(r.ErrorMessage().find(lan), std::string::npos) << r.Describe();
  EXPECT_LT(Seconds(t0), 2.0);
  EXPECT_EQ(store.Accepted(1.0), 0) << "the server dialled a store its peer does not run";
  ExpectPushSyncs(s, 32, "push_after_foreign_store");

  // The same payload to a server whose flags admit that host: it dials it (and gives up
  // at the payload's timeout, as nobody answers the store protocol there).
  E2E_ASSERT_OK_AND_ASSIGN(Server allowed, StartServer("allowed", {"--model", "qwen3-tiny", "--timeout", "10",
                                                                  "--allow-store-host", lan}));
  std::thread init([&] {
    HttpReply a = HttpPostJson(allowed.url, "/init_weight_transfer_engine",
                               GlooInit(store.port(), "gloo_store_host", lan));
    EXPECT_NE(a.status, 200) << a.Describe();
  });
  EXPECT_GT(store.Accepted(3.0), 0) << "an allowed store host was not dialled";
  init.join();
  ExpectPushSyncs(allowed, 33, "push_allowed");
}

// A trainer killed between start_weight_update and its update: the session blocks the
// next trainer only until --session-lease runs out, and no byte landed, so the weights
// stay consistent.
TEST_F(SessionsTest, AVanishedTrainersSessionExpiresAfterTheLease) {
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("s", {"--model", "qwen3-tiny", "--timeout", "30",
                                                       "--session-lease", "4"}));
  ExpectPushSyncs(s, 34, "push_first");
  ASSERT_EQ(HttpPostJson(s.url, "/start_weight_update", json::object()).status, 200);
  // The trainer is gone. Within the lease the session still holds:
  HttpReply early = HttpPostJson(s.url, "/start_weight_update", json::object());
  EXPECT_EQ(early.status, 409) << early.Describe();
  EXPECT_NE(early.ErrorMessage().find("expires after 4 s"), std::string::npos) << early.Describe();
  std::this_thread::sleep_for(std::chrono::milliseconds(4500));
  HttpReply h = HttpGet(s.url, "/health", "", 5);
  ASSERT_EQ(h.status, 200);
  EXPECT_EQ(h.json.value("session_active", true), false) << h.Describe();
  EXPECT_EQ(h.json.value("expired_sessions", 0), 1) << h.Describe();
  EXPECT_EQ(h.json.value("weights_consistent", false), true) << h.Describe();
  // The next trainer syncs.
  ExpectPushSyncs(s, 35, "push_after_expiry");
  // The vanished trainer's late finish is refused, naming the expiry.
  ASSERT_EQ(HttpPostJson(s.url, "/start_weight_update", json::object()).status, 200);
  std::this_thread::sleep_for(std::chrono::milliseconds(4500));
  HttpReply late = HttpPostJson(s.url, "/finish_weight_update", json::object());
  EXPECT_EQ(late.status, 409) << late.Describe();
  EXPECT_NE(late.ErrorMessage().find("expired"), std::string::npos) << late.Describe();
}

// A malformed local-checkpoint state.json makes the delta backend's fetch and update fail
// (by an exception, where its reader throws): each call is answered, none leaves the
// server "in progress", and once the file is sound again a trainer syncs bit-exact.
TEST_F(SessionsTest, AFailingBackendCallNeverLeavesTheServerInProgress) {
  namespace fs = std::filesystem;
  const fs::path base = dir() / "base", local = dir() / "local", sync = dir() / "sync";
  {
    E2E_ASSERT_OK_AND_ASSIGN(ModelConfig config, LookupModel("qwen3-tiny"));
    E2E_ASSERT_OK_AND_ASSIGN(auto trainer, SyntheticTrainer::FromMetadata(HfTensors(config), 36, DefaultThreads()));
    std::vector<TensorRef> refs;
    for (const HostTensor& t : trainer->tensors()) refs.push_back(t.ref());
    fs::create_directories(base);
    Status w = WriteSafetensors((base / "model.safetensors").string(), refs);
    ASSERT_TRUE(w.ok()) << w.ToString();
  }
  const fs::path state = local / ".skyrl_weight_sync" / "state.json";
  fs::create_directories(state.parent_path());
  std::ofstream(state) << R"({"version": "not a number", "write_in_progress": 7})";
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("s", {"--model", "qwen3-tiny", "--backend", "delta",
                                                       "--base-checkpoint", base.string(), "--local-checkpoint-dir",
                                                       local.string(), "--sync-root", dir().string(), "--timeout", "30"}));
  auto not_in_progress = [](const HttpReply& r) {
    return r.status != 409 || r.ErrorMessage().find("in progress") == std::string::npos;
  };
  for (int round = 0; round < 2; ++round) {
    HttpReply f = HttpPostJson(s.url, "/fetch_weights", json{{"target_version", 1}, {"sync_dir", sync.string()}});
    EXPECT_NE(f.status, 200) << f.Describe();
    EXPECT_NE(f.status, 0) << "no answer: " << f.Describe();
    EXPECT_TRUE(not_in_progress(f)) << "round " << round << ": " << f.Describe();
    HttpReply st = HttpPostJson(s.url, "/start_weight_update", json::object());
    EXPECT_EQ(st.status, 200) << "round " << round << ": " << st.Describe();
    HttpReply u = HttpPostJson(s.url, "/update_weights", json{{"update_info", {{"target_version", 0}}}});
    EXPECT_NE(u.status, 200) << u.Describe();
    EXPECT_TRUE(not_in_progress(u)) << "round " << round << ": " << u.Describe();
    // A failed update ends the session: the next round's start must succeed.
  }
  ASSERT_TRUE(s.process->Running()) << s.process->Describe();
  // The file is sound again: a trainer syncs.
  std::ofstream(state, std::ios::trunc) << json{{"version", 0}, {"write_in_progress", false},
                                                {"target_version", nullptr}, {"base_model_path", base.string()},
                                                {"sync_dir", ""}}.dump();
  RunResult push = RunWsync("push_delta", {"push", "--servers", s.url, "--backend", "delta", "--sync-dir",
                                           sync.string(), "--model", "qwen3-tiny", "--seed", "36", "--steps", "1",
                                           "--verify", "--timeout", "60"},
                            180);
  ASSERT_TRUE(push.success()) << push.description << "\n--- server ---\n" << s.process->Describe();
  EXPECT_TRUE(HasVerifiedTable(push.out, 2)) << push.out;
}

}  // namespace
}  // namespace wsync::e2e
