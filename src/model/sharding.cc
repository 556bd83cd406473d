#include "model/sharding.h"

#include <algorithm>
#include <unordered_map>

#include <fmt/format.h>

namespace wsync {
namespace {

// Checks that tp (and the expert split) divides the sizes vLLM shards, before any table
// is built.
Status CheckDivisible(const ModelConfig& c, int tp, const ExpertSplit& ep) {
  auto not_divisible = [&](const char* what, int64_t value) {
    return InvalidArgument(fmt::format("model {}: {} {} is not divisible by tp_size {}", c.name,
                                       what, value, tp));
  };
  if (c.num_attention_heads % tp != 0) return not_divisible("num_attention_heads", c.num_attention_heads);
  if (!c.is_mla()) {
    const int64_t kv = c.num_key_value_heads;
    if (tp <= kv && kv % tp != 0) return not_divisible("num_key_value_heads", kv);
    if (tp > kv && tp % kv != 0) {
      return InvalidArgument(fmt::format(
          "model {}: tp_size {} is above num_key_value_heads {} and not a multiple of it, so KV "
          "heads cannot be replicated evenly",
          c.name, tp, kv));
    }
  }
  if (c.is_moe()) {
    if (ep.size == 1 && c.moe_intermediate_size % tp != 0) {
      return not_divisible("moe_intermediate_size", c.moe_intermediate_size);
    }
    if (c.n_shared_experts > 0 && (c.moe_intermediate_size * c.n_shared_experts) % tp != 0) {
      return not_divisible("shared experts' width", c.moe_intermediate_size * c.n_shared_experts);
    }
    if (c.first_k_dense_replace > 0 && c.intermediate_size % tp != 0) {
      return not_divisible("intermediate_size", c.intermediate_size);
    }
    if (c.num_experts % ep.size != 0) {
      return InvalidArgument(fmt::format("model {}: num_experts {} is not divisible by ep_size {}",
                                         c.name, c.num_experts, ep.size));
    }
  } else if (c.intermediate_size % tp != 0) {
    return not_divisible("intermediate_size", c.intermediate_size);
  }
  const int64_t padded = ShardingTable::PaddedVocab(c.vocab_size);
  if (padded % tp != 0) return not_divisible("padded vocab_size", padded);
  return Status::Ok();
}

// Builds one worker's parameter list; `add` appends a parameter.
class TableBuilder {
 public:
  TableBuilder(const HfCatalog& catalog, int r, int tp, ExpertSplit ep, Drafter drafter,
               std::vector<WorkerParam>& params)
      : c_(catalog.config()), catalog_(catalog), r_(r), tp_(tp), ep_(ep), drafter_(drafter), params_(params) {}

  void Build() {
    VocabParallel("model.embed_tokens.weight", "model.embed_tokens.weight");
    for (int64_t i = 0; i < c_.num_hidden_layers; ++i) {
      const std::string p = fmt::format("model.layers.{}.", i);
      Layer(i, p, p);
    }
    // The drafter's own layers; its embed_tokens and shared_head.head are the target's
    // parameters (drafter_aliases()), not parameters of their own.
    for (int64_t i = c_.num_hidden_layers; drafter_ == Drafter::kMtp && i < c_.total_layers(); ++i) {
      const std::string p = fmt::format("model.layers.{}.", i);
      Replicated(p + "enorm.weight");
      Replicated(p + "hnorm.weight");
      Replicated(p + "eh_proj.weight");
      Replicated(p + "shared_head.norm.weight");
      Layer(i, p, p + "mtp_block.");
    }
    Replicated("model.norm.weight");
    // Tied: vLLM's lm_head is embed_tokens itself, so there is no separate parameter.
    if (!c_.tie_word_embeddings) VocabParallel("lm_head.weight", "lm_head.weight");
  }

