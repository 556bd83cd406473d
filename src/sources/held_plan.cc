#include "sources/held_plan.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace wsync {
namespace {

using Interval = std::pair<int64_t, int64_t>;  // [first, second) along a dim

// The parts of [begin, end) that `covered` (sorted, disjoint) leaves out.
std::vector<Interval> Gaps(const std::vector<Interval>& covered, int64_t begin, int64_t end) {
  std::vector<Interval> gaps;
  int64_t at = begin;
  for (const Interval& c : covered) {
    if (c.second <= at) continue;
    if (c.first >= end) break;
    if (c.first > at) gaps.emplace_back(at, c.first);
    at = std::max(at, c.second);
    if (at >= end) break;
  }
  if (at < end) gaps.emplace_back(at, end);
  return gaps;
}

void Merge(std::vector<Interval>& covered) {
  std::sort(covered.begin(), covered.end());
  std::vector<Interval> merged;
  for (const Interval& c : covered) {
    if (!merged.empty() && c.first <= merged.back().second) {
      merged.back().second = std::max(merged.back().second, c.second);
    } else {
      merged.push_back(c);
    }
  }
  covered = std::move(merged);
}

}  // namespace

Result<std::vector<HeldGroupPlan>> PlanHeldPass(const std::vector<TensorMeta>& hf,
                                                const std::vector<LayerGroup>& groups, int members, int me,
                                                const std::vector<std::vector<HeldPiece>>& pieces,
                                                std::string_view tp_group) {
  if (pieces.size() != hf.size() || members < 1 || me < 0 || me >= members) {
    return Internal(fmt::format("held-pass plan of {} for member {}: {} piece lists for {} tensors and {} members",
                                tp_group, me, pieces.size(), hf.size(), members));
  }
  auto cannot = [&](const TensorMeta& m, const std::string& why) {
    return InvalidArgument(fmt::format("{} cannot assemble {} by itself: {}", tp_group, m.name, why));
  };
  std::vector<HeldGroupPlan> plans;
  for (size_t g = 0; g < groups.size(); ++g) {
    HeldGroupPlan plan;
    plan.group = g;
    plan.runs.resize(members);
    plan.contribution.assign(members, 0);
    auto hold = [&](size_t h) {
      plan.names.push_back(static_cast<int>(h));
      plan.offsets.push_back(plan.bytes);
      plan.bytes += hf[h].nbytes();
    };
    for (size_t h = groups[g].begin; h < groups[g].end; ++h) {
      if (pieces[h].empty()) continue;
      const TensorMeta& m = hf[h];
      std::vector<HeldPiece> order = pieces[h];
      std::stable_sort(order.begin(), order.end(),
                       [](const HeldPiece& a, const HeldPiece& b) { return a.member < b.member; });
      const int dim = order.front().dim;
      if (dim < 0 || static_cast<size_t>(dim) >= m.shape.size()) {
        return cannot(m, fmt::format("a slice along dim {} of a tensor of shape {}", dim, ShapeString(m.shape)));
      }
      const int64_t extent = m.shape[dim];
      for (const HeldPiece& p : order) {
        if (p.dim != dim) return cannot(m, fmt::format("its members slice it along dims {} and {}", dim, p.dim));
        if (p.member < 0 || p.member >= members) {
          return Internal(fmt::format("held-pass plan of {}: a slice of {} on member {} of {}", tp_group, m.name,
                                      p.member, members));
        }
        if (p.length <= 0) continue;
        if (p.start < 0 || p.length > extent - p.start) {
          return cannot(m, fmt::format("slice [{}, {}) along dim {} is outside its {} indices", p.start,
                                       p.start + p.length, dim, extent));
        }
      }
      const std::vector<bool> whole = HoldsWhole(order, members, extent);
      if (std::find(whole.begin(), whole.end(), true) != whole.end()) {  // an own tensor
        if (!whole[me]) continue;
        for (const HeldPiece& p : order) {
          if (p.member == me && p.length > 0) plan.own.push_back(HeldRun{p.param, plan.bytes, p.runs});
        }
        hold(h);
        continue;
      }
      std::vector<Interval> covered;
      for (const HeldPiece& p : order) {
        if (p.length <= 0) continue;
        const int64_t inner = p.runs.run_bytes / p.length;  // bytes per index along dim
        for (const Interval& gap : Gaps(covered, p.start, p.start + p.length)) {
          HeldRun run{p.param, plan.bytes, p.runs};
          run.runs.run_bytes = (gap.second - gap.first) * inner;
          run.runs.hf_offset += (gap.first - p.start) * inner;
          run.runs.dst_offset += (gap.first - p.start) * inner;
          plan.contribution[p.member] += static_cast<size_t>(run.runs.count * run.runs.run_bytes);
          plan.runs[p.member].push_back(run);
          covered.push_back(gap);
        }
        Merge(covered);
      }
      std::vector<Interval> missing = Gaps(covered, 0, extent);
      if (!missing.empty()) {
        return cannot(m, fmt::format("indices [{}, {}) of its {} along dim {} are on no member",
                                     missing.front().first, missing.front().second, extent, dim));
      }
      hold(h);
    }
    if (!plan.names.empty()) plans.push_back(std::move(plan));
  }
  return plans;
}

