#include "backends/ipc/trainer.h"

#include <fcntl.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "backends/ipc/protocol.h"
#include "control/client.h"
#include "control/fleet.h"
#include "receiver/update_info.h"
#include "core/log.h"
#include "core/parallel.h"

namespace wsync {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Copies one tensor into the slot, on several threads when it is large.
void CopyInto(std::byte* dst, std::span<const std::byte> src, size_t threads) {
  constexpr size_t kPiece = size_t{8} << 20;
  if (src.size() < 2 * kPiece || threads <= 1) {
    std::memcpy(dst, src.data(), src.size());
    return;
  }
  size_t pieces = (src.size() + kPiece - 1) / kPiece;
  ParallelFor(pieces, threads, [&](size_t b, size_t e) {
    size_t from = b * kPiece, to = std::min(src.size(), e * kPiece);
    std::memcpy(dst + from, src.data() + from, to - from);
  });
}

class IpcTrainer final : public TrainerEngine {
 public:
  IpcTrainer(const TrainerOptions& o, const IpcTrainerOptions& ipc)
      : options_(o), ipc_(ipc), client_(o.servers, ClientOptions{o.api_key, 10}) {}
  ~IpcTrainer() override { Shutdown(); }

  Status Init(const std::vector<TensorMeta>& metadata) override {
    if (!options_.device.is_cpu()) {
      return Unimplemented(fmt::format(
          "trainer device {}: the ipc backend's CUDA staging (CUDA IPC / cuMem fd export keyed by "
          "GPU UUID) is not wired into this trainer yet; use --device cpu",
          options_.device.ToString()));
    }
    Shutdown();
    if (options_.rank != 0) return Status::Ok();  // not the sender: nothing to export
    Deadline deadline = Deadline::InSeconds(options_.timeout_seconds);
    // Servers give up a little before the trainer does, so that their account of a
    // failure arrives before the trainer's own wait ends (as the nccl backend does).
    double server_timeout = ServerTimeout(options_.timeout_seconds);
    Deadline http_deadline = Deadline::InSeconds(options_.timeout_seconds + 5);
    WSYNC_ASSIGN_OR_RETURN(std::vector<int> per_server, ServerWorldSizes(client_, deadline));
    std::vector<int> offsets;
    WSYNC_ASSIGN_OR_RETURN(int readers, IpcReaderOffsets(per_server, options_.data_parallel_size, &offsets));
    reader_labels_ = ReaderLabels(readers, offsets, deadline);

    IpcRegionOptions r;
    r.session = NewSessionId();
    r.num_slots = std::clamp(options_.num_buffers, 1, kIpcMaxSlots);
    r.slot_bytes = IpcSlotBytes(metadata, static_cast<uint64_t>(options_.bucket_gb * double(uint64_t{1} << 30)));
    r.reader_count = readers;
    r.backing = ipc_.backing;
    WSYNC_ASSIGN_OR_RETURN(std::unique_ptr<IpcRegion> region, IpcRegion::Create(r));

    IpcInitInfo info;
    info.session = region->session();
    info.control_path = region->path();
    info.control_bytes = region->bytes();
    info.num_slots = region->num_slots();
    info.slot_bytes = region->slot_bytes();
    info.reader_count = region->reader_count();
    info.buffers[HostDeviceKey()] = region->ShmBuffer();
    info.timeout_seconds = server_timeout;
    std::vector<json> bodies;
    for (int offset : offsets) {
      info.reader_offset = offset;
      bodies.push_back(json{{"init_info", info.ToJson()}});
    }
    WSYNC_LOG_INFO("init: {} servers, {} readers, reader offsets [{}], {} slot(s) of {} bytes in {}",
                   offsets.size(), info.reader_count, fmt::join(offsets, ", "), info.num_slots,
                   info.slot_bytes, info.control_path);
    auto pending = client_.PostAsync("/init_weight_transfer_engine", std::move(bodies), http_deadline);
    WSYNC_RETURN_IF_ERROR(pending->Wait(http_deadline).status());
    region->UnlinkName();  // every server has it open now
    for (int reader = 0; reader < readers; ++reader) {
      if (region->reader_pid(reader) == 0) {
        return FailedPrecondition(fmt::format(
            "no server took reader {} ({}) of the ipc session: do the servers' DP layouts match "
            "--data-parallel-size {}?", reader, reader_labels_[reader], options_.data_parallel_size));
      }
    }
    region_ = std::move(region);
    next_seq_ = 1;
    sync_ = 0;
    return Status::Ok();
  }

