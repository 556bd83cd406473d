#include "engine/sync_pass.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <set>

#include <fmt/format.h>

#include "core/digest.h"

namespace wsync {

void CopyRecordingDigest(std::byte* dst, const TensorRef& t, PassDigests* digests) {
  if (digests == nullptr) {
    std::memcpy(dst, t.bytes.data(), t.bytes.size());
    return;
  }
  std::unique_ptr<Hasher> hasher = Hasher::Create(DigestAlgorithm::kXxh3_128);
  CopyAndHash(dst, t.bytes, *hasher, /*hash_destination=*/false);
  digests->Record(t.name, hasher->FinishHex());
}

void PassDigests::Record(std::string_view name, std::string hex) {
  std::lock_guard lock(mu_);
  digests_.insert_or_assign(std::string(name), std::move(hex));
}

void PassDigests::RecordRows(std::string_view name, int64_t begin, int64_t end, std::string hex) {
  std::lock_guard lock(mu_);
  std::vector<Rows>& rows = rows_[std::string(name)];
  // Kept ascending by begin; ranges usually come in order (appended in O(1)).
  auto at = rows.empty() || rows.back().begin < begin ? rows.end() : std::ranges::lower_bound(rows, begin, {}, &Rows::begin);
  if (at != rows.end() && at->begin == begin) {
    *at = Rows{begin, end, std::move(hex)};
    return;
  }
  rows.insert(at, Rows{begin, end, std::move(hex)});
}

bool PassDigests::Covers(const std::string& name, int64_t dim0) const {
  std::lock_guard lock(mu_);
  if (digests_.contains(name)) return true;
  auto it = rows_.find(name);
  if (it == rows_.end()) return false;
  int64_t next = 0;
  for (const Rows& r : it->second) {
    if (r.begin != next || r.end <= r.begin) return false;
    next = r.end;
  }
  return next == dim0;
}

size_t PassDigests::size() const {
  std::lock_guard lock(mu_);
  size_t n = digests_.size();
  for (const auto& [name, rows] : rows_) n += digests_.contains(name) ? 0 : 1;
  return n;
}

nlohmann::json PassDigests::Json() const {
  std::lock_guard lock(mu_);
  nlohmann::json j = digests_;
  for (const auto& [name, rows] : rows_) {
    if (digests_.contains(name)) continue;
    nlohmann::json list = nlohmann::json::array();
    for (const Rows& r : rows) list.push_back(nlohmann::json::array({r.begin, r.end, r.hex}));
    j[name] = nlohmann::json{{"rows", std::move(list)}};
  }
  return j;
}

Status PassDigests::Merge(const nlohmann::json& j) {
  if (!j.is_object()) return InvalidArgument("in-line digests: not a JSON object");
  for (const auto& [name, value] : j.items()) {
    if (value.is_string()) {
      Record(name, value.get<std::string>());
      continue;
    }
    const nlohmann::json* rows = value.is_object() && value.contains("rows") ? &value["rows"] : nullptr;
    if (rows == nullptr || !rows->is_array()) {
      return InvalidArgument(fmt::format("in-line digests of {}: neither a hex string nor {{\"rows\": [...]}}", name));
    }
    for (const nlohmann::json& e : *rows) {
      if (!e.is_array() || e.size() != 3 || !e[0].is_number_integer() || !e[1].is_number_integer() ||
          !e[2].is_string()) {
        return InvalidArgument(fmt::format("in-line digests of {}: a row range is not [begin, end, hex]", name));
      }
      RecordRows(name, e[0].get<int64_t>(), e[1].get<int64_t>(), e[2].get<std::string>());
    }
  }
  return Status::Ok();
}

class SyncPass::Outer final : public TensorStream {
 public:
  // `digests`: where the pass's digests go (null: none); `hash`: whether the pass hashes
  // them itself (else a reader took the hashing over).
  Outer(std::unique_ptr<TensorStream> checked, std::shared_ptr<PassDigests> digests, bool hash,
        std::shared_ptr<const void> keep = nullptr)
      : keep_(std::move(keep)), checked_(std::move(checked)), digests_(std::move(digests)), hash_(hash) {}
  Result<bool> Next(TensorRef* out) override {
    if (failed_) return FailedPrecondition("the sync's pass already failed");
    Result<bool> more = checked_->Next(out);
    if (!more.ok()) failed_ = true;
    if (more.ok() && !*more) complete_ = true;
    if (more.ok() && *more && digests_) {
      names_.emplace_back(out->name);
      if (hash_ && out->device.is_cpu()) digests_->Record(out->name, HexDigest(DigestAlgorithm::kXxh3_128, out->bytes));
    }
    return more;
  }
  bool complete() const { return complete_; }
  const std::vector<std::string>& names() const { return names_; }

