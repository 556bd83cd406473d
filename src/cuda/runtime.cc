#include "cuda/runtime.h"

#include <cuda_runtime_api.h>

#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include <fmt/format.h>

#include "core/digest.h"
#include "core/process_memory.h"
#include "cuda/cuda_check.h"
#include "cuda/device.h"
#include "cuda/device_memory.h"
#include "cuda/digest_kernels.h"
#include "wsync/device_runtime.h"

namespace wsync::cuda {
namespace {

class CudaDeviceRuntime final : public DeviceRuntime {
 public:
  int DeviceCount() override { return cuda::DeviceCount(); }

  Status SetDevice(int device) override {
    WSYNC_CUDA_CHECK(cudaSetDevice(device));
    return Status::Ok();
  }

  Result<void*> Allocate(int device, size_t bytes) override {
    WSYNC_CUDA_CHECK(cudaSetDevice(device));
    void* p = nullptr;
    cudaError_t err = cudaMalloc(&p, bytes == 0 ? 256 : bytes);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();  // clear the sticky-free error so later calls do not see it
      return CudaError(err, fmt::format("cudaMalloc({} bytes) on cuda:{}", bytes, device), __FILE__, __LINE__);
    }
    {
      std::lock_guard lock(mu_);
      plain_[p] = bytes == 0 ? 256 : bytes;
    }
    NoteDeviceBytes(static_cast<int64_t>(bytes == 0 ? 256 : bytes));
    WSYNC_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, cudaStreamPerThread));
    WSYNC_CUDA_CHECK(cudaStreamSynchronize(cudaStreamPerThread));
    return p;
  }

  Result<void*> AllocateVirtualMemory(int device, size_t bytes) override {
    auto m = ExportedDeviceMemory::Allocate(device, bytes == 0 ? 1 : bytes, ExportKind::kCuMemFd);
    if (!m.ok()) return m.status().WithContext(fmt::format("cuMemCreate of {} bytes on cuda:{}", bytes, device));
    void* p = (*m)->data();
    WSYNC_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, cudaStreamPerThread));
    WSYNC_CUDA_CHECK(cudaStreamSynchronize(cudaStreamPerThread));
    std::lock_guard lock(mu_);
    virtual_[p] = std::move(*m);
    return p;
  }

  void Free(int device, void* ptr) override {
    {
      std::unique_ptr<ExportedDeviceMemory> vm;
      std::unique_lock lock(mu_);
      if (auto it = virtual_.find(ptr); it != virtual_.end()) {
        vm = std::move(it->second);
        virtual_.erase(it);
        lock.unlock();
        vm.reset();  // unmaps and releases (an importer's mapping keeps the memory alive)
        return;
      }
      if (auto it = plain_.find(ptr); it != plain_.end()) {
        NoteDeviceBytes(-static_cast<int64_t>(it->second));
        plain_.erase(it);
      }
    }
    int current = -1;
    (void)cudaGetDevice(&current);
    (void)cudaSetDevice(device);
    (void)cudaFree(ptr);
    if (current >= 0) (void)cudaSetDevice(current);
  }

  Status ReleasePhysical(int device, void* ptr) override {
    WSYNC_ASSIGN_OR_RETURN(ExportedDeviceMemory * vm, Virtual(device, ptr));
    return vm->ReleasePhysical();
  }

  Status RestorePhysical(int device, void* ptr) override {
    WSYNC_ASSIGN_OR_RETURN(ExportedDeviceMemory * vm, Virtual(device, ptr));
    if (vm->physical()) return Status::Ok();
    WSYNC_RETURN_IF_ERROR(vm->RestorePhysical());
    WSYNC_CUDA_CHECK(cudaMemsetAsync(ptr, 0, vm->size(), cudaStreamPerThread));
    WSYNC_CUDA_CHECK(cudaStreamSynchronize(cudaStreamPerThread));
    return Status::Ok();
  }

  Result<MemoryInfo> GetMemoryInfo(int device) override {
    WSYNC_CUDA_CHECK(cudaSetDevice(device));
    MemoryInfo info;
    WSYNC_CUDA_CHECK(cudaMemGetInfo(&info.free_bytes, &info.total_bytes));
    return info;
  }

  Status Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width,
                size_t count) override {
    if (width == 0 || count == 0) return Status::Ok();
    if (count == 1) {
      WSYNC_CUDA_CHECK(cudaMemcpyAsync(dst, src, width, cudaMemcpyDefault, cudaStreamPerThread));
    } else {
      WSYNC_CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, count, cudaMemcpyDefault,
                                         cudaStreamPerThread));
    }
    return Status::Ok();
  }

  Status Synchronize() override {
    WSYNC_CUDA_CHECK(cudaStreamSynchronize(cudaStreamPerThread));
    return Status::Ok();
  }

  Status Xxh3Digests(std::span<const Span> spans, std::span<uint64_t> out) override {
    if (out.size() != 2 * spans.size()) {
      return InvalidArgument(fmt::format("{} digest words for {} spans", out.size(), spans.size()));
    }
    if (spans.empty()) return Status::Ok();
    if (spans.size() > std::numeric_limits<unsigned>::max() / 2) {
      return InvalidArgument(fmt::format("{} spans to digest in one launch", spans.size()));
    }
    std::vector<kernels::DigestSpan> list(spans.size());
    for (size_t i = 0; i < spans.size(); ++i) {
      list[i] = {static_cast<const unsigned char*>(spans[i].data), spans[i].bytes};
    }
    // Stream-ordered scratch: no device-wide synchronization, so a broadcast on another
    // stream keeps running while the digests are taken.
    const size_t list_bytes = list.size() * sizeof(kernels::DigestSpan);
    void* scratch = nullptr;
    WSYNC_CUDA_CHECK(cudaMallocAsync(&scratch, list_bytes + out.size_bytes(), cudaStreamPerThread));
    auto* device_list = static_cast<kernels::DigestSpan*>(scratch);
    auto* device_out = reinterpret_cast<unsigned long long*>(static_cast<char*>(scratch) + list_bytes);
    cudaError_t err = cudaMemcpyAsync(device_list, list.data(), list_bytes, cudaMemcpyHostToDevice,
                                      cudaStreamPerThread);
    if (err == cudaSuccess) {
      err = kernels::LaunchXxh3Spans(device_list, static_cast<unsigned>(list.size()), secret_, device_out,
                                     cudaStreamPerThread);
    }
    if (err == cudaSuccess) {
      err = cudaMemcpyAsync(out.data(), device_out, out.size_bytes(), cudaMemcpyDeviceToHost, cudaStreamPerThread);
    }
    const cudaError_t freed = cudaFreeAsync(scratch, cudaStreamPerThread);
    const cudaError_t synced = cudaStreamSynchronize(cudaStreamPerThread);
    if (err == cudaSuccess) err = freed != cudaSuccess ? freed : synced;
    if (err != cudaSuccess) {
      return CudaError(err, fmt::format("digesting {} spans of device memory", spans.size()), __FILE__, __LINE__);
    }
    return Status::Ok();
  }

 private:
  const xxh3::Secret secret_ = Xxh3DefaultSecret();
  // The virtual-memory allocation that starts at `ptr` on `device`.
  Result<ExportedDeviceMemory*> Virtual(int device, void* ptr) {
    std::lock_guard lock(mu_);
    auto it = virtual_.find(ptr);
    if (it == virtual_.end() || it->second->device() != device) {
      return InvalidArgument(fmt::format("{} on cuda:{} is not the start of a virtual-memory allocation of this "
                                         "runtime (DeviceRuntime::AllocateVirtualMemory)", ptr, device));
    }
    return it->second.get();
  }

  std::mutex mu_;
  std::map<void*, std::unique_ptr<ExportedDeviceMemory>> virtual_;  // GUARDED_BY(mu_)
  std::map<void*, size_t> plain_;  // cudaMalloc'd bytes, GUARDED_BY(mu_)
};

}  // namespace

void InstallDeviceRuntime() {
  static CudaDeviceRuntime runtime;
  InstallCudaRuntime(&runtime);
}

}  // namespace wsync::cuda
