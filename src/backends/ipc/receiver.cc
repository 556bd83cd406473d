#include "backends/ipc/receiver.h"

#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "backends/ipc/device_plane.h"
#include "backends/ipc/protocol.h"
#include "backends/ipc/region.h"
#include "core/checked_math.h"
#include "core/log.h"
#include "model/worker_store.h"
#include "receiver/worker_fanout.h"
#include "receiver/worker_thread.h"

namespace wsync {
namespace {

using nlohmann::json;

// What a sync's batched copies were built for: the update's tensors and where they sit.
// The tensor list is shared with the server, the same object sync after sync while the
// trainer's update does not change, so that the comparison is usually a pointer's.
struct CopyLayout {
  std::shared_ptr<const std::vector<TensorMeta>> tensors;
  std::vector<uint64_t> offsets;
  std::vector<uint64_t> chunk_ends;
  uint64_t generation = 0;  // zero-copy: the mapping's generation
  bool operator==(const CopyLayout& o) const {
    return generation == o.generation && offsets == o.offsets && chunk_ends == o.chunk_ends &&
           (tensors == o.tensors || (tensors != nullptr && o.tensors != nullptr && *tensors == *o.tensors));
  }
};

// One worker's side of a session's data plane. A CUDA worker reads either device slots
// (mapped once, shared by the session's workers on the same GPU), or host slots (a CPU
// trainer: each tensor goes host -> device), or none (a zero-copy-only trainer). Only the
// worker's own thread touches it during an update.
struct WorkerPlane {
  enum class Slots { kHost, kDevice, kNone };
  Slots slots = Slots::kHost;
  std::string key;                         // the worker's device key
  int publisher = 0;                       // the trainer rank's line whose slots it reads
  std::shared_ptr<DeviceImport> staging;   // kDevice
  uint64_t offset = 0, stride = 0;         // of slot k: staging + offset + k * stride
  CopyLayout packed_layout;                // what `packed` was built for
  DeviceCopyCache packed;                  // one batched copy per (chunk, slot)
  // Zero-copy: the trainer's tensors mapped under `generation` (0: none), at `zc_offset`.
  std::shared_ptr<DeviceImport> zc;
  uint64_t generation = 0;
  uint64_t zc_offset = 0;
  CopyLayout zc_layout;
  DeviceCopyCache zc_copies;
};

// One mapped session: the region, what init said about it, and each worker's plane (in
// the order of the context's workers).
struct Session {
  std::unique_ptr<IpcRegion> region;
  IpcInitInfo info;
  double timeout = 300;
  std::vector<std::unique_ptr<WorkerPlane>> planes;
};

class IpcReceiver final : public ReceiverBackend {
 public:
  IpcReceiver(ReceiverContext* ctx, IpcOpenPolicy policy) : ctx_(ctx), policy_(std::move(policy)) {
    watcher_ = std::thread([this] { Watch(); });
  }
  ~IpcReceiver() override {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    watcher_.join();
    Shutdown();
  }

  std::string_view name() const override { return "ipc"; }

