// The colocated `ipc` backend on CUDA (label `gpu`): a real `wsync serve --device cuda:0
// --backend ipc` process fed by `wsync push --device cuda:0 --backend ipc` (packed through
// exported GPU staging slots, or zero-copy from the trainer's own allocation) or by a
// trainer engine inside this test (to count GPU memory and open fds across 100 syncs).
// Every sync is checked bit for bit against digests this test computes itself; bad
// handles and a GPU the trainer did not export for are 400s that leave the server
// serving. With 2 GPUs, two trainer ranks (threads of this test, one per GPU, joined by a
// Gloo group) each export their own GPU's slots into a TP=2 server spanning both. Skips
// cleanly without enough GPUs (cuda::DeviceCount()).
#include <dirent.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <regex>
#include <string_view>
#include <thread>

#include <fmt/format.h>

#include "backends/ipc/device_plane.h"
#include "backends/ipc/region.h"
#include "backends/ipc/trainer.h"
#include "comm/gloo_communicator.h"
#include "comm/store.h"
#include "cuda/device.h"
#include "cuda/runtime.h"
#include "e2e_test_base.h"
#include "model/config.h"
#include "synthetic/synthetic.h"
#include "testing/faulty_source.h"
#include "testing/flat_buffer_source.h"
#include "wsync/source.h"

namespace wsync::e2e {
namespace {

using nlohmann::json;

// Open fds of `pid` other than sockets (HTTP connections come and go between syncs).
int OpenFds(pid_t pid) {
  int n = 0;
  std::string dir = fmt::format("/proc/{}/fd", pid);
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] == '.') continue;
      char target[256] = {};
      ssize_t len = readlink((dir + "/" + e->d_name).c_str(), target, sizeof(target) - 1);
      if (len > 0 && std::string_view(target, len).starts_with("socket:")) continue;
      ++n;
    }
    closedir(d);
  }
  return n;
}

class GpuIpcTest : public E2eTest {
 protected:
  void NeedGpus(int n) {
    gpus_ = cuda::DeviceCount();
    if (gpus_ < n) GTEST_SKIP() << "needs " << n << " CUDA device(s), this machine has " << gpus_;
    cuda::InstallDeviceRuntime();
  }
  Result<Server> StartGpuServer(const std::string& name, int tp = 1) {
    return StartServer(name, {"--model", "qwen3-tiny", "--tp", std::to_string(tp), "--device", "cuda:0",
                              "--backend", "ipc", "--timeout", "60"});
  }
  // An ipc trainer on cuda:0 for `s`, 1 MiB buckets (several chunks per sync).
  static Result<std::unique_ptr<TrainerEngine>> GpuTrainer(const Server& s, IpcTrainerOptions::Mode mode) {
    TrainerOptions o;
    o.backend = "ipc";
    o.servers = {s.url};
    o.device = Device{Device::Kind::kCuda, 0};
    o.bucket_gb = 1.0 / 1024;
    o.timeout_seconds = 60;
    IpcTrainerOptions ipc;
    ipc.mode = mode;
    return CreateIpcTrainerWith(o, ipc);
  }
  // `options`: the ipc backend's settings (push --backend-option KEY=VALUE).
  RunResult PushIpc(const std::string& name, const Server& s, std::vector<std::string> args,
                    std::map<std::string, std::string> options = {}) {
    std::vector<std::string> full = {"push", "--servers", s.url, "--backend", "ipc"};
    full.insert(full.end(), args.begin(), args.end());
    for (const auto& [key, value] : options) {
      full.push_back("--backend-option");
      full.push_back(key + "=" + value);
    }
    return RunWsync(name, std::move(full), 120);
  }
  int gpus_ = 0;
};

// Packed (both export kinds), zero-copy, and a CPU trainer's host slots into CUDA shards.
TEST_F(GpuIpcTest, ColocatedSyncsAreBitExactInEveryMode) {
  NeedGpus(1);
  if (IsSkipped()) return;
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartGpuServer("gpu"));
  struct Case {
    const char* name;
    const char* device;
    std::map<std::string, std::string> options;  // push --backend-option
  };
  std::vector<Case> cases = {
      {"packed_cuda_ipc", "cuda:0", {{"mode", "packed"}}},
      {"packed_cuda_fd", "cuda:0", {{"mode", "packed"}, {"export_kind", "cuda_fd"}}},
      {"zero_copy", "cuda:0", {{"mode", "zero_copy"}}},
      {"auto", "cuda:0", {}},
      {"cpu_trainer", "cpu", {}},
  };
  uint64_t seed = 40;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    ++seed;
    // 1 MiB slots: several chunks per sync through the two-slot ring.
    RunResult push = PushIpc(fmt::format("push_{}", c.name), s,
                             {"--model", "qwen3-tiny", "--seed", std::to_string(seed), "--steps", "2", "--device",
                              c.device, "--bucket-gb", "0.001", "--verify", "--timeout", "60"},
                             c.options);
    ASSERT_TRUE(push.success()) << push.description << "\n--- server ---\n" << s.process->Describe();
    EXPECT_TRUE(HasVerifiedTable(push.out, 3)) << push.out;
    // Digested in-line in every mode: packed slots, or the source's own storage
    // (zero-copy), on the device for a GPU trainer.
    EXPECT_EQ(InlineCells(push.out), std::vector<std::string>(3, fmt::format("1/1:{}", TensorCount("qwen3-tiny"))))
        << push.out;
    E2E_ASSERT_OK_AND_ASSIGN(Digests want,
                             ExpectedSyntheticDigests("qwen3-tiny", seed, 2, DigestAlgorithm::kXxh3_128));
    ExpectServersHold({s}, want, DigestAlgorithm::kXxh3_128);
  }
  ExpectCleanShutdown(s);
}

