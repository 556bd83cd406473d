#include "backends/delta/trainer.h"

#include <cstdlib>
#include <filesystem>
#include <span>

#include <fmt/format.h>

#include "backends/delta/manifest.h"
#include "control/session_driver.h"
#include "control/tensor_list.h"
#include "core/digest.h"
#include "core/log.h"
#include "core/stopwatch.h"
#include "engine/backend_options.h"
#include "engine/engine.h"
#include "engine/sync_pass.h"
#include "engine/watched.h"
#include "format/safetensors.h"
#include "receiver/lora_spec.h"

namespace wsync {
namespace {

using nlohmann::json;

class DeltaPlane final : public DataPlane {
 public:
  DeltaPlane(DeltaTrainerOptions d, std::optional<LoraAdapterOptions> lora)
      : delta_(std::move(d)), lora_(std::move(lora)) {}
  ~DeltaPlane() override { RemoveAdapterFile(); }

  // The servers fetch and apply before start, inside a pause that holds through the
  // session (the prefix caches are reset in it); update_weights is their reload.
  // A lora session (docs/lora.md) writes the adapter to one file below the sync dir
  // before start; update_weights names it, and the file goes once the session ends.
  SessionShape Shape() override {
    SessionShape shape;
    if (lora_) {
      shape.transfer = false;
      shape.after_session = [this](SyncContext&, Status outcome) {
        RemoveAdapterFile();
        return outcome;
      };
      return shape;
    }
    shape.transfer = false;
    shape.prefix_cache_reset = PrefixCacheReset::kBeforeStart;
    shape.before_start = [this](SyncContext& sync) { return FetchAndPause(sync); };
    shape.after_session = [this](SyncContext& sync, Status outcome) { return Resume(sync, std::move(outcome)); };
    shape.account = [this](SyncStats* stats) { Account(stats); };
    return shape;
  }

  Status Init(const PlaneInit& init) override {
    if (lora_) return InitAdapter(init);
    WSYNC_ASSIGN_OR_RETURN(std::vector<int64_t> published, delta::PublishedVersions(delta_.sync_dir));
    if (!published.empty()) {
      return FailedPrecondition(fmt::format(
          "sync dir {} already holds versions {}..{} of an earlier chain; a chain starts at the base checkpoint "
          "and never rewrites a version: give a fresh sync_dir", delta_.sync_dir, published.front(),
          published.back()));
    }
    delta::DeltaPublisherOptions p;
    p.sync_dir = delta_.sync_dir;
    p.base_checkpoint = delta_.base_checkpoint;
    p.state_dir = delta_.state_dir;
    p.max_file_bytes = static_cast<uint64_t>(delta_.max_file_gb * double(uint64_t{1} << 30));
    p.threads = delta_.publish_threads;
    p.borrow_source_bytes = delta_.borrow_source_bytes;
    p.rank = init.options.rank;
    p.progress = init.options.progress;
    WSYNC_ASSIGN_OR_RETURN(publisher_, delta::DeltaPublisher::Create(std::move(p), init.metadata));
    if (init.driver != nullptr) {
      // SkyRL's two keys to every server; wsync's own fields only to wsync servers.
      std::vector<json> infos;
      vllm_.assign(init.driver->size(), false);
      for (size_t i = 0; i < init.driver->size(); ++i) {
        const json* health = init.fleet && i < init.fleet->health.size() ? &init.fleet->health[i] : nullptr;
        const bool wsync = health && health->is_object() && health->value("server", "") == "wsync";
        vllm_[i] = wsync && health->value("frontend", "") == "vllm";
        Result<json> info = DeltaInitPayload(delta_, wsync, publisher_->base_digest());
        if (!info.ok()) return info.status().WithContext(init.driver->urls()[i]);
        infos.push_back(std::move(*info));
      }
      WSYNC_RETURN_IF_ERROR(init.driver->Init(std::move(infos)));
    }
    WSYNC_LOG_INFO("delta: publishing to {} for {} server(s); version 0 is {}", delta_.sync_dir,
                   init.options.servers.size(),
                   delta_.base_checkpoint.empty() ? std::string("the first pass of the source") : delta_.base_checkpoint);
    return Status::Ok();
  }

