#include "backends/delta/local_checkpoint.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "backends/delta/codec.h"
#include "backends/delta/confined_dir.h"
#include "backends/delta/fs.h"
#include "backends/delta/manifest.h"
#include "backends/delta/payload_file.h"
#include "core/checked_math.h"
#include "core/json_limits.h"
#include "core/log.h"
#include "core/parallel.h"
#include "core/stopwatch.h"
#include "format/safetensors.h"

namespace wsync::delta {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

// A non-negative integer that fits int64, or nullopt.
std::optional<int64_t> NonNegative(const json& v) {
  if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    return u <= static_cast<uint64_t>(INT64_MAX) ? std::optional<int64_t>(static_cast<int64_t>(u)) : std::nullopt;
  }
  if (v.is_number_integer() && v.get<int64_t>() >= 0) return v.get<int64_t>();
  return std::nullopt;
}

}  // namespace

struct LocalCheckpoint::SyncDir {
  ConfinedDir dir;
  std::string name;  // recorded in the state: the chain the local version belongs to
};

Result<CheckpointState> ParseCheckpointState(std::string_view text) {
  // The depth bound of all untrusted JSON (core/json_limits.h); any fault in the state
  // file is DataLoss.
  if (Status deep = CheckJsonDepth(text, "the state"); !deep.ok()) return DataLoss(deep.message());
  json j = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return DataLoss("the state is not a JSON object");
  CheckpointState s;
  if (auto it = j.find("version"); it != j.end()) {
    std::optional<int64_t> v = NonNegative(*it);
    if (!v) return DataLoss("the state's 'version' is not a non-negative integer");
    s.version = *v;
  }
  if (auto it = j.find("write_in_progress"); it != j.end()) {
    if (!it->is_boolean()) return DataLoss("the state's 'write_in_progress' is not a boolean");
    s.write_in_progress = it->get<bool>();
  }
  if (auto it = j.find("target_version"); it != j.end() && !it->is_null()) {
    std::optional<int64_t> v = NonNegative(*it);
    if (!v) return DataLoss("the state's 'target_version' is not a non-negative integer");
    s.target_version = *v;
  }
  for (auto [key, out] : {std::pair{"base_model_path", &s.base_model_path}, std::pair{"sync_dir", &s.sync_dir}}) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) continue;
    if (!it->is_string()) return DataLoss(fmt::format("the state's '{}' is not a string", key));
    *out = it->get<std::string>();
  }
  return s;
}

struct LocalCheckpoint::Applier {
  explicit Applier(size_t threads) : pool(threads) {}
  TaskPool pool;
  std::vector<std::unique_ptr<DeltaCodec>> codecs;  // one per pool thread
  // The weights/ files stay mapped between versions (each checked to still be the file
  // at its path before use): mapping and unmapping a checkpoint per version costs page
  // table setup and teardown for every page, and pages still dirty from the previous
  // version keep their writable entries.
  std::map<std::string, WritableMapping> maps;
};

LocalCheckpoint::LocalCheckpoint(LocalCheckpointOptions options) : options_(std::move(options)) {
  weights_dir_ = (fs::path(options_.root) / "weights").string();
  state_dir_ = (fs::path(options_.root) / ".skyrl_weight_sync").string();
  state_path_ = (fs::path(state_dir_) / "state.json").string();
  lock_path_ = (fs::path(state_dir_) / "writer.lock").string();
}

LocalCheckpoint::~LocalCheckpoint() = default;

Result<std::unique_ptr<LocalCheckpoint>> LocalCheckpoint::Open(LocalCheckpointOptions options, Deadline deadline) {
  if (options.base_checkpoint.empty()) return InvalidArgument("delta: no base checkpoint given (--base-checkpoint)");
  if (options.root.empty()) return InvalidArgument("delta: no local checkpoint directory given (--local-checkpoint-dir)");
  Result<CheckpointDir> base = CheckpointDir::Open(options.base_checkpoint);
  if (!base.ok()) return base.status().WithContext("delta: base checkpoint");
  if (!options.base_digests) options.base_digests = std::make_shared<BaseDigests>(options.base_checkpoint, options.threads);
  std::unique_ptr<LocalCheckpoint> c(new LocalCheckpoint(std::move(options)));
  for (const TensorMeta& t : base->tensors()) c->base_bytes_ += t.nbytes();
  std::error_code ec;
  fs::create_directories(c->state_dir_, ec);
  if (ec) return Internal(fmt::format("creating {}: {}", c->state_dir_, ec.message()));
  WSYNC_ASSIGN_OR_RETURN(FileLock lock, FileLock::Acquire(c->lock_path_, FileLock::Mode::kExclusive, deadline));
  if (!fs::exists(c->state_path_, ec)) {
    CheckpointState s;
    s.base_model_path = c->options_.base_checkpoint;
    WSYNC_RETURN_IF_ERROR(c->WriteState(s));
  }
  return c;
}

