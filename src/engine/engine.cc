#include "engine/engine.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <map>
#include <string_view>
#include <thread>
#include <unordered_map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/env_knobs.h"
#include "core/log.h"
#include "core/stopwatch.h"

namespace wsync {
namespace {

// The source's metadata against the one Init planned for: the same tensors (name, dtype,
// shape), in any order (the order is the source's, and each sync's update says it).
Status CheckMetadata(const std::vector<TensorMeta>& planned,
                     const std::unordered_map<std::string_view, const TensorMeta*>& by_name,
                     const std::vector<TensorMeta>& got) {
  if (got == planned) return Status::Ok();
  for (const TensorMeta& m : got) {
    auto it = by_name.find(m.name);
    if (it == by_name.end()) {
      return InvalidArgument(fmt::format("the source's tensor {} is not in the metadata Init planned for", m.name));
    }
    WSYNC_RETURN_IF_ERROR(CheckSameMeta(*it->second, m).WithContext("the source's metadata differs from Init's"));
  }
  if (got.size() != planned.size()) {
    return InvalidArgument(fmt::format("the source's metadata lists {} tensors, Init's {}", got.size(),
                                       planned.size()));
  }
  return Status::Ok();
}

// The "wsync_lora" object of a lora session's start (docs/lora.md).
nlohmann::json LoraStartField(const LoraAdapterOptions& lora, const std::string& version) {
  nlohmann::json j{{"format", 1},
                   {"name", lora.name},
                   {"version", version},
                   {"r", lora.r},
                   {"alpha", lora.alpha},
                   {"use_rslora", lora.use_rslora},
                   {"target_modules", lora.target_modules}};
  if (!lora.dtype.empty()) j["dtype"] = lora.dtype;
  return j;
}

class Engine final : public TrainerEngine {
 public:
  Engine(const TrainerOptions& options, std::unique_ptr<DataPlane> plane)
      : options_(options), plane_(std::move(plane)), shape_(plane_->Shape()) {
    if (options_.rank == 0 && !options_.servers.empty()) {
      driver_ = std::make_unique<SessionDriver>(options_.servers, options_.api_key, options_.timeout_seconds);
      driver_->set_draft_sessions(options_.draft_session);
    }
  }
  ~Engine() override { Shutdown(); }

  Status Init(const WeightSource& source) override {
    held_ = source.HeldNames();
    held_rows_ = source.HeldRowRanges();
    held_checked_ = true;
    return InitMetadata(source.metadata());
  }

  Status Init(const std::vector<TensorMeta>& metadata) override {
    held_.reset();
    held_rows_.clear();
    held_checked_ = false;
    return InitMetadata(metadata);
  }

  Status InitMetadata(const std::vector<TensorMeta>& metadata) {
    metadata_ = metadata;
    by_name_.clear();
    for (const TensorMeta& m : metadata_) by_name_.emplace(m.name, &m);
    initialized_ = true;
    if (!Runs()) return Status::Ok();
    return InitPlane();
  }

  Result<SyncStats> SendWeights(WeightSource& source, const std::optional<std::string>& weight_version) override {
    return SendWeightsTo(source, weight_version, {});
  }

