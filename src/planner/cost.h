// The cost model: what one sync of each backend costs on a fleet, from the engine's own plans.
//
// Prediction knows no backend by name: it asks the registry (src/backends/descriptor.h)
// for the backends that carry a cost hook (BackendDescriptor::cost, in each backend's
// folder), prepares the model on the fleet once for all of them (planner/cost_model.h,
// which also lists the assumptions every prediction makes) and runs each hook over it.
// Pure functions; thread-safe.
#pragma once

#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "backends/descriptor.h"
#include "model/config.h"
#include "planner/calibration.h"
#include "planner/cost_model.h"
#include "planner/fleet.h"
#include "wsync/status.h"

namespace wsync::planner {

// The backends `wsync plan` predicts: every registered one with a cost hook, ordered by
// CostHook::plan_order.
const std::vector<const BackendDescriptor*>& PlannedBackends();

// What `backend`'s cost hook reads of `options`, as a published case shows it after the
// backend's name: "sharded (lookahead 1, stages in turn)", "ipc (packed)", "nccl".
std::string BackendWithOptions(const BackendDescriptor& backend, const PlanOptions& options);

// One sync of the backend named `backend`; InvalidArgument for a name that is no backend
// or one without a cost hook.
Result<Prediction> Predict(const ModelConfig& model, const Fleet& fleet, std::string_view backend,
                           const PlanOptions& options, const Constants& k);

// Predict() for each of `backends` in order, preparing the model on the fleet (its
// tensors, the workers' shard sizes, the trainer's owners and, where a hook reads them,
// the workers' consumer plans) once for all of them.
Result<std::vector<Prediction>> PredictEach(const ModelConfig& model, const Fleet& fleet,
                                            std::span<const BackendDescriptor* const> backends,
                                            const PlanOptions& options, const Constants& k);

}  // namespace wsync::planner
