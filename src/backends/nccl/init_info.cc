#include "backends/nccl/init_info.h"

#include <set>

#include <fmt/format.h>

namespace wsync {

using nlohmann::json;

json NcclInitInfo::ToJson() const {
  json j = {{"rank_offset", rank_offset},
            {"world_size", world_size},
            {"packed", packed},
            {"packed_buffer_size_bytes", packed_buffer_size_bytes},
            {"packed_num_buffers", packed_num_buffers}};
  if (nccl_unique_id_b64) j["nccl_unique_id_b64"] = *nccl_unique_id_b64;
  if (gloo_store_host) j["gloo_store_host"] = *gloo_store_host;
  if (gloo_store_port) j["gloo_store_port"] = *gloo_store_port;
  if (gloo_prefix) j["gloo_prefix"] = *gloo_prefix;
  if (!gloo_rank_labels.empty()) j["gloo_rank_labels"] = gloo_rank_labels;
  if (wsync_protocol) j["wsync_protocol"] = *wsync_protocol;
  if (timeout_seconds) j["timeout_seconds"] = *timeout_seconds;
  if (wsync_broadcast_piece_bytes) j["wsync_broadcast_piece_bytes"] = *wsync_broadcast_piece_bytes;
  return j;
}

namespace {

template <typename T>
Status Read(const json& j, const char* field, bool required, std::optional<T>* out) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) {
    if (required) return InvalidArgument(fmt::format("init_info is missing '{}'", field));
    return Status::Ok();
  }
  bool ok = false;
  if constexpr (std::is_same_v<T, bool>) ok = it->is_boolean();
  else if constexpr (std::is_integral_v<T>) ok = it->is_number_integer();
  else if constexpr (std::is_floating_point_v<T>) ok = it->is_number();
  else ok = it->is_string();
  if (!ok) return InvalidArgument(fmt::format("init_info '{}' has the wrong type: {}", field, it->dump()));
  *out = it->get<T>();
  return Status::Ok();
}

}  // namespace

Result<NcclInitInfo> NcclInitInfo::Parse(const json& j) {
  static const std::set<std::string> kKnown = {
      "rank_offset", "world_size", "packed", "packed_buffer_size_bytes", "packed_num_buffers",
      "nccl_unique_id_b64", "master_address", "master_port", "gloo_store_host", "gloo_store_port",
      "gloo_prefix", "gloo_rank_labels", "wsync_protocol", "timeout_seconds", "wsync_broadcast_piece_bytes"};
  for (const auto& [key, _] : j.items()) {
    if (!kKnown.contains(key)) return InvalidArgument(fmt::format("init_info has unknown field '{}'", key));
  }
  if (j.contains("master_address") || j.contains("master_port")) {
    return InvalidArgument(
        "init_info uses master_address/master_port (torch TCPStore rendezvous), which wsync does "
        "not speak: send nccl_unique_id_b64 (GPU) or gloo_store_host/gloo_store_port (CPU)");
  }
  NcclInitInfo info;
  std::optional<int> rank_offset, world_size, num_buffers, port, protocol;
  std::optional<bool> packed;
  std::optional<int64_t> buffer_bytes;
  std::optional<double> timeout;
  WSYNC_RETURN_IF_ERROR(Read(j, "rank_offset", true, &rank_offset));
  WSYNC_RETURN_IF_ERROR(Read(j, "world_size", true, &world_size));
  WSYNC_RETURN_IF_ERROR(Read(j, "packed", false, &packed));
  WSYNC_RETURN_IF_ERROR(Read(j, "packed_buffer_size_bytes", false, &buffer_bytes));
  WSYNC_RETURN_IF_ERROR(Read(j, "packed_num_buffers", false, &num_buffers));
  WSYNC_RETURN_IF_ERROR(Read(j, "nccl_unique_id_b64", false, &info.nccl_unique_id_b64));
  WSYNC_RETURN_IF_ERROR(Read(j, "gloo_store_host", false, &info.gloo_store_host));
  WSYNC_RETURN_IF_ERROR(Read(j, "gloo_store_port", false, &port));
  WSYNC_RETURN_IF_ERROR(Read(j, "gloo_prefix", false, &info.gloo_prefix));
  WSYNC_RETURN_IF_ERROR(Read(j, "wsync_protocol", false, &protocol));
  WSYNC_RETURN_IF_ERROR(Read(j, "timeout_seconds", false, &timeout));
  WSYNC_RETURN_IF_ERROR(Read(j, "wsync_broadcast_piece_bytes", false, &info.wsync_broadcast_piece_bytes));
  info.rank_offset = *rank_offset;
  info.world_size = *world_size;
  if (packed) info.packed = *packed;
  if (buffer_bytes) info.packed_buffer_size_bytes = *buffer_bytes;
  if (num_buffers) info.packed_num_buffers = *num_buffers;
  info.gloo_store_port = port;
  info.wsync_protocol = protocol;
  info.timeout_seconds = timeout;
  if (auto it = j.find("gloo_rank_labels"); it != j.end()) {
    if (!it->is_array()) return InvalidArgument("init_info 'gloo_rank_labels' must be a list of strings");
    for (const json& l : *it) {
      if (!l.is_string()) return InvalidArgument("init_info 'gloo_rank_labels' must be a list of strings");
      info.gloo_rank_labels.push_back(l.get<std::string>());
    }
  }

  if (info.rank_offset < 1) return InvalidArgument(fmt::format("init_info rank_offset {} must be >= 1 (rank 0 is the trainer)", info.rank_offset));
  if (info.world_size < 2) return InvalidArgument(fmt::format("init_info world_size {} must be >= 2", info.world_size));
  if (info.packed_buffer_size_bytes <= 0) return InvalidArgument("init_info packed_buffer_size_bytes must be positive");
  if (info.packed_num_buffers < 1) return InvalidArgument("init_info packed_num_buffers must be >= 1");
  if (info.wsync_protocol && *info.wsync_protocol != kWsyncProtocolVersion) {
    return InvalidArgument(fmt::format("init_info wsync_protocol {} is not supported (this server speaks {})",
                                       *info.wsync_protocol, kWsyncProtocolVersion));
  }
  if (info.timeout_seconds && *info.timeout_seconds <= 0) return InvalidArgument("init_info timeout_seconds must be positive");
  if (info.wsync_broadcast_piece_bytes && *info.wsync_broadcast_piece_bytes <= 0) {
    return InvalidArgument("init_info wsync_broadcast_piece_bytes must be positive");
  }
  bool gloo = info.gloo_store_host || info.gloo_store_port || info.gloo_prefix;
  if (gloo && (!info.gloo_store_host || !info.gloo_store_port || !info.gloo_prefix)) {
    return InvalidArgument("init_info needs all of gloo_store_host, gloo_store_port and gloo_prefix");
  }
  if (gloo == info.nccl_unique_id_b64.has_value()) {
    return InvalidArgument("init_info needs exactly one rendezvous: nccl_unique_id_b64 (GPU) or gloo_store_host (CPU)");
  }
  if (!info.gloo_rank_labels.empty() && static_cast<int>(info.gloo_rank_labels.size()) != info.world_size) {
    return InvalidArgument(fmt::format("init_info gloo_rank_labels has {} entries for world_size {}",
                                       info.gloo_rank_labels.size(), info.world_size));
  }
  return info;
}

}  // namespace wsync
