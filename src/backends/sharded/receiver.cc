#include "backends/sharded/receiver.h"

#include <signal.h>
#include <unistd.h>

#include <cstring>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "backends/nccl/staging.h"
#include "backends/receiver_group.h"
#include "backends/sharded/init_info.h"
#include "backends/sharded/lanes.h"
#include "comm/communicator.h"
#include "comm/connect.h"
#include "core/log.h"
#include "model/sharding.h"
#include "model/worker_sink.h"
#include "plan/sharded_plan.h"
#include "receiver/worker_fanout.h"
#include "receiver/worker_thread.h"

namespace wsync {
namespace {

using nlohmann::json;

// "trainer rank 3 (tp1 pp0 ep1 dp0)" for a producer, "rank 5 (<label>)" for a worker.
DescribeRank Describer(const ShardedInitInfo& info) {
  return [labels = info.rank_labels, producers = info.num_producers](int r) {
    std::string name = r < producers ? fmt::format("trainer rank {}", r) : fmt::format("rank {}", r);
    if (r >= 0 && static_cast<size_t>(r) < labels.size() && !labels[r].empty() && labels[r] != name) {
      name += fmt::format(" ({})", labels[r]);
    }
    return name;
  };
}

class ShardedReceiver final : public ReceiverBackend {
 public:
  explicit ShardedReceiver(ReceiverContext* ctx)
      : ctx_(ctx), slots_(ctx->workers.size()),
        fault_die_mid_update_(ctx->backend_config.value("fault", "") == "die-mid-update") {}
  ~ShardedReceiver() override { Shutdown(); }

  std::string_view name() const override { return "sharded"; }
  // update_info is SkyRL's empty ShardedRDTWeightTransferUpdateInfo: {}.
  bool ParsesOwnUpdateInfo() const override { return true; }
  // A lora session's update_info is its tensor list; trainer rank 0 sends them to every
  // worker (ShardedLoraBuckets).
  bool CarriesAdapters() const override { return true; }
  // Every sync lands through LoadPiece (a lora session's adapters land whole).
  bool LandsSlices() const override { return true; }

  // A split tensor's parts are the row ranges the trainer digests it by; with
  // wsync_split_digests, so are the SplitDigestRows of a tensor several ranks hold whole.
  std::map<std::string, std::vector<std::pair<int64_t, int64_t>>> RowDigestRanges() const override {
    std::map<std::string, std::vector<std::pair<int64_t, int64_t>>> out;
    if (!info_) return out;
    for (size_t i = 0; i < info_->tensors.size(); ++i) {
      if (i < info_->tensor_parts.size() && !info_->tensor_parts[i].empty()) {
        std::vector<std::pair<int64_t, int64_t>>& ranges = out[info_->tensors[i].name];
        for (const TensorPart& p : info_->tensor_parts[i]) ranges.emplace_back(p.row_begin, p.row_end);
        continue;
      }
      if (!info_->wsync_split_digests) continue;
      // Parse checked a class for every name, each within owner_sets.
      auto ranges = SplitDigestRows(info_->tensors[i], info_->owner_sets[info_->name_owner_class[i]].size());
      if (!ranges.empty()) out.emplace(info_->tensors[i].name, std::move(ranges));
    }
    return out;
  }

  // Without a peer address only --allow-store-host admits a Gloo store.
  Status Init(const json& init_info) override { return InitFromPeer(init_info, ""); }

