// The `delta` backend end to end: real `wsync serve --backend delta` servers over a base
// checkpoint written by the test, `wsync push --backend delta --sync-dir`, and the
// servers' /weight_checker compared with digests the test computes itself. Late joiners,
// corruption, a crashed apply, a broken chain, empty deltas and two servers sharing one
// local checkpoint are driven through the HTTP routes directly.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <span>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/digest.h"
#include "core/dtype_convert.h"
#include "core/parallel.h"
#include "e2e_test_base.h"
#include "format/safetensors.h"
#include "model/config.h"
#include "synthetic/synthetic.h"

namespace wsync::e2e {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

std::string ReadAll(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void WriteAll(const fs::path& p, const std::string& s) { std::ofstream(p, std::ios::binary) << s; }

// A base's identity as the protocol defines it: the xxh3-128 hex of the lines
// "<name>\0<tensor's xxh3-128 hex>\n", names in byte order.
std::string BaseDigest(const Digests& tensors) {
  std::string lines;
  for (const auto& [name, hex] : tensors) lines += name + std::string(1, '\0') + hex + "\n";
  return HexDigest(DigestAlgorithm::kXxh3_128, std::as_bytes(std::span(lines.data(), lines.size())));
}

class DeltaTest : public E2eTest {
 protected:
  // The base checkpoint: SyntheticTrainer(model, seed) weights, as one safetensors file;
  // with `disk` (F32), the floating-point tensors stored in that dtype instead.
  void WriteBase(const std::string& model, uint64_t seed, std::optional<DType> disk = std::nullopt) {
    model_ = model;
    seed_ = seed;
    WriteCheckpoint(base(), seed, disk);
  }
  void WriteCheckpoint(const std::string& where, uint64_t seed, std::optional<DType> disk = std::nullopt) {
    const std::string& model = model_;
    E2E_ASSERT_OK_AND_ASSIGN(ModelConfig config, LookupModel(model));
    E2E_ASSERT_OK_AND_ASSIGN(auto trainer, SyntheticTrainer::FromMetadata(HfTensors(config), seed, DefaultThreads()));
    std::vector<TensorRef> refs;
    std::vector<std::vector<std::byte>> widened;
    widened.reserve(trainer->tensors().size());
    for (const HostTensor& t : trainer->tensors()) {
      TensorRef r = t.ref();
      if (disk && r.dtype == DType::kBF16) {
        std::vector<std::byte>& out = widened.emplace_back(r.bytes.size() * 2);
        Status c = Convert(r.bytes, r.dtype, out, *disk, r.name);
        ASSERT_TRUE(c.ok()) << c.ToString();
        r.dtype = *disk;
        r.bytes = out;
      }
      refs.push_back(r);
    }
    fs::create_directories(where);
    fs::create_directories(root());
    Status s = WriteSafetensors((fs::path(where) / "model.safetensors").string(), refs);
    ASSERT_TRUE(s.ok()) << s.ToString();
  }

  std::string base() const { return (dir() / "base").string(); }
  // The servers' --sync-root; the trainer's sync dir lies below it.
  std::string root() const { return (dir() / "shared").string(); }
  std::string sync() const { return (dir() / "shared" / "sync").string(); }
  std::string local(const std::string& name) const { return (dir() / ("local-" + name)).string(); }

  Result<Server> StartDelta(const std::string& name, const std::string& local_dir, std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {"--model", model_, "--backend", "delta", "--base-checkpoint", base(),
                                     "--sync-root", root()};
    if (!local_dir.empty()) {
      args.push_back("--local-checkpoint-dir");
      args.push_back(local_dir);
    }
    args.insert(args.end(), extra.begin(), extra.end());
    return StartServer(name, args);
  }

  RunResult PushDelta(const std::string& name, const std::vector<Server>& servers, int steps) {
    return RunWsync(name, {"push", "--servers", JoinUrls(servers), "--backend", "delta", "--sync-dir", sync(),
                           "--model", model_, "--seed", std::to_string(seed_), "--steps", std::to_string(steps),
                           "--verify", "--timeout", "120"},
                    300);
  }

  Digests Want(int steps) {
    Result<Digests> d = ExpectedSyntheticDigests(model_, seed_, steps, DigestAlgorithm::kXxh3_128);
    EXPECT_TRUE(d.ok()) << d.status().ToString();
    return d.ok() ? *d : Digests{};
  }

  // What the trainer does for one server: fetch (answer returned), then start/update/finish.
  HttpReply Fetch(const Server& s, int version, const std::string& sync_dir = "") {
    return HttpPost(s.url, "/fetch_weights",
                    json{{"target_version", version}, {"sync_dir", sync_dir.empty() ? sync() : sync_dir}}.dump(), "",
                    30);
  }
  void Reload(const Server& s, int version) {
    for (const auto& [path, body] : std::vector<std::pair<std::string, json>>{
             {"/start_weight_update", json::object()},
             {"/update_weights", json{{"update_info", {{"target_version", version}, {"sync_dir", sync()}}}}},
             {"/finish_weight_update", json{{"weight_version", std::to_string(version)}}}}) {
      HttpReply r = HttpPostJson(s.url, path, body);
      ASSERT_EQ(r.status, 200) << path << " " << r.Describe();
    }
  }
  void Payload(int version, const std::function<void(fs::path)>& fn) {
    fn(fs::path(sync()) / fmt::format("delta-{:08d}", version) / "delta-rank00000-file000000.safetensors");
  }

  std::string model_ = "qwen3-tiny";
  uint64_t seed_ = 0;
};

// No error message carries bytes of `secret` (nor its first 8 bytes read as a number).
void ExpectNoLeak(const HttpReply& r, const std::string& secret) {
  EXPECT_EQ(r.body.find(secret.substr(0, 8)), std::string::npos) << r.Describe();
  uint64_t le = 0;
  for (int i = 7; i >= 0; --i) le = (le << 8) | static_cast<uint8_t>(secret[i]);
  EXPECT_EQ(r.body.find(std::to_string(le)), std::string::npos) << r.Describe();
}

TEST_F(DeltaTest, StepsSyncBitExactThroughTheSyncDirIntoTwoServers) {
  WriteBase("qwen3-tiny", 3);
  E2E_ASSERT_OK_AND_ASSIGN(Server a, StartDelta("tp2", local("a"), {"--tp", "2"}));
  E2E_ASSERT_OK_AND_ASSIGN(Server b, StartDelta("tp1", local("b")));
  RunResult push = PushDelta("push", {a, b}, 3);
  ASSERT_TRUE(push.success()) << push.description;
  EXPECT_TRUE(HasVerifiedTable(push.out, 4));  // every sync verified, 0 (empty delta) .. 3
  ExpectServersHold({a, b}, Want(3), DigestAlgorithm::kXxh3_128);
  // Sync 0 sends the base itself: the full version, a zero patch and the digest of every
  // tensor, and the base's digest.
  json m1 = json::parse(ReadAll(fs::path(sync()) / "delta-00000001" / "manifest.json"));
  EXPECT_EQ(m1["base_version"], 0);
  const Digests base_digests = Want(0);
  EXPECT_EQ(m1["base_digest"], BaseDigest(base_digests));
  ASSERT_EQ(m1["tensors"].size(), base_digests.size());
  for (const json& r : m1["tensors"]) EXPECT_EQ(r["checksum"], base_digests.at(r["name"])) << r["name"];
  json m4 = json::parse(ReadAll(fs::path(sync()) / "delta-00000004" / "manifest.json"));
  EXPECT_EQ(m4["version"], 4);
  EXPECT_FALSE(m4["tensors"].empty());
  EXPECT_EQ(m4["format_version"], 1);
  // A second run in the same sync dir is refused: versions are never rewritten.
  RunResult again = PushDelta("again", {a}, 1);
  EXPECT_FALSE(again.success());
  EXPECT_NE(again.err.find("give a fresh sync_dir"), std::string::npos) << again.description;
}

// A trainer killed inside its session (after it paused generation and started the
// update) leaves neither the session nor the pause behind: the pause ends when the
// session's lease runs out, without any call, and a fresh trainer takes over at once.
TEST_F(DeltaTest, ATrainerKilledInsideASessionLeavesNoPauseAndIsTakenOver) {
  WriteBase("qwen3-tiny", 3);
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartDelta("serve", local("a"), {"--session-lease", "2"}));
  E2E_ASSERT_OK_AND_ASSIGN(
      Subprocess * dying,
      SpawnWsync("dying",
                 {"push", "--servers", s.url, "--backend", "delta", "--sync-dir", sync(), "--model", model_, "--seed",
                  "3", "--steps", "1", "--timeout", "60"},
                 {{"WSYNC_FAULT_TRAINER_STALL", "after-start"}}));
  for (int i = 0; i < 1200 && dying->Stderr().find("stalled after start_weight_update") == std::string::npos; ++i) {
    ASSERT_TRUE(dying->Running()) << dying->Describe();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(HttpGet(s.url, "/is_paused").json.value("is_paused", false), true);
  dying->Signal(SIGKILL);
  ASSERT_TRUE(dying->Wait(Deadline::InSeconds(10)).has_value());
  auto t = std::chrono::steady_clock::now();
  bool resumed = false;
  while (!resumed && std::chrono::steady_clock::now() - t < std::chrono::seconds(10)) {
    resumed = HttpGet(s.url, "/is_paused").json.value("is_paused", true) == false;
    if (!resumed) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  std::printf("[takeover] delta: the dead trainer's pause ended %.1f s after the SIGKILL (lease 2 s)\n", took);
  EXPECT_TRUE(resumed) << s.process->Describe();
  EXPECT_NE(s.process->Stderr().find("generation was paused by a trainer that is gone"), std::string::npos);

  const std::string sync2 = (fs::path(root()) / "sync2").string();
  RunResult fresh = RunWsync("fresh", {"push", "--servers", s.url, "--backend", "delta", "--sync-dir", sync2, "--model",
                                       model_, "--seed", "3", "--steps", "1", "--verify", "--timeout", "60"},
                             120);
  ASSERT_TRUE(fresh.success()) << fresh.description;
  ExpectServersHold({s}, Want(1), DigestAlgorithm::kXxh3_128);
  EXPECT_EQ(HttpGet(s.url, "/is_paused").json.value("is_paused", true), false);
}

// Two trainer ranks (`push --trainer-ranks 2`): rank 0 publishes what its FSDP or TP
// shards gather to, rank 1 only drains its source once per sync (its part of the
// collectives); every version lands bit-exact, and the payload names rank 0 only.
TEST_F(DeltaTest, TwoTrainerRanksWhereRank1OnlyDrainsItsSourceSyncBitExact) {
  WriteBase("qwen3-tiny", 4);
  for (const char* layout : {"fsdp", "tp2pp1ep1"}) {
    SCOPED_TRACE(layout);
    fs::remove_all(sync());
    E2E_ASSERT_OK_AND_ASSIGN(Server s, StartDelta(fmt::format("serve_{}", layout), local(layout)));
    RunResult push = RunWsync(fmt::format("push_{}", layout),
                              {"push", "--servers", s.url, "--backend", "delta", "--sync-dir", sync(), "--model",
                               model_, "--seed", "4", "--steps", "2", "--verify", "--timeout", "120",
                               "--trainer-ranks", "2", "--trainer-layout", layout},
                              300);
    ASSERT_TRUE(push.success()) << push.description << "\n--- server ---\n" << s.process->Describe();
    EXPECT_TRUE(HasVerifiedTable(push.out, 3)) << push.out;
    ExpectServersHold({s}, Want(2), DigestAlgorithm::kXxh3_128);
    json m = json::parse(ReadAll(fs::path(sync()) / "delta-00000003" / "manifest.json"));
    ASSERT_FALSE(m["payload_files"].empty());
    for (const auto& f : m["payload_files"]) EXPECT_TRUE(f.get<std::string>().starts_with("delta-rank00000-")) << f;
    ExpectCleanShutdown(s);
  }
}

// A base checkpoint stored in F32 for a bf16 model: the trainer publishes its XORs in the
// checkpoint's dtype, and each server converts while it reloads its shards (on several
// threads for a CPU worker); every version lands bit-exact.
TEST_F(DeltaTest, ACheckpointInAnotherDtypeThanTheModelReloadsBitExact) {
  WriteBase("qwen3-tiny", 5, DType::kF32);
  E2E_ASSERT_OK_AND_ASSIGN(Server tp2, StartDelta("tp2", local("a"), {"--tp", "2"}));
  // The trainer reads the base's dtypes (--base-checkpoint) to publish in them.
  RunResult push = RunWsync("push", {"push", "--servers", tp2.url, "--backend", "delta", "--sync-dir", sync(),
                                     "--base-checkpoint", base(), "--model", model_, "--seed", "5", "--steps", "2",
                                     "--verify", "--timeout", "120"},
                            300);
  ASSERT_TRUE(push.success()) << push.description << "\n--- server ---\n" << tp2.process->Describe();
  EXPECT_TRUE(HasVerifiedTable(push.out, 3)) << push.out;
  ExpectServersHold({tp2}, Want(2), DigestAlgorithm::kXxh3_128);
  json m = json::parse(ReadAll(fs::path(sync()) / "delta-00000003" / "manifest.json"));
  ASSERT_FALSE(m["tensors"].empty());
  EXPECT_EQ(m["tensors"][0]["dtype"], "float32");  // SkyRL names torch dtypes
}

// `push --base-checkpoint`: the servers' base is not the trainer's first pass, so version 1
// is a real delta from the base to the trainer's starting weights.
TEST_F(DeltaTest, ATrainerStartingFromOtherWeightsThanTheBaseSyncsBitExact) {
  WriteBase("qwen3-tiny", 3);
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartDelta("tp1", local("a")));
  RunResult push = RunWsync("push", {"push", "--servers", s.url, "--backend", "delta", "--sync-dir", sync(),
                                     "--model", model_, "--seed", "9", "--steps", "1", "--base-checkpoint", base(),
                                     "--verify", "--timeout", "120"},
                            300);
  ASSERT_TRUE(push.success()) << push.description;
  EXPECT_TRUE(HasVerifiedTable(push.out, 2));
  E2E_ASSERT_OK_AND_ASSIGN(Digests want, ExpectedSyntheticDigests(model_, 9, 1, DigestAlgorithm::kXxh3_128));
  ExpectServersHold({s}, want, DigestAlgorithm::kXxh3_128);
  json m1 = json::parse(ReadAll(fs::path(sync()) / "delta-00000001" / "manifest.json"));
  EXPECT_EQ(m1["base_version"], 0);
  EXPECT_FALSE(m1["tensors"].empty()) << "seed 9's weights differ from the seed-3 base";
  // Without the flag the first pass would be taken as version 0 and the server, still on
  // the seed-3 base, would be left behind: the flag is what makes this run correct.
}

// The issue-32 defect: a trainer whose first weights (seed 4) are not the servers' base
// (seed 3), and which is not told the servers' base, must fail its first sync naming
// both bases and the fix, and leave the server on its base; told the base, it syncs.
TEST_F(DeltaTest, AFirstSyncOverAnotherBaseFailsNamingBothBasesAndTheFix) {
  WriteBase("qwen3-tiny", 3);
  // The server serves its base from the start, as a deployed one does.
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartDelta("tp2", local("a"), {"--tp", "2", "--checkpoint", base()}));
  const Digests a = Want(0);
  ExpectServersHold({s}, a, DigestAlgorithm::kXxh3_128);
  E2E_ASSERT_OK_AND_ASSIGN(Digests b, ExpectedSyntheticDigests(model_, 4, 0, DigestAlgorithm::kXxh3_128));
  RunResult push = RunWsync("push", {"push", "--servers", s.url, "--backend", "delta", "--sync-dir", sync(),
                                     "--model", model_, "--seed", "4", "--steps", "1", "--verify", "--timeout", "120"},
                            300);
  EXPECT_FALSE(push.success()) << push.description;
  const std::string err = push.out + push.err;
  EXPECT_NE(err.find("the trainer's base is not this server's"), std::string::npos) << push.description;
  EXPECT_NE(err.find(fmt::format("base_digest {} over {} tensors", BaseDigest(b), b.size())), std::string::npos)
      << push.description;
  EXPECT_NE(err.find(fmt::format("base checkpoint {} has base_digest {} over the same tensors", base(), BaseDigest(a))),
            std::string::npos) << push.description;
  EXPECT_NE(err.find(fmt::format("{} of them differ", a.size())), std::string::npos) << push.description;
  EXPECT_NE(err.find("wsync push --base-checkpoint DIR"), std::string::npos) << push.description;
  EXPECT_NE(err.find("start the servers with --base-checkpoint"), std::string::npos) << push.description;
  EXPECT_EQ(err.find("delta: version 2"), std::string::npos) << "nothing after the failed first sync";
  std::cout << "[e2e] the push said: " << push.err.substr(push.err.rfind('\n', push.err.size() - 2) + 1);
  ExpectServersHold({s}, a, DigestAlgorithm::kXxh3_128);
  EXPECT_FALSE(fs::exists(fs::path(local("a")) / "weights"));  // refused before anything was copied
  json state = json::parse(ReadAll(fs::path(local("a")) / ".skyrl_weight_sync" / "state.json"));
  EXPECT_EQ(state["version"], 0) << state.dump();
  EXPECT_FALSE(state["write_in_progress"].get<bool>()) << state.dump();

  // A reader that ignores base_digest (SkyRL's) applies the zero patches and fails every
  // tensor's checksum instead of serving its own base.
  fs::path m1 = fs::path(sync()) / "delta-00000001" / "manifest.json";
  json manifest = json::parse(ReadAll(m1));
  manifest.erase("base_digest");
  WriteAll(m1, manifest.dump());
  HttpReply f = Fetch(s, 1);
  EXPECT_EQ(f.status, 500) << f.Describe();
  EXPECT_NE(f.ErrorMessage().find(fmt::format("{} of {} tensors failed verification", a.size(), a.size())),
            std::string::npos) << f.Describe();

  // Told the servers' base, the same trainer syncs bit-exact (a fresh chain).
  const std::string sync2 = (fs::path(root()) / "sync2").string();
  RunResult told = RunWsync("told", {"push", "--servers", s.url, "--backend", "delta", "--sync-dir", sync2,
                                     "--base-checkpoint", base(), "--model", model_, "--seed", "4", "--steps", "1",
                                     "--verify", "--timeout", "120"},
                            300);
  ASSERT_TRUE(told.success()) << told.description << "\n--- server ---\n" << s.process->Describe();
  EXPECT_TRUE(HasVerifiedTable(told.out, 2)) << told.out;
  E2E_ASSERT_OK_AND_ASSIGN(Digests want, ExpectedSyntheticDigests(model_, 4, 1, DigestAlgorithm::kXxh3_128));
  ExpectServersHold({s}, want, DigestAlgorithm::kXxh3_128);
}

// A trainer told a base checkpoint that is not the servers' fails at init, naming both.
TEST_F(DeltaTest, ABaseCheckpointThatIsNotTheServersFailsTheInitNamingBoth) {
  WriteBase("qwen3-tiny", 3);
  const std::string other = (dir() / "other-base").string();
  WriteCheckpoint(other, 4);
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartDelta("tp1", local("a"), {"--checkpoint", base()}));
  const Digests a = Want(0);
  ExpectServersHold({s}, a, DigestAlgorithm::kXxh3_128);
  E2E_ASSERT_OK_AND_ASSIGN(Digests b, ExpectedSyntheticDigests(model_, 4, 0, DigestAlgorithm::kXxh3_128));
  RunResult push = RunWsync("push", {"push", "--servers", s.url, "--backend", "delta", "--sync-dir", sync(),
                                     "--base-checkpoint", other, "--model", model_, "--seed", "4", "--steps", "1",
                                     "--verify", "--timeout", "120"},
                            300);
  EXPECT_FALSE(push.success()) << push.description;
  const std::string err = push.out + push.err;
  EXPECT_NE(err.find(fmt::format("the trainer's base checkpoint {} has base_digest {}, this server's base checkpoint "
                                 "{} has base_digest {} (over its {} tensors)", other, BaseDigest(b), base(),
                                 BaseDigest(a), a.size())),
            std::string::npos) << push.description;
  EXPECT_NE(err.find("wsync push --base-checkpoint DIR"), std::string::npos) << push.description;
  EXPECT_EQ(err.find("delta: version 1"), std::string::npos) << "no sync after a failed init";
  std::cout << "[e2e] the push said: " << push.err.substr(push.err.rfind('\n', push.err.size() - 2) + 1);
  ExpectServersHold({s}, a, DigestAlgorithm::kXxh3_128);
}

