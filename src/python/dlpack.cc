#include "python/dlpack.h"

#include <dlpack/dlpack.h>

#include <optional>
#include <string>

#include <fmt/format.h>

namespace py = pybind11;

namespace wsync::python {
namespace {

constexpr const char* kCapsuleName = "dltensor";
constexpr const char* kUsedCapsuleName = "used_dltensor";

// torch's exporter without the stream handshake of Tensor.__dlpack__, whose Python-level
// event record and wait cost more per CUDA tensor than the rest of a zero-copy sync's
// per-tensor work; Borrow synchronizes torch's stream itself. Null until torch is
// imported (numpy-only callers never import it). Kept for the life of the process.
struct TorchExporter {
  PyObject* tensor_type = nullptr;
  PyObject* to_dlpack = nullptr;
};

const TorchExporter& Torch() {
  static TorchExporter torch;
  if (torch.to_dlpack != nullptr) return torch;
  py::dict modules = py::module_::import("sys").attr("modules");
  if (!modules.contains("torch")) return torch;
  try {
    py::object tensor_type = py::module_::import("torch").attr("Tensor");
    py::object to_dlpack = py::module_::import("torch.utils.dlpack").attr("to_dlpack");
    torch.tensor_type = tensor_type.release().ptr();
    torch.to_dlpack = to_dlpack.release().ptr();
  } catch (py::error_already_set&) {
    // A torch without to_dlpack: every tensor goes through __dlpack__.
  }
  return torch;
}

// The "dltensor" capsule of `tensor`: torch's exporter for torch tensors, else __dlpack__.
py::object ExportCapsule(const py::object& tensor) {
  const TorchExporter& torch = Torch();
  if (torch.to_dlpack != nullptr && PyObject_IsInstance(tensor.ptr(), torch.tensor_type) == 1) {
    return py::reinterpret_borrow<py::object>(torch.to_dlpack)(tensor);
  }
  return tensor.attr("__dlpack__")();
}

std::optional<DType> FromDl(DLDataType t) {
  if (t.lanes != 1) return std::nullopt;
  switch (t.code) {
    case kDLFloat:
      if (t.bits == 16) return DType::kF16;
      if (t.bits == 32) return DType::kF32;
      if (t.bits == 64) return DType::kF64;
      return std::nullopt;
    case kDLBfloat:
      if (t.bits == 16) return DType::kBF16;
      return std::nullopt;
    case kDLInt:
      if (t.bits == 8) return DType::kI8;
      if (t.bits == 16) return DType::kI16;
      if (t.bits == 32) return DType::kI32;
      if (t.bits == 64) return DType::kI64;
      return std::nullopt;
    case kDLUInt:
      if (t.bits == 8) return DType::kU8;
      return std::nullopt;
    default:
      return std::nullopt;
  }
}

// numpy has no bfloat16 or float8: their bits arrive as integers of the same width.
bool IsBitsOf(DLDataType t, DType want) {
  if (t.lanes != 1 || (t.code != kDLInt && t.code != kDLUInt)) return false;
  if (want == DType::kBF16) return t.bits == 16;
  if (want == DType::kF8E4M3 || want == DType::kF8E5M2) return t.bits == 8;
  return false;
}

std::string DlTypeString(DLDataType t) {
  const char* code = t.code == kDLInt ? "int" : t.code == kDLUInt ? "uint" : t.code == kDLFloat ? "float"
                     : t.code == kDLBfloat ? "bfloat" : "code";
  std::string s = fmt::format("{}{}", code, t.bits);
  if (t.lanes != 1) s += fmt::format("x{}", t.lanes);
  return s;
}

// Row-major strides (in elements) for `shape`; a dimension of extent 1 may carry any stride.
bool IsCompact(const DLTensor& t) {
  if (t.strides == nullptr) return true;
  int64_t expect = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    if (t.shape[d] != 1 && t.strides[d] != expect) return false;
    expect *= t.shape[d];
  }
  return true;
}

// Owns a consumed DLManagedTensor: the capsule's deleter runs the producer's deleter.
py::capsule Own(DLManagedTensor* managed) {
  return py::capsule(managed, "wsync.borrowed_dltensor", [](PyObject* capsule) {
    auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "wsync.borrowed_dltensor"));
    if (m != nullptr && m->deleter != nullptr) m->deleter(m);
  });
}

}  // namespace