 private:
  std::shared_ptr<const void> keep_;  // what checked_ is checked against, when the pass owns it
  std::unique_ptr<TensorStream> checked_;
  const std::shared_ptr<PassDigests> digests_;
  const bool hash_;
  std::vector<std::string> names_;  // of the tensors yielded
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
  std::vector<HeldRows> HeldRowRanges() const override { return pass_.source_.HeldRowRanges(); }
  // The pass yields the source's own TensorRefs.
  bool StableRefs() const override { return pass_.source_.StableRefs(); }
  // The pass over the held names: the held tensors' metadata (a tensor held as rows: their
  // shape), in metadata order.
  Result<std::unique_ptr<TensorStream>> IterateHeld() override {
    std::optional<std::vector<std::string>> names = HeldNames();
    if (!names) return Iterate();
    WSYNC_RETURN_IF_ERROR(HandOut());
    const std::set<std::string, std::less<>> held(names->begin(), names->end());
    std::map<std::string, int64_t, std::less<>> rows;
    for (const HeldRows& h : HeldRowRanges()) rows.emplace(h.name, h.end - h.begin);
    std::vector<TensorMeta> metas;
    for (const TensorMeta& m : metadata()) {
      if (!held.count(m.name)) continue;
      metas.push_back(m);
      if (auto it = rows.find(m.name); it != rows.end() && !m.shape.empty()) metas.back().shape[0] = it->second;
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
    outer_ = std::make_shared<Outer>(CheckedStream(std::move(inner), source_.metadata()),
                                     collect_digests_ ? digests_ : nullptr, !digests_taken_);
  }
  return std::shared_ptr<TensorStream>(outer_);
}

Result<std::shared_ptr<TensorStream>> SyncPass::HeldStream(const std::vector<TensorMeta>& held) {
  if (outer_) return FailedPrecondition("a sync makes one pass over its source");
  WSYNC_ASSIGN_OR_RETURN(std::unique_ptr<TensorStream> inner, source_.IterateHeld());
  auto owned = std::make_shared<const std::vector<TensorMeta>>(held);
  outer_ = std::make_shared<Outer>(CheckedStream(std::move(inner), *owned), collect_digests_ ? digests_ : nullptr,
                                   !digests_taken_, owned);
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

std::shared_ptr<PassDigests> SyncPass::TakeDigests() {
  if (!collect_digests_ || outer_) return nullptr;
  digests_taken_ = true;
  return digests_;
}

const std::map<std::string, std::string>& SyncPass::digests() const { return digests_->map(); }

bool SyncPass::digests_complete() const {
  if (!collect_digests_ || !outer_) return false;
  std::map<std::string_view, int64_t> dim0;
  for (const TensorMeta& m : source_.metadata()) dim0.emplace(m.name, m.shape.empty() ? 0 : m.shape[0]);
  return std::ranges::all_of(outer_->names(), [&](const std::string& n) {
    auto it = dim0.find(n);
    return digests_->Covers(n, it == dim0.end() ? 0 : it->second);
  });
}

}  // namespace wsync
