#include "backends/nccl/init_info.h"

#include <cmath>
#include <set>

#include <fmt/format.h>

#include "core/json_int.h"
#include "core/json_limits.h"

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
  if (wsync_device_digests) j["wsync_device_digests"] = true;
  return j;
}

namespace {

// A bool, string or double field; integers go through JsonIntInRange.
template <typename T>
Status Read(const json& j, const char* field, bool required, std::optional<T>* out) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) {
    if (required) return InvalidArgument(fmt::format("init_info is missing '{}'", field));
    return Status::Ok();
  }
  bool ok = false;
  if constexpr (std::is_same_v<T, bool>) ok = it->is_boolean();
  else if constexpr (std::is_floating_point_v<T>) ok = it->is_number();
  else ok = it->is_string();
  if (!ok) return InvalidArgument(fmt::format("init_info '{}' has the wrong type: {}", field, JsonExcerpt(*it)));
  *out = it->get<T>();
  return Status::Ok();
}

// An integer field in [min, max] (exact: 4294967297 is not 1).
Result<std::optional<int64_t>> ReadInt(const json& j, const char* field, bool required, int64_t min,
                                       int64_t max) {
  if (required && (!j.contains(field) || j[field].is_null())) {
    return InvalidArgument(fmt::format("init_info is missing '{}'", field));
  }
  return OptionalJsonIntField(j, field, "init_info", min, max);
}

// A string field that ends up in messages and requests: bounded, printable ASCII.
Status CheckText(const char* field, const std::optional<std::string>& v, size_t max_bytes) {
  if (!v) return Status::Ok();
  if (v->empty() || v->size() > max_bytes) {
    return InvalidArgument(fmt::format("init_info '{}' must have 1 to {} characters, got {}", field, max_bytes, v->size()));
  }
  for (char c : *v) {
    if (c < 0x21 || c > 0x7e) {
      return InvalidArgument(fmt::format("init_info '{}' must be printable ASCII without spaces", field));
    }
  }
  return Status::Ok();
}

}  // namespace

