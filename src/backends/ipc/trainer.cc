#include "backends/ipc/trainer.h"

#include <fcntl.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "backends/ipc/device_plane.h"
#include "backends/ipc/protocol.h"
#include "engine/rank_exchange.h"
#include "backends/ipc/storage_layout.h"
#include "comm/communicator.h"
#include "control/session_driver.h"
#include "core/digest.h"
#include "core/log.h"
#include "core/parallel.h"
#include "core/stopwatch.h"
#include "engine/backend_options.h"
#include "engine/engine.h"
#include "engine/sync_pass.h"
#include "wsync/source.h"

namespace wsync {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;
using Pending = SessionDriver::Pending;

// Copies one tensor into the slot, on several threads when it is large. With a `hasher`
// (in-line verification), the bytes read are hashed too: as they are copied, on one
// thread; or, a large tensor on more than two threads, by the calling thread while the
// others copy.
void CopyInto(std::byte* dst, std::span<const std::byte> src, size_t threads, Hasher* hasher = nullptr) {
  constexpr size_t kPiece = size_t{8} << 20;
  if (src.size() < 2 * kPiece || threads <= 1 || (hasher != nullptr && threads <= 2)) {
    if (hasher != nullptr) {
      CopyAndHash(dst, src, *hasher, /*hash_destination=*/false);
    } else {
      std::memcpy(dst, src.data(), src.size());
    }
    return;
  }
  size_t pieces = (src.size() + kPiece - 1) / kPiece;
  auto copy = [&](size_t b, size_t e) {
    size_t from = b * kPiece, to = std::min(src.size(), e * kPiece);
    std::memcpy(dst + from, src.data() + from, to - from);
  };
  if (hasher == nullptr) {
    ParallelFor(pieces, threads, copy);
    return;
  }
  std::thread copier([&] { ParallelFor(pieces, threads - 1, copy); });
  hasher->Update(src);
  copier.join();
}

class IpcPlane final : public DataPlane {
  // What the ranks of a group agree on before each sync.
  struct GroupSync {
    bool zero_copy = false;
    std::map<std::string, IpcBufferDesc> buffers;  // zero-copy: every publisher's tensors
  };

 public:
  IpcPlane(const TrainerOptions& o, const IpcTrainerOptions& ipc) : options_(o), ipc_(ipc) {}
  ~IpcPlane() override { Shutdown(); }

  // With several ranks every rank runs the plane.
  SessionShape Shape() override {
    SessionShape shape;
    if (AllRanks()) shape.other_rank_sync = [this](SyncContext& sync) { return SyncOtherRank(sync); };
    return shape;
  }

  Status Init(const PlaneInit& init) override {
    Shutdown();
    driver_ = init.driver;
    group_ = zero_copy_group_ = false;
    publisher_ = options_.rank == 0 ? 0 : -1;
    if (AllRanks()) return InitGroup(init);
    WSYNC_ASSIGN_OR_RETURN(Offer offer, CreateSession(init, 1));
    return OfferSession(std::move(offer));
  }

  // A group's ranks answer together (one small all-gather): a failed sync ends the
  // session of the ranks it reached, and every rank initializes again when any lacks one.
  Result<bool> Ready(const Status& mine) override {
    if (!AllRanks()) {
      WSYNC_RETURN_IF_ERROR(mine);
      return region_ != nullptr;
    }
    WSYNC_ASSIGN_OR_RETURN(Communicator * comm, RankComm());
    json j = mine.ok() ? json{{"down", !session_}} : StatusToJson(mine);
    WSYNC_ASSIGN_OR_RETURN(std::vector<std::string> all,
                           AllGatherStrings(*comm, j.dump(), Deadline::InSeconds(options_.timeout_seconds)));
    bool down = false;
    for (size_t r = 0; r < all.size(); ++r) {
      json e = json::parse(all[r]);
      if (e.contains("error")) {
        return StatusFromJson(e, static_cast<int>(r) == options_.rank ? "" : fmt::format("trainer rank {}", r));
      }
      down = down || e["down"].get<bool>();
    }
    return !down;
  }

  // Rank 0: the ranks' exchange, the plan and the update body; the sync is announced to
  // the other publishers. Nothing reaches the servers.
  Status Prepare(SyncContext& sync) override {
    sync_begun_ = false;
    pass_read_ = false;
    Status mine = region_ ? Status::Ok() : FailedPrecondition("no ipc session: call Init() (a failed sync ends the session)");
    GroupSync group;
    if (group_) {
      Status read = ReadPassFirst(sync.pass);
      if (mine.ok()) mine = read;
      WSYNC_ASSIGN_OR_RETURN(group, ExchangeSyncState(sync.pass, mine));
    } else {
      WSYNC_RETURN_IF_ERROR(mine);
    }
    // From here on the sync has begun: with several publishers, a failure aborts it for
    // the other ranks (Abort), which are already waiting for its announcement.
    sync_begun_ = true;
    return Plan(sync, group);
  }

  Status Transfer(SyncContext& sync, Pending& update) override {
    auto check = SenderCheck(update, update_.sync);
    Status s = zero_copy_ ? Go(update_, plan_.payload_bytes, check, sync.deadline)
                          : Transfer(sync.pass, sync.pass.metadata(), plan_, update_, check, sync.deadline);
    if (s.ok()) s = update.Wait(driver_->deadlines().Http()).status();
    if (!s.ok()) return s;
    next_seq_ += plan_.chunk_ends.size();
    if (update_.zero_copy) zero_copy_sent_ = true;  // every server has mapped this generation
    return Status::Ok();
  }

  // Once the update is posted, the readers are stopped and the session ends (Init again);
  // before, only a sync several publishers await is aborted.
  Status Abort(const Status& cause, Pending* update) override {
    if (!region_ || !sync_begun_) return cause;
    if (update == nullptr) {
      if (region_->publisher_count() > 1) {
        region_->Abort(sync_, fmt::format("trainer rank 0: {}", cause.message()));
        Shutdown();
      }
      return cause;
    }
    Status s = cause;
    region_->Abort(update_.sync, s.message());
    // A server's own account explains more than "it stopped acknowledging".
    if (s.code() == StatusCode::kAborted || s.code() == StatusCode::kDeadlineExceeded) {
      Result<std::vector<json>> r = update->Wait(Deadline::InSeconds(2));
      if (!r.ok() && r.status().code() != StatusCode::kDeadlineExceeded) s = r.status();
    }
    Quiesce(update);
    Shutdown();
    return s;
  }