  Status Init(const json& init_info) override {
    WSYNC_ASSIGN_OR_RETURN(IpcInitInfo info, IpcInitInfo::Parse(init_info));
    int tp = ctx_->tp_size;
    for (const ReceiverWorker& w : ctx_->workers) {
      int reader = info.reader_offset + ctx_->DeploymentIndex(w);
      if (reader >= info.reader_count) {
        return InvalidArgument(fmt::format(
            "{} would be reader {} (reader_offset {} + dp {} * tp {} + tp rank {}), outside reader_count {}",
            w.label, reader, info.reader_offset, w.dp_index, tp, w.tp_rank, info.reader_count));
      }
    }
    auto session = std::make_shared<Session>();
    std::vector<const IpcBufferDesc*> buffers;
    for (const ReceiverWorker& w : ctx_->workers) {
      session->planes.push_back(std::make_unique<WorkerPlane>());
      WSYNC_ASSIGN_OR_RETURN(const IpcBufferDesc* b, PickBuffer(w, info, *session->planes.back()));
      buffers.push_back(b);
    }
    WSYNC_ASSIGN_OR_RETURN(session->region, IpcRegion::Open(info, policy_));
    if (!session->region->TrainerAlive()) {
      return InvalidArgument(fmt::format("the trainer that created ipc region {} (pid {}) has exited",
                                         info.control_path, session->region->trainer_pid()));
    }
    std::map<int, std::shared_ptr<DeviceImport>> opened;  // device index -> its slots
    for (size_t i = 0; i < ctx_->workers.size(); ++i) {
      WSYNC_RETURN_IF_ERROR(
          OpenSlots(ctx_->workers[i], info, *buffers[i], *session->region, opened, *session->planes[i]));
    }
    for (size_t i = 0; i < ctx_->workers.size(); ++i) {
      const ReceiverWorker& w = ctx_->workers[i];
      session->region->Attach(info.reader_offset + ctx_->DeploymentIndex(w), static_cast<uint32_t>(getpid()),
                              session->planes[i]->publisher);
    }
    session->info = info;
    session->timeout = ctx_->TimeoutFor(info.timeout_seconds);
    WSYNC_LOG_INFO("ipc session {}: mapped {} ({} slot(s) of {} bytes), readers {}..{} of {}", info.session,
                   info.control_path, info.num_slots, info.slot_bytes, info.reader_offset,
                   info.reader_offset + static_cast<int>(ctx_->workers.size()) - 1, info.reader_count);
    std::lock_guard lock(mu_);
    session_ = std::move(session);  // the previous session's mapping goes here
    return Status::Ok();
  }

  Status Update(const UpdateRequest& req) override {
    if (!req.reject.ok()) return req.reject;  // nothing to join: the trainer sees the HTTP error
    std::shared_ptr<Session> session;
    {
      std::lock_guard lock(mu_);
      session = session_;
    }
    if (!session) {
      return FailedPrecondition(
          "no ipc staging region is mapped: call init_weight_transfer_engine first (a session ends "
          "when its trainer exits)");
    }
    IpcRegion& region = *session->region;
    if (Status s = region.CheckStillMapped(); !s.ok()) {
      Release(session);
      return s;
    }
    WSYNC_ASSIGN_OR_RETURN(IpcUpdateInfo u, ParseAndValidate(req, session));
    IpcRegion::Announcement a = region.Announced();
    if (a.sync == 0 || a.first_seq == 0) {
      return FailedPrecondition(fmt::format("the trainer of ipc session {} announced no sync in its control region "
                                            "before update_weights", u.session));
    }
    u.sync = a.sync;
    u.first_seq = a.first_seq;
    WSYNC_RETURN_IF_ERROR(CheckPlanes(*session, u));
    if (!region.TrainerAlive()) {
      Release(session);
      return FailedPrecondition(fmt::format(
          "the trainer of ipc session {} (pid {}) has exited; its region is released: call "
          "init_weight_transfer_engine again", u.session, region.trainer_pid()));
    }
    for (const ReceiverWorker& w : ctx_->workers) {
      int reader = session->info.reader_offset + ctx_->DeploymentIndex(w);
      if (region.acked(reader) >= u.first_seq) {
        return FailedPrecondition(fmt::format("the trainer announced sync {} from chunk seq {}, which {} has already "
                                              "consumed", u.sync, u.first_seq, w.label));
      }
    }

    Deadline deadline = Deadline::InSeconds(session->timeout);
    if (u.zero_copy) WSYNC_RETURN_IF_ERROR(MapZeroCopy(*session, u));
    std::atomic<size_t> landed{0};
    const std::shared_ptr<const std::vector<TensorMeta>>& tensors = req.tensors;
    Status first = RunOnEveryWorker(ctx_->workers, "update_weights", deadline, [&](size_t i, const ReceiverWorker& w) {
      int reader = session->info.reader_offset + ctx_->DeploymentIndex(w);
      WorkerPlane& plane = *session->planes[i];
      if (u.zero_copy) return ReceiveZeroCopy(w, plane, reader, region, u, tensors, deadline, landed);
      if (plane.slots == WorkerPlane::Slots::kDevice) {
        return ReceiveDevice(w, plane, reader, region, u, tensors, deadline, landed);
      }
      return Receive(w, reader, region, u, *tensors, deadline, landed);
    });
    if (first.ok()) return first;
    if (!region.TrainerAlive() || !region.CheckStillMapped().ok()) Release(session);
    if (first.code() == StatusCode::kAborted && landed.load() > 0) {
      // Some shards already hold the new sync's bytes: not a clean refusal.
      return Unavailable(fmt::format("{} ({} chunk load(s) had landed; weights are mixed until the next sync)",
                                     first.message(), landed.load()));
    }
    return first;
  }

