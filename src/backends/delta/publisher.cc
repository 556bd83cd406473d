#include "backends/delta/publisher.h"

#include <chrono>
#include <condition_variable>
#include <cstdlib>
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
#include "backends/delta/state_file.h"
#include "core/dtype_convert.h"
#include "core/log.h"
#include "core/parallel.h"
#include "core/stopwatch.h"
#include "format/safetensors.h"

namespace wsync::delta {
namespace {

using Clock = std::chrono::steady_clock;

// The publisher reads, stages and encodes every tensor on the host.
Status OnHost(const TensorRef& t) {
  if (t.device.is_cpu()) return Status::Ok();
  return InvalidArgument(fmt::format("tensor {} is on {}; the delta backend publishes host tensors: give the "
                                     "source's tensors on the CPU", t.name, t.device.ToString()));
}

// Bytes of a state file region mapped at once by one encoding thread: the trainer's
// resident set holds at most a few of these per thread, not the tensor.
constexpr size_t kWindowBytes = size_t{4} << 20;

// Keeps a state file region mapped writable a window ahead of an encode and drops the
// pages the encode has passed (DeltaCodec's after_block); the rest at destruction.
class RegionWindow {
 public:
  RegionWindow(const TrainerStateFile& file, std::span<std::byte> region) : file_(file), region_(region) {
    Advance(0);
  }
  ~RegionWindow() { file_.Release(region_.subspan(released_)); }
  RegionWindow(const RegionWindow&) = delete;
  RegionWindow& operator=(const RegionWindow&) = delete;

  void Advance(size_t done) {
    if (done >= released_ + kWindowBytes) {
      const size_t to = done - done % TrainerStateFile::kStatePageBytes;  // the region starts on a page
      file_.Release(region_.subspan(released_, to - released_));
      released_ = to;
    }
    while (mapped_ < region_.size() && mapped_ < done + kWindowBytes) {
      const size_t n = std::min(kWindowBytes, region_.size() - mapped_);
      file_.PrepareForWrite(region_.subspan(mapped_, n));
      mapped_ += n;
    }
  }

 private:
  const TrainerStateFile& file_;
  std::span<std::byte> region_;
  size_t mapped_ = 0, released_ = 0;
};

// The xxh3-128 hex of a state file region, whole and per part of `part` bytes (none
// when part is 0), read a window at a time and dropped behind.
std::string DigestRegion(const TrainerStateFile& file, std::span<const std::byte> region, size_t part,
                         std::vector<std::string>* parts) {
  std::unique_ptr<Hasher> whole = Hasher::Create(DigestAlgorithm::kXxh3_128);
  std::unique_ptr<Hasher> piece;
  for (size_t off = 0; off < region.size();) {
    size_t n = std::min(kWindowBytes, region.size() - off);
    if (part > 0) {
      if (off % part == 0) piece = Hasher::Create(DigestAlgorithm::kXxh3_128);
      n = std::min(n, part - off % part);
    }
    std::span<const std::byte> bytes = region.subspan(off, n);
    whole->Update(bytes);
    if (piece) piece->Update(bytes);
    file.Release(bytes);
    off += n;
    if (piece && (off % part == 0 || off == region.size())) parts->push_back(piece->FinishHex());
  }
  return whole->FinishHex();
}

}  // namespace

std::string DefaultTrainerStateDir(const std::string& sync_dir) {
  constexpr size_t kDigestChars = 16;
  std::string name = std::filesystem::path(sync_dir).filename().string();
  if (name.empty()) name = std::filesystem::path(sync_dir).parent_path().filename().string();  // "dir/"
  for (char& c : name) {
    const bool keep = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
                      c == '_' || c == '.';
    if (!keep) c = '_';
  }
  const std::string digest =
      HexDigest(DigestAlgorithm::kSha256, std::as_bytes(std::span(sync_dir.data(), sync_dir.size()))).substr(0, kDigestChars);
  const char* tmp = std::getenv("TMPDIR");
  return (std::filesystem::path(tmp && *tmp ? tmp : "/tmp") / "wsync_delta_state" / (name + "_" + digest)).string();
}

// What Create() decides once: where each tensor's snapshot lives and in which dtype.
struct DeltaPublisher::Plan {
  struct Entry {
    TensorMeta disk;        // name, on-disk dtype and shape
    size_t state = 0;       // index in state->tensors()
    bool skip = false;      // absent from the base checkpoint
    size_t part = 0;        // encoded in parts of this many bytes; 0: whole
    // The xxh3-128 hex of the snapshot's bytes as this publisher last wrote them, one
    // per part (one for a whole tensor): what the next encode must read back.
    std::vector<std::string> digests;
  };
  std::vector<TensorMeta> metadata;  // the source's
  std::vector<Entry> entries;        // parallel to metadata
  std::unique_ptr<TrainerStateFile> state;
  std::string default_state_dir;     // DefaultTrainerStateDir when used: removed when empty
  size_t largest = 0;                // bytes of the largest on-disk tensor
  std::unique_ptr<TaskPool> pool;
  std::vector<std::unique_ptr<DeltaCodec>> codecs;  // one per pool thread, +1 for rollback