  Result<SyncStats> SendWeights(WeightSource& source, const std::optional<std::string>& weight_version) override {
    const std::vector<TensorMeta>& meta = source.metadata();
    if (options_.rank != 0) {
      // Not the sender: drain the same two passes the sender makes (every pass of a
      // multi-rank source is a collective among the trainer ranks).
      auto t0 = Clock::now();
      for (const char* pass : {"check pass", "transfer pass"}) {
        Status s = DrainChecked(source);
        if (!s.ok()) return s.WithContext(fmt::format("trainer rank {} ({} of the sync)", options_.rank, pass));
      }
      SyncStats stats;
      stats.tensors = meta.size();
      stats.seconds = stats.transfer_seconds = Since(t0);
      return stats;
    }
    // The whole iteration is checked before anything is sent.
    WSYNC_RETURN_IF_ERROR(DrainChecked(source));
    if (!region_) return FailedPrecondition("no ipc session: call Init() (a failed sync ends the session)");
    WSYNC_ASSIGN_OR_RETURN(IpcPlan plan, PlanIpcChunks(meta, region_->slot_bytes()));
    IpcUpdateInfo u;
    u.session = region_->session();
    u.sync = ++sync_;
    u.first_seq = next_seq_;
    u.tensor_offsets = plan.tensor_offsets;
    u.chunk_ends = plan.chunk_ends;
    json update = TensorListJson(meta);
    for (const TensorMeta& m : meta) u.tensor_sizes.push_back(m.nbytes());
    u.AddTo(&update);

    SyncStats stats;
    stats.bytes = plan.payload_bytes;
    stats.tensors = meta.size();
    stats.chunks = plan.chunk_ends.size();
    Deadline deadline = Deadline::InSeconds(options_.timeout_seconds);
    Deadline http_deadline = Deadline::InSeconds(options_.timeout_seconds + 5);
    auto t0 = Clock::now();
    Status started = client_.Post("/start_weight_update", json::object(), deadline).status();
    if (!started.ok()) {
      CloseSessions();
      return started;
    }
    stats.start_seconds = Since(t0);
    auto t1 = Clock::now();
    auto pending = client_.PostAsync("/update_weights",
                                     std::vector<json>(client_.urls().size(), json{{"update_info", update}}),
                                     http_deadline);
    Status s = Transfer(source, meta, plan, u, *pending, deadline);
    if (s.ok()) s = pending->Wait(http_deadline).status();
    if (!s.ok()) {
      region_->Abort(u.sync, s.message());
      // A server's own account explains more than "it stopped acknowledging".
      if (s.code() == StatusCode::kAborted || s.code() == StatusCode::kDeadlineExceeded) {
        Result<std::vector<json>> r = pending->Wait(Deadline::InSeconds(2));
        if (!r.ok() && r.status().code() != StatusCode::kDeadlineExceeded) s = r.status();
      }
      CloseSessions();
      Shutdown();
      return s;
    }
    next_seq_ += plan.chunk_ends.size();
    stats.transfer_seconds = Since(t1);
    auto t2 = Clock::now();
    json finish = json::object();
    if (weight_version) finish["weight_version"] = *weight_version;
    WSYNC_RETURN_IF_ERROR(client_.Post("/finish_weight_update", finish, deadline).status());
    stats.finish_seconds = Since(t2);
    stats.seconds = Since(t0);
    return stats;
  }

