// FailingSource: a test source that breaks in the middle of a pass, as a trainer rank
// whose state is corrupt would. Tests only; header-only. Not thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "wsync/source.h"

namespace wsync {

// Wraps a source; its `fail_pass`-th pass (1-based; 0: never) fails at tensor `fail_at`
// with Internal("injected: ...").
class FailingSource final : public WeightSource {
 public:
  explicit FailingSource(WeightSource* inner) : inner_(inner) {}
  const std::vector<TensorMeta>& metadata() const override { return inner_->metadata(); }
  Result<std::unique_ptr<TensorStream>> Iterate() override {
    WSYNC_ASSIGN_OR_RETURN(auto s, inner_->Iterate());
    size_t fail = ++passes_ == fail_pass ? fail_at : SIZE_MAX;
    return std::unique_ptr<TensorStream>(std::make_unique<Stream>(std::move(s), fail, passes_));
  }
  int fail_pass = 0;
  size_t fail_at = 0;

 private:
  class Stream final : public TensorStream {
   public:
    Stream(std::unique_ptr<TensorStream> inner, size_t fail_at, int pass)
        : inner_(std::move(inner)), fail_at_(fail_at), pass_(pass) {}
    Result<bool> Next(TensorRef* out) override {
      if (n_++ == fail_at_) {
        return Internal(fmt::format("injected: the source broke at tensor {} of pass {}", fail_at_, pass_));
      }
      return inner_->Next(out);
    }

   private:
    std::unique_ptr<TensorStream> inner_;
    size_t fail_at_;
    int pass_;
    size_t n_ = 0;
  };
  WeightSource* inner_;
  int passes_ = 0;
};

}  // namespace wsync
