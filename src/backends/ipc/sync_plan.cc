#include "backends/ipc/sync_plan.h"

#include <optional>

#include <fmt/format.h>

#include "control/session_driver.h"
#include "wsync/device_runtime.h"

namespace wsync {

Status IpcSyncPlan::Plan(SyncContext& sync, const GroupSync& group, bool zero_copy_group, IpcSession& session,
                         ZeroCopyPlanner& zero_copy) {
  const std::vector<TensorMeta>& meta = sync.pass.metadata();
  IpcRegion& region = *session.region();
  const uint64_t id = session.NextSync();
  if (!options_.device.is_cpu()) WSYNC_RETURN_IF_ERROR(UseDeviceOnThisThread(options_.device));
  std::string why;
  std::optional<SourceStorage> storage = zero_copy.Exportable(sync.pass.source(), &why);
  if (zero_copy_group) {
    zero_copy_ = group.zero_copy;
  } else {
    zero_copy_ = storage && ipc_.mode != IpcTrainerOptions::Mode::kPacked && region.publisher_count() == 1 &&
                 (ipc_.mode == IpcTrainerOptions::Mode::kZeroCopy || zero_copy.Knows(*storage));
    if (zero_copy_) zero_copy.UseStorage(*storage);
  }
  if (!options_.device.is_cpu() && ipc_.mode == IpcTrainerOptions::Mode::kZeroCopy && !zero_copy_) {
    return FailedPrecondition(fmt::format("the ipc trainer exports no staging slots (mode zero_copy), so {}",
                                          why.empty() ? std::string("it cannot pack") : why));
  }
  IpcUpdateInfo u;
  u.session = region.session();
  u.first_seq = session.next_seq();
  if (zero_copy_) {
    WSYNC_ASSIGN_OR_RETURN(plan_, zero_copy.Plan(sync.pass, zero_copy_group ? &group.buffers : nullptr,
                                                 session.device_key(), zero_copy_group, &u));
  } else {
    WSYNC_ASSIGN_OR_RETURN(plan_, PlanIpcChunks(meta, region.slot_bytes()));
    u.tensor_offsets = plan_.tensor_offsets;
  }
  u.chunk_ends = plan_.chunk_ends;
  for (const TensorMeta& m : meta) u.tensor_sizes.push_back(m.nbytes());
  sync.update_body = UpdateBody(meta, u);
  u.sync = id;
  update_ = std::move(u);
  sync.stats.bytes = plan_.payload_bytes;
  sync.stats.chunks = plan_.chunk_ends.size();
  region.Announce(update_.sync, update_.first_seq);
  return Status::Ok();
}

std::shared_ptr<const std::string> IpcSyncPlan::UpdateBody(const std::vector<TensorMeta>& meta,
                                                           const IpcUpdateInfo& u) {
  IpcUpdateInfo layout = u;
  layout.sync = layout.first_seq = 0;
  if (body_.bytes == nullptr || !(body_.update == layout) || body_.meta != meta) {
    nlohmann::json extra = nlohmann::json::object();
    layout.AddTo(&extra);
    body_ = CachedBody{meta, std::move(layout), wsync::UpdateBody(meta, extra)};
  }
  return body_.bytes;
}

}  // namespace wsync
