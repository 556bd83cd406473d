// The `sharded` backend's cost hook (BackendDescriptor::cost, src/backends/descriptor.h):
// every trainer rank sends each worker its chunks (plan/sharded_plan.h,
// PlanConsumer / PlanProducer over the sharding tables and the trainer's owners), layer
// group by layer group.
// The shared arithmetic and the assumptions every backend's prediction makes are in
// src/planner/cost_model.h. Pure functions; thread-safe.
#pragma once

#include <string>

#include "planner/cost_model.h"

namespace wsync {

// Fills `p` for one sync of `sharded` on `input.fleet`.
Status PredictShardedCost(const planner::CostInput& input, planner::Prediction& p);
// Whether the hook reads the workers' consumer plans on `fleet`: where it is modeled
// (GPUs on both sides).
bool ShardedCostReadsPlans(const planner::Fleet& fleet);
// "lookahead N", with ", stages in turn" when pipeline stages take turns.
std::string DescribeShardedCostOptions(const planner::PlanOptions& options);

}  // namespace wsync
