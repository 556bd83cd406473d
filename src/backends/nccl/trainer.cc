#include "backends/nccl/trainer.h"

#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <future>
#include <mutex>
#include <random>
#include <thread>

#include <fmt/format.h>

#include "backends/nccl/init_info.h"
#include "backends/nccl/staging.h"
#include "comm/communicator.h"
#include "comm/gloo_communicator.h"
#ifdef WSYNC_WITH_NCCL
#include "comm/nccl_communicator.h"
#endif
#include "comm/store.h"
#include "control/client.h"
#include "control/init_payloads.h"
#include "control/fleet.h"
#include "core/log.h"
#include "core/non_sender_trainer.h"
#include "core/progress_gate.h"
#include "plan/packing.h"
#include "receiver/update_info.h"

namespace wsync {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::string RandomHex(int bytes) {
  std::random_device rd;
  std::string out;
  for (int i = 0; i < bytes; ++i) out += fmt::format("{:02x}", rd() & 0xff);
  return out;
}

// Runs `op` on its own thread and waits for it, for the first failure among the servers'
// HTTP replies, or for the deadline, whichever comes first. On an HTTP failure or the
// deadline it aborts `comm` (which wakes a blocked broadcast) and returns that error; the
// op keeps only shared state, so it may finish after this returns.
Status Watched(std::function<Status()> op, Communicator& comm, FanOutClient::Pending* http,
               Deadline deadline, const char* what) {
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    Status status;
  };
  auto state = std::make_shared<State>();
  std::thread([state, op = std::move(op)] {
    Status s = op();
    std::lock_guard lock(state->mu);
    state->done = true;
    state->status = s;
    state->cv.notify_all();
  }).detach();
  std::unique_lock lock(state->mu);
  for (;;) {
    if (state->cv.wait_for(lock, std::chrono::milliseconds(20), [&] { return state->done; })) {
      if (state->status.ok() || http == nullptr) return state->status;
      // A server that dies breaks every rank's connections at once, and the collective
      // may report a surviving rank first; the dead server's own HTTP call fails within
      // moments, and its error is the one that names the culprit.
      Status op_status = state->status;
      lock.unlock();
      Deadline grace = Deadline::InSeconds(std::min(2.0, std::max(0.0, deadline.remaining_seconds())));
      while (!http->AnyFailed() && !http->Done() && !grace.expired()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      if (!http->AnyFailed()) return op_status;
      Result<std::vector<json>> r = http->Wait(Deadline::InSeconds(1));
      if (r.ok()) return op_status;
      return Status(r.status().code(),
                    fmt::format("{} (the {} failed with: {})", r.status().message(), what, op_status.message()));
    }
    if (http != nullptr && http->AnyFailed()) {
      comm.Abort();
      state->cv.wait_for(lock, std::chrono::seconds(10), [&] { return state->done; });
      lock.unlock();
      Result<std::vector<json>> r = http->Wait(Deadline::InSeconds(1));
      return r.ok() ? Aborted(fmt::format("{} aborted", what)) : r.status();
    }
    if (deadline.expired()) {
      comm.Abort();
      return DeadlineExceeded(fmt::format("{} did not finish within the timeout", what));
    }
  }
}

// The NCCL piece size asked of wsync servers: kWsyncBroadcastPieceBytes, or
// WSYNC_NCCL_PIECE_MB (a tuning knob; the servers follow what init_info says).
int64_t BroadcastPieceBytes() {
  const char* env = std::getenv("WSYNC_NCCL_PIECE_MB");
  int64_t mb = env ? std::strtoll(env, nullptr, 10) : 0;
  return mb > 0 ? mb << 20 : kWsyncBroadcastPieceBytes;
}

class NcclTrainer final : public TrainerEngine {
 public:
  explicit NcclTrainer(const TrainerOptions& o)
      : options_(o), client_(o.servers, ClientOptions{o.api_key, 10}) {}

  ~NcclTrainer() override { Shutdown(); }

