#include "wsync/source.h"

#include <fmt/format.h>

namespace wsync {
namespace {

class Checked final : public TensorStream {
 public:
  Checked(std::unique_ptr<TensorStream> inner, const std::vector<TensorMeta>& metadata)
      : inner_(std::move(inner)), metadata_(metadata) {}

  Result<bool> Next(TensorRef* out) override {
    WSYNC_ASSIGN_OR_RETURN(bool more, inner_->Next(out));
    if (!more) {
      if (index_ != metadata_.size()) {
        return InvalidArgument(fmt::format(
            "source ended after {} tensors but its metadata lists {}; first missing: {}", index_,
            metadata_.size(), metadata_[index_].name));
      }
      return false;
    }
    if (index_ >= metadata_.size()) {
      return InvalidArgument(fmt::format("source yielded {} beyond the {} tensors of its metadata",
                                         out->name, metadata_.size()));
    }
    const TensorMeta& want = metadata_[index_];
    TensorMeta got{std::string(out->name), out->dtype, Shape(out->shape.begin(), out->shape.end())};
    Status s = CheckSameMeta(want, got);
    if (!s.ok()) {
      return s.WithContext(fmt::format("source tensor #{} disagrees with its metadata", index_));
    }
    if (out->bytes.size() != want.nbytes()) {
      return InvalidArgument(fmt::format("source tensor {} has {} bytes, its shape needs {}",
                                         want.name, out->bytes.size(), want.nbytes()));
    }
    ++index_;
    return true;
  }

 private:
  std::unique_ptr<TensorStream> inner_;
  const std::vector<TensorMeta>& metadata_;
  size_t index_ = 0;
};

class HostStream final : public TensorStream {
 public:
  explicit HostStream(const std::vector<HostTensor>& tensors) : tensors_(tensors) {}
  Result<bool> Next(TensorRef* out) override {
    if (next_ >= tensors_.size()) return false;
    *out = tensors_[next_++].ref();
    return true;
  }

 private:
  const std::vector<HostTensor>& tensors_;
  size_t next_ = 0;
};

}  // namespace

std::unique_ptr<TensorStream> CheckedStream(std::unique_ptr<TensorStream> inner,
                                            const std::vector<TensorMeta>& metadata) {
  return std::make_unique<Checked>(std::move(inner), metadata);
}

Result<std::unique_ptr<TensorStream>> WeightSource::IterateHeld() {
  if (!HeldNames()) return Iterate();
  return Unimplemented("this source holds part of the model but has no pass over its held names");
}

Status DrainChecked(WeightSource& source) {
  WSYNC_ASSIGN_OR_RETURN(auto inner, source.Iterate());
  auto stream = CheckedStream(std::move(inner), source.metadata());
  TensorRef t;
  for (;;) {
    WSYNC_ASSIGN_OR_RETURN(bool more, stream->Next(&t));
    if (!more) return Status::Ok();
  }
}

HostTensorSource::HostTensorSource(std::vector<HostTensor> tensors) : tensors_(std::move(tensors)) {
  metadata_.reserve(tensors_.size());
  for (const auto& t : tensors_) metadata_.push_back(t.meta);
}

Result<std::unique_ptr<TensorStream>> HostTensorSource::Iterate() {
  return std::unique_ptr<TensorStream>(std::make_unique<HostStream>(tensors_));
}

Result<std::unique_ptr<DeviceTensorSource>> DeviceTensorSource::Create(const Device& device,
                                                                      std::vector<TensorMeta> metadata,
                                                                      DeviceAllocator allocator) {
  std::unique_ptr<DeviceTensorSource> s(new DeviceTensorSource());
  std::vector<size_t> sizes;
  for (const TensorMeta& m : metadata) sizes.push_back(m.nbytes());
  const size_t total = LayOutAligned(sizes, &s->offsets_);
  s->metadata_ = std::move(metadata);
  WSYNC_ASSIGN_OR_RETURN(s->storage_, DeviceBuffer::Allocate(device, total, allocator));
  return s;
}

Status DeviceTensorSource::Upload(const std::vector<HostTensor>& tensors) {
  if (tensors.size() != metadata_.size()) {
    return InvalidArgument(fmt::format("upload of {} tensors to a source of {}", tensors.size(), metadata_.size()));
  }
  WSYNC_ASSIGN_OR_RETURN(DeviceRuntime * rt, CudaRuntimeFor(device()));
  WSYNC_RETURN_IF_ERROR(rt->SetDevice(device().index));
  for (size_t i = 0; i < tensors.size(); ++i) {
    WSYNC_RETURN_IF_ERROR(CheckSameMeta(metadata_[i], tensors[i].meta));
    const size_t n = metadata_[i].nbytes();
    WSYNC_RETURN_IF_ERROR(rt->Copy2D(storage_.data() + offsets_[i], n, tensors[i].storage.data(), n, n, 1));
  }
  return rt->Synchronize().WithContext(fmt::format("uploading the trainer's tensors to {}", device().ToString()));
}

Result<std::unique_ptr<TensorStream>> DeviceTensorSource::Iterate() {
  class Stream final : public TensorStream {
   public:
    explicit Stream(const DeviceTensorSource& s) : s_(s) {}
    Result<bool> Next(TensorRef* out) override {
      if (i_ >= s_.metadata_.size()) return false;
      const TensorMeta& m = s_.metadata_[i_];
      *out = TensorRef{m.name, m.dtype, m.shape, std::span<const std::byte>(s_.storage_.data() + s_.offsets_[i_], m.nbytes()),
                       s_.device()};
      ++i_;
      return true;
    }

   private:
    const DeviceTensorSource& s_;
    size_t i_ = 0;
  };
  return std::unique_ptr<TensorStream>(std::make_unique<Stream>(*this));
}

std::optional<uint64_t> OffsetInStorage(const SourceStorage& storage, const TensorRef& t) {
  if (t.device != storage.device || storage.data == nullptr) return std::nullopt;
  // Integer addresses: pointers into different objects do not compare in C++.
  auto begin = reinterpret_cast<uintptr_t>(storage.data);
  auto p = reinterpret_cast<uintptr_t>(t.bytes.data());
  if (p < begin || p - begin > storage.bytes || t.bytes.size() > storage.bytes - (p - begin)) return std::nullopt;
  return p - begin;
}

Result<bool> FinishCopiesFrom(DeviceRuntime& rt, const TensorRef& t, const std::optional<SourceStorage>& stable) {
  if (stable && OffsetInStorage(*stable, t)) return false;
  WSYNC_RETURN_IF_ERROR(rt.Synchronize().WithContext(fmt::format("copying {} from {}", t.name, t.device.ToString())));
  return true;
}

}  // namespace wsync
