// The `sharded` backend, inference side: each worker joins the trainer's point-to-point
// group, plans (once, at init) the chunks it needs from its sharding table and checks the
// plan's digest against the trainer's, then per update receives exactly those chunks from
// their producers and scatters each slice into its shards.
#pragma once

#include <memory>

#include "receiver/backend.h"
#include "wsync/status.h"

namespace wsync {

Result<std::unique_ptr<ReceiverBackend>> CreateShardedReceiver(ReceiverContext* context);

}  // namespace wsync
