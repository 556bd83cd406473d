#include "synthetic/synthetic.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <set>

#include <fmt/format.h>

#include "core/parallel.h"
#include "wsync/device_runtime.h"
#include "synthetic/synthetic_kernels.h"

namespace wsync {
namespace {

using synthetic::HashKey;

constexpr uint64_t kChunkElements = SyntheticTrainer::kChunkElements;
// The `purpose` of the initial values' hash keys; steps use the step number.
constexpr uint64_t kInitPurpose = ~uint64_t{0};

bool IsTrained(DType d) { return d == DType::kBF16 || d == DType::kF16 || d == DType::kF32; }

}  // namespace

SyntheticTrainer::SyntheticTrainer(std::vector<TensorMeta> metadata, uint64_t seed, size_t threads,
                                   const Device& device)
    : metadata_(std::move(metadata)),
      device_(device),
      host_(std::vector<HostTensor>{}),
      seed_(seed),
      threads_(std::max<size_t>(1, threads)) {}

WeightSource& SyntheticTrainer::source() {
  if (device_source_) return *device_source_;
  return host_;
}

Status SyntheticTrainer::Prepare() {
  std::set<std::string_view> names;
  for (size_t i = 0; i < metadata_.size(); ++i) {
    const TensorMeta& m = metadata_[i];
    for (int64_t d : m.shape) {
      if (d < 0) return InvalidArgument(fmt::format("tensor {} has a negative dimension: {}", m.name, ShapeString(m.shape)));
    }
    if (!names.insert(m.name).second) return InvalidArgument(fmt::format("tensor {} is listed twice", m.name));
    name_keys_.push_back(synthetic::NameKey(m.name));
    const uint64_t n = static_cast<uint64_t>(m.numel());
    for (uint64_t b = 0; b < n; b += kChunkElements) {
      Chunk c{i, b, std::min(n, b + kChunkElements)};
      all_chunks_.push_back(c);
      if (IsTrained(m.dtype)) train_chunks_.push_back(c);
    }
    if (IsTrained(m.dtype)) trained_elements_ += n;
  }
  if (!device_.is_cpu()) {
    WSYNC_ASSIGN_OR_RETURN(device_source_, DeviceTensorSource::Create(device_, metadata_));
    return Status::Ok();
  }
  std::vector<HostTensor> tensors;
  tensors.reserve(metadata_.size());
  for (const TensorMeta& m : metadata_) {
    WSYNC_ASSIGN_OR_RETURN(HostTensor t, HostTensor::Zeros(m));
    tensors.push_back(std::move(t));
  }
  host_ = HostTensorSource(std::move(tensors));
  return Status::Ok();
}

Status SyntheticTrainer::ForEachChunk(const std::vector<Chunk>& chunks, Access access, const ChunkFn& fn) {
  std::atomic<size_t> next{0};
  std::mutex mu;
  Status first_error;
  const size_t workers = std::min(threads_, chunks.size());
  ParallelFor(workers, workers, [&](size_t, size_t) {
    std::vector<float> scratch;
    std::vector<std::byte> staging;
    for (size_t i = next.fetch_add(1); i < chunks.size(); i = next.fetch_add(1)) {
      const Chunk& c = chunks[i];
      const TensorMeta& m = metadata_[c.tensor];
      const size_t item = ItemSize(m.dtype);
      if (!device_source_) {
        fn(c, host_.tensors()[c.tensor].storage.data() + c.begin * item, scratch);
        continue;
      }
      const size_t bytes = (c.end - c.begin) * item;
      std::byte* on_device = device_source_->device_buffer().data() + device_source_->offset(c.tensor) + c.begin * item;
      staging.resize(bytes);
      Status s;
      if (access == Access::kReadWrite) s = CopyAndWait(device_, staging.data(), bytes, on_device, bytes, bytes, 1);
      if (s.ok()) {
        fn(c, staging.data(), scratch);
        s = CopyAndWait(device_, on_device, bytes, staging.data(), bytes, bytes, 1);
      }
      if (!s.ok()) {
        next.store(chunks.size());
        std::lock_guard<std::mutex> lock(mu);
        if (first_error.ok()) {
          first_error = s.WithContext(fmt::format("tensor {} elements [{}, {}) on {}", m.name, c.begin, c.end,
                                                  device_.ToString()));
        }
        return;
      }
    }
  });
  return first_error;
}

void GenerateInitialRange(uint64_t seed, const TensorMeta& meta, uint64_t begin, uint64_t end, std::byte* range,
                          std::vector<float>& scratch) {
  const size_t n = end - begin;
  const uint32_t first = static_cast<uint32_t>(begin);
  const uint64_t name_key = synthetic::NameKey(meta.name);
  const HashKey key = synthetic::MakeKey(seed, kInitPurpose, name_key, begin >> 32);
  const float mean = meta.name.ends_with("norm.weight") ? 1.0f : 0.0f;
  std::byte* out = range;
  auto normal_scratch = [&]() -> float* {
    scratch.resize(n);
    synthetic::GenerateNormal(scratch.data(), n, first, key, mean, SyntheticTrainer::kInitStd);
    return scratch.data();
  };
  switch (meta.dtype) {
    case DType::kBF16:
    case DType::kF16: {
      const float* values = normal_scratch();
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
      GenerateInitialRange(seed, meta, begin, std::min(n, begin + kChunkElements),
                           out.data() + begin * ItemSize(meta.dtype), scratch);
    }
  });
}