  Status InitFromPeer(const json& init_info, const std::string& peer_address) override {
    WSYNC_ASSIGN_OR_RETURN(ShardedInitInfo info, ShardedInitInfo::Parse(init_info));
    if (info.uses_gloo()) {
      // The store this server dials: the peer's own address (store_address.h).
      WSYNC_ASSIGN_OR_RETURN(info.gloo_store_host, AdmitGlooStore(*ctx_, *info.gloo_store_host, peer_address));
    } else {
      WSYNC_RETURN_IF_ERROR(CheckNcclWorkers(*ctx_));
    }
    if (info.adapters_only && !info.uses_gloo()) {
      return Unimplemented("an adapter group (init_info wsync_lora) over NCCL: LoRA adapters sync over a Gloo (cpu) "
                           "sharded group, or over the nccl or ipc backends");
    }
    WSYNC_ASSIGN_OR_RETURN(std::vector<ConsumerPlan> plans, info.adapters_only ? AdapterSlots(info) : PlanWorkers(info));
    if (!info.uses_gloo() && !info.tensor_parts.empty()) {
      return Unimplemented("the trainer's ranks hold row ranges of some tensors (tensor_parts): a worker assembles "
                           "those pieces in host memory, which only a Gloo (cpu) sharded group lands");
    }
    for (size_t i = 0; i < plans.size(); ++i) {
      if (info.RankOf(plans[i].consumer) < 0) {
        return InvalidArgument(fmt::format("{} (consumer {}) is not among init_info live_consumers: a degraded "
                                           "sync initializes only the live servers", ctx_->workers[i].label,
                                           plans[i].consumer));
      }
    }
    Shutdown();
    const double timeout = ctx_->TimeoutFor(info.timeout_seconds);
    const Deadline deadline = Deadline::InSeconds(timeout);
    std::vector<std::future<Status>> futures;
    for (size_t i = 0; i < ctx_->workers.size(); ++i) {
      const ReceiverWorker& w = ctx_->workers[i];
      CommSpec spec;
      if (info.uses_gloo()) {
        spec.store = CommSpec::Store{*info.gloo_store_host, *info.gloo_store_port, *info.gloo_prefix};
      } else {
        spec.nccl_unique_id_b64 = *info.nccl_unique_id_b64;
        spec.device = w.device.index;
      }
      spec.rank = info.RankOf(plans[i].consumer);
      spec.size = info.world_size;
      spec.connect_deadline = deadline;
      spec.op_timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout * 1000));
      spec.describe_rank = Describer(info);
      // Receive buffers on the device the transport writes: the worker's GPU for NCCL,
      // host memory for Gloo (LoadPiece copies to wherever the shards live).
      const Device buffer_device = info.uses_gloo() ? Device{} : w.device;
      futures.push_back(w.thread->Post([this, i, spec, buffer_device, plan = std::move(plans[i]),
                                        buffers = info.num_buffers,
                                        concurrent = info.concurrent_stages && info.uses_gloo(),
                                        budget = static_cast<size_t>(info.receive_staging_mb) * 1000000]() mutable
                                       -> Status {
        const ReceiverWorker& worker = ctx_->workers[i];
        Result<std::unique_ptr<Communicator>> comm = Connect(spec);
        if (!comm.ok()) {
          return comm.status().WithContext(
              fmt::format("{}: joining the sharded group as rank {} of {}", worker.label, spec.rank, spec.size));
        }
        Slot& slot = slots_[i];
        slot.comm = std::move(*comm);
        slot.plan = std::move(plan);
        slot.lanes = concurrent ? SplitLanesWithin(slot.plan, buffers, budget) : SplitLanes(slot.plan, false);
        return ReserveLanes(slot.lanes, buffers, buffer_device)
            .WithContext(fmt::format("{}: allocating receive buffers", worker.label));
      }));
    }
    if (Status s = JoinAll(futures); !s.ok()) {
      Shutdown();
      return s;
    }
    group_first_.assign(1, 0);
    for (int len : info.group_lens) group_first_.push_back(group_first_.back() + len);
    timeout_ = timeout;
    device_buffers_ = !info.uses_gloo();
    info_ = std::move(info);
    WSYNC_LOG_INFO("joined the sharded group: world {}, consumers {}..{} of {}, {} chunk(s) for worker 0 in {} "
                   "lane(s), {:.1f} MB of receive staging", info_->world_size, slots_.front().plan.consumer,
                   slots_.back().plan.consumer, info_->num_consumers, slots_.front().plan.chunks.size(),
                   slots_.front().lanes.size(),
                   ReceiveStagingBytes(slots_.front().lanes, info_->num_buffers) / 1e6);
    return Status::Ok();
  }

