#include "model/worker_store.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <numeric>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/log.h"
#include "core/parallel.h"
#include "core/prefault.h"
#include "model/dropped_names.h"
#include "model/update_meta.h"

namespace wsync {
namespace {

// One primary piece of an HF tensor somewhere in the group.
struct SourcePiece {
  const WorkerStore* store;
  int param;
  int piece;
};

std::vector<SourcePiece> PrimaryPieces(std::span<const WorkerStore* const> group,
                                       std::string_view hf_name) {
  std::vector<SourcePiece> out;
  for (const WorkerStore* s : group) {
    for (auto [i, k] : s->table().PiecesOf(hf_name)) {
      if (s->table().params()[i].pieces[k].primary) out.push_back({s, i, k});
    }
  }
  return out;
}

// Copies `count` runs of `width` bytes out of a store's memory into host memory: from
// `src` every `src_pitch` bytes to `dst` every `dst_pitch` bytes. A CUDA store's copy runs
// on this thread's stream, on the store's device, and is complete on return.
Status CopyOut(const WorkerStore& store, std::byte* dst, int64_t dst_pitch, const std::byte* src, int64_t src_pitch,
               int64_t width, int64_t count) {
  if (width <= 0 || count <= 0) return Status::Ok();
  return CopyAndWait(store.device(), dst, dst_pitch, src, src_pitch, width, count)
      .WithContext(fmt::format("reading shards back from {}", store.device().ToString()));
}

// Copies HF rows [row_begin, row_end) (along dim 0) of the group's primary pieces into
// `out`, which holds exactly those rows.
Status ReadRows(const std::vector<SourcePiece>& pieces, const TensorMeta& hf, int64_t row_begin,
                int64_t row_end, std::byte* out) {
  const int64_t row_bytes = static_cast<int64_t>(hf.nbytes()) / hf.shape[0];
  const int64_t lo_bound = row_begin * row_bytes, hi_bound = row_end * row_bytes;
  for (const SourcePiece& sp : pieces) {
    const ShardPiece& p = sp.store->table().params()[sp.param].pieces[sp.piece];
    const PieceRuns r = sp.store->table().Runs(sp.param, sp.piece);
    const std::byte* src = sp.store->param_data(sp.param);
    if (p.dim > 0) {
      // Each run lies inside one dim-0 row: the wanted rows' runs, in one strided copy.
      const int64_t per_row = r.count / hf.shape[0];
      const int64_t o_begin = row_begin * per_row, o_end = row_end * per_row;
      WSYNC_RETURN_IF_ERROR(CopyOut(*sp.store, out + (r.hf_offset + o_begin * r.hf_stride - lo_bound), r.hf_stride,
                                    src + r.dst_offset + o_begin * r.dst_stride, r.dst_stride, r.run_bytes,
                                    o_end - o_begin));
      continue;
    }
    for (int64_t o = 0; o < r.count; ++o) {
      const int64_t hs = r.hf_offset + o * r.hf_stride, he = hs + r.run_bytes;
      const int64_t lo = std::max(hs, lo_bound), hi = std::min(he, hi_bound);
      if (lo >= hi) continue;
      WSYNC_RETURN_IF_ERROR(CopyOut(*sp.store, out + (lo - lo_bound), 0,
                                    src + r.dst_offset + o * r.dst_stride + (lo - hs), 0, hi - lo, 1));
    }
  }
  return Status::Ok();
}

Result<const TensorMeta*> FindHfInGroup(std::span<const WorkerStore* const> group,
                                        std::string_view hf_name, bool devices = false) {
  WSYNC_RETURN_IF_ERROR(CheckTpGroup(group, devices));
  int idx = group[0]->table().FindHf(hf_name);
  if (idx < 0) {
    return NotFound(fmt::format("model {} has no tensor {}", group[0]->config().name, hf_name));
  }
  return &group[0]->hf_tensors()[idx];
}

std::string SliceString(const ShardPiece& p, const TensorMeta& hf) {
  if (p.hf_start == 0 && p.length == hf.shape[p.dim]) return "(whole tensor)";
  return fmt::format("[{}, {}) along dim {}", p.hf_start, p.hf_start + p.length, p.dim);
}

}  // namespace

Result<std::unique_ptr<WorkerStore>> WorkerStore::Create(const ModelConfig& config, int tp_rank,
                                                         int tp_size, const Device& device, Drafter drafter) {
  WSYNC_ASSIGN_OR_RETURN(ShardingTable table, ShardingTable::Build(config, tp_rank, tp_size, {}, drafter));
  std::unique_ptr<WorkerStore> store(new WorkerStore(std::move(table)));
  store->device_ = device;
  if (drafter != Drafter::kNone) {
    const ShardingTable& t = store->table_;
    store->drafter_tracker_ =
        std::make_unique<LayerTracker>(t, [&t](int param) { return t.IsDrafterParam(param); }, "drafter");
    for (int64_t l = config.num_hidden_layers; l < config.total_layers(); ++l) {
      store->drafter_prefixes_.push_back(fmt::format("model.layers.{}.", l));
    }
  }
  const std::vector<WorkerParam>& params = store->table_.params();
  for (const WorkerParam& p : params) store->param_bytes_ += p.meta.nbytes();
  if (device.is_cpu()) {
    store->params_.reserve(params.size());
    for (const WorkerParam& p : params) {
      WSYNC_ASSIGN_OR_RETURN(HostTensor t, HostTensor::Zeros(p.meta));
      store->param_data_.push_back(t.storage.data());
      store->params_.push_back(std::move(t));
    }
    const size_t threads = DefaultThreads();
    for (HostTensor& t : store->params_) Prefault(t.storage.span(), threads);
    return store;
  }
  std::vector<size_t> sizes, offsets;
  for (const WorkerParam& p : params) sizes.push_back(p.meta.nbytes());
  const size_t total = LayOutAligned(sizes, &offsets);
  // From the virtual memory API, so that sleep can release it in place; a runtime without
  // that API gives plain memory, and then sleep is refused (DeviceBuffer::ReleasePhysical).
  Result<DeviceBuffer> storage = DeviceBuffer::Allocate(device, total, DeviceAllocator::kVirtualMemory);
  if (storage.status().code() == StatusCode::kUnimplemented) storage = DeviceBuffer::Allocate(device, total);
  WSYNC_ASSIGN_OR_RETURN(store->device_storage_, std::move(storage));
  for (size_t off : offsets) store->param_data_.push_back(store->device_storage_.data() + off);
  return store;
}

std::vector<WorkerStore::DrafterParam> WorkerStore::drafter_params() const {
  std::vector<DrafterParam> out;
  const std::vector<WorkerParam>& params = table_.params();
  for (size_t i = 0; i < params.size(); ++i) {
    if (table_.IsDrafterParam(static_cast<int>(i))) {
      out.push_back({params[i].meta.name, param_data_[i], params[i].meta.nbytes(), -1});
    }
  }
  for (const DrafterAlias& a : table_.drafter_aliases()) {
    out.push_back({a.name, param_data_[a.param], params[a.param].meta.nbytes(), a.param});
  }
  return out;
}

Result<std::unique_ptr<WorkerStore>> WorkerStore::CopyToHost() const {
  WSYNC_RETURN_IF_ERROR(CheckResident("reading back"));
  WSYNC_ASSIGN_OR_RETURN(auto host, Create(config(), tp_rank(), tp_size(), {}, table_.drafter()));
  if (device_.is_cpu()) {
    for (size_t i = 0; i < params_.size(); ++i) {
      std::memcpy(host->param_data_[i], param_data_[i], params_[i].meta.nbytes());
    }
    return host;
  }
  WSYNC_ASSIGN_OR_RETURN(DeviceRuntime * rt, CudaRuntimeFor(device_));
  WSYNC_RETURN_IF_ERROR(rt->SetDevice(device_.index));
  // Straight into the host store's own buffers: no staging copy of the whole shard set.
  for (size_t i = 0; i < param_data_.size(); ++i) {
    const size_t n = table_.params()[i].meta.nbytes();
    WSYNC_RETURN_IF_ERROR(rt->Copy2D(host->param_data_[i], n, param_data_[i], n, n, 1));
  }
  WSYNC_RETURN_IF_ERROR(rt->Synchronize().WithContext(fmt::format("reading back the shards on {}", device_.ToString())));
  return host;
}

Status WorkerStore::CheckHf(const TensorMeta& hf) const {
  return CheckHf(hf.name, hf.dtype, hf.shape);
}

Status WorkerStore::CheckHf(std::string_view name, DType dtype,
                            std::span<const int64_t> shape) const {
  int idx = table_.FindHf(name);
  if (idx < 0) {
    return InvalidArgument(fmt::format("model {} has no tensor {}", config().name, name));
  }
  return CheckUpdateMeta(table_.hf_tensors()[idx], dtype, shape);
}

Status WorkerStore::CheckLoad(const TensorRef& hf) const {
  WSYNC_RETURN_IF_ERROR(CheckResident(hf.name));
  if (!hf.device.is_cpu() && hf.device != device_) {
    return InvalidArgument(fmt::format("tensor {} is on {}; this store is on {} and loads host tensors{}",
                                       hf.name, hf.device.ToString(), device_.ToString(),
                                       device_.is_cpu() ? "" : " or tensors of its own device"));
  }
  WSYNC_RETURN_IF_ERROR(CheckHf(hf.name, hf.dtype, hf.shape));
  const size_t want = static_cast<size_t>(NumElements(hf.shape)) * ItemSize(hf.dtype);
  if (hf.bytes.size() != want) {
    return InvalidArgument(fmt::format("tensor {} of shape {} needs {} bytes, update has {}",
                                       hf.name, ShapeString(hf.shape), want, hf.bytes.size()));
  }
  return Status::Ok();
}

void WorkerStore::BeginDrafterUpdate() {
  if (drafter_tracker_) drafter_tracker_->Reset();
}

Result<bool> WorkerStore::FinishDrafterUpdate() {
  if (!drafter_tracker_) return false;
  Status complete = drafter_tracker_->CheckComplete();
  const bool whole = drafter_tracker_->completed_layers() == drafter_tracker_->num_layers();
  drafter_tracker_->Reset();
  WSYNC_RETURN_IF_ERROR(complete.WithContext("the MTP drafter was not reloaded whole"));
  return whole;
}

bool WorkerStore::IsDropped(std::string_view hf_name) const {
  return table_.FindHf(hf_name) < 0 && !DroppedNameReason(hf_name, config()).empty();
}

Status WorkerStore::Load(const TensorRef& hf) {
  if (IsDropped(hf.name)) return Status::Ok();
  WSYNC_RETURN_IF_ERROR(CheckLoad(hf));
  if (drafter_tracker_) MarkDrafter(hf.name);
  WSYNC_RETURN_IF_ERROR(LoadChecked(hf));
  NoteGroupLanded(hf.name);
  return Status::Ok();
}

void WorkerStore::NoteGroupLanded(std::string_view hf_name) {
  if (group_landing_ && device_.is_cpu()) group_landing_->LandedAll(tp_rank(), table_.FindHf(hf_name));
}

Status WorkerStore::LoadEach(std::span<const TensorRef> hf, size_t threads) {
  std::vector<const TensorRef*> load;
  size_t total = 0;
  for (const TensorRef& t : hf) {
    if (IsDropped(t.name)) continue;
    WSYNC_RETURN_IF_ERROR(CheckLoad(t));
    load.push_back(&t);
    total += t.bytes.size();
  }
  for (const TensorRef* t : load) {
    if (drafter_tracker_) MarkDrafter(t->name);
  }
  if (!device_.is_cpu() || threads <= 1 || load.size() <= 1) {
    for (const TensorRef* t : load) {
      WSYNC_RETURN_IF_ERROR(LoadChecked(*t));
      NoteGroupLanded(t->name);
    }
    return Status::Ok();
  }
  // Contiguous runs of tensors of about equal bytes, one per thread; each tensor lands
  // whole on one thread.
  threads = std::min(threads, load.size());
  std::vector<size_t> bounds{0};
  size_t acc = 0;
  for (size_t i = 0; i < load.size(); ++i) {
    acc += load[i]->bytes.size();
    if (bounds.size() < threads && acc * threads >= total * bounds.size() && i + 1 < load.size()) {
      bounds.push_back(i + 1);
    }
  }
  bounds.push_back(load.size());
  std::vector<Status> status(bounds.size() - 1);
  ParallelFor(status.size(), status.size(), [&](size_t b, size_t e) {
    for (size_t r = b; r < e; ++r) {
      for (size_t i = bounds[r]; i < bounds[r + 1] && status[r].ok(); ++i) {
        status[r] = LoadChecked(*load[i]);
        if (status[r].ok()) NoteGroupLanded(load[i]->name);
      }
    }
  });
  for (Status& s : status) WSYNC_RETURN_IF_ERROR(s);
  return Status::Ok();
}

Status WorkerStore::LoadChecked(const TensorRef& hf) {
  const std::byte* src = hf.bytes.data();
  if (!device_.is_cpu()) {
    WSYNC_ASSIGN_OR_RETURN(DeviceRuntime * rt, CudaRuntimeFor(device_));
    for (auto [i, k] : table_.PiecesOf(hf.name)) {
      const PieceRuns r = table_.Runs(i, k);
      WSYNC_RETURN_IF_ERROR(rt->Copy2D(param_data_[i] + r.dst_offset, r.dst_stride, src + r.hf_offset,
                                       r.hf_stride, r.run_bytes, r.count));
    }
    if (!fault_corrupt_landing_.empty() && hf.name == fault_corrupt_landing_) {
      WSYNC_RETURN_IF_ERROR(CorruptDeviceLanding(hf.name));
    }
    return rt->Synchronize().WithContext(fmt::format("loading {} into the shards on {}", hf.name, device_.ToString()));
  }
  std::vector<std::byte> corrupted;
  if (!fault_corrupt_landing_.empty() && hf.name == fault_corrupt_landing_ && !hf.bytes.empty()) {
    corrupted.assign(hf.bytes.begin(), hf.bytes.end());
    corrupted[0] ^= std::byte{1};
    src = corrupted.data();
  }
  const int hf_index = hash_landings_ ? table_.FindHf(hf.name) : -1;
  const std::vector<LandingRun>* runs = hf_index >= 0 ? &LandingRuns(hf_index) : nullptr;
  if (runs != nullptr && !runs->empty()) {
    // The primary runs in HF order, each hashed as it lands; then any replicated copies.
    auto hasher = Hasher::Create(DigestAlgorithm::kXxh3_128);
    for (const LandingRun& r : *runs) {
      CopyAndHash(r.dst, std::span<const std::byte>(src + r.hf_offset, static_cast<size_t>(r.bytes)), *hasher,
                  /*hash_destination=*/true);
    }
    for (auto [i, k] : table_.PiecesOf(hf.name)) {
      if (table_.params()[i].pieces[k].primary) continue;
      const PieceRuns r = table_.Runs(i, k);
      for (int64_t o = 0; o < r.count; ++o) {
        std::memcpy(param_data_[i] + r.dst_offset + o * r.dst_stride, src + r.hf_offset + o * r.hf_stride,
                    r.run_bytes);
      }
    }
    landed_[hf_index] = hasher->FinishHex();
    return Status::Ok();
  }
  for (auto [i, k] : table_.PiecesOf(hf.name)) {
    const PieceRuns r = table_.Runs(i, k);
    std::byte* dst = param_data_[i];
    for (int64_t o = 0; o < r.count; ++o) {
      std::memcpy(dst + r.dst_offset + o * r.dst_stride, src + r.hf_offset + o * r.hf_stride,
                  r.run_bytes);
    }
  }
  return Status::Ok();
}

void WorkerStore::BeginLandingDigests(bool on) {
  hash_landings_ = on && device_.is_cpu();
  landed_.assign(hash_landings_ ? table_.hf_tensors().size() : 0, std::string());
}

std::optional<std::string> WorkerStore::LandedDigest(std::string_view hf_name) const {
  const int i = table_.FindHf(hf_name);
  if (i < 0 || static_cast<size_t>(i) >= landed_.size() || landed_[i].empty()) return std::nullopt;
  return landed_[i];
}

std::optional<std::span<const std::byte>> WorkerStore::HeldRun(std::string_view hf_name, int64_t begin,
                                                               int64_t end) const {
  const int i = table_.FindHf(hf_name);
  if (i < 0 || begin < 0 || end < begin || end > static_cast<int64_t>(table_.hf_tensors()[i].nbytes())) {
    return std::nullopt;
  }
  // Runs tile the tensor in HF order; extend through runs that continue in memory too.
  const std::byte* start = nullptr;
  int64_t reach = 0;  // the HF offset up to which [begin, reach) lies contiguously from start
  for (const LandingRun& r : LandingRuns(i)) {
    const int64_t r_end = r.hf_offset + r.bytes;
    if (r_end <= begin) continue;
    if (start == nullptr) {
      start = r.dst + (begin - r.hf_offset);
      reach = r_end;
    } else if (r.hf_offset == reach && r.dst == start + (reach - begin)) {
      reach = r_end;
    } else {
      break;
    }
    if (reach >= end) return std::span<const std::byte>(start, static_cast<size_t>(end - begin));
  }
  return std::nullopt;
}

const std::vector<WorkerStore::LandingRun>& WorkerStore::LandingRuns(int hf_index) const {
  std::optional<std::vector<LandingRun>>& cached = landing_runs_[hf_index];
  if (cached) return *cached;
  const TensorMeta& hf = table_.hf_tensors()[hf_index];
  std::vector<LandingRun> runs;
  for (auto [i, k] : table_.PiecesOf(hf.name)) {
    if (!table_.params()[i].pieces[k].primary) continue;
    const PieceRuns r = table_.Runs(i, k);
    if (r.count > 1 && r.dst_stride == r.run_bytes && r.hf_stride == r.run_bytes) {
      runs.push_back({r.hf_offset, param_data_[i] + r.dst_offset, r.run_bytes * r.count});
      continue;
    }
    for (int64_t o = 0; o < r.count; ++o) {
      runs.push_back({r.hf_offset + o * r.hf_stride, param_data_[i] + r.dst_offset + o * r.dst_stride, r.run_bytes});
    }
  }
  std::ranges::sort(runs, {}, &LandingRun::hf_offset);
  int64_t next = 0;
  for (const LandingRun& r : runs) {
    if (r.hf_offset != next) break;
    next += r.bytes;
  }
  if (next != static_cast<int64_t>(hf.nbytes())) runs.clear();  // not held whole: verified at finish
  cached = std::move(runs);
  return *cached;
}

Status WorkerStore::LoadPiece(int param, int piece, std::span<const std::byte> packed, const Device& where) {
  if (param < 0 || static_cast<size_t>(param) >= table_.params().size() || piece < 0 ||
      static_cast<size_t>(piece) >= table_.params()[param].pieces.size()) {
    return InvalidArgument(fmt::format("worker tp{}/{}: no piece {} of parameter {}", tp_rank(), tp_size(), piece,
                                       param));
  }
  const PieceRuns r = table_.Runs(param, piece);
  const std::string& name = table_.params()[param].meta.name;
  if (static_cast<int64_t>(packed.size()) != r.count * r.run_bytes) {
    return InvalidArgument(fmt::format("piece {} of {} is {} bytes, {} arrived", piece, name, r.count * r.run_bytes,
                                       packed.size()));
  }
  WSYNC_RETURN_IF_ERROR(CheckResident(name));
  if (!(where.is_cpu() || where == device_)) {
    return InvalidArgument(fmt::format("piece {} of {} arrived on {}; the shards are on {}", piece, name,
                                       where.ToString(), device_.ToString()));
  }
  if (drafter_tracker_) drafter_tracker_->MarkPiece(param, piece);
  if (!landed_.empty()) {
    // Bytes written here are not those its landing digest covers.
    for (const ShardPiece& p : table_.params()[param].pieces) {
      if (int h = table_.FindHf(p.hf_name); h >= 0) landed_[h].clear();
    }
  }
  std::byte* dst = param_data_[param];
  if (!device_.is_cpu()) {
    WSYNC_ASSIGN_OR_RETURN(DeviceRuntime * rt, CudaRuntimeFor(device_));
    pending_device_copies_ = true;
    return rt->Copy2D(dst + r.dst_offset, r.dst_stride, packed.data(), r.run_bytes, r.run_bytes, r.count);
  }
  for (int64_t o = 0; o < r.count; ++o) {
    std::memcpy(dst + r.dst_offset + o * r.dst_stride, packed.data() + o * r.run_bytes, r.run_bytes);
  }
  if (!fault_corrupt_landing_.empty() && table_.params()[param].pieces[piece].hf_name == fault_corrupt_landing_ &&
      r.count > 0 && r.run_bytes > 0) {
    dst[r.dst_offset] ^= std::byte{1};
  }
  if (group_landing_ && table_.params()[param].pieces[piece].primary) {
    group_landing_->LandedPiece(table_.FindHf(table_.params()[param].pieces[piece].hf_name));
  }
  return Status::Ok();
}

Status WorkerStore::ChunkLanded() {
  if (!pending_device_copies_) return Status::Ok();
  pending_device_copies_ = false;
  WSYNC_ASSIGN_OR_RETURN(DeviceRuntime * rt, CudaRuntimeFor(device_));
  return rt->Synchronize().WithContext(fmt::format("landing slices in the shards on {}", device_.ToString()));
}

void WorkerStore::MarkDrafter(std::string_view hf_name) {
  for (const std::string& prefix : drafter_prefixes_) {
    if (hf_name.starts_with(prefix)) return drafter_tracker_->MarkHf(hf_name);
  }
}

Status WorkerStore::CorruptDeviceLanding(std::string_view hf_name) {
  std::span<const std::pair<int, int>> pieces = table_.PiecesOf(hf_name);
  if (pieces.empty() || device_.is_cpu()) return Status::Ok();
  // The first landed byte of its first piece, one bit flipped on the device.
  WSYNC_ASSIGN_OR_RETURN(DeviceRuntime * rt, CudaRuntimeFor(device_));
  auto [i, k] = pieces.front();
  std::byte* at = param_data_[i] + table_.Runs(i, k).dst_offset;
  std::byte b{};
  WSYNC_RETURN_IF_ERROR(rt->Copy2D(&b, 1, at, 1, 1, 1));
  WSYNC_RETURN_IF_ERROR(rt->Synchronize());
  b ^= std::byte{1};
  WSYNC_RETURN_IF_ERROR(rt->Copy2D(at, 1, &b, 1, 1, 1));
  return rt->Synchronize();
}

void WorkerStore::PlannedCopiesRan(std::span<const TensorMeta> tensors) {
  for (const TensorMeta& m : tensors) {
    if (!fault_corrupt_landing_.empty() && m.name == fault_corrupt_landing_) {
      if (Status s = CorruptDeviceLanding(m.name); !s.ok()) WSYNC_LOG_WARN("fault injection: {}", s.ToString());
    }
    if (IsDropped(m.name)) continue;
    if (drafter_tracker_) MarkDrafter(m.name);
    NoteGroupLanded(m.name);
  }
}

Status WorkerStore::PlanLoad(const TensorRef& hf, std::vector<ByteCopy>* out) const {
  if (IsDropped(hf.name)) return Status::Ok();
  WSYNC_RETURN_IF_ERROR(CheckLoad(hf));
  const std::byte* src = hf.bytes.data();
  for (auto [i, k] : table_.PiecesOf(hf.name)) {
    const PieceRuns r = table_.Runs(i, k);
    std::byte* dst = param_data_[i];
    if (r.count > 1 && r.dst_stride == r.run_bytes && r.hf_stride == r.run_bytes) {  // one block
      out->push_back({src + r.hf_offset, dst + r.dst_offset, static_cast<size_t>(r.run_bytes * r.count)});
      continue;
    }
    for (int64_t o = 0; o < r.count; ++o) {
      out->push_back({src + r.hf_offset + o * r.hf_stride, dst + r.dst_offset + o * r.dst_stride,
                      static_cast<size_t>(r.run_bytes)});
    }
  }
  return Status::Ok();
}

Status CheckTpGroup(std::span<const WorkerStore* const> group, bool devices) {
  if (group.empty()) return InvalidArgument("empty TP group");
  for (size_t i = 0; i < group.size(); ++i) {
    const WorkerStore* s = group[i];
    if (s == nullptr) return InvalidArgument(fmt::format("TP group has no store for tp rank {}", i));
    if (s->tp_rank() != static_cast<int>(i) || s->tp_size() != static_cast<int>(group.size())) {
      return InvalidArgument(fmt::format(
          "TP group entry {} of {} is a store of tp rank {} of tp_size {}", i, group.size(),
          s->tp_rank(), s->tp_size()));
    }
    if (!(s->config() == group[0]->config())) {
      return InvalidArgument(fmt::format("TP group mixes models: rank 0 is {}, rank {} is {}",
                                         group[0]->config().name, i, s->config().name));
    }
    if (!devices && !s->device().is_cpu()) {
      return FailedPrecondition(fmt::format(
          "TP group entry {} is a store on {}: read it back through CopyToHost() first", i, s->device().ToString()));
    }
  }
  return Status::Ok();
}

Status ReadBackHf(std::span<const WorkerStore* const> group, std::string_view hf_name,
                  std::span<std::byte> out) {
  WSYNC_ASSIGN_OR_RETURN(const TensorMeta* hf, FindHfInGroup(group, hf_name));
  if (out.size() != hf->nbytes()) {
    return InvalidArgument(fmt::format("read-back of {} needs {} bytes, buffer has {}", hf_name,
                                       hf->nbytes(), out.size()));
  }
  return ReadRows(PrimaryPieces(group, hf_name), *hf, 0, hf->shape[0], out.data());
}

namespace {

// HfDigest with the caller's scratch buffer for row blocks (grown as needed, kept).
Result<std::string> HfDigestWith(std::span<const WorkerStore* const> group, std::string_view hf_name,
                                 DigestAlgorithm algorithm, size_t block_bytes, std::vector<std::byte>* scratch);

}  // namespace

Result<std::string> HfDigest(std::span<const WorkerStore* const> group, std::string_view hf_name,
                             DigestAlgorithm algorithm, size_t block_bytes) {
  std::vector<std::byte> scratch;
  return HfDigestWith(group, hf_name, algorithm, block_bytes, &scratch);
}

namespace {

// One contiguous run of a host piece's bytes, at `hf_offset` in the HF tensor.
struct HostSpan {
  int64_t hf_offset;
  const std::byte* data;
  int64_t bytes;
};

// Feeds `hasher` HF rows [row_begin, row_end) straight from host pieces, in HF order:
// the runs that fall in those rows, sorted by HF offset (`spans` is scratch). A
// dim-1 split interleaves its pieces' runs row by row; the hash streams across them
// without assembling the rows first.
Status HashHostRows(const std::vector<SourcePiece>& pieces, const TensorMeta& hf, int64_t row_begin,
                    int64_t row_end, std::vector<HostSpan>& spans, Hasher& hasher) {
  const int64_t row_bytes = static_cast<int64_t>(hf.nbytes()) / hf.shape[0];
  const int64_t lo_bound = row_begin * row_bytes, hi_bound = row_end * row_bytes;
  spans.clear();
  for (const SourcePiece& sp : pieces) {
    const ShardPiece& p = sp.store->table().params()[sp.param].pieces[sp.piece];
    const PieceRuns r = sp.store->table().Runs(sp.param, sp.piece);
    const std::byte* src = sp.store->param_data(sp.param) + r.dst_offset;
    int64_t o_begin = 0, o_end = r.count;
    if (p.dim > 0) {  // each run lies inside one dim-0 row
      const int64_t per_row = r.count / hf.shape[0];
      o_begin = row_begin * per_row;
      o_end = row_end * per_row;
    }
    for (int64_t o = o_begin; o < o_end; ++o) {
      const int64_t hs = r.hf_offset + o * r.hf_stride, he = hs + r.run_bytes;
      const int64_t lo = std::max(hs, lo_bound), hi = std::min(he, hi_bound);
      if (lo < hi) spans.push_back({lo, src + o * r.dst_stride + (lo - hs), hi - lo});
    }
  }
  std::ranges::sort(spans, {}, &HostSpan::hf_offset);
  int64_t next = lo_bound;
  for (const HostSpan& s : spans) {
    if (s.hf_offset != next) break;
    hasher.Update({s.data, static_cast<size_t>(s.bytes)});
    next += s.bytes;
  }
  if (next != hi_bound) return Internal(fmt::format("primary pieces of {} do not tile its rows", hf.name));
  return Status::Ok();
}

// Feeds `hasher` rows [row_begin, row_end) of `hf` in HF order, read from the group's
// primary `pieces` in blocks of at most `block_bytes` (at least one row): in place from
// host stores, through `scratch` from device ones.
Status HashRows(const std::vector<SourcePiece>& pieces, const TensorMeta& hf, int64_t row_begin, int64_t row_end,
                size_t block_bytes, std::vector<std::byte>* scratch, Hasher& hasher) {
  if (row_end <= row_begin) return Status::Ok();
  const int64_t row_bytes = static_cast<int64_t>(hf.nbytes()) / hf.shape[0];
  const int64_t block = std::clamp<int64_t>(static_cast<int64_t>(block_bytes) / std::max<int64_t>(row_bytes, 1), 1,
                                            row_end - row_begin);
  const bool on_host = std::ranges::all_of(pieces, [](const SourcePiece& sp) { return sp.store->device().is_cpu(); });
  std::vector<HostSpan> spans;
  if (!on_host && scratch->size() < static_cast<size_t>(block * row_bytes)) scratch->resize(block * row_bytes);
  for (int64_t r0 = row_begin; r0 < row_end; r0 += block) {
    const int64_t r1 = std::min(row_end, r0 + block);
    if (on_host) {
      WSYNC_RETURN_IF_ERROR(HashHostRows(pieces, hf, r0, r1, spans, hasher));
      continue;
    }
    WSYNC_RETURN_IF_ERROR(ReadRows(pieces, hf, r0, r1, scratch->data()).WithContext(hf.name));
    hasher.Update({scratch->data(), static_cast<size_t>((r1 - r0) * row_bytes)});
  }
  return Status::Ok();
}

Result<std::string> HfDigestWith(std::span<const WorkerStore* const> group, std::string_view hf_name,
                                 DigestAlgorithm algorithm, size_t block_bytes, std::vector<std::byte>* scratch) {
  WSYNC_ASSIGN_OR_RETURN(const TensorMeta* hf, FindHfInGroup(group, hf_name, /*devices=*/true));
  const std::vector<SourcePiece> pieces = PrimaryPieces(group, hf_name);
  auto hasher = Hasher::Create(algorithm);
  WSYNC_RETURN_IF_ERROR(HashRows(pieces, *hf, 0, hf->shape[0], block_bytes, scratch, *hasher));
  return hasher->FinishHex();
}

}  // namespace

Result<std::string> HfRowsDigest(std::span<const WorkerStore* const> group, std::string_view hf_name,
                                 int64_t row_begin, int64_t row_end, DigestAlgorithm algorithm,
                                 std::vector<std::byte>* scratch, size_t block_bytes) {
  WSYNC_ASSIGN_OR_RETURN(const TensorMeta* hf, FindHfInGroup(group, hf_name, /*devices=*/true));
  const int64_t rows = hf->shape.empty() ? 0 : hf->shape[0];
  if (row_begin < 0 || row_begin >= row_end || row_end > rows) {
    return InvalidArgument(fmt::format("rows [{}, {}) of {}: outside its {} rows", row_begin, row_end, hf_name, rows));
  }
  auto hasher = Hasher::Create(algorithm);
  WSYNC_RETURN_IF_ERROR(
      HashRows(PrimaryPieces(group, hf_name), *hf, row_begin, row_end, block_bytes, scratch, *hasher));
  return hasher->FinishHex();
}

Result<std::map<std::string, std::string>> DeviceHeldDigests(
    std::span<const WorkerStore* const> tp_group, std::span<const TensorMeta> tensors,
    const std::map<std::string, std::vector<std::pair<int64_t, int64_t>>>& row_ranges) {
  struct PerDevice {
    std::vector<DeviceRuntime::Span> spans;
    std::vector<std::pair<size_t, size_t>> owners;  // (tensor, range) of each span
  };
  std::map<int, PerDevice> devices;
  std::vector<std::vector<std::string>> hexes(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorMeta& m = tensors[i];
    const int64_t bytes = static_cast<int64_t>(m.nbytes());
    std::vector<std::pair<int64_t, int64_t>> spans{{0, bytes}};
    if (auto rows = row_ranges.find(m.name); rows != row_ranges.end()) {
      const int64_t dim0 = m.shape.empty() ? 0 : m.shape[0];
      if (dim0 <= 0) continue;
      const int64_t row_bytes = bytes / dim0;
      spans.clear();
      for (auto [b, e] : rows->second) spans.push_back({b * row_bytes, e * row_bytes});
    }
    std::vector<std::pair<const WorkerStore*, std::span<const std::byte>>> found;
    for (auto [b, e] : spans) {
      const size_t before = found.size();
      for (const WorkerStore* store : tp_group) {
        if (store->device().is_cpu()) continue;
        if (std::optional<std::span<const std::byte>> run = store->HeldRun(m.name, b, e)) {
          found.emplace_back(store, *run);
          break;
        }
      }
      if (found.size() == before) break;
    }
    if (found.size() != spans.size()) continue;  // read back at finish
    hexes[i].resize(found.size());
    for (size_t r = 0; r < found.size(); ++r) {
      PerDevice& d = devices[found[r].first->device().index];
      d.spans.push_back({found[r].second.data(), found[r].second.size()});
      d.owners.emplace_back(i, r);
    }
  }
  for (auto& [index, d] : devices) {
    const Device device{Device::Kind::kCuda, index};
    Result<std::vector<std::string>> got = DeviceXxh3Hex(device, d.spans);
    if (!got.ok()) {
      return got.status().WithContext(fmt::format("digesting {} landed tensor(s) on {}", d.spans.size(),
                                                  device.ToString()));
    }
    for (size_t k = 0; k < d.owners.size(); ++k) hexes[d.owners[k].first][d.owners[k].second] = std::move((*got)[k]);
  }
  std::map<std::string, std::string> digests;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!hexes[i].empty()) digests.emplace(tensors[i].name, fmt::format("{}", fmt::join(hexes[i], ",")));
  }
  return digests;
}

