#include "backends/delta/receiver.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <map>
#include <cstring>
#include <filesystem>
#include <tuple>

#include <fmt/format.h>

#include "backends/delta/base_digest.h"
#include "backends/delta/local_checkpoint.h"
#include "backends/delta/confined_dir.h"
#include "backends/delta/manifest.h"
#include "backends/delta/receiver_request.h"
#include "core/digest.h"
#include "core/dtype_convert.h"
#include "core/log.h"
#include "core/parallel.h"
#include "core/syscall.h"
#include "core/stopwatch.h"
#include "format/safetensors.h"
#include "model/worker_store.h"
#include "receiver/worker_fanout.h"

namespace wsync {
namespace {

using nlohmann::json;
using delta::FetchReport;
using delta::LocalCheckpoint;

// An adapter file's header: a few hundred bytes per tensor.
constexpr uint64_t kMaxAdapterHeaderBytes = uint64_t{16} << 20;

// A string setting from the serve flags ("" when absent).
std::string Flag(const json& config, const char* key) {
  auto it = config.find(key);
  return it != config.end() && it->is_string() ? it->get<std::string>() : std::string();
}

// Whether two paths are spelled the same once "." and ".." are folded (SkyRL's init keys
// against the flags: a request's path is compared, never looked up on disk).
bool SamePath(const std::string& a, const std::string& b) {
  auto norm = [](const std::string& p) {
    std::filesystem::path n = std::filesystem::path(p).lexically_normal();
    return !n.has_filename() && n.has_relative_path() ? n.parent_path() : n;
  };
  return norm(a) == norm(b);
}

class DeltaReceiver final : public ReceiverBackend {
 public:
  explicit DeltaReceiver(ReceiverContext* ctx) : ctx_(ctx) {}

  std::string_view name() const override { return "delta"; }
  bool ParsesOwnUpdateInfo() const override { return true; }
  // A lora session's update_info is its tensor list plus the safetensors file below the
  // sync dir that holds them (ReceiveAdapter).
  bool CarriesAdapters() const override { return true; }

  Status Init(const json& init_info) override {
    WSYNC_ASSIGN_OR_RETURN(delta::DeltaInitRequest init, delta::ParseDeltaInit(init_info));
    if (init.sync_dir) WSYNC_RETURN_IF_ERROR(CheckSyncDir(*init.sync_dir));
    // SkyRL's init keys name directories; a server takes its directories from its flags
    // only (docs/security.md). Keys naming other directories are noted, never opened: a
    // warning where the flag names another one, a note where the server uses its default
    // (a SkyRL-shaped trainer always sends both keys).
    const json& flags = ctx_->backend_config;
    for (const auto& [key, given, flag] :
         {std::tuple{"base_model_path", init.base_model_path, Flag(flags, "base_checkpoint")},
          std::tuple{"local_checkpoint_dir", init.local_checkpoint_dir, Flag(flags, "local_checkpoint_dir")}}) {
      if (!given || given->empty() || (!flag.empty() && SamePath(*given, flag))) continue;
      if (flag.empty()) {
        WSYNC_LOG_INFO("delta: init_info {} {} is not opened; this server uses its default (flags "
                       "--base-checkpoint, --local-checkpoint-dir choose its directories)", key, *given);
      } else {
        WSYNC_LOG_WARN("delta: init_info {} {} is not this server's ({}): ignored; a server's directories come "
                       "from its flags (--base-checkpoint, --local-checkpoint-dir)", key, *given, flag);
      }
    }
    WSYNC_RETURN_IF_ERROR(Open());
    if (init.base_digest) WSYNC_RETURN_IF_ERROR(CheckBase(*init.base_digest, init.base_model_path.value_or("")));
    if (init.sync_dir) sync_dir_ = *init.sync_dir;
    return Status::Ok();
  }

