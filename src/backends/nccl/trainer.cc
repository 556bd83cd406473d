#include "backends/nccl/trainer.h"

#include <condition_variable>
#include <cstring>
#include <future>
#include <mutex>
#include <random>
#include <thread>

#include <fmt/format.h>

#include "backends/nccl/init_info.h"
#include "backends/nccl/staging.h"
#include "comm/communicator.h"
#include "comm/connect.h"
#include "comm/store.h"
#include "control/init_payloads.h"
#include "control/session_driver.h"
#include "core/log.h"
#include "core/progress_gate.h"
#include "core/stopwatch.h"
#include "engine/backend_options.h"
#include "engine/engine.h"
#include "engine/watched.h"
#include "core/digest.h"
#include "engine/device_digests.h"
#include "engine/sync_pass.h"
#include "plan/packing.h"

namespace wsync {
namespace {

using nlohmann::json;
using Pending = SessionDriver::Pending;

class NcclPlane final : public DataPlane {
 public:
  NcclPlane(const TrainerOptions& o, const NcclTrainerOptions& nccl) : options_(o), nccl_(nccl) {}
  ~NcclPlane() override { Shutdown(); }

  SessionShape Shape() override { return SessionShape{}; }

  Status Init(const PlaneInit& init) override {
    const bool gpu = !options_.device.is_cpu();
    if (gpu) {
      if (!HasNccl()) {
        return Unimplemented(fmt::format("trainer device {}: this build has no NCCL (the GPU data plane); use "
                                         "device cpu", options_.device.ToString()));
      }
      WSYNC_RETURN_IF_ERROR(CudaRuntimeFor(options_.device).status());
    }
    Shutdown();
    const SessionDriver& driver = *init.driver;
    Deadline deadline = driver.deadlines().Call();
    Fleet fleet = *init.fleet;
    // wsync's extensions (preflight vote, labels, timeouts, broadcast pieces) go to wsync
    // servers only; any other fleet gets vLLM's payload and vLLM's data plane.
    wsync_servers_ = fleet.wsync;
    if (!wsync_servers_ && !gpu) {
      return FailedPrecondition(fmt::format(
          "{} is not a wsync server (its /health does not say \"server\": \"wsync\"): the CPU data plane "
          "(Gloo) needs wsync servers; vLLM servers take the GPU path (trainer device cuda:N)", fleet.other));
    }
    if (!wsync_servers_) {
      WSYNC_LOG_INFO("{} is not a wsync server: speaking plain vLLM (no preflight vote, one broadcast per chunk)",
                     fleet.other);
    }
    WSYNC_RETURN_IF_ERROR(driver.WorldSizes(&fleet));
    // Deployments may differ in size (TP); each server's offset follows the ones before it.
    WSYNC_ASSIGN_OR_RETURN(NcclFleetLayout layout,
                           NcclFleetRanks(fleet.world_sizes, options_.data_parallel_size, 1, driver.urls()));
    const int world = layout.world_size;
    const std::vector<int>& offsets = layout.rank_offsets;
    labels_ = driver.WorkerLabels(fleet, world, offsets);
    labels_[0] = "trainer";  // rank 0 is the trainer; the others are the servers' workers

    if (!store_ && !gpu) {
      WSYNC_ASSIGN_OR_RETURN(store_, StoreServer::Start(options_.store_host, 0));
    }
    prefix_ = fmt::format("wsync-{}/{}", RandomHex(8), ++attempt_);
    buffer_bytes_ = PackedBufferSize(init.metadata, static_cast<size_t>(options_.bucket_gb * (1u << 30)));

    NcclInitInfo info;
    info.world_size = world;
    info.packed = options_.packed;
    info.packed_buffer_size_bytes = static_cast<int64_t>(buffer_bytes_);
    info.packed_num_buffers = options_.num_buffers;
    if (wsync_servers_) {
      info.gloo_rank_labels = labels_;
      info.wsync_protocol = kWsyncProtocolVersion;
      info.timeout_seconds = driver.deadlines().server_timeout();
      if (gpu) info.wsync_broadcast_piece_bytes = nccl_.broadcast_piece_bytes;
      info.wsync_device_digests = gpu;
    }
    CommSpec spec;
    if (gpu) {
      // vLLM's UID rendezvous: no store; every rank enters ncclCommInitRank at once.
      WSYNC_ASSIGN_OR_RETURN(info.nccl_unique_id_b64, NewNcclGroupId());
      spec.nccl_unique_id_b64 = info.nccl_unique_id_b64;
      spec.device = options_.device.index;
      spec.piece_bytes = static_cast<size_t>(info.wsync_broadcast_piece_bytes.value_or(0));
    } else {
      info.gloo_store_host = options_.store_host;
      info.gloo_store_port = store_->port();
      info.gloo_prefix = prefix_;
      spec.store = CommSpec::Store{options_.store_host, store_->port(), prefix_, options_.store_host};
    }
    std::vector<json> infos;
    for (int offset : offsets) {
      info.rank_offset = offset;
      infos.push_back(info.ToJson());
    }
    WSYNC_LOG_INFO("init: {} servers, world {}, rank offsets [{}], packed buffer {} bytes",
                   offsets.size(), world, fmt::join(offsets, ", "), buffer_bytes_);
    auto pending = driver.InitAsync(std::move(infos));

    spec.rank = 0;
    spec.size = world;
    spec.connect_deadline = deadline;
    spec.op_timeout = std::chrono::milliseconds(static_cast<int64_t>(options_.timeout_seconds * 1000));
    spec.describe_rank = [labels = labels_](int r) {
      return r < static_cast<int>(labels.size()) ? fmt::format("rank {} ({})", r, labels[r])
                                                 : fmt::format("rank {}", r);
    };
    // Connect on a side thread so that a server refusing init ends the wait at once.
    auto connected = std::make_shared<std::promise<Result<std::unique_ptr<Communicator>>>>();
    auto connect_future = connected->get_future();
    std::thread([connected, spec] { connected->set_value(Connect(spec)); }).detach();
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
    WSYNC_ASSIGN_OR_RETURN(ChunkPlan plan, PlanChunks(init.metadata, options_.packed ? buffer_bytes_ : 1));
    WSYNC_RETURN_IF_ERROR(ReserveStaging(plan));
    WSYNC_RETURN_IF_ERROR(pending->Wait(driver.deadlines().Http()).status());
    if (store_) store_->ErasePrefix(prefix_);
    WSYNC_LOG_INFO("broadcast group of {} ranks is up ({}, trainer on {})", world, comm_->kind(),
                   options_.device.ToString());
    return Status::Ok();
  }