  Result<SyncStats> SyncOtherRank(SyncContext& sync) {
    if (publisher_ > 0) return SendAsPublisher(sync.pass);
    return Drain(sync.pass);
  }

 private:
  // What rank 0 sets up before the servers hear of it: the region, its own slots, and the
  // init_info (without the other publishers' buffers).
  struct Offer {
    std::unique_ptr<IpcRegion> region;
    std::unique_ptr<DeviceExport> staging;
    std::string device_key;
    IpcInitInfo info;
    std::vector<int> offsets;
  };

  Result<Offer> CreateSession(const PlaneInit& init, int publishers) {
    const std::vector<TensorMeta>& metadata = init.metadata;
    const SessionDriver& driver = *init.driver;
    const bool gpu = !options_.device.is_cpu();
    Offer o;
    o.device_key = HostDeviceKey();
    if (gpu) {
      WSYNC_RETURN_IF_ERROR(UseDeviceOnThisThread(options_.device));
      WSYNC_ASSIGN_OR_RETURN(o.device_key, IpcDeviceKey(options_.device));
    }
    Fleet fleet = *init.fleet;
    WSYNC_RETURN_IF_ERROR(driver.WorldSizes(&fleet));
    WSYNC_ASSIGN_OR_RETURN(int readers, IpcReaderOffsets(fleet.world_sizes, options_.data_parallel_size, &o.offsets));
    reader_labels_ = driver.WorkerLabels(fleet, readers, o.offsets);

    IpcRegionOptions r;
    r.session = NewSessionId();
    r.num_slots = std::clamp(options_.num_buffers, 1, kIpcMaxSlots);
    r.slot_bytes = IpcSlotBytes(metadata, static_cast<uint64_t>(options_.bucket_gb * double(uint64_t{1} << 30)));
    r.reader_count = readers;
    r.publisher_count = publishers;
    r.backing = ipc_.backing;
    r.slots_in_region = !gpu;
    WSYNC_ASSIGN_OR_RETURN(o.region, IpcRegion::Create(r));
    IpcBufferDesc buffer = o.region->ShmBuffer();
    if (gpu && ipc_.mode == IpcTrainerOptions::Mode::kZeroCopy) {
      buffer = IpcBufferDesc{"none", 0, 0, json::object()};
    } else if (gpu) {
      // The slots, exported once for the whole session.
      WSYNC_ASSIGN_OR_RETURN(o.staging, DeviceExport::Allocate(options_.device, o.region->slot_stride() * r.num_slots,
                                                               ipc_.export_kind));
      buffer = IpcBufferDesc{std::string(o.staging->kind()), 0, o.region->slot_stride(), o.staging->Handle()};
    }
    IpcInitInfo& info = o.info;
    info.session = o.region->session();
    info.control_path = o.region->path();
    info.control_bytes = o.region->bytes();
    info.num_slots = o.region->num_slots();
    info.slot_bytes = o.region->slot_bytes();
    info.reader_count = o.region->reader_count();
    info.buffers[o.device_key] = buffer;
    // Servers give up a little before the trainer does, so that their account of a
    // failure arrives before the trainer's own wait ends.
    info.timeout_seconds = driver.deadlines().server_timeout();
    return o;
  }

  // Sends `o.info` to every server; the session is this engine's once all attached.
  Status OfferSession(Offer o) {
    IpcInitInfo& info = o.info;
    std::vector<json> infos;
    for (int offset : o.offsets) {
      info.reader_offset = offset;
      infos.push_back(info.ToJson());
    }
    std::vector<std::string> keys;
    for (const auto& [key, b] : info.buffers) keys.push_back(fmt::format("{} ({}, publisher {})", key, b.kind, b.publisher));
    WSYNC_LOG_INFO("init: {} servers, {} readers, reader offsets [{}], {} slot(s) of {} bytes, control {}, "
                   "buffers {}", o.offsets.size(), info.reader_count, fmt::join(o.offsets, ", "), info.num_slots,
                   info.slot_bytes, info.control_path, fmt::join(keys, ", "));
    WSYNC_RETURN_IF_ERROR(driver_->Init(std::move(infos)));
    o.region->UnlinkName();  // every server has it open now
    for (int reader = 0; reader < info.reader_count; ++reader) {
      if (o.region->reader_pid(reader) == 0) {
        return FailedPrecondition(fmt::format(
            "no server took reader {} ({}) of the ipc session: do the servers' DP layouts match "
            "data_parallel_size {}?", reader, reader_labels_[reader], options_.data_parallel_size));
      }
    }
    region_ = std::move(o.region);
    staging_ = std::move(o.staging);
    device_key_ = o.device_key;
    next_seq_ = 1;
    sync_ = 0;
    return Status::Ok();
  }

  // Init of one rank of several (TrainerOptions::comm): a fixed sequence of collectives
  // that every rank runs whatever fails, so that a failure anywhere ends every rank's
  // Init with the same error instead of a hang:
  //   1. all-gather each rank's device key; every rank derives the same publishers (the
  //      lowest rank on each GPU; only rank 0 on a CPU trainer, whose shm slots serve the
  //      host);
  //   2. rank 0 queries the servers, creates the region (one line per publisher) and its
  //      own slots, and broadcasts the region's path and session;
  //   3. every other publisher opens the region by path, allocates and exports its slots
  //      on its GPU (same count and stride); all-gather of the descriptors;
  //   4. rank 0 sends the merged `buffers` to the servers and broadcasts the outcome.
  // The ranks' group as a communicator (every group wsync builds is one).
  Result<Communicator*> RankComm() const {
    auto* comm = dynamic_cast<Communicator*>(options_.comm.get());
    if (comm == nullptr) {
      return InvalidArgument("TrainerOptions::comm is not a wsync communicator: the ipc backend runs collectives "
                             "among the trainer ranks");
    }
    return comm;
  }