TEST_F(DeltaTest, ALateServerCatchesUpThroughTheWholeChain) {
  WriteBase("qwen3-tiny", 4);
  E2E_ASSERT_OK_AND_ASSIGN(Server a, StartDelta("early", local("a")));
  ASSERT_TRUE(PushDelta("push", {a}, 3).success());
  E2E_ASSERT_OK_AND_ASSIGN(Server late, StartDelta("late", local("late"), {"--tp", "2"}));
  HttpReply f = Fetch(late, 4);
  ASSERT_EQ(f.status, 200) << f.Describe();
  EXPECT_EQ(f.json["stats"]["versions"], 4) << f.body;
  EXPECT_EQ(f.json["applied_by_workers"], 1) << f.body;
  Reload(late, 4);
  ExpectServersHold({a, late}, Want(3), DigestAlgorithm::kXxh3_128);
  // Asking for a version behind the local one is refused.
  HttpReply behind = Fetch(late, 2);
  EXPECT_EQ(behind.status, 409) << behind.Describe();
  EXPECT_NE(behind.ErrorMessage().find("ahead of target_version 2"), std::string::npos) << behind.Describe();
  // A reload of a version the local checkpoint is not at is refused too.
  ASSERT_EQ(HttpPostJson(late.url, "/start_weight_update", json::object()).status, 200);
  HttpReply wrong = HttpPostJson(late.url, "/update_weights", json{{"update_info", {{"target_version", 3}}}});
  EXPECT_EQ(wrong.status, 409) << wrong.Describe();
  EXPECT_NE(wrong.ErrorMessage().find("fetch_weights"), std::string::npos) << wrong.Describe();
}

