#include "model/sharding.h"

#include <algorithm>

#include <fmt/format.h>

namespace wsync {
namespace {

// Checks that tp divides the sizes vLLM shards, before any table is built.
Status CheckDivisible(const ModelConfig& c, int tp) {
  auto not_divisible = [&](const char* what, int64_t value) {
    return InvalidArgument(fmt::format("model {}: {} {} is not divisible by tp_size {}", c.name,
                                       what, value, tp));
  };
  if (c.num_attention_heads % tp != 0) return not_divisible("num_attention_heads", c.num_attention_heads);
  const int64_t kv = c.num_key_value_heads;
  if (tp <= kv && kv % tp != 0) return not_divisible("num_key_value_heads", kv);
  if (tp > kv && tp % kv != 0) {
    return InvalidArgument(fmt::format(
        "model {}: tp_size {} is above num_key_value_heads {} and not a multiple of it, so KV "
        "heads cannot be replicated evenly",
        c.name, tp, kv));
  }
  if (c.is_moe()) {
    if (c.moe_intermediate_size % tp != 0) {
      return not_divisible("moe_intermediate_size", c.moe_intermediate_size);
    }
  } else if (c.intermediate_size % tp != 0) {
    return not_divisible("intermediate_size", c.intermediate_size);
  }
  const int64_t padded = ShardingTable::PaddedVocab(c.vocab_size);
  if (padded % tp != 0) return not_divisible("padded vocab_size", padded);
  return Status::Ok();
}

}  // namespace

Result<ShardingTable> ShardingTable::Build(const ModelConfig& c, int r, int tp) {
  WSYNC_RETURN_IF_ERROR(ValidateConfig(c));
  if (tp < 1 || r < 0 || r >= tp) {
    return InvalidArgument(
        fmt::format("model {}: tp_rank {} is outside tp_size {}", c.name, r, tp));
  }
  WSYNC_RETURN_IF_ERROR(CheckDivisible(c, tp));

  ShardingTable t;
  t.config_ = c;
  t.tp_rank_ = r;
  t.tp_size_ = tp;
  auto& params = t.params_;
  auto add = [&](std::string name, Shape shape, std::vector<ShardPiece> pieces) {
    params.push_back(WorkerParam{TensorMeta{std::move(name), c.dtype, std::move(shape)},
                                 std::move(pieces)});
  };
  // Whole tensor on every rank; rank 0's copy is the one read back.
  auto replicated = [&](const std::string& name, Shape shape) {
    ShardPiece p{name, 0, 0, shape[0], -1, 0, r == 0};
    add(name, std::move(shape), {std::move(p)});
  };
  // VocabParallelEmbedding / ParallelLMHead: padded rows split evenly, tail rows zero.
  auto vocab_parallel = [&](const std::string& name) {
    const int64_t per = PaddedVocab(c.vocab_size) / tp;
    const int64_t start = r * per, end = std::min(c.vocab_size, start + per);
    std::vector<ShardPiece> pieces;
    if (end > start) pieces.push_back(ShardPiece{name, 0, start, end - start, -1, 0, true});
    add(name, {per, c.hidden_size}, std::move(pieces));
  };

  const int64_t H = c.hidden_size, D = c.head_dim;
  const int64_t q_rows = c.num_attention_heads / tp * D;
  // KV heads: split when tp <= Hkv, else each head replicated on tp/Hkv consecutive ranks.
  int64_t kv_heads = 1, kv_head0 = 0;
  bool kv_primary = true;
  if (tp <= c.num_key_value_heads) {
    kv_heads = c.num_key_value_heads / tp;
    kv_head0 = r * kv_heads;
  } else {
    const int64_t reps = tp / c.num_key_value_heads;
    kv_head0 = r / reps;
    kv_primary = r % reps == 0;
  }
  const int64_t kv_rows = kv_heads * D;

  vocab_parallel("model.embed_tokens.weight");
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = fmt::format("model.layers.{}.", i);
    const std::string a = p + "self_attn.";
    add(a + "qkv_proj.weight", {q_rows + 2 * kv_rows, H},
        {ShardPiece{a + "q_proj.weight", 0, r * q_rows, q_rows, -1, 0, true},
         ShardPiece{a + "k_proj.weight", 0, kv_head0 * D, kv_rows, -1, q_rows, kv_primary},
         ShardPiece{a + "v_proj.weight", 0, kv_head0 * D, kv_rows, -1, q_rows + kv_rows,
                    kv_primary}});
    add(a + "o_proj.weight", {H, q_rows},
        {ShardPiece{a + "o_proj.weight", 1, r * q_rows, q_rows, -1, 0, true}});
    replicated(a + "q_norm.weight", {D});
    replicated(a + "k_norm.weight", {D});
    if (c.is_moe()) {
      const int64_t E = c.num_experts, I = c.moe_intermediate_size / tp;
      replicated(p + "mlp.gate.weight", {E, H});
      std::vector<ShardPiece> w13, w2;
      w13.reserve(2 * E);
      w2.reserve(E);
      for (int64_t e = 0; e < E; ++e) {
        const std::string x = fmt::format("{}mlp.experts.{}.", p, e);
        w13.push_back(ShardPiece{x + "gate_proj.weight", 0, r * I, I, e, 0, true});
        w13.push_back(ShardPiece{x + "up_proj.weight", 0, r * I, I, e, I, true});
        w2.push_back(ShardPiece{x + "down_proj.weight", 1, r * I, I, e, 0, true});
      }
      add(p + "mlp.experts.w13_weight", {E, 2 * I, H}, std::move(w13));
      add(p + "mlp.experts.w2_weight", {E, H, I}, std::move(w2));
    } else {
      const int64_t I = c.intermediate_size / tp;
      add(p + "mlp.gate_up_proj.weight", {2 * I, H},
          {ShardPiece{p + "mlp.gate_proj.weight", 0, r * I, I, -1, 0, true},
           ShardPiece{p + "mlp.up_proj.weight", 0, r * I, I, -1, I, true}});
      add(p + "mlp.down_proj.weight", {H, I},
          {ShardPiece{p + "mlp.down_proj.weight", 1, r * I, I, -1, 0, true}});
    }
    replicated(p + "input_layernorm.weight", {H});
    replicated(p + "post_attention_layernorm.weight", {H});
  }
  replicated("model.norm.weight", {H});
  // Tied: vLLM's lm_head is embed_tokens itself, so there is no separate parameter.
  if (!c.tie_word_embeddings) vocab_parallel("lm_head.weight");

