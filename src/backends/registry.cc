// The one place backends are registered: one line per backend and side.
#include <functional>
#include <map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "backends/delta/receiver.h"
#include "backends/delta/trainer.h"
#include "backends/ipc/receiver.h"
#include "backends/ipc/trainer.h"
#include "backends/nccl/receiver.h"
#include "backends/nccl/trainer.h"
#include "backends/sharded/receiver.h"
#include "backends/sharded/trainer.h"
#include "receiver/backend.h"
#include "wsync/trainer.h"

namespace wsync {
namespace {

const std::map<std::string, ReceiverFactory, std::less<>>& Receivers() {
  static const std::map<std::string, ReceiverFactory, std::less<>> kReceivers = {
      {"delta", CreateDeltaReceiver},
      {"ipc", CreateIpcReceiver},
      {"nccl", CreateNcclReceiver},
      {"sharded", CreateShardedReceiver},
  };
  return kReceivers;
}

using TrainerFactory = std::function<Result<std::unique_ptr<TrainerEngine>>(const TrainerOptions&)>;
const std::map<std::string, TrainerFactory, std::less<>>& Trainers() {
  static const std::map<std::string, TrainerFactory, std::less<>> kTrainers = {
      {"delta", CreateDeltaTrainer},
      {"ipc", CreateIpcTrainer},
      {"nccl", CreateNcclTrainer},
      {"sharded", CreateShardedTrainer},
  };
  return kTrainers;
}

}  // namespace

Result<std::unique_ptr<ReceiverBackend>> CreateReceiverBackend(std::string_view name,
                                                               ReceiverContext* context) {
  auto it = Receivers().find(name);
  if (it != Receivers().end()) return it->second(context);
  return InvalidArgument(fmt::format("unknown backend '{}': available: {}", name,
                                     fmt::join(ReceiverBackendNames(), ", ")));
}

std::vector<std::string> ReceiverBackendNames() {
  std::vector<std::string> names;
  for (const auto& [n, _] : Receivers()) names.push_back(n);
  return names;
}

Result<std::unique_ptr<TrainerEngine>> CreateTrainerEngine(const TrainerOptions& options) {
  auto it = Trainers().find(options.backend);
  if (it != Trainers().end()) return it->second(options);
  return InvalidArgument(fmt::format("unknown backend '{}': available: {}", options.backend,
                                     fmt::join(TrainerBackendNames(), ", ")));
}

std::vector<std::string> TrainerBackendNames() {
  std::vector<std::string> names;
  for (const auto& [n, _] : Trainers()) names.push_back(n);
  return names;
}

}  // namespace wsync