  Status InitGroup(const PlaneInit& init) {
    WSYNC_ASSIGN_OR_RETURN(Communicator * group, RankComm());
    Communicator& comm = *group;
    const int rank = comm.rank(), ranks = comm.size();
    Deadline deadline = Deadline::InSeconds(options_.timeout_seconds);
    // 1. device keys (a rank that cannot name its device, or is misnumbered, fails all).
    json mine;
    {
      std::string key = HostDeviceKey();
      Status s = Status::Ok();
      if (rank != options_.rank) {
        s = InvalidArgument(fmt::format("TrainerOptions::rank {} is rank {} of TrainerOptions::comm", options_.rank,
                                        rank));
      } else if (!options_.device.is_cpu()) {
        s = UseDeviceOnThisThread(options_.device);
        if (s.ok()) {
          Result<std::string> k = IpcDeviceKey(options_.device);
          s = k.status();
          if (k.ok()) key = *k;
        }
      }
      mine = s.ok() ? json{{"key", key}} : StatusToJson(s);
    }
    WSYNC_ASSIGN_OR_RETURN(std::vector<std::string> gathered, AllGatherStrings(comm, mine.dump(), deadline));
    std::vector<std::string> keys(ranks);
    for (int r = 0; r < ranks; ++r) {
      json j = json::parse(gathered[r]);
      if (j.contains("error")) return StatusFromJson(j, fmt::format("trainer rank {} (its device key)", r));
      keys[r] = j["key"].get<std::string>();
    }
    const bool host = keys[0].starts_with("host-");
    std::vector<int> publisher_of(ranks, -1);
    int publishers = 0;
    std::map<std::string, int> by_key;
    for (int r = 0; r < ranks; ++r) {
      if (keys[r].starts_with("host-") ? r != 0 : host) continue;  // CPU: rank 0's host slots serve all
      auto [it, fresh] = by_key.emplace(keys[r], publishers);
      if (fresh) publisher_of[r] = publishers++;
    }

    // 2. rank 0's region.
    std::optional<Offer> offer;
    std::string created;
    if (rank == 0) {
      Result<Offer> o = CreateSession(init, publishers);
      if (o.ok()) {
        created = json{{"path", o->region->path()}, {"session", o->region->session()}}.dump();
        offer = std::move(*o);
      } else {
        created = StatusToJson(o.status()).dump();
      }
    }
    WSYNC_ASSIGN_OR_RETURN(std::string got, BroadcastString(comm, created, 0, deadline));
    json region_json = json::parse(got);
    if (region_json.contains("error")) return StatusFromJson(region_json, rank == 0 ? "" : "trainer rank 0");

    // 3. the other publishers' slots.
    std::unique_ptr<IpcRegion> region;
    std::unique_ptr<DeviceExport> staging;
    json desc = json::object();
    if (rank != 0 && publisher_of[rank] > 0) {
      Status s = [&]() -> Status {
        WSYNC_ASSIGN_OR_RETURN(region, IpcRegion::OpenPublisher(region_json["path"].get<std::string>(),
                                                                region_json["session"].get<std::string>(),
                                                                publisher_of[rank]));
        IpcBufferDesc b{"none", 0, 0, json::object(), publisher_of[rank]};  // zero-copy only: no slots
        if (ipc_.mode != IpcTrainerOptions::Mode::kZeroCopy) {
          WSYNC_ASSIGN_OR_RETURN(staging, DeviceExport::Allocate(options_.device,
                                                                 region->slot_stride() * region->num_slots(),
                                                                 ipc_.export_kind));
          b = IpcBufferDesc{std::string(staging->kind()), 0, region->slot_stride(), staging->Handle(),
                            publisher_of[rank]};
        }
        desc = json{{"key", keys[rank]}, {"buffer", b.ToJson()}};
        return Status::Ok();
      }();
      if (!s.ok()) desc = StatusToJson(s);
    }
    WSYNC_ASSIGN_OR_RETURN(gathered, AllGatherStrings(comm, desc.dump(), deadline));

    // 4. rank 0 offers the merged map.
    std::string outcome;
    Status mine_status = Status::Ok();
    if (rank == 0) {
      mine_status = [&]() -> Status {
        for (int r = 1; r < ranks; ++r) {
          json j = json::parse(gathered[r]);
          if (j.contains("error")) {
            return StatusFromJson(j, fmt::format("trainer rank {} ({}) exporting its staging", r, keys[r]));
          }
          if (!j.contains("buffer")) continue;
          WSYNC_ASSIGN_OR_RETURN(IpcBufferDesc b, IpcBufferDesc::Parse(j["buffer"], keys[r], "trainer rank"));
          offer->info.buffers[keys[r]] = std::move(b);
        }
        return OfferSession(std::move(*offer));
      }();
      outcome = mine_status.ok() ? "{}" : StatusToJson(mine_status).dump();
    }
    WSYNC_ASSIGN_OR_RETURN(got, BroadcastString(comm, outcome, 0, deadline));
    group_ = true;
    zero_copy_group_ = publishers > 1 && !host && ipc_.mode != IpcTrainerOptions::Mode::kPacked;
    if (rank == 0) {
      if (!mine_status.ok()) Shutdown();
      session_ = mine_status.ok();
      return mine_status;
    }
    json result = json::parse(got);
    if (result.contains("error")) return StatusFromJson(result, "trainer rank 0 (ipc init)");
    session_ = true;
    publisher_ = publisher_of[rank];
    if (region) {
      has_readers_ = region->HasReaders();
      WSYNC_LOG_INFO("init: trainer rank {} is publisher {} of ipc session {} on {} ({} reader(s) of its own)", rank,
                     publisher_, region->session(), keys[rank], has_readers_ ? "with" : "without");
    }
    region_ = std::move(region);
    staging_ = std::move(staging);
    device_key_ = keys[rank];
    sync_ = 0;
    return Status::Ok();
  }

  // A rank of a group that packs nothing: the ranks' exchange, then its source's pass
  // (every pass of a multi-rank source is a collective among the trainer ranks).
  Result<SyncStats> Drain(SyncPass& pass) {
    Stopwatch total;
    Status s = ReadPassFirst(pass);
    WSYNC_RETURN_IF_ERROR(ExchangeSyncState(pass, s).status());
    if (!pass_read_) s = pass.ReadAll();
    if (!s.ok()) return s.WithContext(fmt::format("trainer rank {} (its pass of the sync)", options_.rank));
    SyncStats stats;
    stats.tensors = pass.metadata().size();
    stats.seconds = stats.transfer_seconds = total.seconds();
    return stats;
  }

