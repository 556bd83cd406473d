#include "backends/delta/descriptor.h"

#include "backends/delta/cost.h"
#include "backends/delta/receiver.h"
#include "backends/delta/trainer.h"

namespace wsync {

const BackendDescriptor& DeltaBackend() {
  static const BackendDescriptor kDelta{
      .name = "delta",
      .summary = "XOR deltas through a directory shared with the servers",
      .init_info_fields = {"sync_dir", "format_version", "base_model_path", "local_checkpoint_dir"},
      .update_info_fields = {"target_version"},
      .trainer_options =
          {{"sync_dir", "path", "", "directory shared with the servers", "--sync-dir"},
           {"max_file_gb", "float", "1", "payload files roll over at this size", "--max-file-gb"},
           {"publish_threads", "int", "0", "publishing threads, 0 for all cores", "--publish-threads"},
           {"base_checkpoint", "path", "",
            "the servers' base checkpoint (version 0) when it is not the first sync's weights", "--base-checkpoint"},
           {"base_model_path", "string", "",
            "init_info base_model_path, the base checkpoint as the servers name it (default: --base-checkpoint); "
            "SkyRL's servers require it",
            "--base-model-path"},
           {"local_checkpoint_dir", "string", "",
            "init_info local_checkpoint_dir for SkyRL's servers (default: SkyRL's "
            "$TMPDIR/skyrl_delta_checkpoints/<sync dir name>_<hash>)",
            "--local-checkpoint-dir"},
           {"state_dir", "path", "",
            "where the trainer keeps its last published version, a file as large as the model rewritten every sync, "
            "on a local disk (default: $TMPDIR/wsync_delta_state/<sync dir name>_<hash>)",
            "--state-dir"}},
      .receiver_options = {{"base_checkpoint", "path", "", "the base checkpoint directory (version 0)"},
                           {"local_checkpoint_dir", "path", "", "this host's mutable copy of the checkpoint"},
                           {"sync_root", "path", "", "the directory every sync dir a request names must lie below"}},
      .fetches = true,
      .create_receiver = CreateDeltaReceiver,
      .create_trainer = CreateDeltaTrainer,
      .cost = {.predict = PredictDeltaCost, .plan_order = 2},
  };
  return kDelta;
}

}  // namespace wsync
