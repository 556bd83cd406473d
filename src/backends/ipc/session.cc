#include "backends/ipc/session.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/log.h"
#include "wsync/device_runtime.h"

namespace wsync {

using nlohmann::json;

Result<IpcSession::Offer> IpcSession::Create(const PlaneInit& init, int publishers) {
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
  info.wsync_device_digests = gpu;
  // Servers give up a little before the trainer does, so that their account of a
  // failure arrives before the trainer's own wait ends.
  info.timeout_seconds = driver.deadlines().server_timeout();
  return o;
}

Status IpcSession::Open(Offer o, const SessionDriver& driver) {
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
  WSYNC_RETURN_IF_ERROR(driver.Init(std::move(infos)));
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

void IpcSession::Join(std::unique_ptr<IpcRegion> region, std::unique_ptr<DeviceExport> staging,
                      std::string device_key) {
  if (region) has_readers_ = region->HasReaders();
  region_ = std::move(region);
  staging_ = std::move(staging);
  device_key_ = std::move(device_key);
  sync_ = 0;
}

void IpcSession::Close() {
  has_readers_ = true;
  published_seq_ = 0;
  staging_.reset();
  region_.reset();
}

Status IpcSession::WaitSlotFree(uint64_t seq, Deadline deadline, const std::function<Status()>& check) const {
  uint64_t previous = seq > static_cast<uint64_t>(region_->num_slots()) ? seq - region_->num_slots() : 0;
  return region_->WaitAcked(previous, deadline, check, ReaderDescriber());
}

void IpcSession::Publish(uint64_t seq, uint64_t bytes) {
  region_->Publish(seq, bytes);
  published_seq_ = seq;
}

void IpcSession::Quiesce(SessionDriver::Pending* http) const {
  Deadline bound = Deadline::InSeconds(2);
  if (http != nullptr) {
    while (!http->Done() && !bound.expired()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  } else if (region_ && published_seq_ > 0) {
    (void)region_->WaitAcked(published_seq_, bound, nullptr, nullptr);
  }
}

namespace {

std::function<Status()> HttpCheck(SessionDriver::Pending& http) {
  return [&http]() -> Status {
    if (!http.AnyFailed()) return Status::Ok();
    Result<std::vector<json>> r = http.Wait(Deadline::InSeconds(1));
    return r.ok() ? Aborted("a server ended its update early") : r.status();
  };
}

}  // namespace

std::function<Status()> IpcSession::SenderCheck(SessionDriver::Pending& http, uint64_t sync) const {
  if (region_->publisher_count() == 1) return HttpCheck(http);
  return [this, &http, sync]() -> Status {
    WSYNC_RETURN_IF_ERROR(HttpCheck(http)());
    if (auto reason = region_->AbortedReason(sync)) return Aborted(fmt::format("sync {} was abandoned: {}", sync, *reason));
    return Status::Ok();
  };
}

std::function<Status()> IpcSession::PeerCheck(uint64_t sync) const {
  using Clock = std::chrono::steady_clock;
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

std::function<std::string(int)> IpcSession::ReaderDescriber() const {
  return [this](int r) {
    return r < static_cast<int>(reader_labels_.size()) ? reader_labels_[r] : fmt::format("reader {}", r);
  };
}

}  // namespace wsync
