// Tensors across the Python boundary through DLPack, without copying.
//
// Borrow: a trainer's tensor (torch CPU or CUDA, numpy, anything with __dlpack__) read in
// place. Lend: wsync's own receive buffers handed to Python as torch tensors, valid while
// the call that lends them runs.
#pragma once

#include <cstddef>
#include <optional>
#include <span>
#include <string_view>

#include <pybind11/pybind11.h>

#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync::python {

// One tensor lent by Python: a view of its bytes and the object keeping them alive.
// `meta.name` is the name the caller gave. Holding `owner` needs the GIL (copy and destroy
// it only with the GIL held).
struct BorrowedTensor {
  TensorMeta meta;
  const std::byte* data = nullptr;
  size_t nbytes = 0;
  Device device;
  pybind11::object owner;
  TensorRef ref() const {
    return TensorRef{meta.name, meta.dtype, meta.shape, {data, nbytes}, device};
  }
};

// Reads `tensor` through DLPack, consuming the capsule its __dlpack__() returns (renamed
// "used_dltensor"; the producer's deleter runs when `owner` goes). A torch tensor that
// requires grad is read through its detached view; for a torch CUDA tensor, torch's
// current stream on its device is synchronized first. A non-contiguous tensor, an
// unsupported dtype or device is an InvalidArgument naming `name`. `bits_of`: integers of
// the same width are read as this dtype when it is one numpy lacks (bfloat16 from a
// uint16/int16 array, float8 from uint8/int8). Needs the GIL. (dlpack.cc)
// `sync_cuda` false: the caller vouches that the tensor's producing work is done (its
// source synchronized once for the whole pass).
Result<BorrowedTensor> Borrow(pybind11::handle tensor, std::string_view name,
                              std::optional<DType> bits_of = std::nullopt, bool sync_cuda = true);

// A DLPack capsule ("dltensor") over `bytes`, which wsync owns and keeps valid while the
// capsule's consumer may use it; `keep_alive` is held until the consumer releases it.
// Needs the GIL. (dlpack_export.cc)
pybind11::capsule Lend(std::span<std::byte> bytes, DType dtype, std::span<const int64_t> shape,
                       const Device& device, pybind11::object keep_alive = pybind11::none());

}  // namespace wsync::python