TEST_F(DeltaTest, ACorruptPayloadByteIsDetectedAndTheNextFetchRecoversFromTheBase) {
  WriteBase("qwen3-tiny", 5);
  E2E_ASSERT_OK_AND_ASSIGN(Server a, StartDelta("a", local("a")));
  ASSERT_TRUE(PushDelta("push", {a}, 2).success());
  E2E_ASSERT_OK_AND_ASSIGN(Server b, StartDelta("b", local("b")));
  std::string good;
  Payload(3, [&](fs::path p) {
    good = ReadAll(p);
    std::string bad = good;
    bad[bad.size() - 1000] ^= 0x01;  // one byte inside the last tensors' frames
    WriteAll(p, bad);
  });
  HttpReply f = Fetch(b, 3);
  EXPECT_EQ(f.status, 500) << f.Describe();
  EXPECT_NE(f.ErrorMessage().find("delta-00000003"), std::string::npos) << f.Describe();
  EXPECT_NE(f.ErrorMessage().find("delta-rank00000-file000000.safetensors"), std::string::npos) << f.Describe();
  json state = json::parse(ReadAll(fs::path(local("b")) / ".skyrl_weight_sync" / "state.json"));
  EXPECT_TRUE(state["write_in_progress"].get<bool>()) << state.dump();
  Payload(3, [&](fs::path p) { WriteAll(p, good); });
  HttpReply again = Fetch(b, 3);
  ASSERT_EQ(again.status, 200) << again.Describe();
  EXPECT_TRUE(again.json["reset"].get<bool>()) << again.body;
  Reload(b, 3);
  ExpectServersHold({b}, Want(2), DigestAlgorithm::kXxh3_128);
}