  Status Init(const std::vector<TensorMeta>& metadata) override {
    const bool gpu = !options_.device.is_cpu();
    if (gpu) {
#ifndef WSYNC_WITH_NCCL
      return Unimplemented(fmt::format("trainer device {}: this build has no NCCL (the GPU data plane); use --device cpu",
                                       options_.device.ToString()));
#endif
      WSYNC_RETURN_IF_ERROR(CudaRuntimeFor(options_.device).status());
    }
    Shutdown();
    Deadline deadline = Deadline::InSeconds(options_.timeout_seconds);
    // Servers give up a little before the trainer does, so that a server left waiting
    // for a peer answers with ITS account (which rank never came) before the trainer's
    // own wait ends; the trainer's HTTP wait allows a short grace past its deadline.
    double server_timeout = ServerTimeout(options_.timeout_seconds);
    Deadline http_deadline = Deadline::InSeconds(options_.timeout_seconds + 5);
    // wsync's extensions (preflight vote, labels, timeouts, broadcast pieces) go to wsync
    // servers only; any other fleet gets vLLM's payload and vLLM's data plane.
    std::string other_server;
    WSYNC_ASSIGN_OR_RETURN(std::vector<json> health, FleetHealth(client_, deadline));
    wsync_servers_ = WsyncServers(client_, health, &other_server);
    if (!wsync_servers_ && !gpu) {
      return FailedPrecondition(fmt::format(
          "{} is not a wsync server (its /health does not say \"server\": \"wsync\"): the CPU data plane "
          "(Gloo) needs wsync servers; vLLM servers take the GPU path (push --device cuda:N)", other_server));
    }
    if (!wsync_servers_) {
      WSYNC_LOG_INFO("{} is not a wsync server: speaking plain vLLM (no preflight vote, one broadcast per chunk)",
                     other_server);
    }
    WSYNC_ASSIGN_OR_RETURN(std::vector<int> per_server, ServerWorldSizes(client_, deadline));
    WSYNC_ASSIGN_OR_RETURN(int world, BroadcastWorldSize(per_server, options_.data_parallel_size));
    WSYNC_ASSIGN_OR_RETURN(std::vector<int> offsets,
                           NcclRankOffsets(world, static_cast<int>(per_server.size()),
                                           options_.data_parallel_size));
    labels_ = RankLabels(health, world, offsets);

    if (!store_ && !gpu) {
      WSYNC_ASSIGN_OR_RETURN(store_, StoreServer::Start(options_.store_host, 0));
    }
    prefix_ = fmt::format("wsync-{}/{}", RandomHex(8), ++attempt_);
    buffer_bytes_ = PackedBufferSize(metadata, static_cast<size_t>(options_.bucket_gb * (1u << 30)));

    NcclInitInfo info;
    info.world_size = world;
    info.packed = options_.packed;
    info.packed_buffer_size_bytes = static_cast<int64_t>(buffer_bytes_);
    info.packed_num_buffers = options_.num_buffers;
    if (wsync_servers_) {
      info.gloo_rank_labels = labels_;
      info.wsync_protocol = kWsyncProtocolVersion;
      info.timeout_seconds = server_timeout;
      if (gpu) info.wsync_broadcast_piece_bytes = BroadcastPieceBytes();
    }
#ifdef WSYNC_WITH_NCCL
    NcclUniqueIdBytes unique_id{};
    if (gpu) {
      // vLLM's UID rendezvous: no store; every rank enters ncclCommInitRank at once.
      WSYNC_ASSIGN_OR_RETURN(unique_id, NewNcclUniqueId());
      info.nccl_unique_id_b64 = EncodeNcclUniqueId(unique_id);
    }
#endif
    if (!gpu) {
      info.gloo_store_host = options_.store_host;
      info.gloo_store_port = store_->port();
      info.gloo_prefix = prefix_;
    }
    std::vector<json> bodies;
    for (int offset : offsets) {
      info.rank_offset = offset;
      bodies.push_back(json{{"init_info", info.ToJson()}});
    }
    WSYNC_LOG_INFO("init: {} servers, world {}, rank offsets [{}], packed buffer {} bytes",
                   offsets.size(), world, fmt::join(offsets, ", "), buffer_bytes_);
    auto pending = client_.PostAsync("/init_weight_transfer_engine", std::move(bodies), http_deadline);

    auto describe = [labels = labels_](int r) {
      return r < static_cast<int>(labels.size()) ? fmt::format("rank {} ({})", r, labels[r])
                                                 : fmt::format("rank {}", r);
    };
    auto op_timeout = std::chrono::milliseconds(static_cast<int64_t>(options_.timeout_seconds * 1000));
    std::function<Result<std::unique_ptr<Communicator>>()> connect;
    if (gpu) {
#ifdef WSYNC_WITH_NCCL
      NcclOptions n;
      n.unique_id = unique_id;
      n.rank = 0;
      n.size = world;
      n.device = options_.device.index;
      n.connect_deadline = deadline;
      n.op_timeout = op_timeout;
      n.describe_rank = describe;
      n.piece_bytes = static_cast<size_t>(info.wsync_broadcast_piece_bytes.value_or(0));
      connect = [n] { return ConnectNccl(n); };
#endif
    } else {
      GlooOptions g;
      g.store_host = options_.store_host;
      g.store_port = store_->port();
      g.prefix = prefix_;
      g.rank = 0;
      g.size = world;
      g.bind_host = options_.store_host;
      g.connect_deadline = deadline;
      g.op_timeout = op_timeout;
      g.describe_rank = describe;
      connect = [g] { return ConnectGloo(g); };
    }
    // Connect on a side thread so that a server refusing init ends the wait at once.
    auto connected = std::make_shared<std::promise<Result<std::unique_ptr<Communicator>>>>();
    auto connect_future = connected->get_future();
    std::thread([connected, connect] { connected->set_value(connect()); }).detach();
    while (connect_future.wait_for(std::chrono::milliseconds(20)) != std::future_status::ready) {
      if (pending->AnyFailed()) return pending->Wait(Deadline::InSeconds(1)).status();
    }
    Result<std::unique_ptr<Communicator>> comm = connect_future.get();
    if (!comm.ok()) {
      // A server's own error explains more than "rank N never joined"; give it a moment.
      Result<std::vector<json>> r = pending->Wait(Deadline::InSeconds(3));
      if (!r.ok() && r.status().code() != StatusCode::kDeadlineExceeded) return r.status();
      return comm.status();
    }
    comm_ = std::move(*comm);
    auto warmup = std::make_shared<float>(0.0f);  // vLLM's one-element float32 SUM
    std::shared_ptr<Communicator> c = comm_;
    Device device = options_.device;
    WSYNC_RETURN_IF_ERROR(Watched([c, warmup, deadline, device] {
                                    WSYNC_RETURN_IF_ERROR(UseDeviceOnThisThread(device));
                                    return c->AllReduceSum(std::span<float>(warmup.get(), 1), deadline);
                                  },
                                  *comm_, pending.get(), deadline, "broadcast group warm-up"));
    // The staging ring for the whole model, while the servers allocate theirs: the first
    // sync then finds every buffer resident, as later syncs do.
    WSYNC_ASSIGN_OR_RETURN(ChunkPlan plan, PlanChunks(metadata, options_.packed ? buffer_bytes_ : 1));
    WSYNC_RETURN_IF_ERROR(ReserveStaging(plan));
    WSYNC_RETURN_IF_ERROR(pending->Wait(http_deadline).status());
    if (store_) store_->ErasePrefix(prefix_);
    WSYNC_LOG_INFO("broadcast group of {} ranks is up ({}, trainer on {})", world, comm_->kind(),
                   options_.device.ToString());
    return Status::Ok();
  }