// qwen3-0.6b (1.2 GB; its embedding alone is 19 read-back blocks) with the trainer and the
// server on cuda:0: neither the trainer nor either side of the verification holds the
// model in host memory, and both report it (push's summary, /health).
TEST_F(GpuIpcTest, AVerifiedSyncOfAModelFarLargerThanTheReadBackBlocksStaysInBoundedHostMemory) {
  NeedGpus(1);
  if (IsSkipped()) return;
  E2E_ASSERT_OK_AND_ASSIGN(Digests want, ExpectedSyntheticDigests("qwen3-0.6b", 81, 1, DigestAlgorithm::kXxh3_128));
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("gpu06", {"--model", "qwen3-0.6b", "--device", "cuda:0",
                                                           "--backend", "ipc", "--timeout", "120"},
                                                 {}, /*ready_seconds=*/180));
  RunResult push = PushIpc("push", s, {"--model", "qwen3-0.6b", "--seed", "81", "--steps", "1", "--device", "cuda:0",
                                       "--verify", "--timeout", "120"});
  ASSERT_TRUE(push.success()) << push.description << "\n--- server ---\n" << s.process->Describe();
  EXPECT_TRUE(HasVerifiedTable(push.out, 2)) << push.out;
  // Digested in-line on the device on both sides: the embedding by row ranges.
  EXPECT_EQ(InlineCells(push.out), std::vector<std::string>(2, fmt::format("1/1:{}", TensorCount("qwen3-0.6b"))))
      << push.out;
  ExpectServersHold({s}, want, DigestAlgorithm::kXxh3_128);
  std::smatch m;
  const std::regex summary(R"(memory: model ([0-9.]+) MB on cuda:0; process RSS [0-9.]+ MB \(peak ([0-9.]+) MB\);)"
                           R"( peak extra per sync: host ([0-9.]+) MB, device ([0-9.]+) MB; per verification: host )"
                           R"(([0-9.]+) MB)");
  ASSERT_TRUE(std::regex_search(push.err, m, summary)) << push.description;
  const double mb = 1e6;
  // The CUDA context and libraries take a few hundred MB of host memory; the model, 1192 MB,
  // must not be there (a host copy plus an fp32 master took 3.6 GB).
  EXPECT_LE(std::stod(m[2]) * mb, 1.0 * (1u << 30) + 1024 * mb) << m[0];
  EXPECT_LE(std::stod(m[5]) * mb, 512 * mb) << m[0];
  HttpReply health = HttpGet(s.url, "/health");
  ASSERT_EQ(health.status, 200) << health.Describe();
  const nlohmann::json& check = health.json["memory"]["last_checksum"];
  ASSERT_TRUE(check.is_object()) << health.Describe();
  EXPECT_LE(check["host_peak_extra_bytes"].get<int64_t>(), 512 * mb) << health.Describe();
  std::cout << "[e2e] " << m[0] << "; server checksum read-back +" << check["host_peak_extra_bytes"].get<int64_t>() / mb
            << " MB\n";
  ExpectCleanShutdown(s);
}

// A server whose GPU landing of the embedding is one bit off: the trainer's device digests
// of its packed slots catch it at finish, naming the tensor, and the old version stays.
TEST_F(GpuIpcTest, ACorruptGpuLandingIsRefusedByTheTrainersDeviceDigests) {
  NeedGpus(1);
  if (IsSkipped()) return;
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("bad", {"--model", "qwen3-0.6b", "--device", "cuda:0", "--backend",
                                                         "ipc", "--fault", "corrupt-landed", "--timeout", "120"},
                                                 {}, /*ready_seconds=*/180));
  RunResult push = PushIpc("push", s, {"--model", "qwen3-0.6b", "--seed", "82", "--device", "cuda:0",
                                       "--weight-version", "v1", "--timeout", "120"},
                           {{"mode", "packed"}});
  ExpectRefusedInLine(push, s, "model.embed_tokens.weight");
  ExpectCleanShutdown(s);
}

