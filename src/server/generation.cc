#include "server/generation.h"

#include <algorithm>
#include <ctime>

#include <fmt/format.h>

#include "core/log.h"

namespace wsync {

using nlohmann::json;

struct Generator::Request {
  std::string id;
  std::vector<int32_t> prompt;
  std::string adapter;  // empty: the base model
  int max_tokens = 0;
  Clock::time_point arrived;
  int64_t created = 0;  // unix seconds
  // Written by the scheduler under mu_ (state only by the scheduler thread).
  uint64_t state = kInitialState;
  bool prefilled = false;
  bool recompute = false;  // set by ResetPrefixCache(reset_running_requests)
  int cached_tokens = 0;
  std::vector<int32_t> tokens;
  std::vector<std::string> versions;
  Clock::time_point next_at;
  std::optional<Clock::time_point> blocked_since;  // waiting for a pause or the weights
  std::string blocked_on;
  bool done = false;
  std::string finish_reason;
  Status error;
};

Result<std::unique_ptr<Generator>> Generator::Create(const GeneratorOptions& options, WithWeights with_weights) {
  if (options.limits.vocab_size <= 0) return InvalidArgument("the generator needs a vocabulary size");
  if (options.token_interval_ms < 0) {
    return InvalidArgument(fmt::format("--token-interval-ms {} must be >= 0", options.token_interval_ms));
  }
  std::unique_ptr<Generator> g(new Generator(options, std::move(with_weights)));
  WSYNC_ASSIGN_OR_RETURN(g->cache_, PrefixCache::Create(options.kv_cache_bytes, options.kv_block_bytes));
  g->scheduler_ = std::thread([p = g.get()] { p->Loop(); });
  return g;
}

Generator::Generator(GeneratorOptions options, WithWeights with_weights)
    : options_(std::move(options)), with_weights_(std::move(with_weights)) {}

Generator::~Generator() {
  Shutdown();
  if (scheduler_.joinable()) scheduler_.join();
}

void Generator::Shutdown() {
  std::lock_guard lock(mu_);
  if (stopping_) return;
  stopping_ = true;
  std::vector<std::shared_ptr<Request>> all(running_.begin(), running_.end());
  all.insert(all.end(), queued_.begin(), queued_.end());
  for (auto& r : all) {
    FinishLocked(r, "", Unavailable(fmt::format("request {} ended after {} of {} tokens: the server is shutting down",
                                                r->id, r->tokens.size(), r->max_tokens)));
  }
  wake_cv_.notify_all();
}

void Generator::FinishLocked(const std::shared_ptr<Request>& r, std::string_view reason, Status error) {
  if (r->done) return;
  r->done = true;
  r->finish_reason = std::string(reason);
  r->error = std::move(error);
  std::erase(running_, r);
  std::erase(queued_, r);
  by_id_.erase(r->id);
  if (!r->error.ok()) {
    ++failed_;
  } else if (reason == "abort") {
    ++aborted_;
  } else {
    ++completed_;
  }
  done_cv_.notify_all();
}

Result<json> Generator::Complete(const json& body) {
  WSYNC_ASSIGN_OR_RETURN(CompletionRequest req, ParseCompletionRequest(body, options_.limits));
  return Run(std::move(req));
}

Result<json> Generator::Run(CompletionRequest req) {
  auto r = std::make_shared<Request>();
  r->prompt = std::move(req.prompt);
  r->adapter = std::move(req.adapter);
  r->max_tokens = req.max_tokens;
  r->arrived = Clock::now();
  r->created = static_cast<int64_t>(std::time(nullptr));
  std::unique_lock lock(mu_);
  if (stopping_) return Unavailable("the server is shutting down; it takes no completions");
  r->id = req.request_id.empty() ? fmt::format("cmpl-{}", next_id_++) : std::move(req.request_id);
  if (by_id_.contains(r->id)) {
    return InvalidArgument(fmt::format("field 'request_id': request {} is already running", r->id));
  }
  by_id_[r->id] = r;
  queued_.push_back(r);
  wake_cv_.notify_all();
  // The scheduler ends every request: it finishes, is aborted, or times out waiting. This
  // wait gives up only when the request makes no progress for longer than that.
  const auto stall = std::chrono::duration<double>(options_.timeout_seconds + 5);
  size_t seen = 0;
  auto progress_at = Clock::now();
  while (!r->done) {
    done_cv_.wait_for(lock, std::chrono::milliseconds(200));
    if (r->tokens.size() != seen) {
      seen = r->tokens.size();
      progress_at = Clock::now();
    } else if (!r->done && Clock::now() - progress_at > stall) {
      FinishLocked(r, "", DeadlineExceeded(fmt::format("request {} made no progress for {} s after {} of {} tokens",
                                                       r->id, options_.timeout_seconds + 5, r->tokens.size(),
                                                       r->max_tokens)));
    }
  }
  if (!r->error.ok()) return r->error;
  return ReplyLocked(*r);
}

json Generator::ReplyLocked(const Request& r) const {
  const size_t n = r.tokens.size();
  std::string version = r.versions.empty() ? std::string() : r.versions.back();
  json choice{{"index", 0},
              {"text", RenderTokens(r.tokens)},
              {"token_ids", r.tokens},
              {"logprobs", nullptr},
              {"finish_reason", r.finish_reason},
              {"stop_reason", nullptr},
              {"weight_versions", r.versions}};
  json out{{"id", r.id},
           {"object", "text_completion"},
           {"created", r.created},
           {"model", r.adapter.empty() ? options_.limits.model : r.adapter},
           {"choices", json::array({std::move(choice)})},
           {"usage",
            {{"prompt_tokens", r.prompt.size()},
             {"completion_tokens", n},
             {"total_tokens", r.prompt.size() + n},
             {"prompt_tokens_details", {{"cached_tokens", r.cached_tokens}}}}}};
  out["weight_version"] = r.versions.empty() ? json(nullptr) : json(version);
  return out;
}

namespace {

// One request's part of a step, computed without the lock.
struct Work {
  bool prefill = false;        // first step, or a recompute
  bool use_cache = false;
  int cached = 0;
  uint64_t state = 0;
  int32_t token = 0;
  std::string version;  // a request naming an adapter: the adapter's version
  Status error;
};

}  // namespace

void Generator::Loop() {
  std::unique_lock lock(mu_);
  using std::chrono::duration;
  using std::chrono::duration_cast;
  const auto timeout = duration_cast<Clock::duration>(duration<double>(options_.timeout_seconds));
  const auto interval = duration_cast<Clock::duration>(duration<double, std::milli>(options_.token_interval_ms));
  const auto poll = std::chrono::milliseconds(2);
  while (!stopping_) {
    auto now = Clock::now();
    if (!paused_) {
      for (auto& r : queued_) {
        r->next_at = now;
        running_.push_back(r);
      }
      queued_.clear();
    }
    // Requests that waited too long for a resume or for the weights end with an error.
    std::vector<std::shared_ptr<Request>> late;
    for (auto& r : queued_) {
      if (now - r->arrived > timeout) late.push_back(r);
    }
    for (auto& r : late) {
      FinishLocked(r, "", DeadlineExceeded(fmt::format(
                              "request {} waited {} s in the queue for generation to resume (paused, mode {})", r->id,
                              options_.timeout_seconds, pause_mode_)));
    }
    const bool frozen = paused_ && pause_mode_ == "keep";
    late.clear();
    for (auto& r : running_) {
      if (frozen && !r->blocked_since) {
        r->blocked_since = now;
        r->blocked_on = "generation to resume (paused, mode keep)";
      }
      if (r->blocked_since && now - *r->blocked_since > timeout) late.push_back(r);
    }
    for (auto& r : late) {
      FinishLocked(r, "", DeadlineExceeded(fmt::format("request {} waited {} s for {} after {} of {} tokens", r->id,
                                                       options_.timeout_seconds, r->blocked_on, r->tokens.size(),
                                                       r->max_tokens)));
    }
    // The requests due now; otherwise sleep until the next one is due.
    std::vector<std::shared_ptr<Request>> due;
    auto wake_at = now + timeout;
    if (!frozen) {
      for (auto& r : running_) {
        if (r->next_at <= now) {
          due.push_back(r);
        } else {
          wake_at = std::min(wake_at, r->next_at);
        }
      }
    }
    for (auto& r : running_) {
      if (r->blocked_since) wake_at = std::min(wake_at, *r->blocked_since + timeout);
    }
    for (auto& r : queued_) wake_at = std::min(wake_at, r->arrived + timeout);
    if (due.empty()) {
      wake_cv_.wait_until(lock, wake_at);
      continue;
    }
    std::vector<Work> work(due.size());
    for (size_t i = 0; i < due.size(); ++i) {
      Request& r = *due[i];
      work[i].prefill = !r.prefilled || r.recompute;
      work[i].use_cache = !r.prefilled && !r.recompute && r.adapter.empty();
      work[i].state = r.state;
    }
    in_step_ = true;
    lock.unlock();

    // The step: reads only what the scheduler alone writes (state, tokens, the prompt).
    std::string why;
    std::string version;
    bool ran = false;
    Status thrown;
    try {
      ran = with_weights_(
          [&](const Probe& probe, const std::string& v) {
            version = v;
            for (size_t i = 0; i < due.size(); ++i) {
              const Request& r = *due[i];
              Work& w = work[i];
              std::optional<uint64_t> adapter_key;
              if (!r.adapter.empty()) {
                Result<std::pair<uint64_t, std::string>> a =
                    options_.adapter ? options_.adapter(r.adapter)
                                     : Result<std::pair<uint64_t, std::string>>(
                                           NotFound(fmt::format("no LoRA adapter named {}", r.adapter)));
                if (!a.ok()) {
                  w.error = a.status().WithContext(fmt::format("request {}", r.id));
                  continue;
                }
                adapter_key = a->first;
                w.version = std::move(a->second);
              }
              auto absorb = [&](int32_t t) -> bool {
                Result<uint64_t> p = probe(t);
                if (!p.ok()) {
                  w.error = p.status().WithContext(fmt::format("request {}: reading the weights of token {}", r.id, t));
                  return false;
                }
                w.state = AbsorbToken(w.state, t, adapter_key ? GenerationMix(*p ^ *adapter_key) : *p);
                return true;
              };
              bool ok = true;
              if (w.prefill) {
                w.state = kInitialState;
                size_t start = 0;
                if (w.use_cache) {
                  uint64_t cached_state = 0;
                  start = cache_->Lookup(r.prompt, r.prompt.size() - 1, &cached_state);
                  if (start > 0) w.state = cached_state;
                  w.cached = static_cast<int>(start);
                }
                std::vector<uint64_t> block_states(start / PrefixCache::kBlockTokens);
                for (size_t k = start; ok && k < r.prompt.size(); ++k) {
                  ok = absorb(r.prompt[k]);
                  if ((k + 1) % PrefixCache::kBlockTokens == 0) block_states.push_back(w.state);
                }
                if (ok && w.use_cache) cache_->Insert(r.prompt, block_states, start / PrefixCache::kBlockTokens);
                for (size_t k = 0; ok && k < r.tokens.size(); ++k) ok = absorb(r.tokens[k]);  // a recompute
              } else {
                ok = absorb(r.tokens.back());
              }
              if (ok) w.token = static_cast<int32_t>(SampleToken(w.state, options_.limits.vocab_size));
            }
          },
          &why);
    } catch (const std::exception& e) {
      thrown = Internal(fmt::format("a generation step threw: {}", e.what()));
    }

    lock.lock();
    in_step_ = false;
    now = Clock::now();
    for (size_t i = 0; i < due.size(); ++i) {
      const std::shared_ptr<Request>& r = due[i];
      if (r->done) continue;  // aborted during the step
      if (!thrown.ok()) {
        FinishLocked(r, "", thrown.WithContext(fmt::format("request {}", r->id)));
        continue;
      }
      if (!ran) {
        if (!r->blocked_since) {
          r->blocked_since = now;
          r->blocked_on = why;
        }
        r->next_at = now + poll;
        continue;
      }
      Work& w = work[i];
      if (!w.error.ok()) {
        FinishLocked(r, "", w.error);
        continue;
      }
      r->blocked_since.reset();
      r->state = w.state;
      if (w.prefill) {
        if (!r->prefilled) r->cached_tokens = w.cached;
        r->prefilled = true;
        r->recompute = false;
      }
      r->tokens.push_back(w.token);
      r->versions.push_back(r->adapter.empty() ? version : w.version);
      r->next_at = now + interval;
      if (static_cast<int>(r->tokens.size()) >= r->max_tokens) {
        FinishLocked(r, "length");
      }
    }
    done_cv_.notify_all();
  }
}

Status Generator::WaitStepLocked(std::unique_lock<std::mutex>& lock, std::string_view what) {
  auto deadline = Clock::now() + std::chrono::duration<double>(options_.timeout_seconds);
  if (!done_cv_.wait_until(lock, deadline, [&] { return !in_step_; })) {
    return DeadlineExceeded(fmt::format("{}: a generation step still runs after {} s", what, options_.timeout_seconds));
  }
  return Status::Ok();
}

Status Generator::Pause(std::string_view mode, bool clear_cache) {
  if (mode != "abort" && mode != "wait" && mode != "keep") {
    return InvalidArgument(fmt::format("unknown pause mode '{}': use abort, wait or keep (query parameter 'mode')",
                                       mode.substr(0, 64)));
  }
  std::unique_lock lock(mu_);
  paused_ = true;
  pause_mode_ = std::string(mode);
  wake_cv_.notify_all();
  if (mode == "wait") {
    auto deadline = Clock::now() + std::chrono::duration<double>(options_.timeout_seconds);
    if (!done_cv_.wait_until(lock, deadline, [&] { return running_.empty() && !in_step_; })) {
      std::string still;
      for (const auto& r : running_) {
        if (!still.empty()) still += ", ";
        still += fmt::format("{} ({} of {} tokens)", r->id, r->tokens.size(), r->max_tokens);
      }
      return DeadlineExceeded(fmt::format(
          "pause (mode wait) gave up after {} s: requests still run: {}; generation stays paused (POST /resume "
          "or pause with mode abort)",
          options_.timeout_seconds, still.empty() ? "none (a step is in progress)" : still));
    }
  } else {
    WSYNC_RETURN_IF_ERROR(WaitStepLocked(lock, fmt::format("pause (mode {})", mode)));
  }
  if (mode == "abort") {
    std::vector<std::shared_ptr<Request>> all(running_.begin(), running_.end());
    all.insert(all.end(), queued_.begin(), queued_.end());
    for (auto& r : all) FinishLocked(r, "abort");
  }
  if (clear_cache && mode != "keep") cache_->Clear();
  return Status::Ok();
}

Status Generator::Resume() {
  std::lock_guard lock(mu_);
  paused_ = false;
  pause_mode_.clear();
  for (auto& r : running_) r->blocked_since.reset();
  wake_cv_.notify_all();
  return Status::Ok();
}

bool Generator::IsPaused() const {
  std::lock_guard lock(mu_);
  return paused_;
}

int Generator::Abort(const std::vector<std::string>& request_ids) {
  std::lock_guard lock(mu_);
  std::vector<std::shared_ptr<Request>> targets;
  if (request_ids.empty()) {
    targets.assign(running_.begin(), running_.end());
    targets.insert(targets.end(), queued_.begin(), queued_.end());
  } else {
    for (const std::string& id : request_ids) {
      if (auto it = by_id_.find(id); it != by_id_.end()) targets.push_back(it->second);
    }
  }
  int n = 0;
  for (auto& r : targets) {
    if (r->done) continue;
    FinishLocked(r, "abort");
    ++n;
  }
  return n;
}

bool Generator::ResetPrefixCache(bool reset_running_requests) {
  std::lock_guard lock(mu_);
  if (!running_.empty() && !reset_running_requests) return false;
  for (auto& r : running_) {
    if (r->prefilled) r->recompute = true;
  }
  cache_->Clear();
  return true;
}

Status Generator::DropKvCache() { return cache_->Drop(); }
Status Generator::RestoreKvCache() { return cache_->Restore(); }
size_t Generator::kv_cache_bytes_resident() const { return cache_->resident_bytes(); }

json Generator::Health() const {
  json cache = cache_->Health();
  std::lock_guard lock(mu_);
  return json{{"running", running_.size()},
              {"waiting", queued_.size()},
              {"paused", paused_},
              {"pause_mode", paused_ ? json(pause_mode_) : json(nullptr)},
              {"completed", completed_},
              {"aborted", aborted_},
              {"failed", failed_},
              {"token_interval_ms", options_.token_interval_ms},
              {"prefix_cache", std::move(cache)}};
}

}  // namespace wsync