 private:
  // Every name the builder asks for is one of HfTensors(c_) by construction.
  const TensorMeta& Hf(const std::string& name) const { return catalog_.tensors()[catalog_.Find(name)]; }
  void Add(std::string name, DType dtype, Shape shape, std::vector<ShardPiece> pieces) {
    params_.push_back(WorkerParam{TensorMeta{std::move(name), dtype, std::move(shape)}, std::move(pieces)});
  }
  // Whole tensor on every rank; rank 0's copy is the one read back.
  void Replicated(const std::string& name) { ReplicatedAs(name, name); }
  void ReplicatedAs(const std::string& param, const std::string& hf) {
    const TensorMeta& m = Hf(hf);
    Add(param, m.dtype, m.shape, {ShardPiece{hf, 0, 0, m.shape[0], -1, 0, r_ == 0}});
  }
  // VocabParallelEmbedding / ParallelLMHead: padded rows split evenly, tail rows zero.
  void VocabParallel(const std::string& param, const std::string& hf) {
    const int64_t per = ShardingTable::PaddedVocab(c_.vocab_size) / tp_;
    const int64_t start = r_ * per, end = std::min(c_.vocab_size, start + per);
    std::vector<ShardPiece> pieces;
    if (end > start) pieces.push_back(ShardPiece{hf, 0, start, end - start, -1, 0, true});
    Add(param, c_.dtype, {per, c_.hidden_size}, std::move(pieces));
  }
  // Column-parallel: rows [r*n, (r+1)*n) of each listed tensor, stacked along dim 0.
  void Column(const std::string& param, const std::vector<std::pair<std::string, int64_t>>& parts,
              int64_t cols) {
    std::vector<ShardPiece> pieces;
    int64_t off = 0;
    for (const auto& [hf, rows] : parts) {
      pieces.push_back(ShardPiece{hf, 0, r_ * rows, rows, -1, off, true});
      off += rows;
    }
    Shape shape{off};
    if (cols > 0) shape.push_back(cols);
    Add(param, c_.dtype, std::move(shape), std::move(pieces));
  }
  // Row-parallel: columns [r*n, (r+1)*n).
  void Row(const std::string& param, const std::string& hf, int64_t rows, int64_t cols) {
    Add(param, c_.dtype, {rows, cols}, {ShardPiece{hf, 1, r_ * cols, cols, -1, 0, true}});
  }
  void DenseMlp(const std::string& hf_prefix, const std::string& param_prefix, int64_t width) {
    const int64_t I = width / tp_, H = c_.hidden_size;
    Column(param_prefix + "gate_up_proj.weight",
           {{hf_prefix + "gate_proj.weight", I}, {hf_prefix + "up_proj.weight", I}}, H);
    Row(param_prefix + "down_proj.weight", hf_prefix + "down_proj.weight", H, I);
  }

  void Layer(int64_t layer, const std::string& hf, const std::string& pp) {
    const std::string a = hf + "self_attn.", pa = pp + "self_attn.";
    if (c_.is_mla()) {
      MlaAttention(a, pa);
    } else {
      GqaAttention(a, pa);
    }
    if (c_.is_moe_layer(layer)) {
      ReplicatedAs(pp + "mlp.gate.weight", hf + "mlp.gate.weight");
      if (c_.architecture == kDeepseekV3 || c_.architecture == kGlm4Moe) {
        ReplicatedAs(pp + "mlp.gate.e_score_correction_bias", hf + "mlp.gate.e_score_correction_bias");
      }
      Experts(hf, pp);
      if (c_.n_shared_experts > 0) {
        DenseMlp(hf + "mlp.shared_experts.", pp + "mlp.shared_experts.",
                 c_.moe_intermediate_size * c_.n_shared_experts);
      }
    } else {
      DenseMlp(hf + "mlp.", pp + "mlp.", c_.intermediate_size);
    }
    ReplicatedAs(pp + "input_layernorm.weight", hf + "input_layernorm.weight");
    ReplicatedAs(pp + "post_attention_layernorm.weight", hf + "post_attention_layernorm.weight");
  }