// 100 syncs per mode from one trainer engine: no GPU memory and no fds gained on either
// side after the first syncs (mappings and copy plans are made once per session), every
// sync's bytes land, and a zero-copy source whose allocation is replaced is re-exported
// under a new generation instead of read through the old mapping.
TEST_F(GpuIpcTest, HundredSyncsGainNoGpuMemoryOrFdsAndAReplacedAllocationIsReExported) {
  NeedGpus(1);
  if (IsSkipped()) return;
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartGpuServer("gpu"));
  const Device dev{Device::Kind::kCuda, 0};
  auto trainer = SyntheticTrainer::FromMetadata(HfTensors(*LookupModel("qwen3-tiny")), 51, 2);
  ASSERT_TRUE(trainer.ok()) << trainer.status().ToString();
  auto source = DeviceTensorSource::Create(dev, (*trainer)->metadata());
  ASSERT_TRUE(source.ok()) << source.status().ToString();
  ASSERT_TRUE((*source)->Upload((*trainer)->tensors()).ok());
  uint64_t step = 0;
  for (auto mode : {IpcTrainerOptions::Mode::kPacked, IpcTrainerOptions::Mode::kZeroCopy}) {
    bool zero_copy = mode == IpcTrainerOptions::Mode::kZeroCopy;
    SCOPED_TRACE(zero_copy ? "zero-copy" : "packed");
    auto engine = GpuTrainer(s, mode);
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    ASSERT_TRUE((*engine)->Init((*trainer)->metadata()).ok());
    for (int i = 0; i < 3; ++i) {
      auto st = (*engine)->SendWeights(**source, std::nullopt);
      ASSERT_TRUE(st.ok()) << st.status().ToString();
    }
    auto mem0 = IpcDeviceMemoryInfo(dev);
    ASSERT_TRUE(mem0.ok()) << mem0.status().ToString();
    int server_fds0 = OpenFds(s.process->pid()), own_fds0 = OpenFds(getpid());
    for (int i = 0; i < 100; ++i) {
      if (i % 25 == 0) {  // new weights now and then, so that the syncs move new bytes
        ASSERT_TRUE((*trainer)->Step(++step).ok());
        ASSERT_TRUE((*source)->Upload((*trainer)->tensors()).ok());
      }
      auto st = (*engine)->SendWeights(**source, std::nullopt);
      ASSERT_TRUE(st.ok()) << "sync " << i << ": " << st.status().ToString() << "\n" << s.process->Describe();
    }
    auto mem1 = IpcDeviceMemoryInfo(dev);
    ASSERT_TRUE(mem1.ok());
    int64_t lost = static_cast<int64_t>(mem0->first) - static_cast<int64_t>(mem1->first);
    EXPECT_LE(lost, int64_t{4} << 20) << "GPU memory lost over 100 syncs: " << lost << " bytes";
    EXPECT_EQ(OpenFds(s.process->pid()), server_fds0);
    EXPECT_EQ(OpenFds(getpid()), own_fds0);
    E2E_ASSERT_OK_AND_ASSIGN(Digests got, ServerChecksums(s.url, DigestAlgorithm::kXxh3_128));
    EXPECT_TRUE(DigestsEqual(DigestTensors((*trainer)->tensors(), DigestAlgorithm::kXxh3_128), got));

    if (zero_copy) {
      // A new allocation (perhaps at the old address): the trainer must export it again.
      source->reset();
      ASSERT_TRUE((*trainer)->Step(++step).ok());
      source = DeviceTensorSource::Create(dev, (*trainer)->metadata());
      ASSERT_TRUE(source.ok());
      ASSERT_TRUE((*source)->Upload((*trainer)->tensors()).ok());
      auto st = (*engine)->SendWeights(**source, std::nullopt);
      ASSERT_TRUE(st.ok()) << st.status().ToString() << "\n" << s.process->Describe();
      E2E_ASSERT_OK_AND_ASSIGN(Digests again, ServerChecksums(s.url, DigestAlgorithm::kXxh3_128));
      EXPECT_TRUE(DigestsEqual(DigestTensors((*trainer)->tensors(), DigestAlgorithm::kXxh3_128), again));
      EXPECT_NE(s.process->Stderr().find("generation 2"), std::string::npos) << s.process->Describe();
    }
    (*engine)->Shutdown();
  }
  ExpectCleanShutdown(s);
}

// A PyTorch trainer's flat buffer: a source that is no DeviceTensorSource offers a block
// 4 KiB into a cudaMalloc allocation (a tensor inside torch's caching allocator segment,
// exported through CUDA IPC), then into a cuMemCreate one (expandable segments, exported
// as cuda_fd), its tensors with gaps between them. The server maps the allocation and
// copies from the block's offset; mode zero_copy sends every sync as one go, mode auto
// packs its first sync (learning the layout) and then goes zero-copy; every sync verified.
TEST_F(GpuIpcTest, AFlatBufferInsideALargerAllocationSyncsZeroCopy) {
  NeedGpus(1);
  if (IsSkipped()) return;
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartGpuServer("flat_buffer"));
  const Device dev{Device::Kind::kCuda, 0};
  auto trainer = SyntheticTrainer::FromMetadata(HfTensors(*LookupModel("qwen3-tiny")), 52, 2);
  ASSERT_TRUE(trainer.ok()) << trainer.status().ToString();
  uint64_t step = 0;
  for (DeviceAllocator allocator : {DeviceAllocator::kRuntime, DeviceAllocator::kVirtualMemory}) {
    for (auto mode : {IpcTrainerOptions::Mode::kZeroCopy, IpcTrainerOptions::Mode::kAuto}) {
      bool auto_mode = mode == IpcTrainerOptions::Mode::kAuto;
      SCOPED_TRACE(fmt::format("{}, {}", allocator == DeviceAllocator::kRuntime ? "cudaMalloc" : "cuMemCreate",
                               auto_mode ? "auto" : "zero_copy"));
      testing::FlatBufferSource::Options fo;
      fo.allocator = allocator;
      E2E_ASSERT_OK_AND_ASSIGN(std::unique_ptr<testing::FlatBufferSource> source,
                               testing::FlatBufferSource::Create(dev, (*trainer)->metadata(), fo));
      auto engine = GpuTrainer(s, mode);
      ASSERT_TRUE(engine.ok()) << engine.status().ToString();
      ASSERT_TRUE((*engine)->Init((*trainer)->metadata()).ok());
      for (int i = 0; i < 3; ++i) {
        ASSERT_TRUE((*trainer)->Step(++step).ok());
        ASSERT_TRUE(source->Upload((*trainer)->tensors()).ok());
        auto st = (*engine)->SendWeights(*source, std::nullopt);
        ASSERT_TRUE(st.ok()) << st.status().ToString() << "\n" << s.process->Describe();
        if (auto_mode && i == 0) {
          EXPECT_GT(st->chunks, 1u);
        } else {
          EXPECT_EQ(st->chunks, 1u);
        }
        E2E_ASSERT_OK_AND_ASSIGN(Digests got, ServerChecksums(s.url, DigestAlgorithm::kXxh3_128));
        EXPECT_TRUE(DigestsEqual(DigestTensors((*trainer)->tensors(), DigestAlgorithm::kXxh3_128), got));
      }
      (*engine)->Shutdown();
    }
  }
  ExpectCleanShutdown(s);
}

