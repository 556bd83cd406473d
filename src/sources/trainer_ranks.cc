#include "sources/trainer_ranks.h"

#include "comm/gloo_communicator.h"

namespace wsync {

Result<std::shared_ptr<Communicator>> ConnectTrainerGroup(const TrainerGroupOptions& options,
                                                          const ParallelLayout& layout, int rank) {
  GlooOptions g;
  g.store_host = options.store_host;
  g.store_port = options.store_port;
  g.prefix = options.prefix;
  g.rank = rank;
  g.size = layout.world;
  g.bind_host = options.store_host;
  g.connect_deadline = Deadline::InSeconds(options.timeout_seconds);
  g.op_timeout = std::chrono::milliseconds(static_cast<int64_t>(options.timeout_seconds * 1000));
  g.describe_rank = [layout](int r) { return layout.Describe(r); };
  WSYNC_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> comm, ConnectGloo(g));
  return std::shared_ptr<Communicator>(std::move(comm));
}

Result<std::unique_ptr<WeightSource>> BuildRankSource(std::shared_ptr<Communicator> comm,
                                                      const ParallelLayout& layout,
                                                      const ModelConfig* config,
                                                      const std::vector<HostTensor>& full,
                                                      double timeout_seconds) {
  SourceOptions o;
  o.timeout_seconds = timeout_seconds;
  o.describe_rank = [layout](int r) { return layout.Describe(r); };
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
