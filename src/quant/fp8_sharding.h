// FP8 block quantization of a TP worker's parameters, and the Hugging Face FP8 checkpoint
// convention their digests follow.
//
// Which tensors: the linear weights vLLM's Fp8 config quantizes in a Qwen3 / Qwen3-MoE /
// GLM-4.5 model (LinearBase and FusedMoE layers): self_attn.{q,k,v,o}_proj,
// mlp.{gate,up,down}_proj, every expert's mlp.experts.E.{gate,up,down}_proj and the shared
// experts' mlp.shared_experts.{gate,up,down}_proj, MTP layers' decoder layers included. The
// embeddings, lm_head, the norms, the MoE router mlp.gate (a ReplicatedLinear built with
// quant_config=None) and an MTP layer's eh_proj (a plain linear) stay in the model dtype;
// so do DeepSeek-V3's MLA projections (q_a/q_b/kv_a/kv_b_proj), which this rule does not
// cover yet. IsFp8Quantized() is that rule, for HF names.
//
// Block grid: per HF tensor [rows, cols], 128x128 blocks from its origin (quant/fp8_block.h).
// A worker parameter (fused qkv_proj / gate_up_proj, a TP shard, stacked experts [E, R, C])
// is quantized on its own [R, C] grid; that grid coincides with the HF tensors' grids
// exactly when every piece starts at a multiple of 128 in both the HF tensor and the
// parameter, and its length is a multiple of 128 unless it ends both the HF tensor and the
// parameter along the split dim (then the partial block is partial in both).
// CheckFp8Sharding() enforces this (vLLM refuses the same shapes at load time), so a block
// never straddles two HF tensors and a parameter's bytes and scales are exactly those of
// the HF tensors' quantization, rearranged.
//
// Scale layout of a parameter (what vLLM's weight_scale_inv parameter holds): the
// parameter's shape with its last two dims R, C replaced by ceil(R/128), ceil(C/128),
// float32, row-major; a piece at rows [s, s+n) of the parameter fills scale rows
// [s/128, ceil((s+n)/128)) (columns likewise for a dim-1 piece).
//
// HF FP8 checkpoint convention: NAME holds the e4m3 bytes in the HF shape and
// NAME_scale_inv (".weight" -> ".weight_scale_inv") the float32 [ceil(rows/128),
// ceil(cols/128)] grid. Fp8WeightRuns / Fp8ScaleRuns say where each piece's part of NAME /
// NAME_scale_inv lives in the parameter's fp8 bytes / scales, in the same form as
// ShardingTable::Runs, so read-back and digests use the table's primary pieces as for
// model-dtype tensors.
//
// All functions are pure and thread-safe; QuantizeFp8Param blocks while its threads run.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "model/config.h"
#include "model/sharding.h"
#include "quant/fp8_block.h"
#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync {

// Whether the HF tensor `hf_name` is held as float8 e4m3 with block scales (rule above).
bool IsFp8Quantized(std::string_view hf_name);

// NAME_scale_inv of a quantized weight: "X.weight" -> "X.weight_scale_inv".
std::string Fp8ScaleInvName(std::string_view weight_name);

// What an FP8 checkpoint name refers to: the quantized weight `hf_name` itself
// (scale == false) or its scale_inv (scale == true). nullopt for any other name (a
// model-dtype tensor, or an unknown one).
struct Fp8HfPart {
  std::string hf_name;
  bool scale = false;
};
std::optional<Fp8HfPart> ParseFp8HfName(std::string_view name);

// The HF FP8 checkpoint's tensor list: HfTensors(config) with every quantized NAME as
// F8_E4M3 (same shape), followed by NAME_scale_inv (F32, [ceil(rows/128), ceil(cols/128)]).
std::vector<TensorMeta> Fp8HfTensors(const ModelConfig& config);