  Status Update(const UpdateRequest& req) override {
    if (!req.reject.ok()) return req.reject;
    const json& update_info = *req.update_info;
    const bool lora = req.lora;
    if (!lora && info_ && info_->adapters_only) {
      return FailedPrecondition(
          "this server's sharded group is an adapter group (a LoRA trainer's init, init_info wsync_lora): it carries "
          "lora sessions only; full weights need init_weight_transfer_engine from a full-weight trainer");
    }
    if (!lora && !update_info.is_object()) {
      return InvalidArgument("update_info must be an object ({} for backend sharded)");
    }
    if (!lora && !update_info.empty()) {
      std::vector<std::string> keys;  // the first few, cut short: the body is untrusted
      for (const auto& [key, _] : update_info.items()) {
        if (keys.size() == 8) {
          keys.push_back("...");
          break;
        }
        keys.push_back(key.substr(0, 64));
      }
      return InvalidArgument(fmt::format(
          "update_info of backend sharded takes no fields (the plan is fixed at init); got {}", fmt::join(keys, ", ")));
    }
    if (!info_ || slots_.empty() || slots_.front().comm == nullptr || slots_.front().comm->aborted()) {
      return FailedPrecondition(
          "no live sharded group: call init_weight_transfer_engine first (a failed sync tears the group down)");
    }
    const Deadline deadline = Deadline::InSeconds(timeout_);
    Status s = RunOnEveryWorker(ctx_->workers, "update_weights", deadline, [&](size_t i, const ReceiverWorker& w) {
      Status r = lora ? ReceiveAdapter(w, slots_[i], *req.tensors, deadline) : ReceivePlan(w, slots_[i], deadline);
      if (!r.ok()) AbortGroup();  // the other workers' waits end now, not at the deadline
      return r;
    });
    if (!s.ok()) AbortGroup();
    return s;
  }

  void Shutdown() override {
    AbortGroup();
    for (Slot& slot : slots_) slot.comm.reset();
    info_.reset();
  }

 private:
  // A split tensor's piece while its parts arrive: the packed piece and the bytes in.
  struct Partial {
    std::vector<std::byte> bytes;
    size_t received = 0;
  };
  struct Slot {
    std::unique_ptr<Communicator> comm;
    ConsumerPlan plan;
    std::vector<ReceiveLane> lanes;  // the receive lanes and their rings, reused across syncs
    std::map<std::pair<int, int>, Partial> partial;  // by (param, piece), during an update
    // Assembled split pieces lent to the sink: they live until its ChunkLanded returns
    // (WorkerSink::LoadPiece may keep views of them until then).
    std::vector<std::vector<std::byte>> assembled;
    std::vector<std::byte> adapter[2];  // a lora session's receive buffers, reused across syncs
  };

  // Every worker's plan, made from its own sharding table and checked against the
  // trainer's digest of it.
  Result<std::vector<ConsumerPlan>> PlanWorkers(const ShardedInitInfo& info) const {
    // Every worker's place first: a fleet the two sides count differently is named as such,
    // not as the plan digests it also changes.
    WSYNC_RETURN_IF_ERROR(CheckPlaces(info));
    for (const ReceiverWorker& w : ctx_->workers) {
      if (w.sink->sharding() == nullptr) {
        return Unimplemented(fmt::format("{} keeps no sharding table: backend sharded needs the worker's model and "
                                         "TP place (a wsync serve worker's, or ReceiverEngine's model and tp_size)",
                                         w.label));
      }
    }
    ShardedStream stream{info.tensors, info.group_lens, Ownership{info.owner_sets, info.name_owner_class},
                         info.num_producers, info.tensor_parts};
    std::vector<ConsumerPlan> plans;
    for (const ReceiverWorker& w : ctx_->workers) {
      const int index = ctx_->DeploymentIndex(w);
      const int consumer = info.consumer_offset + index;
      Result<ConsumerPlan> plan =
          PlanConsumer(stream, *w.sink->sharding(), ConsumerSpot{consumer, index, info.deployment_workers});
      if (!plan.ok()) return plan.status().WithContext(fmt::format("{}: planning its slices", w.label));
      if (plan->digest != info.plan_digests[index]) {
        return FailedPrecondition(fmt::format(
            "{} (consumer {}): the trainer's plan for it has digest {}, this server's has digest {}: the two sides "
            "disagree on which slices it keeps (same model and --tp on both sides?)", w.label, consumer,
            info.plan_digests[index], plan->digest));
      }
      plans.push_back(std::move(*plan));
    }
    return plans;
  }

