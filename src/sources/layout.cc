#include "sources/layout.h"

#include <algorithm>
#include <cstring>
#include <regex>

#include <fmt/format.h>

#include "sources/held_plan.h"

namespace wsync {

Result<ParallelLayout> ParallelLayout::Parse(std::string_view text, int world) {
  if (world < 1) return InvalidArgument(fmt::format("trainer ranks must be at least 1, got {}", world));
  ParallelLayout l;
  l.world = world;
  if (text == "fsdp") return l;
  static const std::regex kRe("tp([0-9]{1,6})pp([0-9]{1,6})ep([0-9]{1,6})(etp([0-9]{1,6}))?");
  std::cmatch m;
  std::string s(text);
  if (!std::regex_match(s.c_str(), m, kRe)) {
    return InvalidArgument(fmt::format(
        "trainer layout '{}': expected 'fsdp' or 'tpXppYepZ[etpW]' such as 'tp2pp2ep1' or 'tp2pp1ep2etp2'",
        text));
  }
  l.fsdp = false;
  l.tp = std::stoi(m[1]);
  l.pp = std::stoi(m[2]);
  l.ep = std::stoi(m[3]);
  l.etp = m[5].matched ? std::stoi(m[5]) : 1;
  if (l.tp < 1 || l.pp < 1 || l.ep < 1 || l.etp < 1) {
    return InvalidArgument(fmt::format("trainer layout '{}': tp, pp, ep and etp must be at least 1", text));
  }
  if (l.tp % l.etp != 0) {
    return InvalidArgument(fmt::format(
        "trainer layout '{}': etp {} must divide tp {} (expert shards are split over the TP group)",
        text, l.etp, l.tp));
  }
  const int cell = l.tp * l.pp * l.ep;
  if (world % cell != 0) {
    return InvalidArgument(fmt::format(
        "trainer layout '{}' needs a multiple of tp*pp*ep = {} ranks, got {}", text, cell, world));
  }
  return l;
}

std::string ParallelLayout::ToString() const {
  if (fsdp) return "fsdp";
  return etp == 1 ? fmt::format("tp{}pp{}ep{}", tp, pp, ep) : fmt::format("tp{}pp{}ep{}etp{}", tp, pp, ep, etp);
}

ParallelLayout::Coord ParallelLayout::CoordOf(int rank) const {
  if (fsdp) return Coord{0, 0, 0, rank};
  Coord c;
  c.tp = rank % tp;
  rank /= tp;
  c.ep = rank % ep;
  rank /= ep;
  c.dp = rank % dp();
  c.pp = rank / dp();
  return c;
}

int ParallelLayout::RankOf(const Coord& c) const {
  if (fsdp) return c.dp;
  return c.tp + tp * (c.ep + ep * (c.dp + dp() * c.pp));
}

std::string ParallelLayout::Describe(int rank) const {
  if (fsdp) return fmt::format("trainer rank {}", rank);
  Coord c = CoordOf(rank);
  return fmt::format("trainer rank {} (tp{} pp{} ep{} dp{})", rank, c.tp, c.pp, c.ep, c.dp);
}

std::pair<int64_t, int64_t> MegatronLayout::StageLayers(int stage) const {
  const int64_t L = config_.num_hidden_layers;
  return {stage * L / layout_.pp, (stage + 1) * L / layout_.pp};
}

Result<MegatronLayout> MegatronLayout::Build(const ModelConfig& c, const ParallelLayout& l) {
  WSYNC_RETURN_IF_ERROR(ValidateConfig(c));
  if (l.fsdp) return InvalidArgument("MegatronLayout needs a tpXppYepZ layout, not fsdp");
  auto bad = [&](std::string what) {
    return InvalidArgument(fmt::format("model {}, trainer layout {}: {}", c.name, l.ToString(), what));
  };
  if (c.architecture != kQwen3Dense && c.architecture != kQwen3Moe) {
    return bad(fmt::format("Megatron layouts cover {} and {} only, not {}", kQwen3Dense, kQwen3Moe,
                           c.architecture));
  }
  const int tp = l.tp, ep = l.ep;
  if (c.num_key_value_heads % tp != 0) {
    return bad(fmt::format("num_key_value_heads (query groups) {} is not divisible by tp {}",
                           c.num_key_value_heads, tp));
  }
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    return bad(fmt::format("num_attention_heads {} is not a multiple of num_key_value_heads {}",
                           c.num_attention_heads, c.num_key_value_heads));
  }
  const int64_t I = c.is_moe() ? c.moe_intermediate_size : c.intermediate_size;
  if (!c.is_moe() && I % tp != 0) {
    return bad(fmt::format("intermediate_size {} is not divisible by tp {}", I, tp));
  }
  if (c.num_hidden_layers < l.pp) {
    return bad(fmt::format("{} layers cannot fill {} pipeline stages", c.num_hidden_layers, l.pp));
  }
  if (ep > 1 && !c.is_moe()) return bad(fmt::format("ep {} needs a MoE model", ep));
  if (l.etp > 1 && !c.is_moe()) return bad(fmt::format("etp {} needs a MoE model", l.etp));
  if (c.is_moe() && c.moe_intermediate_size % l.etp != 0) {
    return bad(fmt::format("moe_intermediate_size {} is not divisible by etp {}", c.moe_intermediate_size, l.etp));
  }
  if (c.is_moe()) {
    for (int64_t layer = 0; layer < c.num_hidden_layers; ++layer) {
      if (c.num_experts % ep != 0) {
        return bad(fmt::format("layer {} (model.layers.{}.mlp.experts) has {} experts, not divisible by ep {}",
                               layer, layer, c.num_experts, ep));
      }
    }
  }

