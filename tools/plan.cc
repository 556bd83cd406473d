// `wsync plan`: predicts a sync of each backend on a fleet larger than any machine here,
// from the engine's own plans, hardware profiles and calibrated constants (src/planner).
#include "plan.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "backends/descriptor.h"
#include "model/config.h"
#include "planner/calibration.h"
#include "planner/cost.h"
#include "planner/fleet.h"
#include "planner/m2n.h"
#include "planner/published.h"

namespace wsync::cli {
namespace {

using namespace wsync::planner;

struct PlanArgs {
  std::string model;
  std::string trainer;
  std::string servers;
  std::string backend = "all";
  double bucket_gb = 1.0;
  std::string dtype = "bf16";
  std::string placement = "disaggregated";
  int lookahead = 1;
  std::string concurrent_stages = "on";
  bool ipc_packed = false;
  std::string hardware_dir = DefaultHardwareDir();
  bool json = false;
  std::string plot;
  bool published = false;
  bool calibrate = false;
  std::string doc;
  bool check = false;
  std::string m2n_model;
  std::string m2n_system;
  std::string m2n_hw = "h100";
  std::string m2n_write;
  bool timings = false;
};

[[noreturn]] void Exit(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(code);
}

int Fail(const std::string& message, int code = 2) {
  fmt::print(stderr, "wsync plan: error: {}\n", message);
  return code;
}

std::string Bytes(double b) { return fmt::format("{:.2f} GB", b / 1e9); }

// --backend's values: "a, b, c or all" (the planned backends, in their order).
std::string BackendChoices() {
  std::string out;
  for (const BackendDescriptor* b : PlannedBackends()) out += fmt::format("{}, ", b->name);
  return out.substr(0, out.size() - 2) + " or all";
}

std::string Time(double s) { return s < 0.1 ? fmt::format("{:.2f} ms", s * 1000) : fmt::format("{:.3f} s", s); }

nlohmann::json ToJson(const Prediction& p) {
  nlohmann::json j;
  j["backend"] = p.backend;
  j["applicable"] = p.applicable;
  if (!p.applicable) {
    j["not_applicable"] = p.not_applicable;
    return j;
  }
  j["seconds"] = p.seconds;
  j["sent_per_trainer_rank_bytes"] = {{"min", p.sent_per_trainer_rank_min}, {"max", p.sent_per_trainer_rank_max}};
  j["received_per_worker_bytes"] = p.received_per_worker_max;
  j["trainer_extra_bytes"] = p.trainer_extra_bytes;
  j["worker_extra_bytes"] = p.worker_extra_bytes;
  j["bottleneck"] = p.bottleneck;
  j["utilisation"] = p.utilisation;
  for (const Step& s : p.steps) {
    j["steps"].push_back({{"name", s.name}, {"resource", s.resource}, {"bytes", s.bytes},
                          {"gb_per_s", s.gb_per_s}, {"seconds", s.seconds}});
  }
  j["assumptions"] = p.assumptions;
  return j;
}

void PrintText(const Prediction& p) {
  if (!p.applicable) {
    fmt::print("{:<8} n/a: {}\n\n", p.backend, p.not_applicable);
    return;
  }
  fmt::print("{:<8} {}   bottleneck: {}{}\n", p.backend, Time(p.seconds), p.bottleneck,
             p.utilisation > 0 ? fmt::format(" ({:.0f}% of its rate)", 100 * p.utilisation) : "");
  fmt::print("         sent per trainer rank {} .. {}, received per worker {}\n", Bytes(p.sent_per_trainer_rank_min),
             Bytes(p.sent_per_trainer_rank_max), Bytes(p.received_per_worker_max));
  fmt::print("         extra memory: trainer {} per rank, worker {} per worker\n", Bytes(p.trainer_extra_bytes),
             Bytes(p.worker_extra_bytes));
  for (const Step& s : p.steps) {
    fmt::print("         {:<12} {:>10}  {:>10}  {}\n", s.name, Time(s.seconds), s.bytes > 0 ? Bytes(s.bytes) : "",
               s.resource);
  }
  for (const std::string& a : p.assumptions) fmt::print("         assumes: {}\n", a);
  fmt::print("\n");
}

Result<std::string> ReadText(const std::string& path, size_t max_bytes) {
  std::error_code ec;
  const uintmax_t size = std::filesystem::file_size(path, ec);
  if (ec) return NotFound(fmt::format("{}: cannot be read ({})", path, ec.message()));
  if (size > max_bytes) return InvalidArgument(fmt::format("{}: {} bytes, over {}", path, size, max_bytes));
  std::ifstream in(path, std::ios::binary);
  std::string text(static_cast<size_t>(size), '\0');
  if (!in.read(text.data(), static_cast<std::streamsize>(text.size()))) {
    return NotFound(fmt::format("{}: cannot be read", path));
  }
  return text;
}

// This process's peak resident memory (VmHWM), in bytes; 0 where /proc does not say.
int64_t PeakRssBytes() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.starts_with("VmHWM:")) return std::strtoll(line.c_str() + 6, nullptr, 10) * 1024;
  }
  return 0;
}

