#include "quant/fp8_sink.h"

#include <sys/mman.h>

#include <cerrno>
#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "core/syscall.h"

#if WSYNC_FP8_SINK_CUDA
#include <cuda_runtime_api.h>

#include "quant/fp8_device.h"
#endif

namespace wsync {

Fp8LayerTracker::Fp8LayerTracker(const ShardingTable& table)
    : LayerTracker(table, [&table](int param) { return IsFp8Param(table, param); }, "quantized") {}

void Fp8LayerTracker::MarkHf(std::string_view hf_name) {
  if (IsFp8Quantized(hf_name)) LayerTracker::MarkHf(hf_name);
}

Status Fp8LayerTracker::CheckComplete() const {
  Status s = LayerTracker::CheckComplete();
  if (s.ok()) return s;
  return FailedPrecondition(fmt::format("fp8: {}, so they were not quantized", s.message()));
}

// ---- Fp8WorkerSink ----

Result<std::unique_ptr<Fp8WorkerSink>> Fp8WorkerSink::Create(WorkerStore* store, size_t threads) {
  const ShardingTable& table = store->table();
  WSYNC_RETURN_IF_ERROR(CheckFp8Sharding(table));
  std::unique_ptr<Fp8WorkerSink> sink(new Fp8WorkerSink(store));
  const size_t n = table.params().size();
  sink->layouts_.resize(n);
  sink->weight_.assign(n, nullptr);
  sink->scale_.assign(n, nullptr);
  std::vector<size_t> weight_offsets(n), scale_offsets(n);
  size_t total = 0;
  const auto align = [](size_t v) { return (v + 255) / 256 * 256; };
  for (size_t i = 0; i < n; ++i) {
    if (!IsFp8Param(table, static_cast<int>(i))) continue;
    WSYNC_ASSIGN_OR_RETURN(sink->layouts_[i], Fp8LayoutOf(table, static_cast<int>(i)));
    const Fp8ParamLayout& l = sink->layouts_[i];
    const size_t wb = static_cast<size_t>(l.shape.elements());
    const size_t sb = static_cast<size_t>(l.shape.scales()) * sizeof(float);
    // Each is at most its parameter's size, which the store has allocated.
    weight_offsets[i] = total;
    total += align(wb);
    scale_offsets[i] = total;
    total += align(sb);
    sink->fp8_bytes_ += wb + sb;
  }
  if (store->device().is_cpu()) {
    sink->host_weight_.resize(n);
    sink->host_scale_.resize(n);
    for (size_t i = 0; i < n; ++i) {
      if (sink->layouts_[i].weight.name.empty()) continue;
      sink->host_weight_[i].assign(static_cast<size_t>(sink->layouts_[i].shape.elements()), 0);
      sink->host_scale_[i].assign(static_cast<size_t>(sink->layouts_[i].shape.scales()), 0.0f);
      sink->weight_[i] = sink->host_weight_[i].data();
      sink->scale_[i] = sink->host_scale_[i].data();
    }
    sink->pool_ = std::make_unique<TaskPool>(std::max<size_t>(1, threads));
    sink->group_ = std::make_unique<TaskGroup>(*sink->pool_);
    return sink;
  }
#if WSYNC_FP8_SINK_CUDA
  WSYNC_ASSIGN_OR_RETURN(sink->device_fp8_, DeviceBuffer::Allocate(store->device(), std::max<size_t>(total, 1)));
  for (size_t i = 0; i < n; ++i) {
    if (sink->layouts_[i].weight.name.empty()) continue;
    sink->weight_[i] = reinterpret_cast<uint8_t*>(sink->device_fp8_.data() + weight_offsets[i]);
    sink->scale_[i] = reinterpret_cast<float*>(sink->device_fp8_.data() + scale_offsets[i]);
  }
  return sink;
#else
  return Unimplemented(fmt::format("fp8 quantization on {} needs a build with CUDA", store->device().ToString()));
#endif
}

Fp8WorkerSink::~Fp8WorkerSink() {
  (void)Wait();
#if WSYNC_FP8_SINK_CUDA
  if (stream_ != nullptr) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
#endif
}

Status Fp8WorkerSink::Load(const TensorRef& hf) {
  WSYNC_RETURN_IF_ERROR(store_->Load(hf));
  tracker_.MarkHf(hf.name);
  return Status::Ok();
}

Status Fp8WorkerSink::LoadPiece(int param, int piece, std::span<const std::byte> packed, const Device& where) {
  WSYNC_RETURN_IF_ERROR(store_->LoadPiece(param, piece, packed, where));
  tracker_.MarkPiece(param, piece);
  return Status::Ok();
}

Status Fp8WorkerSink::PlanLoad(const TensorRef& hf, std::vector<ByteCopy>* out) const {
  if (store_->device().is_cpu()) return Unimplemented("a host fp8 sink does not plan copies");
  return store_->PlanLoad(hf, out);
}

void Fp8WorkerSink::PlannedCopiesRan(std::span<const TensorMeta> tensors) {
  store_->PlannedCopiesRan(tensors);
  for (const TensorMeta& m : tensors) tracker_.MarkHf(m.name);
  if (Status s = QuantizeCompleted(); !s.ok()) {
    std::lock_guard lock(mu_);
    if (first_error_.ok()) first_error_ = std::move(s);
  }
}

Status Fp8WorkerSink::ChunkLanded() {
  WSYNC_RETURN_IF_ERROR(store_->ChunkLanded());
  return QuantizeCompleted();
}

Status Fp8WorkerSink::QuantizeCompleted() {
  const std::vector<int> done = tracker_.TakeCompleted();
  return done.empty() ? Status::Ok() : Quantize(done);
}

Status Fp8WorkerSink::Quantize(const std::vector<int>& params) {
  const ShardingTable& table = store_->table();
  if (!store_->device().is_cpu()) {
#if WSYNC_FP8_SINK_CUDA
    if (stream_ == nullptr) {
      cudaStream_t s = nullptr;
      if (cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking); e != cudaSuccess) {
        return Internal(fmt::format("fp8: creating the quantization stream on {}: {}", store_->device().ToString(),
                                    cudaGetErrorString(e)));
      }
      stream_ = s;
    }
    for (int p : params) {
      WSYNC_RETURN_IF_ERROR(QuantizeFp8ParamOnDevice(table, p, store_->param_data(p), weight_[p], scale_[p],
                                                     static_cast<cudaStream_t>(stream_)));
    }
    stream_pending_ = true;
    return Status::Ok();
#else
    return Unimplemented("fp8 quantization on a device needs a build with CUDA");
#endif
  }
  for (int p : params) {
    group_->Submit([this, &table, p](size_t) {
      const size_t nbytes = table.params()[p].meta.nbytes();
      std::span<std::byte> src = store_->mutable_param_bytes(p);
      // The layout cached at Create (QuantizeFp8Param would re-check the pieces).
      const Fp8ParamLayout& l = layouts_[p];
      Status s = QuantizeFp8Blocks(src.first(nbytes), table.params()[p].meta.dtype, l.shape,
                                   {weight_[p], static_cast<size_t>(l.shape.elements())},
                                   {scale_[p], static_cast<size_t>(l.shape.scales())}, 1, l.weight.name);
      // The landing buffer is not needed until the next update lands in it (zero pages).
      if (s.ok() && !src.empty() && ::madvise(src.data(), src.size(), MADV_DONTNEED) != 0) {
        s = ErrnoStatus(errno, fmt::format("releasing the landing buffer of {}", table.params()[p].meta.name));
      }
      if (!s.ok()) {
        std::lock_guard lock(mu_);
        if (first_error_.ok()) first_error_ = std::move(s);
      }
    });
  }
  return Status::Ok();
}

