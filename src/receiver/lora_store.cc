#include "receiver/lora_store.h"

#include <cstring>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/digest.h"

namespace wsync {

namespace {

uint64_t Mix(uint64_t x) {  // splitmix64's finalizer
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Folds the first 16 hex digits of every digest, in tensor order.
uint64_t KeyOf(const std::vector<std::string>& digests) {
  uint64_t h = 0x4c6f5241ULL;  // "LoRA"
  for (const std::string& d : digests) {
    uint64_t w = 0;
    for (size_t i = 0; i < 16 && i < d.size(); ++i) {
      const char c = d[i];
      w = (w << 4) | static_cast<uint64_t>(c <= '9' ? c - '0' : c - 'a' + 10);
    }
    h = Mix(h ^ w);
  }
  return h;
}

}  // namespace

class LoraStore::Held final : public HeldTensors {
 public:
  explicit Held(const LoraAdapter* a) : a_(a) {
    for (size_t i = 0; i < a->tensors.size(); ++i) index_.emplace(a->tensors[i].name, i);
  }
  std::string_view DropReason(std::string_view) const override { return {}; }
  const TensorMeta* Find(std::string_view name) const override {
    std::optional<size_t> i = Index(name);
    return i ? &a_->tensors[*i] : nullptr;
  }
  std::string Describe() const override {
    return fmt::format("adapter {} ({} tensors: lora_A and lora_B of modules {} in every decoder layer)",
                       a_->spec.name, a_->tensors.size(), fmt::join(a_->spec.target_modules, ", "));
  }
  std::optional<size_t> Index(std::string_view name) const {
    auto it = index_.find(name);
    if (it == index_.end()) return std::nullopt;
    return it->second;
  }

 private:
  const LoraAdapter* a_;
  std::map<std::string, size_t, std::less<>> index_;
};

class LoraStore::Sink final : public WorkerSink {
 public:
  Sink(LoraAdapter* a, const Held* held, std::vector<bool>* landed) : a_(a), held_(held), landed_(landed) {}
  const std::vector<TensorMeta>& hf_tensors() const override { return a_->tensors; }
  bool HashesLandings() const override { return true; }
  Status Load(const TensorRef& hf) override {
    std::optional<size_t> i = held_->Index(hf.name);
    if (!i) return InvalidArgument(fmt::format("tensor {} is not one of adapter {}'s", hf.name, a_->spec.name));
    const TensorMeta got{std::string(hf.name), hf.dtype, Shape(hf.shape.begin(), hf.shape.end())};
    WSYNC_RETURN_IF_ERROR(CheckSameMeta(a_->tensors[*i], got).WithContext(fmt::format("adapter {}", a_->spec.name)));
    if (hf.bytes.size() != a_->bytes[*i].size()) {
      return InvalidArgument(fmt::format("adapter {}: {} arrived as {} bytes, expected {}", a_->spec.name, hf.name,
                                         hf.bytes.size(), a_->bytes[*i].size()));
    }
    if (!hf.device.is_cpu()) {
      return Unimplemented(fmt::format("adapter {}: {} arrived on {}; adapters land from host memory",
                                       a_->spec.name, hf.name, hf.device.ToString()));
    }
    std::unique_ptr<Hasher> h = Hasher::Create(DigestAlgorithm::kXxh3_128);
    if (!hf.bytes.empty()) CopyAndHash(a_->bytes[*i].data(), hf.bytes, *h, /*hash_destination=*/true);
    a_->digests[*i] = h->FinishHex();
    (*landed_)[*i] = true;
    return Status::Ok();
  }