Result<NcclInitInfo> NcclInitInfo::Parse(const json& j) {
  static const std::set<std::string> kKnown = {
      "rank_offset", "world_size", "packed", "packed_buffer_size_bytes", "packed_num_buffers",
      "nccl_unique_id_b64", "master_address", "master_port", "gloo_store_host", "gloo_store_port",
      "gloo_prefix", "gloo_rank_labels", "wsync_protocol", "timeout_seconds", "wsync_broadcast_piece_bytes",
      "wsync_device_digests"};
  if (!j.is_object()) return InvalidArgument("init_info must be an object");
  for (const auto& [key, _] : j.items()) {
    if (!kKnown.contains(key)) {
      std::string shown;  // the key as sent may be anything: printable ASCII, cut short
      for (char c : key.substr(0, 64)) shown += (c >= 0x20 && c < 0x7f) ? c : '?';
      return InvalidArgument(fmt::format("init_info has unknown field '{}'{}", shown, key.size() > 64 ? "..." : ""));
    }
  }
  if (j.contains("master_address") || j.contains("master_port")) {
    return InvalidArgument(kTcpStoreRefusal);
  }
  NcclInitInfo info;
  std::optional<bool> packed;
  std::optional<double> timeout;
  std::optional<bool> device_digests;
  WSYNC_ASSIGN_OR_RETURN(auto world_size, ReadInt(j, "world_size", true, 2, kMaxNcclWorldSize));
  WSYNC_ASSIGN_OR_RETURN(auto rank_offset, ReadInt(j, "rank_offset", true, 1, kMaxNcclWorldSize - 1));
  WSYNC_ASSIGN_OR_RETURN(auto buffer_bytes,
                         ReadInt(j, "packed_buffer_size_bytes", false, 1, kMaxNcclBufferBytes));
  WSYNC_ASSIGN_OR_RETURN(auto num_buffers, ReadInt(j, "packed_num_buffers", false, 1, kMaxNcclNumBuffers));
  WSYNC_ASSIGN_OR_RETURN(auto port, ReadInt(j, "gloo_store_port", false, 1, 65535));
  WSYNC_ASSIGN_OR_RETURN(auto protocol, ReadInt(j, "wsync_protocol", false, 0, INT32_MAX));
  WSYNC_ASSIGN_OR_RETURN(auto piece_bytes,
                         ReadInt(j, "wsync_broadcast_piece_bytes", false, 1, kMaxNcclBufferBytes));
  WSYNC_RETURN_IF_ERROR(Read(j, "packed", false, &packed));
  WSYNC_RETURN_IF_ERROR(Read(j, "nccl_unique_id_b64", false, &info.nccl_unique_id_b64));
  WSYNC_RETURN_IF_ERROR(Read(j, "gloo_store_host", false, &info.gloo_store_host));
  WSYNC_RETURN_IF_ERROR(Read(j, "gloo_prefix", false, &info.gloo_prefix));
  WSYNC_RETURN_IF_ERROR(Read(j, "timeout_seconds", false, &timeout));
  WSYNC_RETURN_IF_ERROR(Read(j, "wsync_device_digests", false, &device_digests));
  WSYNC_RETURN_IF_ERROR(CheckText("gloo_store_host", info.gloo_store_host, kMaxGlooStoreHostBytes));
  WSYNC_RETURN_IF_ERROR(CheckText("gloo_prefix", info.gloo_prefix, kMaxGlooPrefixBytes));
  WSYNC_RETURN_IF_ERROR(CheckText("nccl_unique_id_b64", info.nccl_unique_id_b64, kMaxNcclUniqueIdB64Bytes));
  info.world_size = static_cast<int>(*world_size);
  info.rank_offset = static_cast<int>(*rank_offset);
  if (packed) info.packed = *packed;
  if (buffer_bytes) info.packed_buffer_size_bytes = *buffer_bytes;
  if (num_buffers) info.packed_num_buffers = static_cast<int>(*num_buffers);
  if (port) info.gloo_store_port = static_cast<int>(*port);
  if (protocol) info.wsync_protocol = static_cast<int>(*protocol);
  if (piece_bytes) info.wsync_broadcast_piece_bytes = *piece_bytes;
  info.timeout_seconds = timeout;
  info.wsync_device_digests = device_digests.value_or(false);
  if (auto it = j.find("gloo_rank_labels"); it != j.end()) {
    if (!it->is_array()) return InvalidArgument("init_info 'gloo_rank_labels' must be a list of strings");
    // Checked before any per-rank allocation.
    if (it->size() != static_cast<size_t>(info.world_size)) {
      return InvalidArgument(fmt::format("init_info gloo_rank_labels has {} entries for world_size {}",
                                         it->size(), info.world_size));
    }
    for (const json& l : *it) {
      if (!l.is_string() || l.get_ref<const std::string&>().size() > kMaxGlooRankLabelBytes) {
        return InvalidArgument(fmt::format("init_info 'gloo_rank_labels' must be a list of strings of at most {} bytes",
                                           kMaxGlooRankLabelBytes));
      }
      info.gloo_rank_labels.push_back(l.get<std::string>());
    }
  }

  if (info.rank_offset >= info.world_size) {
    return InvalidArgument(fmt::format("init_info rank_offset {} must be below world_size {} (rank 0 is the trainer)",
                                       info.rank_offset, info.world_size));
  }
  if (info.wsync_protocol && *info.wsync_protocol != kWsyncProtocolVersion) {
    return InvalidArgument(fmt::format("init_info wsync_protocol {} is not supported (this server speaks {})",
                                       *info.wsync_protocol, kWsyncProtocolVersion));
  }
  if (info.timeout_seconds && !(*info.timeout_seconds > 0 && std::isfinite(*info.timeout_seconds))) {
    return InvalidArgument("init_info timeout_seconds must be a positive finite number");
  }
  bool gloo = info.gloo_store_host || info.gloo_store_port || info.gloo_prefix;
  if (gloo && (!info.gloo_store_host || !info.gloo_store_port || !info.gloo_prefix)) {
    return InvalidArgument("init_info needs all of gloo_store_host, gloo_store_port and gloo_prefix");
  }
  if (gloo == info.nccl_unique_id_b64.has_value()) {
    return InvalidArgument("init_info needs exactly one rendezvous: nccl_unique_id_b64 (GPU) or gloo_store_host (CPU)");
  }
  if (gloo && info.wsync_device_digests) {
    return InvalidArgument("init_info wsync_device_digests is for a trainer on a GPU (nccl_unique_id_b64); a trainer "
                           "on the CPU data plane (gloo_store_host) digests on the host");
  }
  return info;
}

}  // namespace wsync
