#include "backends/delta/trainer.h"

#include <chrono>

#include <fmt/format.h>

#include "backends/delta/manifest.h"
#include "control/client.h"
#include "core/log.h"
#include "core/non_sender_trainer.h"

namespace wsync {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

class DeltaTrainerImpl final : public DeltaTrainer {
 public:
  DeltaTrainerImpl(const TrainerOptions& o, DeltaTrainerOptions d)
      : options_(o), delta_(std::move(d)), client_(o.servers, ClientOptions{o.api_key, 10}) {}

  Status Init(const std::vector<TensorMeta>& metadata) override {
    WSYNC_ASSIGN_OR_RETURN(std::vector<int64_t> published, delta::PublishedVersions(options_.sync_dir));
    if (!published.empty()) {
      return FailedPrecondition(fmt::format(
          "sync dir {} already holds versions {}..{} of an earlier chain; a chain starts at the base checkpoint "
          "and never rewrites a version: give a fresh --sync-dir", options_.sync_dir, published.front(),
          published.back()));
    }
    delta::DeltaPublisherOptions p;
    p.sync_dir = options_.sync_dir;
    p.base_checkpoint = delta_.base_checkpoint;
    p.max_file_bytes = static_cast<uint64_t>(options_.max_file_gb * double(uint64_t{1} << 30));
    p.threads = options_.publish_threads;
    p.borrow_source_bytes = delta_.borrow_source_bytes;
    p.rank = options_.rank;
    p.progress = options_.progress;
    WSYNC_ASSIGN_OR_RETURN(publisher_, delta::DeltaPublisher::Create(std::move(p), metadata));
    if (!options_.servers.empty()) {
      json info{{"sync_dir", options_.sync_dir}, {"format_version", delta::kManifestFormatVersion}};
      WSYNC_RETURN_IF_ERROR(client_.Post("/init_weight_transfer_engine", json{{"init_info", info}},
                                         Deadline::InSeconds(options_.timeout_seconds)).status());
    }
    WSYNC_LOG_INFO("delta: publishing to {} for {} server(s); version 0 is {}", options_.sync_dir,
                   options_.servers.size(),
                   delta_.base_checkpoint.empty() ? std::string("the first pass of the source") : delta_.base_checkpoint);
    return Status::Ok();
  }

  Result<SyncStats> SendWeights(WeightSource& source, const std::optional<std::string>& weight_version) override {
    if (!publisher_) return FailedPrecondition("delta: call Init() before SendWeights()");
    auto t0 = Clock::now();
    DeltaSyncReport rep;
    WSYNC_ASSIGN_OR_RETURN(rep.publish, publisher_->Publish(source));
    int64_t v = rep.publish.version;
    std::string uri = delta::VersionDir(options_.sync_dir, v);
    if (!options_.servers.empty()) WSYNC_RETURN_IF_ERROR(DriveServers(v, uri, weight_version, &rep));
    rep.seconds = Since(t0);
    const delta::PublishStats& p = rep.publish;
    WSYNC_LOG_INFO("delta: version {}: {} of {} tensors changed, {:.1f} MB compressed of {:.1f} MB ({:.2f}%); "
                   "publish {:.3f} s ({:.2f} GB/s on {} threads; source {:.3f} s, encode {:.3f} s summed over "
                   "threads, write {:.3f} s, {:.3f} CPU s), fetch {:.3f} s, pause {:.3f} s, start {:.3f} s, "
                   "reload {:.3f} s, finish {:.3f} s, resume {:.3f} s, total {:.3f} s",
                   v, p.changed_tensors, p.tensors, p.compressed_bytes / 1e6, p.model_bytes / 1e6,
                   p.model_bytes ? 100.0 * p.compressed_bytes / p.model_bytes : 0.0, p.seconds,
                   p.seconds > 0 ? p.model_bytes / p.seconds / 1e9 : 0.0, p.threads, p.stage_seconds,
                   p.encode_cpu_seconds, p.write_seconds, p.cpu_seconds, rep.fetch_seconds,
                   rep.pause_seconds, rep.start_seconds, rep.update_seconds, rep.finish_seconds,
                   rep.resume_seconds, rep.seconds);
    report_ = std::move(rep);
    SyncStats stats;
    stats.bytes = report_.publish.model_bytes;
    stats.tensors = report_.publish.tensors;
    stats.chunks = report_.publish.payload_files;
    stats.seconds = report_.seconds;
    stats.start_seconds = report_.pause_seconds + report_.start_seconds;
    stats.transfer_seconds = report_.publish.seconds + report_.fetch_seconds + report_.update_seconds;
    stats.finish_seconds = report_.finish_seconds + report_.resume_seconds;
    return stats;
  }