  void GqaAttention(const std::string& a, const std::string& pa) {
    const int64_t H = c_.hidden_size, D = c_.head_dim;
    const int64_t q_rows = c_.num_attention_heads / tp_ * D;
    // KV heads: split when tp <= Hkv, else each head replicated on tp/Hkv consecutive ranks.
    int64_t kv_heads = 1, kv_head0 = 0;
    bool kv_primary = true;
    if (tp_ <= c_.num_key_value_heads) {
      kv_heads = c_.num_key_value_heads / tp_;
      kv_head0 = r_ * kv_heads;
    } else {
      const int64_t reps = tp_ / c_.num_key_value_heads;
      kv_head0 = r_ / reps;
      kv_primary = r_ % reps == 0;
    }
    const int64_t kv_rows = kv_heads * D;
    auto qkv = [&](const char* kind, Shape shape) {
      Add(pa + "qkv_proj." + kind, c_.dtype, std::move(shape),
          {ShardPiece{a + "q_proj." + kind, 0, r_ * q_rows, q_rows, -1, 0, true},
           ShardPiece{a + "k_proj." + kind, 0, kv_head0 * D, kv_rows, -1, q_rows, kv_primary},
           ShardPiece{a + "v_proj." + kind, 0, kv_head0 * D, kv_rows, -1, q_rows + kv_rows, kv_primary}});
    };
    qkv("weight", {q_rows + 2 * kv_rows, H});
    if (c_.attention_bias) qkv("bias", {q_rows + 2 * kv_rows});
    Row(pa + "o_proj.weight", a + "o_proj.weight", H, q_rows);
    if (c_.has_qk_norm()) {
      ReplicatedAs(pa + "q_norm.weight", a + "q_norm.weight");
      ReplicatedAs(pa + "k_norm.weight", a + "k_norm.weight");
    }
  }

  void MlaAttention(const std::string& a, const std::string& pa) {
    const int64_t H = c_.hidden_size, heads = c_.num_attention_heads / tp_;
    const int64_t qk = c_.qk_nope_head_dim + c_.qk_rope_head_dim;
    const int64_t kv_a = c_.kv_lora_rank + c_.qk_rope_head_dim;
    if (c_.q_lora_rank > 0) {
      const bool primary = r_ == 0;
      Add(pa + "fused_qkv_a_proj.weight", c_.dtype, {c_.q_lora_rank + kv_a, H},
          {ShardPiece{a + "q_a_proj.weight", 0, 0, c_.q_lora_rank, -1, 0, primary},
           ShardPiece{a + "kv_a_proj_with_mqa.weight", 0, 0, kv_a, -1, c_.q_lora_rank, primary}});
      ReplicatedAs(pa + "q_a_layernorm.weight", a + "q_a_layernorm.weight");
      Column(pa + "q_b_proj.weight", {{a + "q_b_proj.weight", heads * qk}}, c_.q_lora_rank);
    } else {
      Column(pa + "q_proj.weight", {{a + "q_proj.weight", heads * qk}}, H);
      ReplicatedAs(pa + "kv_a_proj_with_mqa.weight", a + "kv_a_proj_with_mqa.weight");
    }
    ReplicatedAs(pa + "kv_a_layernorm.weight", a + "kv_a_layernorm.weight");
    Column(pa + "kv_b_proj.weight",
           {{a + "kv_b_proj.weight", heads * (c_.qk_nope_head_dim + c_.v_head_dim)}}, c_.kv_lora_rank);
    Row(pa + "o_proj.weight", a + "o_proj.weight", H, heads * c_.v_head_dim);
  }

