#include "backends/nccl/receiver.h"

#include <signal.h>
#include <unistd.h>

#include <future>
#include <vector>

#include <fmt/format.h>

#include "backends/nccl/init_info.h"
#include "backends/nccl/staging.h"
#include "backends/receiver_group.h"
#include "comm/communicator.h"
#include "comm/connect.h"
#include "core/log.h"
#include "core/progress_gate.h"
#include "model/worker_store.h"
#include "receiver/worker_fanout.h"
#include "receiver/worker_thread.h"

namespace wsync {
namespace {

using nlohmann::json;

class NcclReceiver final : public ReceiverBackend {
 public:
  explicit NcclReceiver(ReceiverContext* ctx)
      : ctx_(ctx), slots_(ctx->workers.size()),
        fault_die_mid_update_(ctx->backend_config.value("fault", "") == "die-mid-update") {}
  ~NcclReceiver() override { Shutdown(); }

  std::string_view name() const override { return "nccl"; }

  // Without a peer address only --allow-store-host admits a Gloo store.
  Status Init(const json& init_info) override { return InitFromPeer(init_info, ""); }

  Status InitFromPeer(const json& init_info, const std::string& peer_address) override {
    WSYNC_ASSIGN_OR_RETURN(NcclInitInfo info, NcclInitInfo::Parse(init_info));
    for (const ReceiverWorker& w : ctx_->workers) {
      int64_t rank = Rank(info, w);
      if (rank >= info.world_size) {
        return InvalidArgument(fmt::format(
            "{} would be rank {} (rank_offset {} + dp {} * tp {} + tp rank {}), outside world_size {}",
            w.label, rank, info.rank_offset, w.dp_index, ctx_->tp_size, w.tp_rank, info.world_size));
      }
    }
    if (info.uses_gloo()) {
      // The store this server dials: the peer's own address (store_address.h).
      WSYNC_ASSIGN_OR_RETURN(info.gloo_store_host, AdmitGlooStore(*ctx_, *info.gloo_store_host, peer_address));
    } else {
      WSYNC_RETURN_IF_ERROR(CheckNcclWorkers(*ctx_));
    }
    Shutdown();
    double timeout = ctx_->TimeoutFor(info.timeout_seconds);
    Deadline deadline = Deadline::InSeconds(timeout);
    std::vector<std::string> labels = info.gloo_rank_labels;
    DescribeRank describe = [labels](int r) {
      if (r >= 0 && r < static_cast<int>(labels.size())) return fmt::format("rank {} ({})", r, labels[r]);
      return r == 0 ? std::string("rank 0 (trainer)") : fmt::format("rank {}", r);
    };
    auto op_timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout * 1000));
    std::vector<std::future<Status>> futures;
    for (size_t i = 0; i < ctx_->workers.size(); ++i) {
      const ReceiverWorker& w = ctx_->workers[i];
      CommSpec spec;
      if (info.uses_gloo()) {
        spec.store = CommSpec::Store{*info.gloo_store_host, *info.gloo_store_port, *info.gloo_prefix};
      } else {
        spec.nccl_unique_id_b64 = *info.nccl_unique_id_b64;
        spec.device = w.device.index;
        // wsync trainers say how they cut each chunk; vLLM's send one call per chunk.
        spec.piece_bytes = static_cast<size_t>(info.wsync_broadcast_piece_bytes.value_or(0));
      }
      spec.rank = static_cast<int>(Rank(info, w));
      spec.size = info.world_size;
      spec.connect_deadline = deadline;
      spec.op_timeout = op_timeout;
      spec.describe_rank = describe;
      auto connect = [spec] { return Connect(spec); };
      futures.push_back(w.thread->Post([this, i, connect, deadline, info]() -> Status {
        WSYNC_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> comm, connect());
        float warmup = 0.0f;  // vLLM's one-element float32 SUM warm-up
        WSYNC_RETURN_IF_ERROR(comm->AllReduceSum(std::span<float>(&warmup, 1), deadline));
        slots_[i].comm = std::move(comm);
        // Receive buffers for an update of the whole model, now rather than in the first
        // update (which then runs as fast as the later ones).
        const ReceiverWorker& worker = ctx_->workers[i];
        WSYNC_ASSIGN_OR_RETURN(ChunkPlan plan, PlanFor(info, worker.sink->hf_tensors()));
        slots_[i].buffers.resize(RingSize(info));
        return ReserveRing(slots_[i].buffers, info.uses_gloo() ? Device{} : worker.device, plan)
            .WithContext(fmt::format("{}: allocating receive buffers", worker.label));
      }));
    }
    Status s = JoinAll(futures);
    if (!s.ok()) {
      Shutdown();
      return s;
    }
    info_ = info;
    timeout_ = timeout;
    // NCCL receives into device buffers; Gloo into host buffers (loaded into shards on
    // whatever device they live).
    device_buffers_ = !info.uses_gloo();
    WSYNC_LOG_INFO("joined broadcast group: world {}, ranks {}..{}, packed {}", info.world_size,
                   Rank(info, ctx_->workers.front()), Rank(info, ctx_->workers.back()), info.packed);
    return Status::Ok();
  }

  Status Update(const UpdateRequest& req) override {
    if (!info_ || slots_.front().comm == nullptr || slots_.front().comm->aborted()) {
      if (!req.reject.ok()) return req.reject;
      return FailedPrecondition(
          "no live broadcast group: call init_weight_transfer_engine first (a failed sync "
          "tears the group down)");
    }
    Deadline deadline = Deadline::InSeconds(timeout_);
    const std::vector<TensorMeta>& tensors = *req.tensors;
    ChunkPlan plan;
    if (req.reject.ok()) {
      WSYNC_ASSIGN_OR_RETURN(plan, PlanFor(*info_, tensors));
    }
    bool preflight = info_->wsync_protocol.has_value();
    if (!preflight && !req.reject.ok()) return req.reject;  // vLLM peers: nothing to join

    Status s = RunOnEveryWorker(ctx_->workers, "update_weights", deadline, [&](size_t i, const ReceiverWorker& w) {
      Slot& slot = slots_[i];
      if (preflight) {
        int64_t vote = req.reject.ok() ? 0 : 1;
        WSYNC_RETURN_IF_ERROR(slot.comm->AllReduceSum(std::span<int64_t>(&vote, 1), deadline));
        if (!req.reject.ok()) return req.reject;
        if (vote != 0) {
          return Aborted(fmt::format(
              "update abandoned: {} other rank(s) of the broadcast group rejected it (the "
              "trainer reports why)", vote));
        }
      }
      return ReceiveInto(w, slot, tensors, plan, deadline);
    });
    if (!req.reject.ok()) return req.reject;  // this server's own refusal, whatever the vote
    if (!s.ok() && s.code() != StatusCode::kAborted && req.reject.ok()) {
      // The data phase failed: the group is unusable for every worker of this server.
      for (Slot& slot : slots_) {
        if (slot.comm) slot.comm->Abort();
      }
    }
    return s;
  }

  void Shutdown() override {
    for (Slot& slot : slots_) {
      if (slot.comm) slot.comm->Abort();
      slot.comm.reset();
    }
    info_.reset();
  }

 private:
  struct Slot {
    std::unique_ptr<Communicator> comm;
    std::vector<StagingBuffer> buffers;  // receive buffers, reused across syncs
  };

  static Result<ChunkPlan> PlanFor(const NcclInitInfo& info, const std::vector<TensorMeta>& tensors) {
    return info.packed ? PlanChunks(tensors, static_cast<size_t>(info.packed_buffer_size_bytes))
                       : PlanChunks(tensors, 1);  // one tensor per chunk
  }
  static size_t RingSize(const NcclInitInfo& info) { return std::max(1, std::min(info.packed_num_buffers, 2)); }

  // In int64: rank_offset and world_size are bounded (init_info.h), the sum is not.
  int64_t Rank(const NcclInitInfo& info, const ReceiverWorker& w) const {
    return int64_t{info.rank_offset} + ctx_->DeploymentIndex(w);
  }

  // Receives every chunk and loads it; runs on the worker's thread. Loading chunk k
  // overlaps the receipt of chunk k+1 (one loader task in flight per buffer).
  Status ReceiveInto(const ReceiverWorker& w, Slot& slot, const std::vector<TensorMeta>& tensors,
                     const ChunkPlan& plan, Deadline deadline) {
    const size_t nbuf = RingSize(*info_);
    slot.buffers.resize(nbuf);
    const Device buffer_device = device_buffers_ ? w.device : Device{};
    WSYNC_RETURN_IF_ERROR(ReserveRing(slot.buffers, buffer_device, plan));
    // A loader thread lands each tensor as soon as all of its bytes have arrived, while
    // the rest of the chunk (and the next one) is still on the wire.
    const size_t n = plan.chunks.size();
    std::vector<ProgressGate> arrived(n);  // bytes of chunk k received
    ProgressGate loaded;                   // chunks fully loaded into the shards
    std::thread loader([&] {
      if (Status s = UseDeviceOnThisThread(w.device); !s.ok()) return loaded.Fail(s);
      for (size_t k = 0; k < n; ++k) {
        const Chunk& c = plan.chunks[k];
        std::span<const std::byte> buf = slot.buffers[k % nbuf].span(c.bytes);
        for (size_t t = c.first; t < c.end; ++t) {
          const TensorMeta& m = tensors[t];
          size_t off = plan.offset_in_chunk[t];
          Status s = arrived[k].WaitFor(off + m.nbytes(), deadline, "chunk bytes");
          if (s.ok()) {
            s = w.sink->Load(TensorRef{m.name, m.dtype, m.shape, buf.subspan(off, m.nbytes()), buffer_device})
                    .WithContext(w.label);
          }
          if (!s.ok()) return loaded.Fail(s);
        }
        if (Status s = w.sink->ChunkLanded().WithContext(w.label); !s.ok()) return loaded.Fail(s);
        loaded.Advance(k + 1);
        if (fault_die_mid_update_ && k + 1 < n) {
          WSYNC_LOG_WARN("fault injection (--fault die-mid-update): {} loaded chunk 1/{}; killing this process", w.label, n);
          kill(getpid(), SIGKILL);
        }
      }
    });
    Status result;
    for (size_t k = 0; k < n; ++k) {
      const Chunk& c = plan.chunks[k];
      if (k >= nbuf) {
        result = loaded.WaitFor(k - nbuf + 1, deadline, "the loader to free a buffer");
        if (!result.ok()) break;
      }
      Communicator::StreamHooks hooks;
      hooks.on_received = [&arrived, k](size_t end) { arrived[k].Advance(end); };
      Status s = slot.comm->Broadcast(slot.buffers[k % nbuf].span(c.bytes), 0, deadline, hooks);
      if (!s.ok()) {
        result = s.WithContext(fmt::format("{}: receiving chunk {}/{} ({} bytes, tensors {}..{})",
                                           w.label, k + 1, n, c.bytes, tensors[c.first].name,
                                           tensors[c.end - 1].name));
        break;
      }
    }
    if (!result.ok()) {
      for (ProgressGate& g : arrived) g.Fail(result);
    }
    loader.join();
    if (result.ok()) result = loaded.WaitFor(n, deadline, "the loader");
    return result;
  }

  ReceiverContext* ctx_;
  std::vector<Slot> slots_;  // one per worker, touched only from that worker's thread
  std::optional<NcclInitInfo> info_;
  double timeout_ = 300;
  bool device_buffers_ = false;  // NCCL: receive buffers on each worker's GPU; Gloo: host
  bool fault_die_mid_update_ = false;
};

}  // namespace

Result<std::unique_ptr<ReceiverBackend>> CreateNcclReceiver(ReceiverContext* context) {
  return std::unique_ptr<ReceiverBackend>(std::make_unique<NcclReceiver>(context));
}

}  // namespace wsync
