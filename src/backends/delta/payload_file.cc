#include "backends/delta/payload_file.h"

#include <unistd.h>

#include <utility>

#include <fmt/format.h>

#include "core/syscall.h"

namespace wsync::delta {

Result<std::vector<TensorLocation>> ReadSafetensorsLayout(int fd, uint64_t size, const std::string& path) {
  WSYNC_ASSIGN_OR_RETURN(SafetensorsHeader header, ReadSafetensorsHeader(fd, size, path, kUntrustedHeader));
  std::vector<TensorLocation> out;
  out.reserve(header.entries.size());
  for (SafetensorsEntry& e : header.entries) out.push_back({std::move(e.meta), path, e.offset, e.nbytes});
  return out;
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
    ssize_t r = RetryOnEintr([&] { return ::pread(file.fd.get(), data + done, size - done, static_cast<off_t>(done)); });
    if (r < 0) return ErrnoStatus(errno, fmt::format("reading {}", file.path));
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