  // Every worker's consumer id (consumer_offset + its deployment index) lies inside the
  // fleet and its deployment.
  Status CheckPlaces(const ShardedInitInfo& info) const {
    if (ctx_->workers.empty()) return FailedPrecondition("this server has no workers to join the sharded group");
    for (const ReceiverWorker& w : ctx_->workers) {
      const int index = ctx_->DeploymentIndex(w);
      // In int64: consumer_offset and the index are bounded, their sum is not.
      const int64_t consumer = int64_t{info.consumer_offset} + index;
      if (index >= info.deployment_workers || consumer >= info.num_consumers) {
        return InvalidArgument(fmt::format(
            "{} would be consumer {} (consumer_offset {} + deployment index {}), outside the fleet's {} consumers "
            "or its deployment's {} workers", w.label, consumer, info.consumer_offset, index, info.num_consumers,
            info.deployment_workers));
      }
    }
    return Status::Ok();
  }

  // An adapter group's workers: their place in the group, no plan.
  Result<std::vector<ConsumerPlan>> AdapterSlots(const ShardedInitInfo& info) const {
    WSYNC_RETURN_IF_ERROR(CheckPlaces(info));
    std::vector<ConsumerPlan> plans;
    for (const ReceiverWorker& w : ctx_->workers) {
      ConsumerPlan plan;
      plan.consumer = info.consumer_offset + ctx_->DeploymentIndex(w);
      plans.push_back(std::move(plan));
    }
    return plans;
  }

  // A lora session's tensors from trainer rank 0, bucket by bucket (ShardedLoraBuckets),
  // the next bucket in flight while one lands; runs on the worker's thread.
  Status ReceiveAdapter(const ReceiverWorker& w, Slot& slot, const std::vector<TensorMeta>& tensors,
                        Deadline deadline) {
    if (!info_->uses_gloo()) {
      return Unimplemented(fmt::format("{}: a lora session over an NCCL sharded group (adapters sync over a Gloo "
                                       "group)", w.label));
    }
    const std::vector<LoraBucket> buckets = ShardedLoraBuckets(tensors);
    size_t largest = 0;
    for (const LoraBucket& b : buckets) largest = std::max(largest, b.bytes);
    for (std::vector<std::byte>& buffer : slot.adapter) buffer.resize(largest);
    auto post = [&](size_t k) -> Result<std::unique_ptr<Communicator::PeerBatch>> {
      Communicator::PeerMessage m{0, static_cast<uint32_t>(k), std::span(slot.adapter[k % 2].data(), buckets[k].bytes)};
      return slot.comm->PostPeerBatch({}, std::span(&m, 1));
    };
    std::unique_ptr<Communicator::PeerBatch> next;
    if (!buckets.empty()) {
      WSYNC_ASSIGN_OR_RETURN(next, post(0));
    }
    for (size_t k = 0; k < buckets.size(); ++k) {
      std::unique_ptr<Communicator::PeerBatch> batch = std::move(next);
      const LoraBucket& b = buckets[k];
      Status s = batch->Wait(deadline);
      if (!s.ok()) {
        return s.WithContext(fmt::format("{}: receiving bucket {}/{} of the adapter ({}..{}) from {}", w.label, k + 1,
                                         buckets.size(), tensors[b.first].name, tensors[b.end - 1].name,
                                         Describer(*info_)(0)));
      }
      if (k + 1 < buckets.size()) {
        WSYNC_ASSIGN_OR_RETURN(next, post(k + 1));
      }
      std::span<const std::byte> bytes(slot.adapter[k % 2].data(), b.bytes);
      size_t off = 0;
      for (size_t i = b.first; i < b.end; ++i) {
        const TensorMeta& m = tensors[i];
        WSYNC_RETURN_IF_ERROR(
            w.sink->Load(TensorRef{m.name, m.dtype, m.shape, bytes.subspan(off, m.nbytes()), Device{}}).WithContext(w.label));
        off += m.nbytes();
      }
      WSYNC_RETURN_IF_ERROR(w.sink->ChunkLanded().WithContext(w.label));
    }
    return Status::Ok();
  }

  void AbortGroup() {
    for (Slot& slot : slots_) {
      if (slot.comm) slot.comm->Abort();
    }
  }

  // "chunk 3/14 of group 2 (model.layers.1.self_attn.q_proj.weight, 1.5 MiB) from
  // trainer rank 1 (...)".
  std::string DescribeChunk(const ConsumerPlan& plan, size_t k) const {
    const PlanChunk& c = plan.chunks[k];
    return fmt::format("chunk {}/{} of group {} ({}, {} bytes) from {}", k + 1, plan.chunks.size(), c.group,
                       info_->tensors[group_first_[c.group]].name, c.bytes, Describer(*info_)(c.producer));
  }

