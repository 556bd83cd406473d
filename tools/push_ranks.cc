#include "push_ranks.h"

#include <random>
#include <thread>

#include <fmt/format.h>

#include "backends/descriptor.h"
#include "comm/store.h"
#include "core/log.h"
#include "sources/trainer_ranks.h"

namespace wsync::cli {

struct TrainerRanks::Impl {
  std::unique_ptr<StoreServer> store;
  ParallelLayout layout;
  std::vector<std::shared_ptr<TrainerGroup>> groups;  // by rank
};

TrainerRanks::~TrainerRanks() = default;

Result<std::unique_ptr<TrainerRanks>> TrainerRanks::Start(int ranks, const std::string& layout_text,
                                                          const ModelConfig* config,
                                                          const std::vector<HostTensor>& full,
                                                          const TrainerOptions& options) {
  WSYNC_ASSIGN_OR_RETURN(ParallelLayout layout, ParallelLayout::Parse(layout_text, ranks));
  std::unique_ptr<TrainerRanks> t(new TrainerRanks());
  t->impl_ = std::make_unique<Impl>();
  t->impl_->layout = layout;
  WSYNC_ASSIGN_OR_RETURN(t->impl_->store, StoreServer::Start("127.0.0.1", 0));
  TrainerGroupOptions g;
  g.store_port = t->impl_->store->port();
  g.prefix = fmt::format("trainer-{:x}", std::random_device{}());
  g.timeout_seconds = options.timeout_seconds;
  t->sources_.resize(ranks);
  t->engines_.resize(ranks);
  t->impl_->groups.resize(ranks);
  std::vector<Status> status(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      status[r] = [&]() -> Status {
        WSYNC_ASSIGN_OR_RETURN(t->impl_->groups[r], TrainerGroup::Connect(g, layout, r));
        WSYNC_ASSIGN_OR_RETURN(t->sources_[r], BuildRankSource(*t->impl_->groups[r], layout, config, full,
                                                               options.timeout_seconds));
        TrainerOptions o = options;
        o.rank = r;
        if (r != 0) o.progress = nullptr;
        const BackendDescriptor* backend = FindBackend(o.backend);
        if (backend != nullptr && backend->trainer_group == TrainerGroupUse::kAlways) {
          o.comm = t->impl_->groups[r]->comm();
        }
        WSYNC_ASSIGN_OR_RETURN(t->engines_[r], CreateTrainerEngine(o));
        Status s = t->engines_[r]->Init(*t->sources_[r]);
        // A rank whose Init failed stops the group, so that ranks waiting on it in a
        // collective of Init fail at once.
        if (!s.ok()) t->impl_->groups[r]->Stop(s);
        return s;
      }();
    });
  }
  for (auto& th : threads) th.join();
  for (int r = 0; r < ranks; ++r) {
    if (!status[r].ok()) return status[r].WithContext(fmt::format("starting {}", layout.Describe(r)));
  }
  return t;
}

Status TrainerRanks::Refresh(const std::vector<HostTensor>& full) {
  for (auto& s : sources_) WSYNC_RETURN_IF_ERROR(RefreshRankSource(*s, full));
  return Status::Ok();
}

Result<SyncStats> TrainerRanks::Sync(const std::optional<std::string>& version) {
  const size_t n = sources_.size();
  std::vector<Status> status(n);
  std::vector<std::thread> threads;
  // A rank that fails stops its group, so the ranks still in their sources' collectives
  // fail at once, naming it and its cause, instead of waiting out the timeout.
  for (size_t r = 1; r < n; ++r) {
    threads.emplace_back([&, r] {
      status[r] = engines_[r]->SendWeights(*sources_[r], version).status();
      if (!status[r].ok()) impl_->groups[r]->Stop(status[r]);
    });
  }
  Result<SyncStats> stats = engines_[0]->SendWeights(*sources_[0], version);
  if (!stats.ok()) impl_->groups[0]->Stop(stats.status());
  for (auto& th : threads) th.join();
  // One error goes up; the other ranks' are logged here, where they are decided.
  status[0] = stats.status();
  size_t first = n;
  for (size_t r = 0; r < n && first == n; ++r) {
    if (!status[r].ok()) first = r;
  }
  if (first == n) return stats;
  for (size_t r = 0; r < n; ++r) {
    if (r == first || status[r].ok()) continue;
    WSYNC_LOG_WARN("{} failed too: {}", impl_->layout.Describe(static_cast<int>(r)), status[r].ToString());
  }
  return status[first];
}

}  // namespace wsync::cli
