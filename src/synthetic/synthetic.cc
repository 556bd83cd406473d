#include "synthetic/synthetic.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <set>

#include <fmt/format.h>

#include "core/parallel.h"
#include "synthetic/synthetic_kernels.h"

namespace wsync {
namespace {

using synthetic::HashKey;

// Elements per work chunk: small enough to balance threads, large enough to amortize
// the dispatch. A power of two dividing 2^32, so no chunk crosses a 2^32 hash block.
constexpr uint64_t kChunkElements = uint64_t{1} << 20;
// The `purpose` of the initial values' hash keys; steps use the step number.
constexpr uint64_t kInitPurpose = ~uint64_t{0};

bool IsTrained(DType d) { return d == DType::kBF16 || d == DType::kF16 || d == DType::kF32; }

template <typename T>
T* As(HostBuffer& b) { return reinterpret_cast<T*>(b.data()); }

}  // namespace

SyntheticTrainer::SyntheticTrainer(std::vector<HostTensor> tensors, uint64_t seed, size_t threads)
    : source_(std::move(tensors)), seed_(seed), threads_(std::max<size_t>(1, threads)) {}

Status SyntheticTrainer::Prepare() {
  std::set<std::string_view> names;
  for (size_t i = 0; i < tensors().size(); ++i) {
    const TensorMeta& m = tensors()[i].meta;
    if (!names.insert(m.name).second) return InvalidArgument(fmt::format("tensor {} is listed twice", m.name));
    name_keys_.push_back(synthetic::NameKey(m.name));
    HostBuffer master;
    if (m.dtype == DType::kBF16 || m.dtype == DType::kF16) {
      WSYNC_ASSIGN_OR_RETURN(master, HostBuffer::Allocate(static_cast<size_t>(m.numel()) * sizeof(float)));
    }
    masters_.push_back(std::move(master));
    const uint64_t n = static_cast<uint64_t>(m.numel());
    for (uint64_t b = 0; b < n; b += kChunkElements) {
      Chunk c{i, b, std::min(n, b + kChunkElements)};
      all_chunks_.push_back(c);
      if (IsTrained(m.dtype)) train_chunks_.push_back(c);
    }
    if (IsTrained(m.dtype)) trained_elements_ += n;
  }
  return Status::Ok();
}

void SyntheticTrainer::ForEachChunk(
    const std::vector<Chunk>& chunks,
    const std::function<void(const Chunk&, std::vector<float>&)>& fn) {
  std::atomic<size_t> next{0};
  const size_t workers = std::min(threads_, chunks.size());
  ParallelFor(workers, workers, [&](size_t, size_t) {
    std::vector<float> scratch;
    for (size_t i = next.fetch_add(1); i < chunks.size(); i = next.fetch_add(1)) fn(chunks[i], scratch);
  });
}

void GenerateInitialRange(uint64_t seed, const TensorMeta& meta, uint64_t begin, uint64_t end, std::byte* tensor,
                          float* master, std::vector<float>& scratch) {
  const size_t n = end - begin;
  const uint32_t first = static_cast<uint32_t>(begin);
  const uint64_t name_key = synthetic::NameKey(meta.name);
  const HashKey key = synthetic::MakeKey(seed, kInitPurpose, name_key, begin >> 32);
  const float mean = meta.name.ends_with("norm.weight") ? 1.0f : 0.0f;
  std::byte* out = tensor + begin * ItemSize(meta.dtype);
  auto normal_scratch = [&]() -> float* {
    scratch.resize(n);
    synthetic::GenerateNormal(scratch.data(), n, first, key, mean, SyntheticTrainer::kInitStd);
    return scratch.data();
  };
  switch (meta.dtype) {
    case DType::kBF16:
    case DType::kF16: {
      float* values = master;
      if (values == nullptr) {
        values = normal_scratch();
      } else {
        synthetic::GenerateNormal(values, n, first, key, mean, SyntheticTrainer::kInitStd);
      }
      auto* model = reinterpret_cast<uint16_t*>(out);
      if (meta.dtype == DType::kBF16) {
        synthetic::RoundToBF16(values, model, n);
      } else {
        synthetic::RoundToF16(values, model, n);
      }
      break;
    }
    case DType::kF32:
      synthetic::GenerateNormal(reinterpret_cast<float*>(out), n, first, key, mean, SyntheticTrainer::kInitStd);
      break;
    case DType::kF8E4M3:
      synthetic::RoundToF8E4M3(normal_scratch(), reinterpret_cast<uint8_t*>(out), n);
      break;
    case DType::kF8E5M2:
      synthetic::RoundToF8E5M2(normal_scratch(), reinterpret_cast<uint8_t*>(out), n);
      break;
    case DType::kF64: {
      const float* v = normal_scratch();
      auto* d = reinterpret_cast<double*>(out);
      for (size_t j = 0; j < n; ++j) d[j] = v[j];
      break;
    }
    default: {  // integers and bool: hash bytes over the tensor's byte range
      const size_t item = ItemSize(meta.dtype);
      const uint64_t byte_begin = begin * item;
      const HashKey bkey = synthetic::MakeKey(seed, kInitPurpose, name_key, byte_begin >> 32);
      synthetic::GenerateBytes(reinterpret_cast<uint8_t*>(out), n * item, static_cast<uint32_t>(byte_begin),
                               bkey, meta.dtype == DType::kBool);
      break;
    }
  }
}

void GenerateInitial(uint64_t seed, const TensorMeta& meta, std::span<std::byte> out, size_t threads) {
  const uint64_t n = static_cast<uint64_t>(meta.numel());
  const size_t chunks = static_cast<size_t>((n + kChunkElements - 1) / kChunkElements);
  ParallelFor(chunks, threads, [&](size_t b, size_t e) {
    std::vector<float> scratch;
    for (size_t c = b; c < e; ++c) {
      const uint64_t begin = c * kChunkElements;
      GenerateInitialRange(seed, meta, begin, std::min(n, begin + kChunkElements), out.data(), nullptr, scratch);
    }
  });
}

void SyntheticTrainer::Generate(const Chunk& c, std::vector<float>& scratch) {
  HostTensor& t = tensors()[c.tensor];
  float* master = masters_[c.tensor].size() > 0 ? As<float>(masters_[c.tensor]) + c.begin : nullptr;
  GenerateInitialRange(seed_, t.meta, c.begin, c.end, t.storage.data(), master, scratch);
}

void SyntheticTrainer::WidenFromModel(const Chunk& c) {
  HostTensor& t = tensors()[c.tensor];
  if (masters_[c.tensor].size() == 0) return;  // F32 is its own master; others are fixed
  const size_t n = c.end - c.begin;
  const auto* model = reinterpret_cast<const uint16_t*>(t.storage.data()) + c.begin;
  float* master = As<float>(masters_[c.tensor]) + c.begin;
  if (t.meta.dtype == DType::kBF16) synthetic::WidenBF16(model, master, n);
  if (t.meta.dtype == DType::kF16) synthetic::WidenF16(model, master, n);
}

Result<std::unique_ptr<SyntheticTrainer>> SyntheticTrainer::FromMetadata(std::vector<TensorMeta> metas,
                                                                         uint64_t seed, size_t threads) {
  std::vector<HostTensor> tensors;
  tensors.reserve(metas.size());
  for (TensorMeta& m : metas) {
    for (int64_t d : m.shape) {
      if (d < 0) return InvalidArgument(fmt::format("tensor {} has a negative dimension: {}", m.name, ShapeString(m.shape)));
    }
    WSYNC_ASSIGN_OR_RETURN(HostTensor t, HostTensor::Zeros(std::move(m)));
    tensors.push_back(std::move(t));
  }
  std::unique_ptr<SyntheticTrainer> trainer(new SyntheticTrainer(std::move(tensors), seed, threads));
  WSYNC_RETURN_IF_ERROR(trainer->Prepare());
  trainer->ForEachChunk(trainer->all_chunks_,
                        [&](const Chunk& c, std::vector<float>& scratch) { trainer->Generate(c, scratch); });
  return trainer;
}

Result<std::unique_ptr<SyntheticTrainer>> SyntheticTrainer::FromCheckpoint(const CheckpointDir& ckpt,
                                                                           size_t threads, uint64_t seed) {
  std::vector<HostTensor> tensors;
  std::vector<std::span<const std::byte>> bytes;
  for (const TensorMeta& m : ckpt.tensors()) {
    WSYNC_ASSIGN_OR_RETURN(HostTensor t, HostTensor::Zeros(m));
    WSYNC_ASSIGN_OR_RETURN(std::span<const std::byte> b, ckpt.Bytes(m.name));
    tensors.push_back(std::move(t));
    bytes.push_back(b);
  }
  std::unique_ptr<SyntheticTrainer> trainer(new SyntheticTrainer(std::move(tensors), seed, threads));
  WSYNC_RETURN_IF_ERROR(trainer->Prepare());
  trainer->ForEachChunk(trainer->all_chunks_, [&](const Chunk& c, std::vector<float>&) {
    const size_t item = ItemSize(trainer->tensors()[c.tensor].meta.dtype);
    std::memcpy(trainer->tensors()[c.tensor].storage.data() + c.begin * item,
                bytes[c.tensor].data() + c.begin * item, (c.end - c.begin) * item);
    trainer->WidenFromModel(c);
  });
  return trainer;
}

Result<StepStats> SyntheticTrainer::Step(uint64_t step) {
  const auto start = std::chrono::steady_clock::now();
  std::atomic<uint64_t> changed{0};
  ForEachChunk(train_chunks_, [&](const Chunk& c, std::vector<float>&) {
    HostTensor& t = tensors()[c.tensor];
    const size_t n = c.end - c.begin;
    const uint32_t first = static_cast<uint32_t>(c.begin);
    const HashKey key = synthetic::MakeKey(seed_, step, name_keys_[c.tensor], c.begin >> 32);
    uint64_t k = 0;
    if (t.meta.dtype == DType::kF32) {
      k = synthetic::StepF32(reinterpret_cast<float*>(t.storage.data()) + c.begin, n, first, key, lr_);
    } else {
      float* master = As<float>(masters_[c.tensor]) + c.begin;
      auto* model = reinterpret_cast<uint16_t*>(t.storage.data()) + c.begin;
      k = t.meta.dtype == DType::kBF16 ? synthetic::StepBF16(master, model, n, first, key, lr_)
                                       : synthetic::StepF16(master, model, n, first, key, lr_);
    }
    changed.fetch_add(k, std::memory_order_relaxed);
  });
  StepStats s;
  s.changed_elements = changed.load();
  s.total_elements = trained_elements_;
  s.changed_fraction = s.total_elements ? static_cast<double>(s.changed_elements) / s.total_elements : 0.0;
  s.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return s;
}

std::span<const float> SyntheticTrainer::master(size_t i) const {
  const HostTensor& t = tensors()[i];
  if (t.meta.dtype == DType::kF32) {
    return {reinterpret_cast<const float*>(t.storage.data()), static_cast<size_t>(t.meta.numel())};
  }
  const HostBuffer& m = masters_[i];
  return {reinterpret_cast<const float*>(m.data()), m.size() / sizeof(float)};
}

}  // namespace wsync