TEST_F(DeltaTest, AnApplyThatDiedMidwayRecoversFromTheBase) {
  // What a server killed during an apply leaves behind: half-patched weights and a state
  // saying write_in_progress. (delta_local_checkpoint_test kills a real apply midway.)
  WriteBase("qwen3-tiny", 6);
  E2E_ASSERT_OK_AND_ASSIGN(Server a, StartDelta("a", local("a")));
  ASSERT_TRUE(PushDelta("push", {a}, 2).success());
  fs::path state_path = fs::path(local("a")) / ".skyrl_weight_sync" / "state.json";
  json state = json::parse(ReadAll(state_path));
  ASSERT_EQ(state["version"], 3);
  state["write_in_progress"] = true;
  state["target_version"] = 3;
  WriteAll(state_path, state.dump());
  fs::path weights = fs::path(local("a")) / "weights" / "model.safetensors";
  std::string w = ReadAll(weights);
  for (size_t i = w.size() / 2; i < w.size() / 2 + 4096; ++i) w[i] ^= 0x55;
  WriteAll(weights, w);
  HttpReply f = Fetch(a, 3);
  ASSERT_EQ(f.status, 200) << f.Describe();
  EXPECT_TRUE(f.json["reset"].get<bool>()) << f.body;
  EXPECT_EQ(f.json["stats"]["versions"], 3) << f.body;
  Reload(a, 3);
  ExpectServersHold({a}, Want(2), DigestAlgorithm::kXxh3_128);
}