  void Experts(const std::string& hf, const std::string& pp) {
    const int64_t H = c_.hidden_size;
    // Without EP every expert is TP-split; with EP this rank's experts are whole.
    const int64_t E = c_.num_experts / ep_.size, e0 = ep_.rank * E;
    const int64_t I = ep_.size > 1 ? c_.moe_intermediate_size : c_.moe_intermediate_size / tp_;
    const int64_t first = ep_.size > 1 ? 0 : r_ * I;
    std::vector<ShardPiece> w13, w2;
    w13.reserve(2 * E);
    w2.reserve(E);
    for (int64_t e = 0; e < E; ++e) {
      const std::string x = fmt::format("{}mlp.experts.{}.", hf, e0 + e);
      w13.push_back(ShardPiece{x + "gate_proj.weight", 0, first, I, e, 0, true});
      w13.push_back(ShardPiece{x + "up_proj.weight", 0, first, I, e, I, true});
      w2.push_back(ShardPiece{x + "down_proj.weight", 1, first, I, e, 0, true});
    }
    Add(pp + "mlp.experts.w13_weight", c_.dtype, {E, 2 * I, H}, std::move(w13));
    Add(pp + "mlp.experts.w2_weight", c_.dtype, {E, H, I}, std::move(w2));
  }

  const ModelConfig& c_;
  const HfCatalog& catalog_;
  int r_, tp_;
  ExpertSplit ep_;
  Drafter drafter_;
  std::vector<WorkerParam>& params_;
};

}  // namespace

Result<std::shared_ptr<const HfCatalog>> HfCatalog::Make(const ModelConfig& config) {
  WSYNC_RETURN_IF_ERROR(ValidateConfig(config));
  auto catalog = std::make_shared<HfCatalog>();
  catalog->config_ = config;
  catalog->tensors_ = HfTensors(config);
  catalog->index_.reserve(catalog->tensors_.size());
  for (size_t i = 0; i < catalog->tensors_.size(); ++i) {
    catalog->index_.emplace(catalog->tensors_[i].name, static_cast<int>(i));
  }
  return std::shared_ptr<const HfCatalog>(std::move(catalog));
}

int HfCatalog::Find(std::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? -1 : it->second;
}

Status ShardingTable::Check(const HfCatalog& catalog, int r, int tp, ExpertSplit ep, Drafter drafter) {
  const ModelConfig& c = catalog.config();
  if (tp < 1 || r < 0 || r >= tp) {
    return InvalidArgument(
        fmt::format("model {}: tp_rank {} is outside tp_size {}", c.name, r, tp));
  }
  if (ep.size < 1 || ep.rank < 0 || ep.rank >= ep.size) {
    return InvalidArgument(
        fmt::format("model {}: ep_rank {} is outside ep_size {}", c.name, ep.rank, ep.size));
  }
  if (ep.size > 1 && !c.is_moe()) {
    return InvalidArgument(fmt::format("model {}: ep_size {} needs a MoE model", c.name, ep.size));
  }
  WSYNC_RETURN_IF_ERROR(CheckDivisible(c, tp, ep));
  if (drafter == Drafter::kMtp && c.num_nextn_predict_layers == 0) {
    return InvalidArgument(fmt::format(
        "model {} has no MTP layers (num_nextn_predict_layers is 0), so it has no MTP drafter", c.name));
  }
  return Status::Ok();
}

Result<ShardingTable> ShardingTable::Build(const ModelConfig& c, int r, int tp, ExpertSplit ep,
                                           Drafter drafter) {
  WSYNC_ASSIGN_OR_RETURN(std::shared_ptr<const HfCatalog> catalog, HfCatalog::Make(c));
  return Build(std::move(catalog), r, tp, ep, drafter);
}

Result<ShardingTable> ShardingTable::Build(std::shared_ptr<const HfCatalog> catalog, int r, int tp,
                                           ExpertSplit ep, Drafter drafter) {
  if (!catalog) return InvalidArgument("sharding table: no model catalog");
  WSYNC_RETURN_IF_ERROR(Check(*catalog, r, tp, ep, drafter));
  ShardingTable t;
  t.catalog_ = std::move(catalog);
  t.tp_rank_ = r;
  t.tp_size_ = tp;
  t.ep_ = ep;
  t.drafter_ = drafter;
  TableBuilder(*t.catalog_, r, tp, ep, drafter, t.params_).Build();
  t.Index();
  return t;
}

std::vector<DrafterAlias> ShardingTable::drafter_aliases() const {
  std::vector<DrafterAlias> out;
  if (drafter_ != Drafter::kMtp) return out;
  const int embed = FindParam("model.embed_tokens.weight");
  // A tied model's lm_head is embed_tokens itself.
  const int head = config().tie_word_embeddings ? embed : FindParam("lm_head.weight");
  for (int64_t i = config().num_hidden_layers; i < config().total_layers(); ++i) {
    out.push_back({fmt::format("model.layers.{}.embed_tokens.weight", i), embed});
    out.push_back({fmt::format("model.layers.{}.shared_head.head.weight", i), head});
  }
  return out;
}

bool ShardingTable::Serves(std::string_view hf_name) const {
  return drafter_ == Drafter::kMtp || MtpLayerOf(config(), hf_name) < 0;
}

std::vector<TensorMeta> ShardingTable::served_hf_tensors() const {
  std::vector<TensorMeta> out;
  for (const TensorMeta& m : hf_tensors()) {
    if (Serves(m.name)) out.push_back(m);
  }
  return out;
}

bool ShardingTable::IsDrafterParam(int param) const {
  if (drafter_ != Drafter::kMtp) return false;
  const std::string& name = params_[param].meta.name;
  return MtpLayerOf(config(), name) >= 0;
}

void ShardingTable::Index() {
  param_index_.reserve(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    param_index_.emplace(params_[i].meta.name, static_cast<int>(i));
  }
  // Every piece names an HF tensor of the same config by construction.
  piece_begin_.assign(params_.size() + 1, 0);
  for (size_t i = 0; i < params_.size(); ++i) {
    piece_begin_[i + 1] = piece_begin_[i] + static_cast<int>(params_[i].pieces.size());
  }
  piece_hf_.resize(piece_begin_.back());
  struct Entry {
    int hf, param, piece;
  };
  std::vector<Entry> entries;
  entries.reserve(piece_hf_.size());
  // Pieces mostly follow the model's tensor order (an expert's gate, up and down tensors
  // are adjacent), so the tensors just after the previous piece's are tried by name first.
  const std::vector<TensorMeta>& hf_list = hf_tensors();
  int prev = -1;
  auto find = [&](const std::string& name) {
    for (int d = 1; d <= 3; ++d) {
      const size_t guess = static_cast<size_t>(prev + d);
      if (guess < hf_list.size() && hf_list[guess].name == name) return prev = static_cast<int>(guess);
    }
    return prev = catalog_->Find(name);
  };
  for (size_t i = 0; i < params_.size(); ++i) {
    for (size_t k = 0; k < params_[i].pieces.size(); ++k) {
      const int hf = find(params_[i].pieces[k].hf_name);
      piece_hf_[piece_begin_[i] + k] = hf;
      entries.push_back({hf, static_cast<int>(i), static_cast<int>(k)});
    }
  }
  std::stable_sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) { return a.hf < b.hf; });
  pieces_.reserve(entries.size());
  pieces_hf_.reserve(entries.size());
  for (const Entry& e : entries) {
    pieces_.emplace_back(e.param, e.piece);
    pieces_hf_.push_back(e.hf);
  }
}

int ShardingTable::FindHf(std::string_view hf_name) const { return catalog_->Find(hf_name); }

int ShardingTable::FindParam(std::string_view param_name) const {
  auto it = param_index_.find(param_name);
  return it == param_index_.end() ? -1 : it->second;
}

std::span<const std::pair<int, int>> ShardingTable::PiecesOf(std::string_view hf_name) const {
  return PiecesOfHf(FindHf(hf_name));
}

std::span<const std::pair<int, int>> ShardingTable::PiecesOfHf(int hf) const {
  const auto [lo, hi] = std::equal_range(pieces_hf_.begin(), pieces_hf_.end(), hf);
  return std::span(pieces_).subspan(lo - pieces_hf_.begin(), hi - lo);
}

PieceRuns ShardingTable::Runs(int param, int piece) const {
  const WorkerParam& wp = params_[param];
  const ShardPiece& p = wp.pieces[piece];
  const Shape& hf = hf_tensors()[PieceHf(param, piece)].shape;
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