  Result<json> Fetch(const json& body) override {
    WSYNC_ASSIGN_OR_RETURN(delta::DeltaFetchRequest req, delta::ParseDeltaFetch(body));
    WSYNC_RETURN_IF_ERROR(EnsureOpen());
    const int64_t target = req.target_version;
    std::string sync_dir = req.sync_dir.value_or(sync_dir_);
    if (req.uri) {
      const std::string& uri = *req.uri;
      if (uri.starts_with("gs://") || uri.starts_with("s3://")) {
        return Unimplemented(fmt::format("fetch_weights from {}: object stores are not supported; share the sync "
                                         "directory through a local or NFS path", uri));
      }
    }
    if (sync_dir.empty()) return InvalidArgument("fetch_weights needs a 'sync_dir' (none was given at init either)");
    WSYNC_RETURN_IF_ERROR(CheckSyncDir(sync_dir));
    Deadline deadline = Deadline::InSeconds(ctx_->timeout_seconds);
    Stopwatch elapsed;
    double cpu0 = ProcessCpuSeconds();
    std::vector<Result<FetchReport>> reports(stores_.size(), Internal("not run"));
    WSYNC_RETURN_IF_ERROR(RunOnEveryWorker(ctx_->workers, "fetch_weights", deadline, [&](size_t i, const ReceiverWorker&) {
      reports[i] = stores_[i]->Fetch(target, sync_dir, deadline);
      return reports[i].status();
    }));
    json stats = {{"fetch_s", 0.0}, {"apply_s", 0.0}, {"apply_cpu_s", 0.0}, {"libzstd_frames", 0}, {"remapped_bytes", 0},
                  {"reset_s", 0.0}, {"lock_wait_s", 0.0},
                  {"versions", 0}, {"tensors", 0}, {"payload_bytes", 0}, {"tensor_bytes", 0}};
    int applied = 0;
    bool reset = false;
    std::string reset_reason;
    for (const auto& r : reports) {
      applied += r->applied ? 1 : 0;
      if (r->reset) {
        reset = true;
        reset_reason = r->reset_reason;
      }
      stats["fetch_s"] = stats["fetch_s"].get<double>() + r->fetch_seconds;
      stats["apply_s"] = stats["apply_s"].get<double>() + r->apply_seconds;
      stats["apply_cpu_s"] = stats["apply_cpu_s"].get<double>() + r->apply_cpu_seconds;
      stats["libzstd_frames"] = stats["libzstd_frames"].get<size_t>() + r->libzstd_frames;
      stats["remapped_bytes"] = stats["remapped_bytes"].get<uint64_t>() + r->remapped_bytes;
      stats["reset_s"] = stats["reset_s"].get<double>() + r->reset_seconds;
      stats["lock_wait_s"] = std::max(stats["lock_wait_s"].get<double>(), r->lock_wait_seconds);
      stats["versions"] = stats["versions"].get<int>() + r->versions;
      stats["tensors"] = stats["tensors"].get<size_t>() + r->tensors;
      stats["payload_bytes"] = stats["payload_bytes"].get<uint64_t>() + r->payload_bytes;
      stats["tensor_bytes"] = stats["tensor_bytes"].get<uint64_t>() + r->tensor_bytes;
    }
    stats["total_s"] = elapsed.seconds();
    stats["cpu_s"] = ProcessCpuSeconds() - cpu0;  // this server process, all threads
    WSYNC_LOG_INFO("delta: fetched version {} from {} (from version {}{}): {} version(s), {} tensors, fetch {:.3f} s, "
                   "apply {:.3f} s ({:.3f} CPU s in the apply threads, {} patch(es) through libzstd, {:.3f} GB re-mapped after a "
                   "write-back), reset {:.3f} s, "
                   "total {:.3f} s", target, sync_dir, reports[0]->from_version,
                   reset ? ", after a reset: " + reset_reason : "", stats["versions"].get<int>(),
                   stats["tensors"].get<size_t>(), stats["fetch_s"].get<double>(), stats["apply_s"].get<double>(),
                   stats["apply_cpu_s"].get<double>(), stats["libzstd_frames"].get<size_t>(),
                   stats["remapped_bytes"].get<uint64_t>() / 1e9,
                   stats["reset_s"].get<double>(), stats["total_s"].get<double>());
    return json{{"status", "ok"}, {"target_version", target}, {"version", target}, {"stats", stats},
                {"applied_by_workers", applied}, {"workers", stores_.size()}, {"reset", reset}};
  }

