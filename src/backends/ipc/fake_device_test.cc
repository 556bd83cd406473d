// The `ipc` engines' GPU paths on a machine without a GPU: a host-memory DeviceRuntime
// (worker stores and trainer sources on "cuda:N") and a host-memory IpcDevicePlane
// (exports are allocations of that runtime, imports find them by serial number, batched
// copies are memcpy lists) stand in for CUDA. Real HTTP servers, trainer engines and
// regions; checksums read back from the servers. What this proves is the engines' logic:
// slot and zero-copy addressing, copy plans built once and reused, re-export of a replaced
// allocation, mappings released with the session, and the errors. The CUDA calls
// themselves are tested on a GPU (tests/e2e/gpu_ipc_test.cc).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "backends/ipc/device_plane.h"
#include "backends/ipc/receiver.h"
#include "backends/ipc/trainer.h"
#include "comm/store.h"
#include "control/http_server.h"
#include "core/digest.h"
#include "model/config.h"
#include "server/inference_server.h"
#include "sources/trainer_ranks.h"
#include "synthetic/synthetic.h"
#include "testing/faulty_source.h"
#include "testing/flat_buffer_source.h"
#include "testing/test_server.h"
#include "wsync/device_runtime.h"
#include "wsync/source.h"

namespace wsync {
namespace {

using nlohmann::json;

// Device memory in host memory: every allocation gets a serial number, as a CUDA
// allocation gets its own IPC handle.
class FakeRuntime final : public DeviceRuntime {
 public:
  struct Allocation {
    std::byte* base;
    size_t bytes;
    uint64_t serial;
    int device;
  };
  int DeviceCount() override { return 4; }
  Status SetDevice(int) override { return Status::Ok(); }
  Result<void*> Allocate(int device, size_t bytes) override {
    size_t n = (std::max<size_t>(bytes, 1) + 255) / 256 * 256;
    void* p = std::aligned_alloc(256, n);
    std::memset(p, 0, n);
    std::lock_guard lock(mu_);
    live_[reinterpret_cast<uintptr_t>(p)] = Allocation{static_cast<std::byte*>(p), n, ++serial_, device};
    return p;
  }
  void Free(int, void* ptr) override {
    {
      std::lock_guard lock(mu_);
      live_.erase(reinterpret_cast<uintptr_t>(ptr));
    }
    std::free(ptr);
  }
  Status Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width, size_t count) override {
    for (size_t i = 0; i < count; ++i) {
      std::memcpy(static_cast<std::byte*>(dst) + i * dst_pitch, static_cast<const std::byte*>(src) + i * src_pitch,
                  width);
    }
    return Status::Ok();
  }
  Status Synchronize() override { return Status::Ok(); }
  // The device kernel's schedule, on the host memory that stands for the device.
  Status Xxh3Digests(std::span<const Span> spans, std::span<uint64_t> out) override {
    return HostXxh3Digests(spans, out);
  }

  std::optional<Allocation> Containing(const void* ptr) {
    std::lock_guard lock(mu_);
    auto it = live_.upper_bound(reinterpret_cast<uintptr_t>(ptr));
    if (it == live_.begin()) return std::nullopt;
    --it;
    const Allocation& a = it->second;
    if (static_cast<const std::byte*>(ptr) >= a.base + a.bytes) return std::nullopt;
    return a;
  }
  std::optional<Allocation> BySerial(uint64_t serial) {
    std::lock_guard lock(mu_);
    for (const auto& [_, a] : live_) {
      if (a.serial == serial) return a;
    }
    return std::nullopt;
  }
  size_t live_bytes() {
    std::lock_guard lock(mu_);
    size_t n = 0;
    for (const auto& [_, a] : live_) n += a.bytes;
    return n;
  }

 private:
  std::mutex mu_;
  std::map<uintptr_t, Allocation> live_;  // GUARDED_BY(mu_)
  uint64_t serial_ = 0;                   // GUARDED_BY(mu_)
};

class FakePlane final : public IpcDevicePlane {
 public:
  explicit FakePlane(FakeRuntime* rt) : rt_(rt) {}

  Result<std::string> DeviceKey(const Device& device) override {
    if (device.is_cpu()) return InvalidArgument("cpu has no GPU key");
    return fmt::format("GPU-fake-{}", device.index);
  }
  Result<std::unique_ptr<DeviceExport>> Allocate(const Device& device, uint64_t bytes, std::string_view kind) override {
    if (kind != "cuda_ipc" && kind != "cuda_fd") return InvalidArgument(fmt::format("kind {}", kind));
    WSYNC_ASSIGN_OR_RETURN(void* p, rt_->Allocate(device.index, bytes));
    auto a = *rt_->Containing(p);
    return std::unique_ptr<DeviceExport>(std::make_unique<Export>(rt_, a, 0, std::string(kind), true));
  }
  Result<std::unique_ptr<DeviceExport>> Existing(const Device& device, const void* ptr, uint64_t bytes) override {
    auto a = rt_->Containing(ptr);
    if (!a) return InvalidArgument("not device memory");
    uint64_t offset = static_cast<const std::byte*>(ptr) - a->base;
    if (a->bytes - offset < bytes) return InvalidArgument("allocation too small");
    return std::unique_ptr<DeviceExport>(std::make_unique<Export>(rt_, *a, offset, "cuda_ipc", false));
  }
  Result<std::unique_ptr<DeviceImport>> Open(const Device& device, std::string_view kind, const json& handle,
                                             uint64_t bytes) override {
    if (!handle.is_object() || !handle.contains("fake")) {
      return InvalidArgument(fmt::format("cannot open the {} handle on {}: not a fake handle", kind, device.ToString()));
    }
    auto a = rt_->BySerial(handle["fake"].get<uint64_t>());
    if (!a) {
      return InvalidArgument(fmt::format("cannot open the {} handle on {}: allocation {} is gone", kind,
                                         device.ToString(), handle["fake"].dump()));
    }
    if (a->bytes < bytes) return InvalidArgument("cannot open: the allocation is smaller than needed");
    opens.fetch_add(1);
    if (a->device != device.index) foreign_opens.fetch_add(1);
    return std::unique_ptr<DeviceImport>(std::make_unique<Import>(a->base, &imports));
  }
  Result<std::unique_ptr<DeviceCopies>> Copies(const Device&, std::span<const WorkerStore::ByteCopy> copies) override {
    plans.fetch_add(1);
    return std::unique_ptr<DeviceCopies>(std::make_unique<Copier>(rt_, copies, &launches));
  }
  Status Synchronize(const Device&) override { return Status::Ok(); }
  Result<std::pair<uint64_t, uint64_t>> MemoryInfo(const Device&) override {
    uint64_t total = uint64_t{1} << 40;
    return std::pair<uint64_t, uint64_t>{total - rt_->live_bytes(), total};
  }