  void Shutdown() override {
    std::lock_guard lock(mu_);
    session_.reset();
  }

 private:
  // The update's ipc fields, checked against its tensors and the session; a body already
  // checked for this session (the same object, see UpdateRequest) is not parsed again.
  Result<IpcUpdateInfo> ParseAndValidate(const UpdateRequest& req, const std::shared_ptr<Session>& session) {
    if (req.update_info == checked_.info.lock() && req.tensors == checked_.tensors && session == checked_.session.lock()) {
      return checked_.update;
    }
    checked_ = Checked{};
    WSYNC_ASSIGN_OR_RETURN(IpcUpdateInfo u, IpcUpdateInfo::Parse(*req.update_info));
    if (u.session != session->info.session) {
      return FailedPrecondition(fmt::format(
          "update_info names ipc session {}, but this server mapped session {}: call "
          "init_weight_transfer_engine for the new session", u.session, session->info.session));
    }
    WSYNC_RETURN_IF_ERROR(u.Validate(*req.tensors, session->region->slot_bytes()));
    checked_ = Checked{req.update_info, req.tensors, session, u};
    return u;
  }

  // Lands every chunk of the update from the host slots in one worker's shards (a CUDA
  // worker copies each tensor host -> device); runs on the worker's thread.
  static Status Receive(const ReceiverWorker& w, int reader, IpcRegion& region, const IpcUpdateInfo& u,
                        const std::vector<TensorMeta>& tensors, Deadline deadline, std::atomic<size_t>& landed) {
    size_t n = u.num_chunks();
    for (size_t k = 0; k < n; ++k) {
      uint64_t seq = u.first_seq + k;
      std::string what = fmt::format("{}: chunk {}/{} of sync {}", w.label, k + 1, n, u.sync);
      WSYNC_RETURN_IF_ERROR(region.WaitPublished(seq, u.sync, deadline, what, 0));
      std::span<std::byte> slot = region.slot(static_cast<int>(seq % region.num_slots()));
      for (size_t i = u.chunk_first(k); i < u.chunk_ends[k]; ++i) {
        const TensorMeta& m = tensors[i];
        TensorRef ref{m.name, m.dtype, m.shape, slot.subspan(u.tensor_offsets[i], u.tensor_sizes[i]), Device{}};
        WSYNC_RETURN_IF_ERROR(w.sink->Load(ref).WithContext(w.label));
      }
      WSYNC_RETURN_IF_ERROR(w.sink->ChunkLanded().WithContext(w.label));
      landed.fetch_add(1);
      WSYNC_RETURN_IF_ERROR(region.CheckStillMapped().WithContext(what));  // what it read was the file's
      region.Ack(reader, seq);
    }
    return Status::Ok();
  }

  // Where worker `w` reads this session's chunks from: its own GPU's slots, the host
  // slots of the region (CPU workers, or CUDA workers of a trainer on this host's CPU),
  // or nothing (kind none: a zero-copy-only trainer). Fills plane.key and plane.slots.
  Result<const IpcBufferDesc*> PickBuffer(const ReceiverWorker& w, const IpcInitInfo& info, WorkerPlane& plane) {
    plane.key = HostDeviceKey();
    if (!w.device.is_cpu()) {
      WSYNC_ASSIGN_OR_RETURN(plane.key, IpcDeviceKey(w.device));
      auto it = info.buffers.find(plane.key);
      if (it != info.buffers.end()) {
        const IpcBufferDesc& b = it->second;
        if (b.kind == "none") {
          plane.slots = WorkerPlane::Slots::kNone;
        } else if (b.kind == "cuda_ipc" || b.kind == "cuda_fd") {
          plane.slots = WorkerPlane::Slots::kDevice;
        } else {
          return InvalidArgument(fmt::format("init_info buffers['{}'] is of kind {}; {} on {} reads cuda_ipc or "
                                             "cuda_fd", plane.key, b.kind, w.label, w.device.ToString()));
        }
        plane.publisher = b.publisher;
        return &b;
      }
      if (!info.buffers.contains(HostDeviceKey())) {
        return info.FindBuffer(plane.key).status().WithContext(fmt::format("{} (on {})", w.label, w.device.ToString()));
      }
    }
    std::string key = HostDeviceKey();
    WSYNC_ASSIGN_OR_RETURN(const IpcBufferDesc* host, info.FindBuffer(key));
    if (host->kind != "shm") {
      return InvalidArgument(fmt::format("init_info buffers['{}'] is of kind {}, CPU workers read kind shm", key,
                                         host->kind));
    }
    if (host->publisher != 0) {
      return InvalidArgument(fmt::format("init_info buffers['{}'] names publisher {}; the host slots are rank 0's "
                                         "(publisher 0)", key, host->publisher));
    }
    plane.slots = WorkerPlane::Slots::kHost;
    return host;
  }

