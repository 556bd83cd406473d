#include "engine/rank_outcomes.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "comm/store.h"
#include "core/deadline.h"
#include "core/log.h"
#include "engine/rank_exchange.h"

namespace wsync {
namespace {

constexpr auto kBeatEvery = std::chrono::seconds(1);
constexpr auto kPollEvery = std::chrono::milliseconds(50);
// One store request on these paths: short, so that a dead store is noticed promptly.
constexpr double kRequestSeconds = 1;
// A store that stays unreachable this long means rank 0's process is gone.
constexpr double kStoreGoneSeconds = 3;
// How long rank 0 keeps its store up for ranks that give no sign of life (Linger).
constexpr double kLingerSilentSeconds = 5;
// Rounds kept on rank 0's store (older ones are erased at Begin).
constexpr size_t kRoundsKept = 4;

std::string Key(const std::string& round, const char* kind, int rank) {
  return fmt::format("{}/{}/{}", round, kind, rank);
}

}  // namespace

struct RankOutcomes::Impl {
  RankOutcomesOptions options;
  std::unique_ptr<StoreServer> server;  // rank 0
  std::optional<StoreClient> client;
  std::deque<std::string> rounds;       // rank 0: the rounds its store holds
  std::string posted;                   // the round whose failure this rank posted
  std::string current;                  // the round begun last
  bool ended = true;                    // End ran for `current`

  std::mutex mu;
  std::condition_variable cv;
  bool beating = false;                 // GUARDED_BY(mu)
  std::thread beat;

  void StopBeat() {
    {
      std::lock_guard lock(mu);
      beating = false;
    }
    cv.notify_all();
    if (beat.joinable()) beat.join();
  }

  // The failure posted for `round` by the lowest-numbered rank, with that rank; none when
  // none is posted or the store cannot be read. `error`: the store's error, if any.
  std::optional<std::pair<int, Status>> Posted(const std::string& round, Status* error) const {
    std::vector<std::string> keys;
    for (int r = 0; r < options.world_size; ++r) keys.push_back(Key(round, "failed", r));
    Deadline deadline = Deadline::InSeconds(kRequestSeconds);
    Result<std::vector<std::string>> missing = client->Missing(keys, deadline);
    if (!missing.ok()) {
      if (error) *error = missing.status();
      return std::nullopt;
    }
    for (int r = 0; r < options.world_size; ++r) {
      if (std::find(missing->begin(), missing->end(), keys[r]) != missing->end()) continue;
      Result<std::vector<char>> value = client->Get(keys[r], deadline);
      if (!value.ok()) {
        if (error) *error = value.status();
        return std::nullopt;
      }
      nlohmann::json j = nlohmann::json::parse(value->begin(), value->end(), nullptr, false);
      if (j.is_discarded()) j = nlohmann::json::object();
      return std::make_pair(r, StatusFromJson(j, ""));
    }
    return std::nullopt;
  }

  void Post(const std::string& round, const Status& cause) {
    if (posted == round || cause.ok()) return;
    if (Posted(round, nullptr)) return;  // another rank's failure came first: this is its consequence
    std::string text = StatusToJson(cause).dump();
    (void)client->Set(Key(round, "failed", options.rank), std::vector<char>(text.begin(), text.end()),
                      Deadline::InSeconds(kRequestSeconds));
    posted = round;
  }

  // This rank's view of the round's outcome (RankOutcomes::End).
  Status Outcome(const std::string& round, const Status& mine);

