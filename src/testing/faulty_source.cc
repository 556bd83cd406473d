#include "testing/faulty_source.h"

#include <utility>

#include <fmt/format.h>

namespace wsync::testing {

class FaultySource::Stream final : public TensorStream {
 public:
  Stream(FaultySource* owner, std::unique_ptr<TensorStream> inner, int pass)
      : owner_(owner), inner_(std::move(inner)), pass_(pass) {}

  Result<bool> Next(TensorRef* out) override {
    const FaultySourceOptions& o = owner_->options_;
    size_t i = n_++;
    bool fails = o.fail_pass == -1 || (o.fail_pass > 0 && o.fail_pass == pass_);
    if (fails && i == o.fail_at) {
      std::string message = o.fail_message.empty()
                                ? fmt::format("injected: the source broke at tensor {} of pass {}", i, pass_)
                                : o.fail_message;
      return Status(o.fail_code, std::move(message));
    }
    WSYNC_ASSIGN_OR_RETURN(bool more, inner_->Next(out));
    if (!more) {
      owner_->completed_passes_.fetch_add(1);
      return false;
    }
    bool short_bytes = o.lie_bytes_at == i && (o.lie_bytes_pass == 0 || o.lie_bytes_pass == pass_);
    if (short_bytes && !out->bytes.empty()) out->bytes = out->bytes.first(out->bytes.size() - 1);
    if (o.device_label_from && i >= *o.device_label_from) out->device = Device{Device::Kind::kCuda, 0};
    owner_->tensors_.fetch_add(1);
    return true;
  }

 private:
  FaultySource* owner_;
  std::unique_ptr<TensorStream> inner_;
  int pass_;
  size_t n_ = 0;
};

FaultySource::FaultySource(WeightSource* inner, FaultySourceOptions options)
    : inner_(inner), options_(std::move(options)), meta_(inner->metadata()) {
  if (options_.metadata_omits_last && !meta_.empty()) meta_.pop_back();
  if (options_.lie_shape_at && *options_.lie_shape_at < meta_.size() && !meta_[*options_.lie_shape_at].shape.empty()) {
    meta_[*options_.lie_shape_at].shape.back() += 1;
  }
}

Result<std::unique_ptr<TensorStream>> FaultySource::Wrap(Result<std::unique_ptr<TensorStream>> inner) {
  if (!inner.ok()) return inner.status();
  int pass = passes_.fetch_add(1) + 1;
  return std::unique_ptr<TensorStream>(std::make_unique<Stream>(this, std::move(*inner), pass));
}

Result<std::unique_ptr<TensorStream>> FaultySource::Iterate() { return Wrap(inner_->Iterate()); }

Result<std::unique_ptr<TensorStream>> FaultySource::IterateHeld() { return Wrap(inner_->IterateHeld()); }

}  // namespace wsync::testing