  Result<bool> Ready(const Status& mine) override {
    WSYNC_RETURN_IF_ERROR(mine);
    return publisher_ != nullptr || (lora_ && adapter_ready_);
  }

  // Publishes the sync's version; the update names it. Nothing reaches the servers.
  Status Prepare(SyncContext& sync) override {
    if (lora_) return WriteAdapter(sync);
    report_ = DeltaSyncReport{};
    paused_ = false;
    // In-line verification: the encoding's checksums of the new bytes are the digests.
    std::shared_ptr<PassDigests> digests = publisher_->DigestsEveryTensor() ? sync.pass.TakeDigests() : nullptr;
    std::map<std::string, std::string> sums;
    WSYNC_ASSIGN_OR_RETURN(report_.publish, publisher_->Publish(sync.pass.AsSource(), digests ? &sums : nullptr));
    for (auto& [name, hex] : sums) digests->Record(name, std::move(hex));
    version_ = report_.publish.version;
    const std::string uri = delta::VersionDir(delta_.sync_dir, version_);
    sync.update_body = std::make_shared<const std::string>(
        json{{"update_info",
              {{"target_version", version_}, {"version", version_}, {"sync_dir", delta_.sync_dir}, {"uri", uri}}}}
            .dump());
    return Status::Ok();
  }

  Status Abort(const Status& cause, SessionDriver::Pending* update) override {
    return update == nullptr ? cause : cause.WithContext(fmt::format("reloading version {}", version_));
  }

  void Shutdown() override {
    publisher_.reset();
    RemoveAdapterFile();
    adapter_ready_ = false;
  }

  const DeltaSyncReport& last_report() const { return last_; }
  int64_t version() const { return publisher_ ? publisher_->version() : 0; }

 private:
  // fetch (servers keep serving while they download and apply) -> pause(keep).
  Status FetchAndPause(SyncContext& sync) {
    if (sync.driver == nullptr) return Status::Ok();  // publishing alone
    Stopwatch phase;
    const std::string uri = delta::VersionDir(delta_.sync_dir, version_);
    Result<std::vector<json>> fetched =
        sync.driver->Fetch(json{{"target_version", version_}, {"sync_dir", delta_.sync_dir}, {"uri", uri}}, vllm_);
    if (!fetched.ok()) return fetched.status().WithContext(fmt::format("fetching version {}", version_));
    report_.fetch_replies = std::move(*fetched);
    report_.fetch_seconds = phase.Lap();
    paused_ = true;  // resumed even after a partial pause: no server stays paused
    Status s = sync.driver->Pause("keep", false);
    report_.pause_seconds = phase.Lap();
    return s;
  }

  // An adapter trainer's init: the servers are told the sync dir (no base: the model's
  // weights are not this trainer's), and the adapter's files go in <sync_dir>/lora/<name>.
  Status InitAdapter(const PlaneInit& init) {
    const std::string& name = lora_->name;
    if (!IsLoraName(name)) {
      return InvalidArgument(fmt::format("LoRA adapter name '{}': 1 to {} characters of [A-Za-z0-9._-], not "
                                         "starting with '.'", name, kMaxLoraNameBytes));
    }
    adapter_dir_ = "lora/" + name;
    std::error_code ec;
    std::filesystem::create_directories(std::filesystem::path(delta_.sync_dir) / adapter_dir_, ec);
    if (ec) return Internal(fmt::format("creating {}/{}: {}", delta_.sync_dir, adapter_dir_, ec.message()));
    adapter_tag_ = RandomHex(8);  // this trainer's files, apart from an earlier one's
    if (init.driver != nullptr) {
      std::vector<json> infos;
      for (size_t i = 0; i < init.driver->size(); ++i) {
        const json* health = init.fleet && i < init.fleet->health.size() ? &init.fleet->health[i] : nullptr;
        if (!(health && health->is_object() && health->value("server", "") == "wsync")) {
          return FailedPrecondition(fmt::format("{} is not a wsync server: LoRA adapters over backend delta need "
                                                "wsync serve --max-loras", init.driver->urls()[i]));
        }
        Result<json> info = DeltaInitPayload(delta_, true, "");
        if (!info.ok()) return info.status().WithContext(init.driver->urls()[i]);
        infos.push_back(std::move(*info));
      }
      WSYNC_RETURN_IF_ERROR(init.driver->Init(std::move(infos)));
    }
    adapter_ready_ = true;
    WSYNC_LOG_INFO("delta: LoRA adapter {} through {}/{} for {} server(s)", name, delta_.sync_dir, adapter_dir_,
                   init.options.servers.size());
    return Status::Ok();
  }