  Result<SyncStats> SendWeights(WeightSource& source,
                                const std::optional<std::string>& weight_version) override {
    if (!comm_ || comm_->aborted()) {
      return FailedPrecondition("no live broadcast group: call Init() (a failed sync tears it down)");
    }
    const std::vector<TensorMeta>& meta = source.metadata();
    // The whole iteration is checked before anything is sent.
    WSYNC_RETURN_IF_ERROR(DrainChecked(source));
    WSYNC_ASSIGN_OR_RETURN(ChunkPlan plan, PlanChunks(meta, options_.packed ? buffer_bytes_ : 1));
    // The update_info of an unchanged tensor list is serialized once and sent as is (the
    // servers, in turn, parse a byte-identical body once).
    if (!update_body_ || meta != update_meta_) {
      update_meta_ = meta;
      update_body_ = std::make_shared<const std::string>(json{{"update_info", TensorListJson(meta)}}.dump());
    }

    SyncStats stats;
    stats.bytes = plan.total_bytes;
    stats.tensors = meta.size();
    stats.chunks = plan.chunks.size();
    Deadline deadline = Deadline::InSeconds(options_.timeout_seconds);
    auto t0 = Clock::now();
    Status started = client_.Post("/start_weight_update", json::object(), deadline).status();
    if (!started.ok()) {
      CloseSessions();
      return started;
    }
    stats.start_seconds = Since(t0);
    auto t1 = Clock::now();
    // As in Init: the servers' waits end first, so their account arrives in time.
    Deadline http_deadline = Deadline::InSeconds(options_.timeout_seconds + 5);
    auto pending = client_.PostAsync("/update_weights", update_body_, http_deadline);
    Status s = Transfer(source, meta, plan, pending.get(), deadline);
    auto t_wire_done = Clock::now();
    if (s.ok()) s = pending->Wait(http_deadline).status();
    WSYNC_LOG_DEBUG("update_weights answered {:.2f} ms after the wire", Since(t_wire_done) * 1e3);
    if (!s.ok()) {
      comm_->Abort();
      CloseSessions();
      return s;
    }
    stats.transfer_seconds = Since(t1);
    auto t2 = Clock::now();
    json finish = json::object();
    if (weight_version) finish["weight_version"] = *weight_version;
    WSYNC_RETURN_IF_ERROR(client_.Post("/finish_weight_update", finish, deadline).status());
    stats.finish_seconds = Since(t2);
    stats.seconds = Since(t0);
    WSYNC_LOG_DEBUG("sync of {} bytes in {} chunks: start {:.2f} ms, data {:.2f} ms, finish {:.2f} ms, total {:.2f} ms",
                    stats.bytes, stats.chunks, stats.start_seconds * 1e3, stats.transfer_seconds * 1e3,
                    stats.finish_seconds * 1e3, stats.seconds * 1e3);
    return stats;
  }

