#include "backends/sharded/init_info.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <set>
#include <unordered_set>

#include <fmt/format.h>

#include "control/tensor_list.h"
#include "core/json_int.h"

namespace wsync {

using nlohmann::json;

std::vector<LoraBucket> ShardedLoraBuckets(const std::vector<TensorMeta>& tensors) {
  std::vector<LoraBucket> out;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const size_t bytes = tensors[i].nbytes();
    if (out.empty() || out.back().bytes + bytes > kShardedLoraBucketBytes) out.push_back({i, i, 0});
    out.back().end = i + 1;
    out.back().bytes += bytes;
  }
  return out;
}

std::vector<std::pair<int64_t, int64_t>> SplitDigestRows(const TensorMeta& tensor, size_t holders) {
  std::vector<std::pair<int64_t, int64_t>> out;
  if (holders < 2 || tensor.shape.empty() || tensor.nbytes() < kSplitDigestMinBytes) return out;
  const int64_t rows = tensor.shape[0];
  const auto h = static_cast<int64_t>(holders);
  if (rows < h) return out;
  for (int64_t k = 0; k < h; ++k) out.emplace_back(k * rows / h, (k + 1) * rows / h);
  return out;
}

json ShardedInitInfo::ToJson() const {
  json j = adapters_only ? json::object() : TensorListJson(tensors);
  if (adapters_only) {
    j["wsync_lora"] = true;
  } else {
    j["group_lens"] = group_lens;
    j["owner_sets"] = owner_sets;
    j["name_owner_class"] = name_owner_class;
  }
  if (!tensor_parts.empty()) {
    json parts = json::array();
    for (size_t i = 0; i < tensor_parts.size(); ++i) {
      for (const TensorPart& p : tensor_parts[i]) parts.push_back({i, p.row_begin, p.row_end, p.owner_class});
    }
    j["tensor_parts"] = std::move(parts);
  }
  j["num_producers"] = num_producers;
  j["num_consumers"] = num_consumers;
  j["workers_per_replica"] = workers_per_replica;
  j["replica_rank"] = replica_rank;
  j["num_replicas"] = num_replicas;
  j["consumer_offset"] = consumer_offset;
  j["deployment_workers"] = deployment_workers;
  if (!adapters_only) j["plan_digests"] = plan_digests;
  j["world_size"] = world_size;
  j["num_buffers"] = num_buffers;
  if (!concurrent_stages) j["concurrent_stages"] = false;
  if (receive_staging_mb > 0) j["receive_staging_mb"] = receive_staging_mb;
  if (!live_consumers.empty()) j["live_consumers"] = live_consumers;
  if (gloo_store_host) j["gloo_store_host"] = *gloo_store_host;
  if (gloo_store_port) j["gloo_store_port"] = *gloo_store_port;
  if (gloo_prefix) j["gloo_prefix"] = *gloo_prefix;
  if (nccl_unique_id_b64) j["nccl_unique_id_b64"] = *nccl_unique_id_b64;
  if (!rank_labels.empty()) j["rank_labels"] = rank_labels;
  if (timeout_seconds) j["timeout_seconds"] = *timeout_seconds;
  j["wsync_protocol"] = wsync_protocol;
  if (wsync_device_digests) j["wsync_device_digests"] = true;
  if (wsync_split_digests) j["wsync_split_digests"] = true;
  return j;
}

namespace {

// Reads the fields of one init_info object; every error is InvalidArgument naming the
// field ("init_info 'num_producers' ...").
class FieldReader {
 public:
  explicit FieldReader(const json& j) : j_(j) {}

  const json* Find(const char* field) const {
    auto it = j_.find(field);
    return it == j_.end() || it->is_null() ? nullptr : &*it;
  }

  Status Missing(const char* field) const {
    return InvalidArgument(fmt::format("init_info is missing '{}'", field));
  }

