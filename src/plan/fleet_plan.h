// The `sharded` trainer's plans of a whole fleet: every consumer's plan, each rank's
// sends, and (on the rank that sends init_info) every consumer's plan digest.
//
// A consumer's plan body depends only on its table (tp, tp rank, drafter) and its place
// in its block (block index, block size), never on its fleet-global id: replicas of one
// deployment shape pull the same slices from the same producers. So each distinct
// (table, block index, block size) is planned, and its body digested, once: a fleet of R
// replicas of a T-worker shape costs T plans, not R*T. The consumers' own digests
// follow from the body digest (ConsumerDigest), so they equal what each server computes
// for its workers with PlanConsumer.
//
// Pure functions and immutable results; thread-safe.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "model/sharding.h"
#include "plan/sharded_plan.h"
#include "wsync/status.h"

namespace wsync {

// One server of the fleet, as the trainer plans it: `workers` consumers with ids
// first_consumer.. first_consumer + workers - 1; worker j has TP rank j % tp.
struct FleetDeployment {
  int tp = 1;
  int workers = 1;
  int first_consumer = 0;
  bool drafter = false;  // its workers hold an MTP drafter
};

struct FleetPlans {
  // One plan per distinct (tp, tp rank, drafter, block index, block size): a SHAPE. A
  // shape's plan has `consumer` set to its first consumer and an empty digest; chunks
  // of producers other than the kept one have their sizes but no slices.
  std::vector<ConsumerPlan> shapes;
  // By shape, chunk, slice: where the slice's bytes lie in its HF tensor (the table's
  // PieceRuns), for the kept producer's chunks (other chunks: empty). The tables
  // themselves are gone once their shapes are planned.
  std::vector<std::vector<std::vector<PieceRuns>>> runs;
  std::vector<std::vector<int>> shape_consumers;                  // by shape: ids, ascending
  std::vector<int> shape_of;                                      // by consumer id
  std::vector<std::string> digests;  // by consumer id; empty unless PlanFleet was asked
  size_t fleet_bytes = 0;            // every consumer's plan bytes, summed
  size_t fleet_chunks = 0;           // every consumer's chunks, summed

  // This producer's sends over the whole fleet (PlanProducer over every consumer's plan;
  // ProducerSend::plan indexes `shapes`): the kept producer's, or any when all are kept.
  ProducerPlan Producer(int producer, int num_groups) const;
};

// Plans every consumer of `deployments` (numbered without gaps from 0, in order) over
// `stream`, whose tensors must belong to `catalog`'s model. `digests`: fill
// FleetPlans::digests. `keep_producer` >= 0: keep the slices and runs of that trainer
// rank's chunks only, which is all Producer(keep_producer) and packing need; -1 keeps
// every chunk's. At most one table is alive at a time. Errors as PlanConsumer's, and ShardingTable::Build's naming a consumer.
Result<FleetPlans> PlanFleet(const ShardedStream& stream, std::shared_ptr<const HfCatalog> catalog,
                             const std::vector<FleetDeployment>& deployments, bool digests,
                             int keep_producer = -1);

}  // namespace wsync
