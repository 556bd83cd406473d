// DeviceRuntime: the few device-memory operations the CPU-built libraries need for
// tensors that live on `cuda:N` (worker stores, trainer sources, receive buffers).
//
// The core, model and backend libraries build without CUDA; they reach device memory only
// through this interface. A CUDA build installs the implementation from src/cuda
// (cuda::InstallDeviceRuntime(), called by the `wsync` binary and the GPU tests before
// any CUDA tensor exists); without it, every CUDA request is a clear Unimplemented
// naming the device. Copies are ordered on the calling thread's own stream (CUDA's
// per-thread default stream) and are complete once Synchronize() returns on that thread;
// the device is per thread too (SetDevice before the first call on a thread).
// Implementations are thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync {

class DeviceRuntime {
 public:
  virtual ~DeviceRuntime() = default;
  // Devices this process can use (0 without a driver or GPU).
  virtual int DeviceCount() = 0;
  // Makes `device` current on the calling thread.
  virtual Status SetDevice(int device) = 0;
  // `bytes` of zeroed memory on `device`, 256-byte aligned; Free() releases it.
  virtual Result<void*> Allocate(int device, size_t bytes) = 0;
  // The same from the driver's virtual memory API (cuMemCreate + cuMemMap, shareable as a
  // POSIX fd), as PyTorch's expandable segments allocate: the ipc backend exports such
  // memory as cuda_fd, whose mappings copy at full speed. Free() releases it too.
  virtual Result<void*> AllocateVirtualMemory(int device, size_t bytes) {
    return Unimplemented("this device runtime has no virtual-memory allocations");
  }
  virtual void Free(int device, void* ptr) = 0;
  // For an allocation of AllocateVirtualMemory starting at `ptr` (what vLLM's
  // CuMemAllocator does for sleep): ReleasePhysical unmaps and releases its physical
  // memory while its address range stays reserved, so the device memory is free for
  // others and no other allocation can take the address; RestorePhysical maps fresh,
  // zeroed physical memory back at the same address. Pointers into the allocation stay
  // valid (a device access between the two faults). Each is a no-op when the memory is
  // already in that state; InvalidArgument for any other pointer.
  virtual Status ReleasePhysical(int device, void* ptr) {
    return Unimplemented("this device runtime cannot release the physical memory of an allocation");
  }
  virtual Status RestorePhysical(int device, void* ptr) {
    return Unimplemented("this device runtime cannot map physical memory back into an allocation");
  }
  // The device's free and total memory as the driver counts it (cudaMemGetInfo).
  struct MemoryInfo {
    size_t free_bytes = 0;
    size_t total_bytes = 0;
  };
  virtual Result<MemoryInfo> GetMemoryInfo(int device) {
    return Unimplemented("this device runtime reports no device memory");
  }
  // Enqueues `count` copies of `width` bytes, the i-th from src + i * src_pitch to
  // dst + i * dst_pitch, host or device memory on either side (unified addressing).
  virtual Status Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width,
                        size_t count) = 0;
  // Waits for the calling thread's enqueued copies; reports the first failure.
  virtual Status Synchronize() = 0;
  // In-line digests on the device: the xxh3-128 (seed 0, libxxhash's XXH3_128bits) of
  // each of `spans`, device memory of the calling thread's current device, computed after
  // the work this thread enqueued before; out[2i] gets span i's low word and out[2i + 1]
  // its high word. Complete on return.
  struct Span {
    const void* data = nullptr;
    size_t bytes = 0;
  };
  virtual Status Xxh3Digests(std::span<const Span> spans, std::span<uint64_t> out) {
    return Unimplemented("this device runtime computes no digests on the device");
  }
};

// The installed CUDA runtime, or Unimplemented naming `device` and saying that this
// build (or this binary) has no CUDA support. `device` must be a CUDA device.
Result<DeviceRuntime*> CudaRuntimeFor(const Device& device);
// Installs (or, with nullptr, removes) the process-wide CUDA runtime.
void InstallCudaRuntime(DeviceRuntime* runtime);

// Sets `device` current on the calling thread when it is a CUDA device; OK for cpu.
Status UseDeviceOnThisThread(const Device& device);

// Copies `count` runs of `width` bytes, the i-th from src + i * src_pitch to
// dst + i * dst_pitch, where `device` is the device of the side that is not host memory
// (cpu: both sides are host memory, copied with memcpy). A CUDA copy runs on this
// thread's stream with `device` made current, and is complete on return.
Status CopyAndWait(const Device& device, void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width,
                   size_t count);

// Tensors laid out back to back in one device allocation start at multiples of this
// (full-width copies; what cudaMalloc itself guarantees for an allocation's start).
inline constexpr size_t kDeviceTensorAlignment = 256;
// The offsets of tensors of `bytes` sizes laid out that way, in order, into `offsets`;
// returns the size of the allocation that holds them all.
size_t LayOutAligned(std::span<const size_t> bytes, std::vector<size_t>* offsets);

// Which DeviceRuntime call allocates a buffer.
enum class DeviceAllocator { kRuntime, kVirtualMemory };

// Device memory owned by one object: Allocate()d on construction, freed on destruction.
// A kVirtualMemory buffer can release its physical memory and get it back at the same
// address (DeviceRuntime::ReleasePhysical / RestorePhysical).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  static Result<DeviceBuffer> Allocate(const Device& device, size_t bytes,
                                       DeviceAllocator allocator = DeviceAllocator::kRuntime);
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer();

  std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  const Device& device() const { return device_; }
  std::span<std::byte> span() const { return {data_, size_}; }
  // Whether physical memory backs the buffer now (false between ReleasePhysical and
  // RestorePhysical).
  bool physical() const { return physical_; }
  // FailedPrecondition for a buffer not allocated with kVirtualMemory.
  Status ReleasePhysical();
  Status RestorePhysical();

 private:
  void Release();
  DeviceRuntime* runtime_ = nullptr;
  Device device_;
  DeviceAllocator allocator_ = DeviceAllocator::kRuntime;
  bool physical_ = true;
  std::byte* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace wsync