  // Reusable staging buffers, each `largest` bytes, handed out by index.
  std::vector<HostBuffer> staging;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<size_t> free_staging;  // GUARDED_BY(mu)

  std::span<std::byte> Snap(size_t i) { return state->Region(entries[i].state); }
  // DataLoss naming the state file, the tensor (and part) and both digests.
  Status Corrupt(size_t i, std::optional<size_t> part, const std::string& got, const std::string& want,
                 int64_t version) const {
    return DataLoss(fmt::format("trainer state file {}: {}{} does not hold the bytes of version {} that the "
                                "publisher wrote (xxh3-128 {}, {} expected); the file was changed outside the "
                                "publisher: start a new chain (a fresh sync directory)",
                                state->path(), entries[i].disk.name,
                                part ? fmt::format(" (part {})", *part) : std::string(), version, got, want));
  }
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
    std::vector<std::string> digests;  // of the new bytes, per segment (Plan::Entry::digests)
    double cpu_seconds = 0;
  };
  explicit Pass(size_t n) : slots(n) {}
  std::vector<Slot> slots;
};

DeltaPublisher::DeltaPublisher(DeltaPublisherOptions options) : options_(std::move(options)) {}
DeltaPublisher::~DeltaPublisher() {
  if (plan_ == nullptr) return;
  const std::string dir = plan_->default_state_dir;
  plan_.reset();  // removes the state file
  std::error_code ec;
  if (!dir.empty()) std::filesystem::remove(dir, ec);  // only when empty
}

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
    if (!e.skip) plan->largest = std::max(plan->largest, e.disk.nbytes());
    plan->entries.push_back(std::move(e));
  }
  if (!skipped.empty()) {
    WSYNC_LOG_WARN("delta: {} tensor(s) absent from base checkpoint {} are not published: {}{}", skipped.size(),
                   o.base_checkpoint, fmt::join(skipped.begin(), skipped.begin() + std::min<size_t>(5, skipped.size()), ", "),
                   skipped.size() > 5 ? ", ..." : "");
  }
  size_t threads = o.threads ? o.threads : DefaultThreads();
  std::vector<TensorMeta> held;
  for (Plan::Entry& e : plan->entries) {
    if (e.skip) continue;
    e.state = held.size();
    held.push_back(e.disk);
    // On fewer than kMinThreadsForParts threads there are no idle cores to gain, and the
    // parts' own hash pass and tables cost CPU time.
    if (o.part_bytes > 0 && e.disk.nbytes() > 2 * o.part_bytes && threads >= kMinThreadsForParts) e.part = o.part_bytes;
  }
  uint64_t state_bytes = 0;
  std::vector<StateTensor> layout = TrainerStateFile::Layout(held, &state_bytes);
  const std::string state_dir = o.state_dir.empty() ? DefaultTrainerStateDir(o.sync_dir) : o.state_dir;
  std::filesystem::create_directories(state_dir, ec);
  if (ec) return Internal(fmt::format("creating trainer state directory {}: {}", state_dir, ec.message()));
  if (o.state_dir.empty()) plan->default_state_dir = state_dir;
  WSYNC_ASSIGN_OR_RETURN(plan->state,
                         TrainerStateFile::Create(
                             (std::filesystem::path(state_dir) / fmt::format(".wsync-trainer-rank{}.state", o.rank)).string(),
                             std::move(layout), state_bytes, 0));
  plan->pool = std::make_unique<TaskPool>(threads);
  for (size_t i = 0; i <= threads; ++i) {
    WSYNC_ASSIGN_OR_RETURN(auto codec, DeltaCodec::Create());
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
    // Tensors encoded in parts need a digest per part, fed block by block (one thread
    // visits one tensor's blocks in order).
    std::vector<std::vector<std::unique_ptr<Hasher>>> part_hashers(plan->entries.size());
    for (size_t i = 0; i < plan->entries.size(); ++i) {
      const Plan::Entry& e = plan->entries[i];
      if (e.skip || e.part == 0) continue;
      for (size_t k = 0; k * e.part < e.disk.nbytes(); ++k) part_hashers[i].push_back(Hasher::Create(DigestAlgorithm::kXxh3_128));
    }
    Plan* pl = plan.get();
    std::mutex write_mu;
    Status write_status;
    TensorDigests digests = DigestCheckpoint(*base, threads, [&](size_t j, size_t off, std::span<const std::byte> block) {
      if (target[j]) {
        const size_t i = *target[j];
        Status w = pl->state->Write(pl->entries[i].state, off, block);
        if (!w.ok()) {
          std::lock_guard lock(write_mu);
          if (write_status.ok()) write_status = w;
        }
        for (size_t at = 0, part = pl->entries[i].part; part > 0 && at < block.size();) {
          size_t k = (off + at) / part, n = std::min(block.size() - at, (k + 1) * part - (off + at));
          part_hashers[i][k]->Update(block.subspan(at, n));
          at += n;
        }
      }
      // CheckpointDir maps its files read-only and shared: dropping the entries leaves the
      // base in the page cache and out of this process.
      ReleaseFilePages(block);
    });
    WSYNC_RETURN_IF_ERROR(write_status.WithContext(fmt::format("copying base checkpoint {}", o.base_checkpoint)));
    for (size_t i = 0; i < plan->entries.size(); ++i) {
      Plan::Entry& e = plan->entries[i];
      if (e.skip) continue;
      if (e.part == 0) {
        e.digests = {digests.at(e.disk.name)};
      } else {
        for (auto& h : part_hashers[i]) e.digests.push_back(h->FinishHex());
      }
    }
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
    WSYNC_RETURN_IF_ERROR(OnHost(t));
    WSYNC_RETURN_IF_ERROR(plan_->state->Write(plan_->entries[i].state, 0, t.bytes));
    stats->tensors++;
    stats->model_bytes += t.bytes.size();
  }
  return Status::Ok();
}

