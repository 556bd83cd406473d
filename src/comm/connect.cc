#include "comm/connect.h"

#include <fmt/format.h>

#include "comm/gloo_communicator.h"
#include "comm/nccl_unique_id.h"
#ifdef WSYNC_WITH_NCCL
#include "comm/nccl_communicator.h"
#endif

namespace wsync {

bool HasNccl() {
#ifdef WSYNC_WITH_NCCL
  return true;
#else
  return false;
#endif
}

Result<std::string> NewNcclGroupId() {
#ifdef WSYNC_WITH_NCCL
  WSYNC_ASSIGN_OR_RETURN(NcclUniqueIdBytes id, NewNcclUniqueId());
  return EncodeNcclUniqueId(id);
#else
  return Unimplemented("this build has no NCCL (the GPU data plane)");
#endif
}

Result<std::unique_ptr<Communicator>> Connect(const CommSpec& spec) {
  if (spec.store.has_value() == spec.nccl_unique_id_b64.has_value()) {
    return InvalidArgument("a communicator needs exactly one rendezvous: a Gloo store or an NCCL unique id");
  }
  if (spec.store) {
    GlooOptions g;
    g.store_host = spec.store->host;
    g.store_port = spec.store->port;
    g.prefix = spec.store->prefix;
    g.bind_host = spec.store->bind_host;
    g.rank = spec.rank;
    g.size = spec.size;
    g.connect_deadline = spec.connect_deadline;
    g.op_timeout = spec.op_timeout;
    g.describe_rank = spec.describe_rank;
    return ConnectGloo(g);
  }
  WSYNC_ASSIGN_OR_RETURN(NcclUniqueIdBytes id, DecodeNcclUniqueId(*spec.nccl_unique_id_b64));
#ifdef WSYNC_WITH_NCCL
  NcclOptions n;
  n.unique_id = id;
  n.rank = spec.rank;
  n.size = spec.size;
  n.device = spec.device;
  n.piece_bytes = spec.piece_bytes;
  n.connect_deadline = spec.connect_deadline;
  n.op_timeout = spec.op_timeout;
  n.describe_rank = spec.describe_rank;
  return ConnectNccl(n);
#else
  (void)id;
  return Unimplemented("an NCCL group was asked for, but this build has no NCCL");
#endif
}

}  // namespace wsync