Result<std::string> HfRangesDigest(std::span<const WorkerStore* const> group, std::string_view hf_name,
                                   const std::vector<std::pair<int64_t, int64_t>>& ranges,
                                   DigestAlgorithm algorithm, std::vector<std::byte>* scratch) {
  std::string joined;
  for (const auto& [begin, end] : ranges) {
    WSYNC_ASSIGN_OR_RETURN(std::string hex, HfRowsDigest(group, hf_name, begin, end, algorithm, scratch));
    if (!joined.empty()) joined += ',';
    joined += hex;
  }
  return joined;
}

Result<std::map<std::string, std::string>> DigestEach(std::span<const TensorMeta> tensors, size_t threads,
                                                      const TensorDigestFn& digest) {
  // Largest first, pulled from a shared counter, so one big tensor does not trail.
  std::vector<size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), 0);
  std::ranges::stable_sort(order, std::greater<>{}, [&](size_t i) { return tensors[i].nbytes(); });
  std::vector<std::string> digests(tensors.size());
  std::atomic<size_t> next{0};
  std::mutex mu;
  Status first_error;  // guarded by mu
  threads = std::max<size_t>(1, std::min(threads, tensors.size()));
  ParallelFor(threads, threads, [&](size_t, size_t) {
    std::vector<std::byte> scratch;  // this thread's row blocks, reused across tensors
    for (size_t n; (n = next.fetch_add(1)) < order.size();) {
      const size_t i = order[n];
      Result<std::string> d = digest(tensors[i], &scratch);
      if (!d.ok()) {
        std::lock_guard<std::mutex> lock(mu);
        if (first_error.ok()) first_error = d.status();
        return;
      }
      digests[i] = std::move(d).value();
    }
  });
  if (!first_error.ok()) return first_error;
  std::map<std::string, std::string> out;
  for (size_t i = 0; i < tensors.size(); ++i) out.emplace(tensors[i].name, std::move(digests[i]));
  return out;
}

