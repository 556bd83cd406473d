// The colocated `ipc` backend end to end on CPU: real `wsync serve --backend ipc` and
// `wsync push --backend ipc` processes sharing one host, the chunks moving through a
// shared-memory staging region. Every sync is checked bit for bit against digests the
// test computes itself; bad input gets 400/409 and leaves the server serving; a trainer
// SIGKILLed in the middle of a sync leaves the server able to take the next session, and
// releases its staging memory; a hostile region header or a region shrunk under the
// server's mapping is an error answer, never the server's death.
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <thread>

#include <fmt/format.h>

#include "backends/ipc/region.h"
#include "e2e_test_base.h"

namespace wsync::e2e {
namespace {

using nlohmann::json;

class IpcTest : public E2eTest {
 protected:
  Result<Server> StartIpcServer(const std::string& name, const std::string& model, int tp,
                                std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {"--model", model, "--tp", std::to_string(tp), "--device", "cpu",
                                     "--backend", "ipc"};
    args.insert(args.end(), extra.begin(), extra.end());
    return StartServer(name, std::move(args));
  }
  RunResult PushIpc(const std::string& name, const std::vector<Server>& servers, std::vector<std::string> args,
                    double timeout_seconds = 120) {
    std::vector<std::string> full = {"push", "--servers", JoinUrls(servers), "--backend", "ipc"};
    full.insert(full.end(), args.begin(), args.end());
    return RunWsync(name, std::move(full), timeout_seconds);
  }
  // The number of the process's mappings of ipc staging regions (memfd or /dev/shm).
  static int IpcMappings(pid_t pid) {
    std::ifstream maps(fmt::format("/proc/{}/maps", pid));
    std::string line;
    int n = 0;
    while (std::getline(maps, line)) n += line.find("wsync-ipc-") != std::string::npos;
    return n;
  }
  // Polls `pred` every 50 ms for up to `seconds`.
  template <typename Pred>
  static bool Eventually(Pred pred, double seconds) {
    auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (std::chrono::steady_clock::now() < end) {
      if (pred()) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return pred();
  }
};

TEST_F(IpcTest, Tp1AndTp2ServersMatchTheTrainerOverSeveralStepsAndReleaseTheRegionAfter) {
  E2E_ASSERT_OK_AND_ASSIGN(Server tp1, StartIpcServer("tp1", "qwen3-tiny", 1));
  E2E_ASSERT_OK_AND_ASSIGN(Server tp2, StartIpcServer("tp2", "qwen3-tiny", 2));
  HttpReply h = HttpGet(tp2.url, "/health");
  EXPECT_EQ(h.json.value("backend", ""), "ipc") << h.Describe();

  // 1 MiB buckets: several chunks per sync through the two-slot ring.
  RunResult push = PushIpc("push", {tp1, tp2},
                           {"--model", "qwen3-tiny", "--seed", "11", "--steps", "3", "--verify", "--bucket-gb",
                            "0.001", "--weight-version", "ipc-v3", "--timeout", "60"});
  ASSERT_TRUE(push.success()) << push.description << "\n--- tp2 ---\n" << tp2.process->Describe();
  EXPECT_TRUE(HasVerifiedTable(push.out, 4)) << push.out;

  E2E_ASSERT_OK_AND_ASSIGN(Digests step0, ExpectedSyntheticDigests("qwen3-tiny", 11, 0, DigestAlgorithm::kXxh3_128));
  E2E_ASSERT_OK_AND_ASSIGN(Digests step3, ExpectedSyntheticDigests("qwen3-tiny", 11, 3, DigestAlgorithm::kXxh3_128));
  ASSERT_FALSE(DigestsEqual(step0, step3));
  ExpectServersHold({tp1, tp2}, step3, DigestAlgorithm::kXxh3_128);
  E2E_ASSERT_OK_AND_ASSIGN(Digests sha, ExpectedSyntheticDigests("qwen3-tiny", 11, 3, DigestAlgorithm::kSha256));
  ExpectServersHold({tp1, tp2}, sha, DigestAlgorithm::kSha256);
  HttpReply info = HttpGet(tp2.url, "/weight_info");
  EXPECT_EQ(info.json.value("weight_version", ""), "ipc-v3") << info.Describe();

  // The trainer has exited: no server keeps its staging region mapped.
  for (const Server* s : {&tp1, &tp2}) {
    EXPECT_TRUE(Eventually([&] { return IpcMappings(s->process->pid()) == 0; }, 5))
        << s->name << " still maps " << IpcMappings(s->process->pid()) << " ipc region(s)";
  }
  ExpectCleanShutdown(tp1);
  ExpectCleanShutdown(tp2);
}

TEST_F(IpcTest, MoeModelOnTp1AndTp2ServersMatchesTheTrainer) {
  E2E_ASSERT_OK_AND_ASSIGN(Server tp1, StartIpcServer("moe_tp1", "qwen3-moe-tiny", 1));
  E2E_ASSERT_OK_AND_ASSIGN(Server tp2, StartIpcServer("moe_tp2", "qwen3-moe-tiny", 2));
  RunResult push = PushIpc("push", {tp1, tp2},
                           {"--model", "qwen3-moe-tiny", "--seed", "9", "--steps", "2", "--verify", "--bucket-gb",
                            "0.002", "--timeout", "60"});
  ASSERT_TRUE(push.success()) << push.description;
  EXPECT_TRUE(HasVerifiedTable(push.out, 3)) << push.out;
  E2E_ASSERT_OK_AND_ASSIGN(Digests want, ExpectedSyntheticDigests("qwen3-moe-tiny", 9, 2, DigestAlgorithm::kXxh3_128));
  ExpectServersHold({tp1, tp2}, want, DigestAlgorithm::kXxh3_128);
}

TEST_F(IpcTest, TwoTrainerRanksWhereRank1IsNotTheSenderMatchTheTrainer) {
  E2E_ASSERT_OK_AND_ASSIGN(Server tp2, StartIpcServer("tp2", "qwen3-tiny", 2));
  for (const char* layout : {"fsdp", "tp2pp1ep1"}) {
    SCOPED_TRACE(layout);
    RunResult push = PushIpc(fmt::format("push_{}", layout), {tp2},
                             {"--model", "qwen3-tiny", "--seed", "13", "--steps", "2", "--verify",
                              "--trainer-ranks", "2", "--trainer-layout", layout, "--bucket-gb", "0.001",
                              "--timeout", "60"});
    ASSERT_TRUE(push.success()) << push.description << "\n--- server ---\n" << tp2.process->Describe();
    EXPECT_TRUE(HasVerifiedTable(push.out, 3)) << push.out;
    E2E_ASSERT_OK_AND_ASSIGN(Digests want, ExpectedSyntheticDigests("qwen3-tiny", 13, 2, DigestAlgorithm::kXxh3_128));
    ExpectServersHold({tp2}, want, DigestAlgorithm::kXxh3_128);
  }
}

TEST_F(IpcTest, BadInputGetsClearErrorsAndTheServerKeepsServing) {
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartIpcServer("serve", "qwen3-tiny", 2));
  const std::string& u = s.url;
  json init = {{"wsync_ipc_protocol", 3},
               {"packed", true},
               {"session", std::string(32, 'a')},
               {"control_path", "/dev/shm/wsync-ipc-no-such-region"},
               {"control_bytes", 1 << 22},
               {"num_slots", 2},
               {"slot_bytes", 1 << 20},
               {"reader_offset", 0},
               {"reader_count", 2},
               {"buffers", {{"host-unknown", {{"kind", "shm"}, {"offset", 2 << 20}, {"stride", 2 << 20}}}}}};

