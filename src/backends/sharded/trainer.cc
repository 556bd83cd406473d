#include "backends/sharded/trainer.h"

namespace wsync {

// Skeleton: the lead replaces this.
Result<ShardedTrainerOptions> ParseShardedTrainerOptions(const std::map<std::string, std::string>&) {
  return ShardedTrainerOptions{};
}
Result<std::unique_ptr<TrainerEngine>> CreateShardedTrainerWith(const TrainerOptions&, const ShardedTrainerOptions&) {
  return Unimplemented("backend 'sharded' (trainer) is not built yet");
}
Result<std::unique_ptr<TrainerEngine>> CreateShardedTrainer(const TrainerOptions& options) {
  WSYNC_ASSIGN_OR_RETURN(ShardedTrainerOptions o, ParseShardedTrainerOptions(options.backend_options));
  return CreateShardedTrainerWith(options, o);
}

}  // namespace wsync