  // A publisher p > 0: the ranks' exchange, then the sync rank 0 announces, packed into
  // this rank's own slots chunk by chunk for the readers on its GPU as its pass streams;
  // returns once they have acknowledged the last chunk. Any failure aborts the sync for
  // every rank and reader and ends this rank's session (Init again, with the others).
  Result<SyncStats> SendAsPublisher(SyncPass& pass) {
    const std::vector<TensorMeta>& meta = pass.metadata();
    Stopwatch total;
    Status mine = Status::Ok();
    if (!region_) {
      mine = FailedPrecondition(fmt::format("trainer rank {} has no ipc session: call Init() on every rank (a "
                                            "failed sync ends the session)", options_.rank));
    }
    Status read = ReadPassFirst(pass);
    if (mine.ok()) mine = read;
    // Nothing has moved yet: a rank without a session fails the sync on every rank here.
    WSYNC_ASSIGN_OR_RETURN(GroupSync group, ExchangeSyncState(pass, mine));
    const uint64_t sync = ++sync_;
    auto fail = [&](Status s) -> Status {
      s = s.WithContext(fmt::format("trainer rank {} ({}), sync {}", options_.rank, device_key_, sync));
      region_->Abort(sync, s.message());
      Quiesce(nullptr);
      Shutdown();
      return s;
    };
    if (!has_readers_) {  // no worker reads this GPU's slots or tensors: nothing to send
      Status s = pass.ReadAll();
      if (!s.ok()) return fail(s.WithContext("its pass"));
      SyncStats stats;
      stats.tensors = meta.size();
      stats.seconds = stats.transfer_seconds = total.seconds();
      return stats;
    }
    if (!options_.device.is_cpu()) {
      Status s = UseDeviceOnThisThread(options_.device);
      if (!s.ok()) return fail(s);
    }
    Deadline deadline = Deadline::InSeconds(options_.timeout_seconds);
    // Zero-copy: the pass only checks that the tensors are where the exchanged layout
    // says, before the go.
    Result<IpcPlan> plan = group.zero_copy ? ZeroCopyLayout(pass) : PlanIpcChunks(meta, region_->slot_bytes());
    if (!plan.ok()) return fail(plan.status());
    Result<uint64_t> first = region_->WaitAnnounced(sync, deadline);
    if (!first.ok()) return fail(first.status());
    IpcUpdateInfo u;
    u.sync = sync;
    u.first_seq = *first;
    u.chunk_ends = plan->chunk_ends;
    auto check = PeerCheck(sync);
    Stopwatch transfer;
    Status s = group.zero_copy ? Go(u, plan->payload_bytes, check, deadline)
                               : Transfer(pass, meta, *plan, u, check, deadline);
    // Its readers have landed every chunk (or the sync failed somewhere).
    if (s.ok() && !u.chunk_ends.empty()) {
      s = region_->WaitAcked(u.first_seq + u.chunk_ends.size() - 1, deadline, check, ReaderDescriber());
    }
    if (!s.ok()) return fail(s);
    SyncStats stats;
    stats.bytes = plan->payload_bytes;
    stats.tensors = meta.size();
    stats.chunks = plan->chunk_ends.size();
    stats.transfer_seconds = transfer.seconds();
    stats.seconds = total.seconds();
    return stats;
  }

  // Publishers p > 0 stop when another rank abandoned the sync or rank 0 ended its session
  // (a lock probe, a system call: at most every 10 ms, as readers probe).
  std::function<Status()> PeerCheck(uint64_t sync) {
    return [this, sync, last_probe = Clock::time_point{}]() mutable -> Status {
      if (auto reason = region_->AbortedReason(sync)) return Aborted(fmt::format("sync {} was abandoned: {}", sync, *reason));
      auto now = Clock::now();
      if (now - last_probe < std::chrono::milliseconds(10)) return Status::Ok();
      last_probe = now;
      if (!region_->PublisherAlive(0)) {
        return Unavailable(fmt::format("trainer rank 0 (pid {}) ended ipc session {} (it exited, or a sync failed)",
                                       region_->trainer_pid(), region_->session()));
      }
      return Status::Ok();
    };
  }

  // Rank 0's plan of one sync (after the ranks' exchange): zero-copy or packed, its
  // chunks, the update body; then the announcement.
  Status Plan(SyncContext& sync, const GroupSync& group) {
    const std::vector<TensorMeta>& meta = sync.pass.metadata();
    const uint64_t id = ++sync_;
    if (!options_.device.is_cpu()) WSYNC_RETURN_IF_ERROR(UseDeviceOnThisThread(options_.device));
    // With several publishers the ranks decided together (each sends its own GPU's go).
    // One publisher sends zero-copy in mode zero_copy, and in mode auto once a pass has
    // shown where the tensors lie in the storage its source offers now.
    std::string why;
    std::optional<SourceStorage> storage = ExportableStorage(sync.pass.source(), &why);
    if (zero_copy_group_) {
      zero_copy_ = group.zero_copy;
    } else {
      zero_copy_ = storage && ipc_.mode != IpcTrainerOptions::Mode::kPacked && region_->publisher_count() == 1 &&
                   (ipc_.mode == IpcTrainerOptions::Mode::kZeroCopy || (learned_ && learned_->SameBlock(*storage)));
      if (zero_copy_) sync_layout_ = StorageLayout{*storage, {}};
    }
    if (!options_.device.is_cpu() && ipc_.mode == IpcTrainerOptions::Mode::kZeroCopy && !zero_copy_) {
      return FailedPrecondition(fmt::format("the ipc trainer exports no staging slots (mode zero_copy), so {}",
                                            why.empty() ? std::string("it cannot pack") : why));
    }
    IpcUpdateInfo u;
    u.session = region_->session();
    u.first_seq = next_seq_;
    if (zero_copy_) {
      WSYNC_ASSIGN_OR_RETURN(plan_, ZeroCopyPlan(sync.pass, zero_copy_group_ ? &group.buffers : nullptr, &u));
    } else {
      WSYNC_ASSIGN_OR_RETURN(plan_, PlanIpcChunks(meta, region_->slot_bytes()));
      u.tensor_offsets = plan_.tensor_offsets;
    }
    u.chunk_ends = plan_.chunk_ends;
    for (const TensorMeta& m : meta) u.tensor_sizes.push_back(m.nbytes());
    sync.update_body = UpdateBody(meta, u);
    u.sync = id;
    update_ = std::move(u);
    sync.stats.bytes = plan_.payload_bytes;
    sync.stats.chunks = plan_.chunk_ends.size();
    region_->Announce(update_.sync, update_.first_seq);
    return Status::Ok();
  }