// A trainer SIGKILLed in the middle of a packed GPU sync: the server ends the update at
// once, releases the dead trainer's GPU mappings, and takes the next session, whose syncs
// verify (in both modes).
TEST_F(GpuIpcTest, ATrainerKilledMidSyncLeavesTheServerReadyForTheNextSession) {
  NeedGpus(1);
  if (IsSkipped()) return;
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartGpuServer("gpu"));
  E2E_ASSERT_OK_AND_ASSIGN(
      Subprocess * trainer,
      SpawnWsync("stalled_push",
                 {"push", "--servers", s.url, "--backend", "ipc", "--model", "qwen3-tiny", "--seed", "1", "--steps",
                  "2", "--bucket-gb", "0.001", "--device", "cuda:0", "--timeout", "60", "--backend-option",
                  "stall_after_chunks=3", "--backend-option", "mode=packed"}));
  auto stalled = [&] { return trainer->Stderr().find("stalled after 3 chunk(s)") != std::string::npos; };
  for (int i = 0; i < 600 && !stalled(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ASSERT_TRUE(stalled()) << trainer->Describe();
  trainer->Signal(SIGKILL);
  ASSERT_TRUE(trainer->Wait(Deadline::InSeconds(10)).has_value());
  bool ended = false;
  for (int i = 0; i < 100 && !ended; ++i) {
    ended = s.process->Stderr().find("exited during the sync") != std::string::npos;
    if (!ended) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_TRUE(ended) << s.process->Describe();
  EXPECT_EQ(HttpGet(s.url, "/health").status, 200);

  for (const char* mode : {"packed", "zero_copy"}) {
    SCOPED_TRACE(mode);
    RunResult push = PushIpc(fmt::format("push_{}", mode), s,
                             {"--model", "qwen3-tiny", "--seed", "6", "--steps", "2", "--verify", "--bucket-gb",
                              "0.001", "--device", "cuda:0", "--timeout", "60"},
                             {{"mode", mode}});
    ASSERT_TRUE(push.success()) << push.description << "\n--- server ---\n" << s.process->Describe();
    EXPECT_TRUE(HasVerifiedTable(push.out, 3)) << push.out;
  }
  E2E_ASSERT_OK_AND_ASSIGN(Digests want, ExpectedSyntheticDigests("qwen3-tiny", 6, 2, DigestAlgorithm::kXxh3_128));
  ExpectServersHold({s}, want, DigestAlgorithm::kXxh3_128);
  ExpectCleanShutdown(s);
}

// Init payloads a GPU server must refuse with a 400 naming the problem: no entry for its
// GPU's UUID, and handles that do not open. The server keeps serving afterwards.
TEST_F(GpuIpcTest, MissingUuidAndBadHandlesAreClearErrorsAndTheServerKeepsServing) {
  NeedGpus(1);
  if (IsSkipped()) return;
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartGpuServer("gpu"));
  E2E_ASSERT_OK_AND_ASSIGN(std::string uuid, cuda::GpuUuid(0));
  IpcRegionOptions ro;
  ro.session = NewSessionId();
  ro.slot_bytes = 1 << 20;
  ro.reader_count = 1;
  ro.slots_in_region = false;
  auto region = IpcRegion::Create(ro);
  ASSERT_TRUE(region.ok()) << region.status().ToString();
  json init = {{"wsync_ipc_protocol", kIpcProtocolVersion},
               {"packed", true},
               {"session", (*region)->session()},
               {"control_path", (*region)->path()},
               {"control_bytes", (*region)->bytes()},
               {"num_slots", (*region)->num_slots()},
               {"slot_bytes", (*region)->slot_bytes()},
               {"reader_offset", 0},
               {"reader_count", 1}};
  const std::string other = "GPU-00000000-0000-0000-0000-000000000000";
  auto with = [&](const std::string& key, json buffer) {
    json j = init;
    j["buffers"] = {{key, buffer}};
    return json{{"init_info", j}};
  };
  json slots = {{"kind", "cuda_ipc"}, {"offset", 0}, {"stride", (*region)->slot_stride()}};

  json missing = slots;
  missing["handle"] = {{"handle_b64", std::string(86, 'A') + "=="}};
  EXPECT_TRUE(IsError(HttpPostJson(s.url, "/init_weight_transfer_engine", with(other, missing)), 400,
                      {"no entry for this server's device", uuid, other}));

  json zeros = slots;  // a well-formed handle that names no allocation
  zeros["handle"] = {{"handle_b64", std::string(86, 'A') + "=="}};
  EXPECT_TRUE(IsError(HttpPostJson(s.url, "/init_weight_transfer_engine", with(uuid, zeros)), 400,
                      {"cannot open the cuda_ipc handle", uuid}));
  json garbage = slots;
  garbage["handle"] = {{"handle_b64", "not base64"}};
  EXPECT_TRUE(IsError(HttpPostJson(s.url, "/init_weight_transfer_engine", with(uuid, garbage)), 400,
                      {"handle_b64"}));
  json no_handle = slots;
  EXPECT_TRUE(IsError(HttpPostJson(s.url, "/init_weight_transfer_engine", with(uuid, no_handle)), 400,
                      {"handle_b64"}));
  // A cuda_fd handle of a process that has exited.
  E2E_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Subprocess> exited, Subprocess::Fork([] { return 0; }));
  ASSERT_TRUE(exited->Wait(Deadline::InSeconds(30)).has_value());
  pid_t gone = exited->pid();
  json fd = {{"kind", "cuda_fd"}, {"offset", 0}, {"stride", (*region)->slot_stride()},
             {"handle", {{"pid", gone}, {"fd", 3}, {"bytes", (*region)->slot_stride() * 2}}}};
  EXPECT_TRUE(IsError(HttpPostJson(s.url, "/init_weight_transfer_engine", with(uuid, fd)), 400,
                      {"cannot open the cuda_fd handle", "pidfd_open"}));

  // A zero-copy-only session (kind none): a packed update is refused, and so is a
  // zero-copy update naming a generation the server never mapped without its handle.
  ASSERT_EQ(HttpPostJson(s.url, "/init_weight_transfer_engine",
                         with(uuid, {{"kind", "none"}, {"offset", 0}, {"stride", 0}})).status, 200);
  json update = {{"names", {"model.norm.weight"}},
                 {"dtype_names", {"bfloat16"}},
                 {"shapes", {{256}}},  // qwen3-tiny's hidden size
                 {"tensor_sizes", {512}},
                 {"tensor_offsets", {0}},
                 {"chunk_ends", {1}},
                 {"wsync_ipc_protocol", kIpcProtocolVersion},
                 {"session", (*region)->session()}};
  (*region)->Announce(1, 1);
  ASSERT_EQ(HttpPostJson(s.url, "/start_weight_update", json::object()).status, 200);
  EXPECT_TRUE(IsError(HttpPostJson(s.url, "/update_weights", json{{"update_info", update}}), 400,
                      {"no staging slots", uuid}));
  update["zero_copy"] = {{"generation", 5}, {"bytes", 4096}};
  ASSERT_EQ(HttpPostJson(s.url, "/start_weight_update", json::object()).status, 200);
  EXPECT_TRUE(IsError(HttpPostJson(s.url, "/update_weights", json{{"update_info", update}}), 409,
                      {"generation 5", "no handle"}));
  update["zero_copy"]["buffers"] = {{uuid, zeros}};  // a handle that does not open
  update["zero_copy"]["buffers"][uuid]["stride"] = 0;
  ASSERT_EQ(HttpPostJson(s.url, "/start_weight_update", json::object()).status, 200);
  EXPECT_TRUE(IsError(HttpPostJson(s.url, "/update_weights", json{{"update_info", update}}), 400,
                      {"zero_copy buffers", "cannot open the cuda_ipc handle"}));
  (void)HttpPostJson(s.url, "/finish_weight_update", json::object());
  region->reset();
  EXPECT_EQ(HttpGet(s.url, "/health").status, 200);

  RunResult push = PushIpc("push", s, {"--model", "qwen3-tiny", "--seed", "61", "--steps", "1", "--device",
                                       "cuda:0", "--verify", "--timeout", "60"});
  ASSERT_TRUE(push.success()) << push.description << "\n--- server ---\n" << s.process->Describe();
  E2E_ASSERT_OK_AND_ASSIGN(Digests want, ExpectedSyntheticDigests("qwen3-tiny", 61, 1, DigestAlgorithm::kXxh3_128));
  ExpectServersHold({s}, want, DigestAlgorithm::kXxh3_128);
  ExpectCleanShutdown(s);
}