Result<CheckpointState> LocalCheckpoint::ReadState() const {
  WSYNC_ASSIGN_OR_RETURN(std::string text, ReadRegularFile(state_path_, kMaxStateBytes));
  Result<CheckpointState> s = ParseCheckpointState(text);
  if (!s.ok()) return s.status().WithContext(state_path_);
  return s;
}

Result<LocalCheckpoint::SyncDir> LocalCheckpoint::OpenSyncDir(const std::string& sync_dir) const {
  if (options_.sync_root.empty()) {
    WSYNC_ASSIGN_OR_RETURN(ConfinedDir dir, ConfinedDir::Open(sync_dir));
    return SyncDir{std::move(dir), sync_dir};
  }
  WSYNC_ASSIGN_OR_RETURN(std::string rel, PathBelow(options_.sync_root, sync_dir));
  Result<ConfinedDir> root = ConfinedDir::Open(options_.sync_root);
  if (!root.ok()) return root.status().WithContext("the sync root (--sync-root)");
  WSYNC_ASSIGN_OR_RETURN(ConfinedDir dir, root->OpenDir(rel));
  std::error_code ec;
  fs::path name = (fs::absolute(options_.sync_root, ec) / rel).lexically_normal();
  if (!name.has_filename() && name.has_relative_path()) name = name.parent_path();
  return SyncDir{std::move(dir), name.string()};
}

Status LocalCheckpoint::WriteState(const CheckpointState& s) const {
  json j{{"version", s.version},
         {"write_in_progress", s.write_in_progress},
         {"target_version", s.target_version ? json(*s.target_version) : json(nullptr)},
         {"base_model_path", s.base_model_path},
         {"sync_dir", s.sync_dir}};
  return WriteFileAtomic(state_path_, j.dump());
}

Status LocalCheckpoint::ValidateReady(int64_t target) const {
  WSYNC_ASSIGN_OR_RETURN(CheckpointState s, ReadState());
  if (s.write_in_progress) {
    return FailedPrecondition(fmt::format(
        "local checkpoint {} has an unfinished apply (toward version {}); call /fetch_weights before the reload",
        options_.root, s.target_version.value_or(-1)));
  }
  if (s.version != target) {
    return FailedPrecondition(fmt::format("local checkpoint {} is at version {}, the update wants version {}; "
                                          "call /fetch_weights with target_version {} first",
                                          options_.root, s.version, target, target));
  }
  return Status::Ok();
}

std::string LocalCheckpoint::CurrentDir() const {
  std::error_code ec;
  return fs::exists(weights_dir_, ec) ? weights_dir_ : options_.base_checkpoint;
}

Result<std::shared_ptr<void>> LocalCheckpoint::LockForReading(Deadline deadline) const {
  WSYNC_ASSIGN_OR_RETURN(FileLock lock, FileLock::Acquire(lock_path_, FileLock::Mode::kShared, deadline));
  return std::shared_ptr<void>(std::make_shared<FileLock>(std::move(lock)));
}

Status LocalCheckpoint::ResetFromBase(const std::string& sync_dir) {
  CheckpointState s;
  s.base_model_path = options_.base_checkpoint;
  s.sync_dir = sync_dir;
  s.write_in_progress = true;  // until weights/ is gone: a crash here resets again
  WSYNC_RETURN_IF_ERROR(WriteState(s));
  std::error_code ec;
  if (applier_) applier_->maps.clear();
  fs::remove_all(weights_dir_, ec);
  if (ec) return Internal(fmt::format("removing {}: {}", weights_dir_, ec.message()));
  s.write_in_progress = false;
  return WriteState(s);
}

