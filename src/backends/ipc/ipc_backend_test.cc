// The `ipc` backend end to end inside one process: real HTTP servers on loopback, real
// shared-memory regions (each side maps its own view, as separate processes do), a
// trainer engine, and checksums read back from the servers' shards. A hand-made region
// plays the trainer where a test needs to misbehave on purpose.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <future>
#include <thread>

#include "backends/ipc/receiver.h"
#include "backends/ipc/region.h"
#include "backends/ipc/region_testing.h"
#include "backends/ipc/trainer.h"
#include "control/session_driver.h"
#include "control/http_server.h"
#include "core/digest.h"
#include "model/config.h"
#include "server/inference_server.h"
#include "synthetic/synthetic.h"
#include "testing/faulty_source.h"
#include "testing/test_server.h"

namespace wsync {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

using testing::ExpectServerHolds;
using testing::FaultySource;
using Server = testing::TestServer;

// `shm_dir`: the directory `wsync serve --ipc-shm-dir` would allow POSIX shm regions in.
Server StartServer(const std::string& model, int tp, int dp = 1, int dp_rank = -1, const std::string& shm_dir = "") {
  InferenceServerOptions o;
  if (!shm_dir.empty()) o.backend_config["ipc_shm_dir"] = shm_dir;
  o.model = model;
  o.tp = tp;
  o.dp = dp;
  o.dp_rank = dp_rank;
  o.backend = "ipc";
  o.timeout_seconds = 20;
  auto made = Server::Start(o, [](std::string_view, ReceiverContext* c) { return CreateIpcReceiver(c); });
  EXPECT_TRUE(made.ok()) << made.status().ToString();
  return std::move(*made);
}

class IpcBackend : public ::testing::Test {
 protected:
  std::unique_ptr<SyntheticTrainer> Trainer(const std::string& model, uint64_t seed) {
    return std::move(*SyntheticTrainer::FromMetadata(HfTensors(*LookupModel(model)), seed, 2));
  }
  TrainerOptions Options(const std::vector<Server*>& servers) {
    TrainerOptions o;
    o.backend = "ipc";
    for (Server* s : servers) o.servers.push_back(s->url());
    o.timeout_seconds = 20;
    return o;
  }
};

TEST_F(IpcBackend, Tp1AndTp2ServersMatchTheTrainerOverSeveralStepsWithManyChunks) {
  for (ShmBacking backing : {ShmBacking::kMemfd, ShmBacking::kPosixShm}) {
    for (const char* model : {"qwen3-tiny", "qwen3-moe-tiny"}) {
      SCOPED_TRACE(model);
      auto trainer = Trainer(model, 5);
      std::string shm_dir = backing == ShmBacking::kPosixShm ? "/dev/shm" : "";
      Server a = StartServer(model, 1, 1, -1, shm_dir);
      Server b = StartServer(model, 2, 1, -1, shm_dir);
      TrainerOptions o = Options({&a, &b});
      o.bucket_gb = 1.0 / 1024;  // 1 MiB: many chunks through a 2-slot ring
      IpcTrainerOptions ipc;
      ipc.backing = backing;
      auto engine = *CreateIpcTrainerWith(o, ipc);
      ASSERT_TRUE(engine->Init(trainer->metadata()).ok());
      for (int step = 0; step <= 2; ++step) {
        if (step > 0) {
          ASSERT_TRUE(trainer->Step(step).ok());
        }
        auto stats = engine->SendWeights(trainer->source(), "v" + std::to_string(step));
        ASSERT_TRUE(stats.ok()) << stats.status().ToString();
        EXPECT_GE(stats->chunks, 3u);
        ExpectServerHolds(*a.service, trainer->source());
        ExpectServerHolds(*b.service, trainer->source());
      }
      EXPECT_EQ(a.service->WeightVersion(), "v2");
      EXPECT_EQ(b.service->Health()["syncs"], 3);
    }
  }
}

TEST_F(IpcBackend, OneServerHostingTp2Dp2AndExternalLbDpServersShareOneReaderNumbering) {
  auto trainer = Trainer("qwen3-tiny", 8);
  Server both = StartServer("qwen3-tiny", 2, 2);
  Server rank0 = StartServer("qwen3-tiny", 2, 2, 0);
  Server rank1 = StartServer("qwen3-tiny", 2, 2, 1);
  // Deployments of one server each cannot place the external-LB ranks: init says which
  // reader nobody took instead of leaving the first sync waiting for it.
  TrainerOptions o = Options({&rank0, &rank1});
  auto wrong = *CreateIpcTrainer(o);
  Status s = wrong->Init(trainer->metadata());
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_NE(s.message().find("no server took reader"), std::string::npos) << s.message();
  wrong.reset();

  o = Options({&rank0, &rank1});
  o.data_parallel_size = 2;
  auto lb = *CreateIpcTrainer(o);
  ASSERT_TRUE(lb->Init(trainer->metadata()).ok());
  ASSERT_TRUE(lb->SendWeights(trainer->source(), std::nullopt).ok());
  ExpectServerHolds(*rank0.service, trainer->source());
  ExpectServerHolds(*rank1.service, trainer->source());
  lb.reset();
  auto one = *CreateIpcTrainer(Options({&both}));
  ASSERT_TRUE(one->Init(trainer->metadata()).ok());
  ASSERT_TRUE(one->SendWeights(trainer->source(), std::nullopt).ok());
  ExpectServerHolds(*both.service, trainer->source());
}

TEST_F(IpcBackend, LyingSourceFailsBeforeAnythingIsSentAndTheSessionSurvives) {
  auto trainer = Trainer("qwen3-tiny", 1);
  Server a = StartServer("qwen3-tiny", 1);
  auto engine = *CreateIpcTrainer(Options({&a}));
  ASSERT_TRUE(engine->Init(trainer->metadata()).ok());
  FaultySource liar(&trainer->source(), {.lie_shape_at = 3});
  auto r = engine->SendWeights(liar, std::nullopt);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find(trainer->metadata()[3].name), std::string::npos) << r.status().message();
  EXPECT_EQ(a.service->Health()["syncs"], 0);
  ASSERT_TRUE(engine->SendWeights(trainer->source(), std::nullopt).ok());
  ExpectServerHolds(*a.service, trainer->source());
}

