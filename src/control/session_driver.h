// SessionDriver: the trainer's typed calls to its fleet of servers.
//
// One driver per trainer engine (rank 0) talks to every server with one FanOutClient: each
// call fans out to all servers concurrently, waits for all, and fails with the first
// server's error carrying the server's own message (client.h). The driver spells every
// route through control/routes.h and builds every body, so no other trainer code knows
// about HTTP. Stateful calls are never retried.
//
// Deadlines follow one policy (DeadlinePolicy): a call the trainer waits on is bounded by
// the trainer's timeout; the servers are handed a slightly shorter one (server_timeout()),
// so that a server left waiting answers with its account before the trainer's own wait
// ends; calls that wait on the data plane (init of a group, the update in flight) allow
// kHttpGraceSeconds past the trainer's deadline for that answer; the best-effort close
// after a failure waits at most kCloseTimeoutSeconds.
//
// Thread-safe (the client is); a Pending may be waited on from any thread.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "control/client.h"
#include "core/deadline.h"
#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync {

struct DeadlinePolicy {
  // Past the trainer's deadline, for the servers' answer to a call that waits on the data
  // plane (their own waits end at server_timeout(), earlier).
  static constexpr double kHttpGraceSeconds = 5;
  // The best-effort finish that closes sessions after a failed sync.
  static constexpr double kCloseTimeoutSeconds = 10;

  double timeout_seconds = 300;  // the trainer's bound on every wait

  Deadline Call() const { return Deadline::InSeconds(timeout_seconds); }
  Deadline Http() const { return Deadline::InSeconds(timeout_seconds + kHttpGraceSeconds); }
  Deadline Close() const { return Deadline::InSeconds(kCloseTimeoutSeconds); }
  // The bound a trainer hands the servers in init_info: a little under its own.
  double server_timeout() const;
};

// What GET /health and /get_world_size tell a trainer about its fleet, in server order.
struct Fleet {
  std::vector<nlohmann::json> health;  // each server's /health body
  // Every server says "server": "wsync" (else: a plain vLLM fleet, and `other` names the
  // first server that does not).
  bool wsync = true;
  // Per server: whether its /health declares "inline_verification": "xxh3_128" (it
  // takes digests with finish_weight_update; vLLM's own engines reject unknown keys).
  std::vector<bool> inline_verification;
  std::string other;
  // Worker counts from /get_world_size?include_dp=true (filled by WorldSizes()).
  std::vector<int> world_sizes;
};

// The /health a vLLM server running wsync's plugin would give, from its /server_info
// reply (vLLM's config as JSON): {"server": "wsync", "frontend": "vllm", "tp", "pp", "dp",
// "dp_rank": -1}; nullopt when the reply is not such a server's.
std::optional<nlohmann::json> VllmWsyncHealth(const nlohmann::json& server_info);

// {"checksums": {name: hex}, "not_held": [name, ...]} of a /collective_rpc
// wsync_weight_digests reply ({"results": [{"checksums", "not_held"}, ...]}, one per
// worker: every worker reads back the whole model; a name some worker digests is held). Internal naming the server when the reply has no such result or two
// workers disagree about a tensor.
Result<nlohmann::json> MergeWorkerChecksums(const nlohmann::json& reply, std::string_view server);

// The "verified" object of a wsync server's verified finish ({"tensors", "algorithm",
// "unverifiable"}) from a vLLM server's /collective_rpc wsync_inline_digests reply
// ({"results": [{"tensors", "not_landed", "differing", "differ"}, ...]}, one per worker)
// for `digests` digests sent: a tensor is verified where some worker landed it, and
// unverifiable where none did. DataLoss naming the tensors when any worker's differ;
// Internal when the reply has no such results.
Result<nlohmann::json> MergeInlineResults(const nlohmann::json& reply, size_t digests, std::string_view server);

class SessionDriver {
 public:
  // A fan-out call in flight: Wait() returns every server's reply or the first error.
  using Pending = FanOutClient::Pending;

  SessionDriver(std::vector<std::string> servers, std::string api_key, double timeout_seconds);

  const std::vector<std::string>& urls() const { return client_.urls(); }
  size_t size() const { return client_.urls().size(); }
  // Whether Start opens draft sessions (/start_draft_weight_update: the servers' MTP
  // drafter alone, SkyRL's draft_session) instead of /start_weight_update.
  void set_draft_sessions(bool draft) { draft_sessions_ = draft; }
  // Fields every later Start adds to its /start_weight_update body (a lora session's
  // {"wsync_lora": {...}}); an empty object: none.
  void set_start_fields(nlohmann::json fields) { start_fields_ = std::move(fields); }
  // Which servers (in server order) are vLLM running wsync's plugin (Fleet health
  // "frontend": "vllm"). A lora session reaches their workers by collective RPC (vLLM's
  // start route passes no body), and its finish leaves their weight_version alone (it
  // names vLLM's base weights, not an adapter).
  void set_vllm_servers(std::vector<bool> vllm) { vllm_ = std::move(vllm); }
  const DeadlinePolicy& deadlines() const { return policy_; }

