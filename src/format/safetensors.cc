#include "format/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <numeric>
#include <set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/json_limits.h"
#include "core/shape_math.h"
#include "core/syscall.h"

namespace wsync {
namespace {

using nlohmann::json;

// Closes a file descriptor on scope exit.
struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) ::close(fd);
  }
};

uint64_t LoadLe64(const std::byte* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

// A non-negative integer JSON value that fits a u64, or nullopt.
std::optional<uint64_t> AsU64(const json& v) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer() && v.get<int64_t>() >= 0) return static_cast<uint64_t>(v.get<int64_t>());
  return std::nullopt;
}

// Parses one tensor entry of the header, of a file whose data section holds `data_size`
// bytes from `data_begin`; errors name the tensor (the caller adds the file).
Result<SafetensorsEntry> ParseEntry(const std::string& name, const json& v, uint64_t data_begin,
                                    uint64_t data_size, const SafetensorsHeaderOptions& o) {
  auto bad = [&](std::string_view why) {
    return InvalidArgument(fmt::format("tensor {}: {}", TextExcerpt(name, kMaxNameBytes), why));
  };
  if (!v.is_object()) return bad("entry is not an object");
  auto dtype_it = v.find("dtype");
  auto shape_it = v.find("shape");
  auto offs_it = v.find("data_offsets");
  if (dtype_it == v.end() || !dtype_it->is_string()) return bad("missing string \"dtype\"");
  if (shape_it == v.end() || !shape_it->is_array()) return bad("missing array \"shape\"");
  if (offs_it == v.end() || !offs_it->is_array() || offs_it->size() != 2) {
    return bad("\"data_offsets\" is not a [begin, end] pair");
  }
  SafetensorsEntry e;
  e.meta.name = name;
  auto dtype = DTypeFromSafetensorsName(dtype_it->get<std::string>());
  if (!dtype.ok()) return bad(o.quote_file ? dtype.status().message() : "unknown dtype");
  e.meta.dtype = *dtype;
  for (const json& d : *shape_it) {
    auto dim = AsU64(d);
    if (!dim || *dim > static_cast<uint64_t>(INT64_MAX)) return bad("shape has a non-integer or negative dimension");
    e.meta.shape.push_back(static_cast<int64_t>(*dim));
  }
  // Every partial product must fit int64 (a zero dimension after huge ones too), so that
  // numel() and nbytes() of the tensor are defined wherever they are used.
  std::optional<int64_t> numel = CheckedNumElements(e.meta.shape);
  if (!numel) return bad(o.quote_file ? fmt::format("shape {} overflows int64", ShapeString(e.meta.shape)) : "shape overflows int64");
  auto begin = AsU64((*offs_it)[0]);
  auto end = AsU64((*offs_it)[1]);
  if (!begin || !end || *begin > *end) {
    return bad(o.quote_file ? fmt::format("data_offsets [{}, {}] are not ordered non-negative integers",
                                          JsonExcerpt((*offs_it)[0]), JsonExcerpt((*offs_it)[1]))
                            : "data_offsets are not ordered non-negative integers");
  }
  if (*end > data_size) {
    return DataLoss(o.quote_file ? fmt::format("tensor {}: data_offsets [{}, {}] end past the {} data bytes of the "
                                               "file (truncated?)", name, *begin, *end, data_size)
                                 : fmt::format("tensor {} lies past the end of the file (truncated?)", name));
  }
  uint64_t want = 0;
  if (__builtin_mul_overflow(static_cast<uint64_t>(*numel), ItemSize(e.meta.dtype), &want) || want != *end - *begin) {
    return bad(o.quote_file ? fmt::format("data_offsets [{}, {}] hold {} bytes but {} {} needs {}", *begin, *end,
                                          *end - *begin, SafetensorsName(e.meta.dtype), ShapeString(e.meta.shape), want)
                            : "data_offsets do not span the bytes its shape and dtype need");
  }
  e.offset = data_begin + *begin;
  e.nbytes = want;
  return e;
}

}  // namespace

