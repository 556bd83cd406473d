// HostBackedDevice: a DeviceRuntime whose "device" memory is host memory, for running the
// code of CUDA tensors (allocation, Copy2D staging, read-back) on a machine without a GPU.
// It fakes the device, not the copies: every byte still moves through Copy2D, and the
// largest single copy is recorded so tests can bound staging, and allocations count as
// device bytes (NoteDeviceBytes) as the CUDA runtime's do. DeferCopies() injects the one
// fault a synchronous host copy cannot show: copies that run after Copy2D returned, as a
// CUDA stream's do. Header-only; tests only.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

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
    const Pending copy{dst, dst_pitch, src, src_pitch, width, count};
    if (defer_.load()) {
      std::lock_guard lock(mu_);
      pending_[std::this_thread::get_id()].push_back(copy);
      return Status::Ok();
    }
    Run(copy);
    return Status::Ok();
  }
  Status Synchronize() override {
    ++synchronizes_;
    RunPending();
    return Status::Ok();
  }
  // The device kernel's schedule run on the host memory that stands for the device, after
  // the copies this thread enqueued before.
  Status Xxh3Digests(std::span<const Span> spans, std::span<uint64_t> out) override {
    ++digest_launches_;
    RunPending();
    return HostXxh3Digests(spans, out);
  }
  // From now on, a thread's copies run at its next Synchronize() or digest launch.
  void DeferCopies(bool on) { defer_ = on; }
  // Xxh3Digests calls so far.
  int digest_launches() const { return digest_launches_.load(); }

  std::atomic<size_t> largest_{0};    // bytes of the largest single copy
  std::atomic<size_t> allocated_{0};  // bytes ever allocated
  std::atomic<int> digest_launches_{0};
  std::atomic<int> synchronizes_{0};  // Synchronize calls so far

 private:
  struct Pending {
    void* dst;
    size_t dst_pitch;
    const void* src;
    size_t src_pitch;
    size_t width;
    size_t count;
  };
  static void Run(const Pending& c) {
    for (size_t i = 0; i < c.count; ++i) {
      std::memcpy(static_cast<std::byte*>(c.dst) + i * c.dst_pitch,
                  static_cast<const std::byte*>(c.src) + i * c.src_pitch, c.width);
    }
  }
  void RunPending() {
    std::vector<Pending> mine;
    {
      std::lock_guard lock(mu_);
      auto it = pending_.find(std::this_thread::get_id());
      if (it == pending_.end()) return;
      mine = std::move(it->second);
      pending_.erase(it);
    }
    for (const Pending& c : mine) Run(c);
  }

  std::atomic<bool> defer_{false};
  std::mutex mu_;
  std::map<void*, size_t> sizes_;                              // live allocations, GUARDED_BY(mu_)
  std::map<std::thread::id, std::vector<Pending>> pending_;  // deferred copies by thread, GUARDED_BY(mu_)
};

}  // namespace wsync