TEST_F(DeltaTest, AManifestWithAWrongBaseVersionIsRefused) {
  WriteBase("qwen3-tiny", 7);
  E2E_ASSERT_OK_AND_ASSIGN(Server a, StartDelta("a", local("a")));
  ASSERT_TRUE(PushDelta("push", {a}, 2).success());
  E2E_ASSERT_OK_AND_ASSIGN(Server b, StartDelta("b", local("b")));
  ASSERT_EQ(Fetch(b, 2).status, 200);
  fs::path mpath = fs::path(sync()) / "delta-00000003" / "manifest.json";
  json m = json::parse(ReadAll(mpath));
  m["base_version"] = 1;
  WriteAll(mpath, m.dump());
  HttpReply f = Fetch(b, 3);
  EXPECT_EQ(f.status, 409) << f.Describe();
  EXPECT_NE(f.ErrorMessage().find("base_version 1"), std::string::npos) << f.Describe();
  // The refusal touched nothing: the server still reloads version 2 exactly.
  Reload(b, 2);
  ExpectServersHold({b}, Want(1), DigestAlgorithm::kXxh3_128);
}

TEST_F(DeltaTest, EmptyDeltasWork) {
  WriteBase("qwen3-tiny", 8);
  E2E_ASSERT_OK_AND_ASSIGN(Server a, StartDelta("a", local("a")));
  RunResult push = PushDelta("push", {a}, 0);
  ASSERT_TRUE(push.success()) << push.description;
  EXPECT_TRUE(HasVerifiedTable(push.out, 1));
  ExpectServersHold({a}, Want(0), DigestAlgorithm::kXxh3_128);
  EXPECT_FALSE(fs::exists(fs::path(local("a")) / "weights"));  // nothing to patch: no copy of the base
}