Result<std::unique_ptr<SyntheticTrainer>> SyntheticTrainer::FromMetadata(std::vector<TensorMeta> metas,
                                                                         uint64_t seed, size_t threads,
                                                                         const Device& device) {
  std::unique_ptr<SyntheticTrainer> trainer(new SyntheticTrainer(std::move(metas), seed, threads, device));
  WSYNC_RETURN_IF_ERROR(trainer->Prepare());
  SyntheticTrainer& t = *trainer;
  WSYNC_RETURN_IF_ERROR(t.ForEachChunk(t.all_chunks_, Access::kWrite,
                                       [&](const Chunk& c, std::byte* range, std::vector<float>& scratch) {
                                         GenerateInitialRange(t.seed_, t.metadata_[c.tensor], c.begin, c.end, range,
                                                              scratch);
                                       }));
  return trainer;
}

Result<std::unique_ptr<SyntheticTrainer>> SyntheticTrainer::FromCheckpoint(
    const CheckpointDir& ckpt, size_t threads, uint64_t seed, const Device& device,
    const std::function<bool(std::string_view)>& skip) {
  std::vector<std::span<const std::byte>> bytes;
  std::vector<TensorMeta> kept;
  for (const TensorMeta& m : ckpt.tensors()) {
    if (skip && skip(m.name)) continue;
    WSYNC_ASSIGN_OR_RETURN(std::span<const std::byte> b, ckpt.Bytes(m.name));
    bytes.push_back(b);
    kept.push_back(m);
  }
  std::unique_ptr<SyntheticTrainer> trainer(new SyntheticTrainer(std::move(kept), seed, threads, device));
  WSYNC_RETURN_IF_ERROR(trainer->Prepare());
  SyntheticTrainer& t = *trainer;
  WSYNC_RETURN_IF_ERROR(t.ForEachChunk(t.all_chunks_, Access::kWrite,
                                       [&](const Chunk& c, std::byte* range, std::vector<float>&) {
                                         const size_t item = ItemSize(t.metadata_[c.tensor].dtype);
                                         std::memcpy(range, bytes[c.tensor].data() + c.begin * item,
                                                     (c.end - c.begin) * item);
                                       }));
  return trainer;
}

Result<StepStats> SyntheticTrainer::Step(uint64_t step) {
  const auto start = std::chrono::steady_clock::now();
  std::atomic<uint64_t> changed{0};
  WSYNC_RETURN_IF_ERROR(ForEachChunk(train_chunks_, Access::kReadWrite,
                                     [&](const Chunk& c, std::byte* range, std::vector<float>&) {
    const DType dtype = metadata_[c.tensor].dtype;
    const size_t n = c.end - c.begin;
    const uint32_t first = static_cast<uint32_t>(c.begin);
    const HashKey key = synthetic::MakeKey(seed_, step, name_keys_[c.tensor], c.begin >> 32);
    uint64_t k = 0;
    if (dtype == DType::kF32) {
      k = synthetic::StepF32(reinterpret_cast<float*>(range), n, first, key, lr_);
    } else if (dtype == DType::kBF16) {
      k = synthetic::StepBF16(reinterpret_cast<uint16_t*>(range), n, first, key, lr_);
    } else {
      k = synthetic::StepF16(reinterpret_cast<uint16_t*>(range), n, first, key, lr_);
    }
    changed.fetch_add(k, std::memory_order_relaxed);
  }).WithContext(fmt::format("synthetic step {}", step)));
  StepStats s;
  s.changed_elements = changed.load();
  s.total_elements = trained_elements_;
  s.changed_fraction = s.total_elements ? static_cast<double>(s.changed_elements) / s.total_elements : 0.0;
  s.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return s;
}

}  // namespace wsync
