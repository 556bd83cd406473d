// The `delta` backend's data plane, trainer side (rank 0; the engine skeleton in src/engine
// runs the session, and every other rank drains its source's one pass per sync): publishes
// each sync as the next version of an XOR-delta chain in a sync directory the servers
// share (DeltaPublisher), then drives the servers through SkyRL's fetch-before-pause flow
// (reference/skyrl_weight_sync.md §5.3):
//
//   publish -> POST /fetch_weights (servers keep generating while they download and
//   apply) -> POST /pause?mode=keep -> /start_weight_update -> /update_weights
//   {"target_version", "version", "sync_dir", "uri"} (the servers reload their local
//   checkpoint) -> /finish_weight_update -> POST /resume (always, once paused).
//
// publish is the plane's Prepare; fetch and pause its step before start and resume its
// step after the session (its SessionShape, engine/data_plane.h, which also puts the
// prefix-cache reset inside the pause and has no transfer phase); start, update and
// finish are the engine's session. Every phase is timed (DeltaSyncReport; also
// logged per sync). SyncStats maps them as:
// bytes = model bytes published, chunks = payload files, transfer = publish + fetch +
// update, start = pause + start, finish = finish + resume, seconds = all of it.
//
// Init payload: SkyRL's delta receiver (its DeltaTransferInitInfo) takes exactly
// `base_model_path` and `local_checkpoint_dir` (both required strings; it refuses unknown
// keys), so every server gets those two, and only servers whose GET /health says
// "server": "wsync" also get wsync's `sync_dir` and `format_version` (DeltaInitPayload),
// and with base_checkpoint set its `base_digest` (base_digest.h): such a server refuses
// the init when its own base differs. A wsync server takes its directories from its own
// flags and only compares these. Without base_checkpoint the first sync publishes a full
// version (publisher.h), which any server on another base refuses at the fetch.
//
// Init() refuses a sync directory that already holds published versions: a chain starts
// at the base checkpoint, and a trainer never rewrites a version that servers may have
// applied; servers reset to their base when a fetch names a new sync directory. With no
// servers, SendWeights() only publishes (servers that join later catch up by replaying
// the chain). Every HTTP wait is bounded by timeout_seconds. Not thread-safe.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "backends/delta/publisher.h"
#include "wsync/trainer.h"

namespace wsync {

// Settings of the delta trainer that TrainerOptions does not carry; the option keys of
// TrainerOptions::backend_options are the field names (all but borrow_source_bytes).
struct DeltaTrainerOptions {
  // The directory both sides share (local or NFS). Required.
  std::string sync_dir;
  // Payload files roll over at this size (GiB).
  double max_file_gb = 1.0;
  // Publishing threads (0: all cores).
  size_t publish_threads = 0;
  // Version 0 and the on-disk dtypes. Empty: version 0 is the source's first pass (see
  // publisher.h), which is what `wsync push --checkpoint BASE` needs.
  std::string base_checkpoint;
  // The base checkpoint as the servers name it: SkyRL's init key base_model_path. Empty:
  // base_checkpoint. A fleet with a server that is not wsync needs one of the two.
  std::string base_model_path;
  // Each server's local checkpoint directory: SkyRL's init key local_checkpoint_dir.
  // Empty: SkyRL's own default for this sync dir (DefaultSkyrlLocalCheckpointDir).
  std::string local_checkpoint_dir;
  // Where the trainer keeps its last published version (publisher.h: a file as large as
  // the model, rewritten in place every sync, on the trainer's local disk). Empty:
  // DefaultTrainerStateDir(sync_dir), under $TMPDIR.
  std::string state_dir;
  // Read same-dtype tensors in place instead of staging a copy, where the source's
  // TensorRefs stay valid for a whole pass (WeightSource::StableRefs); false: always stage.
  bool borrow_source_bytes = true;
};

struct DeltaSyncReport {
  delta::PublishStats publish;
  double fetch_seconds = 0;   // POST /fetch_weights, every server (download + apply)
  double pause_seconds = 0;
  double start_seconds = 0;
  double update_seconds = 0;  // POST /update_weights: the reload
  double finish_seconds = 0;
  double resume_seconds = 0;
  double seconds = 0;
  std::vector<nlohmann::json> fetch_replies;  // each server's /fetch_weights answer
};

class DeltaTrainer : public TrainerEngine {
 public:
  // The phases of the last successful SendWeights().
  virtual const DeltaSyncReport& last_report() const = 0;
  virtual int64_t version() const = 0;
};

// SkyRL's default local checkpoint directory for a sync dir:
// $TMPDIR (else /tmp) / "skyrl_delta_checkpoints" / NAME, where NAME is the sync dir's last
// path component with every byte outside [A-Za-z0-9._-] replaced by '_', cut to 143
// bytes, then "_" and the first 16 hex digits of the SHA-256 of the whole sync dir.
std::string DefaultSkyrlLocalCheckpointDir(const std::string& sync_dir);

// The init_info of one server: {base_model_path, local_checkpoint_dir} for any server,
// plus {sync_dir, format_version} for a wsync one, and its base_digest when
// `base_digest` is not empty. InvalidArgument when a server that is not wsync would get
// no base_model_path (SkyRL requires it).
Result<nlohmann::json> DeltaInitPayload(const DeltaTrainerOptions& delta, bool wsync_server,
                                        const std::string& base_digest = "");

Result<DeltaTrainerOptions> ParseDeltaTrainerOptions(const std::map<std::string, std::string>& values);

// The registry's factory (TrainerOptions only).
Result<std::unique_ptr<TrainerEngine>> CreateDeltaTrainer(const TrainerOptions& options);
// The same engine with the delta-only settings (bench, tests).
Result<std::unique_ptr<DeltaTrainer>> NewDeltaTrainer(const TrainerOptions& options, DeltaTrainerOptions delta);

}  // namespace wsync