  EXPECT_TRUE(IsError(HttpPostJson(u, "/finish_weight_update", json::object()), 409, {"without an active"}));
  // A missing region name, on a host the trainer is not on, and a file that is no region.
  EXPECT_TRUE(IsError(HttpPostJson(u, "/init_weight_transfer_engine", json{{"init_info", init}}), 400,
                      {"no entry for this server's device", "host-unknown"}));
  json here = init;
  here["buffers"] = json::object();
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string boot_id;
  std::getline(boot, boot_id);
  here["buffers"]["host-" + boot_id] = init["buffers"]["host-unknown"];
  EXPECT_TRUE(IsError(HttpPostJson(u, "/init_weight_transfer_engine", json{{"init_info", here}}), 400,
                      {"is not a wsync ipc region this server may open", "/dev/shm/wsync-ipc-no-such-region"}));
  here["control_path"] = (dir() / "serve.stderr").string();  // a plain file of garbage
  EXPECT_TRUE(IsError(HttpPostJson(u, "/init_weight_transfer_engine", json{{"init_info", here}}), 400, {}));
  here["control_path"] = "not/absolute";
  EXPECT_TRUE(IsError(HttpPostJson(u, "/init_weight_transfer_engine", json{{"init_info", here}}), 400,
                      {"control_path"}));
  EXPECT_TRUE(IsError(HttpPostJson(u, "/init_weight_transfer_engine", json{{"init_info", {{"packed", true}}}}), 400,
                      {"wsync_ipc_protocol"}));