// OK when every quantized parameter of this worker has its pieces on the 128-element grid
// (header comment). Otherwise InvalidArgument naming the model, tp, the HF tensor, the
// parameter and the offending boundary, e.g. "model qwen3-tiny, tp 2: fp8 block
// quantization needs shard boundaries at multiples of 128; rows [0, 64) of
// model.layers.0.self_attn.k_proj.weight land at rows [128, 192) of
// model.layers.0.self_attn.qkv_proj.weight on tp rank 0: boundary 64 is not a multiple of
// 128". Every rank of
// a qwen3 table holds pieces of equal lengths, so any rank refuses the same model and tp.
Status CheckFp8Sharding(const ShardingTable& table);

// Whether params()[param] is held in fp8: its pieces are of quantized HF tensors.
bool IsFp8Param(const ShardingTable& table, int param);

// How a quantized parameter is stored.
struct Fp8ParamLayout {
  Fp8MatrixShape shape;  // count = E for stacked experts [E, R, C], else 1
  TensorMeta weight;     // the parameter's name, F8_E4M3, its shape
  TensorMeta scale_inv;  // name with ".weight" -> ".weight_scale_inv" (w13_weight ->
                         // w13_weight_scale_inv), F32, [E,] ceil(R/128), ceil(C/128)
};

// The layout of params()[param]; InvalidArgument when it is not a quantized parameter or
// its pieces are off the grid (as CheckFp8Sharding).
Result<Fp8ParamLayout> Fp8LayoutOf(const ShardingTable& table, int param);

// Quantizes params()[param] from its bytes in the model dtype (`src`, the parameter's
// nbytes) into `weight` (one byte per element, the parameter's layout) and `scale_inv`
// (Fp8LayoutOf's scale_inv shape), on up to `threads` threads. Errors as Fp8LayoutOf and
// QuantizeFp8Blocks, naming the parameter.
Status QuantizeFp8Param(const ShardingTable& table, int param, std::span<const std::byte> src,
                        std::span<uint8_t> weight, std::span<float> scale_inv, size_t threads);

// Byte runs of params()[param].pieces[piece] of a quantized parameter, like
// ShardingTable::Runs: Fp8WeightRuns between the HF tensor's e4m3 bytes (NAME) and the
// parameter's e4m3 bytes; Fp8ScaleRuns between NAME_scale_inv's float32 bytes and the
// parameter's scale_inv bytes. Valid for a table CheckFp8Sharding accepts.
PieceRuns Fp8WeightRuns(const ShardingTable& table, int param, int piece);
PieceRuns Fp8ScaleRuns(const ShardingTable& table, int param, int piece);

// Where the bytes of FP8 checkpoint tensor `name` (NAME or NAME_scale_inv, see
// ParseFp8HfName) live on this worker: one entry per piece of the HF tensor this worker
// holds, in table order, with its runs between the checkpoint tensor's bytes and the
// parameter's e4m3 bytes (NAME: Fp8WeightRuns) or scale_inv bytes (NAME_scale_inv:
// Fp8ScaleRuns). Read-back and digests use the `primary` entries across the TP group;
// together they tile the checkpoint tensor. Empty for any other name.
struct Fp8Source {
  int param = -1;
  int piece = -1;
  bool primary = true;
  bool scale = false;  // the runs address the parameter's scale_inv, not its e4m3 bytes
  PieceRuns runs;
};
std::vector<Fp8Source> Fp8SourcesOf(const ShardingTable& table, std::string_view name);

// One worker's quantized parameters in host memory, for read-back: params[i] holds
// params()[i]'s e4m3 bytes and scale_inv (empty for parameters that are not quantized).
struct Fp8ParamView {
  std::span<const uint8_t> weight;
  std::span<const float> scale_inv;
};
struct Fp8WorkerView {
  const ShardingTable* table = nullptr;
  std::span<const Fp8ParamView> params;
};

// Reassembles FP8 checkpoint tensor `name` (NAME: rows*cols e4m3 bytes; NAME_scale_inv:
// the float32 grid) into `out`, which must be exactly its size (Fp8HfTensors), from the
// primary pieces of a TP group (indexed by tp_rank). InvalidArgument for a name that is
// neither, a wrong output size, or views that lack a parameter's bytes (naming it);
// Internal when the primary pieces do not tile the tensor.
Status ReadBackFp8Hf(std::span<const Fp8WorkerView> group, std::string_view name, std::span<std::byte> out);

}  // namespace wsync