TEST_F(DeltaTest, ConcurrentFetchesFromTheWorkersOfOneHostApplyOnce) {
  WriteBase("qwen3-tiny", 9);
  E2E_ASSERT_OK_AND_ASSIGN(Server a, StartDelta("a", local("a")));
  ASSERT_TRUE(PushDelta("push", {a}, 2).success());
  // Two DP ranks of one deployment on this host, sharing one local checkpoint: four
  // workers in two processes fetch at once.
  E2E_ASSERT_OK_AND_ASSIGN(Server r0, StartDelta("dp0", local("shared"), {"--tp", "2", "--dp", "2", "--dp-rank", "0"}));
  E2E_ASSERT_OK_AND_ASSIGN(Server r1, StartDelta("dp1", local("shared"), {"--tp", "2", "--dp", "2", "--dp-rank", "1"}));
  HttpReply f0, f1;
  std::thread t0([&] { f0 = Fetch(r0, 3); });
  std::thread t1([&] { f1 = Fetch(r1, 3); });
  t0.join();
  t1.join();
  ASSERT_EQ(f0.status, 200) << f0.Describe();
  ASSERT_EQ(f1.status, 200) << f1.Describe();
  EXPECT_EQ(f0.json["applied_by_workers"].get<int>() + f1.json["applied_by_workers"].get<int>(), 1)
      << f0.body << "\n" << f1.body;
  Reload(r0, 3);
  Reload(r1, 3);
  ExpectServersHold({r0, r1}, Want(2), DigestAlgorithm::kXxh3_128);
}

// The trust boundary (docs/security.md): a request names a sync dir only below the
// server's --sync-root, and never its local checkpoint or base (SkyRL's init keys are
// compared, never opened). Here the server runs without --local-checkpoint-dir, so
// init_info's local_checkpoint_dir must not become the directory a new chain resets.
TEST_F(DeltaTest, PathsInRequestsStayBelowTheFlagRootsAndNothingOutsideIsDeleted) {
  WriteBase("qwen3-tiny", 11);
  fs::path victim = dir() / "victim";
  fs::create_directories(victim / "weights");
  WriteAll(victim / "weights" / "keep.txt", "keep");
  E2E_ASSERT_OK_AND_ASSIGN(Server a, StartDelta("a", ""));
  ASSERT_TRUE(PushDelta("push", {a}, 1).success());  // versions 1 and 2 in sync()
  HttpReply init = HttpPostJson(a.url, "/init_weight_transfer_engine",
                                json{{"init_info", {{"sync_dir", sync()}, {"local_checkpoint_dir", victim.string()},
                                                    {"base_model_path", victim.string()}}}});
  EXPECT_EQ(init.status, 200) << init.Describe();  // SkyRL sends both keys: accepted, never opened
  ASSERT_EQ(Fetch(a, 2).status, 200);
  // A second chain below the root: a new chain resets the server's own local checkpoint.
  fs::copy(sync(), fs::path(root()) / "sync2", fs::copy_options::recursive);
  HttpReply other = Fetch(a, 2, (fs::path(root()) / "sync2").string());
  ASSERT_EQ(other.status, 200) << other.Describe();
  EXPECT_TRUE(other.json["reset"].get<bool>()) << other.body;
  EXPECT_TRUE(fs::exists(victim / "weights" / "keep.txt"));
  EXPECT_FALSE(fs::exists(victim / ".skyrl_weight_sync"));
  // Sync dirs outside the root: absolute, climbing with "..", and through a symlink.
  fs::copy(sync(), dir() / "outside", fs::copy_options::recursive);
  fs::create_directory_symlink(dir() / "outside", fs::path(root()) / "escape");
  for (const std::string& bad : {(dir() / "outside").string(), root() + "/../outside", root() + "/escape",
                                 std::string("../outside"), victim.string()}) {
    SCOPED_TRACE(bad);
    HttpReply f = Fetch(a, 2, bad);
    EXPECT_EQ(f.status, 400) << f.Describe();
    EXPECT_TRUE(f.ErrorMessage().find("sync root") != std::string::npos ||
                f.ErrorMessage().find("leads outside") != std::string::npos) << f.Describe();
    if (bad.ends_with("/escape")) continue;  // init checks the path; the fetch resolves its symlinks
    HttpReply i = HttpPostJson(a.url, "/init_weight_transfer_engine", json{{"init_info", {{"sync_dir", bad}}}});
    EXPECT_EQ(i.status, 400) << i.Describe();
  }
  EXPECT_TRUE(fs::exists(victim / "weights" / "keep.txt"));
  // A relative sync dir is taken below the root; the server still syncs bit-exact.
  HttpReply rel = Fetch(a, 2, "sync");
  ASSERT_EQ(rel.status, 200) << rel.Describe();
  Reload(a, 2);
  ExpectServersHold({a}, Want(1), DigestAlgorithm::kXxh3_128);
}

