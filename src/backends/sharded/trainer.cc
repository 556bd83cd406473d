#include "backends/sharded/trainer.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <deque>
#include <future>
#include <map>
#include <optional>
#include <tuple>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "backends/nccl/staging.h"
#include "backends/sharded/init_info.h"
#include "comm/communicator.h"
#include "comm/connect.h"
#include "comm/store.h"
#include "control/init_payloads.h"
#include "control/session_driver.h"
#include "core/checked_math.h"
#include "core/digest.h"
#include "core/log.h"
#include "core/parallel.h"
#include "core/stopwatch.h"
#include "engine/backend_options.h"
#include "engine/device_digests.h"
#include "engine/engine.h"
#include "engine/rank_exchange.h"
#include "engine/sync_pass.h"
#include "engine/watched.h"
#include "model/config.h"
#include "model/sharding.h"
#include "plan/fleet_plan.h"
#include "plan/sharded_plan.h"
#include "sources/groups.h"

namespace wsync {
namespace {

using nlohmann::json;
using Pending = SessionDriver::Pending;

// One deployment of the fleet: `servers` consecutive servers that together host
// `workers` workers of one TP size (SkyRL's data-parallel servers of one replica).
struct Deployment {
  int tp = 1;
  int workers = 1;
  int first_consumer = 0;
  int first_server = 0;
  int servers = 1;
  bool drafter = false;  // its workers hold an MTP drafter (serve --speculative mtp)
};

// What rank 0 learns of the fleet and tells the other ranks: the same plan follows on all.
struct FleetShape {
  std::vector<Deployment> deployments;
  std::vector<std::string> urls;
  int num_consumers = 0;
  // The group's rendezvous: a Gloo store, or an NCCL unique id.
  std::string store_host;
  int store_port = 0;
  std::string prefix;
  std::string nccl_id;
  // A degraded sync's workers (consumer ids of the live servers, ascending); empty: all.
  std::vector<int> live_consumers;

  json ToJson() const {
    json deps = json::array();
    for (const Deployment& d : deployments) {
      deps.push_back({{"tp", d.tp}, {"workers", d.workers}, {"first_consumer", d.first_consumer},
                      {"first_server", d.first_server}, {"servers", d.servers}, {"drafter", d.drafter}});
    }
    return json{{"deployments", deps}, {"urls", urls}, {"num_consumers", num_consumers},
                {"store_host", store_host}, {"store_port", store_port}, {"prefix", prefix}, {"nccl_id", nccl_id},
                {"live_consumers", live_consumers}};
  }
  // From rank 0 of the same trainer (a peer this process trusts as itself).
  static FleetShape FromJson(const json& j) {
    FleetShape f;
    for (const json& d : j.at("deployments")) {
      f.deployments.push_back({d.at("tp").get<int>(), d.at("workers").get<int>(), d.at("first_consumer").get<int>(),
                               d.at("first_server").get<int>(), d.at("servers").get<int>(),
                               d.at("drafter").get<bool>()});
    }
    f.urls = j.at("urls").get<std::vector<std::string>>();
    f.num_consumers = j.at("num_consumers").get<int>();
    f.store_host = j.at("store_host").get<std::string>();
    f.store_port = j.at("store_port").get<int>();
    f.prefix = j.at("prefix").get<std::string>();
    f.nccl_id = j.at("nccl_id").get<std::string>();
    f.live_consumers = j.at("live_consumers").get<std::vector<int>>();
    return f;
  }
  bool uniform() const {
    return std::all_of(deployments.begin(), deployments.end(),
                       [&](const Deployment& d) { return d.workers == deployments.front().workers; });
  }
  // The server that hosts consumer `c` (its deployment's data-parallel ranks spread
  // evenly over the deployment's servers), or -1.
  int ServerOf(int c) const {
    for (const Deployment& d : deployments) {
      if (c < d.first_consumer || c >= d.first_consumer + d.workers) continue;
      const int dp = (c - d.first_consumer) / d.tp;
      const int dp_per_server = std::max(1, d.workers / d.tp / d.servers);
      return d.first_server + std::min(d.servers - 1, dp / dp_per_server);
    }
    return -1;
  }
  // "http://host:port worker dp1/tp0" for consumer `c`.
  std::string Label(int c) const {
    for (const Deployment& d : deployments) {
      if (c < d.first_consumer || c >= d.first_consumer + d.workers) continue;
      const int j = c - d.first_consumer;
      return fmt::format("{} worker dp{}/tp{}", urls[ServerOf(c)], j / d.tp, j % d.tp);
    }
    return fmt::format("consumer {}", c);
  }
  // Group rank of consumer `c` given `producers`; -1: not live.
  int RankOf(int producers, int c) const { return ShardedGroupRank(producers, live_consumers, c); }
  int group_size(int producers) const {
    return producers + (live_consumers.empty() ? num_consumers : static_cast<int>(live_consumers.size()));
  }
};

// The `tp` a server's /health reports (a reply from the network): -1 unless an integer in
// [1, kMaxShardedRanks].
int HealthTp(const json& health) {
  auto it = health.find("tp");
  if (it == health.end() || !it->is_number_integer()) return -1;
  const int64_t tp = it->get<int64_t>();
  return tp >= 1 && tp <= kMaxShardedRanks ? static_cast<int>(tp) : -1;
}

// Whether a server's /health (a reply from the network) says it holds an MTP drafter:
// "speculative" is an object whose "method" is "mtp".
bool HealthDrafter(const json& health) {
  auto it = health.find("speculative");
  if (it == health.end() || !it->is_object()) return false;
  auto m = it->find("method");
  return m != it->end() && m->is_string() && m->get<std::string>() == "mtp";
}

// One copy a group's pack makes: slice `slice` of a send's layout, from the tensor it
// belongs to, into the group's buffer at `offset` (the send's place plus the slice's).
struct PackStep {
  PieceRuns runs;
  size_t offset = 0;
  // A sub-slice of a split tensor: packed bytes [begin, begin + bytes) of the piece, read
  // from this rank's rows, which start at byte `first_byte` of the whole tensor.
  bool part = false;
  size_t begin = 0;
  size_t bytes = 0;
  size_t first_byte = 0;
};

class ShardedPlane final : public DataPlane {
 public:
  ShardedPlane(const TrainerOptions& o, ShardedTrainerOptions s, ModelConfig config)
      : options_(o), sharded_(std::move(s)), config_(std::move(config)) {}
  ~ShardedPlane() override { Shutdown(); }

  // Every rank produces; a degraded sync serves the live servers only.
  SessionShape Shape() override {
    SessionShape shape;
    shape.other_rank_sync = [this](SyncContext& sync) { return SyncOtherRank(sync); };
    shape.serves_part_of_fleet = true;
    return shape;
  }