  std::atomic<int> imports{0};   // mappings alive
  std::atomic<int> opens{0};     // mappings ever made
  std::atomic<int> foreign_opens{0};  // ...of memory on another GPU than the importer's
  std::atomic<int> plans{0};     // batched copies built
  std::atomic<int> launches{0};  // batched copies run

 private:
  class Export final : public DeviceExport {
   public:
    Export(FakeRuntime* rt, FakeRuntime::Allocation a, uint64_t offset, std::string kind, bool owned)
        : rt_(rt), a_(a), offset_(offset), kind_(std::move(kind)), owned_(owned) {}
    ~Export() override {
      if (owned_) rt_->Free(0, a_.base);
    }
    std::byte* data() const override { return a_.base + offset_; }
    std::string_view kind() const override { return kind_; }
    uint64_t offset() const override { return offset_; }
    json Handle() const override { return json{{"fake", a_.serial}}; }

   private:
    FakeRuntime* rt_;
    FakeRuntime::Allocation a_;
    uint64_t offset_;
    std::string kind_;
    bool owned_;
  };
  class Import final : public DeviceImport {
   public:
    Import(std::byte* base, std::atomic<int>* live) : base_(base), live_(live) { live_->fetch_add(1); }
    ~Import() override { live_->fetch_sub(1); }
    std::byte* data() const override { return base_; }

   private:
    std::byte* base_;
    std::atomic<int>* live_;
  };
  class Copier final : public DeviceCopies {
   public:
    Copier(FakeRuntime* rt, std::span<const WorkerStore::ByteCopy> c, std::atomic<int>* launches)
        : rt_(rt), copies_(c.begin(), c.end()), launches_(launches) {}
    Status Run() override {
      // A launch reads and writes live device memory only: a copy from freed staging (a
      // trainer rank that freed its slots while a reader still copied) fails the test
      // here instead of reading freed host memory. (Building a plan only records the
      // addresses, as on a GPU.)
      for (const auto& c : copies_) {
        auto s = rt_->Containing(c.src), d = rt_->Containing(c.dst);
        if (!s || !d || static_cast<const std::byte*>(c.src) + c.bytes > s->base + s->bytes ||
            static_cast<std::byte*>(c.dst) + c.bytes > d->base + d->bytes) {
          return Internal(fmt::format("fake plane: a copy of {} bytes from {} to {} leaves live device memory",
                                      c.bytes, static_cast<const void*>(c.src), static_cast<const void*>(c.dst)));
        }
      }
      for (const auto& c : copies_) std::memcpy(c.dst, c.src, c.bytes);
      launches_->fetch_add(1);
      return Status::Ok();
    }
    uint64_t bytes() const override {
      uint64_t n = 0;
      for (const auto& c : copies_) n += c.bytes;
      return n;
    }

   private:
    FakeRuntime* rt_;
    std::vector<WorkerStore::ByteCopy> copies_;
    std::atomic<int>* launches_;
  };
  FakeRuntime* rt_;
};

using Server = testing::TestServer;
using testing::FaultySource;
using testing::FlatBufferSource;

template <typename Pred>
bool Eventually(Pred pred, double seconds) {
  auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return pred();
}

class IpcFakeGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    InstallCudaRuntime(&rt_);
    SetIpcDevicePlaneForTesting(&plane_);
  }
  void TearDown() override {
    servers_.clear();
    SetIpcDevicePlaneForTesting(nullptr);
    InstallCudaRuntime(nullptr);
  }
  Server& StartServer(int tp, Device device = kCuda0, const std::string& model = "qwen3-tiny",
                      const std::string& speculative = "none") {
    InferenceServerOptions o;
    o.model = model;
    o.speculative = speculative;
    o.tp = tp;
    o.device = device;
    o.backend = "ipc";
    o.timeout_seconds = 20;
    auto made = Server::Start(o, [](std::string_view, ReceiverContext* c) { return CreateIpcReceiver(c); });
    EXPECT_TRUE(made.ok()) << made.status().ToString();
    servers_.push_back(std::make_unique<Server>(std::move(*made)));
    return *servers_.back();
  }
  TrainerOptions Options(const std::vector<Server*>& servers, Device device = kCuda0) {
    TrainerOptions o;
    o.backend = "ipc";
    for (Server* s : servers) o.servers.push_back(s->url());
    o.device = device;
    o.bucket_gb = 1.0 / 1024;  // 1 MiB slots: several chunks per sync
    o.timeout_seconds = 20;
    return o;
  }
  static void ExpectHolds(InferenceServer& server, const SyntheticTrainer& trainer) {
    testing::ExpectServerHolds(server, trainer.tensors());
  }

  static constexpr Device kCuda0{Device::Kind::kCuda, 0};
  FakeRuntime rt_;
  FakePlane plane_{&rt_};
  std::vector<std::unique_ptr<Server>> servers_;
};

