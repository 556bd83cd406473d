#include "model/layer_tracker.h"

#include <algorithm>
#include <map>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace wsync {
namespace {

// "model.layers.3" for "model.layers.3.self_attn.qkv_proj.weight"; the name itself
// outside a decoder layer.
std::string LayerOf(std::string_view name) {
  constexpr std::string_view kLayers = "model.layers.";
  if (!name.starts_with(kLayers)) return std::string(name);
  const size_t dot = name.find('.', kLayers.size());
  return std::string(dot == std::string_view::npos ? name : name.substr(0, dot));
}

}  // namespace

LayerTracker::LayerTracker(const ShardingTable& table, const std::function<bool(int param)>& tracked,
                           std::string kind)
    : table_(table), kind_(std::move(kind)) {
  const size_t n = table.params().size();
  layer_of_.assign(n, -1);
  landed_.resize(n);
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < n; ++i) {
    if (!tracked(static_cast<int>(i))) continue;
    const std::string layer = LayerOf(table.params()[i].meta.name);
    auto [it, added] = index.emplace(layer, layers_.size());
    if (added) layers_.emplace_back().name = layer;
    Layer& l = layers_[it->second];
    l.params.push_back(static_cast<int>(i));
    l.pieces += table.params()[i].pieces.size();
    layer_of_[i] = static_cast<int>(it->second);
    landed_[i].assign(table.params()[i].pieces.size(), 0);
  }
}

void LayerTracker::MarkPiece(int param, int piece) {
  if (param < 0 || static_cast<size_t>(param) >= layer_of_.size() || layer_of_[param] < 0) return;
  std::vector<uint8_t>& marks = landed_[param];
  if (piece < 0 || static_cast<size_t>(piece) >= marks.size() || marks[piece]) return;
  marks[piece] = 1;
  Layer& l = layers_[layer_of_[param]];
  if (l.landed++ == 0) dirty_.push_back(static_cast<size_t>(layer_of_[param]));
}

void LayerTracker::MarkHf(std::string_view hf_name) {
  for (auto [i, k] : table_.PiecesOf(hf_name)) MarkPiece(i, k);
}

std::vector<int> LayerTracker::TakeCompleted() {
  std::vector<int> out;
  for (size_t li : dirty_) {
    Layer& l = layers_[li];
    if (l.taken || l.landed != l.pieces) continue;
    l.taken = true;
    out.insert(out.end(), l.params.begin(), l.params.end());
  }
  return out;
}

size_t LayerTracker::completed_layers() const {
  return static_cast<size_t>(
      std::ranges::count_if(dirty_, [&](size_t li) { return layers_[li].landed == layers_[li].pieces; }));
}

Status LayerTracker::CheckComplete() const {
  std::vector<std::string> problems;
  for (size_t li : dirty_) {
    const Layer& l = layers_[li];
    if (l.landed == l.pieces) continue;
    // The layer's followed HF tensors, in table order; those with a piece not landed.
    std::vector<std::string> all, missing;
    for (int p : l.params) {
      const std::vector<ShardPiece>& pieces = table_.params()[p].pieces;
      for (size_t k = 0; k < pieces.size(); ++k) {
        const std::string& hf = pieces[k].hf_name;
        if (std::ranges::find(all, hf) == all.end()) all.push_back(hf);
        if (!landed_[p][k] && std::ranges::find(missing, hf) == missing.end()) missing.push_back(hf);
      }
    }
    std::vector<std::string> shown;
    for (const std::string& m : missing) {
      shown.push_back(m.size() > l.name.size() + 1 && m.starts_with(l.name) ? m.substr(l.name.size() + 1) : m);
    }
    problems.push_back(fmt::format("{}: {} of {} {} tensors incomplete ({})", l.name, missing.size(), all.size(),
                                   kind_, fmt::join(shown, ", ")));
  }
  if (problems.empty()) return Status::Ok();
  return FailedPrecondition(fmt::format("tp rank {}: {} layer(s) touched by this update did not land every {} tensor: {}",
                                        table_.tp_rank(), problems.size(), kind_, fmt::join(problems, "; ")));
}

void LayerTracker::Reset() {
  for (size_t li : dirty_) {
    Layer& l = layers_[li];
    for (int p : l.params) std::ranges::fill(landed_[p], 0);
    l.landed = 0;
    l.taken = false;
  }
  dirty_.clear();
}

}  // namespace wsync
