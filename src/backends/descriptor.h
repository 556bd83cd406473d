// BackendDescriptor: what the rest of wsync knows about one backend, declared by the
// backend itself (src/backends/<name>/descriptor.cc) and listed once in
// src/backends/registry.cc. Code outside a backend's folder finds a backend by name
// (FindBackend) or walks them all (Backends) and reads these fields: the backend-mismatch
// detector its init_info fields, the CLI, the options check and Python its options
// schema, the planner its cost hook, the Python trainer and `wsync push` whether it runs
// on a trainer group. Nothing outside the folder spells a backend's name.
//
// Descriptors are built on first use and never change; every function here is thread-safe.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "engine/backend_options.h"
#include "receiver/backend.h"
#include "wsync/trainer.h"

namespace wsync {

using TrainerFactory = Result<std::unique_ptr<TrainerEngine>> (*)(const TrainerOptions&);

namespace planner {
struct CostInput;
struct Fleet;
struct PlanOptions;
struct Prediction;
}  // namespace planner

// The planner's model of one sync of the backend (`wsync plan`, src/planner/cost.h); the
// arithmetic every backend shares and the CostInput it reads are in
// src/planner/cost_model.h. A backend whose predict is nullptr is not planned.
struct CostHook {
  // Fills the prediction's bytes, memory, steps, seconds, bottleneck and assumptions, or
  // marks it not applicable with the reason; an error fails the whole plan.
  Status (*predict)(const planner::CostInput& input, planner::Prediction& prediction) = nullptr;
  // Whether predict reads the workers' consumer plans (PreparedModel::plans) on `fleet`;
  // the planner builds them only when a planned backend does. nullptr: never.
  bool (*reads_plans)(const planner::Fleet& fleet) = nullptr;
  // The options predict reads, as a published case shows them after the backend's name
  // ("lookahead 1, stages in turn"); nullptr or "": nothing to show.
  std::string (*describe_options)(const planner::PlanOptions& options) = nullptr;
  // Where `wsync plan` lists the backend among the others (ascending).
  int plan_order = 0;
};

// Whether the backend's trainer ranks meet in wsync's trainer group (TrainerGroup), whose
// communicator the engine receives as TrainerOptions::comm.
enum class TrainerGroupUse {
  kNever,     // one rank sends; the others drain their sources
  kOnDevice,  // on a GPU the ranks exchange device handles in the group; on cpu as kNever
  kAlways,    // every rank sends what it holds, through the group's communicator
};

struct BackendDescriptor {
  std::string_view name;     // what --backend, TrainerOptions::backend and init_info name
  std::string_view summary;  // one line for help texts and docstrings
  // The init_info fields only this backend sends; the backend-mismatch detector
  // (src/receiver/backend_mismatch.h) tells an init_info meant for it by them. Fields every
  // backend may send ("packed", "timeout_seconds") are in no list.
  std::vector<std::string> init_info_fields;
  // Fields this backend also sends that another backend lists as its own.
  std::vector<std::string> shared_init_info_fields;
  // The update_info fields only this backend sends, beside vLLM's names/dtype_names/shapes
  // and the fields every backend sends ("packed", "weight_version", ...).
  std::vector<std::string> update_info_fields;
  // TrainerOptions::backend_options keys, in the order the backend reads them.
  std::vector<BackendOptionSpec> trainer_options;
  // ReceiverEngineOptions::backend_config keys (wsync serve sets them from its flags).
  std::vector<BackendOptionSpec> receiver_options;
  TrainerGroupUse trainer_group = TrainerGroupUse::kNever;
  // The trainer option naming the servers' model, which `wsync push` fills from the
  // weights' model and the Python trainer uses to drop the tensors servers drop; empty when
  // the backend plans without the model.
  std::string_view model_option;
  // Whether the single-worker receiver (ReceiverEngine, C++ and Python) hosts it; a backend
  // that needs the whole deployment's workers runs in `wsync serve` only.
  bool single_worker_receiver = true;
  // Whether its receiver answers /fetch_weights (ReceiverBackend::Fetch): brings the
  // worker's copy to a version ahead of the update that applies it.
  bool fetches = false;
  ReceiverFactory create_receiver;
  TrainerFactory create_trainer = nullptr;
  CostHook cost;
};

// Every backend this build has, in registry order (alphabetical).
const std::vector<const BackendDescriptor*>& Backends();
// The backend named `name`, or nullptr.
const BackendDescriptor* FindBackend(std::string_view name);
// Names of every backend, "a, b, c or d": for help texts.
std::string BackendNamesText(std::string_view last_separator = " or ");
// OK when `name` is a backend; else InvalidArgument "unknown backend 'x': available: ...".
Result<const BackendDescriptor*> LookupBackend(std::string_view name);
// OK when every key of `backend_config` (an object) is one of backend `name`'s
// receiver_options, or `name` is no backend (creating it says so); else InvalidArgument
// as CheckBackendOptionKeys words it.
Status CheckReceiverOptionKeys(std::string_view name, const nlohmann::json& backend_config);
// Whether `backend`'s trainer ranks use the trainer group on `device`.
bool UsesTrainerGroup(const BackendDescriptor& backend, const Device& device);

}  // namespace wsync