  Status Update(const UpdateRequest& req) override {
    if (!req.reject.ok()) return req.reject;
    if (req.lora) return ReceiveAdapter(*req.update_info, *req.tensors);
    WSYNC_RETURN_IF_ERROR(EnsureOpen());
    if (req.update_info == nullptr || !req.update_info->is_object()) return InvalidArgument("update_info must be an object");
    // SkyRL's update_info: {target_version, version, sync_dir, uri}. The reload reads the
    // local checkpoint the fetch prepared; a sync dir named here is still confined.
    WSYNC_ASSIGN_OR_RETURN(delta::DeltaFetchRequest named, delta::ParseDeltaUpdate(*req.update_info));
    if (named.sync_dir) WSYNC_RETURN_IF_ERROR(CheckSyncDir(*named.sync_dir));
    const int64_t target = named.target_version;
    WSYNC_RETURN_IF_ERROR(stores_.front()->ValidateReady(target));
    Deadline deadline = Deadline::InSeconds(ctx_->timeout_seconds);
    Stopwatch elapsed;
    // The servers are paused: a CPU worker's copies may take its share of every core.
    const size_t threads = std::max<size_t>(1, DefaultThreads() / stores_.size());
    WSYNC_RETURN_IF_ERROR(RunOnEveryWorker(ctx_->workers, "update_weights", deadline,
                                           [&](size_t i, const ReceiverWorker& w) {
                                             return Reload(w, *stores_[i], target, deadline, threads);
                                           }));
    WSYNC_LOG_INFO("delta: reloaded version {} from {} into {} worker(s) in {:.3f} s", target,
                   stores_.front()->CurrentDir(), stores_.size(), elapsed.seconds());
    return Status::Ok();
  }

  void Shutdown() override { stores_.clear(); }

 private:
  Status EnsureOpen() { return stores_.empty() ? Open() : Status::Ok(); }

  // A sync dir a request names must lie below the --sync-root flag (LocalCheckpoint
  // opens it beneath the root, so a symlink cannot lead out either).
  Status CheckSyncDir(const std::string& sync_dir) const {
    std::string root = Flag(ctx_->backend_config, "sync_root");
    if (root.empty()) {
      return InvalidArgument(fmt::format("sync_dir {}: this server takes no sync dir from requests; start it with "
                                         "--sync-root DIR (a directory the sync dirs lie below)", sync_dir));
    }
    return delta::PathBelow(root, sync_dir).status();
  }