// --m2n-model / --m2n-system: the model and the fleet specs from NCCL M2N benchmark files.
Status LoadM2n(PlanArgs& a) {
  if (!a.m2n_model.empty()) {
    if (!a.model.empty() && a.model != a.m2n_model) return InvalidArgument("--model and --m2n-model name the model twice");
    a.model = a.m2n_model;
  }
  if (!a.m2n_system.empty()) {
    if (!a.trainer.empty() || !a.servers.empty()) {
      return InvalidArgument("--m2n-system names the trainer and the servers; drop --trainer and --servers");
    }
    WSYNC_ASSIGN_OR_RETURN(std::string text, ReadText(a.m2n_system, kMaxM2nBytes));
    WSYNC_ASSIGN_OR_RETURN(M2nSystem system, ParseM2nSystem(text, a.m2n_system));
    auto specs = FleetSpecsOfM2n(system, a.m2n_hw);
    if (!specs.ok()) return InvalidArgument(fmt::format("{}: {}", a.m2n_system, specs.status().message()));
    a.trainer = specs->trainer;
    a.servers = specs->servers;
  }
  return Status::Ok();
}

// The model of --model: a registered name, a config.json directory, or an M2N model file.
Result<ModelConfig> PlanModel(const PlanArgs& a) {
  if (a.model != a.m2n_model || a.m2n_model.empty()) return LookupModel(a.model);
  WSYNC_ASSIGN_OR_RETURN(std::string text, ReadText(a.m2n_model, kMaxM2nBytes));
  WSYNC_ASSIGN_OR_RETURN(std::vector<TensorMeta> tensors, ParseM2nModel(text, a.m2n_model));
  return ModelOfM2n(tensors, a.m2n_model);
}

// --m2n-write DIR: the model and the fleet as M2N benchmark files.
int WriteM2n(const PlanArgs& a, const ModelConfig& model, const Fleet& fleet) {
  namespace fs = std::filesystem;
  auto system = M2nSystemOf(fleet.trainer, fleet.servers);
  if (!system.ok()) return Fail(fmt::format("--m2n-write: {}", system.status().message()));
  system->comment = fmt::format("wsync plan: {} from {} to {}", model.name, fleet.trainer.ToString(),
                                fleet.servers.ToString());
  const std::string stem = fs::path(model.name).filename().string();
  const fs::path model_file = fs::path(a.m2n_write) / (stem + ".model.json");
  const M2nParallel& t = system->train;
  const M2nParallel& g = system->generation;
  const fs::path system_file =
      fs::path(a.m2n_write) / fmt::format("{}-tp{}pp{}ep{}fsdp{}dp{}-to-tp{}dp{}-{}gpus.json", stem, t.tp, t.pp, t.ep,
                                          t.fsdp, t.dp, g.tp, g.dp, t.num_gpus + g.num_gpus);
  std::error_code ec;
  fs::create_directories(a.m2n_write, ec);
  for (const auto& [path, text] : {std::pair{model_file, WriteM2nModel(HfTensors(model))},
                                   std::pair{system_file, WriteM2nSystem(*system)}}) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << text;
    if (!out.flush()) return Fail(fmt::format("--m2n-write: cannot write {}", path.string()), 1);
    fmt::print(stderr, "wsync plan: wrote {}\n", path.string());
  }
  return 0;
}

