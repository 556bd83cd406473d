#include "backends/ipc/protocol.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <random>
#include <set>

#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "control/init_payloads.h"
#include "core/checked_math.h"
#include "core/digest.h"
#include "core/json_limits.h"
#include "plan/packing.h"

namespace wsync {

using nlohmann::json;

namespace {

uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

// A non-negative integer, however nlohmann stored it (parsed text gives unsigned, code
// that assigns an int gives signed).
bool IsNonNegativeInteger(const json& v) {
  return v.is_number_unsigned() || (v.is_number_integer() && v.get<int64_t>() >= 0);
}

// Reads `field` of `j` (an object named `where` in messages) into `out`.
template <typename T>
Status Read(const json& j, const char* where, const char* field, bool required, std::optional<T>* out) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) {
    if (required) return InvalidArgument(fmt::format("{} is missing '{}'", where, field));
    return Status::Ok();
  }
  bool ok = false;
  if constexpr (std::is_same_v<T, bool>) {
    ok = it->is_boolean();
  } else if constexpr (std::is_integral_v<T>) {
    // Exactly representable in T, never narrowed: 4294967297 is not an int 1, -7 no size.
    if (!it->is_number_integer()) {
      return InvalidArgument(fmt::format("{} '{}' must be an integer, got {}", where, field, JsonExcerpt(*it)));
    }
    std::optional<T> v = it->is_number_unsigned() ? CheckedCast<T>(it->get<uint64_t>())
                                                  : CheckedCast<T>(it->get<int64_t>());
    if (!v) {
      return InvalidArgument(fmt::format("{} '{}' = {} is outside {}..{}", where, field, JsonExcerpt(*it),
                                         std::numeric_limits<T>::min(), std::numeric_limits<T>::max()));
    }
    *out = *v;
    return Status::Ok();
  } else if constexpr (std::is_floating_point_v<T>) {
    ok = it->is_number() && std::isfinite(it->get<double>());
  } else if constexpr (std::is_same_v<T, json>) {
    ok = it->is_object();
  } else {
    ok = it->is_string();
  }
  if (!ok) return InvalidArgument(fmt::format("{} '{}' has the wrong type: {}", where, field, JsonExcerpt(*it)));
  *out = it->get<T>();
  return Status::Ok();
}

Result<std::vector<uint64_t>> ReadU64List(const json& j, const char* field) {
  auto it = j.find(field);
  if (it == j.end()) return InvalidArgument(fmt::format("update_info is missing '{}' (wsync ipc protocol)", field));
  if (!it->is_array()) return InvalidArgument(fmt::format("update_info '{}' must be a list of non-negative integers", field));
  std::vector<uint64_t> out;
  out.reserve(it->size());
  for (size_t i = 0; i < it->size(); ++i) {
    const json& v = (*it)[i];
    if (!IsNonNegativeInteger(v)) {
      return InvalidArgument(fmt::format("update_info {}[{}] must be a non-negative integer, got {}", field, i,
                                         JsonExcerpt(v)));
    }
    out.push_back(v.get<uint64_t>());
  }
  return out;
}

bool IsSessionId(const std::string& s) { return s.size() == 32 && IsLowerHex(s); }

}  // namespace

json IpcBufferDesc::ToJson() const {
  json j{{"kind", kind}, {"offset", offset}, {"stride", stride}, {"handle", handle}};
  if (publisher != 0) j["publisher"] = publisher;
  return j;
}

