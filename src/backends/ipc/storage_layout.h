// Where a source's tensors lie inside the one block its storage() names (source.h), as
// the ipc trainer's zero-copy mode needs it: receivers copy tensor i from the exported
// block at offsets[i]. A SourceStorage promises fixed offsets but not which ones, so the
// trainer learns them from passes: StorageLayoutRecorder watches a pass tensor by tensor
// (a packed pass reads every tensor anyway), ReadStorageLayout reads a whole pass for it.
// Values and functions only; not synchronized.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "wsync/source.h"
#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync {

struct StorageLayout {
  SourceStorage storage;
  std::vector<uint64_t> offsets;  // tensor i starts at storage.data + offsets[i]

  // Whether `other` names the same block (address, size and device).
  bool SameBlock(const SourceStorage& other) const;
  // Names the block's size and the offsets: ranks whose digests are equal can share one
  // update's tensor_offsets.
  std::string Digest() const;
};

// Follows one pass: Add() each tensor as the pass yields it, then Finish(). The tensors
// must lie in the block in iteration order without overlapping (gaps are fine), as the
// ipc protocol's tensor_offsets do.
class StorageLayoutRecorder {
 public:
  // `storage`: what the source offers (nullopt: nothing is learned).
  StorageLayoutRecorder(std::optional<SourceStorage> storage, size_t tensors);
  void Add(const TensorMeta& meta, const TensorRef& t);
  // After the whole pass: the layout, or FailedPrecondition naming the first tensor that
  // lay outside the block or out of order (or saying that the source offers none).
  Result<StorageLayout> Finish() const;

 private:
  std::optional<SourceStorage> storage_;
  StorageLayout layout_;
  std::string outside_;  // why the first tensor that breaks the layout does
  uint64_t end_ = 0;      // where the previous tensor ends in the block
  std::string previous_;  // ...and its name
};

// Reads the rest of `stream` (checked against `meta`, from tensor 0) and returns where
// every tensor lies in `storage`; FailedPrecondition naming the first one that does not
// lie in it as the recorder requires.
Result<StorageLayout> ReadStorageLayout(TensorStream& stream, const std::vector<TensorMeta>& meta,
                                        const SourceStorage& storage);

// "12345 bytes at 0x7f.. on cuda:0": a block, for messages.
std::string DescribeStorage(const SourceStorage& storage);

}  // namespace wsync
