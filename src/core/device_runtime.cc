#include "wsync/device_runtime.h"

#include <cstring>

#include <atomic>
#include <utility>

#include <fmt/format.h>

namespace wsync {
namespace {

std::atomic<DeviceRuntime*> g_cuda_runtime{nullptr};

}  // namespace

Result<DeviceRuntime*> CudaRuntimeFor(const Device& device) {
  if (device.is_cpu()) return InvalidArgument("CudaRuntimeFor(cpu): not a CUDA device");
  DeviceRuntime* rt = g_cuda_runtime.load(std::memory_order_acquire);
  if (rt == nullptr) {
    return Unimplemented(fmt::format(
        "device {}: this binary has no CUDA support (built without the CUDA toolkit, or the CUDA "
        "runtime was not installed); use --device cpu", device.ToString()));
  }
  return rt;
}

void InstallCudaRuntime(DeviceRuntime* runtime) { g_cuda_runtime.store(runtime, std::memory_order_release); }

Status UseDeviceOnThisThread(const Device& device) {
  if (device.is_cpu()) return Status::Ok();
  WSYNC_ASSIGN_OR_RETURN(DeviceRuntime * rt, CudaRuntimeFor(device));
  return rt->SetDevice(device.index);
}

Status CopyAndWait(const Device& device, void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width,
                   size_t count) {
  if (width == 0 || count == 0) return Status::Ok();
  if (device.is_cpu()) {
    for (size_t i = 0; i < count; ++i) {
      std::memcpy(static_cast<std::byte*>(dst) + i * dst_pitch, static_cast<const std::byte*>(src) + i * src_pitch,
                  width);
    }
    return Status::Ok();
  }
  WSYNC_ASSIGN_OR_RETURN(DeviceRuntime * rt, CudaRuntimeFor(device));
  WSYNC_RETURN_IF_ERROR(rt->SetDevice(device.index));
  WSYNC_RETURN_IF_ERROR(rt->Copy2D(dst, dst_pitch, src, src_pitch, width, count));
  return rt->Synchronize();
}

size_t LayOutAligned(std::span<const size_t> bytes, std::vector<size_t>* offsets) {
  size_t total = 0;
  for (size_t n : bytes) {
    offsets->push_back(total);
    total += (n + kDeviceTensorAlignment - 1) / kDeviceTensorAlignment * kDeviceTensorAlignment;
  }
  return total;
}

Result<DeviceBuffer> DeviceBuffer::Allocate(const Device& device, size_t bytes, DeviceAllocator allocator) {
  WSYNC_ASSIGN_OR_RETURN(DeviceRuntime * rt, CudaRuntimeFor(device));
  WSYNC_ASSIGN_OR_RETURN(void* p, allocator == DeviceAllocator::kVirtualMemory
                                      ? rt->AllocateVirtualMemory(device.index, bytes)
                                      : rt->Allocate(device.index, bytes));
  DeviceBuffer b;
  b.runtime_ = rt;
  b.device_ = device;
  b.data_ = static_cast<std::byte*>(p);
  b.size_ = bytes;
  b.allocator_ = allocator;
  return b;
}

Status DeviceBuffer::ReleasePhysical() {
  if (data_ == nullptr || !physical_) return Status::Ok();
  if (allocator_ != DeviceAllocator::kVirtualMemory) {
    return FailedPrecondition(fmt::format("a buffer of {} bytes on {} was not allocated from the virtual memory API, "
                                          "so its physical memory cannot be released in place", size_,
                                          device_.ToString()));
  }
  WSYNC_RETURN_IF_ERROR(runtime_->ReleasePhysical(device_.index, data_));
  physical_ = false;
  return Status::Ok();
}

Status DeviceBuffer::RestorePhysical() {
  if (data_ == nullptr || physical_) return Status::Ok();
  WSYNC_RETURN_IF_ERROR(runtime_->RestorePhysical(device_.index, data_));
  physical_ = true;
  return Status::Ok();
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept { *this = std::move(other); }

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    Release();
    runtime_ = std::exchange(other.runtime_, nullptr);
    device_ = other.device_;
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    allocator_ = other.allocator_;
    physical_ = std::exchange(other.physical_, true);
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() { Release(); }

void DeviceBuffer::Release() {
  if (data_ != nullptr && runtime_ != nullptr) runtime_->Free(device_.index, data_);
  data_ = nullptr;
  size_ = 0;
}

}  // namespace wsync
