// FlatBufferSource: a trainer's flat parameter buffer as PyTorch holds it, for tests of
// data planes that read a source's storage() in place (the ipc backend's zero-copy).
//
// Unlike a DeviceTensorSource, its block does not start its allocation: it sits `lead`
// bytes into a larger one (as a tensor inside a caching allocator's segment does), and its
// tensors follow each other in iteration order with `gap` spare bytes after each, so a
// data plane must learn their offsets rather than assume a packing rule. Tensor `stray`,
// when set, lives in an allocation of its own instead: a source breaking storage()'s
// promise. Device memory goes through the installed DeviceRuntime (a real GPU, or a
// test's fake). Not thread-safe.
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <vector>

#include "wsync/device_runtime.h"
#include "wsync/source.h"

namespace wsync::testing {

class FlatBufferSource final : public WeightSource {
 public:
  struct Options {
    size_t lead = 4096;  // bytes of the allocation before the block
    size_t gap = 1024;   // spare bytes after each tensor (then 512-byte aligned)
    DeviceAllocator allocator = DeviceAllocator::kRuntime;
  };
  static Result<std::unique_ptr<FlatBufferSource>> Create(const Device& device, std::vector<TensorMeta> metadata,
                                                          Options options);

  const std::vector<TensorMeta>& metadata() const override { return metadata_; }
  Result<std::unique_ptr<TensorStream>> Iterate() override;
  std::optional<SourceStorage> storage() const override { return SourceStorage{block(), bytes_, device_}; }
  // Copies `tensors` (the metadata's, in order) to where this source yields them.
  Status Upload(const std::vector<HostTensor>& tensors);

  std::optional<size_t> stray;

 private:
  FlatBufferSource() = default;
  std::byte* block() const { return allocation_.data() + lead_; }
  std::byte* at(size_t i) const { return stray == i ? stray_.data() : block() + offsets_[i]; }

  Device device_;
  std::vector<TensorMeta> metadata_;
  std::vector<size_t> offsets_;
  size_t lead_ = 0;
  size_t bytes_ = 0;
  DeviceBuffer allocation_;
  DeviceBuffer stray_;
};

}  // namespace wsync::testing
