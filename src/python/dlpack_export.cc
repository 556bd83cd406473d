// Lend: wsync's memory to Python as a DLPack capsule, without copying.
#include <Python.h>

#include <dlpack/dlpack.h>

#include <vector>

#include <fmt/format.h>

#include "python/dlpack.h"
#include "python/errors.h"

namespace py = pybind11;

namespace wsync::python {
namespace {

constexpr const char* kCapsuleName = "dltensor";          // DLPack's protocol: not consumed yet
constexpr const char* kUsedCapsuleName = "used_dltensor";  // renamed by the consumer

// The managed tensor and what it points into: its shape, and the object kept alive for
// as long as the consumer holds the tensor.
struct Lent {
  DLManagedTensor managed{};
  std::vector<int64_t> shape;
  PyObject* keep_alive = nullptr;  // a strong reference, or null
};

// DLPack's deleter: the consumer may call it from any thread, with or without the GIL.
void DeleteLent(DLManagedTensor* self) {
  auto* lent = static_cast<Lent*>(self->manager_ctx);
  if (lent->keep_alive != nullptr) {
    PyGILState_STATE gil = PyGILState_Ensure();
    Py_DECREF(lent->keep_alive);
    PyGILState_Release(gil);
  }
  delete lent;
}

// The capsule's destructor: a capsule no consumer took still owns its tensor.
void DestroyCapsule(PyObject* capsule) {
  if (PyCapsule_IsValid(capsule, kUsedCapsuleName)) return;
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, kCapsuleName));
  if (managed == nullptr) {
    PyErr_Clear();
    return;
  }
  managed->deleter(managed);
}

// DLPack 0.6 has no 8-bit float and carries bool as an 8-bit unsigned integer: those go
// out as uint8, for the caller to view as the real dtype.
DLDataType DlType(DType dtype) {
  switch (dtype) {
    case DType::kBool: return {kDLUInt, 8, 1};
    case DType::kU8: return {kDLUInt, 8, 1};
    case DType::kI8: return {kDLInt, 8, 1};
    case DType::kI16: return {kDLInt, 16, 1};
    case DType::kI32: return {kDLInt, 32, 1};
    case DType::kI64: return {kDLInt, 64, 1};
    case DType::kF16: return {kDLFloat, 16, 1};
    case DType::kBF16: return {kDLBfloat, 16, 1};
    case DType::kF32: return {kDLFloat, 32, 1};
    case DType::kF64: return {kDLFloat, 64, 1};
    case DType::kF8E4M3:
    case DType::kF8E5M2: return {kDLUInt, 8, 1};
  }
  return {kDLUInt, 8, 1};
}

}  // namespace

py::capsule Lend(std::span<std::byte> bytes, DType dtype, std::span<const int64_t> shape, const Device& device,
                 py::object keep_alive) {
  auto lent = std::make_unique<Lent>();
  lent->shape.assign(shape.begin(), shape.end());
  DLTensor& t = lent->managed.dl_tensor;
  t.data = bytes.data();
  t.device = device.is_cpu() ? DLDevice{kDLCPU, 0} : DLDevice{kDLCUDA, device.index};
  t.ndim = static_cast<int32_t>(lent->shape.size());
  t.dtype = DlType(dtype);
  t.shape = lent->shape.data();
  t.strides = nullptr;  // compact, row-major
  t.byte_offset = 0;
  if (!keep_alive.is_none()) lent->keep_alive = keep_alive.release().ptr();
  lent->managed.manager_ctx = lent.get();
  lent->managed.deleter = DeleteLent;
  DLManagedTensor* managed = &lent.release()->managed;
  PyObject* capsule = PyCapsule_New(managed, kCapsuleName, DestroyCapsule);
  if (capsule == nullptr) {
    managed->deleter(managed);
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::capsule>(capsule);
}

}  // namespace wsync::python
