// The `ipc` backend's cost hook (BackendDescriptor::cost, src/backends/descriptor.h):
// every GPU's publisher packs the model into slots its colocated worker
// reads (or, with one trainer rank, offers its tensors zero-copy); on CPU hosts a slot ring.
// The shared arithmetic and the assumptions every backend's prediction makes are in
// src/planner/cost_model.h. Pure functions; thread-safe.
#pragma once

#include <string>

#include "planner/cost_model.h"

namespace wsync {

// Fills `p` for one sync of `ipc` on `input.fleet`.
Status PredictIpcCost(const planner::CostInput& input, planner::Prediction& p);
// `packed` when options.ipc_packed, else empty: the published table's note after the name.
std::string DescribeIpcCostOptions(const planner::PlanOptions& options);

}  // namespace wsync