TEST_F(IpcFakeGpu, PackedAndZeroCopySyncsLandBitExactWithPlansBuiltOnceAndMappingsReleasedAfter) {
  Server& a = StartServer(1);
  Server& b = StartServer(1);  // two readers of the same GPU's slots
  auto trainer = std::move(*SyntheticTrainer::FromMetadata(HfTensors(*LookupModel("qwen3-tiny")), 5, 2));
  auto source = std::move(*DeviceTensorSource::Create(kCuda0, trainer->metadata()));
  ASSERT_TRUE(source->Upload(trainer->tensors()).ok());
  uint64_t step = 0;
  for (auto mode : {IpcTrainerOptions::Mode::kPacked, IpcTrainerOptions::Mode::kZeroCopy}) {
    bool zero_copy = mode == IpcTrainerOptions::Mode::kZeroCopy;
    SCOPED_TRACE(zero_copy ? "zero-copy" : "packed");
    IpcTrainerOptions ipc;
    ipc.mode = mode;
    int opens0 = plane_.opens.load();
    auto engine = std::move(*CreateIpcTrainerWith(Options({&a, &b}), ipc));
    ASSERT_TRUE(engine->Init(trainer->metadata()).ok());
    int plans_after_warmup = 0;
    for (int i = 0; i < 8; ++i) {
      ASSERT_TRUE(trainer->Step(++step).ok());
      ASSERT_TRUE(source->Upload(trainer->tensors()).ok());
      auto st = engine->SendWeights(*source, "v" + std::to_string(step));
      ASSERT_TRUE(st.ok()) << st.status().ToString();
      if (zero_copy) {
        EXPECT_EQ(st->chunks, 1u);
      } else {
        EXPECT_GE(st->chunks, 3u);
      }
      // Packed slots, or the source's own storage (zero-copy), are digested on the
      // "device" and both servers check every tensor.
      EXPECT_EQ(st->inline_verified_servers, 2u);
      EXPECT_EQ(st->inline_verified_tensors, trainer->metadata().size());
      ExpectHolds(*a.service, *trainer);
      ExpectHolds(*b.service, *trainer);
      if (i == 2) plans_after_warmup = plane_.plans.load();
    }
    // Both sides reuse their batched copies; each server mapped once (slots or tensors).
    EXPECT_EQ(plane_.plans.load(), plans_after_warmup);
    EXPECT_EQ(plane_.opens.load() - opens0, 2);
    EXPECT_EQ(a.service->WeightVersion(), "v" + std::to_string(step));

    if (zero_copy) {
      // A replaced allocation is exported again (generation 2) and mapped again; the old
      // mapping is never read (its allocation is gone: a stale read would not see the
      // new bytes).
      source.reset();
      ASSERT_TRUE(trainer->Step(++step).ok());
      source = std::move(*DeviceTensorSource::Create(kCuda0, trainer->metadata()));
      ASSERT_TRUE(source->Upload(trainer->tensors()).ok());
      auto st = engine->SendWeights(*source, std::nullopt);
      ASSERT_TRUE(st.ok()) << st.status().ToString();
      ExpectHolds(*a.service, *trainer);
      ExpectHolds(*b.service, *trainer);
      EXPECT_EQ(plane_.opens.load() - opens0, 4);
      EXPECT_EQ(plane_.imports.load(), 2);
    }
    engine.reset();
    // The trainer's region is closed: the servers release their mappings.
    EXPECT_TRUE(Eventually([&] { return plane_.imports.load() == 0; }, 5)) << plane_.imports.load() << " left";
  }
}

// The batched copies are planned once and replayed: every replay still tells the store
// what landed, so the MTP drafter is reloaded by every sync, not only the first.
TEST_F(IpcFakeGpu, ReplayedCopiesReloadTheMtpDrafterEverySync) {
  Server& s = StartServer(1, kCuda0, "glm4-moe-tiny", "mtp");
  auto trainer = std::move(*SyntheticTrainer::FromMetadata(HfTensors(*LookupModel("glm4-moe-tiny")), 6, 2));
  auto source = std::move(*DeviceTensorSource::Create(kCuda0, trainer->metadata()));
  uint64_t step = 0;
  for (auto mode : {IpcTrainerOptions::Mode::kPacked, IpcTrainerOptions::Mode::kZeroCopy}) {
    SCOPED_TRACE(mode == IpcTrainerOptions::Mode::kZeroCopy ? "zero-copy" : "packed");
    IpcTrainerOptions ipc;
    ipc.mode = mode;
    auto engine = std::move(*CreateIpcTrainerWith(Options({&s}), ipc));
    ASSERT_TRUE(engine->Init(trainer->metadata()).ok());
    const int plans0 = plane_.plans.load();
    for (int i = 0; i < 3; ++i) {
      ASSERT_TRUE(trainer->Step(++step).ok());
      ASSERT_TRUE(source->Upload(trainer->tensors()).ok());
      const std::string version = "v" + std::to_string(step);
      auto st = engine->SendWeights(*source, version);
      ASSERT_TRUE(st.ok()) << st.status().ToString();
      ExpectHolds(*s.service, *trainer);
      const nlohmann::json spec = s.service->Health()["speculative"];
      EXPECT_EQ(spec["weight_version"], version) << spec.dump();
      EXPECT_EQ(spec["stale"], false) << spec.dump();
    }
    EXPECT_GT(plane_.plans.load(), plans0);  // planned at the first sync of the layout
    engine.reset();
  }
}