// SkyRL's delta receiver payloads, exactly: an init with DeltaTransferInitInfo's keys and
// no sync_dir (the sync dir comes with each fetch), an update_info of {target_version,
// version, sync_dir, uri}; an update naming a sync dir outside --sync-root is refused.
TEST_F(DeltaTest, SkyrlsExactInitAndUpdatePayloadsSyncBitExact) {
  WriteBase("qwen3-tiny", 13);
  E2E_ASSERT_OK_AND_ASSIGN(Server a, StartDelta("a", local("a")));
  ASSERT_TRUE(PushDelta("push", {a}, 1).success());  // versions 1 and 2 in sync()
  E2E_ASSERT_OK_AND_ASSIGN(Server b, StartDelta("b", local("b")));
  const json skyrl_init = {{"base_model_path", base()},
                           {"local_checkpoint_dir", local("b")},
                           {"cloud_download_workers", 4},
                           {"checkpoint_load_format", "vllm_multi_thread_safetensors"},
                           {"multi_thread_safetensors_max_workers", 8}};
  HttpReply init = HttpPostJson(b.url, "/init_weight_transfer_engine", json{{"init_info", skyrl_init}});
  ASSERT_EQ(init.status, 200) << init.Describe();
  const std::string uri = (fs::path(sync()) / "delta-00000002").string();
  HttpReply f = HttpPostJson(b.url, "/fetch_weights", json{{"target_version", 2}, {"sync_dir", sync()}, {"uri", uri}});
  ASSERT_EQ(f.status, 200) << f.Describe();
  EXPECT_EQ(f.json["status"], "ok");
  EXPECT_EQ(f.json["target_version"], 2);
  const json outside = {{"target_version", 2}, {"version", 2}, {"sync_dir", (dir() / "elsewhere").string()}, {"uri", uri}};
  ASSERT_EQ(HttpPostJson(b.url, "/start_weight_update", json::object()).status, 200);
  HttpReply refused = HttpPostJson(b.url, "/update_weights", json{{"update_info", outside}});
  EXPECT_EQ(refused.status, 400) << refused.Describe();
  (void)HttpPostJson(b.url, "/finish_weight_update", json::object());
  const json update = {{"target_version", 2}, {"version", 2}, {"sync_dir", sync()}, {"uri", uri}};
  for (const auto& [path, body] : std::vector<std::pair<std::string, json>>{
           {"/start_weight_update", json::object()},
           {"/update_weights", json{{"update_info", update}}},
           {"/finish_weight_update", json{{"weight_version", "2"}}}}) {
    HttpReply r = HttpPostJson(b.url, path, body);
    ASSERT_EQ(r.status, 200) << path << " " << r.Describe();
  }
  ExpectServersHold({a, b}, Want(1), DigestAlgorithm::kXxh3_128);
}