Result<IpcBufferDesc> IpcBufferDesc::Parse(const json& j, const std::string& key, const char* parent) {
  if (key.size() > kMaxNameBytes) {
    return InvalidArgument(fmt::format("{} buffers has a device key of {} bytes, over the limit of {}", parent,
                                       key.size(), kMaxNameBytes));
  }
  std::string where = fmt::format("{} buffers['{}']", parent, key);
  if (!j.is_object()) return InvalidArgument(where + " must be an object");
  static const std::set<std::string> kKnown = {"kind", "offset", "stride", "handle", "publisher"};
  for (const auto& [k, _] : j.items()) {
    if (!kKnown.contains(k)) return InvalidArgument(fmt::format("{} has unknown field '{}'", where, TextExcerpt(k)));
  }
  std::optional<std::string> kind;
  std::optional<uint64_t> offset, stride;
  std::optional<json> handle;
  std::optional<int> publisher;
  WSYNC_RETURN_IF_ERROR(Read(j, where.c_str(), "kind", true, &kind));
  WSYNC_RETURN_IF_ERROR(Read(j, where.c_str(), "publisher", false, &publisher));
  if (publisher && (*publisher < 0 || *publisher >= kIpcMaxPublishers)) {
    return InvalidArgument(fmt::format("{} publisher {} must be within 0..{}", where, *publisher, kIpcMaxPublishers - 1));
  }
  WSYNC_RETURN_IF_ERROR(Read(j, where.c_str(), "offset", true, &offset));
  WSYNC_RETURN_IF_ERROR(Read(j, where.c_str(), "stride", true, &stride));
  WSYNC_RETURN_IF_ERROR(Read(j, where.c_str(), "handle", false, &handle));
  if (*kind != "shm" && *kind != "cuda_ipc" && *kind != "cuda_fd" && *kind != "none") {
    return InvalidArgument(fmt::format("{} kind '{}' is not one of shm, cuda_ipc, cuda_fd, none", where, TextExcerpt(*kind)));
  }
  IpcBufferDesc d;
  d.kind = *kind;
  d.offset = *offset;
  d.stride = *stride;
  if (handle) d.handle = *handle;
  d.publisher = publisher.value_or(0);
  return d;
}

json IpcInitInfo::ToJson() const {
  json b = json::object();
  for (const auto& [key, desc] : buffers) b[key] = desc.ToJson();
  json j = {{"wsync_ipc_protocol", wsync_ipc_protocol},
            {"packed", packed},
            {"session", session},
            {"control_path", control_path},
            {"control_bytes", control_bytes},
            {"num_slots", num_slots},
            {"slot_bytes", slot_bytes},
            {"reader_offset", reader_offset},
            {"reader_count", reader_count},
            {"buffers", b}};
  if (timeout_seconds) j["timeout_seconds"] = *timeout_seconds;
  if (wsync_device_digests) j["wsync_device_digests"] = true;
  return j;
}