  Status Init(const PlaneInit& init) override {
    Shutdown();
    const Deadline deadline = Deadline::InSeconds(options_.timeout_seconds);
    WSYNC_ASSIGN_OR_RETURN(rank_comm_, RankComm());
    producers_ = rank_comm_ ? rank_comm_->size() : 1;
    me_ = options_.rank;
    if (!options_.device.is_cpu()) {
      if (!HasNccl()) {
        return Unimplemented(fmt::format("trainer device {}: this build has no NCCL; use device cpu",
                                         options_.device.ToString()));
      }
      WSYNC_RETURN_IF_ERROR(CudaRuntimeFor(options_.device).status());
    }
    adapters_ = options_.lora.has_value();
    if (adapters_ && !options_.device.is_cpu()) {
      return Unimplemented(fmt::format("LoRA adapter {} over the sharded backend: trainer device {}; adapters sync "
                                       "over a Gloo (cpu) sharded group, or over the nccl or ipc backends",
                                       options_.lora->name, options_.device.ToString()));
    }
    // An adapter group carries no model: its sessions send the adapter, rank 0 to every
    // worker (ShardedLoraBuckets), and plan nothing.
    if (!adapters_) WSYNC_RETURN_IF_ERROR(AgreeOnOwnership(init, deadline));
    if (stream_.split() && !options_.device.is_cpu()) {
      return Unimplemented(fmt::format(
          "trainer rank {}: the trainer ranks hold rows of some tensors (FSDP's dim-0 shards, held_rows()); "
          "the sharded backend sends those parts from a cpu trainer only", me_));
    }

    // Rank 0 discovers the fleet and opens the rendezvous; every rank plans from its word.
    std::string shape_text;
    if (me_ == 0) {
      Result<FleetShape> shape = init.live.empty() ? DiscoverFleet(init) : LiveFleet(init);
      if (shape.ok() && init.live.empty()) provisioned_ = *shape;
      shape_text = shape.ok() ? shape->ToJson().dump() : StatusToJson(shape.status()).dump();
    }
    if (producers_ > 1) {
      WSYNC_ASSIGN_OR_RETURN(shape_text, BroadcastString(*rank_comm_, shape_text, 0, deadline));
    }
    json shape_json = json::parse(shape_text);
    if (shape_json.contains("error")) return StatusFromJson(shape_json, me_ == 0 ? "" : "trainer rank 0");
    fleet_ = FleetShape::FromJson(shape_json);
    if (!adapters_) {
      WSYNC_RETURN_IF_ERROR(BuildPlans());
      PlanSplitDigests();
    }
    labels_ = Labels();

    // Rank 0 tells the others how its side went (its servers' init replies included); they
    // wait for that word on the trainer ranks' group while they join, so a server that
    // refuses init ends every rank's Init at once rather than at the connect deadline.
    if (me_ == 0) {
      Status mine = InitServersAndJoin(init, deadline);
      if (producers_ > 1) {
        Result<std::string> told = BroadcastString(*rank_comm_, mine.ok() ? "{}" : StatusToJson(mine).dump(), 0,
                                                   deadline);
        if (mine.ok() && !told.ok()) mine = told.status();
      }
      WSYNC_RETURN_IF_ERROR(mine);
    } else {
      auto connecting = StartConnect(deadline);
      WSYNC_ASSIGN_OR_RETURN(std::string word, BroadcastString(*rank_comm_, "", 0, deadline));
      json w = json::parse(word);
      if (w.contains("error")) return StatusFromJson(w, "trainer rank 0");
      WSYNC_RETURN_IF_ERROR(FinishConnect(std::move(connecting), nullptr));
      WSYNC_RETURN_IF_ERROR(ReserveBuffers());
    }
    if (adapters_) {
      WSYNC_LOG_INFO("trainer rank {}: adapter group of {} producers and {} workers is up for LoRA adapter {}{}", me_,
                     producers_, fleet_.num_consumers, options_.lora->name,
                     me_ == 0 ? "; this rank sends it to every worker" : "");
    } else {
      WSYNC_LOG_INFO("trainer rank {}: sharded group of {} producers and {} workers is up; this rank sends {:.1f} MB "
                     "per sync in {} groups", me_, producers_, fleet_.num_consumers, producer_.bytes_sent / 1e6,
                     producer_.by_group.size());
    }
    return Status::Ok();
  }

  // Every rank answers together: any rank's error fails the sync on all; any rank's
  // group being down re-initializes all of them.
  Result<bool> Ready(const Status& mine) override {
    const bool down = !comm_ || comm_->aborted();
    if (producers_ <= 1 || rank_comm_ == nullptr) {
      WSYNC_RETURN_IF_ERROR(mine);
      return !down;
    }
    return AllRanksReady(*rank_comm_, mine, down, me_, Deadline::InSeconds(options_.timeout_seconds));
  }

  Status Prepare(SyncContext& sync) override {
    if (adapters_) {
      // A lora session's update_info is its tensor list, admitted against the adapter's
      // declaration (docs/lora.md).
      sync.update_body = adapter_body_.Get(sync.pass.metadata());
      const size_t consumers = GroupWorkers().size();
      size_t bytes = 0;
      for (const TensorMeta& m : sync.pass.metadata()) bytes += m.nbytes();
      sync.stats.bytes = bytes * consumers;
      sync.stats.chunks = ShardedLoraBuckets(sync.pass.metadata()).size() * consumers;
      return Status::Ok();
    }
    static const auto kBody = std::make_shared<const std::string>(json{{"update_info", json::object()}}.dump());
    sync.update_body = kBody;
    sync.stats.bytes = fleet_bytes_;
    sync.stats.chunks = fleet_chunks_;
    return Status::Ok();
  }

  Status Transfer(SyncContext& sync, Pending& update) override {
    return adapters_ ? ProduceAdapter(sync, &update) : Produce(sync, &update);
  }

  Result<SyncStats> SyncOtherRank(SyncContext& sync) {
    Stopwatch total;
    if (adapters_) {
      // Rank 0 sends the adapter; the others read their pass to its end (a source with
      // collectives inside needs every rank to).
      WSYNC_ASSIGN_OR_RETURN(std::shared_ptr<TensorStream> stream, sync.pass.Stream());
      TensorRef t;
      for (;;) {
        WSYNC_ASSIGN_OR_RETURN(bool more, stream->Next(&t));
        if (!more) break;
      }
      sync.stats.seconds = sync.stats.transfer_seconds = total.seconds();
      return sync.stats;
    }
    WSYNC_RETURN_IF_ERROR(Produce(sync, nullptr).WithContext(fmt::format("trainer rank {}", me_)));
    sync.stats.bytes = producer_.bytes_sent;
    sync.stats.chunks = messages_;
    sync.stats.seconds = sync.stats.transfer_seconds = total.seconds();
    return sync.stats;
  }

  Status Abort(const Status& cause, Pending* update) override {
    if (update != nullptr && comm_) comm_->Abort();
    return cause;
  }

  void Shutdown() override {
    if (comm_) comm_->Abort();
    comm_.reset();
  }

