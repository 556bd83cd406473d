#include "backends/delta/payload_file.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/checked_math.h"

namespace wsync::delta {
namespace {

using nlohmann::json;

uint64_t LoadLe64(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// A non-negative integer JSON value, or nullopt.
std::optional<uint64_t> AsU64(const json& v) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer() && v.get<int64_t>() >= 0) return static_cast<uint64_t>(v.get<int64_t>());
  return std::nullopt;
}

}  // namespace

Result<std::vector<TensorLocation>> ParseSafetensorsHeader(std::string_view header, uint64_t file_size,
                                                           const std::string& path) {
  json j = json::parse(header.begin(), header.end(), nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return InvalidArgument(fmt::format("{}: header is not a JSON object", path));
  const uint64_t data_start = 8 + header.size();
  if (data_start > file_size) return DataLoss(fmt::format("{}: the header runs past the end of the file", path));
  const uint64_t data_size = file_size - data_start;
  std::vector<TensorLocation> out;
  for (auto item = j.begin(); item != j.end(); ++item) {
    const std::string& name = item.key();
    const json& v = item.value();
    if (name == "__metadata__") continue;
    if (name.size() > kMaxTensorNameBytes) {
      return InvalidArgument(fmt::format("{}: a tensor name is longer than {} bytes", path, kMaxTensorNameBytes));
    }
    auto bad = [&](std::string_view why) { return InvalidArgument(fmt::format("{}: tensor {}: {}", path, name, why)); };
    if (!v.is_object()) return bad("entry is not an object");
    auto dtype = v.find("dtype"), shape = v.find("shape"), off = v.find("data_offsets");
    if (dtype == v.end() || shape == v.end() || off == v.end()) return bad("entry needs dtype, shape and data_offsets");
    if (!off->is_array() || off->size() != 2) return bad("data_offsets must be two non-negative integers");
    std::optional<uint64_t> begin = AsU64((*off)[0]), end = AsU64((*off)[1]);
    if (!begin || !end) return bad("data_offsets must be two non-negative integers");
    TensorLocation loc;
    loc.meta.name = name;
    if (!dtype->is_string()) return bad("dtype is not a string");
    Result<DType> dt = DTypeFromSafetensorsName(dtype->get<std::string>());
    if (!dt.ok()) return bad("unknown dtype");
    loc.meta.dtype = *dt;
    if (!shape->is_array()) return bad("shape is not an array");
    uint64_t nbytes = ItemSize(loc.meta.dtype);
    for (const auto& d : *shape) {
      std::optional<uint64_t> dim = AsU64(d);
      if (!dim || *dim > static_cast<uint64_t>(INT64_MAX)) return bad("shape has a negative or non-integer dimension");
      std::optional<uint64_t> n = CheckedMul(nbytes, *dim);
      if (!n) return bad("shape's byte size overflows 64 bits");
      nbytes = *n;
      loc.meta.shape.push_back(static_cast<int64_t>(*dim));
    }
    if (*end < *begin || *end > data_size) {
      return DataLoss(fmt::format("{}: tensor {} lies past the end of the file", path, name));
    }
    if (*end - *begin != nbytes) {
      return bad(fmt::format("data_offsets span {} bytes, shape and dtype need {}", *end - *begin, nbytes));
    }
    loc.path = path;
    loc.offset = data_start + *begin;
    loc.nbytes = nbytes;
    out.push_back(std::move(loc));
  }
  // No two tensors may share bytes: their patches are applied on different threads.
  std::vector<const TensorLocation*> sorted;
  for (const TensorLocation& l : out) sorted.push_back(&l);
  std::sort(sorted.begin(), sorted.end(), [](auto* a, auto* b) { return a->offset < b->offset; });
  for (size_t i = 1; i < sorted.size(); ++i) {
    if (sorted[i - 1]->offset + sorted[i - 1]->nbytes > sorted[i]->offset) {
      return InvalidArgument(fmt::format("{}: tensors {} and {} overlap", path, sorted[i - 1]->meta.name,
                                         sorted[i]->meta.name));
    }
  }
  return out;
}

Result<std::vector<TensorLocation>> ReadSafetensorsLayout(int fd, uint64_t size, const std::string& path) {
  unsigned char len_bytes[8];
  if (size < 8 || ::pread(fd, len_bytes, 8, 0) != 8) return DataLoss(fmt::format("{}: shorter than 8 bytes", path));
  uint64_t header_len = LoadLe64(len_bytes);
  if (header_len > kMaxLayoutHeaderBytes || header_len > size - 8) {
    return DataLoss(fmt::format("{}: its header length does not fit the file ({} bytes) or the {} byte limit", path,
                                size, kMaxLayoutHeaderBytes));
  }
  std::string header(header_len, '\0');
  size_t done = 0;
  while (done < header_len) {
    ssize_t r = ::pread(fd, header.data() + done, header_len - done, static_cast<off_t>(8 + done));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return DataLoss(fmt::format("{}: short read of the header", path));
    done += static_cast<size_t>(r);
  }
  return ParseSafetensorsHeader(header, size, path);
}

Result<PayloadFile> PayloadFile::Read(const RegularFile& file, uint64_t max_bytes, PayloadBuffer* buffer) {
  if (file.size > max_bytes) {
    return InvalidArgument(fmt::format("{} is {} bytes, more than this version's payload may hold ({} bytes)",
                                       file.path, file.size, max_bytes));
  }
  PayloadFile p;
  p.path_ = file.path;
  WSYNC_ASSIGN_OR_RETURN(std::vector<TensorLocation> layout,
                         ReadSafetensorsLayout(file.fd.get(), file.size, file.path));
  const size_t size = static_cast<size_t>(file.size);
  if (buffer->capacity < size) {
    size_t grown = size + size / 4;  // room for the next versions' slightly larger files
    buffer->data.reset(new std::byte[grown]);
    buffer->capacity = grown;
  }
  std::byte* data = buffer->data.get();
  p.data_ = data;
  size_t done = 0;
  while (done < size) {
    ssize_t r = ::pread(file.fd.get(), data + done, size - done, static_cast<off_t>(done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return ErrnoStatus(fmt::format("reading {}", file.path), errno);
    if (r == 0) return DataLoss(fmt::format("{} shrank while it was read", file.path));
    done += static_cast<size_t>(r);
  }
  for (TensorLocation& l : layout) p.entries_.emplace(std::move(l.meta.name), std::make_pair(l.offset, l.nbytes));
  return p;
}

Result<std::span<const std::byte>> PayloadFile::Bytes(std::string_view key) const {
  auto it = entries_.find(key);
  if (it == entries_.end()) return NotFound(fmt::format("{} holds no entry {}", path_, key));
  return std::span<const std::byte>(data_ + it->second.first, it->second.second);
}

}  // namespace wsync::delta
