// The `delta` backend's cost hook (BackendDescriptor::cost, src/backends/descriptor.h):
// the publisher's compressed payload, fetched and applied on every
// server node, then reloaded into the shards.
// The shared arithmetic and the assumptions every backend's prediction makes are in
// src/planner/cost_model.h. Pure functions; thread-safe.
#pragma once

#include <string>

#include "planner/cost_model.h"

namespace wsync {

// Fills `p` for one sync of `delta` on `input.fleet`.
Status PredictDeltaCost(const planner::CostInput& input, planner::Prediction& p);

}  // namespace wsync