 private:
  Result<Communicator*> RankComm() const {
    if (!options_.comm || options_.comm->size() <= 1) {
      if (options_.rank != 0) {
        return InvalidArgument(fmt::format(
            "trainer rank {}: the sharded backend runs every trainer rank as a producer; give TrainerOptions::comm "
            "(the trainer ranks' group)", options_.rank));
      }
      return nullptr;
    }
    auto* comm = dynamic_cast<Communicator*>(options_.comm.get());
    if (comm == nullptr) {
      return InvalidArgument("TrainerOptions::comm is not a wsync communicator: the sharded backend runs "
                             "collectives among the trainer ranks");
    }
    if (comm->rank() != options_.rank) {
      return InvalidArgument(fmt::format("TrainerOptions::rank {} is rank {} of TrainerOptions::comm",
                                         options_.rank, comm->rank()));
    }
    return comm;
  }

  // The ranks agree on the model (SkyRL's metadata digest) and gather who holds what.
  Status AgreeOnOwnership(const PlaneInit& init, Deadline deadline) {
    std::vector<std::string> names;
    names.reserve(init.metadata.size());
    for (const TensorMeta& m : init.metadata) names.push_back(m.name);
    std::string mask(names.size(), init.held ? '0' : '1');
    if (init.held) {
      std::map<std::string_view, size_t> index;
      for (size_t i = 0; i < names.size(); ++i) index.emplace(names[i], i);
      for (const std::string& h : *init.held) {
        auto it = index.find(h);
        if (it == index.end()) {
          return InvalidArgument(fmt::format("trainer rank {} holds {}, which its metadata does not list", me_, h));
        }
        mask[it->second] = '1';
      }
    }
    // The rows of the held names this rank holds only part of: {"tensor index": [begin, end]}.
    json rows = json::object();
    if (init.held_rows != nullptr) {
      std::map<std::string_view, size_t> index;
      for (size_t i = 0; i < names.size(); ++i) index.emplace(names[i], i);
      for (const HeldRows& h : *init.held_rows) {
        auto it = index.find(h.name);
        if (it == index.end() || mask[it->second] != '1') {
          return InvalidArgument(fmt::format("trainer rank {} holds rows of {}, which it does not list as held", me_,
                                             h.name));
        }
        rows[std::to_string(it->second)] = {h.begin, h.end};
      }
    }
    json mine{{"digest", MetadataDigest(names)}, {"held", mask}, {"rows", rows}};
    std::vector<std::string> all{mine.dump()};
    if (producers_ > 1) {
      WSYNC_ASSIGN_OR_RETURN(all, AllGatherStrings(*rank_comm_, mine.dump(), deadline));
    }
    std::vector<std::vector<bool>> held(all.size());
    HeldRowsByRank row_ranges(all.size(), std::vector<std::optional<std::pair<int64_t, int64_t>>>(names.size()));
    std::string first_digest;
    for (size_t r = 0; r < all.size(); ++r) {
      json j = json::parse(all[r]);
      const std::string digest = j.at("digest").get<std::string>();
      if (r == 0) first_digest = digest;
      if (digest != first_digest) {
        return InvalidArgument(fmt::format(
            "trainer rank {} describes another model than rank 0 (metadata digest {} against {}): every rank's "
            "metadata must list the WHOLE model, in the same order", r, digest, first_digest));
      }
      const std::string m = j.at("held").get<std::string>();
      if (m.size() != names.size()) return Internal(fmt::format("trainer rank {} sent a held mask of {} names", r, m.size()));
      held[r].resize(m.size());
      for (size_t i = 0; i < m.size(); ++i) held[r][i] = m[i] == '1';
      const json rows_of = j.value("rows", json::object());
      for (const auto& [key, range] : rows_of.items()) {
        const size_t i = std::stoul(key);
        if (i >= names.size()) return Internal(fmt::format("trainer rank {} sent rows of tensor {}", r, i));
        row_ranges[r][i] = std::make_pair(range.at(0).get<int64_t>(), range.at(1).get<int64_t>());
      }
    }
    WSYNC_ASSIGN_OR_RETURN(Ownership ownership, ResolveOwnership(names, held));
    WSYNC_ASSIGN_OR_RETURN(std::vector<std::vector<TensorPart>> parts,
                           ResolveParts(init.metadata, held, row_ranges, ownership));
    WSYNC_ASSIGN_OR_RETURN(std::vector<LayerGroup> groups, LayerGroups(names));
    stream_ = ShardedStream{};
    stream_.tensors = init.metadata;
    for (const LayerGroup& g : groups) stream_.group_lens.push_back(static_cast<int>(g.size()));
    stream_.ownership = std::move(ownership);
    stream_.parts = std::move(parts);
    stream_.num_producers = producers_;
    group_first_.clear();
    for (const LayerGroup& g : groups) group_first_.push_back(g.begin);
    group_first_.push_back(names.size());
    held_.clear();
    held_meta_.clear();
    held_first_byte_.assign(names.size(), 0);
    for (size_t i = 0; i < names.size(); ++i) {
      if (!held[me_][i]) continue;
      held_.push_back(i);
      TensorMeta m = init.metadata[i];
      if (const auto& range = row_ranges[me_][i]) {
        // This rank's rows alone: the pass yields them, and packing reads them from their
        // place in the whole tensor.
        held_first_byte_[i] = m.nbytes() / static_cast<size_t>(m.shape[0]) * static_cast<size_t>(range->first);
        m.shape[0] = range->second - range->first;
      }
      held_meta_.push_back(std::move(m));
    }
    return Status::Ok();
  }

  // Rank 0: every server's worker count and TP size, cut into deployments.
  Result<FleetShape> DiscoverFleet(const PlaneInit& init) {
    const SessionDriver& driver = *init.driver;
    Fleet fleet = *init.fleet;
    if (!fleet.wsync) {
      return FailedPrecondition(fmt::format("{} is not a wsync server: the sharded backend needs wsync servers "
                                            "(wsync serve --backend sharded)", fleet.other));
    }
    WSYNC_RETURN_IF_ERROR(driver.WorldSizes(&fleet));
    const int dp = options_.data_parallel_size;
    const int servers = static_cast<int>(fleet.world_sizes.size());
    FleetShape shape;
    shape.urls = driver.urls();
    // Consumer ids follow the broadcast group's numbering, less its trainer rank: the same
    // deployments, the same checked sums.
    WSYNC_ASSIGN_OR_RETURN(NcclFleetLayout ranks, NcclFleetRanks(fleet.world_sizes, dp, 1, shape.urls));
    const int64_t consumers = ranks.world_size - 1;
    if (consumers + producers_ > kMaxShardedRanks) {
      return InvalidArgument(fmt::format("the fleet has {} workers, more than {}", consumers,
                                         kMaxShardedRanks - producers_));
    }
    for (int first = 0; first < servers; first += dp) {
      Deployment d;
      d.first_server = first;
      d.servers = dp;
      d.workers = fleet.world_sizes[first];
      d.tp = HealthTp(fleet.health[first]);
      d.drafter = HealthDrafter(fleet.health[first]);
      d.first_consumer = ranks.rank_offsets[first] - 1;
      for (int s = first; s < first + dp; ++s) {
        const int tp = HealthTp(fleet.health[s]);
        if (tp != d.tp) {
          return InvalidArgument(fmt::format(
              "{} and {} are data-parallel servers of one deployment (data_parallel_size {}) but report tp {} "
              "and {}", shape.urls[first], shape.urls[s], dp, d.tp, tp));
        }
        if (HealthDrafter(fleet.health[s]) != d.drafter) {
          return InvalidArgument(fmt::format(
              "{} and {} are data-parallel servers of one deployment (data_parallel_size {}) but only one holds an "
              "MTP drafter (--speculative mtp)", shape.urls[first], shape.urls[s], dp));
        }
      }
      if (d.drafter && config_.num_nextn_predict_layers == 0) {
        return InvalidArgument(fmt::format("{} holds an MTP drafter, but model {} has no MTP layers", shape.urls[first],
                                           config_.name));
      }
      if (d.tp < 1 || d.workers % d.tp != 0) {
        return InvalidArgument(fmt::format("{} reports {} workers at tp {}: not a whole number of TP groups",
                                           shape.urls[first], d.workers, d.tp));
      }
      shape.deployments.push_back(d);
    }
    shape.num_consumers = static_cast<int>(consumers);
    WSYNC_RETURN_IF_ERROR(NewRendezvous(&shape));
    return shape;
  }