 private:
  LoraAdapter* a_;
  const Held* held_;
  std::vector<bool>* landed_;
};

LoraStore::LoraStore() = default;
LoraStore::~LoraStore() = default;

Status LoraStore::Begin(const LoraSpec& spec, std::vector<TensorMeta> tensors) {
  Discard();
  auto a = std::make_shared<LoraAdapter>();
  a->spec = spec;
  a->tensors = std::move(tensors);
  a->bytes.reserve(a->tensors.size());
  try {
    for (const TensorMeta& t : a->tensors) a->bytes.emplace_back(t.nbytes());
  } catch (const std::bad_alloc&) {
    return Internal(fmt::format("adapter {}: cannot allocate its {} tensors", spec.name, a->tensors.size()));
  }
  a->digests.assign(a->tensors.size(), std::string());
  landed_.assign(a->tensors.size(), false);
  held_ = std::make_unique<Held>(a.get());
  sink_ = std::make_unique<Sink>(a.get(), held_.get(), &landed_);
  staged_ = std::move(a);
  return Status::Ok();
}

WorkerSink* LoraStore::staging_sink() { return sink_.get(); }

const HeldTensors* LoraStore::staging_tensors() const { return held_.get(); }

Status LoraStore::CheckStaged() const {
  if (!staged_) return FailedPrecondition("no adapter is staged");
  std::vector<std::string_view> missing;
  size_t count = 0;
  for (size_t i = 0; i < landed_.size(); ++i) {
    if (landed_[i]) continue;
    if (++count <= 5) missing.push_back(staged_->tensors[i].name);
  }
  if (count == 0) return Status::Ok();
  return FailedPrecondition(fmt::format("adapter {} version {}: {} of its {} tensors did not arrive in this session "
                                        "({}{}); the previous version keeps serving",
                                        staged_->spec.name, staged_->spec.version, count, landed_.size(),
                                        fmt::join(missing, ", "), count > missing.size() ? ", ..." : ""));
}

std::map<std::string, std::string> LoraStore::StagedDigests() const {
  std::map<std::string, std::string> out;
  if (!staged_) return out;
  for (size_t i = 0; i < staged_->tensors.size(); ++i) {
    if (landed_[i]) out.emplace(staged_->tensors[i].name, staged_->digests[i]);
  }
  return out;
}

Result<std::string> LoraStore::StagedRowsDigest(std::string_view name,
                                                std::span<const std::pair<int64_t, int64_t>> ranges) const {
  if (!staged_) return FailedPrecondition("no adapter is staged");
  for (size_t i = 0; i < staged_->tensors.size(); ++i) {
    const TensorMeta& m = staged_->tensors[i];
    if (m.name != name) continue;
    if (!landed_[i]) break;
    const int64_t rows = m.shape.empty() ? 0 : m.shape[0];
    const size_t row_bytes = rows > 0 ? m.nbytes() / static_cast<size_t>(rows) : 0;
    std::string joined;
    for (const auto& [begin, end] : ranges) {
      if (begin < 0 || begin >= end || end > rows) {
        return InvalidArgument(fmt::format("rows [{}, {}) of {}: outside its {} rows", begin, end, name, rows));
      }
      if (!joined.empty()) joined += ',';
      const std::span<const std::byte> bytes(staged_->bytes[i]);
      joined += HexDigest(DigestAlgorithm::kXxh3_128, bytes.subspan(static_cast<size_t>(begin) * row_bytes,
                                                                    static_cast<size_t>(end - begin) * row_bytes));
    }
    return joined;
  }
  return NotFound(fmt::format("adapter {}: tensor {} has not landed", staged_->spec.name, name));
}

std::shared_ptr<const LoraAdapter> LoraStore::Commit(const std::optional<std::string>& version) {
  if (!staged_) return nullptr;
  if (version) staged_->spec.version = *version;
  staged_->key = KeyOf(staged_->digests);
  std::shared_ptr<const LoraAdapter> live;
  {
    std::lock_guard lock(mu_);
    staged_->loads = ++loads_[staged_->spec.name];
    live = staged_;
    live_[staged_->spec.name] = live;
  }
  sink_.reset();
  held_.reset();
  staged_.reset();
  landed_.clear();
  return live;
}

void LoraStore::Discard() {
  sink_.reset();
  held_.reset();
  staged_.reset();
  landed_.clear();
}

std::shared_ptr<const LoraAdapter> LoraStore::Find(std::string_view name) const {
  std::lock_guard lock(mu_);
  auto it = live_.find(name);
  return it == live_.end() ? nullptr : it->second;
}

std::vector<std::shared_ptr<const LoraAdapter>> LoraStore::List() const {
  std::lock_guard lock(mu_);
  std::vector<std::shared_ptr<const LoraAdapter>> out;
  for (const auto& [name, a] : live_) out.push_back(a);
  return out;
}

size_t LoraStore::size() const {
  std::lock_guard lock(mu_);
  return live_.size();
}

Status LoraStore::Unload(std::string_view name) {
  std::lock_guard lock(mu_);
  auto it = live_.find(name);
  if (it == live_.end()) return NotFound(fmt::format("no LoRA adapter named {} is loaded", name));
  live_.erase(it);
  return Status::Ok();
}

}  // namespace wsync
