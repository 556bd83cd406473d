#include "engine/sync_pass.h"

#include <set>

#include <fmt/format.h>

#include "core/digest.h"

namespace wsync {

class SyncPass::Outer final : public TensorStream {
 public:
  Outer(std::unique_ptr<TensorStream> checked, bool digests, std::shared_ptr<const void> keep = nullptr)
      : keep_(std::move(keep)), checked_(std::move(checked)), collect_digests_(digests) {}
  Result<bool> Next(TensorRef* out) override {
    if (failed_) return FailedPrecondition("the sync's pass already failed");
    Result<bool> more = checked_->Next(out);
    if (!more.ok()) failed_ = true;
    if (more.ok() && !*more) complete_ = true;
    if (more.ok() && *more && collect_digests_ && out->device.is_cpu()) {
      digests_.insert_or_assign(std::string(out->name), HexDigest(DigestAlgorithm::kXxh3_128, out->bytes));
    }
    return more;
  }
  bool complete() const { return complete_; }
  const std::map<std::string, std::string>& digests() const { return digests_; }

 private:
  std::shared_ptr<const void> keep_;  // what checked_ is checked against, when the pass owns it
  std::unique_ptr<TensorStream> checked_;
  const bool collect_digests_;
  std::map<std::string, std::string> digests_;
  bool failed_ = false;
  bool complete_ = false;
};

class SyncPass::View final : public WeightSource {
 public:
  explicit View(SyncPass& pass) : pass_(pass) {}
  const std::vector<TensorMeta>& metadata() const override { return pass_.metadata(); }
  Result<std::unique_ptr<TensorStream>> Iterate() override {
    WSYNC_RETURN_IF_ERROR(HandOut());
    WSYNC_ASSIGN_OR_RETURN(std::shared_ptr<TensorStream> s, pass_.Stream());
    return Borrow(std::move(s));
  }
  std::optional<std::vector<std::string>> HeldNames() const override { return pass_.source_.HeldNames(); }
  // The pass over the held names: the held tensors' metadata, in metadata order.
  Result<std::unique_ptr<TensorStream>> IterateHeld() override {
    std::optional<std::vector<std::string>> names = HeldNames();
    if (!names) return Iterate();
    WSYNC_RETURN_IF_ERROR(HandOut());
    const std::set<std::string, std::less<>> held(names->begin(), names->end());
    std::vector<TensorMeta> metas;
    for (const TensorMeta& m : metadata()) {
      if (held.count(m.name)) metas.push_back(m);
    }
    WSYNC_ASSIGN_OR_RETURN(std::shared_ptr<TensorStream> s, pass_.HeldStream(metas));
    return Borrow(std::move(s));
  }

 private:
  Status HandOut() {
    if (handed_out_) return FailedPrecondition("a sync makes one pass over its source");
    handed_out_ = true;
    return Status::Ok();
  }
  // Borrowed: the pass owns the stream and outlives this view's callers.
  static std::unique_ptr<TensorStream> Borrow(std::shared_ptr<TensorStream> s) {
    class Borrowed final : public TensorStream {
     public:
      explicit Borrowed(std::shared_ptr<TensorStream> s) : s_(std::move(s)) {}
      Result<bool> Next(TensorRef* out) override { return s_->Next(out); }

     private:
      std::shared_ptr<TensorStream> s_;
    };
    return std::make_unique<Borrowed>(std::move(s));
  }

  SyncPass& pass_;
  bool handed_out_ = false;
};

SyncPass::SyncPass(WeightSource& source) : source_(source) {}
SyncPass::~SyncPass() = default;

Result<std::shared_ptr<TensorStream>> SyncPass::Stream() {
  if (!outer_) {
    WSYNC_ASSIGN_OR_RETURN(std::unique_ptr<TensorStream> inner, source_.Iterate());
    outer_ = std::make_shared<Outer>(CheckedStream(std::move(inner), source_.metadata()), collect_digests_);
  }
  return std::shared_ptr<TensorStream>(outer_);
}

Result<std::shared_ptr<TensorStream>> SyncPass::HeldStream(const std::vector<TensorMeta>& held) {
  if (outer_) return FailedPrecondition("a sync makes one pass over its source");
  WSYNC_ASSIGN_OR_RETURN(std::unique_ptr<TensorStream> inner, source_.IterateHeld());
  auto owned = std::make_shared<const std::vector<TensorMeta>>(held);
  outer_ = std::make_shared<Outer>(CheckedStream(std::move(inner), *owned), collect_digests_, owned);
  return std::shared_ptr<TensorStream>(outer_);
}

WeightSource& SyncPass::AsSource() {
  if (!view_) view_ = std::make_unique<View>(*this);
  return *view_;
}

Status SyncPass::ReadAll() {
  WSYNC_ASSIGN_OR_RETURN(std::shared_ptr<TensorStream> stream, Stream());
  TensorRef t;
  for (;;) {
    WSYNC_ASSIGN_OR_RETURN(bool more, stream->Next(&t));
    if (!more) return Status::Ok();
  }
}

bool SyncPass::complete() const { return outer_ && outer_->complete(); }

const std::map<std::string, std::string>& SyncPass::digests() const {
  static const std::map<std::string, std::string> kNone;
  return outer_ ? outer_->digests() : kNone;
}

}  // namespace wsync