  t.Index();
  return t;
}

void ShardingTable::Index() {
  hf_ = HfTensors(config_);
  hf_index_.reserve(hf_.size());
  for (size_t i = 0; i < hf_.size(); ++i) hf_index_.emplace(hf_[i].name, static_cast<int>(i));
  param_index_.reserve(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    param_index_.emplace(params_[i].meta.name, static_cast<int>(i));
  }
  pieces_of_.assign(hf_.size(), {});
  for (size_t i = 0; i < params_.size(); ++i) {
    for (size_t k = 0; k < params_[i].pieces.size(); ++k) {
      // Every piece names an HF tensor of the same config by construction.
      pieces_of_[FindHf(params_[i].pieces[k].hf_name)].emplace_back(static_cast<int>(i),
                                                                   static_cast<int>(k));
    }
  }
}

int ShardingTable::FindHf(std::string_view hf_name) const {
  auto it = hf_index_.find(hf_name);
  return it == hf_index_.end() ? -1 : it->second;
}

int ShardingTable::FindParam(std::string_view param_name) const {
  auto it = param_index_.find(param_name);
  return it == param_index_.end() ? -1 : it->second;
}

std::span<const std::pair<int, int>> ShardingTable::PiecesOf(std::string_view hf_name) const {
  int i = FindHf(hf_name);
  if (i < 0) return {};
  return pieces_of_[i];
}

PieceRuns ShardingTable::Runs(int param, int piece) const {
  const WorkerParam& wp = params_[param];
  const ShardPiece& p = wp.pieces[piece];
  const Shape& hf = hf_[FindHf(p.hf_name)].shape;
  // The destination (sub-)tensor has the HF tensor's rank; stacked experts add a lead dim.
  std::span<const int64_t> dst(wp.meta.shape);
  int64_t dst_base = 0;
  const int64_t item = static_cast<int64_t>(ItemSize(wp.meta.dtype));
  if (p.dst_index >= 0) {
    dst = dst.subspan(1);
    dst_base = p.dst_index * NumElements(dst) * item;
  }
  int64_t inner = item, outer = 1;
  for (size_t d = p.dim + 1; d < hf.size(); ++d) inner *= hf[d];
  for (int d = 0; d < p.dim; ++d) outer *= hf[d];
  PieceRuns runs;
  runs.count = outer;
  runs.run_bytes = p.length * inner;
  runs.hf_offset = p.hf_start * inner;
  runs.hf_stride = hf[p.dim] * inner;
  runs.dst_offset = dst_base + p.dst_start * inner;
  runs.dst_stride = dst[p.dim] * inner;
  return runs;
}

int64_t ShardingTable::param_bytes() const {
  int64_t n = 0;
  for (const WorkerParam& p : params_) n += static_cast<int64_t>(p.meta.nbytes());
  return n;
}

}  // namespace wsync