  void Shutdown() override {
    if (comm_) comm_->Abort();
    comm_.reset();
  }

 private:
  // Preflight vote, then every chunk: pack chunk k+1 (on a helper thread) while chunk k
  // is broadcast.
  Status Transfer(WeightSource& source, const std::vector<TensorMeta>& meta_in,
                  const ChunkPlan& plan_in, FanOutClient::Pending* http, Deadline deadline) {
    std::shared_ptr<Communicator> comm = comm_;
    const Device device = options_.device;
    auto t_vote = Clock::now();
    auto vote = std::make_shared<int64_t>(0);
    if (wsync_servers_) {  // vLLM servers take no vote
      WSYNC_RETURN_IF_ERROR(Watched([comm, vote, deadline, device] {
                                      WSYNC_RETURN_IF_ERROR(UseDeviceOnThisThread(device));
                                      return comm->AllReduceSum(std::span<int64_t>(vote.get(), 1), deadline);
                                    },
                                    *comm_, http, deadline, "update preflight"));
    }
    if (*vote != 0) {
      Result<std::vector<json>> r = http->Wait(deadline);
      if (!r.ok()) return r.status();
      return Aborted(fmt::format("{} worker(s) rejected the update", *vote));
    }
    WSYNC_RETURN_IF_ERROR(ReserveStaging(plan_in));
    const size_t nbuf = buffers_.size();
    // The op owns copies of what it reads, so it may outlive this call after an abort.
    auto meta_owned = std::make_shared<const std::vector<TensorMeta>>(meta_in);
    auto plan_owned = std::make_shared<const ChunkPlan>(plan_in);
    WSYNC_ASSIGN_OR_RETURN(auto inner, source.Iterate());
    std::shared_ptr<TensorStream> stream = CheckedStream(std::move(inner), *meta_owned);
    auto buffers = buffers_;
    auto progress = options_.progress;
    DeviceRuntime* rt = nullptr;
    if (!device.is_cpu()) {
      WSYNC_ASSIGN_OR_RETURN(rt, CudaRuntimeFor(device));
    }
    auto op = [comm, stream, buffers, meta_owned, plan_owned, progress, deadline, nbuf, device, rt]() -> Status {
      WSYNC_RETURN_IF_ERROR(UseDeviceOnThisThread(device));
      const ChunkPlan& plan = *plan_owned;
      const std::vector<TensorMeta>& meta = *meta_owned;
      const size_t n = plan.chunks.size();
      std::vector<ProgressGate> packed(n);  // bytes of chunk k written into its buffer
      ProgressGate sent;                     // chunks whose broadcast has completed
      // Packs chunk k into its buffer, releasing bytes as they land: the broadcast of
      // chunk k sends each piece as soon as the packer has written it.
      auto pack_chunk = [&](size_t k) -> Status {
        const Chunk& c = plan.chunks[k];
        std::byte* dst = buffers[k % nbuf]->data();
        TensorRef t;
        size_t released = 0;
        for (size_t i = c.first; i < c.end; ++i) {
          WSYNC_ASSIGN_OR_RETURN(bool more, stream->Next(&t));
          if (!more) return Internal("source ended early");
          const size_t off = plan.offset_in_chunk[i];
          if (rt != nullptr) {
            // GPU: copies on this thread's stream, released in slices as NCCL streams
            // the chunk in pieces, so the wire starts before the whole chunk is packed.
            constexpr size_t kReleaseBytes = size_t{128} << 20;
            if (!(t.device == device || t.device.is_cpu())) {
              return InvalidArgument(fmt::format("tensor {} is on {}, the trainer sends from {}", t.name,
                                                 t.device.ToString(), device.ToString()));
            }
            for (size_t b = 0; b < t.bytes.size(); b += kReleaseBytes) {
              const size_t len = std::min(kReleaseBytes, t.bytes.size() - b);
              WSYNC_RETURN_IF_ERROR(rt->Copy2D(dst + off + b, len, t.bytes.data() + b, len, len, 1));
              const size_t end = off + b + len;
              if (end - released >= kReleaseBytes) {
                WSYNC_RETURN_IF_ERROR(rt->Synchronize());
                packed[k].Advance(end);
                released = end;
              }
            }
            continue;
          }
          if (!t.device.is_cpu()) {
            return InvalidArgument(fmt::format("tensor {} is on {}: a trainer on cpu sends host tensors (push --device {})",
                                               t.name, t.device.ToString(), t.device.ToString()));
          }
          constexpr size_t kSlice = size_t{8} << 20;  // publish big tensors in slices
          for (size_t b = 0; b < t.bytes.size(); b += kSlice) {
            size_t len = std::min(kSlice, t.bytes.size() - b);
            std::memcpy(dst + off + b, t.bytes.data() + b, len);
            packed[k].Advance(off + b + len);
          }
        }
        if (rt != nullptr) {
          WSYNC_RETURN_IF_ERROR(rt->Synchronize().WithContext(fmt::format("packing chunk {}/{}", k + 1, n)));
        }
        packed[k].Advance(c.bytes);
        return Status::Ok();
      };
      // The packer fills chunk k while chunk k-1 is on the wire; a failure fails chunk k
      // and every later one, so the broadcast stops at the first chunk it cannot send.
      std::thread packer([&] {
        Status s = UseDeviceOnThisThread(device);
        size_t k = 0;
        for (; s.ok() && k < n; ++k) {
          if (k >= nbuf) s = sent.WaitFor(k - nbuf + 1, deadline, "the broadcast to free a buffer");
          if (s.ok()) s = pack_chunk(k);
          if (!s.ok()) break;
        }
        if (!s.ok()) {
          for (size_t j = k; j < n; ++j) packed[j].Fail(s);
        }
      });
      Status result;
      SyncProgress p{0, plan.total_bytes, 0, n};
      for (size_t k = 0; k < n && result.ok(); ++k) {
        const Chunk& c = plan.chunks[k];
        Communicator::StreamHooks hooks;
        hooks.before_send = [&packed, k, deadline](size_t end) {
          return packed[k].WaitFor(end, deadline, "the packer");
        };
        Status s = comm->Broadcast(std::span(buffers[k % nbuf]->data(), c.bytes), 0, deadline, hooks);
        if (!s.ok()) {
          result = s.WithContext(fmt::format("broadcast of chunk {}/{} ({} bytes: {}..{})", k + 1, n,
                                             c.bytes, meta[c.first].name, meta[c.end - 1].name));
          break;
        }
        sent.Advance(k + 1);
        p.bytes_done += c.bytes;
        p.chunks_done = k + 1;
        if (progress) progress(p);
      }
      if (!result.ok()) sent.Fail(result);
      packer.join();
      return result;
    };
    auto t_wire = Clock::now();
    Status s = Watched(op, *comm_, http, deadline, "weight broadcast");
    WSYNC_LOG_DEBUG("preflight {:.2f} ms, chunks on the wire {:.2f} ms", std::chrono::duration<double>(t_wire - t_vote).count() * 1e3,
                    Since(t_wire) * 1e3);
    return s;
  }

