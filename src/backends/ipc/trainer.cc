#include "backends/ipc/trainer.h"

#include <memory>

#include <fmt/format.h>

#include "backends/ipc/packer.h"
#include "backends/ipc/protocol.h"
#include "backends/ipc/rank_group.h"
#include "backends/ipc/session.h"
#include "backends/ipc/sync_plan.h"
#include "backends/ipc/zero_copy_plan.h"
#include "control/session_driver.h"
#include "core/stopwatch.h"
#include "engine/backend_options.h"
#include "engine/device_digests.h"
#include "engine/engine.h"
#include "engine/sync_pass.h"
#include "wsync/device_runtime.h"

namespace wsync {
namespace {

using nlohmann::json;
using Pending = SessionDriver::Pending;

// The ipc data plane: a composition of its session (session.h), its ranks' group
// (rank_group.h), its zero-copy planner (zero_copy_plan.h), rank 0's sync under way
// (sync_plan.h) and its packer (packer.h).
class IpcPlane final : public DataPlane {
 public:
  IpcPlane(const TrainerOptions& o, const IpcTrainerOptions& ipc)
      : options_(o),
        ipc_(ipc),
        session_(options_, ipc_),
        group_(options_, ipc_),
        zero_copy_(options_),
        sync_(options_, ipc_),
        packer_(options_, ipc_) {}
  ~IpcPlane() override { Shutdown(); }

  // With several ranks every rank runs the plane.
  SessionShape Shape() override {
    SessionShape shape;
    if (group_.several()) shape.other_rank_sync = [this](SyncContext& sync) { return SyncOtherRank(sync.pass); };
    return shape;
  }

  Status Init(const PlaneInit& init) override {
    Shutdown();
    driver_ = init.driver;
    group_.Reset();
    if (group_.several()) return group_.Init(init, session_);
    WSYNC_ASSIGN_OR_RETURN(IpcSession::Offer offer, session_.Create(init, 1));
    return session_.Open(std::move(offer), *driver_);
  }

  // A failed sync ends the session of the ranks it reached; a group's ranks answer
  // together.
  Result<bool> Ready(const Status& mine) override {
    if (group_.several()) return group_.Ready(mine);
    WSYNC_RETURN_IF_ERROR(mine);
    return session_.region() != nullptr;
  }

  // Rank 0: the ranks' exchange, the plan and the update body; the sync is announced to
  // the other publishers. Nothing reaches the servers.
  Status Prepare(SyncContext& sync) override {
    sync_.Reset();
    zero_copy_.NewPass();
    // In-line digests, taken over before the pass starts (see SendAsPublisher).
    digests_ = sync.pass.TakeDigests();
    Status mine = session_.region() ? Status::Ok()
                                    : FailedPrecondition("no ipc session: call Init() (a failed sync ends the session)");
    GroupSync group;
    if (group_.active()) {
      Status read = group_.ReadPassFirst(sync.pass, session_, zero_copy_);
      if (mine.ok()) mine = read;
      WSYNC_ASSIGN_OR_RETURN(group, group_.Exchange(sync.pass, mine, session_, zero_copy_));
    } else {
      WSYNC_RETURN_IF_ERROR(mine);
    }
    sync_.Begin();
    return sync_.Plan(sync, group, group_.zero_copy(), session_, zero_copy_);
  }

  Status Transfer(SyncContext& sync, Pending& update) override {
    const IpcUpdateInfo& u = sync_.update();
    auto check = session_.SenderCheck(update, u.sync);
    Status s = sync_.zero_copy()
                   ? packer_.Go(session_, u, sync_.plan().payload_bytes, check, sync.deadline)
                   : packer_.Pack(session_, sync.pass, sync_.plan(), u, zero_copy_, digests_.get(), check,
                                  sync.deadline);
    if (s.ok() && sync_.zero_copy() && digests_) s = DigestZeroCopy(sync.pass, sync_.plan(), *digests_);
    if (s.ok()) s = update.Wait(driver_->deadlines().Http()).status();
    if (!s.ok()) return s;
    session_.Advance(sync_.plan().chunk_ends.size());
    if (u.zero_copy) zero_copy_.MarkSent();  // every server has mapped this generation
    return Status::Ok();
  }

  // Once the update is posted, the readers are stopped and the session ends (Init again);
  // before, only a sync several publishers await is aborted.
  Status Abort(const Status& cause, Pending* update) override {
    IpcRegion* region = session_.region();
    if (region == nullptr || !sync_.begun()) return cause;
    if (update == nullptr) {
      if (region->publisher_count() > 1) {
        region->Abort(session_.sync(), fmt::format("trainer rank 0: {}", cause.message()));
        Shutdown();
      }
      return cause;
    }
    Status s = cause;
    region->Abort(sync_.update().sync, s.message());
    // A server's own account explains more than "it stopped acknowledging".
    if (s.code() == StatusCode::kAborted || s.code() == StatusCode::kDeadlineExceeded) {
      Result<std::vector<json>> r = update->Wait(Deadline::InSeconds(2));
      if (!r.ok() && r.status().code() != StatusCode::kDeadlineExceeded) s = r.status();
    }
    session_.Quiesce(update);
    Shutdown();
    return s;
  }

