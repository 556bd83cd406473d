#include "planner/fleet.h"

#include <algorithm>
#include <charconv>
#include <map>
#include <regex>
#include <tuple>

#include <fmt/format.h>


namespace wsync::planner {
namespace {

// Counts on the command line: far above any fleet, low enough for int products.
constexpr int kMaxCount = 1 << 16;

Result<int> Count(std::string_view text, std::string_view what, std::string_view whole) {
  int v = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || v < 1 || v > kMaxCount) {
    return InvalidArgument(fmt::format("'{}': {} '{}' must be an integer in [1, {}]", whole, what, text, kMaxCount));
  }
  return v;
}

// Splits "SPEC@HW"; both parts non-empty.
Result<std::pair<std::string, std::string>> SplitAt(std::string_view text, std::string_view flag,
                                                    std::string_view form) {
  size_t at = text.rfind('@');
  if (at == std::string_view::npos || at == 0 || at + 1 == text.size()) {
    return InvalidArgument(fmt::format("{} '{}': expected {}", flag, text, form));
  }
  return std::make_pair(std::string(text.substr(0, at)), std::string(text.substr(at + 1)));
}

int NodeOf(int gpu, int gpus_per_node) { return gpus_per_node > 0 ? gpu / gpus_per_node : 0; }

}  // namespace

std::string TrainerSpec::ToString() const {
  std::string layout = fsdp ? "fsdp" : fmt::format("tp{}pp{}ep{}", tp, pp, ep);
  if (!fsdp && etp != 1) layout += fmt::format("etp{}", etp);
  return fmt::format("{}:{}@{}", layout, world, hardware);
}

std::string ServerSpec::ToString() const {
  return fmt::format("{}x({},{},{})@{}", count, tp, dp, ep, hardware);
}

Result<TrainerSpec> ParseTrainerSpec(std::string_view text) {
  constexpr std::string_view kForm = "LAYOUT[:RANKS]@HW, LAYOUT fsdp or tpXppY[epZ][etpW] (e.g. tp4pp2ep8:16@h100)";
  WSYNC_ASSIGN_OR_RETURN(auto parts, SplitAt(text, "--trainer", kForm));
  TrainerSpec t;
  t.hardware = parts.second;
  std::string layout = parts.first;
  std::string ranks;
  if (size_t colon = layout.find(':'); colon != std::string::npos) {
    ranks = layout.substr(colon + 1);
    layout.resize(colon);
  }
  static const std::regex kMegatron("tp([0-9]+)pp([0-9]+)(?:ep([0-9]+))?(?:etp([0-9]+))?");
  std::smatch m;
  if (layout == "fsdp") {
    t.fsdp = true;
  } else if (std::regex_match(layout, m, kMegatron)) {
    t.fsdp = false;
    const std::string whole(text);
    WSYNC_ASSIGN_OR_RETURN(t.tp, Count(m[1].str(), "tp", whole));
    WSYNC_ASSIGN_OR_RETURN(t.pp, Count(m[2].str(), "pp", whole));
    if (m[3].matched) {
      WSYNC_ASSIGN_OR_RETURN(t.ep, Count(m[3].str(), "ep", whole));
    }
    if (m[4].matched) {
      WSYNC_ASSIGN_OR_RETURN(t.etp, Count(m[4].str(), "etp", whole));
    }
  } else {
    return InvalidArgument(fmt::format("--trainer '{}': layout '{}' is neither fsdp nor tpXppY[epZ][etpW]",
                                       text, layout));
  }
  const int64_t min_world = t.fsdp ? 1 : int64_t{t.tp} * t.pp;
  if (min_world > kMaxCount) {
    return InvalidArgument(fmt::format("--trainer '{}': tp*pp is over {}", text, kMaxCount));
  }
  t.world = static_cast<int>(min_world);
  if (!ranks.empty()) {
    WSYNC_ASSIGN_OR_RETURN(t.world, Count(ranks, "RANKS", text));
  }
  if (!t.fsdp) {
    const int stage = t.world / t.pp;
    if (t.world % (t.tp * t.pp) != 0) {
      return InvalidArgument(fmt::format("--trainer '{}': {} ranks are not a multiple of tp*pp = {}", text,
                                         t.world, t.tp * t.pp));
    }
    if (t.tp % t.etp != 0) {
      return InvalidArgument(fmt::format("--trainer '{}': etp {} does not divide tp {}", text, t.etp, t.tp));
    }
    if (stage % (t.ep * t.etp) != 0) {
      return InvalidArgument(fmt::format(
          "--trainer '{}': a pipeline stage's {} ranks are not a multiple of ep*etp = {}", text, stage,
          t.ep * t.etp));
    }
  }
  return t;
}

