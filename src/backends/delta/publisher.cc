#include "backends/delta/publisher.h"

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <string_view>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "backends/delta/base_digest.h"
#include "backends/delta/codec.h"
#include "backends/delta/fs.h"
#include "core/dtype_convert.h"
#include "core/log.h"
#include "core/parallel.h"
#include "core/stopwatch.h"
#include "format/safetensors.h"

namespace wsync::delta {
namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kSnapshotAlign = 64;

}  // namespace

// What Create() decides once: where each tensor's snapshot lives and in which dtype.
struct DeltaPublisher::Plan {
  struct Entry {
    TensorMeta disk;        // name, on-disk dtype and shape
    size_t offset = 0;      // in `snapshot`
    bool skip = false;      // absent from the base checkpoint
  };
  std::vector<TensorMeta> metadata;  // the source's
  std::vector<Entry> entries;        // parallel to metadata
  HostBuffer snapshot;
  size_t largest = 0;                // bytes of the largest on-disk tensor
  std::unique_ptr<TaskPool> pool;
  std::vector<std::unique_ptr<DeltaCodec>> codecs;  // one per pool thread, +1 for rollback

  // Reusable staging buffers, each `largest` bytes, handed out by index.
  std::vector<HostBuffer> staging;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<size_t> free_staging;  // GUARDED_BY(mu)

  std::span<std::byte> Snap(size_t i) { return {snapshot.data() + entries[i].offset, entries[i].disk.nbytes()}; }
  size_t AcquireStaging() {
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return !free_staging.empty(); });
    size_t s = free_staging.back();
    free_staging.pop_back();
    return s;
  }
  void ReleaseStaging(size_t s) {
    {
      std::lock_guard lock(mu);
      free_staging.push_back(s);
    }
    cv.notify_one();
  }
};

// One Publish(): every tensor's outcome, filled by the pool threads (slot i by one task).
struct DeltaPublisher::Pass {
  struct Slot {
    bool submitted = false;
    Status status;
    EncodedDelta enc;
    double cpu_seconds = 0;
  };
  explicit Pass(size_t n) : slots(n) {}
  std::vector<Slot> slots;
};

DeltaPublisher::DeltaPublisher(DeltaPublisherOptions options) : options_(std::move(options)) {}
DeltaPublisher::~DeltaPublisher() = default;

