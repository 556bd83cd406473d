// The trainer's LoRA adapter as a WeightSource (docs/lora.md).
//
// A trainer hands its adapter's A and B matrices, under PEFT's parameter or state-dict
// names ("model.layers.0.self_attn.q_proj.lora_A.default.weight",
// "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", ...), one list per
// trainer rank that holds any (expert- or data-parallel ranks often hold copies of the
// same tensors). LoraAdapterSource names each as PEFT saves it
// (base_model.model.<module>.lora_A.weight), checks it against the adapter's options
// (rank r: A [r, in], B [out, r]; its module one of target_modules; both matrices of each
// module; one dtype), and keeps each tensor once: a copy on another rank must be
// byte-identical, else the error names the tensor and both ranks. Tensors go unscaled;
// the receiver applies vLLM's scaling (alpha / r). Pure and thread-safe; the source
// itself is a HostTensorSource (not thread-safe, one pass at a time).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "wsync/source.h"
#include "wsync/status.h"
#include "wsync/tensor.h"
#include "wsync/trainer.h"

namespace wsync {

// `name` as PEFT saves it, or nullopt when it is not a LoRA A/B matrix's name.
std::optional<std::string> PeftLoraName(std::string_view name);

// Builds the adapter's source from every rank's tensors (`per_rank[k]`: rank k's), moving
// them in. InvalidArgument naming the tensor for anything that does not fit `lora`.
Result<std::unique_ptr<HostTensorSource>> LoraAdapterSource(const LoraAdapterOptions& lora,
                                                            std::vector<std::vector<HostTensor>> per_rank);

}  // namespace wsync
