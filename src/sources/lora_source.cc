#include "sources/lora_source.h"

#include <algorithm>
#include <cstring>
#include <map>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace wsync {

namespace {

constexpr std::string_view kPrefix = "base_model.model.";

struct Parsed {
  std::string module;  // with the PEFT prefix
  char ab = 'A';
};

std::optional<Parsed> Parse(std::string_view name) {
  constexpr std::string_view kWeight = ".weight";
  if (!name.ends_with(kWeight)) return std::nullopt;
  name.remove_suffix(kWeight.size());
  // "<module>.lora_A" or "<module>.lora_A.<adapter>"
  size_t at = name.rfind(".lora_");
  if (at == std::string_view::npos || at + 7 > name.size()) return std::nullopt;
  const char ab = name[at + 6];
  std::string_view tail = name.substr(at + 7);
  if ((ab != 'A' && ab != 'B') || (!tail.empty() && (tail[0] != '.' || tail.size() < 2 ||
                                                      tail.find('.', 1) != std::string_view::npos))) {
    return std::nullopt;
  }
  std::string_view module = name.substr(0, at);
  if (module.empty()) return std::nullopt;
  return Parsed{module.starts_with(kPrefix) ? std::string(module) : std::string(kPrefix) + std::string(module), ab};
}

}  // namespace

std::optional<std::string> PeftLoraName(std::string_view name) {
  std::optional<Parsed> p = Parse(name);
  if (!p) return std::nullopt;
  return fmt::format("{}.lora_{}.weight", p->module, p->ab);
}

Result<std::unique_ptr<HostTensorSource>> LoraAdapterSource(const LoraAdapterOptions& lora,
                                                            std::vector<std::vector<HostTensor>> per_rank) {
  if (lora.r < 1) return InvalidArgument(fmt::format("adapter {}: r is {}, must be >= 1", lora.name, lora.r));
  std::map<std::string, HostTensor> kept;  // by PEFT name
  std::map<std::string, size_t> holder;    // the rank whose copy is kept
  for (size_t rank = 0; rank < per_rank.size(); ++rank) {
    for (HostTensor& t : per_rank[rank]) {
      std::optional<std::string> name = PeftLoraName(t.meta.name);
      if (!name) continue;  // base weights and anything else are not the adapter's
      auto it = kept.find(*name);
      if (it != kept.end()) {
        const HostTensor& first = it->second;
        const bool same = first.meta.dtype == t.meta.dtype && first.meta.shape == t.meta.shape &&
                          std::memcmp(first.storage.data(), t.storage.data(), t.meta.nbytes()) == 0;
        if (!same) {
          return InvalidArgument(fmt::format("adapter {}: {} differs between rank {} and rank {}; ranks that hold "
                                             "the same adapter tensor must hold the same values",
                                             lora.name, *name, holder[*name], rank));
        }
        continue;
      }
      t.meta.name = *name;
      holder.emplace(*name, rank);
      kept.emplace(*name, std::move(t));
    }
  }
  if (kept.empty()) return InvalidArgument(fmt::format("adapter {}: no LoRA A/B matrices among the tensors", lora.name));
  std::map<std::string, std::pair<const HostTensor*, const HostTensor*>> modules;
  for (const auto& [name, t] : kept) {
    Parsed p = *Parse(name);
    auto& ab = modules[p.module];
    (p.ab == 'A' ? ab.first : ab.second) = &t;
  }
  std::optional<DType> dtype;
  for (const auto& [module, ab] : modules) {
    const std::string leaf = module.substr(module.rfind('.') + 1);
    if (std::ranges::find(lora.target_modules, leaf) == lora.target_modules.end()) {
      return InvalidArgument(fmt::format("adapter {}: {} targets module {}, not one of target_modules [{}]", lora.name,
                                         module, leaf, fmt::join(lora.target_modules, ", ")));
    }
    if (ab.first == nullptr || ab.second == nullptr) {
      return InvalidArgument(fmt::format("adapter {}: {} has lora_{} but no lora_{}", lora.name, module,
                                         ab.first ? 'A' : 'B', ab.first ? 'B' : 'A'));
    }
    const Shape& a = ab.first->meta.shape;
    const Shape& b = ab.second->meta.shape;
    if (a.size() != 2 || b.size() != 2 || a[0] != lora.r || b[1] != lora.r) {
      return InvalidArgument(fmt::format("adapter {}: {} has lora_A [{}] and lora_B [{}]; rank {} needs A [r, in] "
                                         "and B [out, r]",
                                         lora.name, module, fmt::join(a, ", "), fmt::join(b, ", "), lora.r));
    }
    for (const HostTensor* t : {ab.first, ab.second}) {
      if (dtype && *dtype != t->meta.dtype) {
        return InvalidArgument(fmt::format("adapter {}: {} is {}, another matrix {}; one dtype for all", lora.name,
                                           t->meta.name, TorchName(t->meta.dtype), TorchName(*dtype)));
      }
      dtype = t->meta.dtype;
    }
  }
  std::vector<HostTensor> tensors;
  tensors.reserve(kept.size());
  for (auto& [name, t] : kept) tensors.push_back(std::move(t));
  return std::make_unique<HostTensorSource>(std::move(tensors));
}

}  // namespace wsync