  // --- fleet discovery (GET /health, GET /get_world_size) ---
  // /health of every server and whether all are wsync servers. A vLLM server whose
  // weight-transfer engine is wsync's plugin (/server_info?config_format=json says
  // weight_transfer_config.backend "wsync") counts as a wsync server, with the health
  // VllmWsyncHealth() makes of its config.
  Result<Fleet> Discover() const;
  // Fills fleet->world_sizes (each a positive int within kMaxBroadcastWorldSize).
  Status WorldSizes(Fleet* fleet) const;
  // FailedPrecondition naming each server whose /health reports a backend other than
  // `wanted` and the backend it runs; servers that do not report one pass.
  Status CheckBackend(const Fleet& fleet, std::string_view wanted) const;
  // "URL worker dpD/tpT" for the worker of global index offsets[server] + D * TP + T.
  std::vector<std::string> WorkerLabels(const Fleet& fleet, int count, const std::vector<int>& offsets) const;

  // --- init (POST /init_weight_transfer_engine {"init_info": ...}) ---
  // One init_info per server, in server order; waits for every answer (bounded by Http()).
  Status Init(std::vector<nlohmann::json> init_infos) const;
  // The same for every server.
  Status InitAll(const nlohmann::json& init_info) const;
  // Starts the init and returns at once (a data plane that joins its group meanwhile).
  std::shared_ptr<Pending> InitAsync(std::vector<nlohmann::json> init_infos) const;

  // --- one sync ---
  // POST /start_weight_update; servers marked in `inline_verify` are told that the finish
  // will carry in-line digests ({"wsync_inline_verify": true}), so that they hash what
  // they land from the start of the session on. In a lora session the vLLM servers get
  // POST /collective_rpc {"method": "wsync_lora_start", "args": ["<wsync_lora as JSON>",
  // "start"]} instead, before the others start (docs/lora.md): it opens vLLM's session,
  // and a refusal there fails the start naming the server.
  Status Start(const std::vector<bool>* inline_verify = nullptr) const;
  // POST /update_weights with a body already serialized ({"update_info": ...}; see
  // UpdateBodyCache), in the background: the data plane runs while it is in flight.
  std::shared_ptr<Pending> UpdateAsync(std::shared_ptr<const std::string> body) const;
  // POST /update_weights {"update_info": ...}, waited for (bounded by Call()).
  Status Update(const nlohmann::json& update_info) const;
  // POST /finish_weight_update, with "weight_version" when given (not to vLLM servers in a
  // lora session).
  Status Finish(const std::optional<std::string>& weight_version) const;
  // POST /finish_weight_update with the pass's digests (PassDigests::Json) to the servers
  // marked in `verifying` (in server order; their body adds "wsync_digests" and
  // "digest_algorithm": "xxh3_128"), the plain body to the others; every server's reply.
  // A verifying vLLM server (set_vllm_servers: wsync's plugin, whose finish route passes
  // only weight_version) gets the digests first by POST /collective_rpc
  // {"method": "wsync_inline_digests", "args": ["{\"wsync_digests\": ..., ...}"]}, then
  // the plain finish, which its workers refuse (500) when bytes differ; in a lora session
  // it gets one POST /collective_rpc {"method": "wsync_lora_finish", "args": [the same]}
  // instead, which checks and finishes. Its reply here is {"verified": ...} merged from
  // its workers' (MergeInlineResults). When a finish fails, those vLLM servers get a plain
  // finish (a lora session: Close's abort) that closes vLLM's session.
  Result<std::vector<nlohmann::json>> FinishVerified(const std::optional<std::string>& weight_version,
                                                     const nlohmann::json& digests,
                                                     const std::vector<bool>& verifying) const;
  // After a failed sync: a best-effort finish that ends any session still open (servers
  // whose failed update already ended theirs answer 409, which is expected), bounded by
  // Close().
  // A vLLM server in a lora session gets the collective RPC wsync_lora_finish
  // {"abort": true} instead: its workers drop the staged adapter and close vLLM's session.
  // `only_lora`: those servers alone.
  void Close(bool only_lora = false) const;

