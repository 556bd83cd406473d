// UpdateAdmission: the checks an update_info passes before any byte of it moves, the same
// for every host of the receive side (`wsync serve`'s InferenceServer, ReceiverEngine and
// the Python fronts over it).
//
// An update is admitted when its update_info is a JSON object whose tensor list
// (control/tensor_list.h) parses, names every tensor once, adds up to at most
// `max_update_bytes` (overflow-checked), and names only tensors the worker holds with the
// same dtype and shape, or tensors the worker drops (model/dropped_names.h: admitted
// unchecked, never landed). A refusal is InvalidArgument naming the tensor or the field,
// worded here for every host (a tensor's dtype and shape as model/update_meta.h words
// them); it lands nothing. A backend that parses its own update_info (delta) gets the
// object check only.
//
// Identity cache: the last admitted update_info and its tensor list are kept, and a later
// update that is the same object (or, with `compare_values`, an equal one) is admitted
// without being parsed or checked again and handed on as the same objects, so that a
// backend may keep what it derived from them (UpdateRequest's contract, backend.h).
//
// Not thread-safe: the call that holds the session (ReceiverSession::BeginUpdate) or the
// engine's busy guard is the only caller at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync {

// What the worker holds, as admission asks it. Implementations: the shards of a
// WorkerStore (update_info.h), a ReceiverEngine's metadata list.
class HeldTensors {
 public:
  virtual ~HeldTensors() = default;
  // Why the worker drops `name` (the rule's phrase), or empty when it does not.
  virtual std::string_view DropReason(std::string_view name) const = 0;
  // The worker's tensor `name` (its dtype and shape), or nullptr when it holds none.
  virtual const TensorMeta* Find(std::string_view name) const = 0;
  // Whether the worker takes any tensor it is given, unchecked.
  virtual bool TakesAny() const { return false; }
  // What holds the tensors, as a refusal names it.
  virtual std::string Describe() const { return "the worker"; }
};

struct AdmissionOptions {
  // An update whose tensors add up to more bytes is refused: update_info is the trainer's
  // word, and this bounds what it can make the worker allocate.
  uint64_t max_update_bytes = uint64_t{1} << 40;
  // Names the worker in logs.
  std::string label = "worker";
  // Whether an update_info equal to the cached one (not only the same object) is a hit.
  // On: the cache holds its object (a caller that copies each body); off: it does not
  // own it (a caller whose bodies are shared, such as the HTTP router's identity cache,
  // and an expired body matches nothing).
  bool compare_values = false;
};

// An update as admission leaves it: what the backend's UpdateRequest carries.
struct AdmittedUpdate {
  std::shared_ptr<const nlohmann::json> update_info;     // never null
  std::shared_ptr<const std::vector<TensorMeta>> tensors;  // never null; empty when not parsed
  Status reject;  // OK, or why the update is refused
};

class UpdateAdmission {
 public:
  // `held` outlives this object.
  UpdateAdmission(const HeldTensors* held, AdmissionOptions options);

  // Admits `update_info` (null: refused as missing). `parse`: false when the backend
  // parses its own update_info.
  AdmittedUpdate Admit(std::shared_ptr<const nlohmann::json> update_info, bool parse);
  // The same for a body the caller does not share: copied unless it is a cache hit.
  AdmittedUpdate Admit(const nlohmann::json& update_info, bool parse);

  // The checks alone, on a parsed tensor list: unique names, the byte bound, and each
  // tensor held or dropped.
  Status Check(const std::vector<TensorMeta>& tensors) const;

  const AdmissionOptions& options() const { return options_; }

 private:
  // The cached update_info when `info` hits the cache; null otherwise.
  std::shared_ptr<const nlohmann::json> CacheHit(const nlohmann::json& info) const;
  AdmittedUpdate Hit(std::shared_ptr<const nlohmann::json> cached) const;
  AdmittedUpdate Miss(std::shared_ptr<const nlohmann::json> update_info, bool parse);

  const HeldTensors* held_;
  const AdmissionOptions options_;
  std::weak_ptr<const nlohmann::json> cached_info_;
  std::shared_ptr<const nlohmann::json> owned_info_;  // compare_values: keeps cached_info_ alive
  std::shared_ptr<const std::vector<TensorMeta>> cached_tensors_;
};

}  // namespace wsync