Result<std::unique_ptr<DeltaPublisher>> DeltaPublisher::Create(DeltaPublisherOptions options,
                                                               const std::vector<TensorMeta>& metadata) {
  if (options.sync_dir.empty()) return InvalidArgument("delta: no sync directory given (option sync_dir)");
  if (options.max_file_bytes == 0) return InvalidArgument("delta: the largest payload file (option max_file_gb) must be positive");
  std::error_code ec;
  std::filesystem::create_directories(options.sync_dir, ec);
  if (ec) return Internal(fmt::format("creating sync directory {}: {}", options.sync_dir, ec.message()));
  std::unique_ptr<DeltaPublisher> p(new DeltaPublisher(std::move(options)));
  const DeltaPublisherOptions& o = p->options_;
  auto plan = std::make_unique<Plan>();
  plan->metadata = metadata;
  std::optional<CheckpointDir> base;
  if (!o.base_checkpoint.empty()) {
    WSYNC_ASSIGN_OR_RETURN(CheckpointDir b, CheckpointDir::Open(o.base_checkpoint));
    base = std::move(b);
  }
  size_t total = 0;
  std::vector<std::string> skipped;
  for (const TensorMeta& m : metadata) {
    Plan::Entry e;
    e.disk = m;
    if (base) {
      Result<TensorRef> ref = base->Ref(m.name);
      if (!ref.ok()) {
        e.skip = true;
        skipped.push_back(m.name);
      } else {
        e.disk.dtype = ref->dtype;
        e.disk.shape.assign(ref->shape.begin(), ref->shape.end());
        if (e.disk.shape != m.shape) {
          return InvalidArgument(fmt::format("shape of {} is {} in base checkpoint {}, the source says {}", m.name,
                                             ShapeString(e.disk.shape), o.base_checkpoint, ShapeString(m.shape)));
        }
        if (!CanConvert(m.dtype, e.disk.dtype)) {
          return InvalidArgument(fmt::format("{} is {} in the source but {} in base checkpoint {}: no cast exists",
                                             m.name, TorchName(m.dtype), TorchName(e.disk.dtype), o.base_checkpoint));
        }
      }
    }
    e.offset = total;
    if (!e.skip) {
      total += (e.disk.nbytes() + kSnapshotAlign - 1) / kSnapshotAlign * kSnapshotAlign;
      plan->largest = std::max(plan->largest, e.disk.nbytes());
    }
    plan->entries.push_back(std::move(e));
  }
  if (!skipped.empty()) {
    WSYNC_LOG_WARN("delta: {} tensor(s) absent from base checkpoint {} are not published: {}{}", skipped.size(),
                   o.base_checkpoint, fmt::join(skipped.begin(), skipped.begin() + std::min<size_t>(5, skipped.size()), ", "),
                   skipped.size() > 5 ? ", ..." : "");
  }
  WSYNC_ASSIGN_OR_RETURN(plan->snapshot, HostBuffer::Allocate(std::max<size_t>(total, 1)));
  size_t threads = o.threads ? o.threads : DefaultThreads();
  plan->pool = std::make_unique<TaskPool>(threads);
  for (size_t i = 0; i <= threads; ++i) {
    WSYNC_ASSIGN_OR_RETURN(auto codec, DeltaCodec::Create(o.zstd_level));
    plan->codecs.push_back(std::move(codec));
  }
  size_t nstaging = o.staging_buffers ? o.staging_buffers : threads + 1;
  for (size_t s = 0; s < nstaging; ++s) {
    WSYNC_ASSIGN_OR_RETURN(HostBuffer b, HostBuffer::Allocate(std::max<size_t>(plan->largest, 1)));
    plan->staging.push_back(std::move(b));
    plan->free_staging.push_back(s);
  }
  if (base) {
    // The snapshot starts as the base's bytes, copied block by block as they are hashed
    // for the base's digest, on every core.
    std::map<std::string_view, size_t> entry_of;
    for (size_t i = 0; i < plan->entries.size(); ++i) {
      if (!plan->entries[i].skip) entry_of.emplace(plan->entries[i].disk.name, i);
    }
    std::vector<std::optional<size_t>> target(base->tensors().size());
    for (size_t j = 0; j < target.size(); ++j) {
      if (auto it = entry_of.find(base->tensors()[j].name); it != entry_of.end()) target[j] = it->second;
    }
    Plan* pl = plan.get();
    TensorDigests digests = DigestCheckpoint(*base, threads, [pl, &target](size_t j, size_t off, std::span<const std::byte> block) {
      if (target[j]) std::memcpy(pl->Snap(*target[j]).data() + off, block.data(), block.size());
    });
    p->base_digest_ = CombineDigests(digests);
    p->snapshot_ready_ = true;
  }
  p->plan_ = std::move(plan);
  return p;
}

Status DeltaPublisher::InitSnapshotFromFirstPass(WeightSource& source, PublishStats* stats) {
  WSYNC_ASSIGN_OR_RETURN(auto inner, source.Iterate());
  auto stream = CheckedStream(std::move(inner), plan_->metadata);
  TensorRef t;
  for (size_t i = 0;; ++i) {
    WSYNC_ASSIGN_OR_RETURN(bool more, stream->Next(&t));
    if (!more) break;
    std::memcpy(plan_->Snap(i).data(), t.bytes.data(), t.bytes.size());
    stats->tensors++;
    stats->model_bytes += t.bytes.size();
  }
  return Status::Ok();
}

