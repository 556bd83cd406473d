#include "backends/ipc/storage_layout.h"

#include <span>

#include <fmt/format.h>

#include "core/digest.h"

namespace wsync {

bool StorageLayout::SameBlock(const SourceStorage& other) const {
  return other.data == storage.data && other.bytes == storage.bytes && other.device == storage.device;
}

std::string StorageLayout::Digest() const {
  std::vector<uint64_t> words{storage.bytes};
  words.insert(words.end(), offsets.begin(), offsets.end());
  return HexDigest(DigestAlgorithm::kXxh3_128, std::as_bytes(std::span(words)));
}

std::string DescribeStorage(const SourceStorage& storage) {
  return fmt::format("{} bytes at {} on {}", storage.bytes, static_cast<const void*>(storage.data),
                     storage.device.ToString());
}

StorageLayoutRecorder::StorageLayoutRecorder(std::optional<SourceStorage> storage, size_t tensors)
    : storage_(storage) {
  if (storage_) layout_.storage = *storage_;
  layout_.offsets.reserve(storage_ ? tensors : 0);
}

void StorageLayoutRecorder::Add(const TensorMeta& meta, const TensorRef& t) {
  if (!storage_ || !outside_.empty()) return;
  std::optional<uint64_t> offset = OffsetInStorage(*storage_, t);
  if (!offset) {
    outside_ = fmt::format("tensor {} ({} bytes at {} on {}) does not lie inside the source's storage ({})", meta.name,
                           t.bytes.size(), static_cast<const void*>(t.bytes.data()), t.device.ToString(),
                           DescribeStorage(*storage_));
    return;
  }
  if (!layout_.offsets.empty() && *offset < end_) {
    outside_ = fmt::format("tensor {} lies at offset {} of the source's storage, inside {} before it (which ends at "
                           "{}): receivers take the tensors in iteration order, without overlap",
                           meta.name, *offset, previous_, end_);
    return;
  }
  layout_.offsets.push_back(*offset);
  end_ = *offset + t.bytes.size();
  previous_ = meta.name;
}

Result<StorageLayout> StorageLayoutRecorder::Finish() const {
  if (!storage_) return FailedPrecondition("the source offers no storage()");
  if (!outside_.empty()) return FailedPrecondition(outside_);
  return layout_;
}

Result<StorageLayout> ReadStorageLayout(TensorStream& stream, const std::vector<TensorMeta>& meta,
                                        const SourceStorage& storage) {
  StorageLayoutRecorder recorder(storage, meta.size());
  TensorRef t;
  for (const TensorMeta& m : meta) {
    WSYNC_ASSIGN_OR_RETURN(bool more, stream.Next(&t));
    if (!more) return Internal(fmt::format("source ended before tensor {}", m.name));
    recorder.Add(m, t);
    WSYNC_RETURN_IF_ERROR(recorder.Finish().status());  // the first tensor outside ends the pass
  }
  WSYNC_ASSIGN_OR_RETURN(bool extra, stream.Next(&t));  // the end of the pass (checked)
  if (extra) return Internal("the source yielded more tensors than its metadata lists");
  return recorder.Finish();
}

}  // namespace wsync
