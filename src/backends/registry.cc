// The one place backends are registered: one line per backend, its descriptor. Everything
// else a backend declares (name, fields, options, factories) lives in its own folder.
#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "backends/delta/descriptor.h"
#include "backends/descriptor.h"
#include "backends/ipc/descriptor.h"
#include "backends/nccl/descriptor.h"
#include "backends/sharded/descriptor.h"

namespace wsync {

const std::vector<const BackendDescriptor*>& Backends() {
  static const std::vector<const BackendDescriptor*> kBackends = {
      &DeltaBackend(),
      &IpcBackend(),
      &NcclBackend(),
      &ShardedBackend(),
  };
  return kBackends;
}

const BackendDescriptor* FindBackend(std::string_view name) {
  for (const BackendDescriptor* b : Backends()) {
    if (b->name == name) return b;
  }
  return nullptr;
}

std::string BackendNamesText(std::string_view last_separator) {
  std::string out;
  const auto& all = Backends();
  for (size_t i = 0; i < all.size(); ++i) {
    if (i > 0) out += i + 1 == all.size() ? last_separator : std::string_view(", ");
    out += all[i]->name;
  }
  return out;
}

Result<const BackendDescriptor*> LookupBackend(std::string_view name) {
  if (const BackendDescriptor* b = FindBackend(name)) return b;
  return InvalidArgument(fmt::format("unknown backend '{}': available: {}", name, BackendNamesText(", ")));
}

Status CheckReceiverOptionKeys(std::string_view name, const nlohmann::json& backend_config) {
  const BackendDescriptor* b = FindBackend(name);
  if (b == nullptr || !backend_config.is_object()) return Status::Ok();
  std::vector<std::string> keys;
  for (const auto& [key, _] : backend_config.items()) keys.push_back(key);
  return CheckBackendOptionKeys(b->name, b->receiver_options, keys);
}

bool UsesTrainerGroup(const BackendDescriptor& backend, const Device& device) {
  switch (backend.trainer_group) {
    case TrainerGroupUse::kNever: return false;
    case TrainerGroupUse::kOnDevice: return !device.is_cpu();
    case TrainerGroupUse::kAlways: return true;
  }
  return false;
}

Result<std::unique_ptr<ReceiverBackend>> CreateReceiverBackend(std::string_view name,
                                                               ReceiverContext* context) {
  WSYNC_ASSIGN_OR_RETURN(const BackendDescriptor* b, LookupBackend(name));
  return b->create_receiver(context);
}

std::vector<std::string> ReceiverBackendNames() {
  std::vector<std::string> names;
  for (const BackendDescriptor* b : Backends()) names.emplace_back(b->name);
  return names;
}

Result<std::unique_ptr<TrainerEngine>> CreateTrainerEngine(const TrainerOptions& options) {
  WSYNC_ASSIGN_OR_RETURN(const BackendDescriptor* b, LookupBackend(options.backend));
  WSYNC_RETURN_IF_ERROR(CheckBackendOptionKeys(b->name, b->trainer_options, options.backend_options));
  return b->create_trainer(options);
}

std::vector<std::string> TrainerBackendNames() { return ReceiverBackendNames(); }

}  // namespace wsync