  MegatronLayout t;
  t.config_ = c;
  t.layout_ = l;
  t.params_.resize(l.world);
  const int64_t H = c.hidden_size, D = c.head_dim;
  const int64_t groups = c.num_key_value_heads, qpg = c.num_attention_heads / groups;
  const int64_t local_groups = groups / tp;
  const int64_t vpad = (c.vocab_size + 128 * tp - 1) / (128 * tp) * (128 * tp);
  for (int rank = 0; rank < l.world; ++rank) {
    const ParallelLayout::Coord k = l.CoordOf(rank);
    const int r = k.tp;
    const bool dense_primary = k.dp == 0 && k.ep == 0;
    const bool repl_primary = dense_primary && r == 0;
    auto& params = t.params_[rank];
    auto add = [&](std::string name, Shape shape, std::vector<ShardPiece> pieces) {
      params.push_back(WorkerParam{TensorMeta{std::move(name), c.dtype, std::move(shape)}, std::move(pieces)});
    };
    auto replicated = [&](std::string name, const std::string& hf, Shape shape, bool primary) {
      ShardPiece p{hf, 0, 0, shape[0], -1, 0, primary};
      add(std::move(name), std::move(shape), {std::move(p)});
    };
    auto vocab = [&](std::string name, const std::string& hf, bool primary) {
      const int64_t per = vpad / tp, start = r * per, end = std::min(c.vocab_size, start + per);
      std::vector<ShardPiece> pieces;
      if (end > start) pieces.push_back(ShardPiece{hf, 0, start, end - start, -1, 0, primary});
      add(std::move(name), {per, H}, std::move(pieces));
    };
    const auto [first, end] = t.StageLayers(k.pp);
    if (k.pp == 0) vocab("embedding.word_embeddings.weight", "model.embed_tokens.weight", dense_primary);
    for (int64_t layer = first; layer < end; ++layer) {
      const std::string m = fmt::format("decoder.layers.{}.", layer - first);
      const std::string h = fmt::format("model.layers.{}.", layer);
      const std::string a = h + "self_attn.";
      replicated(m + "self_attention.linear_qkv.layer_norm_weight", h + "input_layernorm.weight", {H},
                 repl_primary);
      std::vector<ShardPiece> qkv;
      for (int64_t j = 0; j < local_groups; ++j) {
        const int64_t g = r * local_groups + j, base = j * (qpg + 2) * D;
        qkv.push_back(ShardPiece{a + "q_proj.weight", 0, g * qpg * D, qpg * D, -1, base, dense_primary});
        qkv.push_back(ShardPiece{a + "k_proj.weight", 0, g * D, D, -1, base + qpg * D, dense_primary});
        qkv.push_back(ShardPiece{a + "v_proj.weight", 0, g * D, D, -1, base + (qpg + 1) * D, dense_primary});
      }
      add(m + "self_attention.linear_qkv.weight", {local_groups * (qpg + 2) * D, H}, std::move(qkv));
      replicated(m + "self_attention.q_layernorm.weight", a + "q_norm.weight", {D}, repl_primary);
      replicated(m + "self_attention.k_layernorm.weight", a + "k_norm.weight", {D}, repl_primary);
      const int64_t cols = local_groups * qpg * D;
      add(m + "self_attention.linear_proj.weight", {H, cols},
          {ShardPiece{a + "o_proj.weight", 1, r * cols, cols, -1, 0, dense_primary}});
      if (c.is_moe()) {
        const int64_t E = c.num_experts, n_local = E / ep;
        // Megatron's expert grid re-lays the stage's ranks etp fastest, then ep, then
        // expert-dp (MoE parallel folding): shard s, EP rank xr, copy d of the shard.
        const int64_t stage_index = r + tp * (k.ep + ep * k.dp);
        const int64_t Fl = c.moe_intermediate_size / l.etp, s = stage_index % l.etp;
        const int64_t xr = stage_index / l.etp % ep, d = stage_index / (l.etp * ep);
        replicated(m + "pre_mlp_layernorm.weight", h + "post_attention_layernorm.weight", {H}, repl_primary);
        replicated(m + "mlp.router.weight", h + "mlp.gate.weight", {E, H}, repl_primary);
        for (int64_t i = 0; i < n_local; ++i) {
          const int64_t e = xr * n_local + i;
          // Copies 0 .. tp/etp - 1 exist in every layout; export spreads experts over them.
          const bool primary = d == i % (tp / l.etp);
          const std::string x = fmt::format("{}mlp.experts.local_experts.{}.", m, i);
          const std::string y = fmt::format("{}mlp.experts.{}.", h, e);
          add(x + "linear_fc1.weight", {2 * Fl, H},
              {ShardPiece{y + "gate_proj.weight", 0, s * Fl, Fl, -1, 0, primary},
               ShardPiece{y + "up_proj.weight", 0, s * Fl, Fl, -1, Fl, primary}});
          add(x + "linear_fc2.weight", {H, Fl},
              {ShardPiece{y + "down_proj.weight", 1, s * Fl, Fl, -1, 0, primary}});
        }
      } else {
        const int64_t Il = I / tp;
        replicated(m + "mlp.linear_fc1.layer_norm_weight", h + "post_attention_layernorm.weight", {H},
                   repl_primary);
        add(m + "mlp.linear_fc1.weight", {2 * Il, H},
            {ShardPiece{h + "mlp.gate_proj.weight", 0, r * Il, Il, -1, 0, dense_primary},
             ShardPiece{h + "mlp.up_proj.weight", 0, r * Il, Il, -1, Il, dense_primary}});
        add(m + "mlp.linear_fc2.weight", {H, Il},
            {ShardPiece{h + "mlp.down_proj.weight", 1, r * Il, Il, -1, 0, dense_primary}});
      }
    }
    if (k.pp == l.pp - 1) {
      replicated("decoder.final_layernorm.weight", "model.norm.weight", {H}, repl_primary);
      if (!c.tie_word_embeddings) {
        vocab("output_layer.weight", "lm_head.weight", dense_primary);
      } else if (l.pp > 1) {
        // Tied over several stages: the last stage keeps its own copy of the embedding
        // (Megatron keeps the two equal); export reads the first stage's.
        vocab("output_layer.weight", "model.embed_tokens.weight", false);
      }
    }
  }
  WSYNC_RETURN_IF_ERROR(t.Index());
  return t;
}

