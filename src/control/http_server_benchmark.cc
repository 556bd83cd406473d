// Micro-benchmark of the control plane's per-call cost (not a test): an HttpControlServer
// on loopback in front of a service that does nothing, driven by the trainer's own
// FanOutClient the way a sync drives it (start, update with a ~30 KB update_info sent
// unchanged every round, finish), plus GET /health alone. Prints the median, p90 and p99
// of each call in microseconds.
//   http_server_benchmark [ROUNDS] [SERVERS]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "control/client.h"
#include "control/http_server.h"

namespace wsync {
namespace {

using nlohmann::json;

// A ControlService that accepts everything at once: what is left is the HTTP layer.
class NullService : public ControlService {
 public:
  Status InitWeightTransfer(const json&, const std::string&) override { return Status::Ok(); }
  Status StartWeightUpdate() override { return Status::Ok(); }
  Status UpdateWeights(std::shared_ptr<const json>) override { return Status::Ok(); }
  Status FinishWeightUpdate(const std::optional<std::string>&) override { return Status::Ok(); }
  int WorldSize(bool) const override { return 1; }
  std::string WeightVersion() const override { return "v"; }
  void SetWeightVersion(std::string) override {}
  Status Pause(std::string_view, bool) override { return Status::Ok(); }
  Status Resume() override { return Status::Ok(); }
  bool IsPaused() const override { return false; }
  Result<bool> ResetPrefixCache(bool) override { return true; }
  Result<std::map<std::string, std::string>> Checksums(DigestAlgorithm) override {
    return std::map<std::string, std::string>{};
  }
  json Health() const override { return {{"status", "ok"}}; }
};

struct Series {
  const char* name;
  std::vector<double> us;
};

void Print(Series& s) {
  std::sort(s.us.begin(), s.us.end());
  auto at = [&](double q) { return s.us[static_cast<size_t>(q * (s.us.size() - 1))]; };
  std::printf("%-24s %8.1f %8.1f %8.1f\n", s.name, at(0.5), at(0.9), at(0.99));
}

int Run(int rounds, int servers) {
  std::vector<std::unique_ptr<NullService>> services;
  std::vector<std::unique_ptr<HttpControlServer>> https;
  std::vector<std::string> urls;
  for (int i = 0; i < servers; ++i) {
    services.push_back(std::make_unique<NullService>());
    auto s = HttpControlServer::Start(HttpServerOptions{}, services.back().get());
    if (!s.ok()) {
      std::fprintf(stderr, "%s\n", s.status().ToString().c_str());
      return 1;
    }
    urls.push_back((*s)->url());
    https.push_back(std::move(*s));
  }
  FanOutClient client(urls, {});
  json names = json::array(), dtypes = json::array(), shapes = json::array();
  for (int i = 0; i < 300; ++i) {
    names.push_back("model.layers." + std::to_string(i) + ".mlp.up_proj.weight");
    dtypes.push_back("bfloat16");
    shapes.push_back({3072, 1024});
  }
  auto update = std::make_shared<const std::string>(
      json{{"update_info", {{"names", names}, {"dtype_names", dtypes}, {"shapes", shapes}}}}.dump());
  Series start{"POST start", {}}, upd{"POST update (cached)", {}}, finish{"POST finish", {}},
      sync{"sync (3 calls)", {}}, health{"GET /health", {}};
  auto now = [] { return std::chrono::steady_clock::now(); };
  auto us = [](auto a, auto b) { return std::chrono::duration<double, std::micro>(b - a).count(); };
  for (int r = 0; r < rounds + 20; ++r) {
    Deadline d = Deadline::InSeconds(30);
    auto t0 = now();
    if (!client.Post("/start_weight_update", json::object(), d).ok()) return 1;
    auto t1 = now();
    if (!client.PostAsync("/update_weights", update, d)->Wait(d).ok()) return 1;
    auto t2 = now();
    if (!client.Post("/finish_weight_update", json::object(), d).ok()) return 1;
    auto t3 = now();
    if (!client.Get("/health", d).ok()) return 1;
    auto t4 = now();
    if (r < 20) continue;  // warm-up
    start.us.push_back(us(t0, t1));
    upd.us.push_back(us(t1, t2));
    finish.us.push_back(us(t2, t3));
    sync.us.push_back(us(t0, t3));
    health.us.push_back(us(t3, t4));
  }
  std::printf("%d rounds, %d server(s), update body %zu bytes\n", rounds, servers, update->size());
  std::printf("%-24s %8s %8s %8s\n", "call (us)", "p50", "p90", "p99");
  for (Series* s : {&start, &upd, &finish, &sync, &health}) Print(*s);
  return 0;
}

}  // namespace
}  // namespace wsync

int main(int argc, char** argv) {
  int rounds = argc > 1 ? std::atoi(argv[1]) : 2000;
  int servers = argc > 2 ? std::atoi(argv[2]) : 1;
  return wsync::Run(rounds, servers);
}
