#include "plan/fleet_plan.h"

#include <map>
#include <tuple>
#include <utility>

#include <fmt/format.h>

namespace wsync {

ProducerPlan FleetPlans::Producer(int producer, int num_groups) const {
  return PlanProducer(producer, num_groups, shapes, shape_consumers);
}

Result<FleetPlans> PlanFleet(const ShardedStream& stream, std::shared_ptr<const HfCatalog> catalog,
                             const std::vector<FleetDeployment>& deployments, bool digests, int keep_producer) {
  FleetPlans out;
  WSYNC_ASSIGN_OR_RETURN(StreamIndex index, IndexStream(stream, catalog, "the trainer's stream"));
  int consumers = 0;
  for (const FleetDeployment& d : deployments) {
    if (d.tp < 1 || d.workers < 1 || d.workers % d.tp != 0 || d.first_consumer != consumers) {
      return InvalidArgument(fmt::format("deployment of {} workers at tp {} from consumer {}: expected workers a "
                                         "multiple of tp >= 1, numbered from {}",
                                         d.workers, d.tp, d.first_consumer, consumers));
    }
    consumers += d.workers;
  }
  // The shapes and their consumers, numbered in order of their first consumer.
  using TableKey = std::tuple<int, int, bool>;  // tp, tp rank, drafter
  struct Shape {
    TableKey table;
    ConsumerSpot spot;  // its first consumer's
  };
  std::vector<Shape> shapes;
  std::map<std::tuple<int, bool, int, int>, int> shape_ids;  // tp, drafter, block index, block size
  out.shape_of.assign(static_cast<size_t>(consumers), -1);
  for (const FleetDeployment& d : deployments) {
    for (int j = 0; j < d.workers; ++j) {
      const ConsumerSpot spot{d.first_consumer + j, j, d.workers};
      auto [it, fresh] = shape_ids.try_emplace(std::make_tuple(d.tp, d.drafter, j, d.workers),
                                               static_cast<int>(shapes.size()));
      if (fresh) {
        shapes.push_back(Shape{TableKey{d.tp, j % d.tp, d.drafter}, spot});
        out.shape_consumers.emplace_back();
      }
      out.shape_of[static_cast<size_t>(spot.consumer)] = it->second;
      out.shape_consumers[static_cast<size_t>(it->second)].push_back(spot.consumer);
    }
  }
  // Table by table, so that one table is alive at a time: its shapes are planned,
  // digested and trimmed to what the kept producer packs, then it goes.
  std::map<TableKey, std::vector<int>> shapes_of_table;
  for (size_t k = 0; k < shapes.size(); ++k) shapes_of_table[shapes[k].table].push_back(static_cast<int>(k));
  out.shapes.resize(shapes.size());
  out.runs.resize(shapes.size());
  if (digests) out.digests.resize(static_cast<size_t>(consumers));
  for (const auto& [key, members] : shapes_of_table) {
    const auto [tp, tp_rank, drafter] = key;
    Result<ShardingTable> built =
        ShardingTable::Build(catalog, tp_rank, tp, {}, drafter ? Drafter::kMtp : Drafter::kNone);
    if (!built.ok()) {
      return built.status().WithContext(fmt::format("consumer {}", shapes[members.front()].spot.consumer));
    }
    const ShardingTable& table = *built;
    for (int k : members) {
      Result<ConsumerPlan> plan = PlanConsumer(stream, index, table, shapes[k].spot, digests);
      if (!plan.ok()) return plan.status();
      plan->digest.clear();
      std::vector<std::vector<PieceRuns>>& runs = out.runs[static_cast<size_t>(k)];
      runs.resize(plan->chunks.size());
      for (size_t c = 0; c < plan->chunks.size(); ++c) {
        PlanChunk& chunk = plan->chunks[c];
        if (keep_producer >= 0 && chunk.producer != keep_producer) {
          chunk.slices = {};
          continue;
        }
        runs[c].reserve(chunk.slices.size());
        for (const PlanSlice& slice : chunk.slices) runs[c].push_back(table.Runs(slice.param, slice.piece));
      }
      const std::vector<int>& members_of_shape = out.shape_consumers[static_cast<size_t>(k)];
      out.fleet_bytes += plan->bytes() * members_of_shape.size();
      out.fleet_chunks += plan->chunks.size() * members_of_shape.size();
      if (digests) {
        for (int consumer : members_of_shape) {
          const ConsumerSpot spot{consumer, shapes[k].spot.block_index, shapes[k].spot.block_size};
          out.digests[static_cast<size_t>(consumer)] =
              ConsumerDigest(plan->body_digest, spot, plan->tp_rank, plan->tp_size);
        }
      }
      out.shapes[static_cast<size_t>(k)] = std::move(*plan);
    }
  }
  return out;
}

}  // namespace wsync
