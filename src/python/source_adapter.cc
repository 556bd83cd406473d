#include "python/source_adapter.h"

#include <Python.h>

#include <algorithm>
#include <map>
#include <string_view>
#include <tuple>
#include <utility>

#include <fmt/format.h>

#include <pybind11/stl.h>

#include "python/bindings.h"
#include "python/errors.h"
#include "wsync/dtype.h"

namespace py = pybind11;

namespace wsync::python {
namespace {

// "ValueError: text" of the exception being raised now, recorded in `control`.
std::string CaptureError(PassControl& control) {
  py::error_already_set error;
  control.RecordError(error);
  return DescribePythonError(error);
}

std::string TypeName(py::handle obj) { return py::str(py::type::handle_of(obj).attr("__name__")); }

class PyStream final : public TensorStream {
 public:
  // `ready`: the source yields tensors whose CUDA work is already done (its
  // yields_ready_tensors attribute), so no tensor needs a stream synchronization of its own.
  PyStream(py::object iterator, std::shared_ptr<PassControl> control,
           std::shared_ptr<const std::vector<TensorMeta>> metadata, const Device& device, bool ready)
      : iterator_(std::move(iterator)), control_(std::move(control)), metadata_(std::move(metadata)), device_(device),
        ready_(ready) {}

  ~PyStream() override {
    DropWithGil(iterator_);
    if (current_) DropWithGil(current_->owner);
  }

  Result<bool> Next(TensorRef* out) override {
    std::lock_guard lock(mu_);
    if (control_->cancelled()) {
      return Aborted(fmt::format("{} after {} tensors of the source", control_->cancel_reason(), index_));
    }
    if (control_->closed()) return Aborted("the Python call that ran this sync has returned");
    py::gil_scoped_acquire gil;
    if (current_) current_->owner = py::object();
    current_.reset();
    PyObject* raw = PyIter_Next(iterator_.ptr());
    if (raw == nullptr) {
      if (PyErr_Occurred() == nullptr) return false;
      std::string text = CaptureError(*control_);
      return Aborted(fmt::format("the source raised {} while yielding tensor #{}{}", text, index_,
                                 index_ < metadata_->size() ? " (" + (*metadata_)[index_].name + ")" : ""));
    }
    py::object item = py::reinterpret_steal<py::object>(raw);
    if (!py::isinstance<py::tuple>(item) && !py::isinstance<py::list>(item)) {
      return InvalidArgument(fmt::format("source item #{} is a {}, not a (name, tensor) pair", index_, TypeName(item)));
    }
    auto pair = py::reinterpret_borrow<py::sequence>(item);
    if (pair.size() != 2 || !py::isinstance<py::str>(pair[0])) {
      return InvalidArgument(fmt::format("source item #{} is not a (name: str, tensor) pair", index_));
    }
    std::string name = pair[0].cast<std::string>();
    std::optional<DType> bits_of;
    if (index_ < metadata_->size() && (*metadata_)[index_].name == name) bits_of = (*metadata_)[index_].dtype;
    Result<BorrowedTensor> borrowed = Borrow(pair[1], name, bits_of, /*sync_cuda=*/!ready_);
    if (!borrowed.ok()) return borrowed.status();
    if (!borrowed->device.is_cpu() && borrowed->device != device_) {
      std::string on = borrowed->device.ToString();
      borrowed->owner = py::object();
      return InvalidArgument(fmt::format("tensor {} lives on {}, but the engine runs on {}", name, on, device_.ToString()));
    }
    current_ = std::move(borrowed).value();
    *out = current_->ref();
    ++index_;
    return true;
  }

  // PySource::DrainRest's loop.
  Status DrainRest(Deadline deadline) {
    std::lock_guard lock(mu_);
    if (current_) DropWithGil(current_->owner);
    current_.reset();
    size_t drained = 0;
    for (;;) {
      if (control_->interrupted()) return Aborted("the trainer was interrupted (KeyboardInterrupt) while draining");
      if (control_->closed()) return Aborted("the Python call that ran this sync has returned");
      if (deadline.expired()) {
        return DeadlineExceeded(fmt::format("draining the source: still unfinished at the deadline after {} more "
                                            "items (tensor #{})", drained, index_));
      }
      py::gil_scoped_acquire gil;
      if (!iterator_) return Status::Ok();
      PyObject* raw = PyIter_Next(iterator_.ptr());
      if (raw == nullptr) {
        if (PyErr_Occurred() == nullptr) return Status::Ok();
        return Aborted(fmt::format("the source raised {} while draining it (tensor #{})", CaptureError(*control_),
                                   index_));
      }
      Py_DECREF(raw);
      ++index_;
      ++drained;
    }
  }