// A source that is no DeviceTensorSource offers its storage(): a block 4 KiB into a larger
// allocation (a tensor inside torch's caching allocator segment), tensors with gaps.
TEST_F(IpcFakeGpu, AnySourceOfferingItsStorageSendsZeroCopyFromInsideItsAllocation) {
  Server& a = StartServer(1);
  auto trainer = std::move(*SyntheticTrainer::FromMetadata(HfTensors(*LookupModel("qwen3-tiny")), 21, 2));
  auto made = FlatBufferSource::Create(kCuda0, trainer->metadata(), {});
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  FlatBufferSource& source = **made;
  uint64_t step = 0;
  auto sync = [&](TrainerEngine& engine) -> Result<SyncStats> {
    EXPECT_TRUE(trainer->Step(++step).ok());
    EXPECT_TRUE(source.Upload(trainer->tensors()).ok());
    return engine.SendWeights(source, "v" + std::to_string(step));
  };
  // `n` syncs, each verified: the chunks each sent.
  auto syncs = [&](TrainerEngine& engine, int n) {
    std::vector<uint64_t> chunks;
    for (int i = 0; i < n; ++i) {
      auto st = sync(engine);
      EXPECT_TRUE(st.ok()) << st.status().ToString();
      if (!st.ok()) break;
      chunks.push_back(st->chunks);
      ExpectHolds(*a.service, *trainer);
    }
    return chunks;
  };
  using Chunks = std::vector<uint64_t>;
  // Mode zero_copy: every sync one go, the server copying from the block at its offset
  // inside the allocation, at the offsets the pass shows; mapped once.
  IpcTrainerOptions zc;
  zc.mode = IpcTrainerOptions::Mode::kZeroCopy;
  auto engine = std::move(*CreateIpcTrainerWith(Options({&a}), zc));
  ASSERT_TRUE(engine->Init(trainer->metadata()).ok());
  int opens0 = plane_.opens.load();
  EXPECT_EQ(syncs(*engine, 3), (Chunks{1, 1, 1}));
  EXPECT_EQ(plane_.opens.load() - opens0, 1);
  // A tensor outside the block: mode zero_copy names it, and the next sync lands.
  source.stray = 5;
  Status s = sync(*engine).status();
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  const std::string name = trainer->metadata()[5].name;
  EXPECT_NE(s.message().find("zero-copy: tensor " + name + " ("), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("does not lie inside the source's storage"), std::string::npos) << s.message();
  source.stray.reset();
  EXPECT_EQ(syncs(*engine, 1), (Chunks{1}));
  engine.reset();

  // Mode auto: the first sync packs and learns the layout, then one go per sync.
  engine = std::move(*CreateIpcTrainer(Options({&a})));
  ASSERT_TRUE(engine->Init(trainer->metadata()).ok());
  Chunks chunks = syncs(*engine, 3);
  ASSERT_EQ(chunks.size(), 3u);
  EXPECT_GE(chunks[0], 3u);
  EXPECT_EQ(Chunks(chunks.begin() + 1, chunks.end()), (Chunks{1, 1}));
  // A source that breaks its storage's promise mid-run fails that sync naming the
  // tensor; auto then packs, sync after sync, while the tensor stays outside.
  source.stray = 7;
  s = sync(*engine).status();
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_NE(s.message().find("tensor " + trainer->metadata()[7].name + " ("), std::string::npos) << s.message();
  chunks = syncs(*engine, 2);
  ASSERT_EQ(chunks.size(), 2u);
  EXPECT_GE(std::min(chunks[0], chunks[1]), 3u);
  // Back inside: one packed sync shows it, then zero-copy again.
  source.stray.reset();
  chunks = syncs(*engine, 2);
  ASSERT_EQ(chunks.size(), 2u);
  EXPECT_GE(chunks[0], 3u);
  EXPECT_EQ(chunks[1], 1u);
}

TEST_F(IpcFakeGpu, HostSourcesAndCpuTrainersStillSyncIntoGpuShards) {
  Server& a = StartServer(1);
  auto trainer = std::move(*SyntheticTrainer::FromMetadata(HfTensors(*LookupModel("qwen3-tiny")), 6, 2));
  // A GPU trainer given host tensors packs them tensor by tensor into its GPU slots.
  auto gpu = std::move(*CreateIpcTrainer(Options({&a})));
  ASSERT_TRUE(gpu->Init(trainer->metadata()).ok());
  auto st = gpu->SendWeights(trainer->source(), std::nullopt);
  ASSERT_TRUE(st.ok()) << st.status().ToString();
  ExpectHolds(*a.service, *trainer);
  gpu.reset();
  // A CPU trainer's host slots, loaded into the GPU shards (no GPU mapping at all).
  int opens0 = plane_.opens.load();
  ASSERT_TRUE(trainer->Step(1).ok());
  auto cpu = std::move(*CreateIpcTrainer(Options({&a}, Device{})));
  ASSERT_TRUE(cpu->Init(trainer->metadata()).ok());
  st = cpu->SendWeights(trainer->source(), std::nullopt);
  ASSERT_TRUE(st.ok()) << st.status().ToString();
  ExpectHolds(*a.service, *trainer);
  EXPECT_EQ(plane_.opens.load(), opens0);
  // A zero-copy-only trainer needs a source that offers its storage on the trainer's GPU.
  IpcTrainerOptions ipc;
  ipc.mode = IpcTrainerOptions::Mode::kZeroCopy;
  auto zc = std::move(*CreateIpcTrainerWith(Options({&a}), ipc));
  ASSERT_TRUE(zc->Init(trainer->metadata()).ok());
  Status s = zc->SendWeights(trainer->source(), std::nullopt).status();
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_NE(s.message().find("its source offers no storage()"), std::string::npos) << s.message();
}

