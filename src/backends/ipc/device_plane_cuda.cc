// device_plane.h over src/cuda (CUDA builds).
#include <cuda_runtime_api.h>

#include <fmt/format.h>

#include "backends/ipc/device_plane.h"
#include "cuda/batched_copy.h"
#include "cuda/cuda_check.h"
#include "cuda/device.h"
#include "cuda/device_memory.h"

namespace wsync {
namespace {

Status NeedsCuda(const Device& device) {
  if (device.is_cpu()) return InvalidArgument("the ipc device plane takes CUDA devices, got cpu");
  return Status::Ok();
}

class CudaExport final : public DeviceExport {
 public:
  explicit CudaExport(std::unique_ptr<cuda::ExportedDeviceMemory> m) : m_(std::move(m)) {}
  std::byte* data() const override { return static_cast<std::byte*>(m_->data()); }
  std::string_view kind() const override { return cuda::ExportKindName(m_->kind()); }
  uint64_t offset() const override { return m_->base_offset(); }
  nlohmann::json Handle() const override { return m_->Handle(); }
  std::string Identity() const override { return m_->Identity(); }

 private:
  std::unique_ptr<cuda::ExportedDeviceMemory> m_;
};

class CudaImport final : public DeviceImport {
 public:
  explicit CudaImport(std::unique_ptr<cuda::ImportedDeviceMemory> m) : m_(std::move(m)) {}
  std::byte* data() const override { return static_cast<std::byte*>(m_->data()); }

 private:
  std::unique_ptr<cuda::ImportedDeviceMemory> m_;
};

class CudaCopies final : public DeviceCopies {
 public:
  explicit CudaCopies(std::unique_ptr<cuda::CopyPlan> plan) : plan_(std::move(plan)) {}
  Status Run() override {
    if (plan_->tiles() == 0) return Status::Ok();
    (void)cudaGetLastError();  // a stale error from an unrelated call must not fail this launch
    WSYNC_RETURN_IF_ERROR(plan_->Launch(cudaStreamPerThread));
    WSYNC_CUDA_CHECK(cudaStreamSynchronize(cudaStreamPerThread));
    return Status::Ok();
  }
  uint64_t bytes() const override { return plan_->bytes(); }

 private:
  std::unique_ptr<cuda::CopyPlan> plan_;
};

class CudaPlane final : public IpcDevicePlane {
 public:
  Result<std::string> DeviceKey(const Device& device) override {
    WSYNC_RETURN_IF_ERROR(NeedsCuda(device));
    return cuda::GpuUuid(device.index);
  }

  Result<std::unique_ptr<DeviceExport>> Allocate(const Device& device, uint64_t bytes,
                                                 std::string_view kind) override {
    WSYNC_RETURN_IF_ERROR(NeedsCuda(device));
    WSYNC_ASSIGN_OR_RETURN(cuda::ExportKind k, cuda::ParseExportKind(kind));
    auto m = cuda::ExportedDeviceMemory::Allocate(device.index, bytes, k);
    if (!m.ok()) {
      return m.status().WithContext(
          fmt::format("allocating {} bytes of {} staging on {}", bytes, kind, device.ToString()));
    }
    return std::unique_ptr<DeviceExport>(std::make_unique<CudaExport>(std::move(*m)));
  }

  Result<std::unique_ptr<DeviceExport>> Existing(const Device& device, const void* ptr, uint64_t bytes) override {
    WSYNC_RETURN_IF_ERROR(NeedsCuda(device));
    auto m = cuda::ExportedDeviceMemory::ExportExisting(device.index, ptr);
    if (!m.ok()) return m.status().WithContext(fmt::format("exporting the trainer's tensors on {}", device.ToString()));
    if ((*m)->size() < bytes) {
      std::string why = (*m)->kind() == cuda::ExportKind::kCuMemFd
                            ? ": the block spans several cuMemCreate allocations mapped side by side (as PyTorch's "
                              "expandable segments map a buffer larger than one segment page), and one export "
                              "carries one allocation; allocate the block without expandable segments, or use "
                              "ipc mode packed"
                            : "";
      return InvalidArgument(fmt::format("the allocation behind the trainer's tensors on {} holds {} bytes from "
                                         "their start, {} are needed{}", device.ToString(), (*m)->size(), bytes, why));
    }
    return std::unique_ptr<DeviceExport>(std::make_unique<CudaExport>(std::move(*m)));
  }

  Result<std::unique_ptr<DeviceImport>> Open(const Device& device, std::string_view kind,
                                             const nlohmann::json& handle, uint64_t bytes) override {
    WSYNC_RETURN_IF_ERROR(NeedsCuda(device));
    WSYNC_ASSIGN_OR_RETURN(cuda::ExportKind k, cuda::ParseExportKind(kind));
    auto m = cuda::ImportedDeviceMemory::Open(device.index, k, handle, bytes);
    if (!m.ok()) {
      (void)cudaGetLastError();
      // The handle came from the request: whatever makes it unopenable is the caller's.
      return InvalidArgument(fmt::format("cannot open the {} handle on {}: {}", kind, device.ToString(),
                                         m.status().message()));
    }
    return std::unique_ptr<DeviceImport>(std::make_unique<CudaImport>(std::move(*m)));
  }

  Result<std::unique_ptr<DeviceCopies>> Copies(const Device& device,
                                               std::span<const WorkerStore::ByteCopy> copies) override {
    WSYNC_RETURN_IF_ERROR(NeedsCuda(device));
    std::vector<cuda::CopyOp> ops;
    ops.reserve(copies.size());
    for (const WorkerStore::ByteCopy& c : copies) ops.push_back({c.src, c.dst, c.bytes});
    WSYNC_ASSIGN_OR_RETURN(std::unique_ptr<cuda::CopyPlan> plan, cuda::CopyPlan::Create(ops));
    return std::unique_ptr<DeviceCopies>(std::make_unique<CudaCopies>(std::move(plan)));
  }

  Status Synchronize(const Device& device) override {
    WSYNC_RETURN_IF_ERROR(NeedsCuda(device));
    WSYNC_CUDA_CHECK(cudaSetDevice(device.index));
    WSYNC_CUDA_CHECK(cudaDeviceSynchronize());
    return Status::Ok();
  }

  Result<std::pair<uint64_t, uint64_t>> MemoryInfo(const Device& device) override {
    WSYNC_RETURN_IF_ERROR(NeedsCuda(device));
    WSYNC_CUDA_CHECK(cudaSetDevice(device.index));
    size_t free = 0, total = 0;
    WSYNC_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    return std::pair<uint64_t, uint64_t>{free, total};
  }
};

}  // namespace

bool IpcDevicePlaneBuilt() { return true; }

IpcDevicePlane& BuiltinIpcDevicePlane() {
  static CudaPlane plane;
  return plane;
}

}  // namespace wsync