  // Rank 0, before its store goes: waits until every other rank has read the outcome of
  // the round begun last, for at most the timeout, and no longer once every rank yet to
  // read it has been silent (no heartbeat for the round) for kLingerSilentSeconds. A rank
  // that returned from End before the others read the board would otherwise take the
  // store, and the root cause, with it.
  void Linger() {
    using Clock = std::chrono::steady_clock;
    const Deadline deadline = Deadline::InSeconds(options.timeout_seconds);
    std::map<int, std::string> beats;
    Clock::time_point life = Clock::now();
    for (;;) {
      std::vector<int> unread;
      for (int r = 1; r < options.world_size; ++r) {
        Result<std::vector<std::string>> missing =
            client->Missing({Key(current, "seen", r)}, Deadline::InSeconds(kRequestSeconds));
        if (!missing.ok() || !missing->empty()) unread.push_back(r);
      }
      if (unread.empty()) return;
      for (int r : unread) {
        Result<std::vector<char>> b = client->Get(Key(current, "beat", r), Deadline::InSeconds(0.05));
        std::string beat = b.ok() ? std::string(b->begin(), b->end()) : std::string();
        auto [it, added] = beats.emplace(r, beat);
        if (!added && it->second != beat) {
          it->second = beat;
          life = Clock::now();
        }
      }
      const double silent = std::chrono::duration<double>(Clock::now() - life).count();
      if (deadline.expired() || silent >= kLingerSilentSeconds) {
        WSYNC_LOG_WARN("trainer rank 0: closing the trainer group store with the outcome of sync {} unread by "
                       "trainer rank(s) {} ({})", current, fmt::join(unread, ", "),
                       deadline.expired() ? fmt::format("the timeout of {:.1f} s passed", options.timeout_seconds)
                                          : fmt::format("silent for {:.1f} s", silent));
        return;
      }
      std::this_thread::sleep_for(kPollEvery);
    }
  }

