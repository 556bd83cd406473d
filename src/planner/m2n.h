// NVIDIA's NCCL M2N reshard benchmark configs: read and written, so its published
// presets run through `wsync plan` as they are.
//
// The benchmark (NVIDIA/nccl-extensions, nccl_m2n/benchmarks: reshard_model_bench reads
// configs/model_configs/*.model.json and configs/system_configs/*.json) describes a fleet
// with two files:
//
//   model  {"<HF tensor name>": {"shape": [d0, d1, ...], "dtype": "BF16", "shard": "synthetic"}, ...}
//          one entry per tensor of the checkpoint; dtype is a safetensors name (BF16, F16,
//          F32, F8_E4M3); "shard" is a note the benchmark does not interpret (kept free text).
//   system {"_comment": "...", "train": P, "generation": P} where P is
//          {"num_gpus": N, "tp_size", "cp_size", "ep_size", "pp_size", "fsdp_size", "dp_size"}
//          (every size defaults to 1; num_gpus is required). The benchmark lays ranks out
//          TP fastest, then CP, EP, DP, PP, and folds EP over each stage's ranks (Megatron's
//          parallel folding, expert TP 1).
//
// How wsync reads them:
//   - train: fsdp_size > 1 with tp, pp, ep, cp 1 is `fsdp:N`; otherwise Megatron
//     `tp<tp>pp<pp>ep<ep>:N` with N/pp = tp * cp * dp (CP ranks hold the weights DP ranks
//     hold, so they count as data-parallel replicas) and ep dividing N/pp.
//   - generation: dp_size vLLM deployments of tp_size workers each, `<dp>x(<tp>,1,1)`;
//     cp, pp, fsdp and ep must be 1 (a vLLM deployment has no such mesh axes; vLLM's own
//     expert parallelism spans a whole deployment, which the benchmark's separate ep axis
//     does not express). num_gpus must equal tp * dp.
//   - model: the tensors are matched to a model wsync knows (a Qwen3 dense or MoE,
//     DeepSeek-V3 / Kimi-K2 (MLA) or GLM-4.5 layout): its sizes are read off the shapes,
//     then the config's own tensor list (HfTensors) must equal the file's, name for name,
//     shape for shape and dtype for dtype, or the file is refused naming the first
//     difference. Without q_norm (GLM-4.5) the head width is taken as 128, GLM-4.5's.
//   Hardware is not in either file; the caller names a profile.
//
// Writing inverts the same mapping (WriteM2nModel, M2nSystemOf + WriteM2nSystem): a fleet
// with expert TP > 1 or vLLM expert parallelism has no M2N system and is refused.
//
// Both files are untrusted: parsed through ParseUntrustedJson, with bounds on the tensor
// count (kMaxM2nTensors), dimensions, name lengths and every size (fuzz target
// planner_m2n_fuzz). Pure functions; thread-safe.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "model/config.h"
#include "planner/fleet.h"
#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync::planner {

// Bounds on an M2N file: far above any real model, low enough that nothing runs away.
inline constexpr size_t kMaxM2nTensors = size_t{1} << 18;     // tensors in a model file
inline constexpr size_t kMaxM2nDims = 8;                      // dimensions of one tensor
inline constexpr int64_t kMaxM2nDim = int64_t{1} << 32;       // one dimension
inline constexpr int kMaxM2nSize = 1 << 20;                   // num_gpus and every *_size
inline constexpr size_t kMaxM2nBytes = size_t{256} << 20;     // a file's text

// One side of a system file.
struct M2nParallel {
  int num_gpus = 1;
  int tp = 1, cp = 1, ep = 1, pp = 1, fsdp = 1, dp = 1;
  friend bool operator==(const M2nParallel&, const M2nParallel&) = default;
};

struct M2nSystem {
  std::string comment;  // "_comment", free text
  M2nParallel train;
  M2nParallel generation;
  friend bool operator==(const M2nSystem&, const M2nSystem&) = default;
};

// InvalidArgument naming `origin` and the field: missing num_gpus, a size that is not an
// integer in [1, kMaxM2nSize], an unknown field in train/generation.
Result<M2nSystem> ParseM2nSystem(std::string_view json, std::string_view origin);
std::string WriteM2nSystem(const M2nSystem& system);

// The wsync specs of a system's trainer and servers on hardware profile `hw`:
// {"tp4pp4:32@h100", "8x(4,1,1)@h100"}. InvalidArgument for what wsync cannot express.
struct M2nFleetSpecs {
  std::string trainer;
  std::string servers;
};
Result<M2nFleetSpecs> FleetSpecsOfM2n(const M2nSystem& system, std::string_view hw);
// The inverse; InvalidArgument for expert TP > 1 or servers with EP > 1.
Result<M2nSystem> M2nSystemOf(const TrainerSpec& trainer, const ServerSpec& servers);

// The tensors of a model file, sorted by name. InvalidArgument naming the tensor and
// field that is malformed or out of bounds.
Result<std::vector<TensorMeta>> ParseM2nModel(std::string_view json, std::string_view origin);
// `tensors` as a model file (entries in the given order, "shard": "synthetic").
std::string WriteM2nModel(const std::vector<TensorMeta>& tensors);

// The config whose HfTensors are exactly `tensors` (any order), named `name`.
Result<ModelConfig> ModelOfM2n(const std::vector<TensorMeta>& tensors, std::string_view name);

}  // namespace wsync::planner