Result<std::map<std::string, std::string>> AllHfDigests(
    std::span<const WorkerStore* const> group, DigestAlgorithm algorithm, size_t threads) {
  WSYNC_RETURN_IF_ERROR(CheckTpGroup(group, /*devices=*/true));
  // Device stores are read back in blocks: each thread holds one at a time.
  const bool on_host = std::ranges::all_of(group, [](const WorkerStore* s) { return s->device().is_cpu(); });
  const size_t block_bytes = on_host ? size_t{64} << 20 : kDeviceReadBackBlockBytes;
  const std::vector<TensorMeta>& served = group[0]->table().served_hf_tensors();
  // xxh3-128 of what a device store holds in one run is taken on the device; only the
  // rest (TP-split tensors) is read back.
  std::map<std::string, std::string> on_device;
  if (!on_host && algorithm == DigestAlgorithm::kXxh3_128) {
    WSYNC_ASSIGN_OR_RETURN(on_device, DeviceHeldDigests(group, served, {}));
  }
  std::vector<TensorMeta> rest;
  for (const TensorMeta& m : served) {
    if (!on_device.contains(m.name)) rest.push_back(m);
  }
  WSYNC_ASSIGN_OR_RETURN(auto read, DigestEach(rest, threads, [&](const TensorMeta& m, std::vector<std::byte>* scratch) {
                           return HfDigestWith(group, m.name, algorithm, block_bytes, scratch);
                         }));
  on_device.merge(read);
  return on_device;
}

