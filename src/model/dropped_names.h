// Dropped names: tensors a trainer may send that no inference model holds.
//
// A trainer sends what it has: a module's state_dict() or a Hugging Face checkpoint. Some
// of those names have no place in the model a server runs, and vLLM's load_weights skips
// them; wsync's receivers drop the same names by the one rule here, so that a trainer can
// send its tensors as they are. A dropped tensor is admitted whatever the model (its
// dtype and shape are not checked against it), its bytes travel with the rest of the
// update, and nothing of it lands; each is logged at debug level with its name. The rule:
//
//   * `...rotary_emb.inv_freq`, `...rotary_emb.cos_cached`, `...rotary_emb.sin_cached`
//     (any prefix): rotary-embedding buffers, which the server computes from the config.
//   * `lm_head.weight` of a model with tie_word_embeddings: the server's lm_head is
//     model.embed_tokens.weight itself, which the update carries.
//   * `model.layers.N.embed_tokens.weight` and `model.layers.N.shared_head.head.weight`:
//     a multi-token-prediction layer's copies of model.embed_tokens.weight and
//     lm_head.weight in DeepSeek-V3 and GLM-4.5 checkpoints. The MTP drafter reads the
//     target's two tensors (the same memory), so the copies are dropped unchecked, as
//     vLLM drops them when the drafter shares the target's embedding and head.
//
// Trainers may leave these names out where that is cheap (`wsync push --checkpoint`
// does). Pure functions; thread-safe.
#pragma once

#include <string_view>

namespace wsync {

struct ModelConfig;

// Why a model whose tie_word_embeddings is `tied` holds no tensor `hf_name` (a phrase for
// logs: "rotary-embedding buffer, computed by the server"); empty when the rule keeps it.
std::string_view DroppedNameReason(std::string_view hf_name, bool tied);
// The same for a known model: `tied` is its tie_word_embeddings.
std::string_view DroppedNameReason(std::string_view hf_name, const ModelConfig& config);

}  // namespace wsync
