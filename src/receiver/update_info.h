// The receiver's view of the model a WorkerStore serves, as update admission
// (admission.h) checks an update's tensor list against it. Thread-safe as the store's
// const methods are.
#pragma once

#include <string_view>

#include "receiver/admission.h"
#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync {

class WorkerStore;

// The tensors of a store's model, each held with the model's dtype and shape; a name the
// model has no tensor of is dropped by the rule of model/dropped_names.h, or not held.
class StoreTensors final : public HeldTensors {
 public:
  explicit StoreTensors(const WorkerStore* store) : store_(store) {}
  std::string_view DropReason(std::string_view name) const override;
  const TensorMeta* Find(std::string_view name) const override;

 private:
  const WorkerStore* store_;
};

// Whether the store's model has no tensor `hf_name` and the rule drops it; logs the drop
// at debug level with the name and the reason.
bool IsDroppedBy(const WorkerStore& store, std::string_view hf_name);

}  // namespace wsync