  // Rank 0, a degraded sync: the fleet as provisioned, its group cut to the live servers'
  // workers. Each live server must still have the shape it was planned with.
  Result<FleetShape> LiveFleet(const PlaneInit& init) {
    if (!provisioned_) {
      return FailedPrecondition("a degraded sync keeps the plan of the whole fleet: sync every server once first");
    }
    FleetShape shape = *provisioned_;
    Fleet fleet = *init.fleet;  // the live servers', in init.live order
    WSYNC_RETURN_IF_ERROR(init.driver->WorldSizes(&fleet));
    for (size_t k = 0; k < init.live.size(); ++k) {
      const int s = init.live[k];
      if (s < 0 || s >= static_cast<int>(shape.urls.size())) {
        return InvalidArgument(fmt::format("live server {}: the fleet has {} servers", s, shape.urls.size()));
      }
      for (const Deployment& d : shape.deployments) {
        if (s < d.first_server || s >= d.first_server + d.servers) continue;
        const int tp = HealthTp(fleet.health[k]);
        if (fleet.world_sizes[k] != d.workers || tp != d.tp || HealthDrafter(fleet.health[k]) != d.drafter) {
          return FailedPrecondition(fmt::format(
              "{} now reports {} workers at tp {} (or a drafter changed); the fleet was planned with {} at tp {}: sync every server to "
              "plan again", shape.urls[s], fleet.world_sizes[k], tp, d.workers, d.tp));
        }
      }
    }
    shape.live_consumers.clear();
    for (int c = 0; c < shape.num_consumers; ++c) {
      if (std::binary_search(init.live.begin(), init.live.end(), shape.ServerOf(c))) shape.live_consumers.push_back(c);
    }
    WSYNC_RETURN_IF_ERROR(NewRendezvous(&shape));
    return shape;
  }

  // A fresh store prefix (Gloo) or unique id (NCCL) for the group about to form.
  Status NewRendezvous(FleetShape* shape) {
    if (options_.device.is_cpu()) {
      if (!store_) {
        WSYNC_ASSIGN_OR_RETURN(store_, StoreServer::Start(options_.store_host, 0));
      }
      // The last group's keys go only now: another trainer rank may still be reading them
      // after rank 0 and every server have joined.
      if (!fleet_.prefix.empty()) store_->ErasePrefix(fleet_.prefix);
      shape->store_host = options_.store_host;
      shape->store_port = store_->port();
      shape->prefix = fmt::format("wsync-sharded-{}/{}", RandomHex(8), ++attempt_);
      shape->nccl_id.clear();
    } else {
      WSYNC_ASSIGN_OR_RETURN(shape->nccl_id, NewNcclGroupId());
    }
    return Status::Ok();
  }

  // Every worker's plan (the same on every rank; slices only where this rank sends them),
  // this rank's sends and its pack steps. Only rank 0 sends init_info, so only it digests
  // the plans.
  Status BuildPlans() {
    // One catalog of the model for every table, and the stream checked against it once.
    WSYNC_ASSIGN_OR_RETURN(std::shared_ptr<const HfCatalog> catalog, HfCatalog::Make(config_));
    std::vector<FleetDeployment> deployments;
    for (const Deployment& d : fleet_.deployments) {
      deployments.push_back(FleetDeployment{d.tp, d.workers, d.first_consumer, d.drafter});
    }
    Result<FleetPlans> plans = PlanFleet(stream_, catalog, deployments, /*digests=*/me_ == 0, /*keep_producer=*/me_);
    if (!plans.ok()) return plans.status().WithContext("planning the fleet");
    plans_ = std::move(*plans);
    fleet_bytes_ = plans_.fleet_bytes;
    fleet_chunks_ = plans_.fleet_chunks;
    producer_ = plans_.Producer(me_, static_cast<int>(stream_.group_lens.size()));
    // Where each send of a group sits in the group's buffer, and the copies each tensor makes.
    send_offset_.assign(producer_.by_group.size(), {});
    pack_.assign(stream_.tensors.size(), {});
    group_bytes_ = 0;
    messages_ = 0;
    for (size_t g = 0; g < producer_.by_group.size(); ++g) {
      size_t off = 0;
      for (const ProducerSend& s : producer_.by_group[g]) {
        off = (off + 255) / 256 * 256;
        send_offset_[g].push_back(off);
        const PlanChunk& chunk = plans_.shapes[s.plan].chunks[s.chunk];
        const std::vector<PieceRuns>& runs = plans_.runs[s.plan][s.chunk];
        for (size_t i = 0; i < chunk.slices.size(); ++i) {
          const PlanSlice& slice = chunk.slices[i];
          PackStep step{runs[i], off + slice.offset};
          const size_t whole = static_cast<size_t>(runs[i].count * runs[i].run_bytes);
          if (held_first_byte_[slice.tensor] != 0 || slice.begin != 0 || slice.bytes != whole) {
            step.part = true;
            step.begin = slice.begin;
            step.bytes = slice.bytes;
            step.first_byte = held_first_byte_[slice.tensor];
          }
          pack_[slice.tensor].push_back(step);
        }
        off += s.bytes;
        messages_ += s.consumers.size();
      }
      group_bytes_ = std::max(group_bytes_, off);
    }
    // The pack steps hold what packing needs; the digests stay for init_info.
    plans_.shapes = {};
    plans_.runs = {};
    return Status::Ok();
  }

  // wsync_split_digests: a cpu trainer of several ranks that verifies in line digests
  // each tensor its ranks all hold whole by SplitDigestRows, one range per holder.
  void PlanSplitDigests() {
    split_rows_.assign(stream_.tensors.size(), {});
    split_digests_ = options_.inline_verify && options_.device.is_cpu() && producers_ > 1;
    if (!split_digests_) return;
    for (size_t i = 0; i < stream_.tensors.size(); ++i) {
      if (!stream_.parts.empty() && !stream_.parts[i].empty()) continue;  // digested by its parts
      split_rows_[i] = SplitDigestRows(stream_.tensors[i], Holders(i).size());
    }
  }

