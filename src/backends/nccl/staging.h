// StagingBuffer: one reusable chunk buffer of the `nccl` backend, in host memory (Gloo)
// or on a CUDA device (NCCL). It only grows: Reserve() reallocates when the chunk plan
// asks for more than it holds, so steady-state syncs allocate nothing. Host memory is
// prefaulted when it is allocated (core/prefault.h), so that the sync that first fills a
// buffer runs as fast as the ones after it. Not synchronized.
//
// Both halves of the backend use a ring of buffers: chunk k of a plan goes through buffer
// k % ring size. ReserveRing() sizes each buffer for the largest chunk that passes
// through it, and is called once at Init (for the whole model's plan) and again at every
// sync (a no-op unless that sync's plan needs more).
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>
#include <type_traits>

#include "core/parallel.h"
#include "core/prefault.h"
#include "plan/packing.h"
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
        host_ = HostBuffer();  // free first: chunk buffers are large
        WSYNC_ASSIGN_OR_RETURN(host_, HostBuffer::Allocate(bytes));
        Prefault(host_.span(), DefaultThreads());
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

// The bytes buffer `slot` of a ring of `ring_size` needs for `plan`: its largest chunk
// k with k % ring_size == slot (0 when no chunk passes through it).
inline size_t RingSlotBytes(const ChunkPlan& plan, size_t ring_size, size_t slot) {
  size_t bytes = 0;
  for (size_t k = slot; k < plan.chunks.size(); k += ring_size) bytes = std::max(bytes, plan.chunks[k].bytes);
  return bytes;
}

// Grows buffer j of `ring` (StagingBuffers, or pointers to them) to
// RingSlotBytes(plan, ring.size(), j) on `device`.
template <typename Ring>
Status ReserveRing(Ring& ring, const Device& device, const ChunkPlan& plan) {
  for (size_t j = 0; j < ring.size(); ++j) {
    StagingBuffer* b;
    if constexpr (std::is_same_v<std::remove_cvref_t<decltype(ring[j])>, StagingBuffer>) {
      b = &ring[j];
    } else {
      b = &*ring[j];
    }
    WSYNC_RETURN_IF_ERROR(b->Reserve(device, RingSlotBytes(plan, ring.size(), j)));
  }
  return Status::Ok();
}

}  // namespace wsync