std::vector<bool> HoldsWhole(std::span<const HeldPiece> pieces, int members, int64_t extent) {
  std::vector<std::vector<Interval>> alone(members);
  for (const HeldPiece& p : pieces) {
    if (p.length > 0) alone[p.member].emplace_back(p.start, p.start + p.length);
  }
  std::vector<bool> whole(members, false);
  for (int t = 0; t < members; ++t) {
    if (alone[t].empty()) continue;
    Merge(alone[t]);
    whole[t] = Gaps(alone[t], 0, extent).empty();
  }
  return whole;
}

std::vector<int> TpGroupRanks(const ParallelLayout& layout, int rank) {
  ParallelLayout::Coord c = layout.CoordOf(rank);
  std::vector<int> ranks;
  for (int t = 0; t < layout.tp; ++t) {
    c.tp = t;
    ranks.push_back(layout.RankOf(c));
  }
  return ranks;
}

std::string DescribeTpGroup(const std::vector<int>& ranks) {
  return fmt::format("the TP group of trainer ranks {}", fmt::join(ranks, ", "));
}

std::vector<std::vector<HeldPiece>> HeldPiecesOf(const MegatronLayout& layout, int rank) {
  std::vector<std::vector<HeldPiece>> pieces(layout.hf_tensors().size());
  const std::vector<int> ranks = TpGroupRanks(layout.layout(), rank);
  for (int t = 0; t < static_cast<int>(ranks.size()); ++t) {
    const std::vector<WorkerParam>& params = layout.params(ranks[t]);
    for (int p = 0; p < static_cast<int>(params.size()); ++p) {
      for (int k = 0; k < static_cast<int>(params[p].pieces.size()); ++k) {
        const ShardPiece& s = params[p].pieces[k];
        pieces[layout.FindHf(s.hf_name)].push_back(
            HeldPiece{t, p, s.dim, s.hf_start, s.length, layout.Runs(ranks[t], p, k)});
      }
    }
  }
  return pieces;
}

size_t PackRuns(std::span<const HeldRun> runs, const std::vector<HostTensor>& params, std::byte* packed) {
  size_t at = 0;
  for (const HeldRun& r : runs) {
    const std::byte* src = params[r.param].storage.data() + r.runs.dst_offset;
    for (int64_t j = 0; j < r.runs.count; ++j, at += r.runs.run_bytes) {
      std::memcpy(packed + at, src + j * r.runs.dst_stride, r.runs.run_bytes);
    }
  }
  return at;
}

size_t UnpackRuns(std::span<const HeldRun> runs, const std::byte* packed, std::byte* group) {
  size_t at = 0;
  for (const HeldRun& r : runs) {
    std::byte* dst = group + r.group_offset + r.runs.hf_offset;
    for (int64_t j = 0; j < r.runs.count; ++j, at += r.runs.run_bytes) {
      std::memcpy(dst + j * r.runs.hf_stride, packed + at, r.runs.run_bytes);
    }
  }
  return at;
}

void PlaceRuns(std::span<const HeldRun> runs, const std::vector<HostTensor>& params, std::byte* group) {
  for (const HeldRun& r : runs) {
    const std::byte* src = params[r.param].storage.data() + r.runs.dst_offset;
    std::byte* dst = group + r.group_offset + r.runs.hf_offset;
    for (int64_t j = 0; j < r.runs.count; ++j) {
      std::memcpy(dst + j * r.runs.hf_stride, src + j * r.runs.dst_stride, r.runs.run_bytes);
    }
  }
}

}  // namespace wsync
