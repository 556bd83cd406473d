#include "backends/delta/trainer.h"

#include <cstdlib>
#include <filesystem>
#include <span>

#include <fmt/format.h>

#include "backends/delta/manifest.h"
#include "control/session_driver.h"
#include "core/digest.h"
#include "core/log.h"
#include "core/stopwatch.h"
#include "engine/backend_options.h"
#include "engine/engine.h"
#include "engine/sync_pass.h"

namespace wsync {
namespace {

using nlohmann::json;

class DeltaPlane final : public DataPlane {
 public:
  explicit DeltaPlane(DeltaTrainerOptions d) : delta_(std::move(d)) {}

  // The servers fetch and apply before start, inside a pause that holds through the
  // session (the prefix caches are reset in it); update_weights is their reload.
  SessionShape Shape() override {
    SessionShape shape;
    shape.transfer = false;
    shape.prefix_cache_reset = PrefixCacheReset::kBeforeStart;
    shape.before_start = [this](SyncContext& sync) { return FetchAndPause(sync); };
    shape.after_session = [this](SyncContext& sync, Status outcome) { return Resume(sync, std::move(outcome)); };
    shape.account = [this](SyncStats* stats) { Account(stats); };
    return shape;
  }

  Status Init(const PlaneInit& init) override {
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
    return publisher_ != nullptr;
  }

  // Publishes the sync's version; the update names it. Nothing reaches the servers.
  Status Prepare(SyncContext& sync) override {
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

  void Shutdown() override { publisher_.reset(); }

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
  auto plane = std::make_unique<DeltaPlane>(std::move(delta));
  const DeltaPlane* view = plane.get();
  WSYNC_ASSIGN_OR_RETURN(std::unique_ptr<TrainerEngine> engine, NewTrainerEngine(options, std::move(plane)));
  return std::unique_ptr<DeltaTrainer>(std::make_unique<DeltaTrainerImpl>(std::move(engine), view));
}

Result<std::unique_ptr<TrainerEngine>> CreateDeltaTrainer(const TrainerOptions& options) {
  WSYNC_ASSIGN_OR_RETURN(DeltaTrainerOptions delta, ParseDeltaTrainerOptions(options.backend_options));
  WSYNC_RETURN_IF_ERROR(CheckDeltaOptions(options, delta));
  // Rank 0 alone publishes; the engine gives the others the one pass per sync it makes.
  return NewTrainerEngine(options, std::make_unique<DeltaPlane>(std::move(delta)));
}

}  // namespace wsync