TEST_F(IpcFakeGpu, AWorkerOnAGpuWithoutAnEntryAndBadHandlesAre400s) {
  Server& tp2 = StartServer(2);  // workers on cuda:0 and cuda:1
  auto trainer = std::move(*SyntheticTrainer::FromMetadata(HfTensors(*LookupModel("qwen3-tiny")), 7, 2));
  auto engine = std::move(*CreateIpcTrainer(Options({&tp2})));
  Status s = engine->Init(trainer->metadata());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("no entry for this server's device GPU-fake-1"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("offered: GPU-fake-0"), std::string::npos) << s.message();

  Server& a = StartServer(1);
  IpcRegionOptions ro;
  ro.session = NewSessionId();
  ro.slot_bytes = 1 << 20;
  ro.slots_in_region = false;
  auto region = std::move(*IpcRegion::Create(ro));
  IpcInitInfo info;
  info.session = region->session();
  info.control_path = region->path();
  info.control_bytes = region->bytes();
  info.num_slots = region->num_slots();
  info.slot_bytes = region->slot_bytes();
  info.reader_count = 1;
  info.buffers["GPU-fake-0"] = IpcBufferDesc{"cuda_ipc", 0, region->slot_stride(), json{{"fake", 123456}}};
  s = a.service->InitWeightTransfer(info.ToJson(), "");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("cannot open the cuda_ipc handle"), std::string::npos) << s.message();
  region.reset();
  // The server keeps serving.
  auto good = std::move(*CreateIpcTrainer(Options({&a})));
  ASSERT_TRUE(good->Init(trainer->metadata()).ok());
  ASSERT_TRUE(good->SendWeights(trainer->source(), std::nullopt).ok());
  ExpectHolds(*a.service, *trainer);
}

// ---- several trainer ranks, each exporting its own GPU's slots ---------------------

