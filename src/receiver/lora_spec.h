// LoraSpec: the LoRA adapter a lora session carries, as a trainer declares it in the
// body of /start_weight_update ("wsync_lora", docs/lora.md), and the tensors that
// declaration fixes for a given base model.
//
// An adapter is PEFT's: for each targeted linear module of each decoder layer, an A
// matrix [r, in_features] and a B matrix [out_features, r], named as PEFT saves them
// (base_model.model.<module>.lora_A.weight, ...lora_B.weight), unscaled. Its scaling
// is vLLM's PEFTHelper rule: alpha / r, or alpha / sqrt(r) with use_rslora; vLLM folds
// it into B when it loads the adapter, and the toy generation reads it as that.
//
// Everything here reads untrusted JSON: every field is range-checked, the sizes it
// implies are overflow-checked, and a refusal is InvalidArgument naming the field. Pure
// and thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "wsync/dtype.h"
#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync {

struct ModelConfig;  // model/config.h

// The version of the "wsync_lora" object this code reads and writes.
inline constexpr int kLoraSpecFormat = 1;
// Bounds on what a declaration may ask for.
inline constexpr int64_t kMaxLoraRank = 1024;          // vLLM's largest supported max_lora_rank is 512
inline constexpr size_t kMaxLoraNameBytes = 64;        // [A-Za-z0-9._-], not starting with '.'
inline constexpr size_t kMaxLoraVersionBytes = 256;    // printable ASCII
inline constexpr size_t kMaxLoraTargetModules = 16;
inline constexpr double kMaxLoraAlpha = 1e6;
// The prefix PEFT's saved adapters put before the base model's module names.
inline constexpr std::string_view kPeftPrefix = "base_model.model.";

struct LoraSpec {
  std::string name;      // what requests name in "model"
  std::string version;   // the adapter version this session installs
  int64_t r = 0;
  double alpha = 0;
  bool use_rslora = false;
  std::vector<std::string> target_modules;  // leaf module names: q_proj, v_proj, ...
  DType dtype = DType::kBF16;              // of every A and B matrix

  // vLLM's PEFTHelper scaling: alpha / r, or alpha / sqrt(r) with use_rslora.
  double scaling() const;
  // The "wsync_lora" object (format kLoraSpecFormat) this spec parses from.
  nlohmann::json ToJson() const;
};

// Parses and checks a "wsync_lora" object against the base model `model`: the format,
// the name (not the base model's own name), the version, r in [1, kMaxLoraRank], alpha
// finite in (0, kMaxLoraAlpha], target_modules unique and each a linear module every
// decoder layer of the model has (`q_proj`, `gate_proj`, ...: a name the model lacks is
// refused, listing those it has), dtype float32, bfloat16 or float16 (default: the
// model's). Unknown fields are refused, so that a later format's field is never ignored.
Result<LoraSpec> ParseLoraSpec(const nlohmann::json& j, const ModelConfig& model);

// Whether `name` is an adapter name: 1 to kMaxLoraNameBytes characters of [A-Za-z0-9._-],
// not starting with '.' (so also one plain path component).
bool IsLoraName(std::string_view name);

// InvalidArgument unless `version` is 1 to kMaxLoraVersionBytes printable ASCII
// characters (the rule for "version", and for a finish's weight_version that renames it).
Status CheckLoraVersion(std::string_view version);

// The linear modules every decoder layer of `model` has, as target_modules names them.
std::vector<std::string> LoraTargetableModules(const ModelConfig& model);

// The tensors `spec` fixes for `model`, in the model's module order (per layer, then
// per module): for every decoder layer (MTP layers excluded) and target module with base
// weight [out, in], base_model.model.<module>.lora_A.weight [r, in] and
// base_model.model.<module>.lora_B.weight [out, r]. Refuses an adapter larger than
// `max_bytes` (sizes overflow-checked).
Result<std::vector<TensorMeta>> LoraTensors(const LoraSpec& spec, const ModelConfig& model,
                                            uint64_t max_bytes = uint64_t{1} << 36);

}  // namespace wsync