// The fleets of docs/plan.md's timing table, each planned by a child `wsync plan`
// (every backend), timed and measured (its peak RSS) as /usr/bin/time would.
struct TimingCase {
  std::string what;
  std::vector<std::string> args;
};

std::vector<TimingCase> TimingCases() {
  const std::string m2n = std::string(WSYNC_SOURCE_DIR) + "/data/m2n/";
  auto preset = [&](const std::string& system) {
    return TimingCase{fmt::format("M2N preset `{}` (qwen3-32b)", system),
                      {"--m2n-model", m2n + "qwen3-32b.model.json", "--m2n-system", m2n + system + ".json"}};
  };
  return {
      {"qwen3-235b-a22b (NeMo-RL fleet)",
       {"--model", "qwen3-235b-a22b", "--trainer", "tp4pp8ep16:128@h100", "--servers", "16x(8,1,1)@h100"}},
      {"deepseek-v3", {"--model", "deepseek-v3", "--trainer", "tp8pp8ep32:256@h100", "--servers", "4x(32,1,32)@h100"}},
      {"kimi-k2 (vLLM RDT fleet)",
       {"--model", "kimi-k2", "--trainer", "tp8pp8ep32:256@h100", "--servers", "4x(32,1,32)@h100"}},
      {"kimi-k2, TP-only servers", {"--model", "kimi-k2", "--trainer", "tp8pp8ep32:256@h100", "--servers", "8x(16,1,1)@h100"}},
      {"moe-2.8t", {"--model", "moe-2.8t", "--trainer", "tp8pp8ep64:512@h100", "--servers", "2x(32,4,128)@h100"}},
      preset("qwen3-32b-dp1-tp1-to-dp1-tp1"),
      preset("qwen3-32b-dp1-tp2-to-dp1-tp2"),
      preset("qwen3-32b-dp1-tp4-to-dp1-tp4"),
      preset("qwen3-32b-tp2pp4dp2-to-tp1dp16-32gpus-gb200"),
      preset("qwen3-32b-tp4pp4dp2-to-tp4dp8-64gpus-h100"),
  };
}

