// Trainer-side parallel layouts: how a training job's ranks split a Hugging Face model.
//
// ParallelLayout names the layout of N trainer ranks: "fsdp" (every rank holds an even
// dim-0 shard of every tensor) or "tpXppYepZ[etpW]" (Megatron-style tensor x pipeline x
// expert parallelism, with N / (X*Y*Z) data-parallel replicas, and MoE expert weights
// split W ways over the TP group, Megatron's expert_tensor_parallel_size; W divides X,
// default 1). Ranks are numbered tp fastest, then ep, then dp, then pp (Megatron's
// "tp-ep-dp-pp" order, its data-parallel size being ep*dp here).
//
// MegatronLayout is the Megatron-Core layout of one model as DATA, like the server-side
// ShardingTable (src/model/sharding.h): for every rank, its parameters (Megatron names,
// rank-local shapes) and, for each, the HF slices that fill it as ShardPieces. Export,
// held names and the inverse "lay an HF model out into rank shards" all read this table:
//   - column-parallel (linear_qkv, linear_fc1, embedding, output_layer) split dim 0,
//     row-parallel (linear_proj, linear_fc2) split dim 1, over tp;
//   - linear_qkv is fused per query group in Megatron's interleaved order:
//     [q heads of group g; k_g; v_g] for each local group g;
//   - linear_fc1 is [gate; up] of this TP shard;
//   - the input and post-attention norms live in the fused TE layers
//     (linear_qkv.layer_norm_weight, linear_fc1.layer_norm_weight; MoE: pre_mlp_layernorm);
//   - embedding and output_layer rows are padded to a multiple of 128 * tp (Megatron's
//     make_vocab_size_divisible_by); padding rows are zero and belong to no HF tensor;
//   - MoE expert params follow Megatron-Core's expert grid (MoE parallel folding): the
//     stage's ranks, in the order above, are re-laid etp fastest, then ep, then
//     expert-dp. Expert e lives on expert-EP rank e / (E / ep) as local expert
//     e % (E / ep) ("mlp.experts.local_experts.<i>.linear_fc1.weight"); etp > 1 splits
//     its fc1 ([gate; up] of the shard) on dim 0 and its fc2 on dim 1. With etp = tp the
//     expert grid is the attention grid (expert-EP rank = ep coordinate); with etp < tp
//     the expert-EP rank changes inside a TP group (tp2ep2: rank 1 holds EP rank 1's
//     experts, rank 2 copies rank 0's), as in Megatron. Megatron's own default is
//     etp = tp; here it is 1;
//   - pipeline stage s owns the contiguous layers [s*L/pp, (s+1)*L/pp) under LOCAL layer
//     numbers; the embedding is on the first stage, final norm and output_layer on the last;
//   - tied embeddings (tie_word_embeddings; the HF checkpoint and vLLM have no lm_head):
//     with pp = 1 the output layer is the embedding and has no parameter of its own; with
//     pp > 1 the last stage holds output_layer.weight, a replica of model.embed_tokens.weight
//     (same vocab-parallel split and padding), so that stage holds the embedding too.
// Exactly one copy of every HF element is `primary` (dp 0; for dense weights ep 0; for
// TP-replicated tensors tp 0; an expert shard's on its expert-dp copy local index %
// (tp / etp), spreading export over the stage): export reads those. A built table is
// immutable; const methods are safe from any thread.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "model/config.h"
#include "model/sharding.h"
#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync {

struct ParallelLayout {
  bool fsdp = true;
  int tp = 1, pp = 1, ep = 1;
  int etp = 1;  // expert tensor parallelism: divides tp
  int world = 1;  // trainer ranks

  struct Coord {
    int tp = 0, pp = 0, ep = 0, dp = 0;
  };
  int dp() const { return fsdp ? world : world / (tp * pp * ep); }
  // "fsdp", "tp2pp2ep1" or "tp2pp1ep2etp2" for `world` ranks; world must be a multiple
  // of tp*pp*ep, and etp must divide tp.
  static Result<ParallelLayout> Parse(std::string_view text, int world);
  std::string ToString() const;
  Coord CoordOf(int rank) const;
  int RankOf(const Coord& c) const;
  // "trainer rank 3 (tp1 pp0 ep1 dp0)", for errors and Gloo's DescribeRank.
  std::string Describe(int rank) const;
};

// One piece that export reads: params(rank)[param].pieces[piece].
struct ExportPiece {
  int rank = 0;
  int param = 0;
  int piece = 0;
};

class MegatronLayout {
 public:
  // InvalidArgument naming the model and quantity when the layout does not fit: KV heads
  // (query groups) or intermediate size not divisible by tp, fewer layers than pp stages,
  // ep or etp > 1 on a dense model, moe_intermediate_size not divisible by etp, or a MoE
  // layer whose experts ep does not divide (the error names the layer).
  static Result<MegatronLayout> Build(const ModelConfig& config, const ParallelLayout& layout);

  const ModelConfig& config() const { return config_; }
  const ParallelLayout& layout() const { return layout_; }
  // The whole model in HF names, HfTensors(config) order.
  const std::vector<TensorMeta>& hf_tensors() const { return hf_; }
  int FindHf(std::string_view name) const;
  // Rank-local parameters with their pieces, in Megatron state-dict order.
  const std::vector<WorkerParam>& params(int rank) const { return params_[rank]; }
  // The primary pieces of HF tensor `hf`, rank-major; together they cover every element once.
  std::span<const ExportPiece> ExportPieces(int hf) const { return export_[hf]; }
  // HF names this rank's held pass yields (held_plan.h), in metadata order: what its TP
  // group assembles of its stage's split tensors, and what it holds whole itself (norms,
  // routers, its own experts when etp = 1). It never crosses stages or expert owners.
  std::vector<std::string> HeldNames(int rank) const;
  // Byte runs of params(rank)[param].pieces[piece] (hf_* in the HF tensor, dst_* in the param).
  PieceRuns Runs(int rank, int param, int piece) const;
  // Layers [first, end) of pipeline stage `stage`.
  std::pair<int64_t, int64_t> StageLayers(int stage) const;

 private:
  Status Index();

  ModelConfig config_;
  ParallelLayout layout_;
  std::vector<TensorMeta> hf_;
  std::unordered_map<std::string, int> hf_index_;
  std::vector<std::vector<WorkerParam>> params_;  // by rank
  std::vector<std::vector<ExportPiece>> export_;  // by HF index
};

// Lays the HF model `hf` out into rank `rank`'s parameters: every piece, primary or
// replica, is copied; padding stays zero. `hf` holds every tensor of hf_tensors() once,
// in any order (a checkpoint's file order need not be the model's): tensors match by name.
Result<std::vector<HostTensor>> LayOutMegatron(const MegatronLayout& layout, int rank,
                                               const std::vector<HostTensor>& hf);
// The same into existing parameters (a trainer step rewrites them in place).
Status LayOutMegatronInto(const MegatronLayout& layout, int rank,
                          const std::vector<HostTensor>& hf, std::vector<HostTensor>& params);

}  // namespace wsync
