// LoraStore: the LoRA adapters one inference worker holds, by name, each at one version,
// and the staging slot a lora session lands the next version in.
//
// A lora session (docs/lora.md) begins staging with the adapter's spec and the tensors it
// fixes (lora_spec.h); the backends land those tensors through staging_sink(), a
// WorkerSink that copies each into host memory beside the live adapters and digests it
// (xxh3-128) as it lands. Finish checks that every tensor landed (CheckStaged), then
// Commit() swaps the staged adapter in for the live one of that name in one step: a
// reader that took the live adapter (Find) keeps its version until it lets it go. A
// session that fails or is abandoned discards the staging (Discard, or the next Begin),
// and the previous version keeps serving. Hosts: `wsync serve` (src/server), one store
// per worker; a vLLM worker can hold one the same way and hand Find()'s tensors to its
// LoRA manager.
//
// Thread-safe: the staging sink is called from the worker's thread one call at a time
// (WorkerSink's contract), everything else from any thread; Begin, Commit and Discard
// must not run while a backend still lands into the staging.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "model/worker_sink.h"
#include "receiver/admission.h"
#include "receiver/lora_spec.h"
#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync {

// One version of one adapter, immutable once live.
struct LoraAdapter {
  LoraSpec spec;
  std::vector<TensorMeta> tensors;                  // LoraTensors(spec, model), in order
  std::vector<std::vector<std::byte>> bytes;        // tensors[i]'s bytes
  std::vector<std::string> digests;                 // tensors[i]'s xxh3-128, lowercase hex
  uint64_t key = 0;  // folds every digest: the toy generation's adapter key (generation.h)
  int64_t loads = 0;  // how many versions of this name this store has installed, this one included
};

class LoraStore {
 public:
  LoraStore();
  ~LoraStore();
  LoraStore(const LoraStore&) = delete;
  LoraStore& operator=(const LoraStore&) = delete;

  // Starts staging `spec`'s tensors (`tensors`: LoraTensors of it), discarding any staging
  // left over. Allocates the adapter's host memory (zeroed) now.
  Status Begin(const LoraSpec& spec, std::vector<TensorMeta> tensors);
  // Where the backends land the staged tensors; null while nothing is staged.
  WorkerSink* staging_sink();
  // What admission checks a lora session's update against: the staged adapter's tensors
  // (each name once, with its dtype and shape); nothing is dropped.
  const HeldTensors* staging_tensors() const;
  // FailedPrecondition naming (up to 5 of) the staged tensors that have not landed.
  Status CheckStaged() const;
  // The staged tensors' digests, by name (for in-line verification and replica checks).
  std::map<std::string, std::string> StagedDigests() const;
  // The xxh3-128 hexes of rows [begin, end) of dim 0 of staged tensor `name`, one per
  // range, joined by ',' (a trainer's row digests, receiver/row_digests.h). `ranges` tile
  // dim 0 (ParseRowDigests checked them); NotFound for a tensor not staged or not landed.
  Result<std::string> StagedRowsDigest(std::string_view name,
                                       std::span<const std::pair<int64_t, int64_t>> ranges) const;
  // Makes the staged adapter the live one of its name (replacing the previous version)
  // and returns it, at `version` when given (else the spec's). Call after CheckStaged()
  // is OK; null when nothing is staged.
  std::shared_ptr<const LoraAdapter> Commit(const std::optional<std::string>& version = std::nullopt);
  void Discard();

  std::shared_ptr<const LoraAdapter> Find(std::string_view name) const;
  // Every live adapter, by name.
  std::vector<std::shared_ptr<const LoraAdapter>> List() const;
  size_t size() const;
  // Drops the live adapter `name`; NotFound when there is none.
  Status Unload(std::string_view name);

 private:
  class Sink;
  class Held;
  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<const LoraAdapter>, std::less<>> live_;  // GUARDED_BY(mu_)
  std::map<std::string, int64_t, std::less<>> loads_;                              // GUARDED_BY(mu_)
  // The staging: written by the sink on the worker's thread between Begin and Commit.
  std::shared_ptr<LoraAdapter> staged_;
  std::vector<bool> landed_;
  std::unique_ptr<Sink> sink_;
  std::unique_ptr<Held> held_;
};

}  // namespace wsync