Result<PublishStats> DeltaPublisher::Publish(WeightSource& source, std::map<std::string, std::string>* digests) {
  if (broken_) {
    return FailedPrecondition("delta: an earlier publish failed inside a tensor's encoding, so the snapshot "
                              "no longer matches any version; start a new chain (fresh sync directory)");
  }
  if (source.metadata() != plan_->metadata) {
    return InvalidArgument("delta: the source's metadata differs from the one the publisher was built for");
  }
  auto t0 = Clock::now();
  double cpu0 = ProcessCpuSeconds();
  PublishStats stats;
  stats.base_version = version_;
  stats.version = version_ + 1;
  stats.threads = plan_->pool->size();
  std::string dir = VersionDir(options_.sync_dir, stats.version);
  std::error_code ec;
  if (std::filesystem::exists(std::filesystem::path(dir) / kManifestName, ec)) {
    return FailedPrecondition(fmt::format("delta: {} is already published; a chain never rewrites a version "
                                          "(use a fresh sync directory)", dir));
  }
  std::filesystem::remove_all(dir, ec);  // leftovers of a publish that died before its manifest
  std::filesystem::create_directories(dir, ec);
  if (ec) return Internal(fmt::format("creating {}: {}", dir, ec.message()));

  DeltaManifest manifest;
  manifest.version = stats.version;
  manifest.base_version = stats.base_version;
  if (!snapshot_ready_) {
    // Version 0 is this first pass: the snapshot takes it and version 1 is its full
    // version (a zero patch and the digest of every tensor).
    auto ts = Clock::now();
    Status s = InitSnapshotFromFirstPass(source, &stats);
    stats.stage_seconds = SecondsSince(ts);
    Pass pass(plan_->entries.size());
    if (s.ok()) {
      EncodeFullVersion(pass, &stats);
      s = WritePayloads(pass, dir, &manifest, &stats);
    }
    if (s.ok() && digests != nullptr) SourceDigests(pass, digests);
    TensorDigests digests;
    for (const DeltaTensorRecord& r : manifest.tensors) digests.emplace(r.name, r.checksum);
    manifest.base_digest = CombineDigests(digests);
    if (s.ok()) s = WriteManifest(dir, manifest, &stats);
    if (!s.ok()) {
      std::filesystem::remove_all(dir, ec);
      return s.WithContext(fmt::format("publishing version {} to {}", stats.version, dir));
    }
    base_digest_ = manifest.base_digest;
    snapshot_ready_ = true;
  } else {
    Pass pass(plan_->entries.size());
    Status s;
    auto ts = Clock::now();
    {
      TaskGroup group(*plan_->pool);
      s = [&]() -> Status {
        WSYNC_ASSIGN_OR_RETURN(auto inner, source.Iterate());
        auto stream = CheckedStream(std::move(inner), plan_->metadata);
        SyncProgress progress{0, 0, 0, plan_->entries.size()};
        for (const Plan::Entry& e : plan_->entries) progress.bytes_total += e.skip ? 0 : e.disk.nbytes();
        TensorRef t;
        for (size_t i = 0;; ++i) {
          WSYNC_ASSIGN_OR_RETURN(bool more, stream->Next(&t));
          if (!more) return Status::Ok();
          const Plan::Entry& e = plan_->entries[i];
          if (e.skip) {
            stats.skipped_tensors++;
            continue;
          }
          std::span<const std::byte> next = t.bytes;
          std::optional<size_t> staged;
          if (t.dtype != e.disk.dtype || !options_.borrow_source_bytes) {
            staged = plan_->AcquireStaging();
            std::span<std::byte> buf = plan_->staging[*staged].span().first(e.disk.nbytes());
            Status c = Convert(t.bytes, t.dtype, buf, e.disk.dtype, e.disk.name);
            if (!c.ok()) {
              plan_->ReleaseStaging(*staged);
              return c;
            }
            next = buf;
          }
          pass.slots[i].submitted = true;
          // On fewer than kMinThreadsForParts threads there are no idle cores to gain, and
          // the parts' own hash pass and tables cost CPU time.
          const size_t part = options_.part_bytes;
          if (part > 0 && next.size() > 2 * part && plan_->pool->size() >= kMinThreadsForParts) {
            SubmitParts(group, pass, i, next, staged);
          } else {
            group.Submit([this, &pass, i, next, staged](size_t thread) {
              auto tt = Clock::now();
              Pass::Slot& slot = pass.slots[i];
              Result<EncodedDelta> r = plan_->codecs[thread]->Encode(next, plan_->Snap(i), DigestAlgorithm::kXxh3_128);
              if (r.ok()) {
                slot.enc = std::move(*r);
              } else {
                slot.status = r.status().WithContext(plan_->entries[i].disk.name);
              }
              if (staged) plan_->ReleaseStaging(*staged);
              slot.cpu_seconds = SecondsSince(tt);
            });
          }
          stats.tensors++;
          stats.model_bytes += e.disk.nbytes();
          progress.bytes_done += e.disk.nbytes();
          progress.chunks_done = i + 1;
          if (options_.progress) options_.progress(progress);
        }
      }();
    }  // waits for every submitted task
    stats.stage_seconds = SecondsSince(ts);
    for (const Pass::Slot& slot : pass.slots) {
      stats.encode_cpu_seconds += slot.cpu_seconds;
      if (s.ok() && !slot.status.ok()) s = slot.status;
    }
    if (s.ok()) s = WritePayloads(pass, dir, &manifest, &stats);
    if (s.ok()) s = WriteManifest(dir, manifest, &stats);
    if (s.ok() && digests != nullptr) SourceDigests(pass, digests);
    if (!s.ok()) {
      Rollback(pass);
      std::filesystem::remove_all(dir, ec);
      return s.WithContext(fmt::format("publishing version {} to {}", stats.version, dir));
    }
  }
  version_ = stats.version;
  stats.seconds = SecondsSince(t0);
  stats.cpu_seconds = ProcessCpuSeconds() - cpu0;
  return stats;
}