  // An exact integer in [min, max]; `fallback` when absent (nullopt: required).
  Result<int> Int(const char* field, int64_t min, int64_t max, std::optional<int> fallback) const {
    const json* v = Find(field);
    if (v == nullptr) {
      if (!fallback) return Missing(field);
      return *fallback;
    }
    WSYNC_ASSIGN_OR_RETURN(int64_t i, JsonIntInRange(*v, fmt::format("init_info '{}'", field), min, max));
    return static_cast<int>(i);
  }

  // A list of at most `max_entries` entries (required when `required`; absent: null).
  Result<const json*> List(const char* field, bool required, size_t max_entries) const {
    const json* v = Find(field);
    if (v == nullptr) {
      if (required) return Missing(field);
      return static_cast<const json*>(nullptr);
    }
    if (!v->is_array()) return InvalidArgument(fmt::format("init_info '{}' must be a list", field));
    if (v->size() > max_entries) {
      return InvalidArgument(fmt::format("init_info '{}' has {} entries, more than {}", field, v->size(), max_entries));
    }
    return v;
  }

  // A list of exact integers, each in [min, max].
  Result<std::vector<int>> Ints(const char* field, size_t max_entries, int64_t min, int64_t max) const {
    WSYNC_ASSIGN_OR_RETURN(const json* list, List(field, true, max_entries));
    return IntsOf(*list, field, min, max);
  }

  static Result<std::vector<int>> IntsOf(const json& list, std::string_view what, int64_t min, int64_t max) {
    std::vector<int> out;
    out.reserve(list.size());
    for (size_t i = 0; i < list.size(); ++i) {
      WSYNC_ASSIGN_OR_RETURN(int64_t v, JsonIntInRange(list[i], fmt::format("init_info {}[{}]", what, i), min, max));
      out.push_back(static_cast<int>(v));
    }
    return out;
  }

  // Text that ends up in messages and dial strings: 1 to max_bytes printable ASCII
  // characters without spaces. Absent: nullopt.
  Result<std::optional<std::string>> Token(const char* field, size_t max_bytes) const {
    const json* v = Find(field);
    if (v == nullptr) return std::optional<std::string>();
    if (!v->is_string()) return InvalidArgument(fmt::format("init_info '{}' must be a string", field));
    const std::string& s = v->get_ref<const std::string&>();
    if (s.empty() || s.size() > max_bytes) {
      return InvalidArgument(
          fmt::format("init_info '{}' must have 1 to {} characters, got {}", field, max_bytes, s.size()));
    }
    for (char c : s) {
      if (c < 0x21 || c > 0x7e) {
        return InvalidArgument(fmt::format("init_info '{}' must be printable ASCII without spaces", field));
      }
    }
    return std::optional<std::string>(s);
  }

