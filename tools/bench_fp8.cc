// `wsync bench fp8`: the same sync into a bf16 server and into an fp8 server
// (`wsync serve --quantization fp8`), and, for a model with MTP layers, into servers
// holding the MTP drafter (`--speculative mtp`), in one run: real server processes on
// this host (`--device cpu`, or `cuda:N` for the servers' shards), the trainer's bf16
// tensors in this process's memory, the `ipc` backend, each variant on a fresh fleet.
//
// Per variant it prints the median whole sync (start .. finish: for fp8 that includes
// waiting for the last layer's quantization) over --iters syncs after a warm-up, and the
// ratios fp8 / bf16 and drafter / no drafter. The fp8 server quantizes each decoder layer
// as soon as its tensors have landed, so its ratio measures how much of the quantization
// the transfer hides; the stream is the same with or without a drafter (a plain server
// drops the MTP tensors), so the drafter's ratio is the cost of landing its own layers.
#include <algorithm>
#include <map>
#include <string>

#include <fmt/format.h>

#include "backends/ipc/descriptor.h"
#include "bench.h"
#include "children.h"
#include "model/config.h"
#include "synthetic/synthetic.h"
#include "wsync/trainer.h"

namespace wsync::cli {
namespace {

struct Timing {
  double sync_s = 0;
  double first_s = 0;
  size_t bytes = 0;
};

// One kind of server the same sync goes into.
struct Variant {
  std::string label;
  std::string quantization;  // serve --quantization
  std::string speculative;   // serve --speculative
};

Result<Timing> RunOne(const BenchArgs& a, const Variant& v, SyntheticTrainer& trainer,
                      const std::vector<TensorMeta>& meta, const std::string& dir) {
  std::vector<Child> servers;
  auto stop = [&] {
    for (Child& c : servers) StopChild(c);
  };
  for (int i = 0; i < a.servers; ++i) {
    Result<Child> c = StartServer({"--model", a.model, "--tp", std::to_string(a.tp), "--device", a.device, "--backend",
                                   std::string(IpcBackend().name), "--timeout", "600", "--quantization", v.quantization, "--speculative",
                                   v.speculative},
                                  fmt::format("{}/{}-{}{}.log", dir, v.quantization, v.speculative, i),
                                  Deadline::InSeconds(300));
    if (!c.ok()) {
      stop();
      return c.status().WithContext(fmt::format("starting a {} server", v.label));
    }
    servers.push_back(*c);
  }
  Timing t;
  Status s = [&]() -> Status {
    TrainerOptions o;
    o.backend = IpcBackend().name;
    for (const Child& c : servers) o.servers.push_back(c.url);
    o.bucket_gb = a.bucket_gb;
    o.timeout_seconds = 600;
    WSYNC_ASSIGN_OR_RETURN(auto engine, CreateTrainerEngine(o));
    WSYNC_RETURN_IF_ERROR(engine->Init(meta));
    std::vector<double> times;
    for (int i = 0; i <= a.iters; ++i) {  // sync 0 warms up (first touch of every page)
      WSYNC_ASSIGN_OR_RETURN(SyncStats st, engine->SendWeights(trainer.source(), std::nullopt));
      t.bytes = st.bytes;
      if (i == 0) {
        t.first_s = st.seconds;
      } else {
        times.push_back(st.seconds);
      }
    }
    engine->Shutdown();
    t.sync_s = Median(times);
    return Status::Ok();
  }();
  stop();
  if (!s.ok()) return s;
  return t;
}

}  // namespace

int RunBenchFp8(const BenchArgs& a) {
  auto fail = [](const Status& s) {
    fmt::print(stderr, "wsync bench fp8: error: {}\n", s.ToString());
    return 1;
  };
  Result<ModelConfig> config = LookupModel(a.model);
  if (!config.ok()) return fail(config.status());
  const std::vector<TensorMeta> meta = HfTensors(*config);
  Result<std::unique_ptr<SyntheticTrainer>> trainer = SyntheticTrainer::FromMetadata(meta, 7, 0);
  if (!trainer.ok()) return fail(trainer.status());
  Result<std::string> dir = MakeTempDir("bench-fp8");
  if (!dir.ok()) return fail(dir.status());
  std::vector<Variant> variants = {{"bf16 (--quantization none)", "none", "none"},
                                   {"fp8 (--quantization fp8)", "fp8", "none"}};
  const bool mtp = config->num_nextn_predict_layers > 0;
  if (mtp) {
    variants.push_back({"bf16 + MTP drafter", "none", "mtp"});
    variants.push_back({"fp8 + MTP drafter", "fp8", "mtp"});
  }
  std::vector<Timing> got;
  for (const Variant& v : variants) {
    fmt::print(stderr, "{}: {} server(s) x TP={} on {}\n", v.label, a.servers, a.tp, a.device);
    Result<Timing> t = RunOne(a, v, **trainer, meta, *dir);
    if (!t.ok()) return fail(t.status());
    got.push_back(*t);
  }
  fmt::print("wsync bench fp8: {} ({:.3f} GB bf16), {} server(s) x TP={} on {}, ipc, median of {} syncs after sync 0\n",
             config->name, got[0].bytes / 1e9, a.servers, a.tp, a.device, a.iters);
  fmt::print("{:<28} {:>9} {:>9} {:>8}\n", "server", "sync s", "sync 0 s", "GB/s");
  for (size_t i = 0; i < variants.size(); ++i) {
    fmt::print("{:<28} {:>9.3f} {:>9.3f} {:>8.2f}\n", variants[i].label, got[i].sync_s, got[i].first_s,
               got[i].bytes / got[i].sync_s / 1e9);
  }
  fmt::print("fp8 / bf16 sync time: {:.2f}x\n", got[1].sync_s / got[0].sync_s);
  if (mtp) {
    fmt::print("MTP drafter / none, bf16: {:.3f}x; fp8: {:.3f}x\n", got[2].sync_s / got[0].sync_s,
               got[3].sync_s / got[1].sync_s);
  }
  return 0;
}

}  // namespace wsync::cli