// A TP=2 server on cuda:0 and cuda:1 with the trainer's staging only on cuda:0: the
// worker on cuda:1 finds no entry for its GPU, and init says so.
TEST_F(GpuIpcTest, AWorkerOnAGpuTheTrainerDidNotExportForIsA400NamingItsUuid) {
  NeedGpus(2);
  if (IsSkipped()) return;
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartGpuServer("tp2", 2));
  E2E_ASSERT_OK_AND_ASSIGN(std::string uuid1, cuda::GpuUuid(1));
  RunResult push = PushIpc("push", s, {"--model", "qwen3-tiny", "--seed", "62", "--device", "cuda:0",
                                       "--timeout", "60"}, {{"mode", "packed"}});
  EXPECT_FALSE(push.success()) << push.description;
  EXPECT_NE(push.err.find(uuid1), std::string::npos) << push.description;
  EXPECT_NE(push.err.find("no entry for this server's device"), std::string::npos) << push.description;
  EXPECT_EQ(HttpGet(s.url, "/health").status, 200);
}

// Two trainer ranks on cuda:0 and cuda:1: threads here, a Gloo group between them, each
// with a DeviceTensorSource on its own GPU and an ipc engine sending to one server.
// Rank `rank` of a two-rank trainer group: its Gloo communicator through the store at
// `store_port`, and its ipc engine on cuda:RANK sending to `url` (several chunks per
// packed sync).
Result<std::shared_ptr<Communicator>> JoinTwoRanks(int store_port, const std::string& prefix, int rank) {
  GlooOptions o;
  o.store_port = store_port;
  o.prefix = prefix;
  o.rank = rank;
  o.size = 2;
  WSYNC_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> c, ConnectGloo(o));
  return std::shared_ptr<Communicator>(std::move(c));
}
Result<std::unique_ptr<TrainerEngine>> RankEngine(const std::string& url, int rank, std::shared_ptr<Communicator> comm,
                                                  const IpcTrainerOptions& ipc) {
  TrainerOptions t;
  t.backend = "ipc";
  t.servers = {url};
  t.device = Device{Device::Kind::kCuda, rank};
  t.rank = rank;
  t.comm = std::move(comm);
  t.bucket_gb = 1.0 / 1024;
  t.timeout_seconds = 60;
  return CreateIpcTrainerWith(t, ipc);
}