  Result<bool> Ready(const Status& mine) override {
    WSYNC_RETURN_IF_ERROR(mine);
    return comm_ && !comm_->aborted();
  }

  Status Prepare(SyncContext& sync) override {
    WSYNC_ASSIGN_OR_RETURN(plan_, PlanChunks(sync.pass.metadata(), options_.packed ? buffer_bytes_ : 1));
    sync.update_body = update_body_.Get(sync.pass.metadata());
    sync.stats.bytes = plan_.total_bytes;
    sync.stats.chunks = plan_.chunks.size();
    return Status::Ok();
  }

  Status Transfer(SyncContext& sync, Pending& update) override {
    Stopwatch wire;
    Status s = Send(sync, update);
    WSYNC_LOG_DEBUG("data plane done in {:.2f} ms", wire.milliseconds());
    return s;
  }

  // After start failed the group is intact; after the update began it may be mid-chunk.
  Status Abort(const Status& cause, Pending* update) override {
    if (update != nullptr && comm_) comm_->Abort();
    return cause;
  }

  void Shutdown() override {
    if (comm_) comm_->Abort();
    comm_.reset();
  }

 private:
  // Preflight vote, then every chunk: pack chunk k+1 (on a helper thread) while chunk k
  // is broadcast.
  Status Send(SyncContext& sync, Pending& update) {
    Pending* http = &update;
    const Deadline deadline = sync.deadline;
    const std::vector<TensorMeta>& meta_in = sync.pass.metadata();
    const ChunkPlan& plan_in = plan_;
    std::shared_ptr<Communicator> comm = comm_;
    const Device device = options_.device;
    Stopwatch vote_watch;
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
    // The packer hashes each host tensor as it copies it, or, on a GPU, digests each chunk
    // on the device once packed (in-line verification).
    std::shared_ptr<PassDigests> digests = sync.pass.TakeDigests();
    WSYNC_ASSIGN_OR_RETURN(std::shared_ptr<TensorStream> stream, sync.pass.Stream());
    const std::optional<SourceStorage> stable = sync.pass.source().storage();
    auto buffers = buffers_;
    auto progress = sync.progress;
    DeviceRuntime* rt = nullptr;
    if (!device.is_cpu()) {
      WSYNC_ASSIGN_OR_RETURN(rt, CudaRuntimeFor(device));
    }
    auto op = [comm, stream, stable, digests, buffers, meta_owned, plan_owned, progress, deadline, nbuf, device,
               rt]() -> Status {
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
        std::vector<DeviceTensorBytes> on_device;  // the chunk's tensors, digested where they were packed
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
            if (digests) on_device.push_back({&meta[i], dst + off});
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
            WSYNC_ASSIGN_OR_RETURN(bool waited, FinishCopiesFrom(*rt, t, stable));
            if (waited) {
              released = off + t.bytes.size();
              packed[k].Advance(released);
            }
            continue;
          }
          if (!t.device.is_cpu()) {
            return InvalidArgument(fmt::format("tensor {} is on {}: a trainer on cpu sends host tensors (give the trainer device {})",
                                               t.name, t.device.ToString(), t.device.ToString()));
          }
          constexpr size_t kSlice = size_t{8} << 20;  // publish big tensors in slices
          std::unique_ptr<Hasher> hasher = digests ? Hasher::Create(DigestAlgorithm::kXxh3_128) : nullptr;
          for (size_t b = 0; b < t.bytes.size(); b += kSlice) {
            size_t len = std::min(kSlice, t.bytes.size() - b);
            if (hasher) {
              CopyAndHash(dst + off + b, t.bytes.subspan(b, len), *hasher, /*hash_destination=*/false);
            } else {
              std::memcpy(dst + off + b, t.bytes.data() + b, len);
            }
            packed[k].Advance(off + b + len);
          }
          if (hasher) digests->Record(t.name, hasher->FinishHex());
        }
        if (rt != nullptr) {
          WSYNC_RETURN_IF_ERROR(rt->Synchronize().WithContext(fmt::format("packing chunk {}/{}", k + 1, n)));
        }
        packed[k].Advance(c.bytes);
        // The packed bytes are what the broadcast sends; the packer reuses the buffer only
        // after this returns.
        if (!on_device.empty()) WSYNC_RETURN_IF_ERROR(RecordDeviceDigests(device, on_device, *digests));
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
    const double vote_ms = vote_watch.milliseconds();
    Stopwatch wire;
    Status s = Watched(op, *comm_, http, deadline, "weight broadcast");
    if (s.ok()) {
      // The end of the pass: a source that yields more than its metadata fails the sync
      // naming the extra tensor (the op has finished with the stream).
      TensorRef end;
      s = stream->Next(&end).status();
    }
    WSYNC_LOG_DEBUG("preflight {:.2f} ms, chunks on the wire {:.2f} ms", vote_ms, wire.milliseconds());
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