 public:
  void Shutdown() override {
    session_ = false;
    has_readers_ = true;
    published_seq_ = 0;
    body_ = CachedBody{};
    pack_cache_.Clear();
    staging_.reset();
    region_.reset();
    zero_copy_sent_ = false;  // a new session maps the source again
  }

 private:
  // The serialized {"update_info": ...} of `u` (whose sync fields are not on the wire):
  // the bytes of the previous sync when nothing changed, so that the servers find them in
  // their cache of parsed bodies.
  std::shared_ptr<const std::string> UpdateBody(const std::vector<TensorMeta>& meta, const IpcUpdateInfo& u) {
    IpcUpdateInfo layout = u;
    layout.sync = layout.first_seq = 0;
    if (body_.bytes == nullptr || !(body_.update == layout) || body_.meta != meta) {
      json extra = json::object();
      layout.AddTo(&extra);
      body_ = CachedBody{meta, std::move(layout), wsync::UpdateBody(meta, extra)};
    }
    return body_.bytes;
  }

  // Exports the allocation behind `source`'s tensors when it is new to this session or
  // changed since the last export (returns whether it did). Exporting is cheap and names
  // the allocation: a new one at the same address has another handle, so a receiver never
  // reads through a stale mapping.
  Result<bool> ExportSource(const SourceStorage& storage) {
    WSYNC_ASSIGN_OR_RETURN(std::unique_ptr<DeviceExport> ex,
                           DeviceExport::Existing(options_.device, storage.data, storage.bytes));
    bool changed = storage.data != exported_data_ || storage.bytes != exported_bytes_ ||
                   zero_copy_export_ == nullptr || ex->offset() != zero_copy_export_->offset() ||
                   ex->Identity() != zero_copy_export_->Identity();
    if (!changed) return false;
    // Kept while the generation lives: a cuda_fd export holds the fd the servers take.
    zero_copy_export_ = std::move(ex);
    exported_ = IpcBufferDesc{std::string(zero_copy_export_->kind()), zero_copy_export_->offset(), 0,
                              zero_copy_export_->Handle(), std::max(publisher_, 0)};
    exported_data_ = storage.data;
    exported_bytes_ = storage.bytes;
    WSYNC_LOG_INFO("zero-copy: exported the source's {} bytes on {}", storage.bytes, options_.device.ToString());
    return true;
  }

  // The update of a zero-copy sync: the source's tensors where they are, one chunk, and
  // the exports of their allocations when they are new to this session or have changed:
  // this rank's own, or with several publishers every publisher's (`group`, exchanged).
  Result<IpcPlan> ZeroCopyPlan(SyncPass& pass, const std::map<std::string, IpcBufferDesc>* group,
                               IpcUpdateInfo* u) {
    WSYNC_ASSIGN_OR_RETURN(IpcPlan plan, ZeroCopyLayout(pass));
    if (group == nullptr) {
      WSYNC_ASSIGN_OR_RETURN(bool changed, ExportSource(sync_layout_->storage));
      if (changed) {
        ++generation_;
        zero_copy_sent_ = false;
      }
    }
    IpcZeroCopy z;
    z.generation = generation_;
    z.bytes = sync_layout_->storage.bytes;
    if (!zero_copy_sent_) {
      if (group != nullptr) z.buffers = *group;
      else z.buffers[device_key_] = exported_;
    }
    u->zero_copy = std::move(z);
    u->tensor_offsets = plan.tensor_offsets;
    return plan;
  }

  // The pass of a zero-copy sync, unless ReadPassFirst read it: where every tensor lies in
  // sync_layout_'s storage, which a group's ranks agreed on before the pass (each rank's
  // tensors must be where it said). A tensor outside the storage, or moved, fails the
  // sync naming it, and what the plane had learned of the storage is forgotten (mode
  // auto packs the next sync).
  Result<IpcPlan> ZeroCopyLayout(SyncPass& pass) {
    const std::vector<TensorMeta>& meta = pass.metadata();
    if (!sync_layout_) return Internal("zero-copy without the layout of the source's storage");
    if (!pass_read_) {
      WSYNC_ASSIGN_OR_RETURN(std::shared_ptr<TensorStream> stream, pass.Stream());
      Result<StorageLayout> read = ReadStorageLayout(*stream, meta, sync_layout_->storage);
      if (read.ok() && group_) {
        for (size_t i = 0; i < meta.size(); ++i) {
          if (read->offsets[i] != sync_layout_->offsets[i]) {
            read = FailedPrecondition(fmt::format("tensor {} lies at offset {} of the source's storage, its last pass "
                                                  "had it at {}", meta[i].name, read->offsets[i],
                                                  sync_layout_->offsets[i]));
            break;
          }
        }
      }
      if (!read.ok()) {
        learned_.reset();
        return read.status().WithContext("zero-copy");
      }
      sync_layout_ = learned_ = std::move(*read);
    }
    IpcPlan plan;
    plan.tensor_offsets = sync_layout_->offsets;
    for (const TensorMeta& m : meta) plan.payload_bytes += m.nbytes();
    if (!meta.empty()) {
      plan.chunk_ends = {meta.size()};
      plan.chunk_bytes = {0};
    }
    return plan;
  }

  // The storage of `source` when zero-copy could export it (on this trainer's GPU);
  // otherwise nullopt, and `why` says why not.
  std::optional<SourceStorage> ExportableStorage(const WeightSource& source, std::string* why) const {
    if (options_.device.is_cpu()) return std::nullopt;
    std::optional<SourceStorage> s = source.storage();
    if (!s || s->data == nullptr || s->bytes == 0) {
      *why = fmt::format("its source offers no storage() (one block on {} holding every tensor)",
                         options_.device.ToString());
      return std::nullopt;
    }
    if (s->device != options_.device) {
      *why = fmt::format("its source's storage is on {}, not the trainer's {}", s->device.ToString(),
                         options_.device.ToString());
      return std::nullopt;
    }
    return s;
  }