  // Checks the host slots against the region, or opens a GPU's slots once (shared through
  // `opened` with the session's other workers on that GPU, on the thread of the first).
  Status OpenSlots(const ReceiverWorker& w, const IpcInitInfo& info, const IpcBufferDesc& buffer, IpcRegion& region,
                   std::map<int, std::shared_ptr<DeviceImport>>& opened, WorkerPlane& plane) {
    if (plane.slots == WorkerPlane::Slots::kNone) return Status::Ok();
    if (plane.slots == WorkerPlane::Slots::kHost) {
      if (buffer.offset != region.header_bytes() || buffer.stride != region.slot_stride() ||
          region.slot(region.num_slots() - 1).empty()) {
        return InvalidArgument(fmt::format(
            "init_info buffers['{}'] puts the slots at offset {} stride {}, but the region {} holds them at "
            "offset {} stride {} in {} bytes", HostDeviceKey(), buffer.offset, buffer.stride, info.control_path,
            region.header_bytes(), region.slot_stride(), region.bytes()));
      }
      return Status::Ok();
    }
    plane.offset = buffer.offset;
    plane.stride = buffer.stride;
    std::shared_ptr<DeviceImport>& staging = opened[w.device.index];
    if (!staging) {
      std::optional<uint64_t> end = CheckedMulAdd(buffer.stride, info.num_slots, buffer.offset);
      if (!end) {
        return InvalidArgument(fmt::format("init_info buffers['{}'] offset {} + stride {} x num_slots {} overflows 64 bits",
                                           plane.key, buffer.offset, buffer.stride, info.num_slots));
      }
      uint64_t bytes = *end;
      std::unique_ptr<DeviceImport> m;
      Status s = RunOnWorker(w, [&]() -> Status {
        WSYNC_ASSIGN_OR_RETURN(m, DeviceImport::Open(w.device, buffer.kind, buffer.handle, bytes));
        return Status::Ok();
      });
      if (!s.ok()) return InvalidArgument(fmt::format("init_info buffers['{}']: {}: {}", plane.key, w.label, s.message()));
      staging = std::move(m);
      WSYNC_LOG_INFO("ipc session {}: {} mapped {} bytes of {} staging on {}", info.session, w.label, bytes,
                     buffer.kind, w.device.ToString());
    }
    plane.staging = staging;
    return Status::Ok();
  }

