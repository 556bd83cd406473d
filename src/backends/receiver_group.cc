#include "backends/receiver_group.h"

#include <fmt/format.h>

#include "comm/connect.h"
#include "comm/store_address.h"

namespace wsync {

Result<std::string> AdmitGlooStore(const ReceiverContext& ctx, std::string_view host, std::string_view peer_address) {
  std::vector<std::string> allowed;
  auto it = ctx.backend_config.find("allowed_store_hosts");
  if (it != ctx.backend_config.end() && it->is_array()) {
    for (const nlohmann::json& h : *it) {
      if (h.is_string()) allowed.push_back(h.get<std::string>());
    }
  }
  return AdmitStoreHost(host, peer_address, allowed);
}

Status CheckNcclWorkers(const ReceiverContext& ctx) {
  for (const ReceiverWorker& w : ctx.workers) {
    if (w.device.is_cpu()) {
      return Unimplemented(fmt::format(
          "init_info carries nccl_unique_id_b64, but {} is on cpu: the NCCL data plane needs CUDA devices "
          "(wsync serve --device cuda:N); use the Gloo rendezvous fields for CPU servers", w.label));
    }
  }
  if (!HasNccl()) return Unimplemented("init_info carries nccl_unique_id_b64, but this server was built without NCCL");
  return Status::Ok();
}

Status JoinAll(std::vector<std::future<Status>>& futures) {
  Status first;
  for (auto& f : futures) {
    Status s = f.get();
    if (first.ok() && !s.ok()) first = s;
  }
  return first;
}

std::vector<BackendOptionSpec> GroupReceiverOptions() {
  return {{"allowed_store_hosts", "list", "",
           "hosts whose Gloo store a worker may dial besides the init request's own peer"},
          {"fault", "choice", "", "die-mid-update (tests)", "", true}};
}

}  // namespace wsync