void DeltaPublisher::SourceDigests(const Pass& pass, std::map<std::string, std::string>* digests) const {
  for (size_t i = 0; i < plan_->entries.size() && i < pass.slots.size(); ++i) {
    const Plan::Entry& e = plan_->entries[i];
    if (e.skip || e.disk.dtype != plan_->metadata[i].dtype || pass.slots[i].enc.checksum.empty()) continue;
    digests->insert_or_assign(plan_->metadata[i].name, pass.slots[i].enc.checksum);
  }
}

bool DeltaPublisher::DigestsEveryTensor() const {
  for (size_t i = 0; i < plan_->entries.size(); ++i) {
    if (plan_->entries[i].skip || plan_->entries[i].disk.dtype != plan_->metadata[i].dtype) return false;
  }
  return true;
}

void DeltaPublisher::EncodeFullVersion(Pass& pass, PublishStats* stats) {
  Plan* pl = plan_.get();
  {
    TaskGroup group(*pl->pool);
    for (size_t i = 0; i < pl->entries.size(); ++i) {
      if (pl->entries[i].skip) continue;
      group.Submit([pl, &pass, i](size_t) {
        auto t0 = Clock::now();
        Pass::Slot& slot = pass.slots[i];
        slot.enc.checksum = HexDigest(DigestAlgorithm::kXxh3_128, pl->Snap(i));
        slot.enc.compressed = zstd::FrameWriter::ZeroFrame(pl->Snap(i).size());
        slot.enc.changed = true;  // a record, though its patch changes nothing
        slot.cpu_seconds = SecondsSince(t0);
      });
    }
  }
  for (const Pass::Slot& slot : pass.slots) stats->encode_cpu_seconds += slot.cpu_seconds;
  stats->full_version = true;
}

