// `wsync push`: the trainer command, and the pieces `demo` and `bench` reuse.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "core/digest.h"
#include "core/process_memory.h"
#include "wsync/source.h"
#include "wsync/status.h"
#include "wsync/trainer.h"

namespace wsync::cli {

struct PushArgs {
  TrainerOptions trainer;
  std::string checkpoint;   // a directory of *.safetensors, or empty
  std::string model;        // registered name or config.json dir, when no checkpoint
  uint64_t seed = 0;
  int steps = 0;
  bool verify = false;
  std::string verify_algorithm = "xxh3_128";
  std::optional<std::string> weight_version;  // reported by the servers after the last sync
  size_t threads = 0;       // 0: hardware concurrency
  // Trainer ranks run as threads of this process (1: the single-rank path); the layout
  // is "fsdp" or "tpXppYepZ" (push_ranks.h).
  int trainer_ranks = 1;
  std::string trainer_layout = "fsdp";
};

struct SyncRow {
  int sync = 0;             // 0 = the starting weights
  double changed_fraction = 0;
  SyncStats stats;
  std::string verified;     // "yes", "no", "-" (not asked)
  MemoryPeak sync_memory;   // this process's peak extra memory during the sync
  MemoryPeak verify_memory; // ... and during the trainer's side of the verification
  double verify_seconds = 0; // the verification's wall time (both sides, overlapped)
};

// Runs the whole push job; prints progress to stderr and the per-sync table to stdout.
// Returns the rows; an error names the server, tensor or wait that failed.
Result<std::vector<SyncRow>> RunPush(const PushArgs& args);

}  // namespace wsync::cli
