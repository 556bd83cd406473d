#include "sources/trainer_ranks.h"

#include <algorithm>
#include <string>

#include <fmt/format.h>

#include "comm/gloo_communicator.h"
#include "comm/store.h"

namespace wsync {
namespace {

// Store waits of the stop board: short, because they run on failure paths.
constexpr double kBoardSeconds = 2;
// Longest cause kept on the board.
constexpr size_t kMaxCauseBytes = 4096;

}  // namespace

struct TrainerGroup::Board {
  StoreClient client;
  int rank = 0;
  int world = 1;
  DescribeRank describe;

  Status PeerStopped() const {
    std::vector<std::string> keys;
    for (int r = 0; r < world; ++r) {
      if (r != rank) keys.push_back(std::to_string(r));
    }
    if (keys.empty()) return Status::Ok();
    Deadline deadline = Deadline::InSeconds(kBoardSeconds);
    Result<std::vector<std::string>> missing = client.Missing(keys, deadline);
    if (!missing.ok() || missing->size() == keys.size()) return Status::Ok();
    for (const std::string& key : keys) {
      if (std::find(missing->begin(), missing->end(), key) != missing->end()) continue;
      Result<std::vector<char>> cause = client.Get(key, deadline);
      if (!cause.ok()) return Status::Ok();
      return Aborted(fmt::format("{} stopped: {}", describe(std::stoi(key)),
                                 std::string(cause->begin(), cause->end())));
    }
    return Status::Ok();
  }
};

Result<std::shared_ptr<TrainerGroup>> TrainerGroup::Connect(const TrainerGroupOptions& options,
                                                            const ParallelLayout& layout, int rank) {
  GlooOptions g;
  g.store_host = options.store_host;
  g.store_port = options.store_port;
  g.prefix = options.prefix;
  g.rank = rank;
  g.size = layout.world;
  g.bind_host = options.bind_host.empty() ? options.store_host : options.bind_host;
  g.connect_deadline = Deadline::InSeconds(options.timeout_seconds);
  g.op_timeout = std::chrono::milliseconds(static_cast<int64_t>(options.timeout_seconds * 1000));
  g.describe_rank = [layout](int r) { return layout.Describe(r); };
  WSYNC_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> comm, ConnectGloo(g));
  std::shared_ptr<TrainerGroup> group(new TrainerGroup());
  group->comm_ = std::move(comm);
  group->board_ = std::make_shared<const Board>(
      Board{StoreClient(options.store_host, options.store_port, options.prefix + "/stop"), rank,
            layout.world, g.describe_rank});
  return group;
}

void TrainerGroup::Stop(const Status& cause) {
  // A failure caused by a peer's stop is not a new cause: keep the board's first one.
  if (PeerStopped().ok()) {
    std::string why = cause.ok() ? "stopped without an error" : cause.message();
    if (why.size() > kMaxCauseBytes) why = why.substr(0, kMaxCauseBytes) + "...";
    // Posted before the abort, so a peer woken by the closed connections finds it.
    (void)board_->client.Set(std::to_string(rank()), std::vector<char>(why.begin(), why.end()),
                             Deadline::InSeconds(kBoardSeconds));
  }
  comm_->Abort();
}

Status TrainerGroup::PeerStopped() const { return board_->PeerStopped(); }

std::function<Status()> TrainerGroup::PeerStoppedFn() const {
  return [board = board_] { return board->PeerStopped(); };
}

Result<std::shared_ptr<Communicator>> ConnectTrainerGroup(const TrainerGroupOptions& options,
                                                          const ParallelLayout& layout, int rank) {
  WSYNC_ASSIGN_OR_RETURN(std::shared_ptr<TrainerGroup> group, TrainerGroup::Connect(options, layout, rank));
  return group->comm();
}

Result<std::unique_ptr<WeightSource>> BuildRankSource(std::shared_ptr<Communicator> comm,
                                                      const ParallelLayout& layout,
                                                      const ModelConfig* config,
                                                      const std::vector<HostTensor>& full,
                                                      double timeout_seconds,
                                                      std::function<Status()> peer_stopped) {
  SourceOptions o;
  o.timeout_seconds = timeout_seconds;
  o.describe_rank = [layout](int r) { return layout.Describe(r); };
  o.peer_stopped = std::move(peer_stopped);
  const int rank = comm->rank();
  if (layout.fsdp) {
    std::vector<TensorMeta> meta;
    for (const HostTensor& t : full) meta.push_back(t.meta);
    WSYNC_ASSIGN_OR_RETURN(auto shards, FsdpShards(full, rank, layout.world));
    WSYNC_ASSIGN_OR_RETURN(auto s, FsdpSource::Create(std::move(comm), std::move(meta), std::move(shards), o));
    return std::unique_ptr<WeightSource>(std::move(s));
  }
  if (config == nullptr) return InvalidArgument("a Megatron layout needs the model's config (--model)");
  WSYNC_ASSIGN_OR_RETURN(MegatronLayout table, MegatronLayout::Build(*config, layout));
  auto shared = std::make_shared<const MegatronLayout>(std::move(table));
  WSYNC_ASSIGN_OR_RETURN(auto params, LayOutMegatron(*shared, rank, full));
  WSYNC_ASSIGN_OR_RETURN(auto s, MegatronSource::Create(std::move(comm), shared, std::move(params), o));
  return std::unique_ptr<WeightSource>(std::move(s));
}

Result<std::unique_ptr<WeightSource>> BuildRankSource(const TrainerGroup& group,
                                                      const ParallelLayout& layout,
                                                      const ModelConfig* config,
                                                      const std::vector<HostTensor>& full,
                                                      double timeout_seconds) {
  return BuildRankSource(group.comm(), layout, config, full, timeout_seconds, group.PeerStoppedFn());
}

Status RefreshRankSource(WeightSource& source, const std::vector<HostTensor>& full) {
  if (auto* f = dynamic_cast<FsdpSource*>(&source)) {
    return FsdpShardsInto(full, f->rank(), f->world(), f->shards());
  }
  if (auto* m = dynamic_cast<MegatronSource*>(&source)) {
    return LayOutMegatronInto(m->layout(), m->rank(), full, m->params());
  }
  return InvalidArgument("RefreshRankSource: not a source built by BuildRankSource");
}

}  // namespace wsync
