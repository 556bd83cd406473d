// The `nccl` backend's receiving half: every worker of a server joins the trainer's
// broadcast group (NCCL on GPU, Gloo on CPU; here through the Communicator interface),
// receives every chunk the trainer broadcasts and lands its own shards.
//
// Per update, each worker: (1) with wsync_protocol, joins a one-integer all-reduce in
// which every rank says whether it accepts the update, so that a server that rejects
// a payload (400/409) makes the whole group stop instead of leaving the trainer
// waiting; (2) receives the chunks into its own buffers, cut exactly as vLLM's packed
// producer cuts them (or one broadcast per tensor when unpacked); (3) copies each
// tensor's pieces into its shards while the next chunk arrives. A failure during the
// data phase aborts the communicator; the next init builds a new one.
#pragma once

#include <memory>

#include "receiver/backend.h"

namespace wsync {

Result<std::unique_ptr<ReceiverBackend>> CreateNcclReceiver(ReceiverContext* context);

}  // namespace wsync
