#include "backends/ipc/receiver.h"

#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <future>
#include <mutex>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "backends/ipc/protocol.h"
#include "backends/ipc/region.h"
#include "core/log.h"
#include "model/worker_store.h"
#include "receiver/worker_thread.h"

namespace wsync {
namespace {

using nlohmann::json;

// One mapped session: the region and what init said about it.
struct Session {
  std::unique_ptr<IpcRegion> region;
  IpcInitInfo info;
  double timeout = 300;
};

class IpcReceiver final : public ReceiverBackend {
 public:
  explicit IpcReceiver(ReceiverContext* ctx) : ctx_(ctx) {
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
      int reader = info.reader_offset + w.dp_index * tp + w.tp_rank;
      if (reader >= info.reader_count) {
        return InvalidArgument(fmt::format(
            "{} would be reader {} (reader_offset {} + dp {} * tp {} + tp rank {}), outside reader_count {}",
            w.label, reader, info.reader_offset, w.dp_index, tp, w.tp_rank, info.reader_count));
      }
      if (!w.device.is_cpu()) {
        return Unimplemented(fmt::format("{} is on {}: ipc from CUDA staging needs the CUDA receiver (not built)",
                                         w.label, w.device.ToString()));
      }
    }
    std::string key = HostDeviceKey();
    WSYNC_ASSIGN_OR_RETURN(const IpcBufferDesc* buffer, info.FindBuffer(key));
    if (buffer->kind != "shm") {
      return InvalidArgument(fmt::format("init_info buffers['{}'] is of kind {}, CPU workers read kind shm", key,
                                         buffer->kind));
    }
    auto session = std::make_shared<Session>();
    WSYNC_ASSIGN_OR_RETURN(session->region, IpcRegion::Open(info));
    if (buffer->offset != session->region->header_bytes() || buffer->stride != session->region->slot_stride() ||
        session->region->slot(session->region->num_slots() - 1).empty()) {
      return InvalidArgument(fmt::format(
          "init_info buffers['{}'] puts the slots at offset {} stride {}, but the region {} holds them at "
          "offset {} stride {} in {} bytes", key, buffer->offset, buffer->stride, info.control_path,
          session->region->header_bytes(), session->region->slot_stride(), session->region->bytes()));
    }
    if (!session->region->TrainerAlive()) {
      return InvalidArgument(fmt::format("the trainer that created ipc region {} (pid {}) has exited",
                                         info.control_path, session->region->trainer_pid()));
    }
    for (const ReceiverWorker& w : ctx_->workers) {
      session->region->Attach(info.reader_offset + w.dp_index * tp + w.tp_rank, static_cast<uint32_t>(getpid()));
    }
    session->info = info;
    session->timeout = std::min(ctx_->timeout_seconds, info.timeout_seconds.value_or(ctx_->timeout_seconds));
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
    WSYNC_ASSIGN_OR_RETURN(IpcUpdateInfo u, IpcUpdateInfo::Parse(*req.update_info));
    IpcRegion& region = *session->region;
    if (u.session != session->info.session) {
      return FailedPrecondition(fmt::format(
          "update_info names ipc session {}, but this server mapped session {}: call "
          "init_weight_transfer_engine for the new session", u.session, session->info.session));
    }
    WSYNC_RETURN_IF_ERROR(u.Validate(req.tensors, region.slot_bytes()));
    if (!region.TrainerAlive()) {
      Release(session);
      return FailedPrecondition(fmt::format(
          "the trainer of ipc session {} (pid {}) has exited; its region is released: call "
          "init_weight_transfer_engine again", u.session, region.trainer_pid()));
    }
    int tp = ctx_->tp_size;
    for (const ReceiverWorker& w : ctx_->workers) {
      int reader = session->info.reader_offset + w.dp_index * tp + w.tp_rank;
      if (region.acked(reader) >= u.first_seq) {
        return FailedPrecondition(fmt::format("update_info first_seq {} of sync {} was already consumed by {}",
                                              u.first_seq, u.sync, w.label));
      }
    }

    Deadline deadline = Deadline::InSeconds(session->timeout);
    std::atomic<size_t> landed{0};
    std::vector<std::future<Status>> futures;
    for (const ReceiverWorker& w : ctx_->workers) {
      int reader = session->info.reader_offset + w.dp_index * tp + w.tp_rank;
      futures.push_back(w.thread->Post([&, reader, w]() -> Status {
        return Receive(w, reader, region, u, req.tensors, deadline, landed);
      }));
    }
    Status first;
    for (auto& f : futures) {
      Status s = f.get();
      if (first.ok() && !s.ok()) first = s;
    }
    if (first.ok()) return first;
    if (!region.TrainerAlive()) Release(session);
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
  // Lands every chunk of the update in one worker's shards; runs on the worker's thread.
  static Status Receive(const ReceiverWorker& w, int reader, IpcRegion& region, const IpcUpdateInfo& u,
                        const std::vector<TensorMeta>& tensors, Deadline deadline, std::atomic<size_t>& landed) {
    size_t n = u.num_chunks();
    for (size_t k = 0; k < n; ++k) {
      uint64_t seq = u.first_seq + k;
      std::string what = fmt::format("{}: chunk {}/{} of sync {}", w.label, k + 1, n, u.sync);
      WSYNC_RETURN_IF_ERROR(region.WaitPublished(seq, u.sync, deadline, what));
      std::span<std::byte> slot = region.slot(static_cast<int>(seq % region.num_slots()));
      for (size_t i = u.chunk_first(k); i < u.chunk_ends[k]; ++i) {
        const TensorMeta& m = tensors[i];
        TensorRef ref{m.name, m.dtype, m.shape, slot.subspan(u.tensor_offsets[i], u.tensor_sizes[i]), w.device};
        WSYNC_RETURN_IF_ERROR(w.store->Load(ref).WithContext(w.label));
      }
      landed.fetch_add(1);
      region.Ack(reader, seq);
    }
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
  std::mutex mu_;
  std::condition_variable cv_;
  std::shared_ptr<Session> session_;  // GUARDED_BY(mu_); an update holds its own reference
  bool stopping_ = false;             // GUARDED_BY(mu_)
  std::thread watcher_;
};

}  // namespace

Result<std::unique_ptr<ReceiverBackend>> CreateIpcReceiver(ReceiverContext* context) {
  return std::unique_ptr<ReceiverBackend>(std::make_unique<IpcReceiver>(context));
}

}  // namespace wsync
