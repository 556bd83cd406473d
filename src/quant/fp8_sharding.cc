#include "quant/fp8_sharding.h"

#include <algorithm>
#include <cstring>
#include <initializer_list>

#include <fmt/format.h>

namespace wsync {
namespace {

constexpr std::string_view kWeight = ".weight";
constexpr std::string_view kScaleInv = "_scale_inv";

// The parameter's sub-tensor a piece lands in: its last two dims.
std::span<const int64_t> DstMatrix(const WorkerParam& wp) {
  std::span<const int64_t> s(wp.meta.shape);
  return s.subspan(s.size() - 2);
}

const char* DimWord(int dim) { return dim == 0 ? "rows" : "columns"; }

// The piece's boundaries on the 128 grid; "" when on it, else the reason.
std::string OffGrid(const ShardPiece& p, int64_t hf_extent, int64_t dst_extent) {
  const int64_t hf_end = p.hf_start + p.length, dst_end = p.dst_start + p.length;
  auto off = [](int64_t v) { return v % fp8::kBlock != 0; };
  int64_t bad = -1;
  if (off(p.hf_start)) {
    bad = p.hf_start;
  } else if (off(p.dst_start)) {
    bad = p.dst_start;
  } else if (off(p.length) && !(hf_end == hf_extent && dst_end == dst_extent)) {
    bad = off(hf_end) && hf_end != hf_extent ? hf_end : dst_end;
  }
  if (bad < 0) return "";
  return fmt::format("boundary {} is not a multiple of {}", bad, fp8::kBlock);
}

Status CheckParam(const ShardingTable& t, int param) {
  const WorkerParam& wp = t.params()[param];
  const ModelConfig& c = t.config();
  if (wp.meta.shape.size() != 2 && wp.meta.shape.size() != 3) {
    return InvalidArgument(fmt::format("model {}: fp8 parameter {} has shape {}, not 2-D or stacked 3-D",
                                       c.name, wp.meta.name, ShapeString(wp.meta.shape)));
  }
  const std::span<const int64_t> dst = DstMatrix(wp);
  for (const ShardPiece& p : wp.pieces) {
    if (!IsFp8Quantized(p.hf_name)) {
      return InvalidArgument(fmt::format("model {}: parameter {} mixes fp8 and unquantized tensor {}",
                                         c.name, wp.meta.name, p.hf_name));
    }
    const TensorMeta& hf = t.hf_tensors()[t.FindHf(p.hf_name)];
    if (hf.shape.size() != 2 || p.dim < 0 || p.dim > 1) {
      return InvalidArgument(fmt::format("model {}: fp8 tensor {} has shape {}, not 2-D", c.name, hf.name,
                                         ShapeString(hf.shape)));
    }
    const std::string why = OffGrid(p, hf.shape[p.dim], dst[p.dim]);
    if (why.empty()) continue;
    const char* what = DimWord(p.dim);
    return InvalidArgument(fmt::format(
        "model {}, tp {}: fp8 block quantization needs shard boundaries at multiples of {}; {} [{}, {}) "
        "of {} land at {} [{}, {}) of {}{} on tp rank {}: {}",
        c.name, t.tp_size(), fp8::kBlock, what, p.hf_start, p.hf_start + p.length, p.hf_name, what,
        p.dst_start, p.dst_start + p.length, wp.meta.name,
        p.dst_index >= 0 ? fmt::format(" (expert {})", p.dst_index) : "", t.tp_rank(), why));
  }
  return Status::Ok();
}

std::string ScaleParamName(std::string_view param_name) {
  // vLLM: "...qkv_proj.weight" -> "...qkv_proj.weight_scale_inv", "w13_weight" ->
  // "w13_weight_scale_inv".
  return std::string(param_name) + std::string(kScaleInv);
}

// Runs between a [hr, hc] HF grid and a [dr, dc] parameter sub-grid, in units of `item`
// bytes per grid cell, for a piece [start, start+length) -> dst_start along `dim`;
// `dst_base` is the byte offset of the parameter's sub-tensor.
PieceRuns GridRuns(const int64_t hf[2], const int64_t dst[2], int dim, int64_t start, int64_t length,
                   int64_t dst_start, int64_t dst_base, int64_t item) {
  const int64_t inner = dim == 0 ? hf[1] * item : item;
  PieceRuns r;
  r.count = dim == 0 ? 1 : hf[0];
  r.run_bytes = length * inner;
  r.hf_offset = start * inner;
  r.hf_stride = hf[dim] * inner;
  r.dst_offset = dst_base + dst_start * inner;
  r.dst_stride = dst[dim] * inner;
  return r;
}

void CopyRuns(const PieceRuns& r, const std::byte* param, std::byte* hf) {
  for (int64_t k = 0; k < r.count; ++k) {
    std::memcpy(hf + r.hf_offset + k * r.hf_stride, param + r.dst_offset + k * r.dst_stride,
                static_cast<size_t>(r.run_bytes));
  }
}

}  // namespace

bool IsFp8Quantized(std::string_view hf_name) {
  // model.layers.N.self_attn.{q,k,v,o}_proj.weight, model.layers.N.mlp.{gate,up,down}_proj.weight,
  // model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight,
  // model.layers.N.mlp.shared_experts.{gate,up,down}_proj.weight.
  std::string_view n = hf_name;
  auto eat = [&n](std::string_view prefix) {
    if (!n.starts_with(prefix)) return false;
    n.remove_prefix(prefix.size());
    return true;
  };
  auto eat_index = [&n] {  // digits, then '.'
    size_t k = 0;
    while (k < n.size() && n[k] >= '0' && n[k] <= '9') ++k;
    if (k == 0 || k >= n.size() || n[k] != '.') return false;
    n.remove_prefix(k + 1);
    return true;
  };
  auto eat_any = [&eat](std::initializer_list<std::string_view> options) {
    for (std::string_view o : options) {
      if (eat(o)) return true;
    }
    return false;
  };
  if (!eat("model.layers.") || !eat_index()) return false;
  if (eat("self_attn.")) return eat_any({"q", "k", "v", "o"}) && n == "_proj.weight";
  if (!eat("mlp.")) return false;
  if (eat("experts.") && !eat_index()) return false;
  (void)eat("shared_experts.");
  return eat_any({"gate", "up", "down"}) && n == "_proj.weight";
}

std::string Fp8ScaleInvName(std::string_view weight_name) {
  return std::string(weight_name) + std::string(kScaleInv);
}

std::optional<Fp8HfPart> ParseFp8HfName(std::string_view name) {
  if (IsFp8Quantized(name)) return Fp8HfPart{std::string(name), false};
  if (name.ends_with(kScaleInv)) {
    std::string_view base = name.substr(0, name.size() - kScaleInv.size());
    if (base.ends_with(kWeight) && IsFp8Quantized(base)) return Fp8HfPart{std::string(base), true};
  }
  return std::nullopt;
}

std::vector<TensorMeta> Fp8HfTensors(const ModelConfig& config) {
  std::vector<TensorMeta> out;
  for (TensorMeta& m : HfTensors(config)) {
    if (!IsFp8Quantized(m.name)) {
      out.push_back(std::move(m));
      continue;
    }
    TensorMeta scale{Fp8ScaleInvName(m.name), DType::kF32, {Fp8Blocks(m.shape[0]), Fp8Blocks(m.shape[1])}};
    m.dtype = DType::kF8E4M3;
    out.push_back(std::move(m));
    out.push_back(std::move(scale));
  }
  return out;
}

bool IsFp8Param(const ShardingTable& table, int param) {
  const WorkerParam& wp = table.params()[param];
  return !wp.pieces.empty() && IsFp8Quantized(wp.pieces.front().hf_name);
}

Status CheckFp8Sharding(const ShardingTable& table) {
  for (int i = 0; i < static_cast<int>(table.params().size()); ++i) {
    if (IsFp8Param(table, i)) WSYNC_RETURN_IF_ERROR(CheckParam(table, i));
  }
  return Status::Ok();
}

Result<Fp8ParamLayout> Fp8LayoutOf(const ShardingTable& table, int param) {
  if (param < 0 || param >= static_cast<int>(table.params().size())) {
    return InvalidArgument(fmt::format("model {}: no parameter {}", table.config().name, param));
  }
  const WorkerParam& wp = table.params()[param];
  if (!IsFp8Param(table, param)) {
    return InvalidArgument(fmt::format("model {}: parameter {} is not fp8-quantized", table.config().name,
                                       wp.meta.name));
  }
  WSYNC_RETURN_IF_ERROR(CheckParam(table, param));
  const Shape& s = wp.meta.shape;
  Fp8ParamLayout l;
  l.shape.count = s.size() == 3 ? s[0] : 1;
  l.shape.rows = s[s.size() - 2];
  l.shape.cols = s[s.size() - 1];
  l.weight = TensorMeta{wp.meta.name, DType::kF8E4M3, s};
  Shape grid = s;
  grid[s.size() - 2] = Fp8Blocks(l.shape.rows);
  grid[s.size() - 1] = Fp8Blocks(l.shape.cols);
  l.scale_inv = TensorMeta{ScaleParamName(wp.meta.name), DType::kF32, std::move(grid)};
  return l;
}

Status QuantizeFp8Param(const ShardingTable& table, int param, std::span<const std::byte> src,
                        std::span<uint8_t> weight, std::span<float> scale_inv, size_t threads) {
  WSYNC_ASSIGN_OR_RETURN(Fp8ParamLayout l, Fp8LayoutOf(table, param));
  return QuantizeFp8Blocks(src, table.params()[param].meta.dtype, l.shape, weight, scale_inv, threads,
                           l.weight.name);
}

PieceRuns Fp8WeightRuns(const ShardingTable& table, int param, int piece) {
  const WorkerParam& wp = table.params()[param];
  const ShardPiece& p = wp.pieces[piece];
  const Shape& hs = table.hf_tensors()[table.FindHf(p.hf_name)].shape;
  const std::span<const int64_t> ds = DstMatrix(wp);
  const int64_t hf[2] = {hs[0], hs[1]}, dst[2] = {ds[0], ds[1]};
  const int64_t base = p.dst_index >= 0 ? p.dst_index * dst[0] * dst[1] : 0;
  return GridRuns(hf, dst, p.dim, p.hf_start, p.length, p.dst_start, base, 1);
}

PieceRuns Fp8ScaleRuns(const ShardingTable& table, int param, int piece) {
  const WorkerParam& wp = table.params()[param];
  const ShardPiece& p = wp.pieces[piece];
  const Shape& hs = table.hf_tensors()[table.FindHf(p.hf_name)].shape;
  const std::span<const int64_t> ds = DstMatrix(wp);
  const int64_t hf[2] = {Fp8Blocks(hs[0]), Fp8Blocks(hs[1])};
  const int64_t dst[2] = {Fp8Blocks(ds[0]), Fp8Blocks(ds[1])};
  const int64_t item = static_cast<int64_t>(sizeof(float));
  const int64_t base = p.dst_index >= 0 ? p.dst_index * dst[0] * dst[1] * item : 0;
  // On the grid, a piece's blocks start at start/128 and number ceil(length/128).
  return GridRuns(hf, dst, p.dim, p.hf_start / fp8::kBlock, Fp8Blocks(p.length), p.dst_start / fp8::kBlock,
                  base, item);
}

std::vector<Fp8Source> Fp8SourcesOf(const ShardingTable& table, std::string_view name) {
  std::vector<Fp8Source> out;
  const std::optional<Fp8HfPart> part = ParseFp8HfName(name);
  if (!part) return out;
  for (auto [i, k] : table.PiecesOf(part->hf_name)) {
    out.push_back(Fp8Source{i, k, table.params()[i].pieces[k].primary, part->scale,
                            part->scale ? Fp8ScaleRuns(table, i, k) : Fp8WeightRuns(table, i, k)});
  }
  return out;
}

Status ReadBackFp8Hf(std::span<const Fp8WorkerView> group, std::string_view name, std::span<std::byte> out) {
  if (group.empty() || group[0].table == nullptr) return InvalidArgument("fp8 read-back: empty TP group");
  const ShardingTable& t0 = *group[0].table;
  const std::optional<Fp8HfPart> part = ParseFp8HfName(name);
  const int h = part ? t0.FindHf(part->hf_name) : -1;
  if (h < 0) {
    return InvalidArgument(fmt::format("fp8 read-back: model {} has no fp8 checkpoint tensor {}", t0.config().name,
                                       name));
  }
  const Shape& hs = t0.hf_tensors()[h].shape;
  const size_t want = part->scale ? static_cast<size_t>(Fp8Blocks(hs[0]) * Fp8Blocks(hs[1])) * sizeof(float)
                                  : static_cast<size_t>(hs[0] * hs[1]);
  if (out.size() != want) {
    return InvalidArgument(fmt::format("fp8 read-back of {}: output holds {} bytes, the tensor {}", name, out.size(),
                                       want));
  }
  size_t got = 0;
  for (const Fp8WorkerView& w : group) {
    if (w.table == nullptr || w.params.size() != w.table->params().size()) {
      return InvalidArgument(fmt::format("fp8 read-back of {}: a worker's view lacks its parameters", name));
    }
    for (const Fp8Source& src : Fp8SourcesOf(*w.table, name)) {
      if (!src.primary) continue;
      const Fp8ParamView& v = w.params[src.param];
      const std::span<const std::byte> bytes = src.scale ? std::as_bytes(v.scale_inv) : std::as_bytes(v.weight);
      const PieceRuns& r = src.runs;
      if (static_cast<int64_t>(bytes.size()) < r.dst_offset + (r.count - 1) * r.dst_stride + r.run_bytes) {
        return InvalidArgument(fmt::format("fp8 read-back of {}: tp rank {} holds too few bytes of {}", name,
                                           w.table->tp_rank(), w.table->params()[src.param].meta.name));
      }
      CopyRuns(r, bytes.data(), out.data());
      got += static_cast<size_t>(r.count * r.run_bytes);
    }
  }
  if (got != want) {
    return Internal(fmt::format("fp8 read-back of {}: primary pieces cover {} of {} bytes", name, got, want));
  }
  return Status::Ok();
}

}  // namespace wsync