TEST_F(IpcBackend, ARejectingServerStopsTheSyncAtOnceAndTheNextInitWorks) {
  auto trainer = Trainer("qwen3-tiny", 2);
  Server a = StartServer("qwen3-tiny", 2);
  Server b = StartServer("qwen3-moe-tiny", 1);  // rejects the tensor list with a 400
  auto engine = *CreateIpcTrainer(Options({&a, &b}));
  ASSERT_TRUE(engine->Init(trainer->metadata()).ok());
  auto t0 = Clock::now();
  auto r = engine->SendWeights(trainer->source(), std::nullopt);
  ASSERT_FALSE(r.ok());
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(10));
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
  EXPECT_NE(r.status().message().find(b.url()), std::string::npos) << r.status().message();
  // The failed sync ended the engine's session and closed both servers' sessions: the
  // next sync initializes a new one by itself and meets the same refusal (not a 409).
  auto again = engine->SendWeights(trainer->source(), std::nullopt);
  EXPECT_EQ(again.status().code(), StatusCode::kInvalidArgument) << again.status().ToString();
  EXPECT_NE(again.status().message().find(b.url()), std::string::npos) << again.status().message();
  engine.reset();
  auto alone = *CreateIpcTrainer(Options({&a}));
  ASSERT_TRUE(alone->Init(trainer->metadata()).ok());
  ASSERT_TRUE(alone->SendWeights(trainer->source(), std::nullopt).ok());
  ExpectServerHolds(*a.service, trainer->source());
  EXPECT_EQ(a.service->Health()["weights_consistent"], true);
}

