// HostBackedDevice: a DeviceRuntime whose "device" memory is host memory, for running the
// code of CUDA tensors (allocation, Copy2D staging, read-back) on a machine without a GPU.
// It fakes the device, not the copies: every byte still moves through Copy2D, and the
// largest single copy is recorded so tests can bound staging, and allocations count as
// device bytes (NoteDeviceBytes) as the CUDA runtime's do. Header-only; tests only.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include "core/digest.h"
#include "core/process_memory.h"
#include "wsync/device_runtime.h"

namespace wsync {

class HostBackedDevice final : public DeviceRuntime {
 public:
  // Installs itself as the process's CUDA runtime for its lifetime.
  HostBackedDevice() { InstallCudaRuntime(this); }
  ~HostBackedDevice() override { InstallCudaRuntime(nullptr); }
  HostBackedDevice(const HostBackedDevice&) = delete;
  HostBackedDevice& operator=(const HostBackedDevice&) = delete;

  int DeviceCount() override { return 1; }
  Status SetDevice(int) override { return Status::Ok(); }
  Result<void*> Allocate(int, size_t bytes) override {
    void* p = std::aligned_alloc(256, (std::max<size_t>(bytes, 1) + 255) / 256 * 256);
    if (p == nullptr) return Internal("host-backed device: out of host memory");
    std::memset(p, 0, bytes);
    allocated_ += bytes;
    NoteDeviceBytes(static_cast<int64_t>(bytes));
    std::lock_guard lock(mu_);
    sizes_[p] = bytes;
    return p;
  }
  void Free(int, void* ptr) override {
    {
      std::lock_guard lock(mu_);
      if (auto it = sizes_.find(ptr); it != sizes_.end()) {
        NoteDeviceBytes(-static_cast<int64_t>(it->second));
        sizes_.erase(it);
      }
    }
    std::free(ptr);
  }
  Status Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width, size_t count) override {
    size_t seen = largest_.load();
    while (width * count > seen && !largest_.compare_exchange_weak(seen, width * count)) {
    }
    for (size_t i = 0; i < count; ++i) {
      std::memcpy(static_cast<std::byte*>(dst) + i * dst_pitch, static_cast<const std::byte*>(src) + i * src_pitch,
                  width);
    }
    return Status::Ok();
  }
  Status Synchronize() override { return Status::Ok(); }
  // The device kernel's schedule run on the host memory that stands for the device.
  Status Xxh3Digests(std::span<const Span> spans, std::span<uint64_t> out) override {
    ++digest_launches_;
    return HostXxh3Digests(spans, out);
  }
  // Xxh3Digests calls so far.
  int digest_launches() const { return digest_launches_.load(); }

  std::atomic<size_t> largest_{0};    // bytes of the largest single copy
  std::atomic<size_t> allocated_{0};  // bytes ever allocated
  std::atomic<int> digest_launches_{0};

 private:
  std::mutex mu_;
  std::map<void*, size_t> sizes_;  // live allocations, GUARDED_BY(mu_)
};

}  // namespace wsync
