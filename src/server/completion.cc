// The toy generation's token function and the parser of its request body (generation.h).
#include <fmt/format.h>

#include <cstring>

#include "server/generation.h"

namespace wsync {

using nlohmann::json;

uint64_t GenerationMix(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

namespace {

uint64_t FoldWords(uint64_t h, std::span<const std::byte> bytes) {
  size_t i = 0;
  for (; i + 8 <= bytes.size(); i += 8) {
    uint64_t w = 0;
    for (int b = 7; b >= 0; --b) w = (w << 8) | static_cast<uint8_t>(bytes[i + b]);
    h = GenerationMix(h ^ w);
  }
  if (i < bytes.size()) {
    uint64_t w = 0;
    for (size_t b = bytes.size(); b > i; --b) w = (w << 8) | static_cast<uint8_t>(bytes[b - 1]);
    h = GenerationMix(h ^ w);
  }
  return h;
}

// A non-negative integer field no larger than `hi`, or `fallback` when absent.
Result<int64_t> BoundedInt(const json& body, const char* field, int64_t fallback, int64_t lo, int64_t hi) {
  auto it = body.find(field);
  if (it == body.end() || it->is_null()) return fallback;
  bool in_range = false;
  int64_t v = 0;
  if (it->is_number_unsigned()) {
    uint64_t u = it->get<uint64_t>();
    in_range = u <= static_cast<uint64_t>(hi);
    v = static_cast<int64_t>(u);
  } else if (it->is_number_integer()) {
    v = it->get<int64_t>();
    in_range = v >= lo && v <= hi;
  }
  if (!in_range || v < lo) {
    return InvalidArgument(fmt::format("field '{}' must be an integer in [{}, {}], got {}", field, lo, hi,
                                       it->dump(-1, ' ', true, json::error_handler_t::replace).substr(0, 64)));
  }
  return v;
}

}  // namespace

uint64_t WeightProbe(std::span<const std::byte> embed_row, std::span<const std::byte> norm) {
  return FoldWords(FoldWords(kProbeSeed, embed_row), norm);
}

uint64_t AbsorbToken(uint64_t state, int64_t token, uint64_t probe) {
  return GenerationMix((state ^ probe) + static_cast<uint64_t>(token + 1) * kGolden);
}

int64_t SampleToken(uint64_t state, int64_t vocab_size) {
  return static_cast<int64_t>(state % static_cast<uint64_t>(vocab_size));
}

std::string RenderTokens(std::span<const int32_t> tokens) {
  std::string out;
  for (int32_t t : tokens) {
    if (t >= 32 && t <= 126) {
      out.push_back(static_cast<char>(t));
    } else {
      out += fmt::format("<{}>", t);
    }
  }
  return out;
}

Result<CompletionRequest> ParseCompletionRequest(const json& body, const CompletionLimits& limits) {
  if (!body.is_object()) return InvalidArgument("a completions request is a JSON object");
  CompletionRequest r;
  if (auto it = body.find("model"); it != body.end() && !it->is_null()) {
    if (!it->is_string()) return InvalidArgument("field 'model' must be a string");
    const std::string& model = it->get_ref<const std::string&>();
    if (model != limits.model && limits.is_adapter && limits.is_adapter(model)) {
      r.adapter = model;
    } else if (model != limits.model) {
      return NotFound(fmt::format("The model `{}` does not exist: this server serves '{}' (field 'model')",
                                  it->get_ref<const std::string&>().substr(0, 256), limits.model));
    }
  }
  if (auto it = body.find("stream"); it != body.end() && !it->is_null()) {
    if (!it->is_boolean()) return InvalidArgument("field 'stream' must be a boolean");
    if (it->get<bool>()) return InvalidArgument("field 'stream': this server answers completions whole, not streamed");
  }
  WSYNC_ASSIGN_OR_RETURN(int64_t n, BoundedInt(body, "n", 1, 1, 1));
  (void)n;
  WSYNC_ASSIGN_OR_RETURN(int64_t max_tokens, BoundedInt(body, "max_tokens", 16, 1, limits.max_tokens));
  r.max_tokens = static_cast<int>(max_tokens);
  if (auto it = body.find("request_id"); it != body.end() && !it->is_null()) {
    if (!it->is_string()) return InvalidArgument("field 'request_id' must be a string");
    const std::string& id = it->get_ref<const std::string&>();
    if (id.empty() || id.size() > limits.max_request_id_bytes) {
      return InvalidArgument(
          fmt::format("field 'request_id' must hold 1 to {} bytes, got {}", limits.max_request_id_bytes, id.size()));
    }
    r.request_id = id;
  }
  auto it = body.find("prompt");
  if (it == body.end() || it->is_null()) return InvalidArgument("a completions request needs a field 'prompt'");
  if (it->is_string()) {
    const std::string& text = it->get_ref<const std::string&>();
    if (text.size() > limits.max_prompt_tokens) {
      return InvalidArgument(fmt::format("field 'prompt' has {} tokens, more than this server's {}", text.size(),
                                         limits.max_prompt_tokens));
    }
    r.prompt.reserve(text.size());
    for (unsigned char c : text) {
      if (c >= limits.vocab_size) {
        return InvalidArgument(fmt::format("field 'prompt': byte {} is not below the vocabulary size {}", c,
                                           limits.vocab_size));
      }
      r.prompt.push_back(c);
    }
  } else if (it->is_array()) {
    if (it->size() > limits.max_prompt_tokens) {
      return InvalidArgument(fmt::format("field 'prompt' has {} tokens, more than this server's {}", it->size(),
                                         limits.max_prompt_tokens));
    }
    r.prompt.reserve(it->size());
    for (size_t i = 0; i < it->size(); ++i) {
      const json& t = (*it)[i];
      bool ok = (t.is_number_unsigned() && t.get<uint64_t>() < static_cast<uint64_t>(limits.vocab_size)) ||
                (t.is_number_integer() && !t.is_number_unsigned() && t.get<int64_t>() >= 0 &&
                 t.get<int64_t>() < limits.vocab_size);
      if (!ok) {
        return InvalidArgument(fmt::format(
            "field 'prompt': element {} must be a token id in [0, {}) (one prompt, as a string or a list of ids)", i,
            limits.vocab_size));
      }
      r.prompt.push_back(static_cast<int32_t>(t.get<int64_t>()));
    }
  } else {
    return InvalidArgument("field 'prompt' must be a string or a list of token ids");
  }
  if (r.prompt.empty()) return InvalidArgument("field 'prompt' is empty");
  return r;
}

}  // namespace wsync