  // A lora session's file: the pass's tensors, hashed as they are copied (in-line
  // verification), written whole (not fsynced: it is read once and removed) and renamed
  // into place; update_info is the tensor list, the sync dir and the file.
  Status WriteAdapter(SyncContext& sync) {
    RemoveAdapterFile();
    const std::vector<TensorMeta>& meta = sync.pass.metadata();
    std::shared_ptr<PassDigests> digests = sync.pass.TakeDigests();
    WSYNC_ASSIGN_OR_RETURN(std::shared_ptr<TensorStream> stream, sync.pass.Stream());
    size_t total = 0;
    for (const TensorMeta& m : meta) total += m.nbytes();
    adapter_bytes_.resize(total);
    std::vector<TensorRef> refs;
    refs.reserve(meta.size());
    size_t off = 0;
    for (const TensorMeta& m : meta) {
      TensorRef t;
      WSYNC_ASSIGN_OR_RETURN(bool more, stream->Next(&t));
      if (!more) return Internal("source ended early");
      if (!t.device.is_cpu()) {
        return InvalidArgument(fmt::format("tensor {} is on {}: LoRA adapters over backend delta are written from "
                                           "host tensors", t.name, t.device.ToString()));
      }
      // The pass's stream checks each tensor's bytes against its metadata.
      std::span<std::byte> into(adapter_bytes_.data() + off, m.nbytes());
      CopyRecordingDigest(into.data(), t, digests.get());
      refs.push_back(TensorRef{m.name, m.dtype, m.shape, into, Device{}});
      off += m.nbytes();
    }
    TensorRef end;
    WSYNC_RETURN_IF_ERROR(stream->Next(&end).status());  // a source yielding more is named
    const std::string rel = fmt::format("{}/{}-{}.safetensors", adapter_dir_, adapter_tag_, ++adapter_seq_);
    const std::string path = (std::filesystem::path(delta_.sync_dir) / rel).string();
    WSYNC_RETURN_IF_ERROR(WriteSafetensors(path, refs, {}, /*durable=*/false));
    adapter_file_ = path;
    json info = TensorListJson(meta);
    info["sync_dir"] = delta_.sync_dir;
    info["wsync_lora_file"] = rel;
    sync.update_body = std::make_shared<const std::string>(json{{"update_info", std::move(info)}}.dump());
    sync.stats.bytes = total;
    sync.stats.chunks = 1;
    return Status::Ok();
  }

  void RemoveAdapterFile() {
    if (adapter_file_.empty()) return;
    std::error_code ec;
    std::filesystem::remove(adapter_file_, ec);
    adapter_file_.clear();
  }

  Status Resume(SyncContext& sync, Status outcome) {
    if (!paused_) return outcome;
    Stopwatch phase;
    Status resumed = sync.driver->Resume();
    report_.resume_seconds = phase.seconds();
    if (!outcome.ok()) return outcome;
    return resumed.WithContext("resuming generation");
  }