struct TwoGpuRanks {
  std::unique_ptr<StoreServer> store;
  std::vector<std::shared_ptr<Communicator>> comms{2};
  std::vector<std::unique_ptr<DeviceTensorSource>> sources{2};
  std::vector<std::unique_ptr<TrainerEngine>> engines{2};

  // fn(rank) on both ranks at once (their Init and SendWeights are collectives).
  template <typename Fn>
  static std::vector<Status> OnRanks(Fn fn) {
    std::vector<Status> out(2);
    std::thread other([&] { out[1] = fn(1); });
    out[0] = fn(0);
    other.join();
    return out;
  }

  static Result<std::unique_ptr<TwoGpuRanks>> Start(const std::string& url, const std::vector<TensorMeta>& meta,
                                                    const IpcTrainerOptions& ipc) {
    auto g = std::make_unique<TwoGpuRanks>();
    WSYNC_ASSIGN_OR_RETURN(g->store, StoreServer::Start("127.0.0.1", 0));
    const std::string prefix = "ipc-ranks-" + NewSessionId();
    for (const Status& st : OnRanks([&](int r) -> Status {
           WSYNC_ASSIGN_OR_RETURN(g->comms[r], JoinTwoRanks(g->store->port(), prefix, r));
           WSYNC_ASSIGN_OR_RETURN(g->sources[r], DeviceTensorSource::Create(Device{Device::Kind::kCuda, r}, meta));
           WSYNC_ASSIGN_OR_RETURN(g->engines[r], RankEngine(url, r, g->comms[r], ipc));
           return Status::Ok();
         })) {
      WSYNC_RETURN_IF_ERROR(st);
    }
    return g;
  }
  std::vector<Status> Init(const std::vector<TensorMeta>& meta) {
    return OnRanks([&](int r) { return engines[r]->Init(meta); });
  }
};

// Two trainer ranks, each packing into slots on its own GPU, and a TP=2 server whose
// workers sit on those GPUs: each worker reads its own GPU's slots (before, the worker on
// cuda:1 had none), sync after sync. Then rank 1's source breaks in the middle of a sync:
// both ranks fail at once naming it, and the next session of both verifies.
TEST_F(GpuIpcTest, TwoTrainerRanksEachExportTheirGpusSlotsToATp2Server) {
  NeedGpus(2);
  if (IsSkipped()) return;
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartGpuServer("tp2", 2));
  auto trainer = SyntheticTrainer::FromMetadata(HfTensors(*LookupModel("qwen3-tiny")), 71, 2);
  ASSERT_TRUE(trainer.ok()) << trainer.status().ToString();
  E2E_ASSERT_OK_AND_ASSIGN(std::unique_ptr<TwoGpuRanks> g, TwoGpuRanks::Start(s.url, (*trainer)->metadata(), {}));
  testing::FaultySource rank1(g->sources[1].get());  // no storage(): the ranks pack
  auto sync = [&](uint64_t step) {
    EXPECT_TRUE((*trainer)->Step(step).ok());
    for (auto& src : g->sources) EXPECT_TRUE(src->Upload((*trainer)->tensors()).ok());
    return TwoGpuRanks::OnRanks([&](int r) {
      WeightSource& src = r == 1 ? static_cast<WeightSource&>(rank1) : *g->sources[r];
      return g->engines[r]->SendWeights(src, std::nullopt).status();
    });
  };
  auto holds = [&] {
    E2E_ASSERT_OK_AND_ASSIGN(Digests got, ServerChecksums(s.url, DigestAlgorithm::kXxh3_128));
    EXPECT_TRUE(DigestsEqual(DigestTensors((*trainer)->tensors(), DigestAlgorithm::kXxh3_128), got));
  };
  for (const Status& st : g->Init((*trainer)->metadata())) {
    ASSERT_TRUE(st.ok()) << st.ToString() << "\n" << s.process->Describe();
  }
  for (uint64_t step = 1; step <= 5; ++step) {
    for (const Status& st : sync(step)) ASSERT_TRUE(st.ok()) << st.ToString() << "\n" << s.process->Describe();
    holds();
  }
  // Sync 6: rank 1's transfer pass (its 12th pass) breaks at tensor 7, after it has
  // published some chunks on cuda:1.
  rank1.options().fail_pass = 12;
  rank1.options().fail_at = 7;
  auto t0 = std::chrono::steady_clock::now();
  std::vector<Status> failed = sync(6);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 20.0);
  for (const Status& st : failed) {
    EXPECT_FALSE(st.ok());
    EXPECT_NE(st.message().find("injected"), std::string::npos) << st.ToString();
  }
  EXPECT_EQ(HttpGet(s.url, "/health").status, 200);
  // The next session of both ranks verifies.
  for (const Status& st : g->Init((*trainer)->metadata())) {
    ASSERT_TRUE(st.ok()) << st.ToString() << "\n" << s.process->Describe();
  }
  for (uint64_t step = 7; step <= 8; ++step) {
    for (const Status& st : sync(step)) ASSERT_TRUE(st.ok()) << st.ToString() << "\n" << s.process->Describe();
    holds();
  }
  g->engines.clear();
  EXPECT_EQ(HttpGet(s.url, "/health").status, 200);
  ExpectCleanShutdown(s);
}