TEST_F(IpcBackend, NonSenderRankDrainsItsSourceAndSendsNothing) {
  auto trainer = Trainer("qwen3-tiny", 3);
  TrainerOptions o;
  o.backend = "ipc";
  o.rank = 1;
  auto engine = *CreateIpcTrainer(o);
  ASSERT_TRUE(engine->Init(trainer->metadata()).ok());
  auto stats = engine->SendWeights(trainer->source(), std::nullopt);
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  EXPECT_EQ(stats->bytes, 0u);
  EXPECT_EQ(stats->tensors, trainer->metadata().size());
}

// A hand-made trainer side: its own region, init_info and update_info.
struct FakeTrainer {
  std::unique_ptr<IpcRegion> region;
  IpcInitInfo info;

  static FakeTrainer Make(int readers, uint64_t slot_bytes, ShmBacking backing = ShmBacking::kMemfd) {
    FakeTrainer f;
    IpcRegionOptions o;
    o.backing = backing;
    o.session = NewSessionId();
    o.reader_count = readers;
    o.slot_bytes = slot_bytes;
    f.region = std::move(*IpcRegion::Create(o));
    f.info.session = f.region->session();
    f.info.control_path = f.region->path();
    f.info.control_bytes = f.region->bytes();
    f.info.num_slots = f.region->num_slots();
    f.info.slot_bytes = f.region->slot_bytes();
    f.info.reader_count = readers;
    f.info.buffers[HostDeviceKey()] = f.region->ShmBuffer();
    f.region->Announce(1, 1);  // every update of the fake is sync 1, from chunk seq 1
    return f;
  }
  json Update(const std::vector<TensorMeta>& ts, uint64_t slot_bytes_for_plan) const {
    IpcPlan plan = *PlanIpcChunks(ts, slot_bytes_for_plan);
    json u = {{"names", json::array()}, {"dtype_names", json::array()}, {"shapes", json::array()}};
    IpcUpdateInfo ipc;
    ipc.session = info.session;
    for (const auto& t : ts) {
      u["names"].push_back(t.name);
      u["dtype_names"].push_back(TorchName(t.dtype));
      u["shapes"].push_back(t.shape);
      ipc.tensor_sizes.push_back(t.nbytes());
    }
    ipc.tensor_offsets = plan.tensor_offsets;
    ipc.chunk_ends = plan.chunk_ends;
    ipc.AddTo(&u);
    return u;
  }
};