// One task per part of options_.part_bytes and one that hashes the whole tensor; the
// last of them to finish joins the parts into the slot's frame and frees the staging.
void DeltaPublisher::SubmitParts(TaskGroup& group, Pass& pass, size_t i, std::span<const std::byte> next,
                                 std::optional<size_t> staged) {
  struct Split {
    std::vector<EncodedPart> parts;
    std::vector<double> seconds;  // per task, the hash's last
    std::string checksum;
    std::atomic<size_t> left{0};
  };
  const size_t part = options_.part_bytes;
  const size_t count = (next.size() + part - 1) / part;
  auto split = std::make_shared<Split>();
  split->parts.resize(count);
  split->seconds.resize(count + 1);
  split->left = count + 1;
  std::span<std::byte> snap = plan_->Snap(i);
  // Whoever finishes last fills the slot; acq_rel orders every task's writes before it.
  auto finish = [this, &pass, i, next, staged, split] {
    if (split->left.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    Pass::Slot& slot = pass.slots[i];
    for (const EncodedPart& p : split->parts) slot.enc.changed_bytes += p.changed_bytes;
    slot.enc.compressed = DeltaCodec::JoinParts(next.size(), split->parts);
    slot.enc.changed = !slot.enc.compressed.empty();
    slot.enc.checksum = std::move(split->checksum);
    for (double t : split->seconds) slot.cpu_seconds += t;
    split->parts.clear();
    if (staged) plan_->ReleaseStaging(*staged);
  };
  group.Submit([next, split, finish](size_t) {  // reads only the new bytes, which no task writes
    auto tt = Clock::now();
    split->checksum = HexDigest(DigestAlgorithm::kXxh3_128, next);
    split->seconds.back() = SecondsSince(tt);
    finish();
  });
  for (size_t k = 0; k < count; ++k) {
    group.Submit([this, next, snap, part, count, k, split, finish](size_t thread) {
      auto tt = Clock::now();
      size_t off = k * part, len = std::min(part, next.size() - off);
      split->parts[k] = plan_->codecs[thread]->EncodePart(next.subspan(off, len), snap.subspan(off, len), k + 1 == count);
      split->seconds[k] = SecondsSince(tt);
      finish();
    });
  }
}

Status DeltaPublisher::WritePayloads(Pass& pass, const std::string& dir, DeltaManifest* manifest,
                                     PublishStats* stats) {
  auto tw = Clock::now();
  std::vector<TensorRef> file;
  std::vector<int64_t> sizes(pass.slots.size());  // the uint8 tensors' shapes
  uint64_t file_bytes = 0;
  int file_index = 0;
  auto flush = [&]() -> Status {
    if (file.empty()) return Status::Ok();
    std::string name = PayloadFileName(options_.rank, file_index);
    WSYNC_RETURN_IF_ERROR(WriteSafetensors((std::filesystem::path(dir) / name).string(), file));
    manifest->payload_files.push_back(name);
    file.clear();
    file_bytes = 0;
    ++file_index;
    return Status::Ok();
  };
  for (size_t i = 0; i < pass.slots.size(); ++i) {
    Pass::Slot& slot = pass.slots[i];
    stats->changed_bytes += slot.enc.changed_bytes;
    if (!slot.enc.changed) continue;
    const TensorMeta& disk = plan_->entries[i].disk;
    uint64_t n = slot.enc.compressed.size();
    if (!file.empty() && file_bytes + n > options_.max_file_bytes) WSYNC_RETURN_IF_ERROR(flush());
    sizes[i] = static_cast<int64_t>(n);
    file.push_back(TensorRef{disk.name, DType::kU8, std::span<const int64_t>(&sizes[i], 1),
                             std::as_bytes(std::span<const uint8_t>(slot.enc.compressed)), Device{}});
    file_bytes += n;
    DeltaTensorRecord r;
    r.name = disk.name;
    r.dtype = disk.dtype;
    r.shape = disk.shape;
    r.uncompressed_num_bytes = disk.nbytes();
    r.compressed_num_bytes = n;
    r.payload_file = PayloadFileName(options_.rank, file_index);
    r.payload_key = disk.name;
    r.checksum = slot.enc.checksum;
    manifest->total_uncompressed_num_bytes += r.uncompressed_num_bytes;
    manifest->total_compressed_num_bytes += n;
    manifest->tensors.push_back(std::move(r));
  }
  WSYNC_RETURN_IF_ERROR(flush());
  stats->changed_tensors = manifest->tensors.size();
  stats->uncompressed_bytes = manifest->total_uncompressed_num_bytes;
  stats->compressed_bytes = manifest->total_compressed_num_bytes;
  stats->payload_files = manifest->payload_files.size();
  stats->write_seconds += SecondsSince(tw);
  return Status::Ok();
}

Status DeltaPublisher::WriteManifest(const std::string& dir, const DeltaManifest& manifest,
                                     PublishStats* stats) {
  auto tw = Clock::now();
  Status s = WriteFileAtomic((std::filesystem::path(dir) / kManifestName).string(), manifest.ToJson());
  stats->write_seconds += SecondsSince(tw);
  return s;
}

void DeltaPublisher::Rollback(Pass& pass) {
  DeltaCodec& codec = *plan_->codecs.back();  // the pool is idle: its threads' codecs are free too
  for (size_t i = 0; i < pass.slots.size(); ++i) {
    Pass::Slot& slot = pass.slots[i];
    if (!slot.submitted) continue;
    if (!slot.status.ok()) {
      broken_ = true;  // the encode stopped part-way through this tensor's snapshot
      continue;
    }
    if (!slot.enc.changed) continue;
    Status s = codec.Apply(slot.enc.compressed, plan_->Snap(i), DigestAlgorithm::kXxh3_128, "",
                           plan_->entries[i].disk.name);
    if (!s.ok()) broken_ = true;
  }
}

}  // namespace wsync::delta