// One call per rank, all at once (Init and SendWeights of several ranks are concurrent,
// as the ranks of a trainer are).
template <typename Fn>
std::vector<Status> OnRanks(int n, Fn fn) {
  std::vector<Status> out(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back([&, r] { out[r] = fn(r); });
  for (auto& t : threads) t.join();
  return out;
}

// The trainer group of `n` ranks (a Gloo communicator through a rendezvous store).
struct Group {
  std::unique_ptr<StoreServer> store;
  ParallelLayout layout;
  std::vector<std::shared_ptr<TrainerGroup>> ranks;

  static Group Connect(int n) {
    Group g;
    g.store = std::move(*StoreServer::Start("127.0.0.1", 0));
    g.layout = *ParallelLayout::Parse("fsdp", n);
    TrainerGroupOptions o;
    o.store_port = g.store->port();
    o.prefix = NewSessionId();
    o.timeout_seconds = 20;
    g.ranks.resize(n);
    auto st = OnRanks(n, [&](int r) -> Status {
      WSYNC_ASSIGN_OR_RETURN(g.ranks[r], TrainerGroup::Connect(o, g.layout, r));
      return Status::Ok();
    });
    for (const Status& s : st) EXPECT_TRUE(s.ok()) << s.ToString();
    return g;
  }
};

TEST_F(IpcFakeGpu, TwoRanksOnTwoGpusEachFeedTheWorkersOnTheirGpuBitExact) {
  constexpr Device kCuda1{Device::Kind::kCuda, 1};
  Server& tp2 = StartServer(2);          // workers on cuda:0 and cuda:1
  Server& one = StartServer(1, kCuda1);  // a second reader of rank 1's slots
  auto trainer = std::move(*SyntheticTrainer::FromMetadata(HfTensors(*LookupModel("qwen3-tiny")), 11, 2));
  Group group = Group::Connect(2);
  // FSDP sources: every pass is a collective of the two ranks, and each yields full
  // tensors (host memory here; each rank packs them into its own GPU's slots).
  std::vector<std::unique_ptr<WeightSource>> sources(2);
  auto built = OnRanks(2, [&](int r) -> Status {
    WSYNC_ASSIGN_OR_RETURN(sources[r], BuildRankSource(*group.ranks[r], group.layout, nullptr, trainer->tensors(), 20));
    return Status::Ok();
  });
  for (const Status& s : built) ASSERT_TRUE(s.ok()) << s.ToString();
  std::vector<std::unique_ptr<TrainerEngine>> engines;
  for (int r = 0; r < 2; ++r) {
    TrainerOptions o = Options({&tp2, &one}, Device{Device::Kind::kCuda, r});
    o.rank = r;
    o.comm = group.ranks[r]->comm();
    engines.push_back(std::move(*CreateIpcTrainer(o)));
  }
  int opens0 = plane_.opens.load();
  auto init = OnRanks(2, [&](int r) { return engines[r]->Init(trainer->metadata()); });
  for (const Status& s : init) ASSERT_TRUE(s.ok()) << s.ToString();
  // One mapping per (server, GPU): tp2 maps both ranks' slots, `one` maps rank 1's.
  EXPECT_EQ(plane_.opens.load() - opens0, 3);
  for (uint64_t step = 1; step <= 4; ++step) {
    ASSERT_TRUE(trainer->Step(step).ok());
    for (auto& s : sources) ASSERT_TRUE(RefreshRankSource(*s, trainer->tensors()).ok());
    std::vector<Result<SyncStats>> stats(2, Status::Ok());
    auto synced = OnRanks(2, [&](int r) {
      stats[r] = engines[r]->SendWeights(*sources[r], "v" + std::to_string(step));
      return stats[r].status();
    });
    for (const Status& s : synced) ASSERT_TRUE(s.ok()) << s.ToString();
    // Rank 1 packed every byte into its own slots (the cut is the same on both ranks).
    EXPECT_GE(stats[1]->chunks, 3u);
    EXPECT_EQ(stats[1]->chunks, stats[0]->chunks);
    EXPECT_EQ(stats[1]->bytes, stats[0]->bytes);
    ExpectHolds(*tp2.service, *trainer);
    ExpectHolds(*one.service, *trainer);
    EXPECT_EQ(one.service->WeightVersion(), "v" + std::to_string(step));
  }
  engines.clear();
  EXPECT_TRUE(Eventually([&] { return plane_.imports.load() == 0; }, 5)) << plane_.imports.load() << " left";
}

// Zero-copy with two ranks: each rank exports its own GPU's tensors, rank 0 sends the
// merged map, and the workers on each GPU copy from the rank on that GPU.
TEST_F(IpcFakeGpu, TwoRanksEachOfferTheirOwnTensorsZeroCopyAndFallBackToPackingTogether) {
  constexpr Device kCuda1{Device::Kind::kCuda, 1};
  Server& tp2 = StartServer(2);          // workers on cuda:0 and cuda:1
  Server& one = StartServer(1, kCuda1);  // a second reader of rank 1's tensors
  auto trainer = std::move(*SyntheticTrainer::FromMetadata(HfTensors(*LookupModel("qwen3-tiny")), 14, 2));
  Group group = Group::Connect(2);
  std::vector<std::unique_ptr<DeviceTensorSource>> device(2);
  for (int r = 0; r < 2; ++r) {
    device[r] = std::move(*DeviceTensorSource::Create(Device{Device::Kind::kCuda, r}, trainer->metadata()));
  }
  std::vector<WeightSource*> sources = {device[0].get(), device[1].get()};
  auto make = [&](IpcTrainerOptions::Mode mode) {
    std::vector<std::unique_ptr<TrainerEngine>> engines(2);
    for (int r = 0; r < 2; ++r) {
      TrainerOptions o = Options({&tp2, &one}, Device{Device::Kind::kCuda, r});
      o.rank = r;
      o.comm = group.ranks[r]->comm();
      IpcTrainerOptions ipc;
      ipc.mode = mode;
      engines[r] = std::move(*CreateIpcTrainerWith(o, ipc));
    }
    auto init = OnRanks(2, [&](int r) { return engines[r]->Init(trainer->metadata()); });
    for (const Status& s : init) EXPECT_TRUE(s.ok()) << s.ToString();
    return engines;
  };
  uint64_t step = 0;
  auto sync = [&](std::vector<std::unique_ptr<TrainerEngine>>& engines, std::vector<SyncStats>* stats = nullptr) {
    EXPECT_TRUE(trainer->Step(++step).ok());
    for (auto& d : device) EXPECT_TRUE(d->Upload(trainer->tensors()).ok());
    std::vector<SyncStats> got(2);
    auto st = OnRanks(2, [&](int r) -> Status {
      WSYNC_ASSIGN_OR_RETURN(got[r], engines[r]->SendWeights(*sources[r], "v" + std::to_string(step)));
      return Status::Ok();
    });
    if (stats != nullptr) *stats = got;
    return st;
  };

  // Auto: the first sync packs, and its pass shows each rank where its tensors lie in its
  // source's storage; from then on one go per rank, nothing packed.
  auto engines = make(IpcTrainerOptions::Mode::kAuto);
  int opens0 = plane_.opens.load(), plans0 = 0;
  for (int i = 0; i < 5; ++i) {
    std::vector<SyncStats> stats;
    for (const Status& s : sync(engines, &stats)) ASSERT_TRUE(s.ok()) << s.ToString();
    if (i == 0) {
      EXPECT_GE(stats[0].chunks, 3u);
    } else {
      EXPECT_EQ(stats[0].chunks, 1u);
      EXPECT_EQ(stats[1].chunks, 1u);
    }
    ExpectHolds(*tp2.service, *trainer);
    ExpectHolds(*one.service, *trainer);
    if (i == 2) plans0 = plane_.plans.load();
  }
  // tp2 mapped both ranks' tensors, `one` rank 1's: each worker its own GPU's, once.
  EXPECT_EQ(plane_.opens.load() - opens0, 3);
  EXPECT_EQ(plane_.foreign_opens.load(), 0);
  EXPECT_EQ(plane_.plans.load(), plans0);

  // Rank 1 alone moves its tensors to a new allocation: one packed sync learns it, then
  // a new generation for every worker, and still each worker maps its own GPU's rank.
  device[1] = std::move(*DeviceTensorSource::Create(kCuda1, trainer->metadata()));
  sources[1] = device[1].get();
  std::vector<SyncStats> stats;
  for (const Status& s : sync(engines, &stats)) ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_GE(stats[1].chunks, 3u);
  EXPECT_EQ(plane_.opens.load() - opens0, 3);
  for (const Status& s : sync(engines, &stats)) ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(stats[1].chunks, 1u);
  ExpectHolds(*tp2.service, *trainer);
  ExpectHolds(*one.service, *trainer);
  EXPECT_EQ(plane_.opens.load() - opens0, 6);
  EXPECT_EQ(plane_.foreign_opens.load(), 0);

  // One rank's source offers no storage: both ranks pack that sync (auto), into their
  // slots, and go back to zero-copy after it without mapping anything again.
  FaultySource other(device[1].get());
  sources[1] = &other;
  for (const Status& s : sync(engines, &stats)) ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_GE(stats[0].chunks, 3u);
  EXPECT_EQ(stats[1].chunks, stats[0].chunks);
  ExpectHolds(*tp2.service, *trainer);
  ExpectHolds(*one.service, *trainer);
  sources[1] = device[1].get();
  int opens1 = plane_.opens.load();
  for (const Status& s : sync(engines, &stats)) ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(stats[1].chunks, 1u);
  EXPECT_EQ(plane_.opens.load(), opens1);
  ExpectHolds(*tp2.service, *trainer);

  // A rank whose pass breaks mid-stream fails the sync on both ranks at once, naming it;
  // the next sync initializes a new session on both ranks by itself and lands.
  FaultySource broken(device[1].get());
  broken.options().fail_pass = 1;
  broken.options().fail_at = 3;
  sources[1] = &broken;
  auto t0 = std::chrono::steady_clock::now();
  auto failed = sync(engines);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10.0);
  ASSERT_FALSE(failed[0].ok());
  EXPECT_NE(failed[0].message().find("trainer rank 1"), std::string::npos) << failed[0].ToString();
  EXPECT_NE(failed[0].message().find("injected"), std::string::npos) << failed[0].ToString();
  ASSERT_FALSE(failed[1].ok());
  EXPECT_NE(failed[1].message().find("injected"), std::string::npos) << failed[1].ToString();
  sources[1] = device[1].get();
  for (const Status& s : sync(engines)) ASSERT_TRUE(s.ok()) << s.ToString();
  ExpectHolds(*tp2.service, *trainer);
  ExpectHolds(*one.service, *trainer);
  engines.clear();

  // zero_copy mode exports no slots: a rank that cannot offer its tensors fails the sync
  // on both ranks with the reason, and the session stays.
  engines = make(IpcTrainerOptions::Mode::kZeroCopy);
  FaultySource wrapped(device[1].get());  // the same tensors, but no storage()
  sources[1] = &wrapped;
  auto refused = sync(engines);
  for (const Status& s : refused) {
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
    EXPECT_NE(s.message().find("trainer rank 1: its source offers no storage()"), std::string::npos)
        << s.ToString();
  }
  sources[1] = device[1].get();
  for (const Status& s : sync(engines)) ASSERT_TRUE(s.ok()) << s.ToString();
  ExpectHolds(*tp2.service, *trainer);
  ExpectHolds(*one.service, *trainer);
  EXPECT_EQ(plane_.foreign_opens.load(), 0);
  engines.clear();
  EXPECT_TRUE(Eventually([&] { return plane_.imports.load() == 0; }, 5)) << plane_.imports.load() << " left";
}