Result<std::string> RenderTimings() {
  std::string md =
      "| fleet | trainer | servers | tensors | parameters | CPU | planned in | max RSS |\n"
      "|---|---|---|---|---|---|---|---|\n";
  for (const TimingCase& c : TimingCases()) {
    PlanArgs probe;
    for (size_t i = 0; i + 1 < c.args.size(); i += 2) {
      if (c.args[i] == "--model") probe.model = c.args[i + 1];
      if (c.args[i] == "--trainer") probe.trainer = c.args[i + 1];
      if (c.args[i] == "--servers") probe.servers = c.args[i + 1];
      if (c.args[i] == "--m2n-model") probe.m2n_model = c.args[i + 1];
      if (c.args[i] == "--m2n-system") probe.m2n_system = c.args[i + 1];
    }
    WSYNC_RETURN_IF_ERROR(LoadM2n(probe).WithContext(c.what));
    WSYNC_ASSIGN_OR_RETURN(ModelConfig model, PlanModel(probe));
    std::vector<std::string> argv = {"wsync", "plan", "--json"};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    std::vector<char*> raw;
    for (std::string& s : argv) raw.push_back(s.data());
    raw.push_back(nullptr);
    // The child reports its own peak RSS (VmHWM of its image after exec): the rusage
    // figure would include this process's memory, which the child shared until exec.
    int out[2];
    if (::pipe(out) != 0) return Internal(fmt::format("{}: pipe: errno {}", c.what, errno));
    const auto start = std::chrono::steady_clock::now();
    const pid_t pid = fork();
    if (pid < 0) return Internal(fmt::format("{}: cannot start wsync plan: errno {}", c.what, errno));
    if (pid == 0) {
      ::dup2(out[1], 1);
      ::close(out[0]);
      ::close(out[1]);
      ::execv("/proc/self/exe", raw.data());
      std::_Exit(127);
    }
    ::close(out[1]);
    std::string text;
    char buf[1 << 16];
    for (ssize_t n; (n = ::read(out[0], buf, sizeof(buf))) != 0;) {
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) break;
      text.append(buf, static_cast<size_t>(n));
    }
    ::close(out[0]);
    int status = 0;
    struct rusage usage {};
    if (wait4(pid, &status, 0, &usage) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      return Internal(fmt::format("{}: wsync plan {} failed", c.what, fmt::join(c.args, " ")));
    }
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double cpu = usage.ru_utime.tv_sec + usage.ru_utime.tv_usec / 1e6 + usage.ru_stime.tv_sec +
                       usage.ru_stime.tv_usec / 1e6;
    const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
    const int64_t peak = j.is_object() && j.contains("peak_rss_bytes") ? j["peak_rss_bytes"].get<int64_t>() : 0;
    md += fmt::format("| {} | `{}` | `{}` | {} | {:.1f}B | {:.2f} s | {:.2f} s | {} MB |\n", c.what, probe.trainer,
                      probe.servers, HfTensors(model).size(), ModelParams(model) / 1e9, cpu, wall, peak >> 20);
  }
  return md;
}

// Runs tools/plot_plan.py through /usr/bin/python3 (matplotlib) on `csv`.
int Plot(const std::string& kind, const std::string& csv, const std::string& png) {
  namespace fs = std::filesystem;
  const fs::path script = fs::path(WSYNC_SOURCE_DIR) / "tools" / "plot_plan.py";
  const fs::path data = fs::temp_directory_path() / fmt::format("wsync_plan_{}.csv", ::getpid());
  {
    std::ofstream out(data);
    out << csv;
    if (!out) return Fail(fmt::format("cannot write {}", data.string()), 1);
  }
  // Arguments are paths this process chose or the user's --plot path, quoted for sh.
  auto quote = [](const std::string& s) {
    std::string q = "'";
    for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
    return q + "'";
  };
  const std::string cmd = fmt::format("/usr/bin/python3 {} {} {} {}", quote(script.string()), kind,
                                      quote(data.string()), quote(png));
  const int rc = std::system(cmd.c_str());
  std::error_code ec;
  fs::remove(data, ec);
  if (rc != 0) {
    return Fail(fmt::format("plotting failed ({}): /usr/bin/python3 needs matplotlib (Debian: python3-matplotlib)",
                            cmd), 1);
  }
  fmt::print(stderr, "wsync plan: wrote {}\n", png);
  return 0;
}

// The published cases planned, and their markdown as `--published` prints it (with the
// planner's own wall time).
struct PublishedRun {
  std::vector<CaseResult> results;
  std::string markdown;
};