Result<FetchReport> LocalCheckpoint::Fetch(int64_t target, const std::string& sync_dir, Deadline deadline) {
  if (target < 0) return InvalidArgument(fmt::format("target_version {} is negative", target));
  if (sync_dir.empty()) return InvalidArgument("fetch_weights needs a sync_dir");
  auto t0 = Clock::now();
  // Refused before anything is touched: a sync dir outside the root resets nothing.
  WSYNC_ASSIGN_OR_RETURN(SyncDir sync, OpenSyncDir(sync_dir));
  FetchReport report;
  report.to_version = target;
  WSYNC_ASSIGN_OR_RETURN(FileLock lock, FileLock::Acquire(lock_path_, FileLock::Mode::kExclusive, deadline));
  report.lock_wait_seconds = SecondsSince(t0);
  Result<CheckpointState> read = ReadState();
  if (!read.ok()) {
    report.reset_reason = fmt::format("state unreadable ({})", read.status().message());
  } else if (read->write_in_progress) {
    report.reset_reason = fmt::format("an apply toward version {} did not finish (crash or checksum failure)",
                                      read->target_version.value_or(-1));
  } else if (!read->sync_dir.empty() && read->sync_dir != sync.name) {
    report.reset_reason = fmt::format("a new chain: sync dir {} replaces {}", sync.name, read->sync_dir);
  } else if (!read->base_model_path.empty() && read->base_model_path != options_.base_checkpoint) {
    report.reset_reason = fmt::format("the base checkpoint changed from {}", read->base_model_path);
  }
  CheckpointState state = read.ok() ? *read : CheckpointState{};
  if (!report.reset_reason.empty()) {
    auto tr = Clock::now();
    WSYNC_LOG_INFO("delta: {}: resetting from base {}: {}", options_.root, options_.base_checkpoint, report.reset_reason);
    WSYNC_RETURN_IF_ERROR(ResetFromBase(sync.name));
    report.reset = true;
    report.reset_seconds += SecondsSince(tr);
    state = CheckpointState{0, false, std::nullopt, options_.base_checkpoint, sync.name};
  }
  report.from_version = state.version;
  if (state.version > target) {
    return FailedPrecondition(fmt::format("local checkpoint {} is at version {}, ahead of target_version {} in {}",
                                          options_.root, state.version, target, sync.name));
  }
  if (state.version == target) {
    if (state.sync_dir != sync.name) {
      state.sync_dir = sync.name;
      WSYNC_RETURN_IF_ERROR(WriteState(state));
    }
    report.seconds = SecondsSince(t0);
    return report;
  }
  state.write_in_progress = true;
  state.target_version = target;
  state.sync_dir = sync.name;
  state.base_model_path = options_.base_checkpoint;
  WSYNC_RETURN_IF_ERROR(WriteState(state));
  for (int64_t v = state.version + 1; v <= target; ++v) {
    Status s = ApplyVersion(v, sync, &report);
    if (!s.ok()) {
      if (s.code() != StatusCode::kDataLoss && !report.applied) {
        // Nothing of version v touched the files: they are still exactly version v - 1.
        CheckpointState clean{v - 1, false, std::nullopt, options_.base_checkpoint, sync.name};
        (void)WriteState(clean);
      }
      return s.WithContext(fmt::format("fetching version {} of {} into {}", v, sync.name, options_.root));
    }
    report.applied = false;  // per version: set again when the next one touches the files
    report.versions++;
    state.version = v;
  }
  report.applied = report.versions > 0;
  WSYNC_RETURN_IF_ERROR(WriteState(CheckpointState{target, false, std::nullopt, options_.base_checkpoint, sync.name}));
  report.seconds = SecondsSince(t0);
  return report;
}