  // A group in mode zero_copy: every rank reads its pass before the ranks' exchange (the
  // pass is only a check there, and may be a collective, so every rank reads it at the
  // same point), a publisher learning where its tensors lie. Sets pass_read_.
  Status ReadPassFirst(SyncPass& pass) {
    pass_read_ = false;
    if (!zero_copy_group_ || ipc_.mode != IpcTrainerOptions::Mode::kZeroCopy) return Status::Ok();
    pass_read_ = true;
    std::string why;
    std::optional<SourceStorage> storage = ExportableStorage(pass.source(), &why);
    if (publisher_ < 0 || !has_readers_ || !storage) {
      sync_layout_.reset();
      return pass.ReadAll();
    }
    WSYNC_ASSIGN_OR_RETURN(std::shared_ptr<TensorStream> stream, pass.Stream());
    Result<StorageLayout> read = ReadStorageLayout(*stream, pass.metadata(), *storage);
    if (!read.ok()) return read.status().WithContext("zero-copy");
    sync_layout_ = learned_ = std::move(*read);
    return Status::Ok();
  }

  // The exchange that starts every sync of a group, before the pass and before
  // anything reaches the servers (an all-gather of one small message per rank; every
  // rank calls it, whatever failed). `mine` is this rank's state: an error on any rank
  // (no session) fails the sync on every rank at once, naming that
  // rank, where the others would otherwise wait for a sync that never comes. With several
  // publishers that may send zero-copy (zero_copy_group_), each publisher with readers
  // offers its tensors' export and layout; the sync is zero-copy when every one offers
  // the same layout, and every rank bumps the generation when any export changed, so all
  // derive the same decision from the same messages.
  Result<GroupSync> ExchangeSyncState(SyncPass& pass, Status mine) {
    WeightSource& source = pass.source();
    json j = json::object();
    if (mine.ok() && zero_copy_group_ && publisher_ >= 0 && has_readers_) {
      std::string why;
      std::optional<SourceStorage> storage = ExportableStorage(source, &why);
      if (storage && !pass_read_) {
        if (learned_ && learned_->SameBlock(*storage)) {
          sync_layout_ = learned_;
        } else {
          storage.reset();
          why = "where its tensors lie in its source's storage is not known yet (a packed sync learns it)";
        }
      }
      if (!storage) {
        j = json{{"zero_copy", false}, {"why", why}};
      } else {
        mine = UseDeviceOnThisThread(options_.device);
        if (mine.ok()) {
          Result<bool> changed = ExportSource(sync_layout_->storage);
          if (!changed.ok()) {
            mine = changed.status();
          } else {
            j = json{{"zero_copy", true}, {"key", device_key_}, {"layout", sync_layout_->Digest()},
                     {"changed", *changed}, {"buffer", exported_.ToJson()}};
          }
        }
      }
    }
    if (!mine.ok()) j = StatusToJson(mine);
    WSYNC_ASSIGN_OR_RETURN(std::vector<std::string> all,
                           AllGatherStrings(*static_cast<Communicator*>(options_.comm.get()), j.dump(),
                                            Deadline::InSeconds(options_.timeout_seconds)));
    if (!mine.ok()) return mine;
    GroupSync g;
    g.zero_copy = zero_copy_group_;
    bool changed = false;
    std::string layout, why;
    int layout_rank = 0;
    for (size_t r = 0; r < all.size(); ++r) {
      json e = json::parse(all[r]);
      if (e.contains("error")) return StatusFromJson(e, fmt::format("trainer rank {}", r));
      if (!e.contains("zero_copy")) continue;
      if (!e["zero_copy"].get<bool>()) {
        g.zero_copy = false;
        why = fmt::format("trainer rank {}: {}", r, e["why"].get<std::string>());
        continue;
      }
      std::string l = e["layout"].get<std::string>();
      if (layout.empty()) {
        layout = l;
        layout_rank = static_cast<int>(r);
      } else if (l != layout) {
        g.zero_copy = false;
        why = fmt::format("trainer rank {}'s tensors lie at other offsets of its allocation than trainer rank {}'s",
                          r, layout_rank);
      }
      changed = changed || e["changed"].get<bool>();
      std::string key = e["key"].get<std::string>();
      WSYNC_ASSIGN_OR_RETURN(g.buffers[key], IpcBufferDesc::Parse(e["buffer"], key, "trainer rank"));
    }
    if (changed) {
      ++generation_;
      zero_copy_sent_ = false;
    }
    if (zero_copy_group_ && !g.zero_copy) {
      if (ipc_.mode == IpcTrainerOptions::Mode::kZeroCopy) {
        return FailedPrecondition(fmt::format("ipc mode zero_copy, but {}", why));
      }
      WSYNC_LOG_DEBUG("sync packs: {}", why);
    }
    return g;
  }

  // The one hand-off of a zero-copy sync on this rank's GPU: once the device is idle (the
  // tensors are final), publish the go on this rank's line; its readers copy and
  // acknowledge it.
  Status Go(const IpcUpdateInfo& u, uint64_t bytes, const std::function<Status()>& check, Deadline deadline) {
    if (u.chunk_ends.empty()) return Status::Ok();
    WSYNC_RETURN_IF_ERROR(SynchronizeIpcDevice(options_.device).WithContext("finishing the trainer's writes"));
    uint64_t seq = u.first_seq;
    uint64_t previous = seq > static_cast<uint64_t>(region_->num_slots()) ? seq - region_->num_slots() : 0;
    Status free = region_->WaitAcked(previous, deadline, check, ReaderDescriber());
    if (!free.ok()) return free.WithContext(fmt::format("waiting to publish the zero-copy go of sync {}", u.sync));
    region_->Publish(seq, 0);
    published_seq_ = seq;
    if (options_.progress) options_.progress(SyncProgress{bytes, bytes, 1, 1});
    ++chunks_published_;
    if (ipc_.stall_after_chunks && chunks_published_ == *ipc_.stall_after_chunks) Stall();
    return Status::Ok();
  }