  // Receives the plan's chunks through the slot's lanes (lanes.h) and lands each slice
  // in the worker's shards; runs on the worker's thread.
  Status ReceivePlan(const ReceiverWorker& w, Slot& slot, Deadline deadline) {
    const ConsumerPlan& plan = slot.plan;
    const size_t n = plan.chunks.size();
    const Device where = device_buffers_ ? w.device : Device{};
    size_t landed = 0;
    auto land = [&](size_t k, std::span<const std::byte> bytes) -> Status {
      for (const PlanSlice& sl : plan.chunks[k].slices) {
        std::span<const std::byte> piece = bytes.subspan(sl.offset, sl.bytes);
        if (info_->tensor_parts.size() > static_cast<size_t>(sl.tensor) &&
            !info_->tensor_parts[sl.tensor].empty()) {
          // A split tensor's sub-slice: the piece lands once all its parts are here.
          WSYNC_ASSIGN_OR_RETURN(std::optional<std::vector<std::byte>> whole, Assemble(w, slot, sl, piece));
          if (!whole) continue;
          slot.assembled.push_back(std::move(*whole));
          Status s = w.sink->LoadPiece(sl.param, sl.piece, slot.assembled.back(), where);
          if (!s.ok()) {
            return s.WithContext(
                fmt::format("landing {} of {}", info_->tensors[sl.tensor].name, DescribeChunk(plan, k)));
          }
          continue;
        }
        Status s = w.sink->LoadPiece(sl.param, sl.piece, piece, where);
        if (!s.ok()) {
          return s.WithContext(fmt::format("landing {} of {}", info_->tensors[sl.tensor].name, DescribeChunk(plan, k)));
        }
      }
      Status landed_chunk = w.sink->ChunkLanded();
      slot.assembled.clear();
      WSYNC_RETURN_IF_ERROR(landed_chunk);
      if (fault_die_mid_update_ && ++landed < n) {
        WSYNC_LOG_WARN("fault injection (--fault die-mid-update): {} landed chunk 1/{}; killing this process",
                       w.label, n);
        kill(getpid(), SIGKILL);
      }
      return Status::Ok();
    };
    auto name = [&](size_t k) { return DescribeChunk(plan, k); };
    slot.partial.clear();
    slot.assembled.clear();
    return ReceiveLanes(*slot.comm, plan, slot.lanes, land, name, deadline).WithContext(w.label);
  }

  // Copies sub-slice `sl` into its piece's assembly buffer; the whole piece once its
  // last part is in (its buffer leaves the slot then), else nullopt.
  Result<std::optional<std::vector<std::byte>>> Assemble(const ReceiverWorker& w, Slot& slot, const PlanSlice& sl,
                                                         std::span<const std::byte> part) {
    const PieceRuns runs = w.sink->sharding()->Runs(sl.param, sl.piece);
    const size_t whole = static_cast<size_t>(runs.count * runs.run_bytes);
    if (sl.begin + sl.bytes > whole) {
      return Internal(fmt::format("a part of {} ends past its piece", info_->tensors[sl.tensor].name));
    }
    Partial& p = slot.partial[{sl.param, sl.piece}];
    if (p.bytes.empty()) p.bytes.resize(whole);
    std::memcpy(p.bytes.data() + sl.begin, part.data(), part.size());
    p.received += sl.bytes;
    if (p.received < whole) return std::optional<std::vector<std::byte>>();
    std::vector<std::byte> out = std::move(p.bytes);
    slot.partial.erase({sl.param, sl.piece});
    return std::optional<std::vector<std::byte>>(std::move(out));
  }

  ReceiverContext* ctx_;
  std::vector<Slot> slots_;  // one per worker, touched only from that worker's thread during an update
  std::optional<ShardedInitInfo> info_;
  std::vector<int64_t> group_first_;  // by group: its first tensor's index; then the tensor count
  double timeout_ = 300;
  bool device_buffers_ = false;  // NCCL: receive buffers on each worker's GPU; Gloo: host
  bool fault_die_mid_update_ = false;
};

}  // namespace

Result<std::unique_ptr<ReceiverBackend>> CreateShardedReceiver(ReceiverContext* context) {
  return std::unique_ptr<ReceiverBackend>(std::make_unique<ShardedReceiver>(context));
}

}  // namespace wsync
