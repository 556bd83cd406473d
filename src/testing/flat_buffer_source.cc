#include "testing/flat_buffer_source.h"

#include <fmt/format.h>

namespace wsync::testing {

Result<std::unique_ptr<FlatBufferSource>> FlatBufferSource::Create(const Device& device,
                                                                   std::vector<TensorMeta> metadata,
                                                                   Options options) {
  std::unique_ptr<FlatBufferSource> s(new FlatBufferSource());
  s->device_ = device;
  s->metadata_ = std::move(metadata);
  s->lead_ = options.lead;
  size_t largest = 1;
  for (const TensorMeta& m : s->metadata_) {
    s->offsets_.push_back(s->bytes_);
    s->bytes_ += (m.nbytes() + options.gap + 511) / 512 * 512;
    largest = std::max(largest, m.nbytes());
  }
  WSYNC_ASSIGN_OR_RETURN(s->allocation_, DeviceBuffer::Allocate(device, s->lead_ + s->bytes_ + 4096,
                                                                options.allocator));
  WSYNC_ASSIGN_OR_RETURN(s->stray_, DeviceBuffer::Allocate(device, largest));
  return s;
}

Result<std::unique_ptr<TensorStream>> FlatBufferSource::Iterate() {
  class Stream final : public TensorStream {
   public:
    explicit Stream(const FlatBufferSource& s) : s_(s) {}
    Result<bool> Next(TensorRef* out) override {
      if (i_ == s_.metadata_.size()) return false;
      const TensorMeta& m = s_.metadata_[i_];
      *out = TensorRef{m.name, m.dtype, m.shape, std::span<const std::byte>(s_.at(i_), m.nbytes()), s_.device_};
      ++i_;
      return true;
    }

   private:
    const FlatBufferSource& s_;
    size_t i_ = 0;
  };
  return std::unique_ptr<TensorStream>(std::make_unique<Stream>(*this));
}

Status FlatBufferSource::Upload(const std::vector<HostTensor>& tensors) {
  if (tensors.size() != metadata_.size()) {
    return InvalidArgument(fmt::format("upload of {} tensors to a source of {}", tensors.size(), metadata_.size()));
  }
  WSYNC_ASSIGN_OR_RETURN(DeviceRuntime * rt, CudaRuntimeFor(device_));
  WSYNC_RETURN_IF_ERROR(rt->SetDevice(device_.index));
  for (size_t i = 0; i < tensors.size(); ++i) {
    const size_t n = metadata_[i].nbytes();
    WSYNC_RETURN_IF_ERROR(rt->Copy2D(at(i), n, tensors[i].storage.data(), n, n, 1));
  }
  return rt->Synchronize();
}

}  // namespace wsync::testing
