// Helpers for the delta backend's unit tests: temp directories, a base checkpoint
// written from tensors, and a check that a checkpoint directory holds given tensors.
// Test-only; single-threaded like gtest.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/dtype_convert.h"
#include "format/safetensors.h"
#include "wsync/tensor.h"

namespace wsync::delta::testing {

// A fresh directory under $TMPDIR, removed by the destructor.
class TempDir {
 public:
  explicit TempDir(const std::string& tag) {
    const char* base = std::getenv("TMPDIR");
    std::string templ = fmt::format("{}/wsync-{}-XXXXXX", base && *base ? base : "/tmp", tag);
    path_ = ::mkdtemp(templ.data()) ? templ : "";
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& child) const { return path_ + "/" + child; }

 private:
  std::string path_;
};

// Writes `tensors` (cast to `as` when given) as one safetensors file, dir/model.safetensors.
inline Status WriteCheckpoint(const std::string& dir, const std::vector<HostTensor>& tensors,
                              std::optional<DType> as = std::nullopt) {
  std::filesystem::create_directories(dir);
  std::vector<HostTensor> cast;
  std::vector<TensorRef> refs;
  for (const HostTensor& t : tensors) {
    if (!as || *as == t.meta.dtype) {
      refs.push_back(t.ref());
      continue;
    }
    WSYNC_ASSIGN_OR_RETURN(HostTensor c, HostTensor::Zeros(TensorMeta{t.meta.name, *as, t.meta.shape}));
    WSYNC_RETURN_IF_ERROR(Convert(t.ref().bytes, t.meta.dtype, c.storage.span().first(c.meta.nbytes()), *as, t.meta.name));
    cast.push_back(std::move(c));
  }
  for (const HostTensor& c : cast) refs.push_back(c.ref());
  return WriteSafetensors(dir + "/model.safetensors", refs);
}

// Every tensor of `tensors` is in the checkpoint at `dir` with the same bytes.
inline ::testing::AssertionResult CheckpointHolds(const std::string& dir, const std::vector<HostTensor>& tensors) {
  Result<CheckpointDir> ckpt = CheckpointDir::Open(dir);
  if (!ckpt.ok()) return ::testing::AssertionFailure() << ckpt.status().ToString();
  for (const HostTensor& t : tensors) {
    Result<std::span<const std::byte>> b = ckpt->Bytes(t.meta.name);
    if (!b.ok()) return ::testing::AssertionFailure() << b.status().ToString();
    std::span<const std::byte> want = t.ref().bytes;
    if (b->size() != want.size() || !std::equal(want.begin(), want.end(), b->begin())) {
      return ::testing::AssertionFailure() << t.meta.name << " differs in " << dir;
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace wsync::delta::testing
