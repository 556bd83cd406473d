// The GPU half of the `ipc` backend's data plane: exported and imported device memory
// and batched device copies, behind a small interface so that the engines (trainer.cc,
// receiver.cc) build and run without CUDA. A CUDA build compiles device_plane_cuda.cc
// (over src/cuda: device_memory.h, batched_copy.h); a build without it compiles
// device_plane_none.cc, whose factories answer Unimplemented naming the device.
//
// Who calls what, from which thread:
//  * the trainer allocates its staging slots once per session (DeviceExport::Allocate),
//    and in zero-copy mode exports its source's own allocation (DeviceExport::Existing);
//  * each receiving worker opens the trainer's memory once per session on its own
//    thread (DeviceImport::Open) and keeps it;
//  * both sides run every chunk as ONE batched launch (DeviceCopies), on the calling
//    thread's stream (CUDA's per-thread default stream, as DeviceRuntime uses), and wait
//    for it before publishing or acknowledging.
// Objects free or unmap what they made in their destructors, on their own device, from
// any thread. Not synchronized: one thread uses an object at a time.
//
// Tests may install their own IpcDevicePlane (SetIpcDevicePlaneForTesting): a host-memory
// fake, with a fake DeviceRuntime, runs the engines' GPU paths on a machine without a GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/worker_store.h"
#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync {

// True when this build has the CUDA data plane (false: every factory below answers
// Unimplemented).
bool IpcDevicePlaneBuilt();

// "GPU-<uuid>" of a CUDA device: the key of its `buffers` entries.
Result<std::string> IpcDeviceKey(const Device& device);

// Device memory this process shares with colocated processes.
class DeviceExport {
 public:
  virtual ~DeviceExport() = default;
  // Allocates at least `bytes` on `device` and exports it as `kind` ("cuda_ipc" or
  // "cuda_fd"); the memory is owned by the object.
  static Result<std::unique_ptr<DeviceExport>> Allocate(const Device& device, uint64_t bytes, std::string_view kind);
  // Exports memory this process already holds, without owning it: a cudaMalloc
  // allocation as "cuda_ipc", a cuMemCreate one (DeviceAllocator::kVirtualMemory,
  // expandable segments) as "cuda_fd", holding the allocation's fd while it lives. `ptr`
  // may point inside its allocation: offset() says where.
  static Result<std::unique_ptr<DeviceExport>> Existing(const Device& device, const void* ptr, uint64_t bytes);

  virtual std::byte* data() const = 0;        // Allocate: the memory; Existing: `ptr`
  virtual std::string_view kind() const = 0;  // "cuda_ipc" or "cuda_fd"
  virtual uint64_t offset() const = 0;        // of data() inside what importers map
  virtual nlohmann::json Handle() const = 0;  // what an importer opens (device_memory.h)
  // Names the exported allocation: two exports of the same one are equal (their cuda_fd
  // handles are not: each has its own fd).
  virtual std::string Identity() const { return std::string(kind()) + ":" + Handle().dump(); }
};

// Device memory another process exported, mapped into this one.
class DeviceImport {
 public:
  virtual ~DeviceImport() = default;
  // Maps the memory `kind`/`handle` name on `device` (this process's ordinal of the
  // exporter's GPU); at least `bytes` must be reachable from its start. InvalidArgument
  // naming what is wrong for a malformed handle, one whose exporter has exited, or one
  // the driver refuses.
  static Result<std::unique_ptr<DeviceImport>> Open(const Device& device, std::string_view kind,
                                                    const nlohmann::json& handle, uint64_t bytes);
  virtual std::byte* data() const = 0;
};

// A fixed list of device copies run as one launch (src/cuda/batched_copy.h). Create()
// and Run() need the calling thread's current device to be `device`.
class DeviceCopies {
 public:
  virtual ~DeviceCopies() = default;
  static Result<std::unique_ptr<DeviceCopies>> Create(const Device& device,
                                                      std::span<const WorkerStore::ByteCopy> copies);
  // Launches every copy on the calling thread's stream and waits for them.
  virtual Status Run() = 0;
  virtual uint64_t bytes() const = 0;
};

// Batched copies kept across syncs, keyed by the caller (chunk and slot). A cached entry
// remembers the copy list it was built from.
class DeviceCopyCache {
 public:
  using Copies = std::vector<WorkerStore::ByteCopy>;
  // The entry under `key` when it was built from exactly `copies`; otherwise builds one
  // (on the calling thread's current device, which must be `device`) and keeps it.
  Result<DeviceCopies*> Get(const Device& device, size_t key, const Copies& copies);
  // The entry under `key`, whatever it was built from; nullptr when there is none.
  DeviceCopies* Find(size_t key) const;
  void Clear() { entries_.clear(); }
  size_t size() const { return entries_.size(); }

 private:
  struct Entry {
    Copies copies;
    std::unique_ptr<DeviceCopies> plan;
  };
  std::map<size_t, Entry> entries_;
};

// What the factories above dispatch to: the built-in plane (CUDA, or the stub) unless a
// test installed another.
class IpcDevicePlane {
 public:
  virtual ~IpcDevicePlane() = default;
  virtual Result<std::string> DeviceKey(const Device& device) = 0;
  virtual Result<std::unique_ptr<DeviceExport>> Allocate(const Device& device, uint64_t bytes,
                                                         std::string_view kind) = 0;
  virtual Result<std::unique_ptr<DeviceExport>> Existing(const Device& device, const void* ptr, uint64_t bytes) = 0;
  virtual Result<std::unique_ptr<DeviceImport>> Open(const Device& device, std::string_view kind,
                                                     const nlohmann::json& handle, uint64_t bytes) = 0;
  virtual Result<std::unique_ptr<DeviceCopies>> Copies(const Device& device,
                                                       std::span<const WorkerStore::ByteCopy> copies) = 0;
  virtual Status Synchronize(const Device& device) = 0;
  virtual Result<std::pair<uint64_t, uint64_t>> MemoryInfo(const Device& device) = 0;
};
// The plane of this build (device_plane_cuda.cc or device_plane_none.cc).
IpcDevicePlane& BuiltinIpcDevicePlane();
// Installs `plane` for the whole process; nullptr goes back to the built-in one. Call it
// before any engine exists and keep `plane` alive while one does.
void SetIpcDevicePlaneForTesting(IpcDevicePlane* plane);

// Waits until every earlier piece of work on the calling thread's current device is done
// (a zero-copy trainer's tensors are final before receivers read them).
Status SynchronizeIpcDevice(const Device& device);

// Free and total memory of `device` in bytes (cudaMemGetInfo), for benchmarks and tests.
Result<std::pair<uint64_t, uint64_t>> IpcDeviceMemoryInfo(const Device& device);

}  // namespace wsync