  // Updates outside an ipc session, and vLLM's torch-pickled handles.
  ASSERT_EQ(HttpPostJson(u, "/start_weight_update", json::object()).status, 200);
  json update = {{"names", {"model.norm.weight"}},
                 {"dtype_names", {"bfloat16"}},
                 {"shapes", {{256}}},
                 {"tensor_sizes", {512}},
                 {"tensor_offsets", {0}},
                 {"chunk_ends", {1}},
                 {"wsync_ipc_protocol", 3},
                 {"session", std::string(32, 'a')}};
  EXPECT_TRUE(IsError(HttpPostJson(u, "/update_weights", json{{"update_info", update}}), 409,
                      {"call init_weight_transfer_engine"}));
  EXPECT_EQ(HttpGet(u, "/health").status, 200);

  // The server still serves: a real push verifies.
  RunResult push = PushIpc("push", {s}, {"--model", "qwen3-tiny", "--seed", "3", "--steps", "1", "--verify",
                                         "--timeout", "60"});
  ASSERT_TRUE(push.success()) << push.description << "\n--- server ---\n" << s.process->Describe();
  E2E_ASSERT_OK_AND_ASSIGN(Digests want, ExpectedSyntheticDigests("qwen3-tiny", 3, 1, DigestAlgorithm::kXxh3_128));
  ExpectServersHold({s}, want, DigestAlgorithm::kXxh3_128);
  ExpectCleanShutdown(s);
}

// Offsets of IpcRegion::Header a hostile trainer rewrites (a trainer of this tree never
// writes them after Create).
template <typename T>
void Poke(const std::string& path, off_t at, T value) {
  int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0) << path;
  ASSERT_EQ(pwrite(fd, &value, sizeof(value), at), static_cast<ssize_t>(sizeof(value)));
  close(fd);
}

json InitFor(const IpcRegion& region) {
  IpcInitInfo info;
  info.session = region.session();
  info.control_path = region.path();
  info.control_bytes = region.bytes();
  info.num_slots = region.num_slots();
  info.slot_bytes = region.slot_bytes();
  info.reader_count = region.reader_count();
  info.buffers[HostDeviceKey()] = region.ShmBuffer();
  return json{{"init_info", info.ToJson()}};
}

TEST_F(IpcTest, HostileRegionsGet4xxOr5xxAndTheServerProcessKeepsServing) {
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartIpcServer("serve", "qwen3-tiny", 1, {"--ipc-shm-dir", "/dev/shm"}));
  IpcRegionOptions o;
  o.session = NewSessionId();
  o.slot_bytes = 1 << 20;
  // 4 slots of stride 2^62: the slots' end wraps around 64 bits to inside the file.
  auto wrap = IpcRegion::Create(o);
  ASSERT_TRUE(wrap.ok()) << wrap.status().ToString();
  Poke<uint32_t>((*wrap)->path(), 12, 4);
  Poke<uint64_t>((*wrap)->path(), 24, uint64_t{1} << 62);
  json init = InitFor(**wrap);
  init["init_info"]["num_slots"] = 4;
  init["init_info"]["buffers"][HostDeviceKey()]["stride"] = uint64_t{1} << 62;
  EXPECT_TRUE(IsError(HttpPostJson(s.url, "/init_weight_transfer_engine", init), 400,
                      {"header slot_stride 4611686018427387904 x num_slots 4"}));
  EXPECT_EQ(HttpGet(s.url, "/health").status, 200) << s.process->Describe();

  // A POSIX shm region shrunk after init.
  o.session = NewSessionId();
  o.backing = ShmBacking::kPosixShm;
  auto shrunk = IpcRegion::Create(o);
  ASSERT_TRUE(shrunk.ok()) << shrunk.status().ToString();
  (*shrunk)->Announce(1, 1);
  HttpReply r = HttpPostJson(s.url, "/init_weight_transfer_engine", InitFor(**shrunk));
  ASSERT_EQ(r.status, 200) << r.Describe();
  ASSERT_EQ(truncate((*shrunk)->path().c_str(), 4096), 0);
  ASSERT_EQ(HttpPostJson(s.url, "/start_weight_update", json::object()).status, 200);
  json update = {{"names", {"model.norm.weight"}}, {"dtype_names", {"bfloat16"}}, {"shapes", {{256}}},
                 {"tensor_sizes", {512}}, {"tensor_offsets", {0}}, {"chunk_ends", {1}},
                 {"wsync_ipc_protocol", 3}, {"session", (*shrunk)->session()}};
  EXPECT_TRUE(IsError(HttpPostJson(s.url, "/update_weights", json{{"update_info", update}}), 500,
                      {"shrank to 4096 bytes"}));
  EXPECT_EQ(HttpGet(s.url, "/health").status, 200) << s.process->Describe();