  void Shutdown() override { region_.reset(); }

 private:
  // Packs and publishes every chunk; chunk k goes into slot (first_seq + k) % num_slots
  // once every reader is done with what that slot held before.
  Status Transfer(WeightSource& source, const std::vector<TensorMeta>& meta, const IpcPlan& plan,
                  const IpcUpdateInfo& u, FanOutClient::Pending& http, Deadline deadline) {
    WSYNC_ASSIGN_OR_RETURN(auto inner, source.Iterate());
    auto stream = CheckedStream(std::move(inner), meta);
    auto check = [&http]() -> Status {
      if (!http.AnyFailed()) return Status::Ok();
      Result<std::vector<json>> r = http.Wait(Deadline::InSeconds(1));
      return r.ok() ? Aborted("a server ended its update early") : r.status();
    };
    auto describe = [this](int r) {
      return r < static_cast<int>(reader_labels_.size()) ? reader_labels_[r] : fmt::format("reader {}", r);
    };
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
      std::span<std::byte> slot = region_->slot(static_cast<int>(seq % region_->num_slots()));
      TensorRef t;
      for (size_t i = u.chunk_first(k); i < u.chunk_ends[k]; ++i) {
        WSYNC_ASSIGN_OR_RETURN(bool more, stream->Next(&t));
        if (!more) return Internal(fmt::format("source ended before tensor {}", meta[i].name));
        CopyInto(slot.data() + plan.tensor_offsets[i], t.bytes, threads);
        p.bytes_done += t.bytes.size();
      }
      region_->Publish(seq, plan.chunk_bytes[k]);
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

  // Ends any session still open on a server after a failed sync (409s are expected from
  // servers whose failed update already ended theirs).
  void CloseSessions() {
    (void)client_.Post("/finish_weight_update", json::object(), Deadline::InSeconds(10));
  }

  // Names every reader from the servers' /health when they are wsync servers.
  std::vector<std::string> ReaderLabels(int readers, const std::vector<int>& offsets, Deadline deadline) {
    return WorkerLabels(client_, readers, offsets, deadline);
  }

  TrainerOptions options_;
  IpcTrainerOptions ipc_;
  FanOutClient client_;
  std::unique_ptr<IpcRegion> region_;
  std::vector<std::string> reader_labels_;
  uint64_t next_seq_ = 1;
  uint64_t sync_ = 0;
  size_t chunks_published_ = 0;
};

}  // namespace

Result<std::unique_ptr<TrainerEngine>> CreateIpcTrainerWith(const TrainerOptions& options, const IpcTrainerOptions& ipc) {
  if (options.servers.empty() && options.rank == 0) return InvalidArgument("no servers given (--servers)");
  if (options.timeout_seconds <= 0) return InvalidArgument("--timeout must be positive");
  if (options.bucket_gb <= 0) return InvalidArgument("--bucket-gb must be positive");
  if (!options.packed) {
    return Unimplemented("the ipc backend sends packed chunks only (--unpacked is not supported: "
                         "one handle per tensor keeps the whole model resident on the trainer)");
  }
  return std::unique_ptr<TrainerEngine>(std::make_unique<IpcTrainer>(options, ipc));
}

Result<std::unique_ptr<TrainerEngine>> CreateIpcTrainer(const TrainerOptions& options) {
  IpcTrainerOptions ipc;
  // The one environment knob of this backend: test-only fault injection (see trainer.h).
  if (const char* v = std::getenv("WSYNC_IPC_FAULT_STALL_AFTER_CHUNKS"); v != nullptr && *v != '\0') {
    ipc.stall_after_chunks = std::strtoull(v, nullptr, 10);
  }
  return CreateIpcTrainerWith(options, ipc);
}

}  // namespace wsync