 private:
  const json& j_;
};

const std::set<std::string, std::less<>>& KnownFields() {
  static const std::set<std::string, std::less<>> kKnown = {
      "names", "dtype_names", "shapes", "group_lens", "owner_sets", "name_owner_class", "num_producers",
      "num_consumers", "workers_per_replica", "replica_rank", "num_replicas", "consumer_offset",
      "deployment_workers", "plan_digests", "world_size", "num_buffers", "concurrent_stages", "receive_staging_mb", "gloo_store_host",
      "gloo_store_port",
      "gloo_prefix", "nccl_unique_id_b64", "rank_labels", "timeout_seconds", "wsync_protocol", "live_consumers",
      "tensor_parts", "wsync_lora", "wsync_device_digests", "wsync_split_digests"};
  return kKnown;
}

Status CheckKnownFields(const json& j) {
  for (const auto& [key, _] : j.items()) {
    if (KnownFields().contains(key)) continue;
    std::string shown;  // the key as sent may be anything: printable ASCII, cut short
    for (char c : key.substr(0, 64)) shown += (c >= 0x20 && c < 0x7f) ? c : '?';
    return InvalidArgument(fmt::format("init_info has unknown field '{}'{}", shown, key.size() > 64 ? "..." : ""));
  }
  return Status::Ok();
}

// names / dtype_names / shapes, bounded before any per-tensor work; names unique.
Result<std::vector<TensorMeta>> ReadTensors(const FieldReader& r) {
  json lists = json::object();
  for (const char* field : {"names", "dtype_names", "shapes"}) {
    WSYNC_ASSIGN_OR_RETURN(const json* list, r.List(field, true, static_cast<size_t>(kMaxShardedTensors)));
    lists[field] = *list;
  }
  Result<std::vector<TensorMeta>> tensors = ParseTensorList(lists);
  if (!tensors.ok()) return tensors.status().WithContext("init_info");
  if (tensors->empty()) return InvalidArgument("init_info 'names' is empty: the model has no tensors");
  std::unordered_set<std::string_view> seen;
  for (const TensorMeta& m : *tensors) {
    if (!seen.insert(m.name).second) return InvalidArgument(fmt::format("init_info names '{}' twice", m.name));
  }
  return tensors;
}

// owner_sets: each a non-empty, strictly ascending list of producer ranks.
Result<std::vector<std::vector<int>>> ReadOwnerSets(const FieldReader& r, int num_producers, size_t max_classes) {
  WSYNC_ASSIGN_OR_RETURN(const json* list, r.List("owner_sets", true, max_classes));
  if (list->empty()) return InvalidArgument("init_info 'owner_sets' is empty");
  std::vector<std::vector<int>> sets;
  sets.reserve(list->size());
  for (size_t c = 0; c < list->size(); ++c) {
    const json& set = (*list)[c];
    std::string what = fmt::format("owner_sets[{}]", c);
    if (!set.is_array() || set.empty() || set.size() > static_cast<size_t>(num_producers)) {
      return InvalidArgument(
          fmt::format("init_info {} must be a list of 1 to {} producer ranks (num_producers)", what, num_producers));
    }
    WSYNC_ASSIGN_OR_RETURN(std::vector<int> owners, FieldReader::IntsOf(set, what, 0, num_producers - 1));
    for (size_t i = 1; i < owners.size(); ++i) {
      if (owners[i] <= owners[i - 1]) {
        return InvalidArgument(fmt::format("init_info {} must list distinct ranks in ascending order", what));
      }
    }
    sets.push_back(std::move(owners));
  }
  return sets;
}

Status CheckGroupLens(const std::vector<int>& group_lens, size_t tensors) {
  if (group_lens.empty()) return InvalidArgument("init_info 'group_lens' is empty");
  int64_t sum = 0;
  for (int n : group_lens) sum += n;  // each at most kMaxShardedTensors, as many as there are tensors
  if (sum != static_cast<int64_t>(tensors)) {
    return InvalidArgument(fmt::format("init_info group_lens add up to {} tensors; names has {}", sum, tensors));
  }
  return Status::Ok();
}

// A plan digest: 1 to 128 hex digits.
bool IsHexDigest(const json& d) {
  if (!d.is_string()) return false;
  const std::string& s = d.get_ref<const std::string&>();
  if (s.empty() || s.size() > 128) return false;
  return std::all_of(s.begin(), s.end(), [](char c) { return std::isxdigit(static_cast<unsigned char>(c)) != 0; });
}

Status ReadRendezvous(const FieldReader& r, ShardedInitInfo* info) {
  WSYNC_ASSIGN_OR_RETURN(info->gloo_store_host, r.Token("gloo_store_host", 253));
  WSYNC_ASSIGN_OR_RETURN(info->gloo_prefix, r.Token("gloo_prefix", 256));
  WSYNC_ASSIGN_OR_RETURN(info->nccl_unique_id_b64, r.Token("nccl_unique_id_b64", 1024));
  if (r.Find("gloo_store_port") != nullptr) {
    WSYNC_ASSIGN_OR_RETURN(info->gloo_store_port, r.Int("gloo_store_port", 1, 65535, std::nullopt));
  }
  const bool gloo = info->gloo_store_host || info->gloo_store_port || info->gloo_prefix;
  if (gloo && (!info->gloo_store_host || !info->gloo_store_port || !info->gloo_prefix)) {
    return InvalidArgument("init_info needs all of gloo_store_host, gloo_store_port and gloo_prefix");
  }
  if (gloo == info->nccl_unique_id_b64.has_value()) {
    return InvalidArgument(
        "init_info needs exactly one rendezvous: nccl_unique_id_b64 (GPU) or gloo_store_host (CPU)");
  }
  return Status::Ok();
}

// tensor_parts: [tensor, row_begin, row_end, class] quads, by tensor then row; the rows
// are checked against the shapes where the plan is made (CheckShardedStream).
Status ReadTensorParts(const FieldReader& r, ShardedInitInfo* info) {
  WSYNC_ASSIGN_OR_RETURN(const json* list, r.List("tensor_parts", false, static_cast<size_t>(kMaxShardedTensors)));
  if (list == nullptr) return Status::Ok();
  const size_t n = info->tensors.size();
  info->tensor_parts.assign(n, {});
  int64_t last = -1;
  for (size_t k = 0; k < list->size(); ++k) {
    const json& q = (*list)[k];
    const std::string what = fmt::format("tensor_parts[{}]", k);
    if (!q.is_array() || q.size() != 4) {
      return InvalidArgument(fmt::format("init_info {} must be [tensor, row_begin, row_end, owner_class]", what));
    }
    WSYNC_ASSIGN_OR_RETURN(int64_t tensor, JsonIntInRange(q[0], "init_info " + what, 0, static_cast<int64_t>(n) - 1));
    WSYNC_ASSIGN_OR_RETURN(int64_t begin, JsonIntInRange(q[1], "init_info " + what, 0, INT64_MAX - 1));
    WSYNC_ASSIGN_OR_RETURN(int64_t end, JsonIntInRange(q[2], "init_info " + what, begin + 1, INT64_MAX));
    WSYNC_ASSIGN_OR_RETURN(int64_t cls, JsonIntInRange(q[3], "init_info " + what, 0,
                                                       static_cast<int64_t>(info->owner_sets.size()) - 1));
    if (tensor < last) return InvalidArgument(fmt::format("init_info {} is out of tensor order", what));
    last = tensor;
    info->tensor_parts[tensor].push_back(TensorPart{begin, end, static_cast<int>(cls)});
  }
  return Status::Ok();
}

// The model and who holds what: the tensors, their groups and owners, the split
// tensors' parts and the deployment's plan digests.
Status ReadModel(const FieldReader& r, ShardedInitInfo* info) {
  WSYNC_ASSIGN_OR_RETURN(info->tensors, ReadTensors(r));
  const size_t n = info->tensors.size();
  WSYNC_ASSIGN_OR_RETURN(info->group_lens, r.Ints("group_lens", n, 1, kMaxShardedTensors));
  WSYNC_RETURN_IF_ERROR(CheckGroupLens(info->group_lens, n));
  WSYNC_ASSIGN_OR_RETURN(info->owner_sets, ReadOwnerSets(r, info->num_producers, 2 * n + info->num_producers));
  WSYNC_ASSIGN_OR_RETURN(const json* classes, r.List("name_owner_class", true, n));
  if (classes->size() != n) {
    return InvalidArgument(
        fmt::format("init_info name_owner_class has {} entries for {} names", classes->size(), n));
  }
  WSYNC_ASSIGN_OR_RETURN(info->name_owner_class,
                         FieldReader::IntsOf(*classes, "name_owner_class", 0,
                                             static_cast<int64_t>(info->owner_sets.size()) - 1));

  WSYNC_RETURN_IF_ERROR(ReadTensorParts(r, info));

  // Per-server: the deployment's plan digests, by deployment index.
  WSYNC_ASSIGN_OR_RETURN(const json* digests, r.List("plan_digests", true, info->deployment_workers));
  if (digests->size() != static_cast<size_t>(info->deployment_workers)) {
    return InvalidArgument(fmt::format("init_info plan_digests has {} entries for deployment_workers {}",
                                       digests->size(), info->deployment_workers));
  }
  for (size_t i = 0; i < digests->size(); ++i) {
    const json& d = (*digests)[i];
    if (!IsHexDigest(d)) return InvalidArgument(fmt::format("init_info plan_digests[{}] must be a hex digest", i));
    info->plan_digests.push_back(d.get<std::string>());
  }
  return Status::Ok();
}

}  // namespace