  // A lora session (docs/lora.md): update_info's `wsync_lora_file`, a safetensors file
  // below its sync dir (or init's), holds exactly the admitted tensors, each with the
  // dtype and shape the update declares; they are read once and lent to every worker's
  // sink (the adapter's staging). The file is untrusted: its path is confined below the
  // sync root, its header parsed by the one safetensors parser without quoting it, its
  // size bounded by the admitted bytes.
  Status ReceiveAdapter(const json& update_info, const std::vector<TensorMeta>& tensors) {
    WSYNC_ASSIGN_OR_RETURN(delta::DeltaAdapterRequest req, delta::ParseDeltaAdapterUpdate(update_info));
    const std::string sync_dir = req.sync_dir.value_or(sync_dir_);
    const std::string& rel = req.file;
    if (sync_dir.empty()) {
      return InvalidArgument("a lora session over backend delta needs update_info 'sync_dir' (none was given at init "
                             "either)");
    }
    WSYNC_RETURN_IF_ERROR(CheckSyncDir(sync_dir));
    const std::string root = Flag(ctx_->backend_config, "sync_root");
    WSYNC_ASSIGN_OR_RETURN(std::string below, delta::PathBelow(root, sync_dir));
    WSYNC_ASSIGN_OR_RETURN(delta::ConfinedDir root_dir, delta::ConfinedDir::Open(root));
    WSYNC_ASSIGN_OR_RETURN(delta::ConfinedDir dir, root_dir.OpenDir(below));
    WSYNC_ASSIGN_OR_RETURN(delta::RegularFile file, dir.OpenFile(rel));
    uint64_t want = 0;
    for (const TensorMeta& m : tensors) want += m.nbytes();  // admitted: bounded by --max-update-bytes
    SafetensorsHeaderOptions options;
    options.max_header_bytes = kMaxAdapterHeaderBytes;
    options.quote_file = false;
    if (file.size > want + 8 + options.max_header_bytes) {
      return InvalidArgument(fmt::format("adapter file {} holds {} bytes, more than the update's {} tensors ({} "
                                         "bytes) and a header", file.path, file.size, tensors.size(), want));
    }
    WSYNC_ASSIGN_OR_RETURN(SafetensorsHeader header, ReadSafetensorsHeader(file.fd.get(), file.size, file.path, options));
    if (header.entries.size() != tensors.size()) {
      return InvalidArgument(fmt::format("adapter file {} holds {} tensors; the update declares {}", file.path,
                                         header.entries.size(), tensors.size()));
    }
    std::map<std::string_view, const SafetensorsEntry*> by_name;
    for (const SafetensorsEntry& e : header.entries) by_name.emplace(e.meta.name, &e);
    std::vector<std::byte> data(want);
    std::vector<TensorRef> refs;
    refs.reserve(tensors.size());
    size_t off = 0;
    for (const TensorMeta& m : tensors) {
      auto it = by_name.find(m.name);
      if (it == by_name.end()) return InvalidArgument(fmt::format("adapter file {} has no tensor {}", file.path, m.name));
      const SafetensorsEntry& e = *it->second;
      if (e.meta.dtype != m.dtype || e.meta.shape != m.shape) {
        return InvalidArgument(fmt::format("adapter file {}: tensor {} is {} {} there; the update declares {} {}",
                                           file.path, m.name, TorchName(e.meta.dtype), ShapeString(e.meta.shape),
                                           TorchName(m.dtype), ShapeString(m.shape)));
      }
      std::span<std::byte> into(data.data() + off, m.nbytes());
      WSYNC_RETURN_IF_ERROR(PreadAll(file, e.offset, into).WithContext(fmt::format("tensor {}", m.name)));
      refs.push_back(TensorRef{m.name, m.dtype, m.shape, into, Device{}});
      off += m.nbytes();
    }
    Deadline deadline = Deadline::InSeconds(ctx_->timeout_seconds);
    return RunOnEveryWorker(ctx_->workers, "update_weights", deadline, [&](size_t, const ReceiverWorker& w) -> Status {
      for (const TensorRef& r : refs) WSYNC_RETURN_IF_ERROR(w.sink->Load(r).WithContext(w.label));
      return w.sink->ChunkLanded().WithContext(w.label);
    });
  }

  // Reads `into.size()` bytes at `offset` of the file; DataLoss when it ends first.
  static Status PreadAll(const delta::RegularFile& file, uint64_t offset, std::span<std::byte> into) {
    size_t done = 0;
    while (done < into.size()) {
      const ssize_t n = ::pread(file.fd.get(), into.data() + done, into.size() - done, static_cast<off_t>(offset + done));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return ErrnoStatus(errno, fmt::format("reading {}", file.path));
      if (n == 0) return DataLoss(fmt::format("{} ends {} bytes early", file.path, into.size() - done));
      done += static_cast<size_t>(n);
    }
    return Status::Ok();
  }

