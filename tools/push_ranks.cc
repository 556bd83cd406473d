#include "push_ranks.h"

#include <random>
#include <thread>

#include <fmt/format.h>

#include "comm/store.h"
#include "sources/trainer_ranks.h"

namespace wsync::cli {

struct TrainerRanks::Impl {
  std::unique_ptr<StoreServer> store;
};

TrainerRanks::~TrainerRanks() = default;

Result<std::unique_ptr<TrainerRanks>> TrainerRanks::Start(int ranks, const std::string& layout_text,
                                                          const ModelConfig* config,
                                                          const std::vector<HostTensor>& full,
                                                          const TrainerOptions& options) {
  WSYNC_ASSIGN_OR_RETURN(ParallelLayout layout, ParallelLayout::Parse(layout_text, ranks));
  std::unique_ptr<TrainerRanks> t(new TrainerRanks());
  t->impl_ = std::make_unique<Impl>();
  WSYNC_ASSIGN_OR_RETURN(t->impl_->store, StoreServer::Start("127.0.0.1", 0));
  TrainerGroupOptions g;
  g.store_port = t->impl_->store->port();
  g.prefix = fmt::format("trainer-{:x}", std::random_device{}());
  g.timeout_seconds = options.timeout_seconds;
  t->sources_.resize(ranks);
  t->engines_.resize(ranks);
  std::vector<Status> status(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      status[r] = [&]() -> Status {
        WSYNC_ASSIGN_OR_RETURN(auto comm, ConnectTrainerGroup(g, layout, r));
        WSYNC_ASSIGN_OR_RETURN(t->sources_[r], BuildRankSource(comm, layout, config, full, options.timeout_seconds));
        if (r == 0) return Status::Ok();
        TrainerOptions o = options;
        o.rank = r;
        o.progress = nullptr;
        WSYNC_ASSIGN_OR_RETURN(t->engines_[r], CreateTrainerEngine(o));
        return t->engines_[r]->Init(t->sources_[r]->metadata());
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

Result<SyncStats> TrainerRanks::Sync(TrainerEngine& sender, const std::optional<std::string>& version) {
  const size_t n = sources_.size();
  std::vector<Status> status(n);
  std::vector<std::thread> threads;
  for (size_t r = 1; r < n; ++r) {
    threads.emplace_back([&, r] { status[r] = engines_[r]->SendWeights(*sources_[r], version).status(); });
  }
  Result<SyncStats> stats = sender.SendWeights(*sources_[0], version);
  for (auto& th : threads) th.join();
  if (!stats.ok()) return stats.status();
  for (size_t r = 1; r < n; ++r) {
    if (!status[r].ok()) return status[r];
  }
  return stats;
}

}  // namespace wsync::cli