Result<ShardedInitInfo> ShardedInitInfo::Parse(const json& j) {
  if (!j.is_object()) return InvalidArgument("init_info must be an object");
  WSYNC_RETURN_IF_ERROR(CheckKnownFields(j));
  const FieldReader r(j);
  ShardedInitInfo info;
  WSYNC_ASSIGN_OR_RETURN(info.wsync_protocol, r.Int("wsync_protocol", 0, INT32_MAX, std::nullopt));
  if (info.wsync_protocol != kShardedProtocolVersion) {
    return InvalidArgument(fmt::format("init_info wsync_protocol {} is not supported (this server speaks {})",
                                       info.wsync_protocol, kShardedProtocolVersion));
  }
  // Counts first: they bound every list below.
  WSYNC_ASSIGN_OR_RETURN(info.num_producers, r.Int("num_producers", 1, kMaxShardedRanks, std::nullopt));
  WSYNC_ASSIGN_OR_RETURN(info.num_consumers, r.Int("num_consumers", 1, kMaxShardedRanks, std::nullopt));
  WSYNC_ASSIGN_OR_RETURN(info.world_size, r.Int("world_size", 2, 2 * kMaxShardedRanks, std::nullopt));
  WSYNC_ASSIGN_OR_RETURN(const json* live, r.List("live_consumers", false, info.num_consumers));
  if (live != nullptr) {
    WSYNC_ASSIGN_OR_RETURN(info.live_consumers, FieldReader::IntsOf(*live, "live_consumers", 0, info.num_consumers - 1));
    if (info.live_consumers.empty()) return InvalidArgument("init_info 'live_consumers' is empty");
    for (size_t i = 1; i < info.live_consumers.size(); ++i) {
      if (info.live_consumers[i] <= info.live_consumers[i - 1]) {
        return InvalidArgument("init_info 'live_consumers' must be ascending without repeats");
      }
    }
  }
  const int consumers_in_group = info.live_consumers.empty() ? info.num_consumers
                                                            : static_cast<int>(info.live_consumers.size());
  if (info.world_size != info.num_producers + consumers_in_group) {
    return InvalidArgument(fmt::format("init_info world_size {} is not num_producers {} + {} {}", info.world_size,
                                       info.num_producers, info.live_consumers.empty() ? "num_consumers" : "live_consumers",
                                       consumers_in_group));
  }
  WSYNC_ASSIGN_OR_RETURN(info.workers_per_replica, r.Int("workers_per_replica", 0, info.num_consumers, 0));
  if (info.workers_per_replica > 0 && info.num_consumers % info.workers_per_replica != 0) {
    return InvalidArgument(fmt::format("init_info workers_per_replica {} does not divide num_consumers {}",
                                       info.workers_per_replica, info.num_consumers));
  }
  WSYNC_ASSIGN_OR_RETURN(info.num_replicas, r.Int("num_replicas", 1, info.num_consumers, 1));
  WSYNC_ASSIGN_OR_RETURN(info.replica_rank, r.Int("replica_rank", 0, info.num_replicas - 1, 0));
  WSYNC_ASSIGN_OR_RETURN(info.consumer_offset, r.Int("consumer_offset", 0, info.num_consumers - 1, std::nullopt));
  WSYNC_ASSIGN_OR_RETURN(info.deployment_workers, r.Int("deployment_workers", 1, info.num_consumers, std::nullopt));
  if (info.consumer_offset + info.deployment_workers > info.num_consumers) {
    return InvalidArgument(fmt::format(
        "init_info consumer_offset {} + deployment_workers {} is past num_consumers {}", info.consumer_offset,
        info.deployment_workers, info.num_consumers));
  }
  if (info.workers_per_replica > 0 &&
      (info.deployment_workers != info.workers_per_replica ||
       int64_t{info.consumer_offset} != int64_t{info.replica_rank} * info.workers_per_replica)) {
    // Uniform deployments: SkyRL's consumer id replica_rank * workers_per_replica + index.
    return InvalidArgument(fmt::format(
        "init_info consumer_offset {} and deployment_workers {} disagree with replica_rank {} and "
        "workers_per_replica {} (deployments of workers_per_replica workers each)", info.consumer_offset,
        info.deployment_workers, info.replica_rank, info.workers_per_replica));
  }
  WSYNC_ASSIGN_OR_RETURN(info.num_buffers, r.Int("num_buffers", 1, kMaxShardedBuffers, 2));
  if (const json* v = r.Find("concurrent_stages"); v != nullptr) {
    if (!v->is_boolean()) return InvalidArgument("init_info 'concurrent_stages' must be true or false");
    info.concurrent_stages = v->get<bool>();
  }
  WSYNC_ASSIGN_OR_RETURN(info.receive_staging_mb, r.Int("receive_staging_mb", 0, INT32_MAX, 0));
  if (const json* v = r.Find("wsync_device_digests"); v != nullptr) {
    if (!v->is_boolean()) return InvalidArgument("init_info 'wsync_device_digests' must be true or false");
    info.wsync_device_digests = v->get<bool>();
  }
  if (const json* v = r.Find("wsync_split_digests"); v != nullptr) {
    if (!v->is_boolean()) return InvalidArgument("init_info 'wsync_split_digests' must be true or false");
    info.wsync_split_digests = v->get<bool>();
  }

  if (const json* v = r.Find("wsync_lora"); v != nullptr) {
    if (!v->is_boolean()) return InvalidArgument("init_info 'wsync_lora' must be true or false");
    info.adapters_only = v->get<bool>();
  }
  if (info.adapters_only) {
    // An adapter group: no model, no plan.
    for (const char* field : {"names", "dtype_names", "shapes", "group_lens", "owner_sets", "name_owner_class",
                              "tensor_parts", "plan_digests"}) {
      if (r.Find(field) != nullptr) {
        return InvalidArgument(fmt::format("init_info '{}': an adapter group (wsync_lora) carries no model", field));
      }
    }
  } else {
    WSYNC_RETURN_IF_ERROR(ReadModel(r, &info));
  }
  WSYNC_RETURN_IF_ERROR(ReadRendezvous(r, &info));
  WSYNC_ASSIGN_OR_RETURN(const json* labels, r.List("rank_labels", false, info.world_size));
  if (labels != nullptr) {
    if (labels->size() != static_cast<size_t>(info.world_size)) {
      return InvalidArgument(fmt::format("init_info rank_labels has {} entries for world_size {}", labels->size(),
                                         info.world_size));
    }
    for (const json& l : *labels) {
      if (!l.is_string() || l.get_ref<const std::string&>().size() > 256) {
        return InvalidArgument("init_info 'rank_labels' must be a list of strings of at most 256 bytes");
      }
      info.rank_labels.push_back(l.get<std::string>());
    }
  }
  if (const json* t = r.Find("timeout_seconds"); t != nullptr) {
    if (!t->is_number() || !(t->get<double>() > 0) || !std::isfinite(t->get<double>())) {
      return InvalidArgument("init_info timeout_seconds must be a positive finite number");
    }
    info.timeout_seconds = t->get<double>();
  }
  if (info.wsync_device_digests && info.uses_gloo()) {
    return InvalidArgument("init_info wsync_device_digests is for trainer ranks on GPUs (nccl_unique_id_b64); a "
                           "Gloo group's ranks digest on the host");
  }
  if (info.wsync_split_digests && !info.uses_gloo()) {
    return InvalidArgument("init_info wsync_split_digests is for trainer ranks on the host (a Gloo group); ranks on "
                           "GPUs digest on the device (wsync_device_digests)");
  }
  return info;
}

}  // namespace wsync