  // Rank 0: one init_info per server.
  Result<std::vector<json>> InitInfos(const PlaneInit& init) {
    WSYNC_ASSIGN_OR_RETURN(std::vector<ReplicaStamp> stamps,
                           RdtReplicaStamps(static_cast<int>(fleet_.urls.size()), options_.data_parallel_size));
    ShardedInitInfo info;
    info.adapters_only = adapters_;
    info.tensors = stream_.tensors;
    info.group_lens = stream_.group_lens;
    info.owner_sets = stream_.ownership.owner_sets;
    info.name_owner_class = stream_.ownership.name_owner_class;
    info.tensor_parts = stream_.parts;
    info.num_producers = producers_;
    info.num_consumers = fleet_.num_consumers;
    info.workers_per_replica = fleet_.uniform() ? fleet_.deployments.front().workers : 0;
    info.world_size = fleet_.group_size(producers_);
    info.live_consumers = fleet_.live_consumers;
    info.num_buffers = std::clamp(options_.num_buffers, 1, static_cast<int>(kMaxShardedBuffers));
    info.concurrent_stages = sharded_.concurrent_stages;
    info.receive_staging_mb = static_cast<int>(sharded_.receive_staging_mb);
    if (options_.device.is_cpu()) {
      info.gloo_store_host = fleet_.store_host;
      info.gloo_store_port = fleet_.store_port;
      info.gloo_prefix = fleet_.prefix;
      info.wsync_split_digests = split_digests_;
    } else {
      info.nccl_unique_id_b64 = fleet_.nccl_id;
      info.wsync_device_digests = true;
    }
    info.rank_labels = labels_;
    info.timeout_seconds = init.driver->deadlines().server_timeout();
    std::vector<json> infos;
    for (const Deployment& d : fleet_.deployments) {
      info.consumer_offset = d.first_consumer;
      info.deployment_workers = d.workers;
      info.plan_digests.clear();
      for (int j = 0; j < d.workers && !adapters_; ++j) info.plan_digests.push_back(plans_.digests[d.first_consumer + j]);
      for (int s = d.first_server; s < d.first_server + d.servers; ++s) {
        if (!init.live.empty() && !std::binary_search(init.live.begin(), init.live.end(), s)) continue;
        info.replica_rank = stamps[s].replica_rank;
        info.num_replicas = stamps[s].num_replicas;
        infos.push_back(info.ToJson());
      }
    }
    return infos;
  }

  // Names of the group's ranks, by group rank.
  std::vector<std::string> Labels() const {
    std::vector<std::string> labels;
    for (int r = 0; r < producers_; ++r) labels.push_back(fmt::format("trainer rank {}", r));
    for (int c = 0; c < fleet_.num_consumers; ++c) {
      if (fleet_.RankOf(producers_, c) >= 0) labels.push_back(fleet_.Label(c));
    }
    return labels;
  }

  // Rank 0: posts every server's init, joins the group while watching their replies, and
  // waits for every reply.
  Status InitServersAndJoin(const PlaneInit& init, Deadline deadline) {
    WSYNC_ASSIGN_OR_RETURN(std::vector<json> infos, InitInfos(init));
    std::shared_ptr<Pending> pending = init.driver->InitAsync(std::move(infos));
    WSYNC_RETURN_IF_ERROR(FinishConnect(StartConnect(deadline), pending.get()));
    WSYNC_RETURN_IF_ERROR(ReserveBuffers());
    return pending->Wait(init.driver->deadlines().Http()).status();
  }

  using Connecting = std::future<Result<std::unique_ptr<Communicator>>>;

  // Starts joining the point-to-point group on a side thread, which keeps only its own
  // state: a caller that gives up (rank 0 said no) leaves it to end at its deadline.
  Connecting StartConnect(Deadline deadline) {
    CommSpec spec;
    if (options_.device.is_cpu()) {
      spec.store = CommSpec::Store{fleet_.store_host, fleet_.store_port, fleet_.prefix, options_.store_host};
    } else {
      spec.nccl_unique_id_b64 = fleet_.nccl_id;
      spec.device = options_.device.index;
    }
    spec.rank = me_;
    spec.size = fleet_.group_size(producers_);
    spec.connect_deadline = deadline;
    spec.op_timeout = std::chrono::milliseconds(static_cast<int64_t>(options_.timeout_seconds * 1000));
    spec.describe_rank = [labels = labels_](int r) {
      return r >= 0 && r < static_cast<int>(labels.size()) ? fmt::format("rank {} ({})", r, labels[r])
                                                           : fmt::format("rank {}", r);
    };
    auto connected = std::make_shared<std::promise<Result<std::unique_ptr<Communicator>>>>();
    auto future = connected->get_future();
    std::thread([connected, spec] { connected->set_value(Connect(spec)); }).detach();
    return future;
  }

  // Waits for the join; rank 0 watches the servers' init replies (`pending`) meanwhile.
  Status FinishConnect(Connecting future, Pending* pending) {
    while (future.wait_for(std::chrono::milliseconds(20)) != std::future_status::ready) {
      if (pending != nullptr && pending->AnyFailed()) return pending->Wait(Deadline::InSeconds(1)).status();
    }
    Result<std::unique_ptr<Communicator>> comm = future.get();
    if (!comm.ok()) {
      if (pending != nullptr) {
        Result<std::vector<json>> r = pending->Wait(Deadline::InSeconds(3));
        if (!r.ok() && r.status().code() != StatusCode::kDeadlineExceeded) return r.status();
      }
      return comm.status().WithContext(fmt::format("trainer rank {} joining the sharded group", me_));
    }
    comm_ = std::move(*comm);
    return Status::Ok();
  }

  // The ring of group buffers: lookahead + 1 groups in flight at most.
  Status ReserveBuffers() {
    buffers_.resize(static_cast<size_t>(std::max(0, sharded_.lookahead)) + 1);
    for (StagingBuffer& b : buffers_) {
      WSYNC_RETURN_IF_ERROR(b.Reserve(options_.device, std::max<size_t>(group_bytes_, 1))
                                .WithContext(fmt::format("trainer rank {}: send buffers", me_)));
    }
    return Status::Ok();
  }