Result<uint64_t> SafetensorsHeaderLength(std::span<const std::byte> file_start, uint64_t file_size,
                                         std::string_view path, const SafetensorsHeaderOptions& o) {
  if (file_size < 8 || file_start.size() < 8) {
    return DataLoss(fmt::format("{}: file is {} bytes, too short for the 8-byte header length", path, file_size));
  }
  const uint64_t len = LoadLe64(file_start.data());
  if (len > o.max_header_bytes) {
    return InvalidArgument(o.quote_file ? fmt::format("{}: header length {} is over the {} byte limit", path, len,
                                                      o.max_header_bytes)
                                        : fmt::format("{}: header length is over the {} byte limit", path,
                                                      o.max_header_bytes));
  }
  if (len > file_size - 8) {
    return DataLoss(o.quote_file ? fmt::format("{}: header length {} runs past the end of the {}-byte file "
                                               "(truncated?)", path, len, file_size)
                                 : fmt::format("{}: header length runs past the end of the {}-byte file (truncated?)",
                                               path, file_size));
  }
  return len;
}

Result<SafetensorsHeader> ParseSafetensorsHeader(std::string_view header_json, uint64_t file_size,
                                                 std::string_view path, const SafetensorsHeaderOptions& o) {
  const uint64_t data_begin = 8 + static_cast<uint64_t>(header_json.size());
  if (data_begin > file_size) return DataLoss(fmt::format("{}: the header runs past the end of the file", path));
  // The depth bound of every untrusted JSON (core/json_limits.h); the parse below keeps
  // its own wording, which quotes the parser only when the file may be quoted.
  WSYNC_RETURN_IF_ERROR(CheckJsonDepth(header_json, fmt::format("{}: header", path)));
  json header;
  try {
    header = json::parse(header_json.begin(), header_json.end());
  } catch (const json::exception& e) {  // nlohmann reports the byte offset of the fault
    return InvalidArgument(o.quote_file ? fmt::format("{}: header is not valid JSON: {}", path, e.what())
                                        : fmt::format("{}: header is not valid JSON", path));
  }
  if (!header.is_object()) return InvalidArgument(fmt::format("{}: header is not a JSON object", path));

  const uint64_t data_size = file_size - data_begin;
  SafetensorsHeader out;
  out.entries.reserve(header.size());
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (o.max_name_bytes > 0 && it.key().size() > o.max_name_bytes) {
      return InvalidArgument(fmt::format("{}: a tensor name is longer than {} bytes", path, o.max_name_bytes));
    }
    if (it.key() == "__metadata__") {
      if (!it->is_object()) return InvalidArgument(fmt::format("{}: __metadata__ is not an object", path));
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string()) {
          return InvalidArgument(o.quote_file ? fmt::format("{}: __metadata__ value of {} is not a string", path, TextExcerpt(m.key()))
                                              : fmt::format("{}: a __metadata__ value is not a string", path));
        }
        out.metadata[m.key()] = m->get<std::string>();
      }
      continue;
    }
    auto e = ParseEntry(it.key(), *it, data_begin, data_size, o);
    if (!e.ok()) return e.status().WithContext(path);
    out.entries.push_back(std::move(*e));
  }

  std::sort(out.entries.begin(), out.entries.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
    return std::tie(a.offset, a.nbytes, a.meta.name) < std::tie(b.offset, b.nbytes, b.meta.name);
  });
  for (size_t i = 1; i < out.entries.size(); ++i) {
    const SafetensorsEntry& prev = out.entries[i - 1];
    const SafetensorsEntry& cur = out.entries[i];
    if (cur.offset < prev.offset + prev.nbytes) {
      if (!o.quote_file) {
        return InvalidArgument(fmt::format("{}: tensors {} and {} overlap", path, prev.meta.name, cur.meta.name));
      }
      return InvalidArgument(fmt::format("{}: tensor {} [{}, {}] overlaps tensor {} [{}, {}]", path, cur.meta.name,
                                         cur.offset - data_begin, cur.offset - data_begin + cur.nbytes,
                                         prev.meta.name, prev.offset - data_begin,
                                         prev.offset - data_begin + prev.nbytes));
    }
  }
  return out;
}