// Zero-copy with two ranks: each rank exports its own GPU's tensors (rank 0 sends the
// merged map, each rank publishes the go for its GPU's workers), so the TP=2 server's
// worker on cuda:1 copies from rank 1's tensors on cuda:1. Then rank 1 alone moves its
// tensors to a cuMem allocation (exported as cuda_fd): a new generation, still verified.
TEST_F(GpuIpcTest, TwoTrainerRanksEachSendTheirOwnTensorsZeroCopy) {
  NeedGpus(2);
  if (IsSkipped()) return;
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartGpuServer("tp2_zero_copy", 2));
  auto trainer = SyntheticTrainer::FromMetadata(HfTensors(*LookupModel("qwen3-tiny")), 72, 2);
  ASSERT_TRUE(trainer.ok()) << trainer.status().ToString();
  IpcTrainerOptions ipc;
  ipc.mode = IpcTrainerOptions::Mode::kZeroCopy;  // no slots anywhere: a packed sync could not pass
  E2E_ASSERT_OK_AND_ASSIGN(std::unique_ptr<TwoGpuRanks> g, TwoGpuRanks::Start(s.url, (*trainer)->metadata(), ipc));
  for (const Status& st : g->Init((*trainer)->metadata())) {
    ASSERT_TRUE(st.ok()) << st.ToString() << "\n" << s.process->Describe();
  }
  auto sync = [&](uint64_t step) {
    EXPECT_TRUE((*trainer)->Step(step).ok());
    for (auto& src : g->sources) EXPECT_TRUE(src->Upload((*trainer)->tensors()).ok());
    std::vector<uint64_t> chunks(2);
    for (const Status& st : TwoGpuRanks::OnRanks([&](int r) -> Status {
           WSYNC_ASSIGN_OR_RETURN(SyncStats stats, g->engines[r]->SendWeights(*g->sources[r], std::nullopt));
           chunks[r] = stats.chunks;
           return Status::Ok();
         })) {
      EXPECT_TRUE(st.ok()) << st.ToString() << "\n" << s.process->Describe();
    }
    EXPECT_EQ(chunks, (std::vector<uint64_t>{1, 1}));  // one go on each GPU
    E2E_ASSERT_OK_AND_ASSIGN(Digests got, ServerChecksums(s.url, DigestAlgorithm::kXxh3_128));
    EXPECT_TRUE(DigestsEqual(DigestTensors((*trainer)->tensors(), DigestAlgorithm::kXxh3_128), got));
  };
  for (uint64_t step = 1; step <= 5; ++step) sync(step);
  auto moved = DeviceTensorSource::Create(Device{Device::Kind::kCuda, 1}, (*trainer)->metadata(),
                                          DeviceAllocator::kVirtualMemory);
  ASSERT_TRUE(moved.ok()) << moved.status().ToString();
  g->sources[1] = std::move(*moved);
  for (uint64_t step = 6; step <= 8; ++step) sync(step);
  g->engines.clear();
  EXPECT_EQ(HttpGet(s.url, "/health").status, 200);
  ExpectCleanShutdown(s);
}

// ---- trainer ranks as separate processes ---------------------------------------------