Status MegatronLayout::Index() {
  hf_ = HfTensors(config_);
  for (size_t i = 0; i < hf_.size(); ++i) hf_index_.emplace(hf_[i].name, static_cast<int>(i));
  export_.assign(hf_.size(), {});
  std::vector<int64_t> covered(hf_.size(), 0);
  for (int rank = 0; rank < layout_.world; ++rank) {
    const auto& params = params_[rank];
    for (size_t p = 0; p < params.size(); ++p) {
      for (size_t k = 0; k < params[p].pieces.size(); ++k) {
        const ShardPiece& piece = params[p].pieces[k];
        int hf = FindHf(piece.hf_name);
        if (hf < 0) return Internal(fmt::format("layout table names unknown tensor {}", piece.hf_name));
        if (!piece.primary) continue;
        export_[hf].push_back(ExportPiece{rank, static_cast<int>(p), static_cast<int>(k)});
        covered[hf] += hf_[hf].numel() / hf_[hf].shape[piece.dim] * piece.length;
      }
    }
  }
  // Self-check: the primary pieces tile every HF tensor exactly once.
  for (size_t i = 0; i < hf_.size(); ++i) {
    if (covered[i] != hf_[i].numel()) {
      return Internal(fmt::format("layout {} of {}: primary pieces cover {} of {} elements of {}",
                                  layout_.ToString(), config_.name, covered[i], hf_[i].numel(), hf_[i].name));
    }
  }
  return Status::Ok();
}

int MegatronLayout::FindHf(std::string_view name) const {
  auto it = hf_index_.find(std::string(name));
  return it == hf_index_.end() ? -1 : it->second;
}