// Two ranks whose sources offer flat buffers (no DeviceTensorSource), mode auto: the
// first sync packs and shows each rank its layout, then zero-copy. A rank whose tensor
// leaves its block after the ranks agreed on the layout fails the sync on both ranks,
// naming the tensor; the next syncs pack, then go zero-copy again once it is back.
TEST_F(IpcFakeGpu, TwoRanksLearnTheirFlatBuffersAndAgreeOnlyWhileBothHold) {
  constexpr Device kCuda1{Device::Kind::kCuda, 1};
  Server& tp2 = StartServer(2);
  auto trainer = std::move(*SyntheticTrainer::FromMetadata(HfTensors(*LookupModel("qwen3-tiny")), 15, 2));
  Group group = Group::Connect(2);
  std::vector<std::unique_ptr<FlatBufferSource>> sources(2);
  std::vector<std::unique_ptr<TrainerEngine>> engines(2);
  for (int r = 0; r < 2; ++r) {
    sources[r] = std::move(*FlatBufferSource::Create(r == 0 ? kCuda0 : kCuda1, trainer->metadata(), {}));
    TrainerOptions o = Options({&tp2}, r == 0 ? kCuda0 : kCuda1);
    o.rank = r;
    o.comm = group.ranks[r]->comm();
    engines[r] = std::move(*CreateIpcTrainer(o));
  }
  for (const Status& s : OnRanks(2, [&](int r) { return engines[r]->Init(trainer->metadata()); })) {
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
  uint64_t step = 0;
  std::vector<uint64_t> chunks(2);
  auto sync = [&] {
    EXPECT_TRUE(trainer->Step(++step).ok());
    for (auto& src : sources) EXPECT_TRUE(src->Upload(trainer->tensors()).ok());
    return OnRanks(2, [&](int r) -> Status {
      WSYNC_ASSIGN_OR_RETURN(SyncStats st, engines[r]->SendWeights(*sources[r], std::nullopt));
      chunks[r] = st.chunks;
      return Status::Ok();
    });
  };
  auto synced = [&] {
    for (const Status& s : sync()) EXPECT_TRUE(s.ok()) << s.ToString();
    ExpectHolds(*tp2.service, *trainer);
    return chunks;
  };
  EXPECT_GE(synced()[0], 3u);
  EXPECT_EQ(synced(), (std::vector<uint64_t>{1, 1}));
  sources[1]->stray = 3;
  const std::string name = trainer->metadata()[3].name;
  std::vector<Status> failed = sync();
  for (const Status& s : failed) {
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.message().find("tensor " + name + " ("), std::string::npos) << s.ToString();
  }
  EXPECT_GE(synced()[1], 3u);  // rank 1 forgot its layout: both pack
  sources[1]->stray.reset();
  EXPECT_GE(synced()[0], 3u);  // the pass that shows the tensor back in the block
  EXPECT_EQ(synced(), (std::vector<uint64_t>{1, 1}));
}