Result<IpcInitInfo> IpcInitInfo::Parse(const json& j) {
  static const std::set<std::string> kKnown = {
      "wsync_ipc_protocol", "packed", "session", "control_path", "control_bytes", "num_slots",
      "slot_bytes", "reader_offset", "reader_count", "buffers", "timeout_seconds",
      "wsync_device_digests"};
  const char* where = "init_info";
  if (!j.contains("wsync_ipc_protocol")) {
    return InvalidArgument(
        "init_info has no 'wsync_ipc_protocol': this server's ipc backend speaks wsync's ipc "
        "protocol (a shared staging region exported once), not vLLM's torch-pickled CUDA IPC "
        "handles; use a wsync trainer (`wsync push --backend ipc`)");
  }
  for (const auto& [key, _] : j.items()) {
    if (!kKnown.contains(key)) {
      return InvalidArgument(fmt::format("init_info has unknown field '{}'", TextExcerpt(key)));
    }
  }
  std::optional<int> version, num_slots, reader_offset, reader_count;
  std::optional<bool> packed;
  std::optional<std::string> session, control_path;
  std::optional<uint64_t> control_bytes, slot_bytes;
  std::optional<double> timeout;
  std::optional<bool> device_digests;
  WSYNC_RETURN_IF_ERROR(Read(j, where, "wsync_ipc_protocol", true, &version));
  if (*version != kIpcProtocolVersion) {
    return InvalidArgument(fmt::format("init_info wsync_ipc_protocol {} is not supported (this server speaks {})",
                                       *version, kIpcProtocolVersion));
  }
  WSYNC_RETURN_IF_ERROR(Read(j, where, "packed", false, &packed));
  WSYNC_RETURN_IF_ERROR(Read(j, where, "session", true, &session));
  WSYNC_RETURN_IF_ERROR(Read(j, where, "control_path", true, &control_path));
  WSYNC_RETURN_IF_ERROR(Read(j, where, "control_bytes", true, &control_bytes));
  WSYNC_RETURN_IF_ERROR(Read(j, where, "num_slots", true, &num_slots));
  WSYNC_RETURN_IF_ERROR(Read(j, where, "slot_bytes", true, &slot_bytes));
  WSYNC_RETURN_IF_ERROR(Read(j, where, "reader_offset", true, &reader_offset));
  WSYNC_RETURN_IF_ERROR(Read(j, where, "reader_count", true, &reader_count));
  WSYNC_RETURN_IF_ERROR(Read(j, where, "timeout_seconds", false, &timeout));
  WSYNC_RETURN_IF_ERROR(Read(j, where, "wsync_device_digests", false, &device_digests));
  IpcInitInfo info;
  if (packed && !*packed) {
    return Unimplemented(
        "init_info packed=false asks for one handle per tensor; wsync's ipc backend moves packed "
        "chunks through one exported staging region, or (GPU) copies straight from the trainer's one "
        "exported allocation, announced per update (update_info zero_copy)");
  }
  if (!IsSessionId(*session)) {
    return InvalidArgument(fmt::format("init_info session '{}' is not 32 lowercase hex digits", IpcClip(*session, 64)));
  }
  if (control_path->empty() || control_path->front() != '/' || control_path->size() > 4096 ||
      !std::all_of(control_path->begin(), control_path->end(), [](char c) { return c > ' ' && c < 127; })) {
    return InvalidArgument(fmt::format("init_info control_path '{}' must be an absolute path of at most 4096 "
                                       "printable ASCII characters", IpcClip(*control_path, 256)));
  }
  if (*num_slots < 1 || *num_slots > kIpcMaxSlots) {
    return InvalidArgument(fmt::format("init_info num_slots {} must be within 1..{}", *num_slots, kIpcMaxSlots));
  }
  if (*slot_bytes == 0) return InvalidArgument("init_info slot_bytes must be positive");
  if (*reader_count < 1 || *reader_count > kIpcMaxReaders) {
    return InvalidArgument(fmt::format("init_info reader_count {} must be within 1..{}", *reader_count, kIpcMaxReaders));
  }
  if (*reader_offset < 0 || *reader_offset >= *reader_count) {
    return InvalidArgument(fmt::format("init_info reader_offset {} must be within 0..{}", *reader_offset, *reader_count - 1));
  }
  if (timeout && (*timeout <= 0 || *timeout > kIpcMaxTimeoutSeconds)) {
    return InvalidArgument(fmt::format("init_info timeout_seconds {} must be within (0, {}]", *timeout,
                                       kIpcMaxTimeoutSeconds));
  }
  info.session = *session;
  info.control_path = *control_path;
  info.control_bytes = *control_bytes;
  info.num_slots = *num_slots;
  info.slot_bytes = *slot_bytes;
  info.reader_offset = *reader_offset;
  info.reader_count = *reader_count;
  info.timeout_seconds = timeout;
  info.wsync_device_digests = device_digests.value_or(false);
  auto it = j.find("buffers");
  if (it == j.end() || !it->is_object() || it->empty()) {
    return InvalidArgument("init_info 'buffers' must be a non-empty object {device key: buffer}");
  }
  for (const auto& [key, value] : it->items()) {
    WSYNC_ASSIGN_OR_RETURN(IpcBufferDesc d, IpcBufferDesc::Parse(value, key));
    if (d.kind != "none" && d.stride < info.slot_bytes) {
      return InvalidArgument(fmt::format("init_info buffers['{}'] stride {} is below slot_bytes {}", key,
                                         d.stride, info.slot_bytes));
    }
    info.buffers.emplace(key, std::move(d));
  }
  return info;
}

Result<const IpcBufferDesc*> IpcInitInfo::FindBuffer(const std::string& key) const {
  auto it = buffers.find(key);
  if (it != buffers.end()) return &it->second;
  std::vector<std::string> keys;
  for (const auto& [k, _] : buffers) keys.push_back(k);
  return InvalidArgument(fmt::format(
      "init_info buffers has no entry for this server's device {} (offered: {}): the ipc backend needs the "
      "trainer on the same host (CPU) or the same GPU", key, fmt::join(keys, ", ")));
}

void IpcUpdateInfo::AddTo(json* u) const {
  (*u)["wsync_ipc_protocol"] = kIpcProtocolVersion;
  (*u)["session"] = session;
  (*u)["tensor_sizes"] = tensor_sizes;
  (*u)["tensor_offsets"] = tensor_offsets;
  (*u)["chunk_ends"] = chunk_ends;
  if (zero_copy) {
    json z = {{"generation", zero_copy->generation}, {"bytes", zero_copy->bytes}};
    if (!zero_copy->buffers.empty()) {
      json b = json::object();
      for (const auto& [key, desc] : zero_copy->buffers) b[key] = desc.ToJson();
      z["buffers"] = b;
    }
    (*u)["zero_copy"] = z;
  }
}