  TrainerOptions options_;
  NcclTrainerOptions nccl_;
  std::unique_ptr<StoreServer> store_;
  std::shared_ptr<Communicator> comm_;
  std::vector<std::shared_ptr<StagingBuffer>> buffers_;
  bool wsync_servers_ = true;  // every server is a wsync server (else: plain vLLM)
  UpdateBodyCache update_body_;
  ChunkPlan plan_;  // this sync's chunks (Prepare)
  std::vector<std::string> labels_;
  std::string prefix_;
  size_t buffer_bytes_ = kDefaultPackedBufferBytes;
  int attempt_ = 0;
};

}  // namespace

Result<NcclTrainerOptions> ParseNcclTrainerOptions(const std::map<std::string, std::string>& values) {
  NcclTrainerOptions o;
  BackendOptions read("nccl", values);
  int64_t mb = o.broadcast_piece_bytes >> 20;
  WSYNC_RETURN_IF_ERROR(read.Read("piece_mb", &mb));
  WSYNC_RETURN_IF_ERROR(read.Finish());
  if (mb <= 0 || mb > (int64_t{1} << 20)) return InvalidArgument(fmt::format("nccl option piece_mb={}: out of range", mb));
  o.broadcast_piece_bytes = mb << 20;
  return o;
}

Result<std::unique_ptr<TrainerEngine>> CreateNcclTrainerWith(const TrainerOptions& options,
                                                             const NcclTrainerOptions& nccl) {
  WSYNC_RETURN_IF_ERROR(CheckTrainerOptions(options));
  if (nccl.broadcast_piece_bytes <= 0) {
    return InvalidArgument(fmt::format("nccl broadcast piece of {} bytes: must be positive", nccl.broadcast_piece_bytes));
  }
  return NewTrainerEngine(options, std::make_unique<NcclPlane>(options, nccl));
}

Result<std::unique_ptr<TrainerEngine>> CreateNcclTrainer(const TrainerOptions& options) {
  WSYNC_ASSIGN_OR_RETURN(NcclTrainerOptions nccl, ParseNcclTrainerOptions(options.backend_options));
  return CreateNcclTrainerWith(options, nccl);
}

}  // namespace wsync