TEST_F(IpcFakeGpu, ARankFailingMidSyncStopsTheOthersAndTheNextSessionSyncs) {
  constexpr Device kCuda1{Device::Kind::kCuda, 1};
  Server& tp2 = StartServer(2);
  auto trainer = std::move(*SyntheticTrainer::FromMetadata(HfTensors(*LookupModel("qwen3-tiny")), 12, 2));
  Group group = Group::Connect(2);
  // Device sources on each rank's own GPU behind wrappers that offer no storage(), so the
  // ranks pack (auto mode).
  std::vector<std::unique_ptr<DeviceTensorSource>> device(2);
  for (int r = 0; r < 2; ++r) {
    device[r] = std::move(*DeviceTensorSource::Create(Device{Device::Kind::kCuda, r}, trainer->metadata()));
  }
  FaultySource rank0(device[0].get()), rank1(device[1].get());  // they count each rank's passes
  std::vector<WeightSource*> sources = {&rank0, &rank1};
  auto expect_passes = [&](int n) {
    EXPECT_EQ(rank0.passes(), n) << "rank 0 iterates its source once per sync";
    EXPECT_EQ(rank1.passes(), n) << "rank 1 iterates its source once per sync";
  };
  std::vector<std::unique_ptr<TrainerEngine>> engines(2);
  auto make = [&] {
    for (int r = 0; r < 2; ++r) {
      TrainerOptions o = Options({&tp2}, r == 0 ? kCuda0 : kCuda1);
      o.rank = r;
      o.comm = group.ranks[r]->comm();
      engines[r] = std::move(*CreateIpcTrainer(o));
    }
    auto init = OnRanks(2, [&](int r) { return engines[r]->Init(trainer->metadata()); });
    for (const Status& s : init) ASSERT_TRUE(s.ok()) << s.ToString();
  };
  auto sync = [&](uint64_t step) {
    EXPECT_TRUE(trainer->Step(step).ok());
    for (auto& d : device) EXPECT_TRUE(d->Upload(trainer->tensors()).ok());
    return OnRanks(2, [&](int r) { return engines[r]->SendWeights(*sources[r], std::nullopt).status(); });
  };
  make();
  for (const Status& s : sync(1)) ASSERT_TRUE(s.ok()) << s.ToString();
  ExpectHolds(*tp2.service, *trainer);
  expect_passes(1);

  // Sync 2: rank 1's pass (its 2nd: one per sync) breaks at tensor 5, after it has
  // published some chunks. Every rank fails at once (not at the 20 s timeout), naming it.
  rank1.options().fail_pass = 2;
  rank1.options().fail_at = 5;
  auto t0 = std::chrono::steady_clock::now();
  auto failed = sync(2);
  double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(took, 10.0);
  ASSERT_FALSE(failed[1].ok());
  EXPECT_NE(failed[1].message().find("injected"), std::string::npos) << failed[1].ToString();
  ASSERT_FALSE(failed[0].ok());
  EXPECT_NE(failed[0].message().find("injected"), std::string::npos) << failed[0].ToString();
  EXPECT_NE(failed[0].message().find("trainer rank 1"), std::string::npos) << failed[0].ToString();
  expect_passes(2);
  // Both sessions are over: the next sync, without Init, starts a new one on both ranks
  // and lands bit-exact.
  for (const Status& s : sync(3)) ASSERT_TRUE(s.ok()) << s.ToString();
  ExpectHolds(*tp2.service, *trainer);
  expect_passes(3);

  // So does an explicit Init on every rank.
  make();
  for (uint64_t step = 4; step <= 5; ++step) {
    for (const Status& s : sync(step)) ASSERT_TRUE(s.ok()) << s.ToString();
    ExpectHolds(*tp2.service, *trainer);
  }
}

TEST_F(IpcFakeGpu, RanksSharingAGpuOrTheHostExportOnceAndAGpuNoRankIsOnIsA400) {
  auto trainer = std::move(*SyntheticTrainer::FromMetadata(HfTensors(*LookupModel("qwen3-tiny")), 13, 2));
  Group group = Group::Connect(2);
  auto engines_on = [&](const std::vector<Server*>& servers, Device d0, Device d1) {
    std::vector<std::unique_ptr<TrainerEngine>> e;
    for (int r = 0; r < 2; ++r) {
      TrainerOptions o = Options(servers, r == 0 ? d0 : d1);
      o.rank = r;
      o.comm = group.ranks[r]->comm();
      e.push_back(std::move(*CreateIpcTrainer(o)));
    }
    return e;
  };
  // Both ranks on cuda:0 export one set of slots there: the TP=2 server's worker on
  // cuda:1 has no entry, and every rank's Init fails with the server's 400 naming it.
  Server& tp2 = StartServer(2);
  auto e = engines_on({&tp2}, kCuda0, kCuda0);
  auto init = OnRanks(2, [&](int r) { return e[r]->Init(trainer->metadata()); });
  for (const Status& s : init) {
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    EXPECT_NE(s.message().find("no entry for this server's device GPU-fake-1"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("offered: GPU-fake-0"), std::string::npos) << s.message();
  }
  // The same two ranks serve a server on their GPU: rank 1 only drains.
  Server& a = StartServer(1);
  e = engines_on({&a}, kCuda0, kCuda0);
  init = OnRanks(2, [&](int r) { return e[r]->Init(trainer->metadata()); });
  for (const Status& s : init) ASSERT_TRUE(s.ok()) << s.ToString();
  // (Both drain the same host tensors: a non-sending rank only reads them.)
  std::vector<WeightSource*> sources = {&trainer->source(), &trainer->source()};
  auto synced = OnRanks(2, [&](int r) { return e[r]->SendWeights(*sources[r], std::nullopt).status(); });
  for (const Status& s : synced) ASSERT_TRUE(s.ok()) << s.ToString();
  ExpectHolds(*a.service, *trainer);
  // CPU ranks: rank 0's host slots serve every worker of the host, GPU workers included.
  ASSERT_TRUE(trainer->Step(1).ok());
  e = engines_on({&tp2}, Device{}, Device{});
  init = OnRanks(2, [&](int r) { return e[r]->Init(trainer->metadata()); });
  for (const Status& s : init) ASSERT_TRUE(s.ok()) << s.ToString();
  synced = OnRanks(2, [&](int r) { return e[r]->SendWeights(*sources[r], std::nullopt).status(); });
  for (const Status& s : synced) ASSERT_TRUE(s.ok()) << s.ToString();
  ExpectHolds(*tp2.service, *trainer);
}

}  // namespace
}  // namespace wsync