std::vector<std::string> MegatronLayout::HeldNames(int rank) const {
  // The held pass's rule (held_plan.h): a tensor some member holds whole is held by the
  // members holding it whole; any other tensor the group has pieces of, by every member.
  const std::vector<std::vector<HeldPiece>> pieces = HeldPiecesOf(*this, rank);
  const int me = layout_.CoordOf(rank).tp;
  std::vector<std::string> names;
  for (size_t i = 0; i < hf_.size(); ++i) {
    if (pieces[i].empty()) continue;
    const Shape& shape = hf_[i].shape;
    const int dim = pieces[i].front().dim;  // the held pass refuses mixed dims
    if (dim >= 0 && static_cast<size_t>(dim) < shape.size()) {
      const std::vector<bool> whole = HoldsWhole(pieces[i], layout_.tp, shape[dim]);
      if (std::find(whole.begin(), whole.end(), true) != whole.end() && !whole[me]) continue;
    }
    names.push_back(hf_[i].name);
  }
  return names;
}

PieceRuns MegatronLayout::Runs(int rank, int param, int piece) const {
  const WorkerParam& wp = params_[rank][param];
  const ShardPiece& p = wp.pieces[piece];
  const Shape& hf = hf_[FindHf(p.hf_name)].shape;
  const Shape& dst = wp.meta.shape;
  const int64_t item = static_cast<int64_t>(ItemSize(wp.meta.dtype));
  int64_t inner = item, outer = 1;
  for (size_t d = p.dim + 1; d < hf.size(); ++d) inner *= hf[d];
  for (int d = 0; d < p.dim; ++d) outer *= hf[d];
  PieceRuns runs;
  runs.count = outer;
  runs.run_bytes = p.length * inner;
  runs.hf_offset = p.hf_start * inner;
  runs.hf_stride = hf[p.dim] * inner;
  runs.dst_offset = p.dst_start * inner;
  runs.dst_stride = dst[p.dim] * inner;
  return runs;
}

Status LayOutMegatronInto(const MegatronLayout& layout, int rank, const std::vector<HostTensor>& hf,
                          std::vector<HostTensor>& params) {
  const auto& want = layout.hf_tensors();
  if (hf.size() != want.size()) {
    return InvalidArgument(fmt::format("lay out: {} HF tensors given, model {} has {}", hf.size(),
                                       layout.config().name, want.size()));
  }
  // `hf` may come in any order (a checkpoint's file order, often sorted by name): match
  // by name. source_of[i] is the position in `hf` of the layout's tensor i.
  std::vector<int> source_of(want.size(), -1);
  for (size_t j = 0; j < hf.size(); ++j) {
    int i = layout.FindHf(hf[j].meta.name);
    if (i < 0) {
      return InvalidArgument(fmt::format("lay out: model {} has no tensor {}", layout.config().name, hf[j].meta.name));
    }
    if (source_of[i] >= 0) return InvalidArgument(fmt::format("lay out: tensor {} is given twice", hf[j].meta.name));
    source_of[i] = static_cast<int>(j);
    WSYNC_RETURN_IF_ERROR(CheckSameMeta(want[i], hf[j].meta));
  }
  const auto& table = layout.params(rank);
  if (params.size() != table.size()) return InvalidArgument("lay out: parameter count differs from the table");
  for (size_t p = 0; p < table.size(); ++p) {
    WSYNC_RETURN_IF_ERROR(CheckSameMeta(table[p].meta, params[p].meta));
    std::byte* dst = params[p].storage.data();
    for (size_t k = 0; k < table[p].pieces.size(); ++k) {
      const std::byte* src = hf[source_of[layout.FindHf(table[p].pieces[k].hf_name)]].storage.data();
      PieceRuns run = layout.Runs(rank, static_cast<int>(p), static_cast<int>(k));
      for (int64_t j = 0; j < run.count; ++j) {
        std::memcpy(dst + run.dst_offset + j * run.dst_stride, src + run.hf_offset + j * run.hf_stride,
                    run.run_bytes);
      }
    }
  }
  return Status::Ok();
}

Result<std::vector<HostTensor>> LayOutMegatron(const MegatronLayout& layout, int rank,
                                               const std::vector<HostTensor>& hf) {
  std::vector<HostTensor> params;
  for (const WorkerParam& p : layout.params(rank)) {
    WSYNC_ASSIGN_OR_RETURN(HostTensor t, HostTensor::Zeros(p.meta));
    params.push_back(std::move(t));
  }
  WSYNC_RETURN_IF_ERROR(LayOutMegatronInto(layout, rank, hf, params));
  return params;
}

}  // namespace wsync
