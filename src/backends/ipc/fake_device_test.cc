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
#include "control/http_server.h"
#include "core/digest.h"
#include "model/config.h"
#include "receiver/inference_server.h"
#include "trainer/synthetic.h"
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
  };
  int DeviceCount() override { return 4; }
  Status SetDevice(int) override { return Status::Ok(); }
  Result<void*> Allocate(int, size_t bytes) override {
    size_t n = (std::max<size_t>(bytes, 1) + 255) / 256 * 256;
    void* p = std::aligned_alloc(256, n);
    std::memset(p, 0, n);
    std::lock_guard lock(mu_);
    live_[reinterpret_cast<uintptr_t>(p)] = Allocation{static_cast<std::byte*>(p), n, ++serial_};
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
    return std::unique_ptr<DeviceImport>(std::make_unique<Import>(a->base, &imports));
  }
  Result<std::unique_ptr<DeviceCopies>> Copies(const Device&, std::span<const WorkerStore::ByteCopy> copies) override {
    plans.fetch_add(1);
    return std::unique_ptr<DeviceCopies>(std::make_unique<Copier>(copies, &launches));
  }
  Status Synchronize(const Device&) override { return Status::Ok(); }
  Result<std::pair<uint64_t, uint64_t>> MemoryInfo(const Device&) override {
    uint64_t total = uint64_t{1} << 40;
    return std::pair<uint64_t, uint64_t>{total - rt_->live_bytes(), total};
  }

  std::atomic<int> imports{0};   // mappings alive
  std::atomic<int> opens{0};     // mappings ever made
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
    Copier(std::span<const WorkerStore::ByteCopy> c, std::atomic<int>* launches)
        : copies_(c.begin(), c.end()), launches_(launches) {}
    Status Run() override {
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
    std::vector<WorkerStore::ByteCopy> copies_;
    std::atomic<int>* launches_;
  };
  FakeRuntime* rt_;
};

struct Server {
  std::unique_ptr<InferenceServer> service;
  std::unique_ptr<HttpControlServer> http;
  std::string url() const { return http->url(); }
};

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
  Server& StartServer(int tp, Device device = kCuda0) {
    InferenceServerOptions o;
    o.model = "qwen3-tiny";
    o.tp = tp;
    o.device = device;
    o.backend = "ipc";
    o.timeout_seconds = 20;
    auto made = InferenceServer::Create(o, [](std::string_view, ReceiverContext* c) { return CreateIpcReceiver(c); });
    EXPECT_TRUE(made.ok()) << made.status().ToString();
    Server s;
    s.service = std::move(*made);
    s.http = std::move(*HttpControlServer::Start(HttpServerOptions{}, s.service.get()));
    s.service->set_url(s.http->url());
    servers_.push_back(std::make_unique<Server>(std::move(s)));
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
    auto sums = server.Checksums(DigestAlgorithm::kXxh3_128);
    ASSERT_TRUE(sums.ok()) << sums.status().ToString();
    for (const HostTensor& t : trainer.tensors()) {
      EXPECT_EQ((*sums)[t.meta.name], HexDigest(DigestAlgorithm::kXxh3_128, t.storage.span().first(t.meta.nbytes())))
          << t.meta.name;
    }
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
      EXPECT_EQ(st->chunks, zero_copy ? 1u : st->chunks);
      if (!zero_copy) EXPECT_GE(st->chunks, 3u);
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
  // A zero-copy-only trainer needs a DeviceTensorSource.
  IpcTrainerOptions ipc;
  ipc.mode = IpcTrainerOptions::Mode::kZeroCopy;
  auto zc = std::move(*CreateIpcTrainerWith(Options({&a}), ipc));
  ASSERT_TRUE(zc->Init(trainer->metadata()).ok());
  Status s = zc->SendWeights(trainer->source(), std::nullopt).status();
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_NE(s.message().find("DeviceTensorSource"), std::string::npos) << s.message();
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
  s = a.service->InitWeightTransfer(info.ToJson());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("cannot open the cuda_ipc handle"), std::string::npos) << s.message();
  region.reset();
  // The server keeps serving.
  auto good = std::move(*CreateIpcTrainer(Options({&a})));
  ASSERT_TRUE(good->Init(trainer->metadata()).ok());
  ASSERT_TRUE(good->SendWeights(trainer->source(), std::nullopt).ok());
  ExpectHolds(*a.service, *trainer);
}

}  // namespace
}  // namespace wsync
