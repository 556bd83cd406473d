// FaultySource: the one fault-injecting WeightSource of the tests.
//
// It wraps a real source and passes its tensors through, except where its options say
// to break: a pass that fails at tensor i (as a trainer rank whose gather fails would),
// metadata that lies about a tensor's shape (what a source whose export disagrees with
// its own table does), a pass that yields fewer bytes than a tensor's metadata says, or
// tensors labelled as on a GPU.
// It counts what the engine asks of it: passes (Iterate() calls), passes drained to the
// end, and tensors yielded (held passes too, IterateHeld()), so that a test can assert how many times a sync iterates its
// source. Counters are atomic and may be read from any thread; the options are set
// before a sync (options() is not synchronized). Tests only.
#pragma once

#include <atomic>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "wsync/source.h"
#include "wsync/status.h"

namespace wsync::testing {

struct FaultySourceOptions {
  // The pass (1-based, counting Iterate() and IterateHeld() calls) whose stream fails at tensor `fail_at`
  // (0-based; that Next() returns the error); 0: no pass fails; -1: every pass fails.
  int fail_pass = 0;
  size_t fail_at = 0;
  // The failure: `fail_code`, with `fail_message`, or when empty "injected: the source
  // broke at tensor I of pass P".
  StatusCode fail_code = StatusCode::kInternal;
  std::string fail_message;
  // metadata() of this tensor (index) has its last dimension one larger than what the
  // stream yields; nullopt: metadata as the inner source's. Read at construction only.
  std::optional<size_t> lie_shape_at;
  // metadata() lacks the last tensor the stream yields (a pass longer than its
  // metadata). Read at construction only.
  bool metadata_omits_last = false;
  // The stream yields this tensor (index) one byte short of its metadata's size, on pass
  // `lie_bytes_pass` (1-based; 0: every pass); nullopt: never.
  std::optional<size_t> lie_bytes_at;
  int lie_bytes_pass = 0;
  // The stream labels this tensor (index) and every later one as on cuda:0, their bytes
  // still on the host (a device tensor where a backend takes host tensors only, on a
  // machine that may have no GPU); nullopt: never.
  std::optional<size_t> device_label_from;
};

class FaultySource final : public WeightSource {
 public:
  // `inner` must outlive this source.
  explicit FaultySource(WeightSource* inner, FaultySourceOptions options = {});
  FaultySource(const FaultySource&) = delete;
  FaultySource& operator=(const FaultySource&) = delete;

  const std::vector<TensorMeta>& metadata() const override { return meta_; }
  Result<std::unique_ptr<TensorStream>> Iterate() override;
  std::optional<std::vector<std::string>> HeldNames() const override { return inner_->HeldNames(); }
  std::vector<HeldRows> HeldRowRanges() const override { return inner_->HeldRowRanges(); }
  // The inner source's held pass, through the same faults and counters as Iterate():
  // passes count both kinds, and tensor indices are positions in the held pass.
  Result<std::unique_ptr<TensorStream>> IterateHeld() override;

  // Read and changed between syncs (lie_shape_at excepted, see above).
  FaultySourceOptions& options() { return options_; }

  // Passes started (Iterate() and IterateHeld() calls that returned a stream).
  int passes() const { return passes_.load(); }
  // Passes whose stream reported its end (Next() returned false).
  int completed_passes() const { return completed_passes_.load(); }
  // Tensors yielded over all passes.
  size_t tensors_yielded() const { return tensors_.load(); }

 private:
  class Stream;
  Result<std::unique_ptr<TensorStream>> Wrap(Result<std::unique_ptr<TensorStream>> inner);
  WeightSource* inner_;
  FaultySourceOptions options_;
  std::vector<TensorMeta> meta_;
  std::atomic<int> passes_{0};
  std::atomic<int> completed_passes_{0};
  std::atomic<size_t> tensors_{0};
};

}  // namespace wsync::testing