  // The trainer's base checkpoint (`trainer_base` as its init names it) must be this
  // server's, byte for byte: base_digest.h.
  Status CheckBase(const std::string& theirs, const std::string& trainer_base) const {
    WSYNC_ASSIGN_OR_RETURN(std::shared_ptr<const delta::TensorDigests> base, base_digests_->Get());
    const std::string mine = delta::CombineDigests(*base);
    if (mine == theirs) return Status::Ok();
    return FailedPrecondition(fmt::format(
        "the trainer's base is not this server's: the trainer's base checkpoint{} has base_digest {}, this server's "
        "base checkpoint {} has base_digest {} (over its {} tensors); a delta over another base would leave every "
        "tensor the trainer does not change wrong. To fix: {}",
        trainer_base.empty() ? std::string() : " " + trainer_base, theirs, base_digests_->checkpoint(), mine,
        base->size(), delta::BaseMismatchFix(base_digests_->checkpoint())));
  }

  // The local checkpoint from the serve flags alone: the base (--base-checkpoint), the
  // local directory (--local-checkpoint-dir, else one under $TMPDIR named after the base)
  // and the sync root (--sync-root).
  Status Open() {
    std::string base = Flag(ctx_->backend_config, "base_checkpoint");
    std::string root = Flag(ctx_->backend_config, "local_checkpoint_dir");
    if (base.empty()) return InvalidArgument("delta: this server needs its base checkpoint (wsync serve --base-checkpoint DIR)");
    if (root.empty()) {
      const char* tmp = std::getenv("TMPDIR");
      root = (std::filesystem::path(tmp && *tmp ? tmp : "/tmp") / "wsync_delta_checkpoints" /
              HexDigest(DigestAlgorithm::kXxh3_128, std::as_bytes(std::span(base.data(), base.size()))).substr(0, 16))
                 .string();
    }
    Deadline deadline = Deadline::InSeconds(ctx_->timeout_seconds);
    std::vector<std::unique_ptr<LocalCheckpoint>> stores;
    if (!base_digests_ || base_digests_->checkpoint() != base) base_digests_ = std::make_shared<delta::BaseDigests>(base);
    for (size_t i = 0; i < ctx_->workers.size(); ++i) {
      delta::LocalCheckpointOptions o;
      o.base_checkpoint = base;
      o.base_digests = base_digests_;
      o.root = root;
      o.sync_root = Flag(ctx_->backend_config, "sync_root");
      WSYNC_ASSIGN_OR_RETURN(auto s, LocalCheckpoint::Open(std::move(o), deadline));
      stores.push_back(std::move(s));
    }
    stores_ = std::move(stores);
    WSYNC_LOG_INFO("delta: local checkpoint {} over base {} for {} worker(s)", root, base, stores_.size());
    return Status::Ok();
  }