Status Fp8WorkerSink::Wait() {
  if (group_) group_->Wait();
  Status s;
  {
    std::lock_guard lock(mu_);
    s = std::exchange(first_error_, Status::Ok());
  }
#if WSYNC_FP8_SINK_CUDA
  if (stream_pending_) {
    stream_pending_ = false;
    if (cudaError_t e = cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)); e != cudaSuccess && s.ok()) {
      s = Internal(fmt::format("fp8 quantization on {}: {}", store_->device().ToString(), cudaGetErrorString(e)));
    }
  }
#endif
  return s;
}

void Fp8WorkerSink::BeginUpdate() {
  (void)Wait();
  tracker_.Reset();
}

Status Fp8WorkerSink::FinishUpdate() {
  // A layer completed by a landing no ChunkLanded / PlannedCopiesRan followed is
  // quantized now rather than left stale.
  if (Status s = QuantizeCompleted(); !s.ok()) {
    (void)Wait();
    tracker_.Reset();
    return s;
  }
  Status waited = Wait();
  Status complete = tracker_.CheckComplete();
  tracker_.Reset();
  WSYNC_RETURN_IF_ERROR(waited);
  return complete;
}

Status Fp8WorkerSink::QuantizeAll() {
  (void)Wait();
  tracker_.Reset();
  std::vector<int> all;
  for (size_t i = 0; i < layouts_.size(); ++i) {
    if (!layouts_[i].weight.name.empty()) all.push_back(static_cast<int>(i));
  }
  WSYNC_RETURN_IF_ERROR(Quantize(all));
  return Wait();
}