namespace {

Result<IpcZeroCopy> ParseZeroCopy(const json& j) {
  const char* where = "update_info zero_copy";
  if (!j.is_object()) return InvalidArgument("update_info 'zero_copy' must be an object");
  static const std::set<std::string> kKnown = {"generation", "bytes", "buffers"};
  for (const auto& [k, _] : j.items()) {
    if (!kKnown.contains(k)) return InvalidArgument(fmt::format("{} has unknown field '{}'", where, TextExcerpt(k)));
  }
  std::optional<uint64_t> generation, bytes;
  WSYNC_RETURN_IF_ERROR(Read(j, where, "generation", true, &generation));
  WSYNC_RETURN_IF_ERROR(Read(j, where, "bytes", true, &bytes));
  if (*generation == 0) return InvalidArgument("update_info zero_copy generation must be >= 1");
  IpcZeroCopy z;
  z.generation = *generation;
  z.bytes = *bytes;
  if (auto it = j.find("buffers"); it != j.end()) {
    if (!it->is_object()) return InvalidArgument("update_info zero_copy 'buffers' must be an object {device key: buffer}");
    for (const auto& [key, value] : it->items()) {
      WSYNC_ASSIGN_OR_RETURN(IpcBufferDesc d, IpcBufferDesc::Parse(value, key, where));
      if (d.kind != "cuda_ipc" && d.kind != "cuda_fd") {
        return InvalidArgument(fmt::format("{} buffers['{}'] kind '{}' is not cuda_ipc or cuda_fd", where, key, d.kind));
      }
      z.buffers.emplace(key, std::move(d));
    }
  }
  return z;
}

}  // namespace

Result<IpcUpdateInfo> IpcUpdateInfo::Parse(const json& j) {
  if (j.contains("ipc_handles") || j.contains("ipc_handles_pickled")) {
    return InvalidArgument(
        "update_info carries ipc_handles (vLLM's torch-pickled CUDA IPC handles), which wsync "
        "does not deserialize; wsync's ipc backend reads chunks from the staging region mapped "
        "at init");
  }
  const char* where = "update_info";
  std::optional<int> version;
  std::optional<std::string> session;
  WSYNC_RETURN_IF_ERROR(Read(j, where, "wsync_ipc_protocol", true, &version));
  if (*version != kIpcProtocolVersion) {
    return InvalidArgument(fmt::format("update_info wsync_ipc_protocol {} is not supported (this server speaks {})",
                                       *version, kIpcProtocolVersion));
  }
  WSYNC_RETURN_IF_ERROR(Read(j, where, "session", true, &session));
  if (!IsSessionId(*session)) {
    return InvalidArgument(fmt::format("update_info session '{}' is not 32 lowercase hex digits", TextExcerpt(*session)));
  }
  IpcUpdateInfo u;
  u.session = *session;
  WSYNC_ASSIGN_OR_RETURN(u.tensor_sizes, ReadU64List(j, "tensor_sizes"));
  WSYNC_ASSIGN_OR_RETURN(u.tensor_offsets, ReadU64List(j, "tensor_offsets"));
  WSYNC_ASSIGN_OR_RETURN(u.chunk_ends, ReadU64List(j, "chunk_ends"));
  if (auto it = j.find("zero_copy"); it != j.end() && !it->is_null()) {
    WSYNC_ASSIGN_OR_RETURN(u.zero_copy, ParseZeroCopy(*it));
  }
  return u;
}