  // What no worker could do with this update, refused before anyone waits.
  Status CheckPlanes(const Session& session, const IpcUpdateInfo& u) const {
    for (size_t i = 0; i < ctx_->workers.size(); ++i) {
      const ReceiverWorker& w = ctx_->workers[i];
      const WorkerPlane& plane = *session.planes[i];
      if (u.zero_copy) {
        if (w.device.is_cpu()) {
          return InvalidArgument(fmt::format("{} is on cpu; a zero-copy update needs workers on the trainer's GPU",
                                             w.label));
        }
        if (plane.generation != u.zero_copy->generation && !u.zero_copy->buffers.contains(plane.key)) {
          if (u.zero_copy->buffers.empty()) {
            return FailedPrecondition(fmt::format(
                "update_info names zero-copy generation {} of session {}, but {} has mapped generation {} and the "
                "update carries no handle: the trainer must send it again", u.zero_copy->generation, u.session,
                w.label, plane.generation));
          }
          std::vector<std::string> keys;
          for (const auto& [k, _] : u.zero_copy->buffers) keys.push_back(k);
          return InvalidArgument(fmt::format(
              "update_info zero_copy buffers has no entry for {}'s device {} (offered: {}): zero-copy needs the "
              "trainer's tensors on the same GPU", w.label, plane.key, fmt::join(keys, ", ")));
        }
        // The go comes on the line of the trainer rank this worker attached to at init.
        auto entry = u.zero_copy->buffers.find(plane.key);
        if (entry != u.zero_copy->buffers.end() && entry->second.publisher != plane.publisher) {
          return InvalidArgument(fmt::format(
              "update_info zero_copy buffers['{}'] names publisher {}, but init_info gave {} publisher {}",
              plane.key, entry->second.publisher, w.label, plane.publisher));
        }
      } else if (plane.slots == WorkerPlane::Slots::kNone) {
        return InvalidArgument(fmt::format(
            "this ipc session has no staging slots on {} (the trainer sends zero-copy updates only), but update "
            "{} is packed", plane.key, u.sync));
      }
    }
    return Status::Ok();
  }

  // Maps the trainer's tensors for a zero-copy update whose generation a worker has not
  // mapped yet: once per GPU, on the thread of the first worker there; the previous
  // generation's mapping goes.
  Status MapZeroCopy(Session& session, const IpcUpdateInfo& u) {
    // Every old mapping goes first: a process must not hold two mappings of one allocation.
    for (auto& plane : session.planes) {
      if (plane->generation == u.zero_copy->generation) continue;
      plane->zc_copies.Clear();
      plane->zc.reset();
      plane->generation = 0;
    }
    std::map<int, std::shared_ptr<DeviceImport>> opened;
    for (size_t i = 0; i < ctx_->workers.size(); ++i) {
      const ReceiverWorker& w = ctx_->workers[i];
      WorkerPlane& plane = *session.planes[i];
      if (plane.generation == u.zero_copy->generation) continue;
      const IpcBufferDesc& buffer = u.zero_copy->buffers.at(plane.key);  // CheckPlanes made sure
      std::shared_ptr<DeviceImport>& mapping = opened[w.device.index];
      if (!mapping) {
        std::optional<uint64_t> end = CheckedAdd(buffer.offset, u.zero_copy->bytes);
        if (!end) {
          return InvalidArgument(fmt::format("update_info zero_copy buffers['{}'] offset {} + bytes {} overflows 64 bits",
                                             plane.key, buffer.offset, u.zero_copy->bytes));
        }
        std::unique_ptr<DeviceImport> m;
        Status s = RunOnWorker(w, [&]() -> Status {
          WSYNC_ASSIGN_OR_RETURN(m, DeviceImport::Open(w.device, buffer.kind, buffer.handle, *end));
          return Status::Ok();
        });
        if (!s.ok()) {
          return InvalidArgument(fmt::format("update_info zero_copy buffers['{}']: {}: {}", plane.key, w.label,
                                             s.message()));
        }
        mapping = std::move(m);
        WSYNC_LOG_INFO("ipc session {}: {} mapped the trainer's tensors ({} bytes, generation {}) on {}", u.session,
                       w.label, u.zero_copy->bytes, u.zero_copy->generation, w.device.ToString());
      }
      plane.zc = mapping;
      plane.zc_offset = buffer.offset;
      plane.generation = u.zero_copy->generation;
      plane.zc_copies.Clear();
      plane.zc_layout = CopyLayout{};
    }
    return Status::Ok();
  }

  // The copies that land tensors [first, end) of `tensors` from `base + offsets[i]` in
  // the worker's shards.
  static Result<DeviceCopyCache::Copies> LandingCopies(const ReceiverWorker& w, const std::byte* base,
                                                       const std::vector<TensorMeta>& tensors, const IpcUpdateInfo& u,
                                                       size_t first, size_t end) {
    DeviceCopyCache::Copies copies;
    for (size_t i = first; i < end; ++i) {
      const TensorMeta& m = tensors[i];
      std::span<std::byte> bytes(const_cast<std::byte*>(base) + u.tensor_offsets[i], u.tensor_sizes[i]);
      TensorRef ref{m.name, m.dtype, m.shape, bytes, w.device};
      WSYNC_RETURN_IF_ERROR(w.sink->PlanLoad(ref, &copies).WithContext(w.label));
    }
    return copies;
  }