Result<PublishedRun> PlanPublished(const PlanArgs& a) {
  const auto start = std::chrono::steady_clock::now();
  WSYNC_ASSIGN_OR_RETURN(std::vector<CaseResult> results, RunPublishedCases(Calibrate(), a.hardware_dir));
  std::string markdown = RenderComparison(results);
  markdown += fmt::format("\nAll cases planned in {:.1f} s.\n",
                          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  return PublishedRun{std::move(results), std::move(markdown)};
}

int RunPublished(const PlanArgs& a) {
  auto run = PlanPublished(a);
  if (!run.ok()) return Fail(run.status().message(), 1);
  fmt::print("{}", run->markdown);
  if (!a.plot.empty()) return Plot("published", ComparisonCsv(run->results), a.plot);
  return 0;
}

// Regenerates (or, with --check, compares) docs/plan.md's generated blocks.
int RunDoc(const PlanArgs& a) {
  std::ifstream in(a.doc, std::ios::binary);
  if (!in) return Fail(fmt::format("--doc {}: cannot be read", a.doc), 1);
  const std::string old((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto run = PlanPublished(a);
  if (!run.ok()) return Fail(run.status().message(), 1);
  auto timings = RenderTimings();
  if (!timings.ok()) return Fail(timings.status().message(), 1);
  auto doc = SpliceBlock(old, "wsync plan --calibrate", CalibrationReport());
  if (doc.ok()) doc = SpliceBlock(*doc, "wsync plan --published", run->markdown);
  if (doc.ok()) doc = SpliceBlock(*doc, "wsync plan --timings", *timings);
  if (!doc.ok()) return Fail(fmt::format("--doc {}: {}", a.doc, doc.status().message()), 1);
  if (a.check) {
    const std::string want = MaskTimings(*doc), have = MaskTimings(old);
    if (want == have) {
      fmt::print("wsync plan: {} is current\n", a.doc);
      return 0;
    }
    size_t line = 1, i = 0;
    while (i < want.size() && i < have.size() && want[i] == have[i]) line += want[i++] == '\n';
    return Fail(fmt::format("--doc {} is stale from line {} on; regenerate it with `wsync plan --doc {} --plot "
                            "docs/plan.png`",
                            a.doc, line, a.doc),
                1);
  }
  std::ofstream out(a.doc, std::ios::binary | std::ios::trunc);
  out << *doc;
  if (!out.flush()) return Fail(fmt::format("--doc {}: cannot be written", a.doc), 1);
  fmt::print(stderr, "wsync plan: wrote {}\n", a.doc);
  if (!a.plot.empty()) return Plot("published", ComparisonCsv(run->results), a.plot);
  return 0;
}

int RunPlan(PlanArgs& a) {
  if (a.check && a.doc.empty()) return Fail("--check needs --doc FILE");
  if (!a.doc.empty()) return RunDoc(a);
  if (a.timings) {
    auto md = RenderTimings();
    if (!md.ok()) return Fail(md.status().message(), 1);
    fmt::print("{}", *md);
    return 0;
  }
  if (Status loaded = LoadM2n(a); !loaded.ok()) return Fail(loaded.message());
  if (a.calibrate) {
    fmt::print("{}", CalibrationReport());
    return 0;
  }
  if (a.published) return RunPublished(a);
  if (a.model.empty() || a.trainer.empty() || a.servers.empty()) {
    return Fail("--model, --trainer and --servers are required (or --m2n-model, --m2n-system; --published, "
                "--calibrate)");
  }
  if (a.dtype != "bf16" && a.dtype != "fp8") return Fail(fmt::format("--dtype '{}': expected bf16 or fp8", a.dtype));
  if (!(a.bucket_gb > 0) || a.bucket_gb > 1024) return Fail(fmt::format("--bucket-gb {}: expected (0, 1024]", a.bucket_gb));
  std::vector<const BackendDescriptor*> backends = PlannedBackends();
  if (a.backend != "all") {
    std::erase_if(backends, [&](const BackendDescriptor* b) { return b->name != a.backend; });
    if (backends.empty()) return Fail(fmt::format("--backend '{}': expected {}", a.backend, BackendChoices()));
  }
  auto placement = ParsePlacement(a.placement);
  if (!placement.ok()) return Fail(placement.status().message());
  auto model = PlanModel(a);
  if (!model.ok()) return Fail(model.status().message());
  auto fleet = BuildFleet(a.trainer, a.servers, *placement, a.hardware_dir);
  if (!fleet.ok()) return Fail(fleet.status().message());
  if (!a.m2n_write.empty()) return WriteM2n(a, *model, *fleet);
  PlanOptions o;
  o.bucket_bytes = static_cast<int64_t>(a.bucket_gb * (int64_t{1} << 30));
  o.lookahead = a.lookahead;
  o.concurrent_stages = a.concurrent_stages == "on";
  o.ipc_packed = a.ipc_packed;
  const ModelConfig travel = TravelConfig(*model, a.dtype == "fp8");
  const Constants k = Calibrate();
  const auto start = std::chrono::steady_clock::now();
  auto planned = PredictEach(travel, *fleet, backends, o, k);
  if (!planned.ok()) return Fail(planned.status().message(), 1);
  const std::vector<Prediction>& predictions = *planned;
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (a.json) {
    nlohmann::json j;
    j["model"] = a.model;
    j["model_bytes"] = ModelBytes(travel);
    j["trainer"] = fleet->trainer.ToString();
    j["servers"] = fleet->servers.ToString();
    j["placement"] = PlacementName(fleet->placement);
    j["plan_seconds"] = took;
    j["peak_rss_bytes"] = PeakRssBytes();
    for (const Prediction& p : predictions) j["predictions"].push_back(ToJson(p));
    fmt::print("{}\n", j.dump(2));
  } else {
    fmt::print("{} ({}, {}) from {} to {} ({}), {} workers\n\n", a.model, Bytes(ModelBytes(travel)), a.dtype,
               fleet->trainer.ToString(), fleet->servers.ToString(), PlacementName(fleet->placement),
               fleet->num_workers());
    for (const Prediction& p : predictions) PrintText(p);
    fmt::print("planned in {:.2f} s\n", took);
  }
  if (a.plot.empty()) return 0;
  // Predicted time per backend against the number of deployments, 1 .. 2N by doubling.
  std::string csv = "deployments,backend,seconds\n";
  for (int n = 1; n <= std::max(2 * fleet->servers.count, 8); n *= 2) {
    Fleet f = *fleet;
    f.servers.count = n;
    auto planned_n = PredictEach(travel, f, backends, o, k);
    if (!planned_n.ok()) continue;
    for (const Prediction& p : *planned_n) {
      if (p.applicable) csv += fmt::format("{},{},{}\n", n, p.backend, p.seconds);
    }
  }
  // Published points of the same model, trainer and deployment shape, at their counts.
  for (const PublishedCase& c : PublishedCases()) {
    auto s = ParseServerSpec(c.servers);
    if (c.model != a.model || c.trainer != a.trainer || !s.ok() || s->tp != fleet->servers.tp ||
        s->dp != fleet->servers.dp || s->ep != fleet->servers.ep) {
      continue;
    }
    csv += fmt::format("{},published {} ({}),{}\n", s->count, c.backend->name, c.id, c.published_lo);
  }
  return Plot("fleet", csv, a.plot);
}

}  // namespace

void AddPlanCommand(CLI::App& app) {
  static PlanArgs parsed;  // lives until the process exits
  PlanArgs* args = &parsed;
  auto* c = app.add_subcommand(
      "plan",
      "predict one sync per backend on a fleet (bytes, memory, time, bottleneck) from the engine's own plans; "
      "--published compares with published results");
  c->footer(
      "Examples:\n"
      "  wsync plan --model qwen3-235b-a22b --trainer tp4pp2ep8:16@h100 --servers '1x(1,16,16)@h100'\n"
      "  wsync plan --model kimi-k2 --trainer tp8pp8ep32:256@h100 --servers '4x(32,1,32)@h100' --backend sharded\n"
      "  wsync plan --model glm-4.5-air --trainer fsdp:8@h800 --servers '1x(8,1,1)@h800' --placement colocated\n"
      "  wsync plan --doc docs/plan.md --plot docs/plan.png   (docs/plan.md's generated tables)\n"
      "  wsync plan --published                          (the table alone, on stdout)\n"
      "  wsync plan --calibrate                          (the constants, from docs/benchmarks.md)\n"
      "  wsync plan --m2n-model data/m2n/qwen3-32b.model.json \\\n"
      "             --m2n-system data/m2n/qwen3-32b-tp4pp4dp2-to-tp4dp8-64gpus-h100.json   (NCCL M2N presets)\n"
      "Hardware profiles: data/hardware/<name>.json (h100, h200, h800, h20, ...) or a path to one.");
  c->add_option("--model", args->model, "registered model (qwen3-235b-a22b, deepseek-v3, kimi-k2, glm-4.5-air, qwen3-30b-a3b, ...) or a config.json directory");
  c->add_option("--trainer", args->trainer,
                "LAYOUT[:RANKS]@HW: fsdp:16@h100, tp4pp2ep8:16@h100 (Megatron tp x pp, ep folded over each stage)");
  c->add_option("--servers", args->servers,
                "N×(TP,DP,EP)@HW or Nx(TP,DP,EP)@HW: N deployments of TP*DP workers; EP 1 or TP*DP");
  c->add_option("--backend", args->backend, BackendChoices())->capture_default_str();
  c->add_option("--bucket-gb", args->bucket_gb, "packed bucket for nccl and ipc, GiB")->capture_default_str();
  c->add_option("--dtype", args->dtype, "bytes on the wire: bf16 or fp8")->capture_default_str();
  c->add_option("--placement", args->placement,
                "disaggregated (servers on their own nodes), packed (after the trainer on its nodes) or colocated "
                "(worker w on trainer rank w's GPU; ipc)")
      ->capture_default_str();
  c->add_option("--lookahead", args->lookahead, "sharded: layer groups staged ahead (0: no overlap)")
      ->capture_default_str();
  c->add_option("--concurrent-stages", args->concurrent_stages,
                "sharded: pipeline stages send at once (on) or take turns (off)")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
  c->add_flag("--ipc-packed", args->ipc_packed, "ipc: pack into slots even where zero-copy is possible");
  c->add_option("--hardware-dir", args->hardware_dir, "where HW names are looked up")->capture_default_str();
  c->add_flag("--json", args->json, "print JSON");
  c->add_option("--plot", args->plot,
                "write a PNG: time per backend against the number of deployments (with --published: predicted "
                "against published); needs /usr/bin/python3 with matplotlib");
  c->add_flag("--published", args->published, "plan the published cases and wsync's own runs (docs/plan.md)");
  c->add_flag("--calibrate", args->calibrate, "print the calibration: inputs from docs/benchmarks.md and constants");
  c->add_option("--doc", args->doc,
                "rewrite the generated blocks of a document (docs/plan.md: the calibration and the published "
                "table, between <!-- BEGIN/END wsync plan --calibrate|--published --> lines)");
  c->add_flag("--check", args->check, "with --doc: write nothing, exit 1 if the document's blocks are stale");
  c->add_option("--m2n-model", args->m2n_model,
                "the model as an NCCL M2N benchmark model file (tensor name -> shape, dtype), instead of --model");
  c->add_option("--m2n-system", args->m2n_system,
                "the trainer and servers as an NCCL M2N benchmark system file ({train, generation}: num_gpus, "
                "tp_size, cp_size, ep_size, pp_size, fsdp_size, dp_size), instead of --trainer and --servers");
  c->add_option("--m2n-hw", args->m2n_hw, "hardware profile of both sides of --m2n-system")->capture_default_str();
  c->add_option("--m2n-write", args->m2n_write,
                "write the model and the fleet as NCCL M2N benchmark files into this directory, and plan nothing");
  c->add_flag("--timings", args->timings,
              "plan docs/plan.md's timing fleets, each in a child process, and print its wall time and max RSS");
  c->final_callback([args] { Exit(RunPlan(*args)); });
}

}  // namespace wsync::cli