  void Shutdown() override {
    group_.set_down();
    sync_.Clear();
    packer_.Clear();  // before the slots its copies name
    session_.Close();
    zero_copy_.ForgetSent();  // a new session maps the source again
  }

 private:
  Result<SyncStats> SyncOtherRank(SyncPass& pass) {
    if (group_.publisher() > 0) return SendAsPublisher(pass);
    return Drain(pass);
  }

  // A rank of a group that packs nothing: the ranks' exchange, then its source's pass
  // (every pass of a multi-rank source is a collective among the trainer ranks).
  Result<SyncStats> Drain(SyncPass& pass) {
    Stopwatch total;
    Status s = group_.ReadPassFirst(pass, session_, zero_copy_);
    WSYNC_RETURN_IF_ERROR(group_.Exchange(pass, s, session_, zero_copy_).status());
    if (!zero_copy_.pass_read()) s = pass.ReadAll();
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
    if (!session_.region()) {
      mine = FailedPrecondition(fmt::format("trainer rank {} has no ipc session: call Init() on every rank (a "
                                            "failed sync ends the session)", options_.rank));
    }
    // In-line digests, taken over before the pass starts: the packer records each slot's;
    // a zero-copy sync's tensors are digested where they lie in the source's storage.
    std::shared_ptr<PassDigests> digests = pass.TakeDigests();
    Status read = group_.ReadPassFirst(pass, session_, zero_copy_);
    if (mine.ok()) mine = read;
    // Nothing has moved yet: a rank without a session fails the sync on every rank here.
    WSYNC_ASSIGN_OR_RETURN(GroupSync group, group_.Exchange(pass, mine, session_, zero_copy_));
    const uint64_t sync = session_.NextSync();
    IpcRegion& region = *session_.region();
    auto fail = [&](Status s) -> Status {
      s = s.WithContext(fmt::format("trainer rank {} ({}), sync {}", options_.rank, session_.device_key(), sync));
      region.Abort(sync, s.message());
      session_.Quiesce(nullptr);
      Shutdown();
      return s;
    };
    if (!session_.has_readers()) {  // no worker reads this GPU's slots or tensors: nothing to send
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
    Result<IpcPlan> plan = group.zero_copy ? zero_copy_.Layout(pass, /*in_group=*/true)
                                           : PlanIpcChunks(meta, region.slot_bytes());
    if (!plan.ok()) return fail(plan.status());
    Result<uint64_t> first = region.WaitAnnounced(sync, deadline);
    if (!first.ok()) return fail(first.status());
    IpcUpdateInfo u;
    u.sync = sync;
    u.first_seq = *first;
    u.chunk_ends = plan->chunk_ends;
    auto check = session_.PeerCheck(sync);
    Stopwatch transfer;
    Status s = group.zero_copy ? packer_.Go(session_, u, plan->payload_bytes, check, deadline)
                               : packer_.Pack(session_, pass, *plan, u, zero_copy_, digests.get(), check, deadline);
    if (s.ok() && group.zero_copy && digests) s = DigestZeroCopy(pass, *plan, *digests);
    // Its readers have landed every chunk (or the sync failed somewhere).
    if (s.ok() && !u.chunk_ends.empty()) {
      s = region.WaitAcked(u.first_seq + u.chunk_ends.size() - 1, deadline, check, session_.ReaderDescriber());
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

  // The digests of a zero-copy sync's tensors where its readers read them: the source's
  // storage (on the trainer's GPU: ZeroCopyPlanner::Exportable) at the plan's offsets,
  // stable until the sync ends, on the device. Without an exportable storage none are
  // recorded and the sync is reported unverified.
  Status DigestZeroCopy(SyncPass& pass, const IpcPlan& plan, PassDigests& digests) {
    std::string why;
    const std::optional<SourceStorage> storage = zero_copy_.Exportable(pass.source(), &why);
    if (!storage) return Status::Ok();
    const std::vector<TensorMeta>& meta = pass.metadata();
    std::vector<DeviceTensorBytes> tensors;
    for (size_t i = 0; i < meta.size(); ++i) tensors.push_back({&meta[i], storage->data + plan.tensor_offsets[i]});
    return RecordDeviceDigests(storage->device, tensors, digests);
  }

  TrainerOptions options_;
  IpcTrainerOptions ipc_;
  std::shared_ptr<PassDigests> digests_;  // rank 0's sync under way, when it digests in-line
  const SessionDriver* driver_ = nullptr;  // rank 0: the engine's, for its lifetime
  IpcSession session_;
  IpcRankGroup group_;
  ZeroCopyPlanner zero_copy_;
  IpcSyncPlan sync_;
  IpcPacker packer_;
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
