#include "receiver/backend_mismatch.h"

#include <algorithm>
#include <utility>

#include <fmt/format.h>

namespace wsync {
namespace {

struct BackendFields {
  std::string backend;
  std::vector<std::string> fields;  // sent by this backend only
  std::vector<std::string> shared;  // also sent by this backend, though listed for another
};

// Fields every backend may send ("packed", "timeout_seconds") are in no list.
const std::vector<BackendFields>& Table() {
  static const std::vector<BackendFields> kTable = {
      {"nccl",
       {"master_address", "master_port", "rank_offset", "world_size", "nccl_unique_id_b64",
        "gloo_store_host", "gloo_store_port", "gloo_prefix", "gloo_rank_labels", "wsync_protocol",
        "packed_buffer_size_bytes", "packed_num_buffers", "wsync_broadcast_piece_bytes"},
       {}},
      {"ipc",
       {"wsync_ipc_protocol", "buffers", "control_path", "control_bytes", "num_slots", "slot_bytes",
        "reader_offset", "reader_count", "session"},
       {}},
      {"delta", {"sync_dir", "format_version", "base_model_path", "local_checkpoint_dir"}, {}},
      // The sharded backend meets its group as the nccl backend does.
      {"sharded",
       {"names", "dtype_names", "shapes", "group_lens", "owner_sets", "name_owner_class", "num_producers",
        "num_consumers", "workers_per_replica", "replica_rank", "num_replicas", "consumer_offset",
        "deployment_workers", "plan_digests", "num_buffers", "concurrent_stages", "receive_staging_mb", "rank_labels"},
       {"world_size", "nccl_unique_id_b64", "gloo_store_host", "gloo_store_port", "gloo_prefix", "wsync_protocol"}},
  };
  return kTable;
}

bool Has(const std::vector<std::string>& fields, const std::string& key) {
  return std::find(fields.begin(), fields.end(), key) != fields.end();
}

// The row of `backend`; an empty one for a backend not in the table.
const BackendFields& Row(std::string_view backend) {
  static const BackendFields kNone;
  for (const BackendFields& b : Table()) {
    if (b.backend == backend) return b;
  }
  return kNone;
}

}  // namespace

const std::vector<std::string>& InitInfoFieldsOf(std::string_view backend) { return Row(backend).fields; }

const std::vector<std::string>& InitInfoSharedFieldsOf(std::string_view backend) { return Row(backend).shared; }

std::vector<std::string> InitInfoBackends() {
  std::vector<std::string> names;
  for (const BackendFields& b : Table()) names.push_back(b.backend);
  return names;
}

std::optional<InitInfoGuess> GuessForeignInitInfo(std::string_view server_backend,
                                                  const nlohmann::json& init_info) {
  if (!init_info.is_object()) return std::nullopt;
  const std::vector<std::string>& own = InitInfoFieldsOf(server_backend);
  std::optional<InitInfoGuess> best;
  size_t best_count = 0;
  for (const BackendFields& b : Table()) {
    if (b.backend == server_backend) continue;
    // A field of the server's own backend that `b` does not send too rules `b` out.
    bool ruled_out = false;
    for (const auto& [key, _] : init_info.items()) {
      ruled_out = ruled_out || (Has(own, key) && !Has(b.shared, key));
    }
    if (ruled_out) continue;
    size_t count = 0;
    std::string first;
    for (const auto& [key, _] : init_info.items()) {
      if (!Has(b.fields, key)) continue;
      if (count++ == 0) first = key;
    }
    if (count > best_count) {
      best_count = count;
      best = InitInfoGuess{b.backend, std::move(first)};
    }
  }
  return best;
}

Status CheckInitInfoBackend(std::string_view server_backend, const nlohmann::json& init_info) {
  std::optional<InitInfoGuess> guess = GuessForeignInitInfo(server_backend, init_info);
  if (!guess) return Status::Ok();
  return FailedPrecondition(fmt::format(
      "this server runs backend '{}'; the init_info is for backend '{}' (field '{}'): start the "
      "server with --backend {} or push with --backend {}",
      server_backend, guess->backend, guess->field, guess->backend, server_backend));
}

}  // namespace wsync
