// A Python weight source seen as a wsync::WeightSource.
//
// A Python source is any object with `metadata()` -> [(name, dtype, shape), ...] and
// `__iter__` -> (name, tensor) pairs in that order; optionally `storage()` -> one tensor
// that holds every yielded tensor (SourceStorage); optionally `held_names()` -> the names
// this rank holds (None: all), with `iter_held()` -> (name, tensor) pairs of those names
// only, in metadata order (WeightSource::HeldNames / IterateHeld: what `sharded` sends from
// every rank), and optionally `held_rows()` -> [(name, begin, end)], the held names held
// as rows [begin, end) of dim 0 only, which iter_held() yields as those rows
// (WeightSource::HeldRowRanges); optionally `yields_stable_tensors`, an attribute: True when
// every tensor a pass yields stays alive and unchanged until the pass ends (the source
// keeps them; WeightSource::StableRefs). PySource reads metadata(), storage(),
// held_names(), held_rows() and yields_stable_tensors once, when built (GIL held); each
// Iterate() is one pass over `iter(source)`, each IterateHeld() one over
// `source.iter_held()`.
//
// Threads: the engine calls Iterate() and the stream's Next() from its own threads; each
// takes the GIL for as long as it touches Python, so the caller that runs the sync must
// wait with the GIL released. Next() borrows the tensor through DLPack and keeps only
// that tensor's owner alive, until the next Next() or the stream's end (no copy is made).
//
// Each pass is checked against metadata() as it streams (CheckedStream), and its first
// failure is kept in the PassControl. A Python exception raised by the iterator (or
// iter()) fails the pass with Aborted carrying the exception's type and text; the
// exception object itself is kept in the PassControl for the caller to chain as __cause__. Cancel() (Ctrl-C in the caller, a raising progress callback)
// makes the next Next() fail with Aborted, naming why. Once the Python call that ran the sync returns,
// Close() makes every later Next() fail without touching Python (a data plane's thread may
// outlive an aborted sync).
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <pybind11/pybind11.h>

#include "core/deadline.h"
#include "python/dlpack.h"
#include "wsync/source.h"
#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync::python {

// What one Python call that runs a sync shares with the streams it starts. Thread-safe.
class PassControl {
 public:
  ~PassControl();
  // Ends the pass: the next Next() fails with Aborted(`reason`), which says what stopped
  // it ("the trainer was interrupted (KeyboardInterrupt)", "the progress callback raised
  // ..."). The first reason stays.
  // `interrupt`: Ctrl-C, which also ends DrainRest.
  void Cancel(std::string reason, bool interrupt = false);
  bool cancelled() const { return cancelled_; }
  bool interrupted() const { return interrupted_; }
  std::string cancel_reason() const;
  void Close() { closed_ = true; }
  bool closed() const { return closed_; }

  // Keeps the first failure of a pass of the source (its own errors and the metadata
  // checks of its tensors): the root cause when the engine reports the sync's failure
  // through a server's reply.
  void RecordStatus(const Status& status);
  std::optional<Status> source_status() const;

  // Keeps the first exception a source raised (GIL held).
  void RecordError(const pybind11::error_already_set& error);
  // The recorded exception object, or None (GIL held); clears it.
  pybind11::object TakeError();

 private:
  std::atomic<bool> cancelled_{false};
  std::atomic<bool> interrupted_{false};
  std::atomic<bool> closed_{false};
  mutable std::mutex mu_;
  std::optional<Status> source_status_;  // GUARDED_BY(mu_)
  std::string cancel_reason_;            // GUARDED_BY(mu_)
  pybind11::object error_;  // GUARDED_BY(mu_); touched only with the GIL held
};

// The (name, dtype, shape) list of a metadata() answer; dtypes may be names ("bfloat16",
// "torch.bfloat16"), torch.dtype or numpy dtype objects. Errors name the entry and field.
// Needs the GIL.
Result<std::vector<TensorMeta>> ParseMetadata(pybind11::handle entries);

class PySource final : public WeightSource {
 public:
  // Calls source.metadata() and, when present, source.storage(). A Python exception from
  // either is recorded in `control` and returned as InvalidArgument. A tensor on a CUDA
  // device other than `device` (the engine's) fails the pass, naming both. Needs the GIL.
  static Result<std::unique_ptr<PySource>> Create(pybind11::object source,
                                                  std::shared_ptr<PassControl> control, const Device& device);
  ~PySource() override;

  const std::vector<TensorMeta>& metadata() const override { return *metadata_; }
  Result<std::unique_ptr<TensorStream>> Iterate() override;
  std::optional<std::vector<std::string>> HeldNames() const override { return held_; }
  std::vector<HeldRows> HeldRowRanges() const override { return held_rows_; }
  Result<std::unique_ptr<TensorStream>> IterateHeld() override;
  std::optional<SourceStorage> storage() const override;
  // A storage() block, or the source's yields_stable_tensors attribute (read once, when
  // built): its tensors outlive the pass, so a backend may read one after the next Next().
  bool StableRefs() const override { return storage_.has_value() || stable_; }

  // Pulls the rest of the latest pass (or a whole new pass when none started: the held pass
  // when the source holds part of the model) straight from
  // the Python iterator, discarding every item, until it ends, raises, Ctrl-C, or
  // `deadline` passes between two items (an item blocked inside a collective is not
  // interrupted). What lets other trainer ranks whose iterators are collectives finish
  // theirs after this rank's sync failed. Thread-safe against a data plane's thread still
  // pulling the same pass. GIL released on entry.
  Status DrainRest(Deadline deadline);

 private:
  struct Pass;
  PySource() = default;
  pybind11::object source_;
  std::shared_ptr<PassControl> control_;
  Device device_;
  // A pass over `iter_method` of the source (nullptr: iter(source)), checked against `checked`.
  Result<std::unique_ptr<TensorStream>> StartPass(const char* iter_method,
                                                  std::shared_ptr<const std::vector<TensorMeta>> checked);
  std::shared_ptr<const std::vector<TensorMeta>> metadata_;
  std::optional<std::vector<std::string>> held_;                // held_names(); nullopt: all
  std::shared_ptr<const std::vector<TensorMeta>> held_metadata_;  // the held names' metadata, in order
  std::vector<HeldRows> held_rows_;  // held_rows(): the held names held as rows only
  std::optional<BorrowedTensor> storage_;
  bool stable_ = false;  // yields_stable_tensors
  std::shared_ptr<Pass> last_;  // the latest pass Iterate() started
};

}  // namespace wsync::python
