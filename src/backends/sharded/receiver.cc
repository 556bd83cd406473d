#include "backends/sharded/receiver.h"

namespace wsync {

// Skeleton: the receiver helper replaces this.
Result<std::unique_ptr<ReceiverBackend>> CreateShardedReceiver(ReceiverContext*) {
  return Unimplemented("backend 'sharded' (receiver) is not built yet");
}

}  // namespace wsync
