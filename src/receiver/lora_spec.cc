#include "receiver/lora_spec.h"

#include <cmath>
#include <map>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/checked_math.h"
#include "core/json_int.h"
#include "core/json_limits.h"
#include "model/config.h"

namespace wsync {

using nlohmann::json;

namespace {

constexpr std::string_view kWhere = "wsync_lora";

bool NameChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
         c == '-';
}

bool ModuleChar(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_'; }

// A decoder layer's 2-D weight "model.layers.<l>.<group>.<module>.weight": its layer and
// module, or layer -1.
struct LayerModule {
  int64_t layer = -1;
  std::string_view module;
};

LayerModule ParseLayerModule(std::string_view name) {
  constexpr std::string_view kLayers = "model.layers.";
  constexpr std::string_view kWeight = ".weight";
  if (!name.starts_with(kLayers) || !name.ends_with(kWeight)) return {};
  std::string_view rest = name.substr(kLayers.size(), name.size() - kLayers.size() - kWeight.size());
  size_t dot = rest.find('.');
  if (dot == 0 || dot == std::string_view::npos || dot > 9) return {};
  int64_t layer = 0;
  for (char c : rest.substr(0, dot)) {
    if (c < '0' || c > '9') return {};
    layer = layer * 10 + (c - '0');
  }
  rest = rest.substr(dot + 1);
  dot = rest.find('.');  // <group>.<module>, exactly two parts
  if (dot == 0 || dot == std::string_view::npos || rest.find('.', dot + 1) != std::string_view::npos) return {};
  return {layer, rest.substr(dot + 1)};
}

// Every decoder layer's 2-D weights, by module: the base tensors in model order.
std::map<std::string, std::vector<const TensorMeta*>, std::less<>> ModulesByName(
    const std::vector<TensorMeta>& hf, const ModelConfig& model) {
  std::map<std::string, std::vector<const TensorMeta*>, std::less<>> out;
  for (const TensorMeta& t : hf) {
    LayerModule lm = ParseLayerModule(t.name);
    if (lm.layer < 0 || lm.layer >= model.num_hidden_layers || t.shape.size() != 2) continue;
    out[std::string(lm.module)].push_back(&t);
  }
  // Only modules every decoder layer has once.
  std::erase_if(out, [&](const auto& kv) { return static_cast<int64_t>(kv.second.size()) != model.num_hidden_layers; });
  return out;
}

Result<std::string> Text(const json& j, const char* field, size_t max_bytes, bool required) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) {
    if (required) return InvalidArgument(fmt::format("{} needs field '{}'", kWhere, field));
    return std::string();
  }
  return BoundedStringField(j, field, kWhere, max_bytes);
}

}  // namespace

Status CheckLoraVersion(std::string_view version) {
  if (version.empty() || version.size() > kMaxLoraVersionBytes ||
      !std::all_of(version.begin(), version.end(), [](char c) { return c >= 0x20 && c < 0x7f; })) {
    return InvalidArgument(fmt::format("{} 'version' must be 1 to {} printable ASCII characters", kWhere,
                                       kMaxLoraVersionBytes));
  }
  return Status::Ok();
}

double LoraSpec::scaling() const {
  return use_rslora ? alpha / std::sqrt(static_cast<double>(r)) : alpha / static_cast<double>(r);
}

json LoraSpec::ToJson() const {
  return json{{"format", kLoraSpecFormat}, {"name", name},         {"version", version},
              {"r", r},                    {"alpha", alpha},       {"use_rslora", use_rslora},
              {"target_modules", target_modules}, {"dtype", std::string(TorchName(dtype))}};
}

std::vector<std::string> LoraTargetableModules(const ModelConfig& model) {
  std::vector<TensorMeta> hf = HfTensors(model);
  std::vector<std::string> out;
  for (const auto& [name, tensors] : ModulesByName(hf, model)) out.push_back(name);
  return out;
}

bool IsLoraName(std::string_view name) {
  return !name.empty() && name.size() <= kMaxLoraNameBytes && name.front() != '.' &&
         std::all_of(name.begin(), name.end(), NameChar);
}