// The script both processes of TwoTrainerRankProcessesEachSendFromTheirOwnGpu run, rank 0
// in the test and rank 1 in a child process: the same synthetic steps (same seed), a
// DeviceTensorSource on cuda:RANK (rank 1's from cuMem, so its exports are cuda_fd handles
// that name rank 1's own pid), one session in auto mode (its first sync packs, then
// zero-copy: each rank's go for its GPU's worker) and one packed with cuda_fd slots. `after_sync` runs after each sync.
Status RunRankScript(int rank, const json& orders, const std::function<Status(uint64_t, const SyntheticTrainer&)>& after_sync) {
  cuda::InstallDeviceRuntime();
  WSYNC_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> shared,
                         JoinTwoRanks(orders["store_port"].get<int>(), orders["prefix"].get<std::string>(), rank));
  WSYNC_ASSIGN_OR_RETURN(auto trainer, SyntheticTrainer::FromMetadata(HfTensors(*LookupModel("qwen3-tiny")), 73, 2));
  const Device dev{Device::Kind::kCuda, rank};
  uint64_t step = 0;
  for (auto mode : {IpcTrainerOptions::Mode::kAuto, IpcTrainerOptions::Mode::kPacked}) {
    WSYNC_ASSIGN_OR_RETURN(auto source,
                           DeviceTensorSource::Create(dev, trainer->metadata(),
                                                      rank == 1 ? DeviceAllocator::kVirtualMemory : DeviceAllocator::kRuntime));
    IpcTrainerOptions ipc;
    ipc.mode = mode;
    ipc.export_kind = "cuda_fd";
    WSYNC_ASSIGN_OR_RETURN(auto engine, RankEngine(orders["url"].get<std::string>(), rank, shared, ipc));
    WSYNC_RETURN_IF_ERROR(engine->Init(trainer->metadata()));
    for (int i = 0; i < 3; ++i) {
      WSYNC_RETURN_IF_ERROR(trainer->Step(++step).status());
      WSYNC_RETURN_IF_ERROR(source->Upload(trainer->tensors()));
      WSYNC_ASSIGN_OR_RETURN(SyncStats stats, engine->SendWeights(*source, std::nullopt));
      // Auto: the first sync packs, its pass showing where the tensors lie in the storage.
      bool zero_copy = mode == IpcTrainerOptions::Mode::kAuto && i > 0;
      if (zero_copy ? stats.chunks != 1 : stats.chunks < 3) {
        return Internal(fmt::format("rank {} sync {} sent {} chunk(s) in {} mode", rank, step, stats.chunks,
                                    zero_copy ? "zero-copy" : "packed"));
      }
      WSYNC_RETURN_IF_ERROR(after_sync(step, *trainer));
    }
  }
  return Status::Ok();
}

// Not a test of its own: the trainer rank 1 process that
// GpuIpcTest.TwoTrainerRankProcessesEachSendFromTheirOwnGpu spawns (this binary, filtered
// to this test, with WSYNC_IPC_RANK1_ORDERS set). Skipped in every other run.
TEST(GpuIpcRankProcess, RankOne) {
  const char* orders = std::getenv("WSYNC_IPC_RANK1_ORDERS");
  if (orders == nullptr) GTEST_SKIP() << "runs only as rank 1 of GpuIpcTest.TwoTrainerRankProcessesEachSendFromTheirOwnGpu";
  Status s = RunRankScript(1, json::parse(orders), [](uint64_t, const SyntheticTrainer&) { return Status::Ok(); });
  ASSERT_TRUE(s.ok()) << s.ToString();
}

// Trainer ranks as separate processes (as a real trainer's are): rank 0 here, rank 1 a
// child process on cuda:1. Each exports its own memory from its own pid (cuda_fd), the TP=2
// server's workers map each rank's, and every sync verifies, zero-copy then packed.
TEST_F(GpuIpcTest, TwoTrainerRankProcessesEachSendFromTheirOwnGpu) {
  NeedGpus(2);
  if (IsSkipped()) return;
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartGpuServer("tp2_processes", 2));
  E2E_ASSERT_OK_AND_ASSIGN(std::unique_ptr<StoreServer> store, StoreServer::Start("127.0.0.1", 0));
  json orders = {{"url", s.url}, {"store_port", store->port()}, {"prefix", "ipc-processes-" + NewSessionId()}};
  SpawnOptions o;
  o.args = {"--gtest_filter=GpuIpcRankProcess.RankOne"};
  o.stdout_path = dir() / "rank1.stdout";
  o.stderr_path = dir() / "rank1.stderr";
  o.env = {{"WSYNC_IPC_RANK1_ORDERS", orders.dump()}};
  o.unset_env = {"WSYNC_API_KEY"};
  E2E_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Subprocess> rank1,
                           Subprocess::Spawn(std::filesystem::read_symlink("/proc/self/exe"), o));
  int verified = 0;
  Status mine = RunRankScript(0, orders, [&](uint64_t, const SyntheticTrainer& trainer) -> Status {
    // Rank 0's sync returns once every server answered: the worker on cuda:1 has landed
    // rank 1's go or chunks too.
    WSYNC_ASSIGN_OR_RETURN(Digests got, ServerChecksums(s.url, DigestAlgorithm::kXxh3_128));
    if (auto same = DigestsEqual(DigestTensors(trainer.tensors(), DigestAlgorithm::kXxh3_128), got); !same) {
      return DataLoss(fmt::format("the server's checksums differ from the trainer's: {}", same.message()));
    }
    ++verified;
    return Status::Ok();
  });
  std::optional<ExitStatus> exit = rank1->Wait(Deadline::InSeconds(60));
  ASSERT_TRUE(mine.ok()) << mine.ToString() << "\n--- rank 1 ---\n" << rank1->Describe() << "\n--- server ---\n"
                         << s.process->Describe();
  ASSERT_TRUE(exit.has_value() && exit->success()) << rank1->Describe();
  EXPECT_EQ(verified, 6);
  EXPECT_EQ(HttpGet(s.url, "/health").status, 200);
  ExpectCleanShutdown(s);
}

}  // namespace
}  // namespace wsync::e2e