Status IpcUpdateInfo::Validate(std::span<const TensorMeta> tensors, uint64_t slot_bytes) const {
  size_t n = tensors.size();
  if (tensor_sizes.size() != n || tensor_offsets.size() != n) {
    return InvalidArgument(fmt::format(
        "update_info lists must have one entry per tensor: names {}, tensor_sizes {}, tensor_offsets {}",
        n, tensor_sizes.size(), tensor_offsets.size()));
  }
  if ((n > 0 || !chunk_ends.empty()) && (chunk_ends.empty() || chunk_ends.back() != n)) {
    return InvalidArgument(fmt::format("update_info chunk_ends must end at the number of tensors ({}), got {}", n,
                                       chunk_ends.empty() ? std::string("[]") : std::to_string(chunk_ends.back())));
  }
  if (zero_copy && chunk_ends.size() > 1) {
    return InvalidArgument(fmt::format("a zero-copy update is one chunk (one go), but chunk_ends has {} entries",
                                       chunk_ends.size()));
  }
  const uint64_t limit = zero_copy ? zero_copy->bytes : slot_bytes;
  for (size_t k = 0; k < chunk_ends.size(); ++k) {
    uint64_t first = chunk_first(k), end = chunk_ends[k];
    if (end <= first || end > n) {
      return InvalidArgument(fmt::format("update_info chunk_ends[{}] = {} does not follow {} (chunks must be non-empty)",
                                         k, end, first));
    }
    uint64_t used = 0;
    for (uint64_t i = first; i < end; ++i) {
      const TensorMeta& t = tensors[i];
      if (tensor_sizes[i] != t.nbytes()) {
        return InvalidArgument(fmt::format("tensor_sizes[{}] of {} is {} bytes, but {} x {} is {} bytes", i, t.name,
                                           tensor_sizes[i], TorchName(t.dtype), ShapeString(t.shape), t.nbytes()));
      }
      if (tensor_offsets[i] < used) {
        return InvalidArgument(fmt::format("tensor_offsets[{}] of {} is {}, overlapping the tensor before it (ends at {})",
                                           i, t.name, tensor_offsets[i], used));
      }
      if (tensor_offsets[i] > limit || tensor_sizes[i] > limit - tensor_offsets[i]) {
        if (zero_copy) {
          return InvalidArgument(fmt::format(
              "zero-copy tensor {} ends at byte {}, beyond the {} bytes of the trainer's exported tensors", t.name,
              tensor_offsets[i] + tensor_sizes[i], limit));
        }
        return InvalidArgument(fmt::format(
            "chunk {}/{} needs {} bytes (up to the end of {}), the mapped slots hold {}", k + 1,
            chunk_ends.size(), tensor_offsets[i] + tensor_sizes[i], t.name, slot_bytes));
      }
      used = tensor_offsets[i] + tensor_sizes[i];
    }
  }
  return Status::Ok();
}

Result<IpcPlan> PlanIpcChunks(std::span<const TensorMeta> tensors, uint64_t slot_bytes) {
  if (slot_bytes == 0) return InvalidArgument("ipc slot size must be positive");
  ChunkCut cut{ChunkCut::Rule::kCloseBeforeOverflow, slot_bytes, kIpcAlignment, "the ipc staging slot"};
  WSYNC_ASSIGN_OR_RETURN(ChunkPlan chunks, CutChunks(tensors, cut));
  IpcPlan plan;
  plan.tensor_offsets.assign(chunks.offset_in_chunk.begin(), chunks.offset_in_chunk.end());
  for (const Chunk& c : chunks.chunks) {
    plan.chunk_ends.push_back(c.end);
    plan.chunk_bytes.push_back(c.bytes);
  }
  for (const TensorMeta& t : tensors) plan.payload_bytes += t.nbytes();
  return plan;
}

uint64_t IpcSlotBytes(std::span<const TensorMeta> tensors, uint64_t bucket_bytes) {
  uint64_t largest = 0, whole = 0;
  for (const TensorMeta& t : tensors) {
    largest = std::max<uint64_t>(largest, t.nbytes());
    whole = AlignUp(whole, kIpcAlignment) + t.nbytes();
  }
  uint64_t slot = std::max(bucket_bytes, largest);
  return std::max<uint64_t>(std::min(slot, whole), 1);
}

Result<int> IpcReaderOffsets(const std::vector<int>& world_sizes, int dp, std::vector<int>* offsets) {
  // The broadcast group's numbering, less its trainer rank: the same deployments, the same
  // checked sums.
  WSYNC_ASSIGN_OR_RETURN(NcclFleetLayout fleet, NcclFleetRanks(world_sizes, dp, /*base_rank_offset=*/1));
  offsets->clear();
  for (int o : fleet.rank_offsets) offsets->push_back(o - 1);
  return fleet.world_size - 1;
}

std::string IpcClip(std::string_view s, size_t max_bytes) {
  if (s.size() <= max_bytes) return std::string(s);
  size_t n = max_bytes;
  while (n > 0 && (static_cast<unsigned char>(s[n]) & 0xC0) == 0x80) --n;  // s[n] continues a sequence
  return std::string(s.substr(0, n)) + "...";
}

std::string HostDeviceKey() {
  static const std::string key = [] {
    std::ifstream f("/proc/sys/kernel/random/boot_id");
    std::string id;
    std::getline(f, id);
    if (id.empty()) {
      char host[256] = {};
      gethostname(host, sizeof(host) - 1);
      id = host;
    }
    return "host-" + id;
  }();
  return key;
}

std::string NewSessionId() {
  std::random_device rd;
  std::string out;
  for (int i = 0; i < 4; ++i) out += fmt::format("{:08x}", rd());
  return out;
}

}  // namespace wsync