Result<ServerSpec> ParseServerSpec(std::string_view text) {
  constexpr std::string_view kForm = "N×(TP,DP,EP)@HW or Nx(TP,DP,EP)@HW (e.g. 2x(8,1,1)@h800)";
  WSYNC_ASSIGN_OR_RETURN(auto parts, SplitAt(text, "--servers", kForm));
  static const std::regex kFleet("([0-9]+)(?:x|\xC3\x97)\\(([0-9]+),([0-9]+),([0-9]+)\\)");
  std::smatch m;
  if (!std::regex_match(parts.first, m, kFleet)) {
    return InvalidArgument(fmt::format("--servers '{}': expected {}", text, kForm));
  }
  ServerSpec s;
  const std::string whole(text);
  WSYNC_ASSIGN_OR_RETURN(s.count, Count(m[1].str(), "N", whole));
  WSYNC_ASSIGN_OR_RETURN(s.tp, Count(m[2].str(), "TP", whole));
  WSYNC_ASSIGN_OR_RETURN(s.dp, Count(m[3].str(), "DP", whole));
  WSYNC_ASSIGN_OR_RETURN(s.ep, Count(m[4].str(), "EP", whole));
  s.hardware = parts.second;
  // Each count is at most kMaxCount, so the int64 product cannot overflow.
  if (int64_t{s.count} * s.tp * s.dp > kMaxCount) {
    return InvalidArgument(fmt::format("--servers '{}': over {} workers", text, kMaxCount));
  }
  if (s.ep != 1 && s.ep != s.tp * s.dp) {
    return InvalidArgument(fmt::format(
        "--servers '{}': EP {} must be 1 (experts split by TP) or TP*DP = {} (vLLM's expert "
        "parallelism spans the deployment)", text, s.ep, s.tp * s.dp));
  }
  return s;
}

int Fleet::trainer_nodes() const {
  const int g = trainer_hw.gpus_per_node;
  return g > 0 ? (trainer.world + g - 1) / g : 1;
}

int Fleet::server_nodes() const {
  const int g = server_hw.gpus_per_node;
  if (placement != Placement::kDisaggregated) return 0;
  return g > 0 ? (num_workers() + g - 1) / g : 1;
}

int Fleet::trainer_node(int rank) const { return NodeOf(rank, trainer_hw.gpus_per_node); }

int Fleet::worker_node(int worker) const {
  switch (placement) {
    case Placement::kColocated:
      return NodeOf(worker, trainer_hw.gpus_per_node);
    case Placement::kPacked:
      return NodeOf(trainer.world + worker, trainer_hw.gpus_per_node);
    case Placement::kDisaggregated:
      break;
  }
  return trainer_nodes() + NodeOf(worker, server_hw.gpus_per_node);
}

Result<Fleet> BuildFleet(std::string_view trainer, std::string_view servers, Placement placement,
                         const std::string& hardware_dir) {
  Fleet f;
  WSYNC_ASSIGN_OR_RETURN(f.trainer, ParseTrainerSpec(trainer));
  WSYNC_ASSIGN_OR_RETURN(f.servers, ParseServerSpec(servers));
  WSYNC_ASSIGN_OR_RETURN(f.trainer_hw, LoadHardwareProfile(f.trainer.hardware, hardware_dir));
  WSYNC_ASSIGN_OR_RETURN(f.server_hw, LoadHardwareProfile(f.servers.hardware, hardware_dir));
  f.placement = placement;
  return f;
}