  static std::function<Status()> HttpCheck(Pending& http) {
    return [&http]() -> Status {
      if (!http.AnyFailed()) return Status::Ok();
      Result<std::vector<json>> r = http.Wait(Deadline::InSeconds(1));
      return r.ok() ? Aborted("a server ended its update early") : r.status();
    };
  }
  // Before a failed sync frees the slots (or lets the caller write its tensors again),
  // for at most 2 s: no reader may still be copying from them. Rank 0 waits for every
  // server's answer to update_weights (a server answers once all its workers stopped);
  // other publishers wait until their readers acknowledged every chunk published (after
  // an abort a reader still lands, and acknowledges, every chunk already published, then
  // stops); a reader that died or stopped for its own reason ends this only at the bound.
  void Quiesce(Pending* http) {
    Deadline bound = Deadline::InSeconds(2);
    if (http != nullptr) {
      while (!http->Done() && !bound.expired()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    } else if (region_ && published_seq_ > 0) {
      (void)region_->WaitAcked(published_seq_, bound, nullptr, nullptr);
    }
  }

  // Rank 0's exits while it waits for acknowledgements: a server that answered early, and
  // with several publishers another rank that abandoned the sync.
  std::function<Status()> SenderCheck(Pending& http, uint64_t sync) {
    if (region_->publisher_count() == 1) return HttpCheck(http);
    return [this, &http, sync]() -> Status {
      WSYNC_RETURN_IF_ERROR(HttpCheck(http)());
      if (auto reason = region_->AbortedReason(sync)) return Aborted(fmt::format("sync {} was abandoned: {}", sync, *reason));
      return Status::Ok();
    };
  }
  bool AllRanks() const { return options_.comm && options_.comm->size() > 1; }
  std::function<std::string(int)> ReaderDescriber() const {
    return [this](int r) {
      return r < static_cast<int>(reader_labels_.size()) ? reader_labels_[r] : fmt::format("reader {}", r);
    };
  }

  // Packs chunk k of a GPU sync into `slot`: tensors inside the storage their source
  // offers on the trainer's device in one cached batched copy (their addresses are
  // stable); anything else tensor by tensor, finished before the stream's next tensor (a
  // TensorRef is only valid until then). `learn` records where the tensors lie.
  Status PackDevice(TensorStream& stream, const std::optional<SourceStorage>& storage,
                    StorageLayoutRecorder& learn, const std::vector<TensorMeta>& meta, const IpcPlan& plan,
                    size_t k, int slot, SyncProgress& p) {
    WSYNC_ASSIGN_OR_RETURN(DeviceRuntime * rt, CudaRuntimeFor(options_.device));
    std::byte* base = staging_->data() + static_cast<uint64_t>(slot) * region_->slot_stride();
    DeviceCopyCache::Copies copies;
    TensorRef t;
    for (size_t i = k == 0 ? 0 : plan.chunk_ends[k - 1]; i < plan.chunk_ends[k]; ++i) {
      WSYNC_ASSIGN_OR_RETURN(bool more, stream.Next(&t));
      if (!more) return Internal(fmt::format("source ended before tensor {}", meta[i].name));
      std::byte* dst = base + plan.tensor_offsets[i];
      learn.Add(meta[i], t);
      if (storage && OffsetInStorage(*storage, t)) {
        copies.push_back({t.bytes.data(), dst, t.bytes.size()});
      } else {
        WSYNC_RETURN_IF_ERROR(rt->Copy2D(dst, 0, t.bytes.data(), 0, t.bytes.size(), 1));
        WSYNC_RETURN_IF_ERROR(rt->Synchronize().WithContext(fmt::format("packing {}", meta[i].name)));
      }
      p.bytes_done += t.bytes.size();
    }
    if (copies.empty()) return Status::Ok();
    WSYNC_ASSIGN_OR_RETURN(DeviceCopies * c,
                           pack_cache_.Get(options_.device, k * kIpcMaxSlots + static_cast<size_t>(slot), copies));
    return c->Run().WithContext(fmt::format("packing chunk {}/{} on {}", k + 1, plan.chunk_ends.size(),
                                            options_.device.ToString()));
  }

  // Packs and publishes every chunk; chunk k goes into slot (first_seq + k) % num_slots
  // once every reader is done with what that slot held before.
  Status Transfer(SyncPass& pass, const std::vector<TensorMeta>& meta, const IpcPlan& plan,
                  const IpcUpdateInfo& u, const std::function<Status()>& check, Deadline deadline) {
    // Host tensors are hashed as they are copied into the slots (in-line verification).
    std::shared_ptr<PassDigests> digests = staging_ == nullptr ? pass.TakeDigests() : nullptr;
    WSYNC_ASSIGN_OR_RETURN(std::shared_ptr<TensorStream> stream, pass.Stream());
    auto describe = ReaderDescriber();
    const bool gpu = staging_ != nullptr;
    std::string why;
    const std::optional<SourceStorage> storage = ExportableStorage(pass.source(), &why);
    StorageLayoutRecorder learn(storage, meta.size());
    size_t threads = DefaultThreads();
    size_t n = plan.chunk_ends.size();
    SyncProgress p{0, plan.payload_bytes, 0, n};
    for (size_t k = 0; k < n; ++k) {
      uint64_t seq = u.first_seq + k;
      uint64_t previous = seq > static_cast<uint64_t>(region_->num_slots()) ? seq - region_->num_slots() : 0;
      Status free = region_->WaitAcked(previous, deadline, check, describe);
      if (!free.ok()) {
        return free.WithContext(fmt::format("waiting for a free staging slot for chunk {}/{} of sync {}", k + 1, n, u.sync));
      }
      int slot_index = static_cast<int>(seq % region_->num_slots());
      if (gpu) {
        WSYNC_RETURN_IF_ERROR(PackDevice(*stream, storage, learn, meta, plan, k, slot_index, p));
      } else {
        std::span<std::byte> slot = region_->slot(slot_index);
        TensorRef t;
        for (size_t i = u.chunk_first(k); i < u.chunk_ends[k]; ++i) {
          WSYNC_ASSIGN_OR_RETURN(bool more, stream->Next(&t));
          if (!more) return Internal(fmt::format("source ended before tensor {}", meta[i].name));
          if (!t.device.is_cpu()) {
            return InvalidArgument(fmt::format("tensor {} is on {}, but this ipc trainer stages in host memory "
                                               "(device cpu); give the trainer the tensors' device",
                                               meta[i].name, t.device.ToString()));
          }
          std::unique_ptr<Hasher> hasher = digests ? Hasher::Create(DigestAlgorithm::kXxh3_128) : nullptr;
          CopyInto(slot.data() + plan.tensor_offsets[i], t.bytes, threads, hasher.get());
          if (hasher) digests->Record(t.name, hasher->FinishHex());
          p.bytes_done += t.bytes.size();
        }
      }
      if (k + 1 == n) {
        // The end of the pass, before the last chunk goes out: a source that yields more
        // than its metadata fails the sync naming the extra tensor.
        TensorRef end;
        WSYNC_RETURN_IF_ERROR(stream->Next(&end).status());
        // What the pass showed of the source's storage; a source without one leaves
        // what an earlier source showed.
        Result<StorageLayout> learned = learn.Finish();
        if (learned.ok()) {
          learned_ = std::move(*learned);
        } else if (storage) {
          learned_.reset();
          WSYNC_LOG_DEBUG("mode auto keeps packing this source: {}", learned.status().message());
        }
      }
      region_->Publish(seq, plan.chunk_bytes[k]);
      published_seq_ = seq;
      p.chunks_done = k + 1;
      if (options_.progress) options_.progress(p);
      ++chunks_published_;
      if (ipc_.stall_after_chunks && chunks_published_ == *ipc_.stall_after_chunks) Stall();
    }
    return Status::Ok();
  }

  [[noreturn]] void Stall() {
    WSYNC_LOG_WARN("fault injection: stalling after chunk {} until killed", chunks_published_);
    std::fprintf(stderr, "wsync ipc fault injection: stalled after %zu chunk(s)\n", chunks_published_);
    std::fflush(stderr);
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
  }

  TrainerOptions options_;
  IpcTrainerOptions ipc_;
  const SessionDriver* driver_ = nullptr;  // rank 0: the engine's, for its lifetime
  std::unique_ptr<IpcRegion> region_;
  std::unique_ptr<DeviceExport> staging_;  // GPU: the session's slots (packed modes)
  std::string device_key_;                 // where the trainer's buffers live
  DeviceCopyCache pack_cache_;             // GPU: one batched copy per (chunk, slot)
  struct CachedBody {
    std::vector<TensorMeta> meta;
    IpcUpdateInfo update;  // sync and first_seq 0
    std::shared_ptr<const std::string> bytes;
  } body_;
  // Zero-copy: what was last exported of the source's allocation, its generation and
  // whether every server of the session has been sent its handle.
  IpcBufferDesc exported_;
  std::unique_ptr<DeviceExport> zero_copy_export_;
  const std::byte* exported_data_ = nullptr;
  size_t exported_bytes_ = 0;
  uint64_t generation_ = 0;
  bool zero_copy_sent_ = false;
  // Zero-copy: where the last source with a storage() held its tensors (from a pass), and
  // this sync's layout (offsets from its pass, or for a group the one agreed before it);
  // pass_read_: ReadPassFirst read this sync's pass.
  std::optional<StorageLayout> learned_;
  std::optional<StorageLayout> sync_layout_;
  bool pass_read_ = false;
  std::vector<std::string> reader_labels_;
  // Init of several ranks succeeded: every sync starts with the ranks' exchange
  // (ExchangeSyncState), until the next Init.
  bool group_ = false;
  bool zero_copy_group_ = false;  // ...in which every publisher may offer its own tensors
  int publisher_ = 0;       // this rank's line in the region; -1: packs nothing (drains)
  bool has_readers_ = true;  // publishers p > 0: some worker reads this GPU's slots
  uint64_t next_seq_ = 1;
  uint64_t published_seq_ = 0;  // the last chunk this rank published in its session
  uint64_t sync_ = 0;
  size_t chunks_published_ = 0;
  // Rank 0's sync under way (Prepare): its plan, its update, whether it packs.
  IpcPlan plan_;
  IpcUpdateInfo update_;
  bool zero_copy_ = false;
  bool sync_begun_ = false;
  bool session_ = false;  // a group's rank: Init succeeded and no failed sync ended it since
};

}  // namespace

Result<IpcTrainerOptions> ParseIpcTrainerOptions(const std::map<std::string, std::string>& values) {
  IpcTrainerOptions o;
  BackendOptions read("ipc", values);
  int mode = static_cast<int>(o.mode);
  WSYNC_RETURN_IF_ERROR(read.ReadChoice("mode", {"auto", "packed", "zero_copy"}, &mode));
  o.mode = static_cast<IpcTrainerOptions::Mode>(mode);
  int kind = o.export_kind == "cuda_fd" ? 1 : 0;
  WSYNC_RETURN_IF_ERROR(read.ReadChoice("export_kind", {"cuda_ipc", "cuda_fd"}, &kind));
  o.export_kind = kind == 1 ? "cuda_fd" : "cuda_ipc";
  int backing = o.backing == ShmBacking::kPosixShm ? 1 : 0;
  WSYNC_RETURN_IF_ERROR(read.ReadChoice("backing", {"memfd", "posix_shm"}, &backing));
  o.backing = backing == 1 ? ShmBacking::kPosixShm : ShmBacking::kMemfd;
  size_t stall = 0;
  WSYNC_RETURN_IF_ERROR(read.Read("stall_after_chunks", &stall));
  if (values.count("stall_after_chunks")) o.stall_after_chunks = stall;
  WSYNC_RETURN_IF_ERROR(read.Finish());
  return o;
}

Result<std::unique_ptr<TrainerEngine>> CreateIpcTrainerWith(const TrainerOptions& options, const IpcTrainerOptions& ipc) {
  WSYNC_RETURN_IF_ERROR(CheckTrainerOptions(options));
  if (ipc.export_kind != "cuda_ipc" && ipc.export_kind != "cuda_fd") {
    return InvalidArgument(fmt::format("ipc export kind '{}' is not cuda_ipc or cuda_fd", ipc.export_kind));
  }
  if (!options.packed) {
    return Unimplemented("the ipc backend sends packed chunks only (unpacked sends are not supported: "
                         "one handle per tensor keeps the whole model resident on the trainer)");
  }
  return NewTrainerEngine(options, std::make_unique<IpcPlane>(options, ipc));
}

Result<std::unique_ptr<TrainerEngine>> CreateIpcTrainer(const TrainerOptions& options) {
  WSYNC_ASSIGN_OR_RETURN(IpcTrainerOptions ipc, ParseIpcTrainerOptions(options.backend_options));
  return CreateIpcTrainerWith(options, ipc);
}

}  // namespace wsync