  // Paths outside what the flags allow: one answer, whatever is there.
  for (const char* path : {"/etc/passwd", "/etc/no-such-file", "/dev/zero"}) {
    json bad = InitFor(**shrunk);
    bad["init_info"]["control_path"] = path;
    HttpReply reply = HttpPostJson(s.url, "/init_weight_transfer_engine", bad);
    EXPECT_TRUE(IsError(reply, 400, {"is not a wsync ipc region this server may open"}));
    EXPECT_EQ(reply.ErrorMessage().find("bytes"), std::string::npos) << reply.Describe();
  }

  // The same process takes the next real sessions, bit-exact.
  RunResult push = PushIpc("push", {s}, {"--model", "qwen3-tiny", "--seed", "5", "--steps", "1", "--verify",
                                         "--timeout", "60"});
  ASSERT_TRUE(push.success()) << push.description << "\n--- server ---\n" << s.process->Describe();
  E2E_ASSERT_OK_AND_ASSIGN(Digests want, ExpectedSyntheticDigests("qwen3-tiny", 5, 1, DigestAlgorithm::kXxh3_128));
  ExpectServersHold({s}, want, DigestAlgorithm::kXxh3_128);
  ExpectCleanShutdown(s);
}

TEST_F(IpcTest, ATrainerKilledMidSyncLeavesTheServerReadyForTheNextSession) {
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartIpcServer("serve", "qwen3-tiny", 2, {"--timeout", "60"}));
  // The trainer publishes 3 chunks of sync 0, then wedges until killed.
  E2E_ASSERT_OK_AND_ASSIGN(
      Subprocess * trainer,
      SpawnWsync("stalled_push",
                 {"push", "--servers", s.url, "--backend", "ipc", "--model", "qwen3-tiny", "--seed", "1",
                  "--steps", "2", "--bucket-gb", "0.001", "--timeout", "60", "--backend-option",
                  "stall_after_chunks=3"}));
  ASSERT_TRUE(Eventually([&] { return trainer->Stderr().find("stalled after 3 chunk(s)") != std::string::npos; }, 60))
      << trainer->Describe();
  EXPECT_GE(IpcMappings(s.process->pid()), 1);
  HttpReply busy = HttpPostJson(s.url, "/start_weight_update", json::object());
  EXPECT_EQ(busy.status, 409) << "the stalled sync's session is still open: " << busy.Describe();

  trainer->Signal(SIGKILL);
  ASSERT_TRUE(trainer->Wait(Deadline::InSeconds(10)).has_value());
  // The server sees the trainer's exit within milliseconds (its lock on the region goes
  // with it), ends the update, and drops the mapping; it never waits out its timeout.
  EXPECT_TRUE(Eventually([&] { return HttpGet(s.url, "/health").json.value("weights_consistent", true) == false; }, 5))
      << s.process->Describe();
  EXPECT_TRUE(Eventually([&] { return IpcMappings(s.process->pid()) == 0; }, 5));
  EXPECT_NE(s.process->Stderr().find("exited during the sync"), std::string::npos) << s.process->Describe();

  RunResult push = PushIpc("push", {s}, {"--model", "qwen3-tiny", "--seed", "6", "--steps", "2", "--verify",
                                         "--bucket-gb", "0.001", "--timeout", "60"});
  ASSERT_TRUE(push.success()) << push.description << "\n--- server ---\n" << s.process->Describe();
  EXPECT_TRUE(HasVerifiedTable(push.out, 3)) << push.out;
  E2E_ASSERT_OK_AND_ASSIGN(Digests want, ExpectedSyntheticDigests("qwen3-tiny", 6, 2, DigestAlgorithm::kXxh3_128));
  ExpectServersHold({s}, want, DigestAlgorithm::kXxh3_128);
  EXPECT_EQ(HttpGet(s.url, "/health").json.value("weights_consistent", false), true);
  ExpectCleanShutdown(s);
}

}  // namespace
}  // namespace wsync::e2e
