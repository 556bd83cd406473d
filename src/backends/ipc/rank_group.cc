#include "backends/ipc/rank_group.h"

#include <optional>
#include <vector>

#include <fmt/format.h>

#include "core/log.h"
#include "engine/rank_exchange.h"
#include "wsync/device_runtime.h"

namespace wsync {

using nlohmann::json;

void IpcRankGroup::Reset() {
  active_ = zero_copy_ = false;
  publisher_ = options_.rank == 0 ? 0 : -1;
}

Result<Communicator*> IpcRankGroup::RankComm() const {
  auto* comm = dynamic_cast<Communicator*>(options_.comm.get());
  if (comm == nullptr) {
    return InvalidArgument("TrainerOptions::comm is not a wsync communicator: the ipc backend runs collectives "
                           "among the trainer ranks");
  }
  return comm;
}

Result<bool> IpcRankGroup::Ready(const Status& mine) {
  WSYNC_ASSIGN_OR_RETURN(Communicator * comm, RankComm());
  return AllRanksReady(*comm, mine, !up_, options_.rank, Deadline::InSeconds(options_.timeout_seconds));
}

Status IpcRankGroup::ReadPassFirst(SyncPass& pass, const IpcSession& session, ZeroCopyPlanner& zero_copy) const {
  return zero_copy.ReadPassFirst(pass, zero_copy_ && ipc_.mode == IpcTrainerOptions::Mode::kZeroCopy,
                                 publisher_ >= 0 && session.has_readers());
}

Status IpcRankGroup::Init(const PlaneInit& init, IpcSession& session) {
  Reset();
  WSYNC_ASSIGN_OR_RETURN(Communicator * group, RankComm());
  Communicator& comm = *group;
  const int rank = comm.rank(), ranks = comm.size();
  Deadline deadline = Deadline::InSeconds(options_.timeout_seconds);
  // 1. device keys (a rank that cannot name its device, or is misnumbered, fails all).
  json mine;
  {
    std::string key = HostDeviceKey();
    Status s = Status::Ok();
    if (rank != options_.rank) {
      s = InvalidArgument(fmt::format("TrainerOptions::rank {} is rank {} of TrainerOptions::comm", options_.rank,
                                      rank));
    } else if (!options_.device.is_cpu()) {
      s = UseDeviceOnThisThread(options_.device);
      if (s.ok()) {
        Result<std::string> k = IpcDeviceKey(options_.device);
        s = k.status();
        if (k.ok()) key = *k;
      }
    }
    mine = s.ok() ? json{{"key", key}} : StatusToJson(s);
  }
  WSYNC_ASSIGN_OR_RETURN(std::vector<std::string> gathered, AllGatherStrings(comm, mine.dump(), deadline));
  std::vector<std::string> keys(ranks);
  for (int r = 0; r < ranks; ++r) {
    json j = json::parse(gathered[r]);
    if (j.contains("error")) return StatusFromJson(j, fmt::format("trainer rank {} (its device key)", r));
    keys[r] = j["key"].get<std::string>();
  }
  const bool host = keys[0].starts_with("host-");
  std::vector<int> publisher_of(ranks, -1);
  int publishers = 0;
  std::map<std::string, int> by_key;
  for (int r = 0; r < ranks; ++r) {
    if (keys[r].starts_with("host-") ? r != 0 : host) continue;  // CPU: rank 0's host slots serve all
    auto [it, fresh] = by_key.emplace(keys[r], publishers);
    if (fresh) publisher_of[r] = publishers++;
  }

  // 2. rank 0's region.
  std::optional<IpcSession::Offer> offer;
  std::string created;
  if (rank == 0) {
    Result<IpcSession::Offer> o = session.Create(init, publishers);
    if (o.ok()) {
      created = json{{"path", o->region->path()}, {"session", o->region->session()}}.dump();
      offer = std::move(*o);
    } else {
      created = StatusToJson(o.status()).dump();
    }
  }
  WSYNC_ASSIGN_OR_RETURN(std::string got, BroadcastString(comm, created, 0, deadline));
  json region_json = json::parse(got);
  if (region_json.contains("error")) return StatusFromJson(region_json, rank == 0 ? "" : "trainer rank 0");

  // 3. the other publishers' slots.
  std::unique_ptr<IpcRegion> region;
  std::unique_ptr<DeviceExport> staging;
  json desc = json::object();
  if (rank != 0 && publisher_of[rank] > 0) {
    Status s = [&]() -> Status {
      WSYNC_ASSIGN_OR_RETURN(region, IpcRegion::OpenPublisher(region_json["path"].get<std::string>(),
                                                              region_json["session"].get<std::string>(),
                                                              publisher_of[rank]));
      IpcBufferDesc b{"none", 0, 0, json::object(), publisher_of[rank]};  // zero-copy only: no slots
      if (ipc_.mode != IpcTrainerOptions::Mode::kZeroCopy) {
        WSYNC_ASSIGN_OR_RETURN(staging, DeviceExport::Allocate(options_.device,
                                                               region->slot_stride() * region->num_slots(),
                                                               ipc_.export_kind));
        b = IpcBufferDesc{std::string(staging->kind()), 0, region->slot_stride(), staging->Handle(),
                          publisher_of[rank]};
      }
      desc = json{{"key", keys[rank]}, {"buffer", b.ToJson()}};
      return Status::Ok();
    }();
    if (!s.ok()) desc = StatusToJson(s);
  }
  WSYNC_ASSIGN_OR_RETURN(gathered, AllGatherStrings(comm, desc.dump(), deadline));

  // 4. rank 0 offers the merged map.
  std::string outcome;
  Status mine_status = Status::Ok();
  if (rank == 0) {
    mine_status = [&]() -> Status {
      for (int r = 1; r < ranks; ++r) {
        json j = json::parse(gathered[r]);
        if (j.contains("error")) {
          return StatusFromJson(j, fmt::format("trainer rank {} ({}) exporting its staging", r, keys[r]));
        }
        if (!j.contains("buffer")) continue;
        WSYNC_ASSIGN_OR_RETURN(IpcBufferDesc b, IpcBufferDesc::Parse(j["buffer"], keys[r], "trainer rank"));
        offer->info.buffers[keys[r]] = std::move(b);
      }
      return session.Open(std::move(*offer), *init.driver);
    }();
    outcome = mine_status.ok() ? "{}" : StatusToJson(mine_status).dump();
  }
  WSYNC_ASSIGN_OR_RETURN(got, BroadcastString(comm, outcome, 0, deadline));
  active_ = true;
  zero_copy_ = publishers > 1 && !host && ipc_.mode != IpcTrainerOptions::Mode::kPacked;
  if (rank == 0) {
    if (!mine_status.ok()) session.Close();
    up_ = mine_status.ok();
    return mine_status;
  }
  json result = json::parse(got);
  if (result.contains("error")) return StatusFromJson(result, "trainer rank 0 (ipc init)");
  up_ = true;
  publisher_ = publisher_of[rank];
  session.Join(std::move(region), std::move(staging), keys[rank]);
  if (session.region()) {
    WSYNC_LOG_INFO("init: trainer rank {} is publisher {} of ipc session {} on {} ({} reader(s) of its own)", rank,
                   publisher_, session.region()->session(), keys[rank], session.has_readers() ? "with" : "without");
  }
  return Status::Ok();
}

Result<GroupSync> IpcRankGroup::Exchange(SyncPass& pass, Status mine, const IpcSession& session,
                                         ZeroCopyPlanner& zero_copy) {
  WeightSource& source = pass.source();
  json j = json::object();
  if (mine.ok() && zero_copy_ && publisher_ >= 0 && session.has_readers()) {
    std::string why;
    std::optional<SourceStorage> storage = zero_copy.Exportable(source, &why);
    if (storage && !zero_copy.pass_read()) {
      if (zero_copy.Knows(*storage)) {
        zero_copy.UseLearned();
      } else {
        storage.reset();
        why = "where its tensors lie in its source's storage is not known yet (a packed sync learns it)";
      }
    }
    if (!storage) {
      j = json{{"zero_copy", false}, {"why", why}};
    } else {
      mine = UseDeviceOnThisThread(options_.device);
      if (mine.ok()) {
        Result<bool> changed = zero_copy.Export(zero_copy.sync_layout()->storage, publisher_);
        if (!changed.ok()) {
          mine = changed.status();
        } else {
          j = json{{"zero_copy", true}, {"key", session.device_key()}, {"layout", zero_copy.sync_layout()->Digest()},
                   {"changed", *changed}, {"buffer", zero_copy.exported().ToJson()}};
        }
      }
    }
  }
  if (!mine.ok()) j = StatusToJson(mine);
  WSYNC_ASSIGN_OR_RETURN(std::vector<std::string> all,
                         AllGatherStrings(*static_cast<Communicator*>(options_.comm.get()), j.dump(),
                                          Deadline::InSeconds(options_.timeout_seconds)));
  if (!mine.ok()) return mine;
  GroupSync g;
  g.zero_copy = zero_copy_;
  bool changed = false;
  std::string layout, why;
  int layout_rank = 0;
  for (size_t r = 0; r < all.size(); ++r) {
    json e = json::parse(all[r]);
    if (e.contains("error")) return StatusFromJson(e, fmt::format("trainer rank {}", r));
    if (!e.contains("zero_copy")) continue;
    if (!e["zero_copy"].get<bool>()) {
      g.zero_copy = false;
      why = fmt::format("trainer rank {}: {}", r, e["why"].get<std::string>());
      continue;
    }
    std::string l = e["layout"].get<std::string>();
    if (layout.empty()) {
      layout = l;
      layout_rank = static_cast<int>(r);
    } else if (l != layout) {
      g.zero_copy = false;
      why = fmt::format("trainer rank {}'s tensors lie at other offsets of its allocation than trainer rank {}'s",
                        r, layout_rank);
    }
    changed = changed || e["changed"].get<bool>();
    std::string key = e["key"].get<std::string>();
    WSYNC_ASSIGN_OR_RETURN(g.buffers[key], IpcBufferDesc::Parse(e["buffer"], key, "trainer rank"));
  }
  if (changed) zero_copy.NewGeneration();
  if (zero_copy_ && !g.zero_copy) {
    if (ipc_.mode == IpcTrainerOptions::Mode::kZeroCopy) {
      return FailedPrecondition(fmt::format("ipc mode zero_copy, but {}", why));
    }
    WSYNC_LOG_DEBUG("sync packs: {}", why);
  }
  return g;
}

}  // namespace wsync