  // --- delta's flow ---
  // POST /fetch_weights with `body`; every server's reply.
  Result<std::vector<nlohmann::json>> Fetch(const nlohmann::json& body) const;
  // The same where `vllm[i]` marks a vLLM server running wsync's plugin (it has no
  // /fetch_weights): those get POST /collective_rpc {"method": "wsync_fetch_weights",
  // "args": [body as JSON text]}, and their reply is the first worker's fetch reply with
  // "applied_by_workers" summed and "workers" counted. Replies in server order.
  Result<std::vector<nlohmann::json>> Fetch(const nlohmann::json& body, const std::vector<bool>& vllm) const;
  // POST /pause?mode=MODE&clear_cache=..., POST /resume.
  Status Pause(std::string_view mode, bool clear_cache) const;
  Status Resume() const;

  // --- prefix caches (GET /server_info, POST /reset_prefix_cache) ---
  // Whether each server (in server order) caches prefixes, as it says at GET
  // /server_info?config_format=json: a wsync server's "capabilities": {"prefix_caching":
  // bool}, else vLLM's cache_config "enable_prefix_caching" (found at any depth of the
  // reply, as a JSON boolean or as "enable_prefix_caching=True" in vLLM's text form); false
  // for a server that says neither or has no /server_info. Never fails.
  std::vector<bool> PrefixCaching() const;
  // POST /reset_prefix_cache?reset_running_requests=true to the servers marked in `which`
  // (in server order; none marked: no call). A server answering {"success": false} is
  // FailedPrecondition naming it: its cache may still hold entries of the old weights.
  Status ResetPrefixCache(const std::vector<bool>& which) const;

  // --- weight checks (POST /weight_checker {"action": "checksum"}) ---
  // Starts every server's checksum of every tensor with `algorithm` (xxh3_128, sha256);
  // each reply holds {"checksums": {name: hex}}. `lora` non-empty: the tensors of that
  // LoRA adapter instead ({"lora": NAME}, docs/lora.md).
  std::shared_ptr<Pending> ChecksumsAsync(std::string_view algorithm, std::string_view lora = {}) const;
  // The same from vLLM servers running wsync's plugin (Fleet health "frontend": "vllm"):
  // POST /collective_rpc {"method": "wsync_weight_digests", "args": [algorithm]}, whose
  // reply holds one {"checksums"} per worker; MergeWorkerChecksums() makes one of them.
  // `lora` non-empty: that adapter's tensors instead ({"method": "wsync_lora_digests",
  // "args": [lora, algorithm]}, read back from what each worker holds).
  std::shared_ptr<Pending> WorkerChecksumsAsync(std::string_view algorithm, std::string_view lora = {}) const;

 private:
  FanOutClient client_;
  std::string api_key_;  // for calls to a subset of the servers
  DeadlinePolicy policy_;
  // The finish body of server `i`: "weight_version" when given, unless `i` is a vLLM
  // server in a lora session.
  nlohmann::json FinishBody(size_t i, const std::optional<std::string>& weight_version) const;
  bool InVllm(size_t i) const { return i < vllm_.size() && vllm_[i]; }
  // Whether server `i` takes this session's start and finish as collective RPCs: a vLLM
  // server in a lora session.
  bool LoraByRpc(size_t i) const;
  // A client of the servers at these indices (ascending): new connections, unless they
  // are every server.
  FanOutClient Subset(const std::vector<size_t>& which) const;
  // wsync_lora_start, opening the session, to the vLLM servers at these indices, waited for.
  Status StartVllmLora(const std::vector<size_t>& vllm) const;

  bool draft_sessions_ = false;
  nlohmann::json start_fields_ = nlohmann::json::object();
  std::vector<bool> vllm_;
};

// Whether one /server_info reply says the server caches prefixes (see PrefixCaching).
bool ServerInfoSaysPrefixCaching(const nlohmann::json& server_info);

// {"update_info": TensorListJson(tensors) + `extra`'s fields}, serialized.
std::shared_ptr<const std::string> UpdateBody(const std::vector<TensorMeta>& tensors,
                                              const nlohmann::json& extra = nlohmann::json::object());

// The serialized update body of a tensor list, kept across syncs: while the list is
// unchanged the same bytes go out again (no dump, no copy), and the servers find them in
// their cache of parsed bodies. Not thread-safe.
class UpdateBodyCache {
 public:
  std::shared_ptr<const std::string> Get(const std::vector<TensorMeta>& tensors);
  void Clear() { bytes_.reset(); }

 private:
  std::vector<TensorMeta> tensors_;
  std::shared_ptr<const std::string> bytes_;
};

}  // namespace wsync