Status CheckReplicas(std::span<const WorkerStore* const> group) {
  WSYNC_RETURN_IF_ERROR(CheckTpGroup(group, /*devices=*/true));
  for (const WorkerStore* s : group) {
    const ShardingTable& t = s->table();
    for (size_t i = 0; i < t.params().size(); ++i) {
      for (size_t k = 0; k < t.params()[i].pieces.size(); ++k) {
        const ShardPiece& p = t.params()[i].pieces[k];
        if (p.primary) continue;
        // The primary copy covers exactly the same slice of the HF tensor.
        const WorkerStore* owner = nullptr;
        int oi = -1, ok = -1;
        for (const WorkerStore* o : group) {
          for (auto [j, l] : o->table().PiecesOf(p.hf_name)) {
            const ShardPiece& q = o->table().params()[j].pieces[l];
            if (q.primary && q.dim == p.dim && q.hf_start == p.hf_start && q.length == p.length) {
              owner = o, oi = j, ok = l;
            }
          }
        }
        const TensorMeta& hf = t.hf_tensors()[t.FindHf(p.hf_name)];
        if (owner == nullptr) {
          return Internal(fmt::format("replica of {} {} on tp rank {} has no primary copy",
                                      p.hf_name, SliceString(p, hf), s->tp_rank()));
        }
        const PieceRuns a = t.Runs(i, k), b = owner->table().Runs(oi, ok);
        // Both copies' runs, packed in host memory (a replicated slice: a norm, a KV head).
        std::vector<std::byte> ca(a.count * a.run_bytes), cb(b.count * b.run_bytes);
        WSYNC_RETURN_IF_ERROR(CopyOut(*s, ca.data(), a.run_bytes, s->param_data(i) + a.dst_offset, a.dst_stride,
                                      a.run_bytes, a.count));
        WSYNC_RETURN_IF_ERROR(CopyOut(*owner, cb.data(), b.run_bytes, owner->param_data(oi) + b.dst_offset,
                                      b.dst_stride, b.run_bytes, b.count));
        for (int64_t o = 0; o < a.count; ++o) {
          if (std::memcmp(ca.data() + o * a.run_bytes, cb.data() + o * b.run_bytes, a.run_bytes) != 0) {
            return DataLoss(fmt::format(
                "replica of {} {} on tp rank {} differs from the primary copy on tp rank {}",
                p.hf_name, SliceString(p, hf), s->tp_rank(), owner->tp_rank()));
          }
        }
      }
    }
  }
  return Status::Ok();
}

}  // namespace wsync