Result<bool> LocalCheckpoint::CheckFullVersion(const DeltaManifest& m, const std::string& dir,
                                               const std::string& sync_dir) const {
  TensorDigests theirs;
  for (const DeltaTensorRecord& r : m.tensors) {
    if (r.checksum_algorithm != DigestAlgorithm::kXxh3_128) {
      return InvalidArgument(fmt::format("{}/manifest.json has a base_digest, but {}'s checksum is not xxh3-128", dir,
                                         r.name));
    }
    theirs.emplace(r.name, r.checksum);
  }
  if (CombineDigests(theirs) != m.base_digest) {
    return InvalidArgument(fmt::format("{}/manifest.json: base_digest {} is not the digest of its records' checksums "
                                       "(a full version's records name the base's bytes)", dir, m.base_digest));
  }
  WSYNC_ASSIGN_OR_RETURN(std::shared_ptr<const TensorDigests> base, options_.base_digests->Get());
  TensorDigests mine;  // the server's base over the records' tensors ("" where it lacks one)
  std::vector<std::string> differ;
  for (const DeltaTensorRecord& r : m.tensors) {
    auto it = base->find(r.name);
    mine.emplace(r.name, it == base->end() ? std::string() : it->second);
    if (it != base->end() && it->second != r.checksum) differ.push_back(r.name);
  }
  if (differ.empty()) return true;  // a tensor the base lacks is skipped, as in any version
  return FailedPrecondition(fmt::format(
      "the trainer's base is not this server's: version {} of {} is the full version of the trainer's first "
      "weights, which it took as version 0 (it was given no base checkpoint), base_digest {} over {} tensors; this "
      "server's base checkpoint {} has base_digest {} over the same tensors, and {} of them differ ({}{}); nothing "
      "was applied. To fix: {}", m.version, sync_dir, m.base_digest, m.tensors.size(), options_.base_checkpoint,
      CombineDigests(mine), differ.size(), fmt::join(differ.begin(), differ.begin() + std::min<size_t>(3, differ.size()), ", "),
      differ.size() > 3 ? ", ..." : "", BaseMismatchFix(options_.base_checkpoint)));
}

