#include "planner/cost.h"

#include <algorithm>

#include <fmt/format.h>

namespace wsync::planner {

const std::vector<const BackendDescriptor*>& PlannedBackends() {
  static const std::vector<const BackendDescriptor*> kPlanned = [] {
    std::vector<const BackendDescriptor*> out;
    for (const BackendDescriptor* b : Backends()) {
      if (b->cost.predict != nullptr) out.push_back(b);
    }
    std::stable_sort(out.begin(), out.end(), [](const BackendDescriptor* a, const BackendDescriptor* b) {
      return a->cost.plan_order < b->cost.plan_order;
    });
    return out;
  }();
  return kPlanned;
}

std::string BackendWithOptions(const BackendDescriptor& backend, const PlanOptions& options) {
  std::string out(backend.name);
  const std::string shown = backend.cost.describe_options ? backend.cost.describe_options(options) : "";
  if (!shown.empty()) out += fmt::format(" ({})", shown);
  return out;
}

Result<Prediction> Predict(const ModelConfig& model, const Fleet& fleet, std::string_view backend,
                           const PlanOptions& options, const Constants& k) {
  WSYNC_ASSIGN_OR_RETURN(const BackendDescriptor* b, LookupBackend(backend));
  WSYNC_ASSIGN_OR_RETURN(std::vector<Prediction> p, PredictEach(model, fleet, {&b, 1}, options, k));
  return std::move(p.front());
}

Result<std::vector<Prediction>> PredictEach(const ModelConfig& model, const Fleet& fleet,
                                            std::span<const BackendDescriptor* const> backends,
                                            const PlanOptions& options, const Constants& k) {
  for (const BackendDescriptor* b : backends) {
    if (b->cost.predict == nullptr) return InvalidArgument(fmt::format("backend '{}' has no cost model", b->name));
  }
  if (options.bucket_bytes < 1 || options.lookahead < 0) {
    WSYNC_RETURN_IF_ERROR(CheckFleet(model, fleet));
    return InvalidArgument("bucket must be positive and lookahead not negative");
  }
  const bool with_plans = std::any_of(backends.begin(), backends.end(), [&](const BackendDescriptor* b) {
    return b->cost.reads_plans != nullptr && b->cost.reads_plans(fleet);
  });
  WSYNC_ASSIGN_OR_RETURN(PreparedModel m, PrepareModel(model, fleet, with_plans));
  const CostInput input{m, model, fleet, options, k};
  std::vector<Prediction> out;
  for (const BackendDescriptor* b : backends) {
    Prediction& p = out.emplace_back();
    p.backend = b->name;
    WSYNC_RETURN_IF_ERROR(b->cost.predict(input, p));
  }
  return out;
}

}  // namespace wsync::planner