  Result<SyncStats> SendWeightsTo(WeightSource& source, const std::optional<std::string>& weight_version,
                                  const std::vector<int>& live_in) override {
    std::vector<int> live = live_in;
    if (static_cast<int>(live.size()) == static_cast<int>(options_.servers.size()) && options_.rank == 0) {
      live.clear();  // every server: the whole fleet
    }
    if (live != live_) {
      if (!live.empty()) {
        if (!shape_.serves_part_of_fleet) {
          return Unimplemented(fmt::format("backend {} syncs every server: it has no degraded sync",
                                           options_.backend));
        }
        for (size_t i = 0; i < live.size(); ++i) {
          const bool in_range = live[i] >= 0 && (options_.rank != 0 || live[i] < static_cast<int>(options_.servers.size()));
          if (!in_range || (i > 0 && live[i] <= live[i - 1])) {
            return InvalidArgument(fmt::format("live servers [{}]: give ascending indices into the servers (0..{})",
                                               fmt::join(live, ", "), options_.servers.size() - 1));
          }
        }
      }
      live_ = live;
      if (options_.rank == 0 && !options_.servers.empty()) {
        std::vector<std::string> urls;
        for (int i : live_) urls.push_back(options_.servers[i]);
        driver_ = std::make_unique<SessionDriver>(live_.empty() ? options_.servers : urls, options_.api_key,
                                                  options_.timeout_seconds);
        driver_->set_draft_sessions(options_.draft_session);
      }
      if (initialized_ && Runs()) {
        WSYNC_LOG_INFO("trainer rank {}: syncing {}; initializing the data plane for them", options_.rank,
                       live_.empty() ? std::string("every server") : fmt::format("servers [{}] only", fmt::join(live_, ", ")));
        plane_->Shutdown();
      }
    }
    Stopwatch total;
    SyncPass pass(source);
    SyncContext sync{pass, driver_.get(), weight_version, driver_ ? driver_->deadlines().Call()
                                                                   : Deadline::InSeconds(options_.timeout_seconds)};
    sync.progress = options_.progress;
    if (driver_) sync.reset_prefix_cache = [this] { return driver_->ResetPrefixCache(prefix_caching_); };
    sync.stats.tensors = source.metadata().size();
    if (!Runs()) return Drain(sync, total);
    if (!initialized_) return FailedPrecondition("call Init() before SendWeights()");
    Status mine = CheckMetadata(metadata_, by_name_, source.metadata());
    if (mine.ok() && held_checked_ && (source.HeldNames() != held_ || source.HeldRowRanges() != held_rows_)) {
      mine = InvalidArgument(fmt::format(
          "trainer rank {}: the source holds other names than the one Init() saw ({} then, {} now); call Init "
          "with the new source", options_.rank, held_ ? fmt::format("{} names", held_->size()) : "all",
          source.HeldNames() ? fmt::format("{} names", source.HeldNames()->size()) : "all"));
    }
    WSYNC_ASSIGN_OR_RETURN(bool ready, plane_->Ready(mine));
    if (!ready) {
      WSYNC_LOG_INFO("trainer rank {}: the data plane is down after a failed sync; initializing it again",
                     options_.rank);
      WSYNC_RETURN_IF_ERROR(InitPlane().WithContext("initializing the data plane again after a failed sync"));
    }
    if (options_.rank == 0 && options_.inline_verify && driver_ &&
        std::find(inline_servers_.begin(), inline_servers_.end(), true) != inline_servers_.end()) {
      pass.CollectDigests();
    }
    return options_.rank != 0 ? shape_.other_rank_sync(sync) : Sync(sync, total);
  }

  void Shutdown() override {
    if (plane_) plane_->Shutdown();
  }

 private:
  // Whether this rank runs the plane (else it only drains its source).
  bool Runs() const { return options_.rank == 0 || shape_.all_ranks(); }

  Status InitPlane() {
    PlaneInit init{options_, metadata_, nullptr, nullptr, held_, live_, &held_rows_};
    Fleet fleet;
    if (driver_) {
      WSYNC_ASSIGN_OR_RETURN(fleet, driver_->Discover());
      WSYNC_RETURN_IF_ERROR(driver_->CheckBackend(fleet, options_.backend));
      // Which servers cache prefixes: their caches are reset every sync.
      prefix_caching_ = driver_->PrefixCaching();
      inline_servers_ = fleet.inline_verification;
      std::vector<bool> vllm(fleet.health.size(), false);
      for (size_t i = 0; i < fleet.health.size(); ++i) {
        vllm[i] = fleet.health[i].is_object() && fleet.health[i].value("frontend", nlohmann::json()) == "vllm";
      }
      driver_->set_vllm_servers(std::move(vllm));
      for (size_t i = 0; i < prefix_caching_.size(); ++i) {
        if (prefix_caching_[i]) WSYNC_LOG_INFO("{} caches prefixes: each sync resets its cache", driver_->urls()[i]);
      }
      init.driver = driver_.get();
      init.fleet = &fleet;
    }
    return plane_->Init(init);
  }

  // A rank that sends nothing (its stats count no bytes): its source's one pass, checked.
  Result<SyncStats> Drain(SyncContext& sync, const Stopwatch& total) {
    Status s = sync.pass.ReadAll();
    if (!s.ok()) {
      return s.WithContext(fmt::format("trainer rank {} (its pass of the sync)", options_.rank));
    }
    sync.stats.seconds = sync.stats.transfer_seconds = total.seconds();
    return sync.stats;
  }

  // Rank 0's sync: Prepare, the shape's steps before start, the session, the shape's
  // step after it.
  Result<SyncStats> Sync(SyncContext& sync, const Stopwatch& total) {
    Status prepared = plane_->Prepare(sync);
    if (!prepared.ok()) return plane_->Abort(prepared, nullptr);
    Status before = BeforeStart(sync);
    Status s = before.ok() ? Session(sync) : plane_->Abort(before, nullptr);
    if (shape_.after_session) s = shape_.after_session(sync, s);
    if (!s.ok()) return s;
    sync.stats.seconds = total.seconds();
    if (shape_.account) shape_.account(&sync.stats);
    WSYNC_LOG_DEBUG("sync of {} bytes in {} chunks: start {:.2f} ms, data {:.2f} ms, finish {:.2f} ms, "
                    "total {:.2f} ms", sync.stats.bytes, sync.stats.chunks, sync.stats.start_seconds * 1e3,
                    sync.stats.transfer_seconds * 1e3, sync.stats.finish_seconds * 1e3, sync.stats.seconds * 1e3);
    return sync.stats;
  }

