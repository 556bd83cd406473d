// ShardingTable: which slices of which Hugging Face tensors make up one inference
// worker's parameters, as data.
//
// A vLLM worker (tp_rank of tp_size) does not hold HF tensors: it holds fused qkv_proj
// and gate_up_proj, vocab-parallel (padded) embeddings, stacked experts, each a TP shard.
// The table lists every worker parameter (vLLM name, shard shape) with the pieces that
// fill it: "rows [s, s+n) along dim d of HF tensor X land at offset o along dim d of the
// parameter (or of its sub-tensor [e] for stacked experts)". Loading, the sharded
// backend's slice plan and read-back all read this one table, so they cannot disagree.
//
// Some pieces are copies: replicated tensors (norms, the MoE router) live whole on every
// rank, and when tp_size > num_key_value_heads each KV head lives on tp/Hkv ranks. Exactly
// one copy of every HF element is `primary` across the TP group; read-back uses those.
//
// DeepSeek-V3 (MLA, as vLLM's DeepseekV2MLAAttention loads it): fused_qkv_a_proj (q_a_proj
// rows then kv_a_proj_with_mqa rows; without q_lora_rank, q_proj is column-split and
// kv_a_proj_with_mqa is replicated on its own), q_a_layernorm and kv_a_layernorm
// replicated, q_b_proj and kv_b_proj column-split by heads, o_proj row-split. GLM-4.5:
// qkv_proj with a fused qkv_proj.bias beside it. Both: dense first layers as a dense MLP,
// the router gate and its e_score_correction_bias replicated, the shared experts one
// MLP (mlp.shared_experts.gate_up_proj / down_proj) split like a dense one, MTP layers
// as vLLM's MTP drafter holds them when the worker serves one (Drafter::kMtp, `serve
// --speculative mtp`): enorm/hnorm/eh_proj/shared_head.norm replicated, the decoder
// layer's parameters under model.layers.<n>.mtp_block.; the drafter's embed_tokens and
// shared_head.head are the target's embed_tokens and lm_head parameters (vLLM shares
// them), listed by drafter_aliases(). Without a drafter the MTP tensors are still HF
// tensors of the model (a trainer streams them) but no parameter holds them: they are
// checked and dropped, as vLLM's target model skips them.
//
// Expert parallelism (ExpertSplit with size > 1, vLLM's enable_expert_parallel, where
// size is tp * dp of the deployment): routed experts are not TP-split; the worker of EP
// rank k holds experts [k*E/size, (k+1)*E/size) whole, stacked in that order, and is
// their only (primary) holder; everything else is as without EP.
//
// A built table is immutable; const methods are safe from any thread. Tables built from
// one HfCatalog share its tensor list and name index, so a fleet's tables cost only their
// own parameters.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "model/config.h"
#include "wsync/status.h"
#include "wsync/tensor.h"

namespace wsync {

// One slice of an HF tensor and where it lands in a worker parameter.
struct ShardPiece {
  std::string hf_name;
  int dim = 0;            // dim of the HF tensor that is sliced; other dims are whole
  int64_t hf_start = 0;   // first index along `dim` in the HF tensor
  int64_t length = 0;     // indices along `dim`
  int64_t dst_index = -1; // -1, or the leading index (expert e) of the param's sub-tensor
  int64_t dst_start = 0;  // offset along `dim` in the param (or its sub-tensor [dst_index])
  bool primary = true;    // read-back uses this copy; false for replicas
  friend bool operator==(const ShardPiece&, const ShardPiece&) = default;
};

// One parameter of the worker: vLLM name, dtype and SHARD shape, and what fills it.
// Elements no piece covers (vocab padding rows) stay zero.
struct WorkerParam {
  TensorMeta meta;
  std::vector<ShardPiece> pieces;
};

// A piece as `count` byte runs, for a copy loop or a batched-copy kernel: run k moves
// `run_bytes` between HF byte offset hf_offset + k*hf_stride and parameter byte offset
// dst_offset + k*dst_stride. A dim-0 piece is a single run.
struct PieceRuns {
  int64_t count = 0;
  int64_t run_bytes = 0;
  int64_t hf_offset = 0;
  int64_t hf_stride = 0;
  int64_t dst_offset = 0;
  int64_t dst_stride = 0;
};

// Which routed experts a worker holds under expert parallelism; size 1: every expert,
// TP-split (no EP).
struct ExpertSplit {
  int rank = 0;
  int size = 1;
};

// Whether the worker serves a speculative-decoding drafter beside the target.
enum class Drafter { kNone, kMtp };

// A drafter parameter that is a target parameter (the same memory).
struct DrafterAlias {
  std::string name;  // the drafter's name, e.g. model.layers.61.embed_tokens.weight
  int param = -1;    // the target parameter's index in params()
};

// A model's HF tensors (HfTensors(config)) with an index by name: built once per model
// and shared, read-only, by every table of that model. Immutable; safe from any thread.
class HfCatalog {
 public:
  // ValidateConfig's errors, else the catalog.
  static Result<std::shared_ptr<const HfCatalog>> Make(const ModelConfig& config);

