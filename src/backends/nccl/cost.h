// The `nccl` backend's cost hook (BackendDescriptor::cost, src/backends/descriptor.h):
// trainer rank 0 gathers the model and broadcasts vLLM's packed chunks
// (plan/packing.h) to every worker; on CPU-only hosts a Gloo chain over loopback.
// The shared arithmetic and the assumptions every backend's prediction makes are in
// src/planner/cost_model.h. Pure functions; thread-safe.
#pragma once

#include <string>

#include "planner/cost_model.h"

namespace wsync {

// Fills `p` for one sync of `nccl` on `input.fleet`.
Status PredictNcclCost(const planner::CostInput& input, planner::Prediction& p);

}  // namespace wsync