  // The shape's step before start, then the prefix-cache reset when it goes there.
  Status BeforeStart(SyncContext& sync) {
    if (shape_.before_start) WSYNC_RETURN_IF_ERROR(shape_.before_start(sync));
    if (shape_.prefix_cache_reset != PrefixCacheReset::kBeforeStart) return Status::Ok();
    return sync.reset_prefix_cache().WithContext("resetting the servers' prefix caches before start");
  }

  // start -> update in the background + the data plane -> finish; closes every server's
  // session on failure.
  Status Session(SyncContext& sync) {
    if (!driver_) {  // no servers (delta publishing alone): nothing to drive
      return shape_.transfer ? plane_->Transfer(sync, *NoServers()) : Status::Ok();
    }
    Stopwatch phase;
    if (options_.lora) {
      if (!sync.weight_version) {
        return plane_->Abort(InvalidArgument(fmt::format("a sync of LoRA adapter {} needs a weight_version (the "
                                                         "adapter version the servers install)",
                                                         options_.lora->name)),
                             nullptr);
      }
      driver_->set_start_fields(nlohmann::json{{"wsync_lora", LoraStartField(*options_.lora, *sync.weight_version)}});
    }
    Status started = driver_->Start(sync.pass.collects_digests() ? &inline_servers_ : nullptr);
    if (!started.ok()) {
      Status s = plane_->Abort(started, nullptr);
      driver_->Close();
      return s;
    }
    sync.stats.start_seconds = phase.Lap();
    if (const char* fault = WSYNC_ENV("WSYNC_FAULT_TRAINER_STALL"); fault && std::string_view(fault) == "after-start") {
      std::fprintf(stderr, "wsync fault injection: stalled after start_weight_update\n");
      std::fflush(stderr);
      for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
    }
    std::shared_ptr<SessionDriver::Pending> update = driver_->UpdateAsync(sync.update_body);
    Status s = shape_.transfer ? plane_->Transfer(sync, *update) : Status::Ok();
    if (s.ok()) s = update->Wait(driver_->deadlines().Http()).status();
    if (!s.ok()) {
      s = plane_->Abort(s, update.get());
      // A server still inside update_weights would refuse the closing finish and keep its
      // session open until the lease ends; the plane's abort ends those calls promptly.
      (void)update->Wait(driver_->deadlines().Close());
      driver_->Close();
      return s;
    }
    sync.stats.transfer_seconds = phase.Lap();
    // The prefix caches are reset here, after the new weights have landed and before
    // finish: a server serves nothing while a session is open (wsync's generation waits
    // for finish; a vLLM fleet is paused by its trainer around send_weights), so no entry
    // computed with the old weights can enter a cache between this reset and finish, and
    // from finish on every prefix is computed with the new version. A reset after finish
    // would leave a window where a request reuses an old-weights prefix.
    if (shape_.prefix_cache_reset == PrefixCacheReset::kBeforeFinish) {
      Status reset = sync.reset_prefix_cache();
      if (!reset.ok()) {
        driver_->Close();
        return reset.WithContext("resetting the servers' prefix caches before finish");
      }
    }
    WSYNC_RETURN_IF_ERROR(Finish(sync));
    sync.stats.finish_seconds = phase.Lap();
    return Status::Ok();
  }

  // finish_weight_update, with the pass's digests to the servers that verify in-line
  // (SyncStats says how many did); a server that verified fewer tensors than it was sent
  // without naming why fails the sync.
  Status Finish(SyncContext& sync) {
    const nlohmann::json digests = sync.pass.digest_set().Json();
    const bool verify = options_.inline_verify && sync.pass.complete() && sync.pass.digests_complete() &&
                        !digests.empty() &&
                        inline_servers_.size() == driver_->size();
    if (!verify) {
      if (options_.inline_verify) sync.stats.inline_unverified_servers = driver_->size();
      return driver_->Finish(sync.weight_version);
    }
    WSYNC_ASSIGN_OR_RETURN(std::vector<nlohmann::json> replies,
                           driver_->FinishVerified(sync.weight_version, digests, inline_servers_));
    sync.stats.inline_digests = digests.size();
    for (size_t i = 0; i < driver_->size(); ++i) {
      if (!inline_servers_[i]) {
        ++sync.stats.inline_unverified_servers;
        continue;
      }
      const nlohmann::json* v = i < replies.size() && replies[i].is_object() && replies[i].contains("verified")
                                    ? &replies[i]["verified"] : nullptr;
      const size_t tensors = v && v->is_object() ? v->value("tensors", size_t{0}) : 0;
      const size_t unverifiable =
          v && v->is_object() && v->contains("unverifiable") && (*v)["unverifiable"].is_object()
              ? (*v)["unverifiable"].size() : 0;
      if (tensors + unverifiable != digests.size()) {
        return DataLoss(fmt::format("{} declares in-line verification but verified {} of the {} tensors it was "
                                    "sent digests for ({} named unverifiable)",
                                    driver_->urls()[i], tensors, digests.size(), unverifiable));
      }
      if (sync.stats.inline_verified_servers++ == 0) sync.stats.inline_verified_tensors = tensors;
    }
    return Status::Ok();
  }

