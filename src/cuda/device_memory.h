// Device memory shared between colocated processes on one GPU: the `ipc` backend's GPU
// staging slots (and, later, zero-copy exports of a source's own allocations).
//
// Two export kinds, named as in the ipc protocol's `buffers` entries:
//  * "cuda_ipc": cudaMalloc + cudaIpcGetMemHandle; the handle is 64 bytes, sent as
//    {"handle_b64": standard base64}. Works for plain cudaMalloc memory only.
//  * "cuda_fd": cuMemCreate with a POSIX file-descriptor handle type, mapped into this
//    process; sent as {"pid", "fd", "bytes"}. The importer takes the fd with pidfd_getfd
//    (Linux >= 5.6; needs ptrace rights over the exporter: same user with Yama
//    ptrace_scope 0, or CAP_SYS_PTRACE) and maps it. This is how memory from VMM /
//    expandable-segment allocators is shared, which cudaIpcGetMemHandle refuses.
//
// Exporting is cheap; opening is the expensive step (docs/benchmarks.md has its cost),
// which is why the ipc protocol exports once per session and importers keep the mapping.
// Each object frees or unmaps what it made in its destructor, on the device it was made
// on. Not synchronized; the calling thread's current device is left set to `device`.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "wsync/status.h"

namespace wsync::cuda {

enum class ExportKind { kCudaIpc, kCuMemFd };
std::string_view ExportKindName(ExportKind kind);  // "cuda_ipc", "cuda_fd"
Result<ExportKind> ParseExportKind(std::string_view name);

class ExportedDeviceMemory {
 public:
  // Allocates at least `bytes` on `device` (cuda_fd rounds up to the allocation
  // granularity) and exports it.
  static Result<std::unique_ptr<ExportedDeviceMemory>> Allocate(int device, size_t bytes, ExportKind kind);
  // Exports memory this process already allocated on `device`, without owning it: the
  // destructor frees nothing. cudaMalloc memory goes out as cuda_ipc; memory from
  // cuMemCreate (the virtual memory API, as expandable-segment allocators use it, created
  // with a POSIX fd handle type) as cuda_fd, this export holding a reference to the
  // allocation and the fd until it is destroyed. Importers map the whole allocation;
  // base_offset() is `ptr`'s offset inside it. Cheap (no allocation), so a caller may
  // export again and compare Identity() to learn whether the allocation behind `ptr`
  // changed (a new allocation differs even at the same address).
  static Result<std::unique_ptr<ExportedDeviceMemory>> ExportExisting(int device, const void* ptr);
  ~ExportedDeviceMemory();
  ExportedDeviceMemory(const ExportedDeviceMemory&) = delete;
  ExportedDeviceMemory& operator=(const ExportedDeviceMemory&) = delete;

  void* data() const { return ptr_; }
  size_t size() const { return size_; }  // ExportExisting: from base_offset() to the allocation's end
  int device() const { return device_; }
  ExportKind kind() const { return kind_; }
  size_t base_offset() const { return base_offset_; }
  // What an importer needs (see the file comment).
  nlohmann::json Handle() const;
  // Names the allocation: equal for two exports of the same one (a cuda_fd Handle() is not:
  // each export has its own fd).
  std::string Identity() const;

  // An owned cuda_fd allocation only (what DeviceRuntime::AllocateVirtualMemory makes):
  // ReleasePhysical closes the export's fd, unmaps the range and releases the physical
  // memory, keeping the address range reserved; RestorePhysical creates new physical
  // memory of the same size, maps it at the same address and exports it again (a new
  // Identity(); importers of the old memory keep what they mapped, not this). Neither
  // zeroes nor copies. No-ops when already in that state; InvalidArgument otherwise.
  Status ReleasePhysical();
  Status RestorePhysical();
  bool physical() const { return mem_handle_ != 0 || kind_ == ExportKind::kCudaIpc; }

 private:
  ExportedDeviceMemory() = default;
  ExportKind kind_ = ExportKind::kCudaIpc;
  bool owned_ = true;
  size_t base_offset_ = 0;
  int device_ = 0;
  void* ptr_ = nullptr;
  size_t size_ = 0;
  size_t alloc_bytes_ = 0;  // ExportExisting: the whole allocation, from its base
  unsigned char ipc_handle_[64] = {};
  unsigned long long mem_handle_ = 0;  // CUmemGenericAllocationHandle
  int fd_ = -1;
  // Physical bytes this object added to NoteDeviceBytes (owned memory only).
  int64_t counted_ = 0;
  void Count(int64_t bytes);
};

class ImportedDeviceMemory {
 public:
  // Maps `bytes` of memory another process exported with `handle`, on `device` (this
  // process's ordinal of the same GPU). InvalidArgument for a malformed handle or one
  // smaller than `bytes`; the named CUDA or OS error when it does not open (its exporter
  // exited, another GPU, no ptrace rights for cuda_fd).
  static Result<std::unique_ptr<ImportedDeviceMemory>> Open(int device, ExportKind kind,
                                                            const nlohmann::json& handle, size_t bytes);
  ~ImportedDeviceMemory();
  ImportedDeviceMemory(const ImportedDeviceMemory&) = delete;
  ImportedDeviceMemory& operator=(const ImportedDeviceMemory&) = delete;

  void* data() const { return ptr_; }
  size_t size() const { return size_; }

 private:
  ImportedDeviceMemory() = default;
  ExportKind kind_ = ExportKind::kCudaIpc;
  int device_ = 0;
  void* ptr_ = nullptr;
  size_t size_ = 0;         // the whole mapping (cuda_fd: the exporter's rounded size)
  unsigned long long mem_handle_ = 0;
};

}  // namespace wsync::cuda