TEST_F(IpcBackend, BadInputIsAClearErrorAndTheServerKeepsServing) {
  auto trainer = Trainer("qwen3-tiny", 4);
  Server a = StartServer("qwen3-tiny", 2);
  InferenceServer& s = *a.service;
  const auto& meta = trainer->metadata();

  EXPECT_EQ(s.FinishWeightUpdate(std::nullopt).code(), StatusCode::kFailedPrecondition);  // finish without start
  ASSERT_TRUE(s.StartWeightUpdate().ok());
  FakeTrainer fake = FakeTrainer::Make(2, 4 << 20);
  Status st = s.UpdateWeights(fake.Update(meta, 4 << 20));  // update before any init
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.ToString();
  EXPECT_NE(st.message().find("call init_weight_transfer_engine"), std::string::npos) << st.message();

  IpcInitInfo bad = fake.info;
  bad.control_path = "/dev/shm/wsync-ipc-does-not-exist";
  st = s.InitWeightTransfer(bad.ToJson(), "");
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_NE(st.message().find("is not a wsync ipc region this server may open"), std::string::npos) << st.message();
  bad = fake.info;
  bad.control_path = "/etc/hostname";
  EXPECT_EQ(s.InitWeightTransfer(bad.ToJson(), "").code(), StatusCode::kInvalidArgument);
  bad = fake.info;
  bad.buffers.clear();
  bad.buffers["GPU-00000000-1111-2222-3333-444444444444"] = fake.region->ShmBuffer();
  st = s.InitWeightTransfer(bad.ToJson(), "");
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("no entry for this server's device " + HostDeviceKey()), std::string::npos) << st.message();
  bad = fake.info;
  bad.reader_count = 1;  // TP=2 needs two readers
  EXPECT_EQ(s.InitWeightTransfer(bad.ToJson(), "").code(), StatusCode::kInvalidArgument);
  st = s.InitWeightTransfer(json{{"packed", true}}, "");  // vLLM's own ipc init_info
  EXPECT_NE(st.message().find("wsync_ipc_protocol"), std::string::npos) << st.message();

  ASSERT_TRUE(s.InitWeightTransfer(fake.info.ToJson(), "").ok());
  ASSERT_TRUE(s.StartWeightUpdate().ok());
  // A chunk larger than the mapped region: planned for 16 MiB slots, mapped 4 MiB.
  st = s.UpdateWeights(fake.Update(meta, 16 << 20));
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_NE(st.message().find("the mapped slots hold 4194304"), std::string::npos) << st.message();
  // Another session's update.
  ASSERT_TRUE(s.StartWeightUpdate().ok());
  json other = fake.Update(meta, 4 << 20);
  other["session"] = NewSessionId();
  st = s.UpdateWeights(other);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.ToString();
  // An update the trainer did not announce in its region (version 1 trainers put the sync
  // in the body instead).
  {
    FakeTrainer silent = FakeTrainer::Make(2, 4 << 20);
    silent.region->Announce(0, 0);
    ASSERT_TRUE(s.InitWeightTransfer(silent.info.ToJson(), "").ok());
    ASSERT_TRUE(s.StartWeightUpdate().ok());
    st = s.UpdateWeights(silent.Update(meta, 4 << 20));
    EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.ToString();
    EXPECT_NE(st.message().find("announced no sync in its control region"), std::string::npos) << st.message();
    json v1 = silent.Update(meta, 4 << 20);
    v1["wsync_ipc_protocol"] = 1;
    ASSERT_TRUE(s.StartWeightUpdate().ok());
    st = s.UpdateWeights(v1);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
    EXPECT_NE(st.message().find("wsync_ipc_protocol 1 is not supported (this server speaks 3)"), std::string::npos)
        << st.message();
    ASSERT_TRUE(s.InitWeightTransfer(fake.info.ToJson(), "").ok());
  }
  // vLLM's pickled handles.
  ASSERT_TRUE(s.StartWeightUpdate().ok());
  json pickled = fake.Update(meta, 4 << 20);
  pickled["ipc_handles_pickled"] = "gASVAAAA";
  EXPECT_EQ(s.UpdateWeights(pickled).code(), StatusCode::kInvalidArgument);
  // A zero-copy update (GPU only) to CPU workers.
  ASSERT_TRUE(s.StartWeightUpdate().ok());
  json zero_copy = fake.Update(meta, 4 << 20);
  zero_copy["chunk_ends"] = {meta.size()};
  zero_copy["zero_copy"] = {{"generation", 1}, {"bytes", 64 << 20}};
  uint64_t at = 0;
  for (size_t i = 0; i < meta.size(); ++i) {
    zero_copy["tensor_offsets"][i] = at;
    at += (meta[i].nbytes() + 255) / 256 * 256;
  }
  st = s.UpdateWeights(zero_copy);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_NE(st.message().find("is on cpu; a zero-copy update needs workers on the trainer's GPU"), std::string::npos)
      << st.message();

  // The server still serves: a real trainer's sync verifies.
  auto engine = *CreateIpcTrainer(Options({&a}));
  ASSERT_TRUE(engine->Init(meta).ok());
  ASSERT_TRUE(engine->SendWeights(trainer->source(), std::nullopt).ok());
  ExpectServerHolds(s, trainer->source());
  EXPECT_EQ(s.Health()["weights_consistent"], true);
}

using ipc_testing::Poke;