 private:
  std::mutex mu_;  // one puller at a time: the engine's threads and DrainRest
  py::object iterator_;
  std::shared_ptr<PassControl> control_;
  const std::shared_ptr<const std::vector<TensorMeta>> metadata_;  // a stream may outlive its PySource
  const Device device_;
  const bool ready_;
  std::optional<BorrowedTensor> current_;    // the tensor lent by the last Next()
  size_t index_ = 0;
};

// A pass's stream as the engine sees it; the PySource keeps the PyStream for DrainRest.
class SharedStream final : public TensorStream {
 public:
  explicit SharedStream(std::shared_ptr<PyStream> inner) : inner_(std::move(inner)) {}
  Result<bool> Next(TensorRef* out) override { return inner_->Next(out); }

 private:
  std::shared_ptr<PyStream> inner_;
};

// The checked pass, whose first failure the PassControl keeps.
class RecordingStream final : public TensorStream {
 public:
  RecordingStream(std::unique_ptr<TensorStream> inner, std::shared_ptr<const std::vector<TensorMeta>> metadata,
                  std::shared_ptr<PassControl> control)
      : metadata_(std::move(metadata)),
        checked_(CheckedStream(std::move(inner), *metadata_)),
        control_(std::move(control)) {}

  Result<bool> Next(TensorRef* out) override {
    Result<bool> r = checked_->Next(out);
    if (!r.ok()) control_->RecordStatus(r.status());
    return r;
  }