  // Hands tensors [first, end) of `tensors`, at `base + offsets[i]` on the worker's
  // device, to a sink that does not plan copies, as one chunk.
  static Status LendChunk(const ReceiverWorker& w, const std::byte* base, const std::vector<TensorMeta>& tensors,
                          const IpcUpdateInfo& u, size_t first, size_t end) {
    for (size_t i = first; i < end; ++i) {
      const TensorMeta& m = tensors[i];
      TensorRef ref{m.name, m.dtype, m.shape, {base + u.tensor_offsets[i], u.tensor_sizes[i]}, w.device};
      WSYNC_RETURN_IF_ERROR(w.sink->Load(ref).WithContext(w.label));
    }
    return w.sink->ChunkLanded().WithContext(w.label);
  }

  // Lands every chunk from the device slots, each with one batched copy built once per
  // (layout, slot), or lent chunk by chunk to a sink that plans no copies; runs on the
  // worker's thread.
  static Status ReceiveDevice(const ReceiverWorker& w, WorkerPlane& plane, int reader, IpcRegion& region,
                              const IpcUpdateInfo& u, const std::shared_ptr<const std::vector<TensorMeta>>& tensors,
                              Deadline deadline, std::atomic<size_t>& landed) {
    if (!w.sink->PlansCopies()) {
      for (size_t k = 0; k < u.num_chunks(); ++k) {
        uint64_t seq = u.first_seq + k;
        int slot = static_cast<int>(seq % region.num_slots());
        std::string what = fmt::format("{}: chunk {}/{} of sync {}", w.label, k + 1, u.num_chunks(), u.sync);
        WSYNC_RETURN_IF_ERROR(region.WaitPublished(seq, u.sync, deadline, what, plane.publisher));
        const std::byte* base = plane.staging->data() + plane.offset + static_cast<uint64_t>(slot) * plane.stride;
        WSYNC_RETURN_IF_ERROR(LendChunk(w, base, *tensors, u, u.chunk_first(k), u.chunk_ends[k]));
        landed.fetch_add(1);
        region.Ack(reader, seq);
      }
      return Status::Ok();
    }
    CopyLayout layout{tensors, u.tensor_offsets, u.chunk_ends, 0};
    if (!(layout == plane.packed_layout)) {
      plane.packed.Clear();
      plane.packed_layout = std::move(layout);
    }
    size_t n = u.num_chunks();
    for (size_t k = 0; k < n; ++k) {
      uint64_t seq = u.first_seq + k;
      int slot = static_cast<int>(seq % region.num_slots());
      size_t key = k * kIpcMaxSlots + static_cast<size_t>(slot);
      DeviceCopies* copies = plane.packed.Find(key);
      if (copies == nullptr) {  // first sync of this layout: plan before waiting
        const std::byte* base = plane.staging->data() + plane.offset + static_cast<uint64_t>(slot) * plane.stride;
        WSYNC_ASSIGN_OR_RETURN(auto list, LandingCopies(w, base, *tensors, u, u.chunk_first(k), u.chunk_ends[k]));
        WSYNC_ASSIGN_OR_RETURN(copies, plane.packed.Get(w.device, key, list));
      }
      std::string what = fmt::format("{}: chunk {}/{} of sync {}", w.label, k + 1, n, u.sync);
      WSYNC_RETURN_IF_ERROR(region.WaitPublished(seq, u.sync, deadline, what, plane.publisher));
      WSYNC_RETURN_IF_ERROR(copies->Run().WithContext(fmt::format("landing {}", what)));
      w.sink->PlannedCopiesRan(std::span(*tensors).subspan(u.chunk_first(k), u.chunk_ends[k] - u.chunk_first(k)));
      landed.fetch_add(1);
      region.Ack(reader, seq);
    }
    return Status::Ok();
  }

