// Published cases: fleets whose sync times were published, and wsync's own measured runs,
// each with the fleet the planner is given and the figure it is compared with.
//
// RenderComparison() plans every case with the shipped hardware profiles and the
// calibration, and returns docs/plan.md's table (markdown) plus, per case, its
// assumptions; ComparisonCsv() the same numbers for tools/plot_plan.py. No constant is
// set per case: a case only chooses the fleet, backend and options its source describes.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "planner/calibration.h"
#include "planner/cost.h"
#include "wsync/status.h"

namespace wsync::planner {

struct PublishedCase {
  std::string id;          // "rdt-qwen3-235b-pipelined"
  std::string title;       // what was measured
  std::string source;      // where the figure was published (or docs/benchmarks.md)
  bool own = false;        // one of wsync's own runs
  std::string model;
  std::string trainer;     // --trainer
  std::string servers;     // --servers
  Placement placement = Placement::kDisaggregated;
  const BackendDescriptor* backend = nullptr;  // a registered backend with a cost hook
  PlanOptions options;
  bool fp8 = false;
  double published_lo = 0, published_hi = 0;  // seconds (a range, or lo == hi)
  std::string authors_bottleneck;             // as the source names it ("" if not named)
  bool fully_described = true;                // the setup is described enough to predict
  std::string notes;                          // assumptions and mapping onto wsync's backend
};

const std::vector<PublishedCase>& PublishedCases();

struct CaseResult {
  const PublishedCase* c = nullptr;
  Prediction prediction;
  double plan_seconds = 0;  // wall time the planner took
  // (predicted - published) / published against the nearer end of the published range.
  double error = 0;
};

Result<std::vector<CaseResult>> RunPublishedCases(const Constants& k, const std::string& hardware_dir);

std::string RenderComparison(const std::vector<CaseResult>& results);
std::string ComparisonCsv(const std::vector<CaseResult>& results);

// docs/plan.md keeps each generated block between two marker lines,
// "<!-- BEGIN <name> -->" and "<!-- END <name> -->" (name: "wsync plan --calibrate",
// "wsync plan --published"). SpliceBlock returns `doc` with the lines between the markers
// replaced by `block`; InvalidArgument names the marker when either is missing, repeated
// or out of order.
Result<std::string> SpliceBlock(std::string_view doc, std::string_view name, std::string_view block);

// `text` with what changes from run to run masked: the "planned in" column of the tables
// (and, in the timing table, its CPU, wall time and max RSS columns) and the total
// planning time.
std::string MaskTimings(std::string_view text);

}  // namespace wsync::planner