  const DeltaSyncReport& last_report() const override { return report_; }
  int64_t version() const override { return publisher_ ? publisher_->version() : 0; }
  void Shutdown() override { publisher_.reset(); }

 private:
  Deadline NewDeadline() const { return Deadline::InSeconds(options_.timeout_seconds); }

  // fetch (while serving) -> pause -> start -> update -> finish -> resume, timed.
  Status DriveServers(int64_t v, const std::string& uri, const std::optional<std::string>& weight_version,
                      DeltaSyncReport* rep) {
    auto t = Clock::now();
    json fetch{{"target_version", v}, {"sync_dir", options_.sync_dir}, {"uri", uri}};
    Result<std::vector<json>> fetched = client_.Post("/fetch_weights", fetch, NewDeadline());
    if (!fetched.ok()) return fetched.status().WithContext(fmt::format("fetching version {}", v));
    rep->fetch_replies = std::move(*fetched);
    rep->fetch_seconds = Since(t);

    t = Clock::now();
    Status s = client_.Post("/pause?mode=keep&clear_cache=false", json::object(), NewDeadline()).status();
    rep->pause_seconds = Since(t);
    if (s.ok()) s = Reload(v, uri, weight_version, rep);
    t = Clock::now();  // resume even after a partial pause: no server stays paused
    Status resumed = client_.Post("/resume", json::object(), NewDeadline()).status();
    rep->resume_seconds = Since(t);
    if (!s.ok()) return s;
    return resumed.WithContext("resuming generation");
  }

  Status Reload(int64_t v, const std::string& uri, const std::optional<std::string>& weight_version,
                DeltaSyncReport* rep) {
    auto t = Clock::now();
    WSYNC_RETURN_IF_ERROR(client_.Post("/start_weight_update", json::object(), NewDeadline()).status());
    rep->start_seconds = Since(t);
    t = Clock::now();
    json update{{"target_version", v}, {"version", v}, {"sync_dir", options_.sync_dir}, {"uri", uri}};
    Status s = client_.Post("/update_weights", json{{"update_info", update}}, NewDeadline()).status();
    if (!s.ok()) {
      // Servers whose update failed have ended their session already (409 is expected).
      (void)client_.Post("/finish_weight_update", json::object(), Deadline::InSeconds(10));
      return s.WithContext(fmt::format("reloading version {}", v));
    }
    rep->update_seconds = Since(t);
    t = Clock::now();
    json finish = json::object();
    if (weight_version) finish["weight_version"] = *weight_version;
    WSYNC_RETURN_IF_ERROR(client_.Post("/finish_weight_update", finish, NewDeadline()).status());
    rep->finish_seconds = Since(t);
    return Status::Ok();
  }

  TrainerOptions options_;
  DeltaTrainerOptions delta_;
  FanOutClient client_;
  std::unique_ptr<delta::DeltaPublisher> publisher_;
  DeltaSyncReport report_;
};

}  // namespace

Result<std::unique_ptr<DeltaTrainer>> NewDeltaTrainer(const TrainerOptions& options, DeltaTrainerOptions delta) {
  if (options.sync_dir.empty()) return InvalidArgument("the delta backend needs --sync-dir");
  if (options.timeout_seconds <= 0) return InvalidArgument("--timeout must be positive");
  if (options.max_file_gb <= 0) return InvalidArgument("--max-file-gb must be positive");
  if (options.rank != 0) {
    return InvalidArgument(fmt::format("trainer rank {} does not publish: only rank 0 builds a delta publisher "
                                       "(CreateDeltaTrainer gives the other ranks an engine that drains their "
                                       "source)", options.rank));
  }
  return std::unique_ptr<DeltaTrainer>(std::make_unique<DeltaTrainerImpl>(options, std::move(delta)));
}

Result<std::unique_ptr<TrainerEngine>> CreateDeltaTrainer(const TrainerOptions& options) {
  if (options.rank < 0) return InvalidArgument(fmt::format("trainer rank {} is negative", options.rank));
  // Rank 0 alone publishes; the others drain the one pass per sync its publisher makes
  // (as SkyRL's non-sender ranks iterate their sources).
  if (options.rank != 0) return NewNonSenderTrainer(options.rank, 1);
  DeltaTrainerOptions delta;
  delta.base_checkpoint = options.base_checkpoint;
  WSYNC_ASSIGN_OR_RETURN(auto engine, NewDeltaTrainer(options, delta));
  return std::unique_ptr<TrainerEngine>(std::move(engine));
}

}  // namespace wsync
