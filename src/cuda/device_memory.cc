#include "cuda/device_memory.h"

#include <openssl/evp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>
#include <optional>

#include <fmt/format.h>

#include "core/checked_math.h"
#include "core/process_memory.h"
#include "cuda/cuda_check.h"

namespace wsync::cuda {
namespace {

using nlohmann::json;

std::string Base64(const unsigned char* data, size_t n) {
  std::string out(4 * ((n + 2) / 3), '\0');
  int len = EVP_EncodeBlock(reinterpret_cast<unsigned char*>(out.data()), data, static_cast<int>(n));
  out.resize(len);
  return out;
}

// Decodes exactly `n` bytes of standard base64.
Status Unbase64(const std::string& text, unsigned char* out, size_t n) {
  if (text.size() != 4 * ((n + 2) / 3)) {
    return InvalidArgument(fmt::format("handle_b64 has {} characters, a {}-byte handle takes {}", text.size(), n,
                                       4 * ((n + 2) / 3)));
  }
  std::string buf(text.size(), '\0');
  int len = EVP_DecodeBlock(reinterpret_cast<unsigned char*>(buf.data()),
                            reinterpret_cast<const unsigned char*>(text.data()), static_cast<int>(text.size()));
  if (len < static_cast<int>(n)) return InvalidArgument("handle_b64 is not standard base64");
  std::memcpy(out, buf.data(), n);
  return Status::Ok();
}

Status UseDevice(int device) {
  WSYNC_CUDA_CHECK(cudaSetDevice(device));
  WSYNC_CUDA_CHECK(cudaFree(nullptr));  // makes the primary context current for driver calls
  return Status::Ok();
}

CUmemAllocationProp FdProp(int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

// The driver calls cuda_fd needs, fetched once.
struct Driver {
  decltype(&cuMemGetAllocationGranularity) granularity = nullptr;
  decltype(&cuMemCreate) create = nullptr;
  decltype(&cuMemRelease) release = nullptr;
  decltype(&cuMemAddressReserve) reserve = nullptr;
  decltype(&cuMemAddressFree) address_free = nullptr;
  decltype(&cuMemMap) map = nullptr;
  decltype(&cuMemUnmap) unmap = nullptr;
  decltype(&cuMemSetAccess) set_access = nullptr;
  decltype(&cuMemExportToShareableHandle) export_handle = nullptr;
  decltype(&cuMemImportFromShareableHandle) import_handle = nullptr;
  decltype(&cuMemGetAddressRange) address_range = nullptr;
  decltype(&cuMemRetainAllocationHandle) retain = nullptr;
};

Result<const Driver*> GetDriver() {
  static Result<Driver> driver = []() -> Result<Driver> {
    Driver d;
    WSYNC_ASSIGN_OR_RETURN(d.granularity, DriverFn<decltype(d.granularity)>("cuMemGetAllocationGranularity"));
    WSYNC_ASSIGN_OR_RETURN(d.create, DriverFn<decltype(d.create)>("cuMemCreate"));
    WSYNC_ASSIGN_OR_RETURN(d.release, DriverFn<decltype(d.release)>("cuMemRelease"));
    WSYNC_ASSIGN_OR_RETURN(d.reserve, DriverFn<decltype(d.reserve)>("cuMemAddressReserve"));
    WSYNC_ASSIGN_OR_RETURN(d.address_free, DriverFn<decltype(d.address_free)>("cuMemAddressFree"));
    WSYNC_ASSIGN_OR_RETURN(d.map, DriverFn<decltype(d.map)>("cuMemMap"));
    WSYNC_ASSIGN_OR_RETURN(d.unmap, DriverFn<decltype(d.unmap)>("cuMemUnmap"));
    WSYNC_ASSIGN_OR_RETURN(d.set_access, DriverFn<decltype(d.set_access)>("cuMemSetAccess"));
    WSYNC_ASSIGN_OR_RETURN(d.export_handle, DriverFn<decltype(d.export_handle)>("cuMemExportToShareableHandle"));
    WSYNC_ASSIGN_OR_RETURN(d.import_handle, DriverFn<decltype(d.import_handle)>("cuMemImportFromShareableHandle"));
    WSYNC_ASSIGN_OR_RETURN(d.address_range, DriverFn<decltype(d.address_range)>("cuMemGetAddressRange"));
    WSYNC_ASSIGN_OR_RETURN(d.retain, DriverFn<decltype(d.retain)>("cuMemRetainAllocationHandle"));
    return d;
  }();
  if (!driver.ok()) return driver.status();
  return &*driver;
}

// Maps `handle` at `ptr` (a reserved range) and grants `device` read/write; on failure
// nothing stays mapped.
CUresult MapAt(const Driver& d, CUdeviceptr ptr, CUmemGenericAllocationHandle handle, size_t size, int device) {
  CUresult r = d.map(ptr, size, 0, handle, 0);
  if (r == CUDA_SUCCESS) {
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = device;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    r = d.set_access(ptr, size, &access, 1);
    if (r != CUDA_SUCCESS) d.unmap(ptr, size);
  }
  return r;
}

// Reserves an address range for `handle`, maps it and grants `device` read/write.
Result<CUdeviceptr> MapHandle(const Driver& d, CUmemGenericAllocationHandle handle, size_t size, int device) {
  CUdeviceptr ptr = 0;
  WSYNC_CU_CHECK(d.reserve(&ptr, size, 0, 0, 0));
  CUresult r = MapAt(d, ptr, handle, size, device);
  if (r != CUDA_SUCCESS) {
    d.address_free(ptr, size);
    WSYNC_CU_CHECK(r);
  }
  return ptr;
}

}  // namespace

std::string_view ExportKindName(ExportKind kind) { return kind == ExportKind::kCudaIpc ? "cuda_ipc" : "cuda_fd"; }

Result<ExportKind> ParseExportKind(std::string_view name) {
  if (name == "cuda_ipc") return ExportKind::kCudaIpc;
  if (name == "cuda_fd") return ExportKind::kCuMemFd;
  return InvalidArgument(fmt::format("device memory kind '{}' is not cuda_ipc or cuda_fd", name));
}

Result<std::unique_ptr<ExportedDeviceMemory>> ExportedDeviceMemory::Allocate(int device, size_t bytes, ExportKind kind) {
  if (bytes == 0) return InvalidArgument("exported device memory must be at least one byte");
  WSYNC_RETURN_IF_ERROR(UseDevice(device));
  std::unique_ptr<ExportedDeviceMemory> m(new ExportedDeviceMemory());
  m->kind_ = kind;
  m->device_ = device;
  if (kind == ExportKind::kCudaIpc) {
    WSYNC_CUDA_CHECK(cudaMalloc(&m->ptr_, bytes));
    m->size_ = bytes;
    m->Count(static_cast<int64_t>(bytes));
    cudaIpcMemHandle_t h;
    WSYNC_CUDA_CHECK(cudaIpcGetMemHandle(&h, m->ptr_));
    static_assert(sizeof(h) == sizeof(m->ipc_handle_));
    std::memcpy(m->ipc_handle_, &h, sizeof(h));
    return m;
  }
  WSYNC_ASSIGN_OR_RETURN(const Driver* d, GetDriver());
  CUmemAllocationProp prop = FdProp(device);
  size_t granularity = 0;
  WSYNC_CU_CHECK(d->granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  std::optional<size_t> rounded = CheckedAdd<size_t>(bytes, granularity - 1);
  if (granularity == 0 || !rounded) {
    return InvalidArgument(fmt::format("{} bytes of cuda_fd memory (granularity {}) do not fit in 64 bits", bytes,
                                       granularity));
  }
  m->size_ = *rounded / granularity * granularity;
  CUmemGenericAllocationHandle handle = 0;
  WSYNC_CU_CHECK(d->create(&handle, m->size_, &prop, 0));
  m->mem_handle_ = handle;
  m->Count(static_cast<int64_t>(m->size_));
  WSYNC_ASSIGN_OR_RETURN(CUdeviceptr ptr, MapHandle(*d, handle, m->size_, device));
  m->ptr_ = reinterpret_cast<void*>(ptr);
  int fd = -1;
  WSYNC_CU_CHECK(d->export_handle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  m->fd_ = fd;
  return m;
}

Result<std::unique_ptr<ExportedDeviceMemory>> ExportedDeviceMemory::ExportExisting(int device, const void* ptr) {
  if (ptr == nullptr) return InvalidArgument("cannot export a null device pointer");
  WSYNC_RETURN_IF_ERROR(UseDevice(device));
  WSYNC_ASSIGN_OR_RETURN(const Driver* d, GetDriver());
  CUdeviceptr base = 0;
  size_t size = 0;
  WSYNC_CU_CHECK(d->address_range(&base, &size, reinterpret_cast<CUdeviceptr>(ptr)));
  std::unique_ptr<ExportedDeviceMemory> m(new ExportedDeviceMemory());
  m->kind_ = ExportKind::kCudaIpc;
  m->owned_ = false;
  m->device_ = device;
  m->ptr_ = const_cast<void*>(ptr);
  m->base_offset_ = reinterpret_cast<CUdeviceptr>(ptr) - base;
  m->size_ = size - m->base_offset_;
  m->alloc_bytes_ = size;
  // Memory from the driver's virtual memory API (cuMemCreate + cuMemMap, as PyTorch's
  // expandable segments make it) has no CUDA IPC handle; it goes out as its allocation's
  // POSIX fd, which importers also map at full copy speed (docs/benchmarks.md compares it
  // with a CUDA IPC mapping of cudaMalloc memory).
  CUmemGenericAllocationHandle vmm = 0;
  if (d->retain(&vmm, const_cast<void*>(ptr)) == CUDA_SUCCESS) {
    m->kind_ = ExportKind::kCuMemFd;
    m->mem_handle_ = vmm;  // our reference: the allocation outlives this export
    int fd = -1;
    CUresult r = d->export_handle(&fd, vmm, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    if (r != CUDA_SUCCESS) {
      return InvalidArgument(fmt::format(
          "device memory at {} on cuda:{} comes from cuMemCreate without a POSIX fd handle type, so it cannot be "
          "exported (CUresult {}); allocate it with requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR",
          ptr, device, static_cast<int>(r)));
    }
    m->fd_ = fd;
    return m;
  }
  (void)cudaGetLastError();
  cudaIpcMemHandle_t h;
  WSYNC_CUDA_CHECK(cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(base)));
  std::memcpy(m->ipc_handle_, &h, sizeof(h));
  return m;
}

void ExportedDeviceMemory::Count(int64_t bytes) {
  NoteDeviceBytes(bytes - counted_);
  counted_ = bytes;
}

ExportedDeviceMemory::~ExportedDeviceMemory() {
  Count(0);
  if (!owned_) {  // an export of memory someone else owns: drop only what the export took
    if (fd_ >= 0) close(fd_);
    if (mem_handle_ != 0) {
      if (auto d = GetDriver(); d.ok()) (*d)->release(mem_handle_);
    }
    return;
  }
  if (cudaSetDevice(device_) != cudaSuccess) return;
  if (kind_ == ExportKind::kCudaIpc) {
    if (ptr_ != nullptr) cudaFree(ptr_);
    return;
  }
  if (fd_ >= 0) close(fd_);
  auto d = GetDriver();
  if (!d.ok()) return;
  if (ptr_ != nullptr) {
    if (mem_handle_ != 0) (*d)->unmap(reinterpret_cast<CUdeviceptr>(ptr_), size_);  // mapped unless released
    (*d)->address_free(reinterpret_cast<CUdeviceptr>(ptr_), size_);
  }
  if (mem_handle_ != 0) (*d)->release(mem_handle_);
}

Status ExportedDeviceMemory::ReleasePhysical() {
  if (!owned_ || kind_ != ExportKind::kCuMemFd) {
    return InvalidArgument(fmt::format("device memory at {} on cuda:{} is not an owned cuda_fd allocation; only those "
                                       "release their physical memory in place", ptr_, device_));
  }
  if (mem_handle_ == 0) return Status::Ok();
  WSYNC_RETURN_IF_ERROR(UseDevice(device_));
  WSYNC_ASSIGN_OR_RETURN(const Driver* d, GetDriver());
  WSYNC_CUDA_CHECK(cudaDeviceSynchronize());  // no copy may still use the memory
  WSYNC_CU_CHECK(d->unmap(reinterpret_cast<CUdeviceptr>(ptr_), size_));
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
  CUmemGenericAllocationHandle handle = mem_handle_;
  mem_handle_ = 0;
  WSYNC_CU_CHECK(d->release(handle));
  Count(0);
  return Status::Ok();
}

Status ExportedDeviceMemory::RestorePhysical() {
  if (!owned_ || kind_ != ExportKind::kCuMemFd) {
    return InvalidArgument(fmt::format("device memory at {} on cuda:{} is not an owned cuda_fd allocation; only those "
                                       "map physical memory back in place", ptr_, device_));
  }
  if (mem_handle_ != 0) return Status::Ok();
  WSYNC_RETURN_IF_ERROR(UseDevice(device_));
  WSYNC_ASSIGN_OR_RETURN(const Driver* d, GetDriver());
  CUmemAllocationProp prop = FdProp(device_);
  CUmemGenericAllocationHandle handle = 0;
  WSYNC_CU_CHECK(d->create(&handle, size_, &prop, 0));
  CUresult r = MapAt(*d, reinterpret_cast<CUdeviceptr>(ptr_), handle, size_, device_);
  if (r != CUDA_SUCCESS) {
    d->release(handle);
    WSYNC_CU_CHECK(r);
  }
  mem_handle_ = handle;
  Count(static_cast<int64_t>(size_));
  int fd = -1;
  WSYNC_CU_CHECK(d->export_handle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  fd_ = fd;
  return Status::Ok();
}

json ExportedDeviceMemory::Handle() const {
  if (kind_ == ExportKind::kCudaIpc) return json{{"handle_b64", Base64(ipc_handle_, sizeof(ipc_handle_))}};
  return json{{"pid", static_cast<int64_t>(getpid())}, {"fd", fd_}, {"bytes", owned_ ? size_ : alloc_bytes_}};
}

std::string ExportedDeviceMemory::Identity() const {
  if (kind_ == ExportKind::kCudaIpc) return "cuda_ipc:" + Base64(ipc_handle_, sizeof(ipc_handle_));
  // The fd differs per export; the allocation handle does not, and while an export holds
  // its reference no other allocation can take the same handle value.
  return fmt::format("cuda_fd:{:x}:{:x}:{}", mem_handle_, reinterpret_cast<uintptr_t>(ptr_) - base_offset_,
                     owned_ ? size_ : alloc_bytes_);
}

Result<std::unique_ptr<ImportedDeviceMemory>> ImportedDeviceMemory::Open(int device, ExportKind kind,
                                                                        const json& handle, size_t bytes) {
  if (!handle.is_object()) return InvalidArgument("device memory handle must be a JSON object");
  WSYNC_RETURN_IF_ERROR(UseDevice(device));
  std::unique_ptr<ImportedDeviceMemory> m(new ImportedDeviceMemory());
  m->kind_ = kind;
  m->device_ = device;
  if (kind == ExportKind::kCudaIpc) {
    auto it = handle.find("handle_b64");
    if (it == handle.end() || !it->is_string()) return InvalidArgument("cuda_ipc handle needs a string 'handle_b64'");
    cudaIpcMemHandle_t h;
    WSYNC_RETURN_IF_ERROR(Unbase64(it->get<std::string>(), reinterpret_cast<unsigned char*>(&h), sizeof(h)));
    WSYNC_CUDA_CHECK(cudaIpcOpenMemHandle(&m->ptr_, h, cudaIpcMemLazyEnablePeerAccess));
    // The handle carries no size, and the importer's `bytes` come from the exporter's
    // payload: the allocation the handle opened must hold them, or a copy would read past
    // its end on the device.
    WSYNC_ASSIGN_OR_RETURN(const Driver* d, GetDriver());
    CUdeviceptr base = 0;
    size_t size = 0;
    WSYNC_CU_CHECK(d->address_range(&base, &size, reinterpret_cast<CUdeviceptr>(m->ptr_)));
    size_t from_ptr = size - (reinterpret_cast<CUdeviceptr>(m->ptr_) - base);
    if (from_ptr < bytes) {
      return InvalidArgument(fmt::format("cuda_ipc handle opens an allocation of {} bytes, {} are needed", from_ptr,
                                         bytes));
    }
    m->size_ = bytes;
    return m;
  }
  // Exact integers: a pid of 4294967297 must not become pid 1.
  auto field = [&](const char* f, auto max) -> Result<uint64_t> {
    auto it = handle.find(f);
    std::optional<uint64_t> v;
    if (it != handle.end() && it->is_number_unsigned()) v = it->template get<uint64_t>();
    if (it != handle.end() && it->is_number_integer() && !it->is_number_unsigned()) {
      v = CheckedCast<uint64_t>(it->template get<int64_t>());
    }
    if (!v || *v > static_cast<uint64_t>(max)) {
      return InvalidArgument(fmt::format("cuda_fd handle needs an integer '{}' within 0..{}", f, max));
    }
    return *v;
  };
  WSYNC_ASSIGN_OR_RETURN(uint64_t pid64, field("pid", std::numeric_limits<pid_t>::max()));
  WSYNC_ASSIGN_OR_RETURN(uint64_t fd64, field("fd", std::numeric_limits<int>::max()));
  WSYNC_ASSIGN_OR_RETURN(uint64_t size64, field("bytes", std::numeric_limits<size_t>::max()));
  if (pid64 == 0) return InvalidArgument("cuda_fd handle pid must be positive");
  int pid = static_cast<int>(pid64), remote_fd = static_cast<int>(fd64);
  size_t size = size64;
  if (size < bytes) {
    return InvalidArgument(fmt::format("cuda_fd handle exports {} bytes, {} are needed", size, bytes));
  }
  WSYNC_ASSIGN_OR_RETURN(const Driver* d, GetDriver());
  int pidfd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  if (pidfd < 0) {
    return InvalidArgument(fmt::format("pidfd_open({}): {} (has the exporting process exited?)", pid, std::strerror(errno)));
  }
  int fd = static_cast<int>(syscall(SYS_pidfd_getfd, pidfd, remote_fd, 0));
  int err = errno;
  close(pidfd);
  if (fd < 0) {
    return InvalidArgument(fmt::format(
        "pidfd_getfd(pid {}, fd {}): {} (taking another process's fd needs ptrace rights over it: the same "
        "user with Yama ptrace_scope 0, or CAP_SYS_PTRACE; otherwise export kind cuda_ipc)",
        pid, remote_fd, std::strerror(err)));
  }
  CUmemGenericAllocationHandle h = 0;
  CUresult r = d->import_handle(&h, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  close(fd);
  WSYNC_CU_CHECK(r);
  m->mem_handle_ = h;
  m->size_ = size;
  WSYNC_ASSIGN_OR_RETURN(CUdeviceptr ptr, MapHandle(*d, h, size, device));
  m->ptr_ = reinterpret_cast<void*>(ptr);
  return m;
}

ImportedDeviceMemory::~ImportedDeviceMemory() {
  if (cudaSetDevice(device_) != cudaSuccess) return;
  if (kind_ == ExportKind::kCudaIpc) {
    if (ptr_ != nullptr) cudaIpcCloseMemHandle(ptr_);
    return;
  }
  auto d = GetDriver();
  if (!d.ok()) return;
  if (ptr_ != nullptr) {
    (*d)->unmap(reinterpret_cast<CUdeviceptr>(ptr_), size_);
    (*d)->address_free(reinterpret_cast<CUdeviceptr>(ptr_), size_);
  }
  if (mem_handle_ != 0) (*d)->release(mem_handle_);
}

}  // namespace wsync::cuda