Result<SafetensorsHeader> ReadSafetensorsHeader(int fd, uint64_t file_size, std::string_view path,
                                                const SafetensorsHeaderOptions& o) {
  std::byte len_bytes[8] = {};
  ssize_t r = file_size < 8 ? 0 : RetryOnEintr([&] { return ::pread(fd, len_bytes, 8, 0); });
  if (r < 0) return ErrnoStatus(errno, fmt::format("reading {}", path));
  WSYNC_ASSIGN_OR_RETURN(uint64_t header_len,
                         SafetensorsHeaderLength(std::span(len_bytes, r == 8 ? 8 : 0), file_size, path, o));
  std::string header(header_len, '\0');
  size_t done = 0;
  while (done < header_len) {
    ssize_t n = RetryOnEintr(
        [&] { return ::pread(fd, header.data() + done, header_len - done, static_cast<off_t>(8 + done)); });
    if (n < 0) return ErrnoStatus(errno, fmt::format("reading the header of {}", path));
    if (n == 0) return DataLoss(fmt::format("{}: short read of the header", path));
    done += static_cast<size_t>(n);
  }
  return ParseSafetensorsHeader(header, file_size, path, o);
}

Result<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, fmt::format("opening safetensors file {}", path));
  FdCloser closer{fd};
  struct stat st;
  if (::fstat(fd, &st) != 0) return ErrnoStatus(errno, fmt::format("stat of {}", path));
  if (!S_ISREG(st.st_mode)) return InvalidArgument(fmt::format("{} is not a regular file", path));
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) {
    return DataLoss(fmt::format("{}: file is {} bytes, too short for the 8-byte header length",
                                path, size));
  }

  SafetensorsFile f;
  f.path_ = path;
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return ErrnoStatus(errno, fmt::format("mapping {} ({} bytes)", path, size));
  f.map_ = static_cast<std::byte*>(p);
  f.map_size_ = size;

  const SafetensorsHeaderOptions options;
  WSYNC_ASSIGN_OR_RETURN(uint64_t header_len, SafetensorsHeaderLength(std::span(f.map_, size), size, path, options));
  const auto* header_begin = reinterpret_cast<const char*>(f.map_ + 8);
  WSYNC_ASSIGN_OR_RETURN(SafetensorsHeader header,
                         ParseSafetensorsHeader(std::string_view(header_begin, header_len), size, path, options));
  f.metadata_ = std::move(header.metadata);
  f.tensors_.reserve(header.entries.size());
  f.file_offsets_.reserve(header.entries.size());
  for (SafetensorsEntry& e : header.entries) {
    f.index_.emplace(e.meta.name, f.tensors_.size());
    f.file_offsets_.push_back(e.offset);
    f.tensors_.push_back(std::move(e.meta));
  }
  return f;
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept { *this = std::move(other); }

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept {
  if (this != &other) {
    Unmap();
    path_ = std::move(other.path_);
    map_ = std::exchange(other.map_, nullptr);
    map_size_ = std::exchange(other.map_size_, 0);
    tensors_ = std::move(other.tensors_);
    file_offsets_ = std::move(other.file_offsets_);
    index_ = std::move(other.index_);
    metadata_ = std::move(other.metadata_);
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() { Unmap(); }

void SafetensorsFile::Unmap() {
  if (map_ != nullptr) ::munmap(map_, map_size_);
  map_ = nullptr;
  map_size_ = 0;
}

std::span<const std::byte> SafetensorsFile::BytesAt(size_t i) const {
  return {map_ + file_offsets_[i], tensors_[i].nbytes()};
}

TensorRef SafetensorsFile::RefAt(size_t i) const {
  const TensorMeta& m = tensors_[i];
  return TensorRef{m.name, m.dtype, m.shape, BytesAt(i), Device{}};
}

Result<std::span<const std::byte>> SafetensorsFile::Bytes(std::string_view name) const {
  auto it = index_.find(name);
  if (it == index_.end()) return NotFound(fmt::format("{} has no tensor {}", path_, name));
  return BytesAt(it->second);
}

Status WriteSafetensors(const std::string& path, std::span<const TensorRef> tensors,
                        const std::map<std::string, std::string>& metadata, bool durable) {
  // Largest item size first keeps every tensor aligned to its item size.
  std::vector<size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return ItemSize(tensors[a].dtype) > ItemSize(tensors[b].dtype);
  });

  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string_view> seen;
  uint64_t offset = 0;
  for (size_t i : order) {
    const TensorRef& t = tensors[i];
    if (t.name.empty() || t.name == "__metadata__") {
      return InvalidArgument(fmt::format("writing {}: tensor #{} has the reserved name '{}'", path, i, t.name));
    }
    if (!seen.insert(t.name).second) {
      return InvalidArgument(fmt::format("writing {}: tensor {} appears twice", path, t.name));
    }
    if (!t.device.is_cpu()) {
      return InvalidArgument(fmt::format("writing {}: tensor {} is on {}, not the CPU", path, t.name,
                                         t.device.ToString()));
    }
    if (std::any_of(t.shape.begin(), t.shape.end(), [](int64_t d) { return d < 0; })) {
      return InvalidArgument(fmt::format("writing {}: tensor {} has a negative dimension in {}", path,
                                         t.name, ShapeString(t.shape)));
    }
    std::optional<int64_t> bytes = CheckedNumBytes(t.shape, t.dtype);
    if (!bytes) {
      return InvalidArgument(fmt::format("writing {}: tensor {} of shape {} has more bytes than int64 counts",
                                         path, t.name, ShapeString(t.shape)));
    }
    const size_t want = static_cast<size_t>(*bytes);
    if (t.bytes.size() != want) {
      return InvalidArgument(fmt::format("writing {}: tensor {} has {} bytes, {} {} needs {}", path,
                                         t.name, t.bytes.size(), SafetensorsName(t.dtype),
                                         ShapeString(t.shape), want));
    }
    header[std::string(t.name)] = {{"dtype", SafetensorsName(t.dtype)},
                                   {"shape", std::vector<int64_t>(t.shape.begin(), t.shape.end())},
                                   {"data_offsets", {offset, offset + want}}};
    offset += want;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::byte len_le[8];
  for (int i = 0; i < 8; ++i) len_le[i] = std::byte((text.size() >> (8 * i)) & 0xff);

  const std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoStatus(errno, fmt::format("creating {}", tmp));
  Status st = [&]() -> Status {
    FdCloser closer{fd};
    auto write_all = [&](const void* data, size_t n, std::string_view what) -> Status {
      const char* p = static_cast<const char*>(data);
      while (n > 0) {
        ssize_t w = RetryOnEintr([&] { return ::write(fd, p, std::min<size_t>(n, size_t{1} << 30)); });
        if (w < 0) return ErrnoStatus(errno, fmt::format("writing {} of {}", what, tmp));
        p += w;
        n -= static_cast<size_t>(w);
      }
      return Status::Ok();
    };
    WSYNC_RETURN_IF_ERROR(write_all(len_le, 8, "header length"));
    WSYNC_RETURN_IF_ERROR(write_all(text.data(), text.size(), "header"));
    for (size_t i : order) {
      const TensorRef& t = tensors[i];
      WSYNC_RETURN_IF_ERROR(write_all(t.bytes.data(), t.bytes.size(), fmt::format("tensor {}", t.name)));
    }
    if (durable && ::fsync(fd) != 0) return ErrnoStatus(errno, fmt::format("fsync of {}", tmp));
    closer.fd = -1;
    if (::close(fd) != 0) return ErrnoStatus(errno, fmt::format("closing {}", tmp));
    if (::rename(tmp.c_str(), path.c_str()) != 0) {
      return ErrnoStatus(errno, fmt::format("renaming {} to {}", tmp, path));
    }
    return Status::Ok();
  }();
  if (!st.ok()) {
    ::unlink(tmp.c_str());
    return st;
  }
  if (!durable) return Status::Ok();
  // Make the rename itself durable.
  size_t slash = path.rfind('/');
  std::string dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
  return Status::Ok();
}

}  // namespace wsync