  void Account(SyncStats* stats) {
    report_.start_seconds = stats->start_seconds;
    report_.update_seconds = stats->transfer_seconds;
    report_.finish_seconds = stats->finish_seconds;
    report_.seconds = stats->seconds;
    const delta::PublishStats& p = report_.publish;
    stats->bytes = p.model_bytes;
    stats->tensors = p.tensors;
    stats->chunks = p.payload_files;
    stats->start_seconds = report_.pause_seconds + report_.start_seconds;
    stats->transfer_seconds = p.seconds + report_.fetch_seconds + report_.update_seconds;
    stats->finish_seconds = report_.finish_seconds + report_.resume_seconds;
    if (p.full_version) {
      WSYNC_LOG_INFO("delta: version {} is the full version of the trainer's first weights (base digest {}): a "
                     "record for each of its {} tensors, none changed", p.version, publisher_->base_digest(),
                     p.changed_tensors);
    }
    WSYNC_LOG_INFO("delta: version {}: {} of {} tensors changed, {:.1f} MB compressed of {:.1f} MB ({:.2f}%); "
                   "publish {:.3f} s ({:.2f} GB/s on {} threads; source {:.3f} s, encode {:.3f} s summed over "
                   "threads, write {:.3f} s, {:.3f} CPU s), fetch {:.3f} s, pause {:.3f} s, start {:.3f} s, "
                   "reload {:.3f} s, finish {:.3f} s, resume {:.3f} s, total {:.3f} s",
                   p.version, p.full_version ? 0 : p.changed_tensors, p.tensors, p.compressed_bytes / 1e6, p.model_bytes / 1e6,
                   p.model_bytes ? 100.0 * p.compressed_bytes / p.model_bytes : 0.0, p.seconds,
                   p.seconds > 0 ? p.model_bytes / p.seconds / 1e9 : 0.0, p.threads, p.stage_seconds,
                   p.encode_cpu_seconds, p.write_seconds, p.cpu_seconds, report_.fetch_seconds,
                   report_.pause_seconds, report_.start_seconds, report_.update_seconds, report_.finish_seconds,
                   report_.resume_seconds, report_.seconds);
    last_ = report_;
  }

  DeltaTrainerOptions delta_;
  std::optional<LoraAdapterOptions> lora_;  // TrainerOptions::lora: lora sessions only
  bool adapter_ready_ = false;
  std::string adapter_dir_;   // relative to the sync dir
  std::string adapter_tag_;   // this trainer's file prefix
  int64_t adapter_seq_ = 0;
  std::string adapter_file_;  // the session's file, removed when it ends
  std::vector<std::byte> adapter_bytes_;
  // Per server: a vLLM server running wsync's plugin (it fetches through a collective RPC).
  std::vector<bool> vllm_;
  std::unique_ptr<delta::DeltaPublisher> publisher_;
  DeltaSyncReport report_;  // the sync under way
  DeltaSyncReport last_;    // the last successful sync
  int64_t version_ = 0;
  bool paused_ = false;
};

// The skeleton around a DeltaPlane, with the plane's report at hand.
class DeltaTrainerImpl final : public DeltaTrainer {
 public:
  DeltaTrainerImpl(std::unique_ptr<TrainerEngine> engine, const DeltaPlane* plane)
      : engine_(std::move(engine)), plane_(plane) {}
  Status Init(const std::vector<TensorMeta>& metadata) override { return engine_->Init(metadata); }
  Result<SyncStats> SendWeights(WeightSource& source, const std::optional<std::string>& weight_version) override {
    return engine_->SendWeights(source, weight_version);
  }
  void Shutdown() override { engine_->Shutdown(); }
  const DeltaSyncReport& last_report() const override { return plane_->last_report(); }
  int64_t version() const override { return plane_->version(); }