Status LocalCheckpoint::ApplyVersion(int64_t v, const SyncDir& sync, FetchReport* report) {
  auto tf = Clock::now();
  std::string dir = VersionDir(sync.name, v);
  Result<ConfinedDir> vdir = sync.dir.OpenDir(VersionDirName(v));
  if (!vdir.ok()) {
    if (vdir.status().code() == StatusCode::kNotFound) {
      return NotFound(fmt::format("version {} is not published in {} ({} does not exist)", v, sync.name, dir));
    }
    return vdir.status();
  }
  WSYNC_ASSIGN_OR_RETURN(DeltaManifest m, ReadManifest(*vdir));
  if (m.version != v) {
    return FailedPrecondition(fmt::format("{}/manifest.json says version {}, expected {}", dir, m.version, v));
  }
  if (m.base_version != v - 1) {
    return FailedPrecondition(fmt::format("{}/manifest.json has base_version {}, but the local checkpoint is at "
                                          "version {}: refusing a delta against another base", dir, m.base_version, v - 1));
  }
  if (!m.base_digest.empty() && m.base_version == 0) {
    WSYNC_ASSIGN_OR_RETURN(bool unchanged, CheckFullVersion(m, dir, sync.name));
    if (unchanged) {
      report->fetch_seconds += SecondsSince(tf);
      return Status::Ok();
    }
  }
  if (m.tensors.empty()) return Status::Ok();
  // What the version may make this server read: the compressed bytes its records claim
  // (at most twice the base's tensor bytes), per file plus its header.
  std::map<std::string, uint64_t, std::less<>> claimed;
  uint64_t total = 0;
  const uint64_t budget = 2 * base_bytes_ + (uint64_t{64} << 20);
  for (const DeltaTensorRecord& r : m.tensors) {
    std::optional<uint64_t> t = CheckedAdd(total, r.compressed_num_bytes);
    if (!t || *t > budget) {
      return InvalidArgument(fmt::format("{}/manifest.json claims more compressed bytes than a delta of this "
                                         "checkpoint ({} tensor bytes) can hold", dir, base_bytes_));
    }
    total = *t;
    claimed[r.payload_file] += r.compressed_num_bytes;
  }
  std::map<std::string, PayloadFile> payloads;
  for (const std::string& f : m.payload_files) {
    if (payloads.count(f) != 0 || claimed.count(f) == 0) continue;  // listed twice, or holds no record
    Result<RegularFile> file = vdir->OpenFile(f);
    if (!file.ok()) return file.status().WithContext(fmt::format("payload file of version {}", v));
    if (payload_buffers_.size() <= payloads.size()) payload_buffers_.emplace_back();
    Result<PayloadFile> payload = PayloadFile::Read(*file, 8 + kMaxSafetensorsHeaderBytes + claimed[f],
                                                    &payload_buffers_[payloads.size()]);
    if (!payload.ok()) return payload.status().WithContext(fmt::format("payload file of version {}", v));
    payloads.emplace(f, std::move(*payload));
  }
  // Payload bytes of every record (read into memory above: the "download" of a shared mount).
  std::vector<std::span<const uint8_t>> frames(m.tensors.size());
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    const DeltaTensorRecord& r = m.tensors[i];
    auto payload = payloads.find(r.payload_file);
    if (payload == payloads.end()) return Internal(fmt::format("{}: payload file {} was not read", r.name, r.payload_file));
    const PayloadFile& file = payload->second;
    Result<std::span<const std::byte>> bytes = file.Bytes(r.payload_key);
    if (!bytes.ok()) return DataLoss(fmt::format("{}: {}", r.name, bytes.status().message()));
    if (bytes->size() != r.compressed_num_bytes) {
      return DataLoss(fmt::format("{}: payload {}:{} has {} bytes, the manifest says {}", r.name, file.path(),
                                  r.payload_key, bytes->size(), r.compressed_num_bytes));
    }
    frames[i] = {reinterpret_cast<const uint8_t*>(bytes->data()), bytes->size()};
    report->payload_bytes += bytes->size();
  }
  report->fetch_seconds += SecondsSince(tf);

  std::error_code exists_ec;
  if (!fs::exists(weights_dir_, exists_ec)) {
    auto tr = Clock::now();
    std::string tmp = weights_dir_ + ".tmp";
    std::error_code ec;
    fs::remove_all(tmp, ec);
    bool reflinked = false;
    WSYNC_RETURN_IF_ERROR(CloneTree(options_.base_checkpoint, tmp, &reflinked));
    fs::rename(tmp, weights_dir_, ec);
    if (ec) return Internal(fmt::format("renaming {} to {}: {}", tmp, weights_dir_, ec.message()));
    report->reset_seconds += SecondsSince(tr);
    WSYNC_LOG_INFO("delta: copied base {} to {} ({})", options_.base_checkpoint, weights_dir_,
                   reflinked ? "reflinks" : "full copy");
  }
  // Where every tensor sits in the local files; each record is checked before any write.
  std::map<std::string, TensorLocation, std::less<>> where;
  std::error_code ec;
  for (auto it = fs::directory_iterator(weights_dir_, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
    if (it->path().extension() != ".safetensors") continue;
    WSYNC_ASSIGN_OR_RETURN(auto layout, ReadSafetensorsLayout(it->path().string()));
    for (TensorLocation& loc : layout) where.emplace(loc.meta.name, std::move(loc));
  }
  if (ec) return Internal(fmt::format("listing {}: {}", weights_dir_, ec.message()));
  struct Job {
    size_t record;
    WritableMapping* mapping;
    std::span<std::byte> region;
  };
  if (!applier_) {
    size_t threads = options_.threads ? options_.threads : DefaultThreads();
    auto applier = std::make_unique<Applier>(threads);
    for (size_t t = 0; t < threads; ++t) {
      WSYNC_ASSIGN_OR_RETURN(auto codec, DeltaCodec::Create());
      applier->codecs.push_back(std::move(codec));
    }
    applier_ = std::move(applier);
  }
  std::map<std::string, WritableMapping>& maps = applier_->maps;
  for (auto it = maps.begin(); it != maps.end();) {  // a file replaced since (another process reset)
    it = it->second.StillMaps(it->first) ? std::next(it) : maps.erase(it);
  }
  std::vector<Job> jobs;
  std::vector<std::string> skipped;
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    const DeltaTensorRecord& r = m.tensors[i];
    auto it = where.find(r.name);
    if (it == where.end()) {
      skipped.push_back(r.name);
      continue;
    }
    const TensorLocation& loc = it->second;
    if (loc.nbytes != r.uncompressed_num_bytes || loc.meta.dtype != r.dtype || loc.meta.shape != r.shape) {
      return FailedPrecondition(fmt::format("{}: the delta is {} {} ({} bytes), the local checkpoint has {} {} ({} bytes)",
                                            r.name, TorchName(r.dtype), ShapeString(r.shape), r.uncompressed_num_bytes,
                                            TorchName(loc.meta.dtype), ShapeString(loc.meta.shape), loc.nbytes));
    }
    auto mit = maps.find(loc.path);
    if (mit == maps.end()) {
      WSYNC_ASSIGN_OR_RETURN(WritableMapping wm, WritableMapping::Open(loc.path));
      mit = maps.emplace(loc.path, std::move(wm)).first;
    }
    jobs.push_back(Job{i, &mit->second, mit->second.bytes().subspan(loc.offset, loc.nbytes)});
  }
  if (!skipped.empty()) {
    WSYNC_LOG_WARN("delta: version {}: {} tensor(s) absent from the local checkpoint skipped: {}", v, skipped.size(),
                   fmt::join(skipped.begin(), skipped.begin() + std::min<size_t>(5, skipped.size()), ", "));
  }
  report->skipped += skipped.size();

  std::set<WritableMapping*> writing;  // the files this version writes
  for (const Job& job : jobs) writing.insert(job.mapping);
  for (WritableMapping* mapping : writing) mapping->BeginVersion();
  auto ta = Clock::now();
  // Largest first, so that one big tensor does not start last.
  std::sort(jobs.begin(), jobs.end(), [](const Job& a, const Job& b) { return a.region.size() > b.region.size(); });
  std::mutex mu;
  std::vector<std::pair<size_t, Status>> failures;  // GUARDED_BY(mu)
  double apply_cpu = 0;                             // GUARDED_BY(mu)
  uint64_t libzstd_before = 0;
  for (const auto& c : applier_->codecs) libzstd_before += c->libzstd_frames();
  report->applied = !jobs.empty();
  {
    TaskGroup group(applier_->pool);
    for (const Job& job : jobs) {
      group.Submit([&, job](size_t thread) {
        const DeltaTensorRecord& r = m.tensors[job.record];
        std::string what = fmt::format("{} (version {}, {})", r.name, v, r.payload_file);
        double c0 = ThreadCpuSeconds();
        // A patch of at least one byte per 256 tensor bytes (an RL step's is far denser)
        // changes nearly every page: map them all writable in one go.
        bool remapped = frames[job.record].size() * 256 >= job.region.size() &&
                        job.mapping->PrepareForWrite(job.region) == WritableMapping::Prepared::kRemapped;
        Status s = applier_->codecs[thread]->Apply(frames[job.record], job.region, r.checksum_algorithm, r.checksum, what);
        {
          std::lock_guard lock(mu);
          apply_cpu += ThreadCpuSeconds() - c0;
          if (remapped) report->remapped_bytes += job.region.size();
        }
        if (!s.ok()) {
          std::lock_guard lock(mu);
          failures.emplace_back(job.record, std::move(s));
          return;
        }
        if (options_.after_tensor_applied) options_.after_tensor_applied(r.name);
      });
    }
  }
  report->apply_seconds += SecondsSince(ta);
  report->apply_cpu_seconds += apply_cpu;
  uint64_t libzstd_after = 0;
  for (const auto& c : applier_->codecs) libzstd_after += c->libzstd_frames();
  report->libzstd_frames += libzstd_after - libzstd_before;
  for (const Job& job : jobs) report->tensor_bytes += job.region.size();
  report->tensors += jobs.size();
  if (!failures.empty()) {
    std::sort(failures.begin(), failures.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    std::vector<std::string> names;
    for (const auto& f : failures) names.push_back(m.tensors[f.first].name);
    return DataLoss(fmt::format("{} of {} tensors failed verification in {} ({}); first: {}; the next fetch "
                                "rebuilds from the base", failures.size(), jobs.size(), dir,
                                fmt::join(names.begin(), names.begin() + std::min<size_t>(5, names.size()), ", "),
                                failures.front().second.message()));
  }
  return Status::Ok();
}

}  // namespace wsync::delta