Result<PublishStats> DeltaPublisher::Publish(WeightSource& source, std::map<std::string, std::string>* digests) {
  if (!broken_.ok()) {
    return FailedPrecondition(fmt::format("delta: the snapshot no longer matches any version ({}); start a new "
                                          "chain (fresh sync directory)", broken_.message()));
  }
  if (source.metadata() != plan_->metadata) {
    return InvalidArgument("delta: the source's metadata differs from the one the publisher was built for");
  }
  if (snapshot_ready_) {
    // Size and header before any byte of the mapping is read: a shorter file would fault.
    if (Status s = plan_->state->Check(version_); !s.ok()) {
      broken_ = s;
      return s;
    }
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
    for (size_t i = 0; i < pass.slots.size(); ++i) {
      if (!plan_->entries[i].skip) plan_->entries[i].digests = std::move(pass.slots[i].digests);
    }
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
        // The pool reads a borrowed tensor after the stream has moved on.
        const bool borrow = options_.borrow_source_bytes && source.StableRefs();
        WSYNC_LOG_DEBUG("delta: version {}: the source's tensors are {}", stats.version,
                        borrow ? "read in place" : "copied to staging first");
        TensorRef t;
        for (size_t i = 0;; ++i) {
          WSYNC_ASSIGN_OR_RETURN(bool more, stream->Next(&t));
          if (!more) return Status::Ok();
          WSYNC_RETURN_IF_ERROR(OnHost(t));
          const Plan::Entry& e = plan_->entries[i];
          if (e.skip) {
            stats.skipped_tensors++;
            continue;
          }
          std::span<const std::byte> next = t.bytes;
          std::optional<size_t> staged;
          if (t.dtype != e.disk.dtype || !borrow) {
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
          if (e.part > 0) {
            SubmitParts(group, pass, i, next, staged);
          } else {
            group.Submit([this, &pass, i, next, staged, version = stats.base_version](size_t thread) {
              auto tt = Clock::now();
              Pass::Slot& slot = pass.slots[i];
              Result<EncodedDelta> r = [&] {
                RegionWindow window(*plan_->state, plan_->Snap(i));
                EncodeOptions options;
                options.hash_previous = true;
                options.after_block = [&window](size_t done) { window.Advance(done); };
                return plan_->codecs[thread]->Encode(next, plan_->Snap(i), DigestAlgorithm::kXxh3_128, options);
              }();
              if (r.ok()) {
                slot.enc = std::move(*r);
                const std::string& want = plan_->entries[i].digests.front();
                if (slot.enc.previous_checksum != want) {
                  slot.status = plan_->Corrupt(i, std::nullopt, slot.enc.previous_checksum, want, version);
                }
                slot.digests = {slot.enc.checksum};
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
    for (size_t i = 0; i < pass.slots.size(); ++i) {
      if (pass.slots[i].submitted) plan_->entries[i].digests = std::move(pass.slots[i].digests);
    }
  }
  // The version is published; a state file whose header cannot follow fails the next pass.
  if (Status s = plan_->state->SetVersion(stats.version); !s.ok()) broken_ = s;
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
        std::span<std::byte> snap = pl->Snap(i);
        slot.enc.checksum = DigestRegion(*pl->state, snap, pl->entries[i].part, &slot.digests);
        if (pl->entries[i].part == 0) slot.digests = {slot.enc.checksum};
        slot.enc.compressed = zstd::FrameWriter::ZeroFrame(snap.size());
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
  const size_t part = plan_->entries[i].part;
  const size_t count = (next.size() + part - 1) / part;
  const int64_t version = version_;
  auto split = std::make_shared<Split>();
  split->parts.resize(count);
  split->seconds.resize(count + 1);
  split->left = count + 1;
  std::span<std::byte> snap = plan_->Snap(i);
  // Whoever finishes last fills the slot; acq_rel orders every task's writes before it.
  auto finish = [this, &pass, i, next, staged, split, version] {
    if (split->left.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    Pass::Slot& slot = pass.slots[i];
    const std::vector<std::string>& want = plan_->entries[i].digests;
    for (size_t k = 0; k < split->parts.size(); ++k) {
      if (split->parts[k].previous_checksum != want[k]) {
        slot.status = plan_->Corrupt(i, k, split->parts[k].previous_checksum, want[k], version);
        break;
      }
    }
    for (EncodedPart& p : split->parts) slot.digests.push_back(std::move(p.checksum));
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
      plan_->state->PrepareForWrite(snap.subspan(off, len));
      split->parts[k] = plan_->codecs[thread]->EncodePart(next.subspan(off, len), snap.subspan(off, len),
                                                          k + 1 == count, /*digests=*/true);
      plan_->state->Release(snap.subspan(off, len));
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
      // The encode stopped part-way through this tensor's snapshot, or found it changed.
      if (broken_.ok()) broken_ = slot.status;
      continue;
    }
    if (!slot.enc.changed) continue;
    std::span<std::byte> snap = plan_->Snap(i);
    plan_->state->PrepareForWrite(snap);
    Status s = codec.Apply(slot.enc.compressed, snap, DigestAlgorithm::kXxh3_128, "", plan_->entries[i].disk.name);
    plan_->state->Release(snap);
    if (!s.ok() && broken_.ok()) broken_ = s;
  }
}

const std::string& DeltaPublisher::state_path() const { return plan_->state->path(); }
uint64_t DeltaPublisher::state_bytes() const { return plan_->state->file_bytes(); }
uint64_t DeltaPublisher::staging_bytes() const {
  uint64_t n = 0;
  for (const HostBuffer& b : plan_->staging) n += b.size();
  return n;
}

}  // namespace wsync::delta