TEST_F(IpcBackend, HostileRegionsAreRefusedAndTheServerKeepsServingBitExact) {
  auto trainer = Trainer("qwen3-tiny", 9);
  Server a = StartServer("qwen3-tiny", 2, 1, -1, "/dev/shm");
  InferenceServer& s = *a.service;
  const auto& meta = trainer->metadata();

  // 4 slots of stride 2^62: the slots' end wraps around 64 bits to inside the file.
  FakeTrainer wrap = FakeTrainer::Make(2, 4 << 20);
  Poke<uint32_t>(*wrap.region, ipc_testing::kNumSlotsAt, 4);
  Poke<uint64_t>(*wrap.region, ipc_testing::kSlotStrideAt, uint64_t{1} << 62);
  wrap.info.num_slots = 4;
  wrap.info.buffers[HostDeviceKey()].stride = uint64_t{1} << 62;
  Status st = s.InitWeightTransfer(wrap.info.ToJson(), "");
  if (st.ok()) {  // what a server that believed the header did next: read slot 1, 2^62 bytes away
    ASSERT_TRUE(s.StartWeightUpdate().ok());
    (void)s.UpdateWeights(wrap.Update(meta, 4 << 20));
  }
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_NE(st.message().find("header slot_stride 4611686018427387904 x num_slots 4"), std::string::npos)
      << st.message();

  // A POSIX shm region (allowed by the server's flags; such a file cannot be sealed)
  // shrunk between init and the update.
  FakeTrainer shrunk = FakeTrainer::Make(2, 4 << 20, ShmBacking::kPosixShm);
  ASSERT_TRUE(s.InitWeightTransfer(shrunk.info.ToJson(), "").ok());
  ASSERT_EQ(truncate(shrunk.region->path().c_str(), 4096), 0);
  ASSERT_TRUE(s.StartWeightUpdate().ok());
  st = s.UpdateWeights(shrunk.Update(meta, 4 << 20));
  EXPECT_EQ(st.code(), StatusCode::kDataLoss) << st.ToString();
  EXPECT_NE(st.message().find("shrank to 4096 bytes"), std::string::npos) << st.message();
  ASSERT_TRUE(s.StartWeightUpdate().ok());  // the session was released: init first
  st = s.UpdateWeights(shrunk.Update(meta, 4 << 20));
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.ToString();

  // A path outside what the flags allow says nothing about what is there.
  for (const char* path : {"/etc/passwd", "/etc/no-such-file", "/proc/self/environ", "/dev/zero"}) {
    IpcInitInfo bad = shrunk.info;
    bad.control_path = path;
    st = s.InitWeightTransfer(bad.ToJson(), "");
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
    EXPECT_NE(st.message().find("is not a wsync ipc region this server may open"), std::string::npos) << st.message();
  }

  // The server still serves: a real trainer's syncs verify bit-exact.
  EXPECT_EQ(s.Health()["status"], "ok");
  auto engine = *CreateIpcTrainer(Options({&a}));
  ASSERT_TRUE(engine->Init(meta).ok());
  for (int step = 0; step < 2; ++step) {
    if (step > 0) ASSERT_TRUE(trainer->Step(step).ok());
    auto stats = engine->SendWeights(trainer->source(), std::nullopt);
    ASSERT_TRUE(stats.ok()) << stats.status().ToString();
    ExpectServerHolds(s, trainer->source());
  }
  EXPECT_EQ(s.Health()["weights_consistent"], true);
}