  Status PeerFailed(int rank, const Status& cause, const Status& mine) const {
    std::string text = fmt::format("trainer rank {} failed: {}", rank, cause.message());
    if (!mine.ok()) text += fmt::format(" (on trainer rank {}: {})", options.rank, mine.message());
    return Status(cause.code(), text);
  }
};

RankOutcomes::RankOutcomes(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

RankOutcomes::~RankOutcomes() {
  Impl& m = *impl_;
  if (!m.ended) {
    Fail(m.current, Aborted(fmt::format("trainer rank {}'s engine was shut down during sync {}", m.options.rank,
                                        m.current)));
    (void)m.client->Set(Key(m.current, "done", m.options.rank), {'f'}, Deadline::InSeconds(kRequestSeconds));
    if (m.options.rank != 0) {
      (void)m.client->Set(Key(m.current, "seen", m.options.rank), {'1'}, Deadline::InSeconds(kRequestSeconds));
    }
  }
  m.StopBeat();
  if (m.server && !m.current.empty()) m.Linger();
}

Result<std::unique_ptr<RankOutcomes>> RankOutcomes::Create(const RankOutcomesOptions& options) {
  if (options.world_size < 1 || options.rank < 0 || options.rank >= options.world_size) {
    return InvalidArgument(fmt::format("trainer rank {} is outside world_size {}", options.rank, options.world_size));
  }
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  if (options.rank == 0) {
    WSYNC_ASSIGN_OR_RETURN(impl->server, StoreServer::Start(options.store_host, options.store_port));
    impl->options.store_port = impl->server->port();
  } else if (options.store_port <= 0) {
    return InvalidArgument(fmt::format("trainer rank {} needs the port of rank 0's trainer group store",
                                       options.rank));
  }
  impl->client.emplace(options.store_host, impl->options.store_port, "trainer");
  return std::unique_ptr<RankOutcomes>(new RankOutcomes(std::move(impl)));
}

int RankOutcomes::port() const { return impl_->options.store_port; }

void RankOutcomes::Begin(const std::string& round) {
  Impl& m = *impl_;
  m.StopBeat();
  m.current = round;
  m.ended = false;
  if (m.server) {
    m.rounds.push_back(round);
    while (m.rounds.size() > kRoundsKept) {
      m.server->ErasePrefix("trainer/" + m.rounds.front() + "/");
      m.rounds.pop_front();
    }
  }
  {
    std::lock_guard lock(m.mu);
    m.beating = true;
  }
  m.beat = std::thread([&m, key = Key(round, "beat", m.options.rank)] {
    uint64_t n = 0;
    std::unique_lock lock(m.mu);
    while (m.beating) {
      lock.unlock();
      std::string text = std::to_string(++n);
      (void)m.client->Set(key, std::vector<char>(text.begin(), text.end()), Deadline::InSeconds(kRequestSeconds));
      lock.lock();
      m.cv.wait_for(lock, kBeatEvery, [&] { return !m.beating; });
    }
  });
}

void RankOutcomes::Fail(const std::string& round, const Status& cause) { impl_->Post(round, cause); }

std::vector<int> RankOutcomes::Silent(const std::string& round, double window) {
  Impl& m = *impl_;
  const int n = m.options.world_size;
  auto read = [&](int r) -> std::string {
    Result<std::vector<char>> b = m.client->Get(Key(round, "beat", r), Deadline::InSeconds(0.05));
    return b.ok() ? std::string(b->begin(), b->end()) : std::string();
  };
  std::vector<std::string> first(n);
  std::vector<bool> beat(n, false);
  beat[m.options.rank] = true;
  for (int r = 0; r < n; ++r) {
    if (!beat[r]) first[r] = read(r);
  }
  const Deadline deadline = Deadline::InSeconds(window);
  while (!deadline.expired() && std::find(beat.begin(), beat.end(), false) != beat.end()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    for (int r = 0; r < n; ++r) {
      if (!beat[r]) beat[r] = read(r) != first[r];
    }
  }
  std::vector<int> silent;
  for (int r = 0; r < n; ++r) {
    if (!beat[r]) silent.push_back(r);
  }
  return silent;
}

Status RankOutcomes::End(const std::string& round, const Status& mine) {
  Impl& m = *impl_;
  Status outcome = m.Outcome(round, mine);
  if (round == m.current) m.ended = true;
  if (m.options.rank != 0) {
    (void)m.client->Set(Key(round, "seen", m.options.rank), {'1'}, Deadline::InSeconds(kRequestSeconds));
  }
  return outcome;
}

Status RankOutcomes::Impl::Outcome(const std::string& round, const Status& mine) {
  Impl& m = *this;
  const RankOutcomesOptions& o = m.options;
  if (!mine.ok()) {
    m.Post(round, mine);
    m.StopBeat();
    (void)m.client->Set(Key(round, "done", o.rank), {'f'}, Deadline::InSeconds(kRequestSeconds));
    auto root = m.Posted(round, nullptr);
    if (root && root->first != o.rank) return m.PeerFailed(root->first, root->second, mine);
    return mine;
  }
  (void)m.client->Set(Key(round, "done", o.rank), {'o'}, Deadline::InSeconds(kRequestSeconds));
  m.StopBeat();
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  std::map<int, std::pair<std::string, Clock::time_point>> beats;  // last beat seen, and when
  std::optional<Clock::time_point> unreachable_since;
  for (;;) {
    Status error;
    if (auto root = m.Posted(round, &error)) return m.PeerFailed(root->first, root->second, mine);
    std::vector<std::string> done;
    std::vector<int> ranks;
    for (int r = 0; r < o.world_size; ++r) {
      if (r == o.rank) continue;
      done.push_back(Key(round, "done", r));
      ranks.push_back(r);
    }
    Result<std::vector<std::string>> missing =
        error.ok() ? m.client->Missing(done, Deadline::InSeconds(kRequestSeconds)) : Result<std::vector<std::string>>(error);
    const auto now = Clock::now();
    if (!missing.ok()) {
      if (!unreachable_since) unreachable_since = now;
      if (std::chrono::duration<double>(now - *unreachable_since).count() >= kStoreGoneSeconds) {
        return Unavailable(fmt::format(
            "trainer rank 0's group store at {} stopped answering while this rank waited for the other ranks' "
            "outcome of sync {} (rank 0's process is gone?): {}", m.client->url(), round, missing.status().message()));
      }
    } else {
      unreachable_since.reset();
      if (missing->empty()) {
        // A failure may have been posted between the look above and this one.
        if (auto root = m.Posted(round, nullptr)) return m.PeerFailed(root->first, root->second, mine);
        return Status::Ok();
      }
      for (size_t i = 0; i < ranks.size(); ++i) {
        if (std::find(missing->begin(), missing->end(), done[i]) == missing->end()) continue;
        const int r = ranks[i];
        std::string beat;
        if (Result<std::vector<char>> b = m.client->Get(Key(round, "beat", r), Deadline::InSeconds(0.05)); b.ok()) {
          beat.assign(b->begin(), b->end());
        }
        auto it = beats.find(r);
        if (it == beats.end() || it->second.first != beat) {
          beats[r] = {beat, it == beats.end() && beat.empty() ? start : now};
          continue;
        }
        const double silent = std::chrono::duration<double>(now - it->second.second).count();
        if (silent >= o.timeout_seconds) {
          return DeadlineExceeded(fmt::format(
              "trainer rank {} gave no sign of life for {:.1f} s while this rank waited for its outcome of sync {}",
              r, silent, round));
        }
      }
    }
    std::this_thread::sleep_for(kPollEvery);
  }
}

}  // namespace wsync