  // An update "in flight" to no server: answered at once.
  static std::shared_ptr<SessionDriver::Pending> NoServers() {
    class Answered final : public SessionDriver::Pending {
     public:
      Result<std::vector<nlohmann::json>> Wait(Deadline) override { return std::vector<nlohmann::json>{}; }
      bool Done() const override { return true; }
      bool AnyFailed() const override { return false; }
    };
    return std::make_shared<Answered>();
  }

  TrainerOptions options_;
  std::unique_ptr<DataPlane> plane_;
  SessionShape shape_;  // plane_'s, asked once
  std::unique_ptr<SessionDriver> driver_;  // rank 0 with servers
  std::vector<bool> prefix_caching_;       // per server, probed at each InitPlane
  std::vector<bool> inline_servers_;       // per server: declares in-line verification
  std::vector<TensorMeta> metadata_;       // what Init planned for
  std::optional<std::vector<std::string>> held_;  // the names Init's source held (nullopt: all)
  std::vector<HeldRows> held_rows_;  // the held names Init's source held rows of only
  bool held_checked_ = false;  // Init(source): each sync's source must hold held_
  std::vector<int> live_;      // a degraded sync's servers; empty: all
  std::unordered_map<std::string_view, const TensorMeta*> by_name_;  // into metadata_
  bool initialized_ = false;
};

}  // namespace

Status CheckServerUrl(const std::string& url) {
  std::string_view rest = url;
  if (size_t scheme = rest.find("://"); scheme != std::string_view::npos) {
    if (rest.substr(0, scheme) != "http") {
      return InvalidArgument(fmt::format("server URL '{}': only http:// is spoken (give http://HOST:PORT)", url));
    }
    rest.remove_prefix(scheme + 3);
  }
  while (!rest.empty() && rest.back() == '/') rest.remove_suffix(1);
  const size_t colon = rest.rfind(':');
  std::string_view host = colon == std::string_view::npos ? rest : rest.substr(0, colon);
  std::string_view port = colon == std::string_view::npos ? std::string_view() : rest.substr(colon + 1);
  if (host.starts_with('[') && host.ends_with(']')) host = host.substr(1, host.size() - 2);
  const bool host_ok = !host.empty() && std::all_of(host.begin(), host.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == '_' || c == ':';
  });
  int port_number = 0;
  auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), port_number);
  const bool port_ok = !port.empty() && ec == std::errc() && end == port.data() + port.size() && port_number > 0 &&
                       port_number < 65536;
  if (!host_ok || !port_ok) {
    return InvalidArgument(fmt::format("server URL '{}' is malformed: give http://HOST:PORT", url));
  }
  return Status::Ok();
}

Status CheckTrainerOptions(const TrainerOptions& options, bool servers_required) {
  if (options.rank < 0) return InvalidArgument(fmt::format("trainer rank {} is negative", options.rank));
  if (servers_required && options.rank == 0 && options.servers.empty()) {
    return InvalidArgument("no servers given: rank 0 needs the servers' URLs");
  }
  for (const std::string& url : options.servers) WSYNC_RETURN_IF_ERROR(CheckServerUrl(url));
  if (options.timeout_seconds <= 0) {
    return InvalidArgument(fmt::format("the timeout is {} s; it must be positive", options.timeout_seconds));
  }
  if (options.bucket_gb <= 0) {
    return InvalidArgument(fmt::format("the bucket size is {} GB; it must be positive", options.bucket_gb));
  }
  return Status::Ok();
}

Result<std::unique_ptr<TrainerEngine>> NewTrainerEngine(const TrainerOptions& options,
                                                        std::unique_ptr<DataPlane> plane) {
  return std::unique_ptr<TrainerEngine>(std::make_unique<Engine>(options, std::move(plane)));
}

}  // namespace wsync