TEST_F(IpcBackend, ATrainerThatDiesMidSyncEndsTheUpdateAtOnceAndTheNextSessionWorks) {
  auto trainer = Trainer("qwen3-tiny", 6);
  Server a = StartServer("qwen3-tiny", 2);
  InferenceServer& s = *a.service;
  const auto& meta = trainer->metadata();
  FakeTrainer fake = FakeTrainer::Make(2, 4 << 20);
  ASSERT_TRUE(s.InitWeightTransfer(fake.info.ToJson(), "").ok());
  ASSERT_TRUE(s.StartWeightUpdate().ok());
  json update = fake.Update(meta, 4 << 20);
  auto pending = std::async(std::launch::async, [&] { return s.UpdateWeights(update); });
  // Publish chunk 1 with the right bytes, then "die" (the region's lock goes with it).
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  IpcUpdateInfo u = *IpcUpdateInfo::Parse(update);
  auto stream = *trainer->source().Iterate();
  TensorRef t;
  for (size_t i = 0; i < u.chunk_ends[0]; ++i) {
    ASSERT_TRUE(*stream->Next(&t));
    std::memcpy(fake.region->slot(1).data() + u.tensor_offsets[i], t.bytes.data(), t.bytes.size());
  }
  fake.region->Publish(1, 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  auto t0 = Clock::now();
  fake.region.reset();
  Status st = pending.get();
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(2));
  EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.ToString();
  EXPECT_NE(st.message().find("exited during the sync"), std::string::npos) << st.message();
  EXPECT_EQ(s.Health()["weights_consistent"], false);  // chunk 1 landed, the rest did not

  // The failed update ended the session; a new trainer's init, sync and checksums work.
  auto engine = *CreateIpcTrainer(Options({&a}));
  ASSERT_TRUE(engine->Init(meta).ok());
  ASSERT_TRUE(engine->SendWeights(trainer->source(), std::nullopt).ok());
  ExpectServerHolds(s, trainer->source());
  EXPECT_EQ(s.Health()["weights_consistent"], true);
}

TEST_F(IpcBackend, AMappingWhoseTrainerExitedIsReleasedBetweenSyncs) {
  auto trainer = Trainer("qwen3-tiny", 7);
  Server a = StartServer("qwen3-tiny", 1);
  auto engine = *CreateIpcTrainer(Options({&a}));
  ASSERT_TRUE(engine->Init(trainer->metadata()).ok());
  ASSERT_TRUE(engine->SendWeights(trainer->source(), std::nullopt).ok());
  engine.reset();  // the trainer goes away between syncs
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // the watcher's period is 1 s
  FakeTrainer fake = FakeTrainer::Make(1, 4 << 20);
  ASSERT_TRUE(a.service->StartWeightUpdate().ok());
  Status st = a.service->UpdateWeights(fake.Update(trainer->metadata(), 4 << 20));
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.ToString();
  EXPECT_NE(st.message().find("no ipc staging region is mapped"), std::string::npos) << st.message();
}

TEST_F(IpcBackend, GpuTrainerOptionsAreCheckedAndACudaTrainerWithoutAGpuIsAClearError) {
  Server a = StartServer("qwen3-tiny", 1);
  TrainerOptions o = Options({&a});
  IpcTrainerOptions ipc;
  ipc.export_kind = "nvlink";
  auto bad = CreateIpcTrainerWith(o, ipc);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("export kind 'nvlink'"), std::string::npos) << bad.status().message();
  // This binary installs no CUDA runtime: a CUDA trainer fails at init naming the device
  // (the GPU paths are tested in tests/e2e/gpu_ipc_test.cc).
  o.device = Device{Device::Kind::kCuda, 0};
  auto engine = *CreateIpcTrainer(o);
  Status s = engine->Init(HfTensors(*LookupModel("qwen3-tiny")));
  EXPECT_EQ(s.code(), StatusCode::kUnimplemented) << s.ToString();
  EXPECT_NE(s.message().find("cuda:0"), std::string::npos) << s.message();
}

TEST_F(IpcBackend, SendWithoutInitAndUnpackedAreClearErrors) {
  auto trainer = Trainer("qwen3-tiny", 1);
  Server a = StartServer("qwen3-tiny", 1);
  auto engine = *CreateIpcTrainer(Options({&a}));
  EXPECT_EQ(engine->SendWeights(trainer->source(), std::nullopt).status().code(), StatusCode::kFailedPrecondition);
  TrainerOptions o = Options({&a});
  o.packed = false;
  EXPECT_EQ(CreateIpcTrainer(o).status().code(), StatusCode::kUnimplemented);
}

}  // namespace
}  // namespace wsync