 private:
  std::shared_ptr<const std::vector<TensorMeta>> metadata_;  // outlives checked_, which reads it
  std::unique_ptr<TensorStream> checked_;
  std::shared_ptr<PassControl> control_;
};

// source.METHOD(); an exception it raises is recorded in `control` and named.
Result<py::object> CallSource(const py::object& source, const char* method, PassControl& control) {
  try {
    return source.attr(method)();
  } catch (py::error_already_set& e) {
    control.RecordError(e);
    return InvalidArgument(fmt::format("the source's {}() raised {}", method, DescribePythonError(e)));
  }
}

}  // namespace

struct PySource::Pass {
  std::shared_ptr<PyStream> stream;
};

PassControl::~PassControl() { DropWithGil(error_); }

void PassControl::Cancel(std::string reason, bool interrupt) {
  std::lock_guard lock(mu_);
  if (!cancelled_) cancel_reason_ = std::move(reason);
  if (interrupt) interrupted_ = true;
  cancelled_ = true;
}

std::string PassControl::cancel_reason() const {
  std::lock_guard lock(mu_);
  return cancel_reason_;
}

void PassControl::RecordStatus(const Status& status) {
  std::lock_guard lock(mu_);
  if (!source_status_) source_status_ = status;
}

std::optional<Status> PassControl::source_status() const {
  std::lock_guard lock(mu_);
  return source_status_;
}

void PassControl::RecordError(const py::error_already_set& error) {
  std::lock_guard lock(mu_);
  if (error_) return;
  py::object value = error.value();
  auto held = py::reinterpret_steal<py::object>(PyException_GetTraceback(value.ptr()));
  if (error.trace() && !held) {
    PyException_SetTraceback(value.ptr(), error.trace().ptr());
  }
  error_ = std::move(value);
}

py::object PassControl::TakeError() {
  std::lock_guard lock(mu_);
  py::object out = std::move(error_);
  error_ = py::object();
  return out ? out : py::none();
}

Result<std::vector<TensorMeta>> ParseMetadata(py::handle entries) {
  std::vector<TensorMeta> out;
  if (!py::isinstance<py::iterable>(entries) || py::isinstance<py::str>(entries)) {
    return InvalidArgument(fmt::format("metadata is a {}, not a list of (name, dtype, shape)", TypeName(entries)));
  }
  // One normalization of dtype spellings, shared with the pure-Python sources.
  py::object dtype_name = py::module_::import("wsync.sources").attr("dtype_name");
  size_t i = 0;
  for (py::handle entry : entries) {
    if (!py::isinstance<py::sequence>(entry) || py::isinstance<py::str>(entry) || py::len(entry) != 3) {
      return InvalidArgument(fmt::format("metadata entry #{} is not a (name, dtype, shape) triple", i));
    }
    py::sequence t = py::reinterpret_borrow<py::sequence>(entry);
    if (!py::isinstance<py::str>(t[0])) {
      return InvalidArgument(fmt::format("metadata entry #{}: the name is a {}, not a str", i, TypeName(t[0])));
    }
    TensorMeta meta;
    meta.name = t[0].cast<std::string>();
    std::string dtype;
    try {
      dtype = py::str(dtype_name(t[1])).cast<std::string>();
    } catch (py::error_already_set& e) {
      return InvalidArgument(fmt::format("metadata of {}: unreadable dtype: {}", meta.name, DescribePythonError(e)));
    }
    Result<DType> parsed = DTypeFromTorchName(dtype);
    if (!parsed.ok()) return parsed.status().WithContext(fmt::format("metadata of {}", meta.name));
    meta.dtype = *parsed;
    if (!py::isinstance<py::iterable>(t[2])) {
      return InvalidArgument(fmt::format("metadata of {}: the shape is a {}, not a sequence of ints", meta.name,
                                         TypeName(t[2])));
    }
    for (py::handle d : t[2]) {
      if (!py::isinstance<py::int_>(d) && !py::hasattr(d, "__index__")) {
        return InvalidArgument(fmt::format("metadata of {}: the shape holds a {}, not an int", meta.name, TypeName(d)));
      }
      int64_t extent = py::int_(py::reinterpret_borrow<py::object>(d)).cast<int64_t>();
      if (extent < 0) return InvalidArgument(fmt::format("metadata of {}: negative extent {}", meta.name, extent));
      meta.shape.push_back(extent);
    }
    out.push_back(std::move(meta));
    ++i;
  }
  return out;
}

namespace {

// The source's held_rows() (absent or None: none), each a held name once, rows within its
// dim 0, in `names` order; the held metadata `meta` (by `names`) then gets their shapes.
Result<std::vector<HeldRows>> HeldRowsOf(const py::object& source, PassControl& control,
                                         const std::vector<std::string>& names, std::vector<TensorMeta>& meta) {
  std::vector<HeldRows> out;
  if (!py::hasattr(source, "held_rows")) return out;
  WSYNC_ASSIGN_OR_RETURN(py::object rows, CallSource(source, "held_rows", control));
  if (rows.is_none()) return out;
  std::vector<std::tuple<std::string, int64_t, int64_t>> entries;
  try {
    entries = rows.cast<std::vector<std::tuple<std::string, int64_t, int64_t>>>();
  } catch (const py::cast_error&) {
    return InvalidArgument(fmt::format("the source's held_rows() gave a {}, not a list of (name, begin, end)",
                                       TypeName(rows)));
  }
  std::map<std::string_view, size_t> index;
  for (size_t i = 0; i < names.size(); ++i) index.emplace(names[i], i);
  std::vector<std::optional<HeldRows>> by_held(names.size());
  for (const auto& [name, begin, end] : entries) {
    auto it = index.find(name);
    if (it == index.end()) {
      return InvalidArgument(fmt::format("the source's held_rows() lists {}, which its held_names() does not", name));
    }
    TensorMeta& m = meta[it->second];
    if (by_held[it->second]) return InvalidArgument(fmt::format("the source's held_rows() lists {} twice", name));
    if (m.shape.empty() || begin < 0 || end <= begin || end > m.shape[0]) {
      return InvalidArgument(fmt::format("the source's held_rows() gives {} rows [{}, {}), outside its dim 0 of {}",
                                         name, begin, end, m.shape.empty() ? 0 : m.shape[0]));
    }
    m.shape[0] = end - begin;
    by_held[it->second] = HeldRows{name, begin, end};
  }
  for (auto& h : by_held) {
    if (h) out.push_back(std::move(*h));
  }
  return out;
}

}  // namespace

Result<std::unique_ptr<PySource>> PySource::Create(py::object source, std::shared_ptr<PassControl> control,
                                                  const Device& device) {
  std::unique_ptr<PySource> s(new PySource());
  s->control_ = std::move(control);
  s->device_ = device;
  if (!py::hasattr(source, "metadata") || !py::hasattr(source, "__iter__")) {
    return InvalidArgument(fmt::format(
        "a {} is not a weight source: it needs metadata() and __iter__ (see wsync.StateDictSource)", TypeName(source)));
  }
  WSYNC_ASSIGN_OR_RETURN(py::object entries, CallSource(source, "metadata", *s->control_));
  WSYNC_ASSIGN_OR_RETURN(std::vector<TensorMeta> metadata, ParseMetadata(entries));
  s->metadata_ = std::make_shared<const std::vector<TensorMeta>>(std::move(metadata));
  if (py::hasattr(source, "storage")) {
    WSYNC_ASSIGN_OR_RETURN(py::object block, CallSource(source, "storage", *s->control_));
    if (!block.is_none()) {
      Result<BorrowedTensor> b = Borrow(block, "storage()");
      if (!b.ok()) return b.status().WithContext("the source's storage block");
      s->storage_ = std::move(b).value();
    }
  }
  try {
    s->stable_ = py::bool_(py::getattr(source, "yields_stable_tensors", py::bool_(false)));
  } catch (py::error_already_set& e) {
    s->control_->RecordError(e);
    return InvalidArgument(fmt::format("the source's yields_stable_tensors raised {}", DescribePythonError(e)));
  }
  if (py::hasattr(source, "held_names")) {
    WSYNC_ASSIGN_OR_RETURN(py::object held, CallSource(source, "held_names", *s->control_));
    if (!held.is_none()) {
      if (!py::hasattr(source, "iter_held")) {
        return InvalidArgument("the source's held_names() lists names, but it has no iter_held() to yield them");
      }
      std::vector<std::string> names;
      try {
        names = held.cast<std::vector<std::string>>();
      } catch (const py::cast_error&) {
        return InvalidArgument(fmt::format("the source's held_names() gave a {}, not a list of str or None",
                                           TypeName(held)));
      }
      std::map<std::string_view, size_t> index;
      for (size_t i = 0; i < s->metadata_->size(); ++i) index.emplace((*s->metadata_)[i].name, i);
      std::vector<size_t> at;
      for (const std::string& n : names) {
        auto it = index.find(n);
        if (it == index.end()) {
          return InvalidArgument(fmt::format("the source's held_names() lists {}, which its metadata() does not", n));
        }
        at.push_back(it->second);
      }
      std::sort(at.begin(), at.end());
      if (std::adjacent_find(at.begin(), at.end()) != at.end()) {
        return InvalidArgument("the source's held_names() lists a name twice");
      }
      std::vector<TensorMeta> held_meta;
      names.clear();
      for (size_t i : at) {
        held_meta.push_back((*s->metadata_)[i]);
        names.push_back((*s->metadata_)[i].name);
      }
      WSYNC_ASSIGN_OR_RETURN(s->held_rows_, HeldRowsOf(source, *s->control_, names, held_meta));
      s->held_ = std::move(names);
      s->held_metadata_ = std::make_shared<const std::vector<TensorMeta>>(std::move(held_meta));
    }
  }
  s->source_ = std::move(source);
  return s;
}

PySource::~PySource() {
  last_.reset();
  DropWithGil(source_);
  if (storage_) DropWithGil(storage_->owner);
}

Result<std::unique_ptr<TensorStream>> PySource::Iterate() { return StartPass(nullptr, metadata_); }

Result<std::unique_ptr<TensorStream>> PySource::IterateHeld() {
  if (!held_) return Iterate();
  return StartPass("iter_held", held_metadata_);
}

Result<std::unique_ptr<TensorStream>> PySource::StartPass(const char* iter_method,
                                                          std::shared_ptr<const std::vector<TensorMeta>> checked) {
  if (control_->cancelled()) return Aborted(fmt::format("{} before the source's pass", control_->cancel_reason()));
  py::gil_scoped_acquire gil;
  py::object iterator;
  bool ready = false;
  const std::string what =
      iter_method == nullptr ? "iter() of the source" : fmt::format("the source's {}()", iter_method);
  try {
    ready = py::bool_(py::getattr(source_, "yields_ready_tensors", py::bool_(false)));
    py::object iterable = iter_method == nullptr ? source_ : source_.attr(iter_method)();
    iterator = py::reinterpret_borrow<py::object>(py::iter(iterable));
  } catch (py::error_already_set& e) {
    std::string text = DescribePythonError(e);
    control_->RecordError(e);
    Status failed = Aborted(fmt::format("{} raised {}", what, text));
    control_->RecordStatus(failed);
    return failed;
  }
  auto stream = std::make_shared<PyStream>(std::move(iterator), control_, checked, device_, ready);
  last_ = std::make_shared<Pass>(Pass{stream});
  return std::unique_ptr<TensorStream>(
      std::make_unique<RecordingStream>(std::make_unique<SharedStream>(std::move(stream)), checked, control_));
}

Status PySource::DrainRest(Deadline deadline) {
  if (!last_) {
    Result<std::unique_ptr<TensorStream>> fresh = IterateHeld();
    if (!fresh.ok()) return fresh.status();
  }
  std::shared_ptr<Pass> pass = last_;
  return pass->stream->DrainRest(deadline);
}

std::optional<SourceStorage> PySource::storage() const {
  if (!storage_) return std::nullopt;
  return SourceStorage{storage_->data, storage_->nbytes, storage_->device};
}

}  // namespace wsync::python