  // Waits for the go, then copies straight from the trainer's tensors into the shards in
  // one batched copy (built once per layout and generation), or lends them to a sink
  // that plans no copies as one chunk.
  static Status ReceiveZeroCopy(const ReceiverWorker& w, WorkerPlane& plane, int reader, IpcRegion& region,
                                const IpcUpdateInfo& u, const std::shared_ptr<const std::vector<TensorMeta>>& tensors,
                                Deadline deadline, std::atomic<size_t>& landed) {
    if (u.num_chunks() == 0) return Status::Ok();
    if (plane.generation != u.zero_copy->generation || !plane.zc) {  // MapZeroCopy made sure; never read stale
      return Internal(fmt::format("{}: zero-copy generation {} is not mapped", w.label, u.zero_copy->generation));
    }
    CopyLayout layout{tensors, u.tensor_offsets, u.chunk_ends, plane.generation};
    if (!(layout == plane.zc_layout)) {
      plane.zc_copies.Clear();
      plane.zc_layout = std::move(layout);
    }
    const bool lend = !w.sink->PlansCopies();  // the trainer's tensors go to the sink as one chunk
    DeviceCopies* copies = lend ? nullptr : plane.zc_copies.Find(0);
    if (copies == nullptr && !lend) {
      WSYNC_ASSIGN_OR_RETURN(auto list, LandingCopies(w, plane.zc->data() + plane.zc_offset, *tensors, u, 0,
                                                      tensors->size()));
      WSYNC_ASSIGN_OR_RETURN(copies, plane.zc_copies.Get(w.device, 0, list));
    }
    std::string what = fmt::format("{}: zero-copy go of sync {}", w.label, u.sync);
    WSYNC_RETURN_IF_ERROR(region.WaitPublished(u.first_seq, u.sync, deadline, what, plane.publisher));
    if (lend) {
      WSYNC_RETURN_IF_ERROR(LendChunk(w, plane.zc->data() + plane.zc_offset, *tensors, u, 0, tensors->size()));
    } else {
      WSYNC_RETURN_IF_ERROR(copies->Run().WithContext(fmt::format("landing {}", what)));
      w.sink->PlannedCopiesRan(*tensors);
    }
    landed.fetch_add(1);
    region.Ack(reader, u.first_seq);
    return Status::Ok();
  }

  // Drops `session` if it is still the current one.
  void Release(const std::shared_ptr<Session>& session) {
    std::lock_guard lock(mu_);
    if (session_ == session) {
      WSYNC_LOG_WARN("ipc session {}: the trainer exited; releasing its region", session->info.session);
      session_.reset();
    }
  }

  // Releases the mapping of a trainer that exited between calls, so that its staging
  // memory is not pinned by this server until the next init.
  void Watch() {
    std::unique_lock lock(mu_);
    while (!cv_.wait_for(lock, std::chrono::seconds(1), [&] { return stopping_; })) {
      if (session_ && !session_->region->TrainerAlive()) {
        WSYNC_LOG_INFO("ipc session {}: the trainer exited; releasing its region", session_->info.session);
        session_.reset();
      }
    }
  }

  ReceiverContext* ctx_;
  const IpcOpenPolicy policy_;
  // The last update that passed ParseAndValidate (used by Update only, which the server
  // never runs twice at once).
  struct Checked {
    std::weak_ptr<const json> info;  // not an owner: the request's body is the router's to keep
    std::shared_ptr<const std::vector<TensorMeta>> tensors;
    std::weak_ptr<Session> session;  // not an owner: a released session's mapping goes
    IpcUpdateInfo update;
  } checked_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::shared_ptr<Session> session_;  // GUARDED_BY(mu_); an update holds its own reference
  bool stopping_ = false;             // GUARDED_BY(mu_)
  std::thread watcher_;
};

}  // namespace

Result<std::unique_ptr<ReceiverBackend>> CreateIpcReceiver(ReceiverContext* context) {
  IpcOpenPolicy policy;
  auto it = context->backend_config.find("ipc_shm_dir");
  if (it != context->backend_config.end()) {
    if (!it->is_string() || it->get<std::string>().empty() || it->get<std::string>().front() != '/') {
      return InvalidArgument(fmt::format("ipc_shm_dir must be an absolute directory, got {}", it->dump()));
    }
    policy.shm_dir = it->get<std::string>();
  }
  return std::unique_ptr<ReceiverBackend>(std::make_unique<IpcReceiver>(context, std::move(policy)));
}

}  // namespace wsync