  // This rank's part of one sync: its held pass, group by group, packed and sent.
  //
  // In-line verification: every rank hashes its share of the tensors it holds
  // (HashingRank; a split tensor's parts, PartHashingRank, and with several cpu ranks a
  // whole tensor's SplitDigestRows, by row range), after packing
  // each, host tensors on the host and GPU tensors on the GPU, and with several trainer
  // ranks rank 0 gathers every rank's digests once all have sent, so that its finish
  // carries a digest of every tensor whichever ranks hold them. Every rank must run with
  // the same TrainerOptions::inline_verify (the gather is a collective of the trainer
  // ranks).
  Status Produce(SyncContext& sync, Pending* http) {
    std::shared_ptr<PassDigests> digests;
    if (options_.inline_verify) {
      if (rank_comm_ != nullptr) sync.pass.CollectDigests();
      digests = sync.pass.TakeDigests();  // null when rank 0 has no verifying server
    }
    WSYNC_ASSIGN_OR_RETURN(std::shared_ptr<TensorStream> stream, sync.pass.HeldStream(held_meta_));
    std::shared_ptr<Communicator> comm = comm_;
    if (!comm) return FailedPrecondition("no sharded group: Init first");
    auto state = std::make_shared<ProduceState>();
    state->stream = stream;
    state->comm = comm;
    state->progress = sync.progress;
    state->digests = digests;
    state->stable = sync.pass.source().storage();
    // The op reads the plane's plans, which live until Shutdown; Shutdown aborts the group
    // first, so the op ends before they go.
    auto op = [this, state, deadline = sync.deadline]() { return ProduceLoop(*state, deadline); };
    Status s = Watched(op, *comm, http, sync.deadline, "sending the trainer's slices");
    if (!s.ok()) {
      comm->Abort();
      return s;
    }
    TensorRef end;
    WSYNC_RETURN_IF_ERROR(stream->Next(&end).status());
    if (!digests || rank_comm_ == nullptr) return Status::Ok();
    Result<std::vector<std::string>> all = AllGatherStrings(*rank_comm_, digests->Json().dump(), sync.deadline);
    if (!all.ok()) return all.status().WithContext(fmt::format("trainer rank {}: gathering the in-line digests", me_));
    if (me_ != 0) return Status::Ok();
    for (size_t r = 1; r < all->size(); ++r) {
      Status merged = digests->Merge(json::parse((*all)[r], nullptr, /*allow_exceptions=*/false));
      if (!merged.ok()) return Internal(fmt::format("trainer rank {} sent malformed {}", r, merged.message()));
    }
    return Status::Ok();
  }

  // The group ranks of the workers in this group (a degraded sync's live ones).
  std::vector<int> GroupWorkers() const {
    std::vector<int> ranks;
    for (int c = 0; c < fleet_.num_consumers; ++c) {
      if (const int r = fleet_.RankOf(producers_, c); r >= 0) ranks.push_back(r);
    }
    return ranks;
  }

  // Rank 0's part of a lora session: the adapter's tensors in ShardedLoraBuckets, each
  // bucket packed (and hashed, for in-line verification) while the one before is on the
  // wire, and sent to every worker of the group.
  Status ProduceAdapter(SyncContext& sync, Pending* http) {
    std::shared_ptr<Communicator> comm = comm_;
    if (!comm) return FailedPrecondition("no sharded group: Init first");
    std::shared_ptr<PassDigests> digests = sync.pass.TakeDigests();
    WSYNC_ASSIGN_OR_RETURN(std::shared_ptr<TensorStream> stream, sync.pass.Stream());
    auto meta = std::make_shared<const std::vector<TensorMeta>>(sync.pass.metadata());
    auto buckets = std::make_shared<const std::vector<LoraBucket>>(ShardedLoraBuckets(*meta));
    const std::vector<int> peers = GroupWorkers();
    size_t largest = 0;
    for (const LoraBucket& b : *buckets) largest = std::max(largest, b.bytes);
    for (auto& b : adapter_buffers_) {
      if (!b) b = std::make_shared<std::vector<std::byte>>();
      if (b->size() < largest) b->resize(largest);
    }
    auto op = [comm, stream, digests, meta, buckets, peers, buffers = adapter_buffers_, progress = sync.progress,
               deadline = sync.deadline]() -> Status {
      std::unique_ptr<Communicator::PeerBatch> inflight;
      size_t inflight_bucket = 0;
      SyncProgress p{0, 0, 0, buckets->size() * peers.size()};
      for (const LoraBucket& b : *buckets) p.bytes_total += b.bytes * peers.size();
      auto wait = [&]() -> Status {
        const LoraBucket& b = (*buckets)[inflight_bucket];
        Status s = inflight->Wait(deadline);
        inflight.reset();
        if (!s.ok()) {
          return s.WithContext(fmt::format("sending bucket {}/{} of the adapter ({}..{})", inflight_bucket + 1,
                                           buckets->size(), (*meta)[b.first].name, (*meta)[b.end - 1].name));
        }
        p.bytes_done += b.bytes * peers.size();
        p.chunks_done += peers.size();
        if (progress) progress(p);
        return Status::Ok();
      };
      for (size_t k = 0; k < buckets->size(); ++k) {
        const LoraBucket& b = (*buckets)[k];
        std::byte* dst = buffers[k % 2]->data();
        size_t off = 0;
        for (size_t i = b.first; i < b.end; ++i) {
          TensorRef t;
          WSYNC_ASSIGN_OR_RETURN(bool more, stream->Next(&t));
          if (!more) return Internal("source ended early");
          if (!t.device.is_cpu()) {
            return InvalidArgument(fmt::format("tensor {} is on {}: a trainer on cpu sends host tensors", t.name,
                                               t.device.ToString()));
          }
          CopyRecordingDigest(dst + off, t, digests.get());
          off += t.bytes.size();
        }
        if (inflight) WSYNC_RETURN_IF_ERROR(wait());
        std::vector<Communicator::PeerMessage> sends;
        for (int peer : peers) sends.push_back({peer, static_cast<uint32_t>(k), std::span(dst, b.bytes)});
        WSYNC_ASSIGN_OR_RETURN(inflight, comm->PostPeerBatch(sends, {}));
        inflight_bucket = k;
      }
      return inflight ? wait() : Status::Ok();
    };
    Status s = Watched(op, *comm, http, sync.deadline, "sending the LoRA adapter");
    if (!s.ok()) {
      comm->Abort();
      return s;
    }
    TensorRef end;
    return stream->Next(&end).status();
  }

  struct ProduceState {
    std::shared_ptr<TensorStream> stream;
    std::shared_ptr<Communicator> comm;
    std::function<void(const SyncProgress&)> progress;
    std::shared_ptr<PassDigests> digests;  // in-line verification: this rank's share
    std::optional<SourceStorage> stable;    // what the source keeps for its life (FinishCopiesFrom)
  };

  // The trainer rank that hashes stream tensor i for in-line verification: one of its
  // holders, taken in turn tensor by tensor, so that ranks that all hold a tensor (FSDP)
  // share the hashing.
  int HashingRank(size_t i) const {
    const std::vector<int>& owners = Holders(i);
    return owners.empty() ? 0 : owners[i % owners.size()];
  }
  // The trainer ranks holding stream tensor i.
  const std::vector<int>& Holders(size_t i) const {
    return stream_.ownership.owner_sets[stream_.ownership.name_owner_class[i]];
  }
  // The same for part k of split stream tensor i: one of the ranks holding its rows.
  int PartHashingRank(size_t i, size_t k) const {
    const std::vector<int>& owners = stream_.ownership.owner_sets[stream_.parts[i][k].owner_class];
    return owners.empty() ? 0 : owners[(i + k) % owners.size()];
  }

