#include "model/dropped_names.h"

#include <array>

#include "model/config.h"

namespace wsync {
namespace {

// "model.layers.<digits>.<suffix>" with one to ten digits.
bool IsLayerTensor(std::string_view name, std::string_view suffix) {
  constexpr std::string_view kPrefix = "model.layers.";
  if (!name.starts_with(kPrefix) || !name.ends_with(suffix)) return false;
  name.remove_prefix(kPrefix.size());
  name.remove_suffix(suffix.size());
  if (name.empty() || name.size() > 10) return false;
  for (char c : name) {
    if (c < '0' || c > '9') return false;
  }
  return true;
}

}  // namespace

std::string_view DroppedNameReason(std::string_view hf_name, bool tied) {
  static constexpr std::array<std::string_view, 3> kRotary = {"rotary_emb.inv_freq", "rotary_emb.cos_cached",
                                                              "rotary_emb.sin_cached"};
  for (std::string_view r : kRotary) {
    if (hf_name == r || (hf_name.ends_with(r) && hf_name[hf_name.size() - r.size() - 1] == '.')) {
      return "rotary-embedding buffer, computed by the server";
    }
  }
  if (tied && hf_name == "lm_head.weight") return "tied to model.embed_tokens.weight (tie_word_embeddings)";
  if (IsLayerTensor(hf_name, ".embed_tokens.weight")) {
    return "an MTP layer's copy of model.embed_tokens.weight, which the drafter shares";
  }
  if (IsLayerTensor(hf_name, ".shared_head.head.weight")) {
    return "an MTP layer's copy of lm_head.weight, which the drafter shares";
  }
  return {};
}

std::string_view DroppedNameReason(std::string_view hf_name, const ModelConfig& config) {
  return DroppedNameReason(hf_name, config.tie_word_embeddings);
}

}  // namespace wsync
