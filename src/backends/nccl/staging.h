// StagingBuffer: one reusable chunk buffer of the `nccl` backend, in host memory (Gloo)
// or on a CUDA device (NCCL). It only grows: Reserve() reallocates when the chunk plan
// asks for more than it holds, so steady-state syncs allocate nothing. Not synchronized.
#pragma once

#include <cstddef>
#include <span>

#include "wsync/device_runtime.h"
#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync {

class StagingBuffer {
 public:
  Status Reserve(const Device& device, size_t bytes) {
    if (device.is_cpu()) {
      device_storage_ = DeviceBuffer();
      if (host_.size() < bytes) {
        WSYNC_ASSIGN_OR_RETURN(host_, HostBuffer::Allocate(bytes));
      }
      data_ = host_.data();
      size_ = host_.size();
    } else {
      host_ = HostBuffer();
      if (device_storage_.size() < bytes || !(device_storage_.device() == device)) {
        device_storage_ = DeviceBuffer();  // free first: chunk buffers are large
        WSYNC_ASSIGN_OR_RETURN(device_storage_, DeviceBuffer::Allocate(device, bytes));
      }
      data_ = device_storage_.data();
      size_ = device_storage_.size();
    }
    device_ = device;
    return Status::Ok();
  }

  std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  const Device& device() const { return device_; }
  std::span<std::byte> span(size_t bytes) const { return {data_, bytes}; }

 private:
  HostBuffer host_;
  DeviceBuffer device_storage_;
  std::byte* data_ = nullptr;
  size_t size_ = 0;
  Device device_;
};

}  // namespace wsync
