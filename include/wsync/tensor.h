// Tensors as wsync moves them: metadata, owned host storage, and non-owning views.
//
// A TensorMeta is a Hugging Face name, dtype and shape. A HostBuffer owns page-aligned
// host memory. TensorRef is a borrowed view of one tensor's bytes, valid for as long as
// whoever lent it says (a stream's Next() call, a buffer's lifetime). Devices are named
// like torch ("cpu", "cuda:1"); CUDA storage lives in src/cuda and is built only when
// CUDA is found. None of these types are synchronized.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "wsync/dtype.h"
#include "wsync/status.h"

namespace wsync {

struct Device {
  enum class Kind : uint8_t { kCpu, kCuda };
  Kind kind = Kind::kCpu;
  int index = 0;

  bool is_cpu() const { return kind == Kind::kCpu; }
  std::string ToString() const;  // "cpu", "cuda:0"
  static Result<Device> Parse(std::string_view text);
  friend bool operator==(const Device&, const Device&) = default;
};

using Shape = std::vector<int64_t>;

int64_t NumElements(std::span<const int64_t> shape);
std::string ShapeString(std::span<const int64_t> shape);  // "[3072, 1024]"

struct TensorMeta {
  std::string name;
  DType dtype = DType::kBF16;
  Shape shape;

  int64_t numel() const { return NumElements(shape); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * ItemSize(dtype); }
  friend bool operator==(const TensorMeta&, const TensorMeta&) = default;
};

// Checks that `got` describes the same tensor as `want`; the error names the tensor and
// the field that differs, e.g. "shape of model.norm.weight is [1024], got [512]".
Status CheckSameMeta(const TensorMeta& want, const TensorMeta& got);

// A borrowed view of one tensor. `bytes.size()` equals numel * itemsize.
struct TensorRef {
  std::string_view name;
  DType dtype = DType::kBF16;
  std::span<const int64_t> shape;
  std::span<const std::byte> bytes;
  Device device;
};

// Owned, page-aligned host memory. Move-only. Large allocations are backed by mmap so
// that untouched pages cost nothing until written.
class HostBuffer {
 public:
  HostBuffer() = default;
  static Result<HostBuffer> Allocate(size_t bytes);
  HostBuffer(HostBuffer&& other) noexcept;
  HostBuffer& operator=(HostBuffer&& other) noexcept;
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  ~HostBuffer();

  std::byte* data() { return data_; }
  const std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  std::span<std::byte> span() { return {data_, size_}; }
  std::span<const std::byte> span() const { return {data_, size_}; }

 private:
  void Release();
  std::byte* data_ = nullptr;
  size_t size_ = 0;
};

// A named tensor that owns its bytes in host memory.
struct HostTensor {
  TensorMeta meta;
  HostBuffer storage;

  static Result<HostTensor> Zeros(TensorMeta meta);
  TensorRef ref() const {
    return TensorRef{meta.name, meta.dtype, meta.shape, storage.span().first(meta.nbytes()),
                     Device{}};
  }
};

}  // namespace wsync