// What a sync dir holds is untrusted too: payload files confined to their version
// directory, regular files only (a FIFO or a device is refused at once, never read), a
// manifest of bounded size, and no file bytes in any error.
TEST_F(DeltaTest, HostileFilesInTheSyncDirAreRefusedQuicklyWithoutLeakingBytes) {
  WriteBase("qwen3-tiny", 12);
  E2E_ASSERT_OK_AND_ASSIGN(Server pusher, StartDelta("pusher", local("pusher")));
  ASSERT_TRUE(PushDelta("push", {pusher}, 2).success());  // versions 1..3
  E2E_ASSERT_OK_AND_ASSIGN(Server a, StartDelta("a", local("a")));
  const std::string secret = "TOPSECRET-do-not-leak-0123456789";
  WriteAll(dir() / "secret.txt", secret);
  ASSERT_EQ(Fetch(a, 2).status, 200);
  fs::path v3 = fs::path(sync()) / "delta-00000003";
  fs::path saved = dir() / "v3-saved";
  fs::copy(v3, saved, fs::copy_options::recursive);
  json good = json::parse(ReadAll(saved / "manifest.json"));
  auto reset_v3 = [&] {
    fs::remove_all(v3);
    fs::copy(saved, v3, fs::copy_options::recursive);
  };
  auto timed_fetch = [&](const char* what) {
    auto t0 = std::chrono::steady_clock::now();
    HttpReply f = Fetch(a, 3);
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_LT(s, 10) << what;
    EXPECT_TRUE(f.status >= 400 && f.status < 600) << what << " " << f.Describe();
    ExpectNoLeak(f, secret);
    return f;
  };
  {  // payload_files naming a file outside the version directory
    json m = good;
    m["payload_files"].push_back("../../../secret.txt");
    WriteAll(v3 / "manifest.json", m.dump());
    HttpReply f = timed_fetch("payload_files ../../../secret.txt");
    EXPECT_EQ(f.status, 400) << f.Describe();
    EXPECT_NE(f.ErrorMessage().find("plain file name"), std::string::npos) << f.Describe();
  }
  {  // a payload file that is a symlink out of the sync root
    reset_v3();
    std::string name = good["payload_files"][0].get<std::string>();
    fs::remove(v3 / name);
    fs::create_symlink(dir() / "secret.txt", v3 / name);
    timed_fetch("payload symlink out of the root");
  }
  {  // a FIFO as manifest.json: refused at once, not a hang past --timeout
    reset_v3();
    fs::remove(v3 / "manifest.json");
    ASSERT_EQ(::mkfifo((v3 / "manifest.json").c_str(), 0644), 0);
    HttpReply f = timed_fetch("FIFO manifest");
    EXPECT_NE(f.ErrorMessage().find("not a regular file"), std::string::npos) << f.Describe();
  }
  {  // manifest.json -> /dev/zero, and -> the secret
    for (const fs::path& target : {fs::path("/dev/zero"), dir() / "secret.txt"}) {
      reset_v3();
      fs::remove(v3 / "manifest.json");
      fs::create_symlink(target, v3 / "manifest.json");
      timed_fetch(target.c_str());
    }
  }
  {  // a manifest over the size limit (a sparse file: no disk, and never read)
    reset_v3();
    ::truncate((v3 / "manifest.json").c_str(), off_t{300} << 20);
    HttpReply f = timed_fetch("oversized manifest");
    EXPECT_NE(f.ErrorMessage().find("limit"), std::string::npos) << f.Describe();
  }
  // None of it touched the local checkpoint: version 3, once whole again, syncs bit-exact.
  reset_v3();
  HttpReply f = Fetch(a, 3);
  ASSERT_EQ(f.status, 200) << f.Describe();
  Reload(a, 3);
  ExpectServersHold({a}, Want(2), DigestAlgorithm::kXxh3_128);
}

// A malformed state.json (wrong types) fails the reload with an error, not an exception
// that leaves the server wedged; the next fetch rebuilds from the base and syncs bit-exact.
TEST_F(DeltaTest, AMalformedStateFileFailsCleanlyAndTheNextFetchSyncsBitExact) {
  WriteBase("qwen3-tiny", 13);
  E2E_ASSERT_OK_AND_ASSIGN(Server a, StartDelta("a", local("a")));
  ASSERT_TRUE(PushDelta("push", {a}, 1).success());
  fs::path state = fs::path(local("a")) / ".skyrl_weight_sync" / "state.json";
  for (const std::string& bad : {std::string(R"({"version": "two", "write_in_progress": 1, "sync_dir": 7})"),
                                 std::string(R"({"version": 18446744073709551615, "target_version": [1]})"),
                                 std::string("[1, 2]"), std::string("{\"version\": 2")}) {
    SCOPED_TRACE(bad);
    WriteAll(state, bad);
    ASSERT_EQ(HttpPostJson(a.url, "/start_weight_update", json::object()).status, 200);
    HttpReply u = HttpPostJson(a.url, "/update_weights", json{{"update_info", {{"target_version", 2}}}});
    EXPECT_TRUE(u.status >= 400 && u.status < 600) << u.Describe();
    (void)HttpPostJson(a.url, "/finish_weight_update", json::object());
    HttpReply f = Fetch(a, 2);
    ASSERT_EQ(f.status, 200) << f.Describe();
    EXPECT_TRUE(f.json["reset"].get<bool>()) << f.body;
    Reload(a, 2);
    ExpectServersHold({a}, Want(1), DigestAlgorithm::kXxh3_128);
  }
}

TEST_F(DeltaTest, Qwen3_0_6bStepsSyncBitExact) {
  WriteBase("qwen3-0.6b", 17);
  E2E_ASSERT_OK_AND_ASSIGN(Server a, StartDelta("tp2", local("a"), {"--tp", "2"}));
  RunResult push = PushDelta("push", {a}, 2);
  ASSERT_TRUE(push.success()) << push.description;
  EXPECT_TRUE(HasVerifiedTable(push.out, 3));
  ExpectServersHold({a}, Want(2), DigestAlgorithm::kXxh3_128);
  std::cout << "[e2e] qwen3-0.6b delta push (3 syncs) took " << push.seconds << " s\n";
  // The first sync's phases, as the trainer logs them.
  const std::string both = push.out + push.err;
  size_t at = both.find("delta: version 1:");
  if (at != std::string::npos) std::cout << "[e2e] first sync: " << both.substr(at, both.find('\n', at) - at) << "\n";
}

}  // namespace
}  // namespace wsync::e2e