Result<BorrowedTensor> Borrow(py::handle tensor, std::string_view name, std::optional<DType> bits_of,
                              bool sync_cuda) {
  if (!py::hasattr(tensor, "__dlpack__")) {
    return InvalidArgument(fmt::format("tensor {} is a {}, which has no __dlpack__ (use a torch tensor or a numpy array)",
                                       name, std::string(py::str(py::type::handle_of(tensor).attr("__name__")))));
  }
  py::object source = py::reinterpret_borrow<py::object>(tensor);
  // torch refuses to export a tensor that requires grad; its detached view shares the storage.
  if (py::hasattr(source, "requires_grad") && py::hasattr(source, "detach") &&
      py::bool_(source.attr("requires_grad"))) {
    source = source.attr("detach")();
  }
  py::object capsule_obj;
  try {
    capsule_obj = ExportCapsule(source);
  } catch (py::error_already_set& e) {
    return InvalidArgument(fmt::format("tensor {} cannot be read through DLPack: {}", name, e.what()));
  }
  PyObject* capsule = capsule_obj.ptr();
  if (!PyCapsule_IsValid(capsule, kCapsuleName)) {
    return InvalidArgument(fmt::format("tensor {}: __dlpack__ returned no unused \"dltensor\" capsule", name));
  }
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, kCapsuleName));
  // Consumed: the producer's capsule destructor must no longer free it; we own it now.
  PyCapsule_SetName(capsule, kUsedCapsuleName);
  py::capsule owner = Own(managed);
  const DLTensor& t = managed->dl_tensor;

  BorrowedTensor out;
  out.meta.name = std::string(name);
  std::optional<DType> dtype = FromDl(t.dtype);
  if (bits_of && IsBitsOf(t.dtype, *bits_of)) dtype = bits_of;
  if (!dtype) {
    return InvalidArgument(fmt::format("tensor {} has dtype {}, which wsync does not move", name,
                                       DlTypeString(t.dtype)));
  }
  out.meta.dtype = *dtype;
  out.meta.shape.assign(t.shape, t.shape + t.ndim);
  for (int64_t d : out.meta.shape) {
    if (d < 0) return InvalidArgument(fmt::format("tensor {} has a negative extent in its shape", name));
  }
  if (!IsCompact(t)) {
    return InvalidArgument(fmt::format(
        "tensor {} (shape {}) is not contiguous; pass a contiguous tensor (.contiguous()) or ask for a copy "
        "(StateDictSource(..., copy_non_contiguous=True))",
        name, ShapeString(out.meta.shape)));
  }
  switch (t.device.device_type) {
    case kDLCPU:
    case kDLCUDAHost:
      out.device = Device{};
      break;
    case kDLCUDA:
      out.device = Device{Device::Kind::kCuda, t.device.device_id};
      // wsync reads on streams of its own: the work that wrote a torch tensor on torch's
      // current stream must be done first (DLPack's stream handshake needs wsync's stream,
      // which the engine picks later).
      if (sync_cuda && py::hasattr(source, "is_cuda")) {
        try {
          py::module_::import("torch").attr("cuda").attr("current_stream")(t.device.device_id).attr("synchronize")();
        } catch (py::error_already_set& e) {
          return InvalidArgument(fmt::format("tensor {}: synchronizing its CUDA stream failed: {}", name, e.what()));
        }
      }
      break;
    default:
      return InvalidArgument(fmt::format("tensor {} lives on DLPack device type {}, not on the CPU or a CUDA GPU",
                                         name, static_cast<int>(t.device.device_type)));
  }
  out.nbytes = out.meta.nbytes();
  out.data = out.nbytes == 0 ? nullptr : static_cast<const std::byte*>(t.data) + t.byte_offset;
  out.owner = std::move(owner);
  return out;
}

}  // namespace wsync::python
