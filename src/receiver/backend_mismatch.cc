#include "receiver/backend_mismatch.h"

#include <algorithm>
#include <utility>

#include <fmt/format.h>

namespace wsync {
namespace {

struct BackendFields {
  std::string backend;
  std::vector<std::string> fields;
};

// Fields every backend may send ("packed", "timeout_seconds") are in no list.
const std::vector<BackendFields>& Table() {
  static const std::vector<BackendFields> kTable = {
      {"nccl",
       {"master_address", "master_port", "rank_offset", "world_size", "nccl_unique_id_b64",
        "gloo_store_host", "gloo_store_port", "gloo_prefix", "gloo_rank_labels", "wsync_protocol",
        "packed_buffer_size_bytes", "packed_num_buffers", "wsync_broadcast_piece_bytes"}},
      {"ipc",
       {"wsync_ipc_protocol", "buffers", "control_path", "control_bytes", "num_slots", "slot_bytes",
        "reader_offset", "reader_count", "session"}},
      {"delta", {"sync_dir", "format_version", "base_model_path", "local_checkpoint_dir"}},
  };
  return kTable;
}

bool Has(const std::vector<std::string>& fields, const std::string& key) {
  return std::find(fields.begin(), fields.end(), key) != fields.end();
}

}  // namespace

const std::vector<std::string>& InitInfoFieldsOf(std::string_view backend) {
  static const std::vector<std::string> kNone;
  for (const BackendFields& b : Table()) {
    if (b.backend == backend) return b.fields;
  }
  return kNone;
}

std::vector<std::string> InitInfoBackends() {
  std::vector<std::string> names;
  for (const BackendFields& b : Table()) names.push_back(b.backend);
  return names;
}

std::optional<InitInfoGuess> GuessForeignInitInfo(std::string_view server_backend,
                                                  const nlohmann::json& init_info) {
  if (!init_info.is_object()) return std::nullopt;
  const std::vector<std::string>& own = InitInfoFieldsOf(server_backend);
  for (const auto& [key, _] : init_info.items()) {
    if (Has(own, key)) return std::nullopt;
  }
  std::optional<InitInfoGuess> best;
  size_t best_count = 0;
  for (const BackendFields& b : Table()) {
    if (b.backend == server_backend) continue;
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