  // Sizes the ring of staging buffers (num_buffers, at most 2) for `plan`.
  Status ReserveStaging(const ChunkPlan& plan) {
    buffers_.resize(std::max(1, std::min(options_.num_buffers, 2)));
    for (auto& b : buffers_) {
      if (!b) b = std::make_shared<StagingBuffer>();
    }
    return ReserveRing(buffers_, options_.device, plan);
  }

  // Ends any session still open on a server after a failed sync (409s are expected
  // from servers whose failed update already ended theirs).
  void CloseSessions() {
    (void)client_.Post("/finish_weight_update", json::object(), Deadline::InSeconds(10));
  }

  // Rank 0 is the trainer; the others are the servers' workers.
  std::vector<std::string> RankLabels(const std::vector<json>& health, int world, const std::vector<int>& offsets) {
    std::vector<std::string> labels = WorkerLabels(client_, health, world, offsets);
    labels[0] = "trainer";
    return labels;
  }

  TrainerOptions options_;
  FanOutClient client_;
  std::unique_ptr<StoreServer> store_;
  std::shared_ptr<Communicator> comm_;
  std::vector<std::shared_ptr<StagingBuffer>> buffers_;
  bool wsync_servers_ = true;  // every server is a wsync server (else: plain vLLM)
  std::vector<TensorMeta> update_meta_;               // the tensor list update_body_ carries
  std::shared_ptr<const std::string> update_body_;    // {"update_info": ...}, serialized
  std::vector<std::string> labels_;
  std::string prefix_;
  size_t buffer_bytes_ = kDefaultPackedBufferBytes;
  int attempt_ = 0;
};

}  // namespace

Result<std::unique_ptr<TrainerEngine>> CreateNcclTrainer(const TrainerOptions& options) {
  if (options.rank < 0) return InvalidArgument(fmt::format("trainer rank {} is negative", options.rank));
  // Not a member of the broadcast group and never on the control plane: it drains the
  // sender's two passes (the check pass, then the transfer pass).
  if (options.rank != 0) return NewNonSenderTrainer(options.rank, 2);
  if (options.servers.empty()) return InvalidArgument("no servers given (--servers)");
  if (options.timeout_seconds <= 0) return InvalidArgument("--timeout must be positive");
  if (options.bucket_gb <= 0) return InvalidArgument("--bucket-gb must be positive");
  return std::unique_ptr<TrainerEngine>(std::make_unique<NcclTrainer>(options));
}

}  // namespace wsync
