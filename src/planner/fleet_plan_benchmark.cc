// The sharded trainer's own planning of a fleet (not a test): every consumer's plan with
// its digest and one rank's sends, as the engine does at init.
//
//   fleet_plan_benchmark MODEL TRAINER SERVERS [per-consumer|shapes] [RANK]
//   fleet_plan_benchmark kimi-k2 tp8pp8ep32:256 '4x(32,1,1)' shapes 0
//
// per-consumer plans every consumer on its own (PlanConsumer with digest, then
// PlanProducer over them); shapes is PlanFleet. Prints wall seconds, the growth of the
// peak RSS, and a digest of the outcome (every consumer digest and the rank's sends), equal
// for both modes. Server specs with ep > 1 are planned as TP-only (the engine's tables).
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <string>

#include <fmt/format.h>

#include "core/digest.h"
#include "model/config.h"
#include "model/sharding.h"
#include "plan/fleet_plan.h"
#include "plan/sharded_plan.h"
#include "planner/fleet.h"
#include "sources/groups.h"

namespace wsync {
namespace {

long PeakRssKb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss;
}

int Main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s MODEL TRAINER SERVERS [per-consumer|shapes] [RANK]\n", argv[0]);
    return 2;
  }
  const std::string mode = argc > 4 ? argv[4] : "shapes";
  const int rank = argc > 5 ? std::stoi(argv[5]) : 0;
  Result<ModelConfig> config = LookupModel(argv[1]);
  Result<planner::TrainerSpec> trainer = planner::ParseTrainerSpec(argv[2]);
  Result<planner::ServerSpec> servers = planner::ParseServerSpec(argv[3]);
  if (!config.ok() || !trainer.ok() || !servers.ok()) {
    std::fprintf(stderr, "bad arguments\n");
    return 2;
  }
  std::shared_ptr<const HfCatalog> catalog = *HfCatalog::Make(*config);
  ShardedStream stream;
  stream.tensors = catalog->tensors();
  std::vector<std::string> names;
  for (const TensorMeta& t : stream.tensors) names.push_back(t.name);
  for (const LayerGroup& g : *LayerGroups(names)) stream.group_lens.push_back(static_cast<int>(g.size()));
  Result<Ownership> own = planner::TrainerOwnership(*catalog, *trainer);
  if (!own.ok()) {
    std::fprintf(stderr, "%s\n", own.status().ToString().c_str());
    return 1;
  }
  stream.ownership = std::move(*own);
  stream.num_producers = trainer->world;
  const int per = servers->workers_per_deployment();
  std::vector<FleetDeployment> deployments;
  for (int d = 0; d < servers->count; ++d) deployments.push_back({servers->tp, per, d * per, false});
  const int groups = static_cast<int>(stream.group_lens.size());
  const long rss0 = PeakRssKb();

  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::string> digests;
  ProducerPlan producer;
  size_t plans_kept = 0;
  if (mode == "per-consumer") {
    StreamIndex index = *IndexStream(stream, catalog);
    std::vector<std::unique_ptr<ShardingTable>> tables;
    std::vector<ConsumerPlan> plans;
    for (const FleetDeployment& d : deployments) {
      for (int j = 0; j < d.workers; ++j) {
        if (j < d.tp && d.first_consumer == 0) tables.push_back(std::make_unique<ShardingTable>(
                                                  *ShardingTable::Build(catalog, j, d.tp)));
        Result<ConsumerPlan> plan = PlanConsumer(stream, index, *tables[j % d.tp], {d.first_consumer + j, j, d.workers});
        if (!plan.ok()) {
          std::fprintf(stderr, "%s\n", plan.status().ToString().c_str());
          return 1;
        }
        digests.push_back(plan->digest);
        plans.push_back(std::move(*plan));
      }
    }
    producer = PlanProducer(rank, groups, plans);
    plans_kept = plans.size();
  } else {
    Result<FleetPlans> plans = PlanFleet(stream, catalog, deployments, rank == 0, rank);
    if (!plans.ok()) {
      std::fprintf(stderr, "%s\n", plans.status().ToString().c_str());
      return 1;
    }
    digests = plans->digests;
    producer = plans->Producer(rank, groups);
    plans_kept = plans->shapes.size();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::string outcome;
  if (rank == 0) {
    for (const std::string& d : digests) outcome += d + "\n";
  }
  for (const auto& sends : producer.by_group) {
    for (const ProducerSend& s : sends) {
      outcome += fmt::format("{} {} {}\n", s.group, s.bytes, s.consumers.size());
      for (size_t i = 0; i < s.consumers.size(); ++i) outcome += fmt::format("{}:{} ", s.consumers[i], s.chunks[i]);
    }
  }
  std::printf("%s %s -> %s, %s, rank %d: %zu consumers, %zu plans kept, %.3f s, peak RSS +%.0f MB, "
              "staging %.1f MB, outcome %s\n",
              argv[1], argv[2], argv[3], mode.c_str(), rank, deployments.size() * static_cast<size_t>(per), plans_kept,
              seconds, static_cast<double>(PeakRssKb() - rss0) / 1024.0,
              static_cast<double>(producer.max_group_bytes) / 1e6,
              HexDigest(DigestAlgorithm::kSha256, std::as_bytes(std::span(outcome))).substr(0, 16).c_str());
  return 0;
}

}  // namespace
}  // namespace wsync

int main(int argc, char** argv) { return wsync::Main(argc, argv); }