// ---- Digests ----

namespace {

int64_t FloorDiv(int64_t a, int64_t b) { return a / b - ((a % b != 0) && ((a < 0) != (b < 0))); }

// Copies `count` runs of `width` bytes from memory on `device` into host memory.
Status CopyOutOf(const Device& device, std::byte* dst, int64_t dst_pitch, const std::byte* src, int64_t src_pitch,
                 int64_t width, int64_t count) {
  if (width <= 0 || count <= 0) return Status::Ok();
  return CopyAndWait(device, dst, dst_pitch, src, src_pitch, width, count)
      .WithContext(fmt::format("reading fp8 weights back from {}", device.ToString()));
}

// Copies the part of runs `r` (from `src`) that falls in checkpoint bytes [lo, hi) into
// `out` (which holds exactly [lo, hi)): the runs wholly inside in one strided copy, the
// (at most two) runs cut by a bound one by one.
Status CopyRunsInRange(const Device& device, const PieceRuns& r, const std::byte* src, int64_t lo, int64_t hi,
                       std::byte* out) {
  if (r.count <= 0 || r.run_bytes <= 0) return Status::Ok();
  const auto part = [&](int64_t o) -> Status {
    if (o < 0 || o >= r.count) return Status::Ok();
    const int64_t hs = r.hf_offset + o * r.hf_stride, he = hs + r.run_bytes;
    const int64_t a = std::max(hs, lo), b = std::min(he, hi);
    if (a >= b || (a == hs && b == he)) return Status::Ok();  // outside, or wholly inside
    return CopyOutOf(device, out + (a - lo), 0, src + r.dst_offset + o * r.dst_stride + (a - hs), 0, b - a, 1);
  };
  if (r.count == 1 || r.hf_stride <= 0) {
    for (int64_t o = 0; o < r.count; ++o) {
      const int64_t hs = r.hf_offset + o * r.hf_stride, he = hs + r.run_bytes;
      const int64_t a = std::max(hs, lo), b = std::min(he, hi);
      if (a < b) {
        WSYNC_RETURN_IF_ERROR(
            CopyOutOf(device, out + (a - lo), 0, src + r.dst_offset + o * r.dst_stride + (a - hs), 0, b - a, 1));
      }
    }
    return Status::Ok();
  }
  // Runs o with lo <= hs(o) and he(o) <= hi.
  const int64_t first = std::clamp<int64_t>(-FloorDiv(r.hf_offset - lo, r.hf_stride), 0, r.count);
  const int64_t end = std::clamp<int64_t>(FloorDiv(hi - r.run_bytes - r.hf_offset, r.hf_stride) + 1, first, r.count);
  if (end > first) {
    WSYNC_RETURN_IF_ERROR(CopyOutOf(device, out + (r.hf_offset + first * r.hf_stride - lo), r.hf_stride,
                                    src + r.dst_offset + first * r.dst_stride, r.dst_stride, r.run_bytes,
                                    end - first));
  }
  WSYNC_RETURN_IF_ERROR(part(first - 1));
  return end != first - 1 ? part(end) : Status::Ok();
}

// The digest of FP8 checkpoint tensor `name` (NAME or NAME_scale_inv) of the group,
// assembled in row blocks of at most `block_bytes` in `scratch`.
Result<std::string> Fp8Digest(std::span<const Fp8WorkerSink* const> group, const TensorMeta& meta,
                              DigestAlgorithm algorithm, size_t block_bytes,
                              std::vector<std::byte>* scratch) {
  const int64_t rows = meta.shape[0];
  const int64_t row_bytes = static_cast<int64_t>(meta.nbytes()) / std::max<int64_t>(rows, 1);
  struct Src {
    const Device* device;
    const std::byte* data;
    PieceRuns runs;
  };
  std::vector<Src> sources;
  int64_t covered = 0;
  for (const Fp8WorkerSink* s : group) {
    for (const Fp8Source& f : Fp8SourcesOf(s->store().table(), meta.name)) {
      if (!f.primary) continue;
      const std::byte* data = f.scale ? reinterpret_cast<const std::byte*>(s->scale_data(f.param))
                                      : reinterpret_cast<const std::byte*>(s->weight_data(f.param));
      if (data == nullptr) return Internal(fmt::format("fp8 read-back of {}: parameter {} is not held", meta.name, f.param));
      sources.push_back({&s->store().device(), data, f.runs});
      covered += f.runs.count * f.runs.run_bytes;
    }
  }
  if (covered != static_cast<int64_t>(meta.nbytes())) {
    return Internal(fmt::format("fp8 read-back of {}: primary pieces cover {} of {} bytes", meta.name, covered,
                                meta.nbytes()));
  }
  auto hasher = Hasher::Create(algorithm);
  const int64_t block = std::clamp<int64_t>(static_cast<int64_t>(block_bytes) / std::max<int64_t>(row_bytes, 1), 1,
                                            std::max<int64_t>(rows, 1));
  if (scratch->size() < static_cast<size_t>(block * row_bytes)) scratch->resize(block * row_bytes);
  for (int64_t r0 = 0; r0 < rows; r0 += block) {
    const int64_t r1 = std::min(rows, r0 + block);
    for (const Src& s : sources) {
      WSYNC_RETURN_IF_ERROR(
          CopyRunsInRange(*s.device, s.runs, s.data, r0 * row_bytes, r1 * row_bytes, scratch->data()).WithContext(meta.name));
    }
    hasher->Update({scratch->data(), static_cast<size_t>((r1 - r0) * row_bytes)});
  }
  return hasher->FinishHex();
}

}  // namespace