  Status ProduceLoop(ProduceState& st, Deadline deadline) {
    WSYNC_RETURN_IF_ERROR(UseDeviceOnThisThread(options_.device));
    DeviceRuntime* rt = nullptr;
    if (!options_.device.is_cpu()) {
      WSYNC_ASSIGN_OR_RETURN(rt, CudaRuntimeFor(options_.device));
    }
    struct InFlight {
      std::unique_ptr<Communicator::PeerBatch> batch;
      size_t group = 0;
    };
    if (me_ == sharded_.stall_rank) return Stall(st, deadline);
    if (st.digests && rt == nullptr && producers_ > 1 && !hash_pool_) hash_pool_ = std::make_unique<TaskPool>(1);
    std::deque<InFlight> inflight;
    const size_t ring = buffers_.size();
    size_t used = 0;  // groups packed so far (the ring slot is used % ring)
    size_t next_held = 0;
    SyncProgress progress{0, producer_.bytes_sent, 0, messages_};
    auto wait_oldest = [&]() -> Status {
      InFlight f = std::move(inflight.front());
      inflight.pop_front();
      Status s = f.batch->Wait(deadline);
      if (!s.ok()) return s.WithContext(GroupName(f.group));
      for (const ProducerSend& send : producer_.by_group[f.group]) {
        progress.bytes_done += send.bytes * send.consumers.size();
        progress.chunks_done += send.consumers.size();
      }
      if (st.progress && me_ == 0) st.progress(progress);
      return Status::Ok();
    };
    for (size_t g = 0; g + 1 < group_first_.size(); ++g) {
      const size_t end = group_first_[g + 1];
      if (next_held >= held_.size() || held_[next_held] >= end) continue;  // nothing held here
      const bool sends = !producer_.by_group[g].empty();
      if (sends && inflight.size() >= ring) WSYNC_RETURN_IF_ERROR(wait_oldest());
      std::byte* buf = buffers_[used % ring].data();
      for (; next_held < held_.size() && held_[next_held] < end; ++next_held) {
        const size_t i = held_[next_held];
        TensorRef t;
        WSYNC_ASSIGN_OR_RETURN(bool more, st.stream->Next(&t));
        if (!more) return Internal("the held pass ended early");
        // Hashed beside the pack below (a cpu rank of several) or after it, while it is in
        // cache, and always before the next tensor is read. A split tensor is
        // whole on no rank: each of its parts is hashed by one of the ranks holding it, as
        // is each range of a tensor several ranks hold whole (SplitDigestRows).
        // A tensor on the trainer's GPU is digested there (whole, or by row ranges over
        // kDeviceWholeDigestBytes) before the next is read, while the source still holds
        // it; one on another device is left undigested (the sync is then unverified).
        const bool split = !stream_.parts.empty() && !stream_.parts[i].empty();
        const bool on_device = !t.device.is_cpu();
        const std::vector<std::pair<int64_t, int64_t>>& spread = split_rows_[i];  // sized at Init
        const bool spread_rows = !spread.empty() && !on_device;
        const bool hash = st.digests && (split || spread_rows || HashingRank(i) == me_) &&
                          (!on_device || (rt != nullptr && t.device == options_.device && !split));
        auto record = [&]() -> Status {
          if (!hash) return Status::Ok();
          if (on_device) {
            const DeviceTensorBytes one{&stream_.tensors[i], t.bytes.data()};
            return RecordDeviceDigests(options_.device, std::span(&one, 1), *st.digests);
          }
          if (spread_rows) {
            const std::vector<int>& owners = Holders(i);
            const size_t row_bytes = t.bytes.size() / static_cast<size_t>(stream_.tensors[i].shape[0]);
            for (size_t k = 0; k < spread.size(); ++k) {
              if (owners[(i + k) % owners.size()] != me_) continue;
              const auto [begin, end] = spread[k];
              st.digests->RecordRows(t.name, begin, end,
                                     HexDigest(DigestAlgorithm::kXxh3_128,
                                               t.bytes.subspan(static_cast<size_t>(begin) * row_bytes,
                                                               static_cast<size_t>(end - begin) * row_bytes)));
            }
            return Status::Ok();
          }
          if (!split) {
            st.digests->Record(t.name, HexDigest(DigestAlgorithm::kXxh3_128, t.bytes));
            return Status::Ok();
          }
          const TensorMeta& whole = stream_.tensors[i];
          const size_t row_bytes = whole.nbytes() / static_cast<size_t>(whole.shape[0]);
          const std::vector<TensorPart>& parts = stream_.parts[i];
          for (size_t k = 0; k < parts.size(); ++k) {
            if (PartHashingRank(i, k) != me_) continue;
            const size_t from = static_cast<size_t>(parts[k].row_begin) * row_bytes - held_first_byte_[i];
            const size_t bytes = static_cast<size_t>(parts[k].row_end - parts[k].row_begin) * row_bytes;
            st.digests->RecordRows(t.name, parts[k].row_begin, parts[k].row_end,
                                   HexDigest(DigestAlgorithm::kXxh3_128, t.bytes.subspan(from, bytes)));
          }
          return Status::Ok();
        };
        if (pack_[i].empty()) {
          WSYNC_RETURN_IF_ERROR(record());
          continue;
        }
        if (rt == nullptr && !t.device.is_cpu()) {
          return InvalidArgument(fmt::format("tensor {} is on {}: a trainer on cpu sends host tensors", t.name,
                                             t.device.ToString()));
        }
        // Host hashing runs on the helper beside this tensor's packing (both only read
        // it): the held pass of an FSDP source is lockstep (an all-gather per tensor), so
        // what one rank spends on a tensor delays every rank's next one.
        Status hashed;
        std::optional<TaskGroup> beside;
        if (hash && !on_device && hash_pool_) {
          beside.emplace(*hash_pool_);
          beside->Submit([&](size_t) { hashed = record(); });
        }
        bool copied = false;  // device copies from `t` are enqueued
        for (const PackStep& p : pack_[i]) {
          const PieceRuns& r = p.runs;
          if (p.part) {
            PackPartHost(r, p.begin, p.bytes, p.first_byte, t.bytes.data(), buf + p.offset);
            continue;
          }
          if (rt != nullptr) {
            WSYNC_RETURN_IF_ERROR(rt->Copy2D(buf + p.offset, r.run_bytes, t.bytes.data() + r.hf_offset, r.hf_stride,
                                             r.run_bytes, r.count));
            copied = true;
            continue;
          }
          for (int64_t k = 0; k < r.count; ++k) {
            std::memcpy(buf + p.offset + k * r.run_bytes, t.bytes.data() + r.hf_offset + k * r.hf_stride,
                        r.run_bytes);
          }
        }
        if (beside) {
          beside->Wait();
          WSYNC_RETURN_IF_ERROR(hashed);
        } else {
          WSYNC_RETURN_IF_ERROR(record());
        }
        if (copied) WSYNC_RETURN_IF_ERROR(FinishCopiesFrom(*rt, t, st.stable).status());
      }
      if (!sends) continue;
      if (rt != nullptr) WSYNC_RETURN_IF_ERROR(rt->Synchronize().WithContext("packing " + GroupName(g)));
      std::vector<Communicator::PeerMessage> messages;
      for (size_t j = 0; j < producer_.by_group[g].size(); ++j) {
        const ProducerSend& send = producer_.by_group[g][j];
        std::span<std::byte> data(buf + send_offset_[g][j], send.bytes);
        for (size_t k = 0; k < send.consumers.size(); ++k) {
          const int peer = fleet_.RankOf(producers_, send.consumers[k]);
          if (peer >= 0) messages.push_back({peer, static_cast<uint32_t>(send.chunks[k]), data});
        }
      }
      // A worker receives its chunks from one producer in chunk order (NCCL matches a
      // pair's messages by posting order alone).
      std::stable_sort(messages.begin(), messages.end(), [](const auto& x, const auto& y) {
        return x.peer != y.peer ? x.peer < y.peer : x.tag < y.tag;
      });
      WSYNC_ASSIGN_OR_RETURN(std::unique_ptr<Communicator::PeerBatch> batch,
                             st.comm->PostPeerBatch(messages, {}));
      inflight.push_back({std::move(batch), g});
      ++used;
    }
    while (!inflight.empty()) WSYNC_RETURN_IF_ERROR(wait_oldest());
    return Status::Ok();
  }

