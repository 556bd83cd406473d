// Soak: 1000 consecutive verified syncs of qwen3-tiny through each CPU backend into one
// real `wsync serve`, then the server's resident memory, open file descriptors and threads
// compared with what they were after a short warm-up. A server that leaks a descriptor, a
// thread or a buffer per sync fails here long before it would fail in a week-long RL run.
// Labelled "slow": `ctest -L slow` runs it; the figures go to docs/security.md.
#include <dirent.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <functional>
#include <thread>

#include <fmt/format.h>

#include "core/parallel.h"
#include "e2e_test_base.h"
#include "format/safetensors.h"
#include "model/config.h"
#include "synthetic/synthetic.h"

namespace wsync::e2e {
namespace {

namespace fs = std::filesystem;

constexpr int kSyncs = 1000;  // the starting weights and 999 steps
constexpr int kWarmupSyncs = 20;

// What /proc says of a process: resident set, open descriptors, threads.
struct ProcessUsage {
  int64_t rss_kib = -1;
  int fds = -1;
  int threads = -1;
  std::string ToString() const { return fmt::format("rss {} KiB, {} fds, {} threads", rss_kib, fds, threads); }
};

ProcessUsage Usage(pid_t pid) {
  ProcessUsage u;
  std::ifstream status(fmt::format("/proc/{}/status", pid));
  std::string key;
  while (status >> key) {
    if (key == "VmRSS:") status >> u.rss_kib;
    if (key == "Threads:") status >> u.threads;
  }
  if (DIR* d = opendir(fmt::format("/proc/{}/fd", pid).c_str())) {
    u.fds = 0;
    while (dirent* e = readdir(d)) u.fds += e->d_name[0] != '.';
    closedir(d);
  }
  return u;
}

class SoakTest : public E2eTest {
 protected:
  // Runs `push ARGS --steps STEPS --verify` to completion while sampling the server's
  // peak resident set; returns the server's usage once the push has exited and settled
  // (see Settled).
  ProcessUsage PushAndMeasure(const Server& s, std::vector<std::string> args, int steps, int64_t* peak_rss_kib,
                              const ProcessUsage& settle_below) {
    std::atomic<bool> done{false};
    std::atomic<int64_t> peak{0};
    std::thread sampler([&] {
      while (!done) {
        peak = std::max<int64_t>(peak, Usage(s.process->pid()).rss_kib);
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    });
    args.insert(args.end(), {"--model", "qwen3-tiny", "--seed", "5", "--steps", std::to_string(steps), "--verify",
                             "--timeout", "120"});
    RunResult push = RunWsync(fmt::format("push{}", steps), args, 3600);
    done = true;
    sampler.join();
    EXPECT_TRUE(push.success()) << push.description << "\n--- server ---\n" << s.process->Describe();
    EXPECT_TRUE(HasVerifiedTable(push.out, steps + 1)) << push.description;
    if (peak_rss_kib) *peak_rss_kib = peak;
    return Settled(s.process->pid(), settle_below);
  }

  // The usage once what the trainer's exit releases (its connections, the ipc region's
  // mapping) is gone on the server's side: polled until descriptors and threads are at
  // most `bound`'s, for up to 10 s.
  static ProcessUsage Settled(pid_t pid, const ProcessUsage& bound) {
    auto end = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    ProcessUsage u = Usage(pid);
    while ((u.fds > bound.fds || u.threads > bound.threads) && std::chrono::steady_clock::now() < end) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      u = Usage(pid);
    }
    return u;
  }

  // Warm-up, then kSyncs consecutive verified syncs; no growth in descriptors or threads,
  // resident memory within allocator slack; the server then holds the trainer's weights.
  // `push_args(tag)` is the push command line of one trainer run ("warmup", "soak").
  void Soak(const Server& s, const std::function<std::vector<std::string>(const std::string&)>& push_args) {
    ProcessUsage before = Usage(s.process->pid());
    ProcessUsage warm = PushAndMeasure(s, push_args("warmup"), kWarmupSyncs - 1, nullptr, before);
    int64_t peak = 0;
    auto t0 = std::chrono::steady_clock::now();
    ProcessUsage after = PushAndMeasure(s, push_args("soak"), kSyncs - 1, &peak, warm);
    double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("soak %s: %d verified syncs in %.1f s; after warm-up: %s; after the soak: %s; peak rss %lld KiB\n",
                ::testing::UnitTest::GetInstance()->current_test_info()->name(), kSyncs, seconds,
                warm.ToString().c_str(), after.ToString().c_str(), static_cast<long long>(peak));
    EXPECT_LE(after.fds, warm.fds) << "descriptors leaked over " << kSyncs << " syncs";
    EXPECT_LE(after.threads, warm.threads) << "threads leaked over " << kSyncs << " syncs";
    // A leak of one tensor-sized buffer per sync would add far more than this.
    EXPECT_LT(after.rss_kib - warm.rss_kib, 16 * 1024) << "resident memory grew over " << kSyncs << " syncs";
    E2E_ASSERT_OK_AND_ASSIGN(Digests want,
                             ExpectedSyntheticDigests("qwen3-tiny", 5, kSyncs - 1, DigestAlgorithm::kXxh3_128));
    ExpectServersHold({s}, want, DigestAlgorithm::kXxh3_128);
  }
};

TEST_F(SoakTest, NcclOverGloo) {
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("serve", {"--model", "qwen3-tiny", "--tp", "2"}));
  Soak(s, [&](const std::string&) { return std::vector<std::string>{"push", "--servers", s.url, "--backend", "nccl"}; });
}

TEST_F(SoakTest, Ipc) {
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("serve", {"--model", "qwen3-tiny", "--tp", "2", "--backend", "ipc"}));
  Soak(s, [&](const std::string&) { return std::vector<std::string>{"push", "--servers", s.url, "--backend", "ipc"}; });
}

TEST_F(SoakTest, Delta) {
  // The server's base checkpoint is the trainer's starting weights (seed 5).
  E2E_ASSERT_OK_AND_ASSIGN(ModelConfig config, LookupModel("qwen3-tiny"));
  E2E_ASSERT_OK_AND_ASSIGN(auto trainer, SyntheticTrainer::FromMetadata(HfTensors(config), 5, DefaultThreads()));
  std::vector<TensorRef> refs;
  for (const HostTensor& t : trainer->tensors()) refs.push_back(t.ref());
  fs::create_directories(dir() / "base");
  Status w = WriteSafetensors((dir() / "base" / "model.safetensors").string(), refs);
  ASSERT_TRUE(w.ok()) << w.ToString();
  E2E_ASSERT_OK_AND_ASSIGN(Server s, StartServer("serve", {"--model", "qwen3-tiny", "--tp", "2", "--backend", "delta",
                                                           "--base-checkpoint", (dir() / "base").string(),
                                                           "--local-checkpoint-dir", (dir() / "local").string(),
                                                           "--sync-root", dir().string()}));
  // A chain never rewrites a version: each trainer run publishes into a sync dir of its own.
  Soak(s, [&](const std::string& tag) {
    return std::vector<std::string>{"push", "--servers", s.url, "--backend", "delta", "--sync-dir",
                                    (dir() / ("sync-" + tag)).string()};
  });
}

}  // namespace
}  // namespace wsync::e2e