 private:
  std::unique_ptr<TrainerEngine> engine_;
  const DeltaPlane* plane_;  // owned by engine_
};

Status CheckDeltaOptions(const TrainerOptions& options, const DeltaTrainerOptions& delta) {
  WSYNC_RETURN_IF_ERROR(CheckTrainerOptions(options, /*servers_required=*/false));
  // Only rank 0 publishes; the others drain their source.
  if (options.rank == 0 && delta.sync_dir.empty()) return InvalidArgument("the delta backend needs a sync directory (option sync_dir)");
  if (delta.max_file_gb <= 0) return InvalidArgument(fmt::format("delta option max_file_gb is {}; it must be positive", delta.max_file_gb));
  return Status::Ok();
}

}  // namespace

std::string DefaultSkyrlLocalCheckpointDir(const std::string& sync_dir) {
  constexpr size_t kMaxName = 160;
  constexpr size_t kDigestChars = 16;
  std::string base = sync_dir;
  if (size_t slash = base.rfind('/'); slash != std::string::npos) base = base.substr(slash + 1);
  for (char& c : base) {
    const bool keep = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
                      c == '_' || c == '.';
    if (!keep) c = '_';
  }
  base = base.substr(0, kMaxName - kDigestChars - 1);
  const std::string digest =
      HexDigest(DigestAlgorithm::kSha256, std::as_bytes(std::span(sync_dir.data(), sync_dir.size()))).substr(0, kDigestChars);
  const char* tmp = std::getenv("TMPDIR");
  return (std::filesystem::path(tmp && *tmp ? tmp : "/tmp") / "skyrl_delta_checkpoints" / (base + "_" + digest))
      .string();
}

Result<json> DeltaInitPayload(const DeltaTrainerOptions& delta, bool wsync_server, const std::string& base_digest) {
  const std::string& base = delta.base_model_path.empty() ? delta.base_checkpoint : delta.base_model_path;
  const std::string local =
      delta.local_checkpoint_dir.empty() ? DefaultSkyrlLocalCheckpointDir(delta.sync_dir) : delta.local_checkpoint_dir;
  json info = json::object();
  if (base.empty()) {
    if (!wsync_server) {
      return InvalidArgument(
          "this server is not a wsync server (its /health does not say \"server\": \"wsync\"), and SkyRL's delta "
          "receiver requires init_info 'base_model_path': give the delta trainer base_model_path (the servers' "
          "path of the base checkpoint) or base_checkpoint");
    }
  } else {
    info["base_model_path"] = base;
  }
  info["local_checkpoint_dir"] = local;
  if (wsync_server) {
    info["sync_dir"] = delta.sync_dir;
    info["format_version"] = delta::kManifestFormatVersion;
    if (!base_digest.empty()) info["base_digest"] = base_digest;
  }
  return info;
}

Result<DeltaTrainerOptions> ParseDeltaTrainerOptions(const std::map<std::string, std::string>& values) {
  DeltaTrainerOptions o;
  BackendOptions read("delta", values);
  WSYNC_RETURN_IF_ERROR(read.Read("sync_dir", &o.sync_dir));
  WSYNC_RETURN_IF_ERROR(read.Read("max_file_gb", &o.max_file_gb));
  WSYNC_RETURN_IF_ERROR(read.Read("publish_threads", &o.publish_threads));
  WSYNC_RETURN_IF_ERROR(read.Read("base_checkpoint", &o.base_checkpoint));
  WSYNC_RETURN_IF_ERROR(read.Read("base_model_path", &o.base_model_path));
  WSYNC_RETURN_IF_ERROR(read.Read("local_checkpoint_dir", &o.local_checkpoint_dir));
  WSYNC_RETURN_IF_ERROR(read.Read("state_dir", &o.state_dir));
  WSYNC_RETURN_IF_ERROR(read.Finish());
  return o;
}

Result<std::unique_ptr<DeltaTrainer>> NewDeltaTrainer(const TrainerOptions& options, DeltaTrainerOptions delta) {
  WSYNC_RETURN_IF_ERROR(CheckDeltaOptions(options, delta));
  if (options.rank != 0) {
    return InvalidArgument(fmt::format("trainer rank {} does not publish: only rank 0 builds a delta publisher "
                                       "(CreateDeltaTrainer gives the other ranks an engine that drains their "
                                       "source)", options.rank));
  }
  auto plane = std::make_unique<DeltaPlane>(std::move(delta), options.lora);
  const DeltaPlane* view = plane.get();
  WSYNC_ASSIGN_OR_RETURN(std::unique_ptr<TrainerEngine> engine, NewTrainerEngine(options, std::move(plane)));
  return std::unique_ptr<DeltaTrainer>(std::make_unique<DeltaTrainerImpl>(std::move(engine), view));
}

Result<std::unique_ptr<TrainerEngine>> CreateDeltaTrainer(const TrainerOptions& options) {
  WSYNC_ASSIGN_OR_RETURN(DeltaTrainerOptions delta, ParseDeltaTrainerOptions(options.backend_options));
  WSYNC_RETURN_IF_ERROR(CheckDeltaOptions(options, delta));
  // Rank 0 alone publishes; the engine gives the others the one pass per sync it makes.
  return NewTrainerEngine(options, std::make_unique<DeltaPlane>(std::move(delta), options.lora));
}

}  // namespace wsync