  const ModelConfig& config() const { return config_; }
  const std::vector<TensorMeta>& tensors() const { return tensors_; }
  // Index into tensors(), or -1.
  int Find(std::string_view name) const;

 private:
  ModelConfig config_;
  std::vector<TensorMeta> tensors_;
  std::unordered_map<std::string_view, int> index_;  // views into tensors_
};

class ShardingTable {
 public:
  // The table of worker `tp_rank` of `tp_size`. A size that does not divide (heads,
  // KV heads, intermediate, padded vocab; experts by ep.size) is InvalidArgument naming
  // the model, the quantity and tp (or ep).
  // Drafter::kMtp needs MTP layers in the config.
  static Result<ShardingTable> Build(const ModelConfig& config, int tp_rank, int tp_size,
                                     ExpertSplit ep = {}, Drafter drafter = Drafter::kNone);
  // The same, over a catalog of the model built once for several tables.
  static Result<ShardingTable> Build(std::shared_ptr<const HfCatalog> catalog, int tp_rank, int tp_size,
                                     ExpertSplit ep = {}, Drafter drafter = Drafter::kNone);
  // Build's checks of the sizes alone (OK exactly when Build would succeed), without
  // building the table.
  static Status Check(const HfCatalog& catalog, int tp_rank, int tp_size, ExpertSplit ep = {},
                      Drafter drafter = Drafter::kNone);

  const ModelConfig& config() const { return catalog_->config(); }
  int tp_rank() const { return tp_rank_; }
  int tp_size() const { return tp_size_; }
  const ExpertSplit& ep() const { return ep_; }
  Drafter drafter() const { return drafter_; }
  // The drafter's parameters that are the target's (empty without a drafter).
  std::vector<DrafterAlias> drafter_aliases() const;
  // Whether params()[param] is one of the drafter's own (an MTP layer's).
  bool IsDrafterParam(int param) const;
  // Whether the worker's models (the target, and the drafter if any) hold this HF tensor:
  // every tensor but an MTP layer's without a drafter.
  bool Serves(std::string_view hf_name) const;
  // The hf_tensors() the worker's models hold, in order.
  std::vector<TensorMeta> served_hf_tensors() const;
  // The worker's parameters in vLLM's order.
  const std::vector<WorkerParam>& params() const { return params_; }
  // The model's HF tensors (HfTensors(config)).
  const std::vector<TensorMeta>& hf_tensors() const { return catalog_->tensors(); }
  const std::shared_ptr<const HfCatalog>& catalog() const { return catalog_; }
  // Index into hf_tensors() / params(), or -1.
  int FindHf(std::string_view hf_name) const;
  int FindParam(std::string_view param_name) const;
  // The pieces of one HF tensor on this worker as (param index, piece index), in table
  // order; empty for an unknown name or a tensor this rank holds nothing of.
  std::span<const std::pair<int, int>> PiecesOf(std::string_view hf_name) const;
  // The same by index into hf_tensors() (empty outside it).
  std::span<const std::pair<int, int>> PiecesOfHf(int hf) const;
  // Every piece of the table as (param index, piece index), ordered by HF index, then in
  // table order; PiecesHf()[k] is the HF index of PiecesByHf()[k]. Their cost grows with
  // the worker's pieces, not with the model's tensors.
  std::span<const std::pair<int, int>> PiecesByHf() const { return pieces_; }
  std::span<const int> PiecesHf() const { return pieces_hf_; }
  // The index into hf_tensors() of params()[param].pieces[piece]'s HF tensor.
  int PieceHf(int param, int piece) const { return piece_hf_[piece_begin_[param] + piece]; }
  // Byte runs of params()[param].pieces[piece].
  PieceRuns Runs(int param, int piece) const;
  // Sum of the worker's parameter bytes.
  int64_t param_bytes() const;

  // vLLM's padded vocabulary: vocab_size rounded up to a multiple of 64. Each rank holds
  // PaddedVocab/tp rows of embed_tokens and lm_head; rows past vocab_size stay zero.
  static int64_t PaddedVocab(int64_t vocab_size) { return (vocab_size + 63) / 64 * 64; }

 private:
  struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  using NameIndex = std::unordered_map<std::string, int, StringHash, std::equal_to<>>;

  void Index();

  std::shared_ptr<const HfCatalog> catalog_;
  int tp_rank_ = 0;
  int tp_size_ = 1;
  ExpertSplit ep_;
  Drafter drafter_ = Drafter::kNone;
  std::vector<WorkerParam> params_;
  NameIndex param_index_;
  // Every (param, piece) pair ordered by HF index (pieces_hf_, ascending), then table order.
  std::vector<std::pair<int, int>> pieces_;
  std::vector<int> pieces_hf_;
  // The HF index of params_[p].pieces[k] is piece_hf_[piece_begin_[p] + k].
  std::vector<int> piece_begin_;
  std::vector<int> piece_hf_;
};

}  // namespace wsync
