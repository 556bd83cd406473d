#include "wsync/tensor.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstdint>
#include <charconv>
#include <cstring>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/shape_math.h"
#include "core/syscall.h"

namespace wsync {

std::string Device::ToString() const {
  return is_cpu() ? std::string("cpu") : fmt::format("cuda:{}", index);
}

Result<Device> Device::Parse(std::string_view text) {
  if (text == "cpu") return Device{};
  std::string_view rest = text;
  if (rest.starts_with("cuda")) {
    rest.remove_prefix(4);
    if (rest.empty()) return Device{Kind::kCuda, 0};
    if (rest.front() == ':') {
      rest.remove_prefix(1);
      int index = -1;
      auto [ptr, ec] = std::from_chars(rest.data(), rest.data() + rest.size(), index);
      if (ec == std::errc() && ptr == rest.data() + rest.size() && index >= 0) {
        return Device{Kind::kCuda, index};
      }
    }
  }
  return InvalidArgument(fmt::format("bad device '{}': expected 'cpu' or 'cuda:N'", text));
}

// A shape with a negative dimension or an int64 overflow (checked by callers that take
// shapes from the wire: core/shape_math.h) counts -1 elements instead of overflowing.
int64_t NumElements(std::span<const int64_t> shape) { return CheckedNumElements(shape).value_or(-1); }

std::string ShapeString(std::span<const int64_t> shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

Status CheckSameMeta(const TensorMeta& want, const TensorMeta& got) {
  if (want.name != got.name) {
    return InvalidArgument(fmt::format("expected tensor {}, got {}", want.name, got.name));
  }
  if (want.dtype != got.dtype) {
    return InvalidArgument(fmt::format("dtype of {} is {}, got {}", want.name,
                                       TorchName(want.dtype), TorchName(got.dtype)));
  }
  if (want.shape != got.shape) {
    return InvalidArgument(fmt::format("shape of {} is {}, got {}", want.name,
                                       ShapeString(want.shape), ShapeString(got.shape)));
  }
  return Status::Ok();
}

namespace {

constexpr size_t kHugePage = size_t{2} << 20;

// Maps `bytes` of anonymous memory; regions of a huge page or more are 2 MiB-aligned and
// marked for transparent huge pages, because a first touch faults once per page: 512
// times fewer faults with 2 MiB pages (docs/benchmarks.md, "broadcast", has the cost).
void* MapAnonymous(size_t bytes) {
  if (bytes < kHugePage) {
    return mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  }
  size_t padded = bytes + kHugePage;
  void* raw = mmap(nullptr, padded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return raw;
  uintptr_t start = reinterpret_cast<uintptr_t>(raw);
  uintptr_t aligned = (start + kHugePage - 1) & ~(kHugePage - 1);
  if (aligned > start) munmap(raw, aligned - start);
  size_t tail = (start + padded) - (aligned + bytes);
  if (tail > 0) munmap(reinterpret_cast<void*>(aligned + bytes), tail);
  madvise(reinterpret_cast<void*>(aligned), bytes, MADV_HUGEPAGE);
  return reinterpret_cast<void*>(aligned);
}

}  // namespace

Result<HostBuffer> HostBuffer::Allocate(size_t bytes) {
  HostBuffer b;
  if (bytes == 0) return b;
  void* p = MapAnonymous(bytes);
  if (p == MAP_FAILED) {
    return ErrnoStatus(errno, fmt::format("allocating {} bytes of host memory", bytes), StatusCode::kInternal);
  }
  b.data_ = static_cast<std::byte*>(p);
  b.size_ = bytes;
  return b;
}

HostBuffer::HostBuffer(HostBuffer&& other) noexcept : data_(other.data_), size_(other.size_) {
  other.data_ = nullptr;
  other.size_ = 0;
}

HostBuffer& HostBuffer::operator=(HostBuffer&& other) noexcept {
  if (this != &other) {
    Release();
    data_ = other.data_;
    size_ = other.size_;
    other.data_ = nullptr;
    other.size_ = 0;
  }
  return *this;
}

HostBuffer::~HostBuffer() { Release(); }

void HostBuffer::Release() {
  if (data_ != nullptr) munmap(data_, size_);
  data_ = nullptr;
  size_ = 0;
}

Result<HostTensor> HostTensor::Zeros(TensorMeta meta) {
  WSYNC_ASSIGN_OR_RETURN(HostBuffer buf, HostBuffer::Allocate(meta.nbytes()));
  return HostTensor{std::move(meta), std::move(buf)};
}

}  // namespace wsync
