#include "backends/ipc/zero_copy_plan.h"

#include <algorithm>

#include <fmt/format.h>

#include "core/log.h"

namespace wsync {

std::optional<SourceStorage> ZeroCopyPlanner::Exportable(const WeightSource& source, std::string* why) const {
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

Result<bool> ZeroCopyPlanner::Export(const SourceStorage& storage, int publisher) {
  WSYNC_ASSIGN_OR_RETURN(std::unique_ptr<DeviceExport> ex,
                         DeviceExport::Existing(options_.device, storage.data, storage.bytes));
  bool changed = storage.data != exported_data_ || storage.bytes != exported_bytes_ || export_ == nullptr ||
                 ex->offset() != export_->offset() || ex->Identity() != export_->Identity();
  if (!changed) return false;
  // Kept while the generation lives: a cuda_fd export holds the fd the servers take.
  export_ = std::move(ex);
  exported_ = IpcBufferDesc{std::string(export_->kind()), export_->offset(), 0, export_->Handle(),
                            std::max(publisher, 0)};
  exported_data_ = storage.data;
  exported_bytes_ = storage.bytes;
  WSYNC_LOG_INFO("zero-copy: exported the source's {} bytes on {}", storage.bytes, options_.device.ToString());
  return true;
}

Result<IpcPlan> ZeroCopyPlanner::Plan(SyncPass& pass, const std::map<std::string, IpcBufferDesc>* group,
                                      const std::string& device_key, bool in_group, IpcUpdateInfo* u) {
  WSYNC_ASSIGN_OR_RETURN(IpcPlan plan, Layout(pass, in_group));
  if (group == nullptr) {
    WSYNC_ASSIGN_OR_RETURN(bool changed, Export(sync_layout_->storage, 0));
    if (changed) NewGeneration();
  }
  IpcZeroCopy z;
  z.generation = generation_;
  z.bytes = sync_layout_->storage.bytes;
  if (!sent_) {
    if (group != nullptr) z.buffers = *group;
    else z.buffers[device_key] = exported_;
  }
  u->zero_copy = std::move(z);
  u->tensor_offsets = plan.tensor_offsets;
  return plan;
}

Result<IpcPlan> ZeroCopyPlanner::Layout(SyncPass& pass, bool in_group) {
  const std::vector<TensorMeta>& meta = pass.metadata();
  if (!sync_layout_) return Internal("zero-copy without the layout of the source's storage");
  if (!pass_read_) {
    WSYNC_ASSIGN_OR_RETURN(std::shared_ptr<TensorStream> stream, pass.Stream());
    Result<StorageLayout> read = ReadStorageLayout(*stream, meta, sync_layout_->storage);
    if (read.ok() && in_group) {
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

Status ZeroCopyPlanner::ReadPassFirst(SyncPass& pass, bool applies, bool learns) {
  pass_read_ = false;
  if (!applies) return Status::Ok();
  pass_read_ = true;
  std::string why;
  std::optional<SourceStorage> storage = Exportable(pass.source(), &why);
  if (!learns || !storage) {
    sync_layout_.reset();
    return pass.ReadAll();
  }
  WSYNC_ASSIGN_OR_RETURN(std::shared_ptr<TensorStream> stream, pass.Stream());
  Result<StorageLayout> read = ReadStorageLayout(*stream, pass.metadata(), *storage);
  if (!read.ok()) return read.status().WithContext("zero-copy");
  sync_layout_ = learned_ = std::move(*read);
  return Status::Ok();
}

void ZeroCopyPlanner::Learn(Result<StorageLayout> learned, bool had_storage) {
  if (learned.ok()) {
    learned_ = std::move(*learned);
  } else if (had_storage) {
    learned_.reset();
    WSYNC_LOG_DEBUG("mode auto keeps packing this source: {}", learned.status().message());
  }
}

void ZeroCopyPlanner::NewGeneration() {
  ++generation_;
  sent_ = false;
}

}  // namespace wsync
