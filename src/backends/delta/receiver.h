// The `delta` backend's receiving half: the server keeps a local mutable checkpoint
// (LocalCheckpoint) and a sync is "fetch, then reload".
//
//   POST /init_weight_transfer_engine {"init_info": {"sync_dir"?, "format_version"?,
//        "base_model_path"?, "local_checkpoint_dir"?}}: opens the local checkpoint from
//        the serve flags alone (--base-checkpoint, --local-checkpoint-dir); SkyRL's two
//        path keys are accepted and never opened (a differing one is logged). sync_dir
//        becomes the fetches' default. wsync's "base_digest" (base_digest.h) must be the
//        digest of this server's base checkpoint, computed at the first need (hashing
//        it) and kept: a differing one fails the init (409) naming both bases.
//   POST /fetch_weights {"target_version": N, "sync_dir": DIR}: runs while the server keeps
//        generating. Every worker fetches at once, each through its own LocalCheckpoint;
//        the host's writer lock lets one apply and the rest find it done. Answers SkyRL's
//        {"status", "target_version", "stats": {fetch_s, apply_s, reset_s, total_s, ...}}
//        plus "applied_by_workers" and "reset".
//   POST /update_weights {"update_info": {"target_version": N, ...}} (its own format, not
//        vLLM's tensor list): checks the local checkpoint is complete at N, then every
//        worker reloads it into its shards (casting f32/bf16/f16 checkpoint dtypes to the
//        model's) under the shared lock, so no fetch rewrites files mid-reload.
//
// A sync_dir (init or fetch) must lie below the serve flag --sync-root, also after
// symlinks are resolved; without the flag no request may name one (400). See
// docs/security.md. Without an init call, the first fetch or update opens the local
// checkpoint from the serve flags. Called by the server one call at a time; work fans out to the workers'
// threads, and each wait (the host lock) is bounded by the server's timeout.
#pragma once

#include <memory>

#include "receiver/backend.h"

namespace wsync {

Result<std::unique_ptr<ReceiverBackend>> CreateDeltaReceiver(ReceiverContext* context);

}  // namespace wsync