  // Loads every HF tensor of the model the worker holds (the drafter's layers included,
  // in the same pass) from the local checkpoint into one worker's shards.
  // A CPU worker plans every copy first and runs them on `threads` threads in pieces of
  // at most kReloadPieceBytes (one copy thread alone would bound the pause); a
  // CUDA worker loads tensor by tensor. A sink that plans no copies (a ReceiverEngine's)
  // is lent the tensors in chunks of about kLendChunkBytes, straight from the mapped
  // checkpoint; one that expects no list is lent every tensor of the checkpoint.
  static Status Reload(const ReceiverWorker& w, const LocalCheckpoint& store, int64_t target, Deadline deadline,
                       size_t threads) {
    constexpr size_t kReloadPieceBytes = size_t{8} << 20;
    constexpr size_t kLendChunkBytes = size_t{1} << 30;
    WSYNC_ASSIGN_OR_RETURN(std::shared_ptr<void> lock, store.LockForReading(deadline));
    WSYNC_RETURN_IF_ERROR(store.ValidateReady(target));  // a fetch may have run since the check
    std::string dir = store.CurrentDir();
    WSYNC_ASSIGN_OR_RETURN(CheckpointDir ckpt, CheckpointDir::Open(dir));
    const bool lend = !w.sink->PlansCopies();
    // A sink that hashes its landings lands every tensor itself (LoadEach), so that its
    // digests cover every byte it writes.
    const bool each = w.device.is_cpu() && !lend && w.sink->HashesLandings();
    const bool plan = w.device.is_cpu() && !lend && !each;
    std::vector<TensorRef> refs;
    const std::vector<TensorMeta>& wanted = w.sink->hf_tensors().empty() ? ckpt.tensors() : w.sink->hf_tensors();
    std::vector<WorkerStore::ByteCopy> copies;
    // What the planned (or lent) views read from, for other dtypes.
    std::vector<std::vector<std::byte>> converted;
    std::vector<std::byte> scratch;
    size_t lent_bytes = 0, lent_tensors = 0;  // since the last ChunkLanded
    const ShardingTable* table = w.sink->sharding();
    for (const TensorMeta& want : wanted) {
      // A tensor no parameter holds (an MTP layer's without a drafter) is not read.
      if (table != nullptr && !table->Serves(want.name)) continue;
      Result<TensorRef> ref = ckpt.Ref(want.name);
      if (!ref.ok()) return NotFound(fmt::format("checkpoint {} has no tensor {}, which the model needs", dir, want.name));
      TensorRef r = *ref;
      if (!std::equal(r.shape.begin(), r.shape.end(), want.shape.begin(), want.shape.end())) {
        return InvalidArgument(fmt::format("shape of {} is {} in the model, {} in checkpoint {}", want.name,
                                           ShapeString(want.shape), ShapeString(r.shape), dir));
      }
      if (r.dtype != want.dtype) {
        std::vector<std::byte>& out = plan || lend || each ? converted.emplace_back() : scratch;
        out.resize(want.nbytes());
        WSYNC_RETURN_IF_ERROR(Convert(r.bytes, r.dtype, out, want.dtype, want.name));
        r.dtype = want.dtype;
        r.bytes = out;
      }
      if (lend) {  // the checkpoint's memory is on the host, whatever the worker's device
        WSYNC_RETURN_IF_ERROR(w.sink->Load(r).WithContext(w.label));
        lent_bytes += r.bytes.size();
        ++lent_tensors;
        if (lent_bytes >= kLendChunkBytes) {
          WSYNC_RETURN_IF_ERROR(w.sink->ChunkLanded().WithContext(w.label));
          converted.clear();
          lent_bytes = lent_tensors = 0;
        }
        continue;
      }
      r.device = w.device;
      if (each) {
        refs.push_back(r);
        continue;
      }
      WSYNC_RETURN_IF_ERROR(plan ? w.sink->PlanLoad(r, &copies) : w.sink->Load(r));
    }
    if (each) {
      WSYNC_RETURN_IF_ERROR(w.sink->LoadEach(refs, threads).WithContext(w.label));
      return w.sink->ChunkLanded().WithContext(w.label);
    }
    if (lend && lent_tensors > 0) return w.sink->ChunkLanded().WithContext(w.label);
    if (!plan) return w.sink->ChunkLanded().WithContext(w.label);
    std::vector<WorkerStore::ByteCopy> pieces;
    for (const WorkerStore::ByteCopy& c : copies) {
      for (size_t off = 0; off < c.bytes; off += kReloadPieceBytes) {
        pieces.push_back({c.src + off, c.dst + off, std::min(kReloadPieceBytes, c.bytes - off)});
      }
    }
    ParallelFor(pieces.size(), threads, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) std::memcpy(pieces[i].dst, pieces[i].src, pieces[i].bytes);
    });
    w.sink->PlannedCopiesRan(wanted);
    return Status::Ok();
  }

  ReceiverContext* ctx_;
  std::string sync_dir_;                                 // from init, the default for fetches
  std::vector<std::unique_ptr<LocalCheckpoint>> stores_;  // one per worker, used on its thread
  std::shared_ptr<delta::BaseDigests> base_digests_;      // the base's, shared by stores_
};

}  // namespace

Result<std::unique_ptr<ReceiverBackend>> CreateDeltaReceiver(ReceiverContext* context) {
  return std::unique_ptr<ReceiverBackend>(std::make_unique<DeltaReceiver>(context));
}

}  // namespace wsync