Result<Placement> ParsePlacement(std::string_view text) {
  if (text == "disaggregated") return Placement::kDisaggregated;
  if (text == "packed") return Placement::kPacked;
  if (text == "colocated") return Placement::kColocated;
  return InvalidArgument(fmt::format("--placement '{}': expected disaggregated, packed or colocated", text));
}

std::string_view PlacementName(Placement p) {
  switch (p) {
    case Placement::kDisaggregated: return "disaggregated";
    case Placement::kPacked: return "packed";
    case Placement::kColocated: return "colocated";
  }
  return "?";
}

namespace {

ExpertSplit WorkerExperts(const ServerSpec& s, int w) {
  const int in_deployment = w % s.workers_per_deployment();
  return s.ep > 1 ? ExpertSplit{in_deployment, s.ep} : ExpertSplit{};
}

int WorkerTpRank(const ServerSpec& s, int w) { return w % s.workers_per_deployment() % s.tp; }

}  // namespace

Result<ShardingTable> WorkerTable(const ModelConfig& model, const ServerSpec& s, int w) {
  return ShardingTable::Build(model, WorkerTpRank(s, w), s.tp, WorkerExperts(s, w));
}

Result<ShardingTable> WorkerTable(std::shared_ptr<const HfCatalog> catalog, const ServerSpec& s, int w) {
  return ShardingTable::Build(std::move(catalog), WorkerTpRank(s, w), s.tp, WorkerExperts(s, w));
}

Status CheckFleet(const ModelConfig& model, const Fleet& f) {
  WSYNC_ASSIGN_OR_RETURN(std::shared_ptr<const HfCatalog> catalog, HfCatalog::Make(model));
  return CheckFleet(*catalog, f);
}

Status CheckFleet(const HfCatalog& catalog, const Fleet& f) {
  const ModelConfig& model = catalog.config();
  const TrainerSpec& t = f.trainer;
  if (!t.fsdp) {
    if (model.num_hidden_layers < t.pp) {
      return InvalidArgument(fmt::format("model {}: {} layers cannot fill {} pipeline stages", model.name,
                                         model.num_hidden_layers, t.pp));
    }
    if (model.is_moe() && model.num_experts % t.ep != 0) {
      return InvalidArgument(fmt::format("model {}: {} experts are not divisible by the trainer's ep {}",
                                         model.name, model.num_experts, t.ep));
    }
    if (!model.is_moe() && (t.ep > 1 || t.etp > 1)) {
      return InvalidArgument(fmt::format("model {}: a dense model has no experts for ep/etp", model.name));
    }
  }
  if (f.server_hw.gpus_per_node != f.trainer_hw.gpus_per_node && f.placement != Placement::kDisaggregated) {
    return InvalidArgument("packed or colocated servers must use the trainer's hardware");
  }
  if (f.colocated() && f.num_workers() > t.world) {
    return InvalidArgument(fmt::format("colocated: {} workers need as many trainer GPUs, the trainer has {}",
                                       f.num_workers(), t.world));
  }
  // One check per distinct (tp rank, ep rank): the tables' own checks name what does not divide.
  const int per = f.servers.workers_per_deployment();
  for (int w = 0; w < per; ++w) {
    if (f.servers.ep == 1 && w >= f.servers.tp) break;
    WSYNC_RETURN_IF_ERROR(ShardingTable::Check(catalog, WorkerTpRank(f.servers, w), f.servers.tp,
                                               WorkerExperts(f.servers, w)));
  }
  return Status::Ok();
}

Result<Ownership> TrainerOwnership(const ModelConfig& model, const TrainerSpec& t) {
  WSYNC_ASSIGN_OR_RETURN(std::shared_ptr<const HfCatalog> catalog, HfCatalog::Make(model));
  return TrainerOwnership(*catalog, t);
}