Result<LoraSpec> ParseLoraSpec(const json& j, const ModelConfig& model) {
  if (!j.is_object()) return InvalidArgument(fmt::format("{} must be an object, got {}", kWhere, JsonExcerpt(j)));
  static const std::set<std::string, std::less<>> kFields = {"format", "name", "version", "r", "alpha",
                                                             "use_rslora", "target_modules", "dtype"};
  for (const auto& [key, value] : j.items()) {
    if (!kFields.contains(key)) {
      return InvalidArgument(fmt::format("{}: unknown field '{}' (format {} has: {})", kWhere, TextExcerpt(key),
                                         kLoraSpecFormat, fmt::join(kFields, ", ")));
    }
  }
  auto format = j.find("format");
  if (format == j.end()) return InvalidArgument(fmt::format("{} needs field 'format' ({})", kWhere, kLoraSpecFormat));
  WSYNC_ASSIGN_OR_RETURN(int64_t f, JsonIntInRange(*format, "wsync_lora 'format'", kLoraSpecFormat, kLoraSpecFormat));
  (void)f;

  LoraSpec spec;
  WSYNC_ASSIGN_OR_RETURN(spec.name, Text(j, "name", kMaxLoraNameBytes, true));
  if (!IsLoraName(spec.name)) {
    return InvalidArgument(fmt::format("{} 'name' {} must be 1 to {} characters of [A-Za-z0-9._-], not starting "
                                       "with '.'", kWhere, JsonExcerpt(j["name"]), kMaxLoraNameBytes));
  }
  if (spec.name == model.name) {
    return InvalidArgument(fmt::format("{} 'name' {} is the base model's own name", kWhere, spec.name));
  }
  WSYNC_ASSIGN_OR_RETURN(spec.version, Text(j, "version", kMaxLoraVersionBytes, true));
  WSYNC_RETURN_IF_ERROR(CheckLoraVersion(spec.version));
  auto r = j.find("r");
  if (r == j.end()) return InvalidArgument(fmt::format("{} needs field 'r'", kWhere));
  WSYNC_ASSIGN_OR_RETURN(spec.r, JsonIntInRange(*r, "wsync_lora 'r'", 1, kMaxLoraRank));
  auto alpha = j.find("alpha");
  if (alpha == j.end() || !alpha->is_number()) {
    return InvalidArgument(fmt::format("{} needs field 'alpha', a number", kWhere));
  }
  spec.alpha = alpha->get<double>();
  if (!std::isfinite(spec.alpha) || spec.alpha <= 0 || spec.alpha > kMaxLoraAlpha) {
    return InvalidArgument(fmt::format("{} 'alpha' is {}, outside (0, {:g}]", kWhere, spec.alpha, kMaxLoraAlpha));
  }
  if (auto it = j.find("use_rslora"); it != j.end() && !it->is_null()) {
    if (!it->is_boolean()) return InvalidArgument(fmt::format("{} 'use_rslora' must be a boolean", kWhere));
    spec.use_rslora = it->get<bool>();
  }
  spec.dtype = model.dtype;
  if (auto it = j.find("dtype"); it != j.end() && !it->is_null()) {
    WSYNC_ASSIGN_OR_RETURN(std::string d, BoundedStringField(j, "dtype", kWhere, 32));
    WSYNC_ASSIGN_OR_RETURN(spec.dtype, DTypeFromTorchName(d));
    if (spec.dtype != DType::kF32 && spec.dtype != DType::kBF16 && spec.dtype != DType::kF16) {
      return InvalidArgument(fmt::format("{} 'dtype' {}: adapters are float32, bfloat16 or float16", kWhere, d));
    }
  }
  auto modules = j.find("target_modules");
  if (modules == j.end() || !modules->is_array() || modules->empty() ||
      modules->size() > kMaxLoraTargetModules) {
    return InvalidArgument(fmt::format("{} 'target_modules' must be a list of 1 to {} module names", kWhere,
                                       kMaxLoraTargetModules));
  }
  const std::vector<std::string> targetable = LoraTargetableModules(model);
  for (size_t i = 0; i < modules->size(); ++i) {
    const json& m = (*modules)[i];
    if (!m.is_string() || m.get_ref<const std::string&>().empty() || m.get_ref<const std::string&>().size() > 64 ||
        !std::ranges::all_of(m.get_ref<const std::string&>(), ModuleChar)) {
      return InvalidArgument(fmt::format("{} 'target_modules'[{}] {} must be a module name of [A-Za-z0-9_]", kWhere,
                                         i, JsonExcerpt(m)));
    }
    const std::string& name = m.get_ref<const std::string&>();
    if (std::ranges::find(targetable, name) == targetable.end()) {
      return InvalidArgument(fmt::format("{} 'target_modules'[{}] {}: every decoder layer of model {} has the "
                                         "linear modules {}",
                                         kWhere, i, name, model.name, fmt::join(targetable, ", ")));
    }
    if (std::ranges::find(spec.target_modules, name) != spec.target_modules.end()) {
      return InvalidArgument(fmt::format("{} 'target_modules' names {} twice", kWhere, name));
    }
    spec.target_modules.push_back(name);
  }
  return spec;
}

Result<std::vector<TensorMeta>> LoraTensors(const LoraSpec& spec, const ModelConfig& model, uint64_t max_bytes) {
  std::vector<TensorMeta> hf = HfTensors(model);
  auto modules = ModulesByName(hf, model);
  std::vector<const TensorMeta*> base;
  for (const std::string& m : spec.target_modules) {
    auto it = modules.find(m);
    if (it == modules.end()) {
      return InvalidArgument(fmt::format("target module {} is not a linear module of every decoder layer of {}", m,
                                         model.name));
    }
    base.insert(base.end(), it->second.begin(), it->second.end());
  }
  // The model's order: by position in its tensor list.
  std::ranges::sort(base, [&](const TensorMeta* a, const TensorMeta* b) { return a < b; });
  std::vector<TensorMeta> out;
  out.reserve(base.size() * 2);
  uint64_t total = 0;
  for (const TensorMeta* t : base) {
    const std::string module = std::string(kPeftPrefix) + t->name.substr(0, t->name.size() - std::string_view(".weight").size());
    const int64_t rows = t->shape[0], cols = t->shape[1];
    out.push_back(TensorMeta{module + ".lora_A.weight", spec.dtype, {spec.r, cols}});
    out.push_back(TensorMeta{module + ".lora_B.weight", spec.dtype, {rows, spec.r}});
    std::optional<uint64_t> elems = CheckedMul(static_cast<uint64_t>(spec.r), static_cast<uint64_t>(rows) + static_cast<uint64_t>(cols));
    std::optional<uint64_t> bytes = elems ? CheckedMul(*elems, ItemSize(spec.dtype)) : std::nullopt;
    std::optional<uint64_t> sum = bytes ? CheckedAdd(total, *bytes) : std::nullopt;
    if (!sum || *sum > max_bytes) {
      return InvalidArgument(fmt::format("adapter {} (r {}, modules {}) takes more than {} bytes", spec.name, spec.r,
                                         fmt::join(spec.target_modules, ","), max_bytes));
    }
    total = *sum;
  }
  return out;
}

}  // namespace wsync