  // The stall fault (ShardedTrainerOptions::stall_rank): the pass is read, nothing sent.
  Status Stall(ProduceState& st, Deadline deadline) {
    WSYNC_LOG_WARN("fault injection (stall_rank): trainer rank {} reads its pass and sends nothing", me_);
    TensorRef t;
    for (;;) {
      WSYNC_ASSIGN_OR_RETURN(bool more, st.stream->Next(&t));
      if (!more) break;
    }
    while (!deadline.expired() && !st.comm->aborted()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    return DeadlineExceeded(fmt::format("fault injection: trainer rank {} sent nothing", me_));
  }

  // "group 3 (model.layers.1.*)": how errors name a layer group.
  std::string GroupName(size_t g) const {
    const std::string& first = stream_.tensors[group_first_[g]].name;
    return fmt::format("group {} ({}, {} tensors)", g, first, group_first_[g + 1] - group_first_[g]);
  }

  TrainerOptions options_;
  ShardedTrainerOptions sharded_;
  ModelConfig config_;
  Communicator* rank_comm_ = nullptr;  // the trainer ranks' group; null for one rank
  int producers_ = 1;
  int me_ = 0;
  ShardedStream stream_;
  std::vector<size_t> group_first_;   // first tensor of each group, then the tensor count
  std::vector<size_t> held_;          // stream indices this rank holds, ascending
  std::vector<TensorMeta> held_meta_;         // a split tensor's: this rank's rows
  std::vector<size_t> held_first_byte_;       // by stream tensor: where this rank's rows begin
  FleetShape fleet_;
  FleetPlans plans_;
  ProducerPlan producer_;
  std::vector<std::vector<size_t>> send_offset_;   // [group][send]: offset in the group buffer
  std::vector<std::vector<PackStep>> pack_;        // by stream tensor
  // By stream tensor: its SplitDigestRows (wsync_split_digests), empty: digested whole.
  std::vector<std::vector<std::pair<int64_t, int64_t>>> split_rows_;
  bool split_digests_ = false;
  std::unique_ptr<TaskPool> hash_pool_;  // a cpu rank's hashing beside its packing (ProduceLoop)
  size_t group_bytes_ = 0;
  size_t messages_ = 0;                            // this rank's messages per sync
  size_t fleet_bytes_ = 0;                         // every worker's bytes per sync
  size_t fleet_chunks_ = 0;
  std::vector<StagingBuffer> buffers_;
  std::vector<std::string> labels_;
  std::unique_ptr<StoreServer> store_;             // rank 0 on cpu
  std::optional<FleetShape> provisioned_;          // rank 0: the whole fleet, as last planned
  std::shared_ptr<Communicator> comm_;
  int attempt_ = 0;
  bool adapters_ = false;  // TrainerOptions::lora: an adapter group (init_info wsync_lora)
  UpdateBodyCache adapter_body_;
  // A lora session's two bucket buffers; shared with a send that may outlive an abort.
  std::array<std::shared_ptr<std::vector<std::byte>>, 2> adapter_buffers_;
};

}  // namespace

Result<ShardedTrainerOptions> ParseShardedTrainerOptions(const std::map<std::string, std::string>& values) {
  ShardedTrainerOptions o;
  BackendOptions read("sharded", values);
  int64_t lookahead = o.lookahead;
  int64_t stall = o.stall_rank;
  WSYNC_RETURN_IF_ERROR(read.Read("model", &o.model));
  WSYNC_RETURN_IF_ERROR(read.Read("lookahead", &lookahead));
  WSYNC_RETURN_IF_ERROR(read.Read("stall_rank", &stall));
  std::string concurrent = o.concurrent_stages ? "on" : "off";
  WSYNC_RETURN_IF_ERROR(read.Read("concurrent_stages", &concurrent));
  if (concurrent != "on" && concurrent != "off") {
    return InvalidArgument(fmt::format("sharded option concurrent_stages={}: must be on or off", concurrent));
  }
  o.concurrent_stages = concurrent == "on";
  WSYNC_RETURN_IF_ERROR(read.Read("receive_staging_mb", &o.receive_staging_mb));
  if (o.receive_staging_mb < 0 || o.receive_staging_mb > INT32_MAX) {
    return InvalidArgument(fmt::format("sharded option receive_staging_mb={}: must be in [0, {}]",
                                       o.receive_staging_mb, INT32_MAX));
  }
  if (stall < -1 || stall >= kMaxShardedRanks) return InvalidArgument(fmt::format("sharded option stall_rank={}: out of range", stall));
  o.stall_rank = static_cast<int>(stall);
  WSYNC_RETURN_IF_ERROR(read.Finish());
  if (lookahead < 0 || lookahead > 64) {
    return InvalidArgument(fmt::format("sharded option lookahead={}: must be in [0, 64]", lookahead));
  }
  o.lookahead = static_cast<int>(lookahead);
  return o;
}

Result<std::unique_ptr<TrainerEngine>> CreateShardedTrainerWith(const TrainerOptions& options,
                                                                const ShardedTrainerOptions& sharded) {
  WSYNC_RETURN_IF_ERROR(CheckTrainerOptions(options));
  if (sharded.model.empty()) {
    return InvalidArgument("the sharded backend plans from the servers' model: give its name or config.json "
                           "directory (backend option model)");
  }
  WSYNC_ASSIGN_OR_RETURN(ModelConfig config, LookupModel(sharded.model));
  return NewTrainerEngine(options, std::make_unique<ShardedPlane>(options, sharded, std::move(config)));
}

Result<std::unique_ptr<TrainerEngine>> CreateShardedTrainer(const TrainerOptions& options) {
  WSYNC_ASSIGN_OR_RETURN(ShardedTrainerOptions o, ParseShardedTrainerOptions(options.backend_options));
  return CreateShardedTrainerWith(options, o);
}

}  // namespace wsync
