#include "cuda/cuda_check.h"

#include <fmt/format.h>

namespace wsync::cuda {

Status CudaError(cudaError_t err, std::string_view expr, const char* file, int line) {
  StatusCode code = err == cudaErrorInvalidValue || err == cudaErrorInvalidResourceHandle ||
                            err == cudaErrorInvalidDevice || err == cudaErrorMapBufferObjectFailed
                        ? StatusCode::kInvalidArgument
                    : err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver
                        ? StatusCode::kUnavailable
                        : StatusCode::kInternal;
  return Status(code, fmt::format("{} -> {}: {} ({}:{})", expr, cudaGetErrorName(err), cudaGetErrorString(err),
                                  file, line));
}

Status CuError(CUresult res, std::string_view expr, const char* file, int line) {
  const char* name = "CUDA_ERROR";
  const char* text = "";
  if (auto n = DriverFn<CUresult (*)(CUresult, const char**)>("cuGetErrorName"); n.ok()) (*n)(res, &name);
  if (auto s = DriverFn<CUresult (*)(CUresult, const char**)>("cuGetErrorString"); s.ok()) (*s)(res, &text);
  StatusCode code = res == CUDA_ERROR_INVALID_VALUE || res == CUDA_ERROR_INVALID_HANDLE ||
                            res == CUDA_ERROR_INVALID_DEVICE || res == CUDA_ERROR_NOT_SUPPORTED
                        ? StatusCode::kInvalidArgument
                    : res == CUDA_ERROR_NO_DEVICE ? StatusCode::kUnavailable
                                                  : StatusCode::kInternal;
  return Status(code, fmt::format("{} -> {}: {} ({}:{})", expr, name, text, file, line));
}

Result<void*> DriverSymbol(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  cudaError_t err = cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found);
  if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || fn == nullptr) {
    return Unavailable(fmt::format("CUDA driver entry point {} is not available ({})", name,
                                   err != cudaSuccess ? cudaGetErrorString(err) : "symbol not found"));
  }
  return fn;
}

}  // namespace wsync::cuda