// A tensor's owners depend only on the pipeline stages that hold it and, for a routed
// expert, its EP rank: each such key resolves to its owner set once, and the classes are
// numbered by the first tensor (in stream order) that has them, as ResolveOwnership does.
Result<Ownership> TrainerOwnership(const HfCatalog& catalog, const TrainerSpec& t) {
  const ModelConfig& model = catalog.config();
  const std::vector<TensorMeta>& hf = catalog.tensors();
  if (t.world < 1) return InvalidArgument("no trainer rank states what it holds");
  const int stage_ranks = t.fsdp ? t.world : t.world / t.pp;
  const int64_t L = model.num_hidden_layers;
  auto stage_of_layer = [&](int64_t layer) {
    if (layer >= L) return t.pp - 1;  // MTP layers follow the last decoder layer
    for (int s = 0; s < t.pp; ++s) {
      if (layer < (s + 1) * L / t.pp) return s;
    }
    return t.pp - 1;
  };
  // Whether stage-local rank j holds the experts of expert-EP rank `ep_rank` (held_plan.h):
  // with etp 1 an expert is whole on its EP rank and only there; split over etp > 1
  // members, every member of a TP group that has a piece of it holds it.
  auto holds_ep_rank = [&](int j, int ep_rank) {
    if (t.etp == 1) return j % t.ep == ep_rank;
    const int j0 = j - j % t.tp;
    for (int m = j0; m < j0 + t.tp; ++m) {
      if ((m / t.etp) % t.ep == ep_rank) return true;
    }
    return false;
  };
  const int64_t per_ep = model.is_moe() ? model.num_experts / t.ep : 1;
  // Key: (first stage, second stage or -1, EP rank or -1) -> class.
  std::map<std::tuple<int, int, int64_t>, int> class_of_key;
  std::map<std::vector<int>, int> class_of_set;
  std::vector<bool> holds_any(t.world, false);
  Ownership own;
  own.name_owner_class.reserve(hf.size());
  for (size_t i = 0; i < hf.size(); ++i) {
    std::tuple<int, int, int64_t> key{0, -1, -1};
    if (!t.fsdp) {
      const std::string& n = hf[i].name;
      if (n.starts_with("model.layers.")) {
        const size_t dot = n.find('.', 13);
        const int64_t layer = std::stoll(n.substr(13, dot - 13));
        std::get<0>(key) = stage_of_layer(layer);
        const std::string_view rest = std::string_view(n).substr(dot + 1);
        if (rest.starts_with("mlp.experts.")) {
          std::get<2>(key) = std::stoll(std::string(rest.substr(12, rest.find('.', 12) - 12))) / per_ep;
        }
      } else if (n == "model.embed_tokens.weight") {
        if (model.tie_word_embeddings && t.pp > 1) std::get<1>(key) = t.pp - 1;
      } else {
        std::get<0>(key) = t.pp - 1;  // final norm, lm_head
      }
    }
    auto found = class_of_key.find(key);
    if (found == class_of_key.end()) {
      std::vector<int> owners;
      for (int s : {std::get<0>(key), std::get<1>(key)}) {
        if (s < 0) continue;
        for (int j = 0; j < stage_ranks; ++j) {
          if (std::get<2>(key) < 0 || holds_ep_rank(j, static_cast<int>(std::get<2>(key)))) {
            owners.push_back(s * stage_ranks + j);
          }
        }
      }
      std::sort(owners.begin(), owners.end());
      owners.erase(std::unique(owners.begin(), owners.end()), owners.end());
      if (owners.empty()) return InvalidArgument(fmt::format("no trainer rank holds tensor {}", hf[i].name));
      for (int r : owners) holds_any[r] = true;
      auto [pos, fresh] = class_of_set.emplace(owners, static_cast<int>(own.owner_sets.size()));
      if (fresh) own.owner_sets.push_back(std::move(owners));
      found = class_of_key.emplace(key, pos->second).first;
    }
    own.name_owner_class.push_back(found->second);
  }
  for (int r = 0; r < t.world; ++r) {
    if (!holds_any[r]) {
      return InvalidArgument(fmt::format("trainer rank {} holds none of the {} tensors", r, hf.size()));
    }
  }
  return own;
}

}  // namespace wsync::planner