Result<std::map<std::string, std::string>> AllFp8HfDigests(std::span<const Fp8WorkerSink* const> group,
                                                           DigestAlgorithm algorithm, size_t threads,
                                                           size_t block_bytes) {
  std::vector<const WorkerStore*> stores;
  for (const Fp8WorkerSink* s : group) {
    if (s == nullptr) return InvalidArgument("fp8 digests: a TP rank has no fp8 sink");
    stores.push_back(&s->store());
  }
  WSYNC_RETURN_IF_ERROR(CheckTpGroup(stores, /*devices=*/true));
  std::vector<TensorMeta> tensors = Fp8HfTensors(stores[0]->config());
  // An MTP layer's tensors without a drafter are held by no parameter.
  std::erase_if(tensors, [&](const TensorMeta& m) {
    const std::optional<Fp8HfPart> part = ParseFp8HfName(m.name);
    return !stores[0]->table().Serves(part ? std::string_view(part->hf_name) : std::string_view(m.name));
  });
  const bool on_host = std::ranges::all_of(stores, [](const WorkerStore* s) { return s->device().is_cpu(); });
  if (block_bytes == 0) block_bytes = on_host ? size_t{64} << 20 : kDeviceReadBackBlockBytes;
  return DigestEach(tensors, threads, [&](const TensorMeta& m, std::vector<std::byte>* scratch) {
    return ParseFp8HfName(m.name) ? Fp8Digest(group, m, algorithm, block_bytes, scratch)
                : HfDigest(stores, m.name, algorithm, block_bytes);
  });
}

}  // namespace wsync
