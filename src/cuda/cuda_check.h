// Check macros for CUDA runtime and driver calls: a failing call becomes a Status that
// records the expression, CUDA's own error name and message, and file:line, with the
// caller's context ("importing the staging buffer of GPU-...: cudaIpcOpenMemHandle(...)
// -> cudaErrorInvalidValue: invalid argument (device_memory.cc:88)").
//
// The driver API is reached through cudaGetDriverEntryPointByVersion (DriverFn below),
// never by linking libcuda: a binary built with CUDA then loads and runs on a machine
// without a GPU driver, where every CUDA call answers "no device" and GPU tests skip.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <string>
#include <string_view>

#include "wsync/status.h"

namespace wsync::cuda {

Status CudaError(cudaError_t err, std::string_view expr, const char* file, int line);
Status CuError(CUresult res, std::string_view expr, const char* file, int line);

// The driver entry point `name` (e.g. "cuMemCreate") as of CUDA 12.0, or Unavailable.
Result<void*> DriverSymbol(const char* name);
template <typename Fn>
Result<Fn> DriverFn(const char* name) {
  WSYNC_ASSIGN_OR_RETURN(void* p, DriverSymbol(name));
  return reinterpret_cast<Fn>(p);
}

}  // namespace wsync::cuda

#define WSYNC_CUDA_CHECK(expr)                                                              \
  do {                                                                                      \
    cudaError_t wsync_cuda_err_ = (expr);                                                   \
    if (wsync_cuda_err_ != cudaSuccess)                                                     \
      return ::wsync::cuda::CudaError(wsync_cuda_err_, #expr, __FILE__, __LINE__);          \
  } while (0)

#define WSYNC_CU_CHECK(expr)                                                                \
  do {                                                                                      \
    CUresult wsync_cu_res_ = (expr);                                                        \
    if (wsync_cu_res_ != CUDA_SUCCESS)                                                      \
      return ::wsync::cuda::CuError(wsync_cu_res_, #expr, __FILE__, __LINE__);             \
  } while (0)
