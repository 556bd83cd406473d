// `wsync serve`: the reference inference server, until SIGTERM or SIGINT.
#include "serve.h"

#include <signal.h>
#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>

#include "core/log.h"
#include "wsync/server.h"

namespace wsync::cli {

int RunServe(const ServeArgs& a) {
  // Block the shutdown signals in every thread; this thread collects them with sigwait.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  ServerOptions options;
  InferenceServerOptions& o = options.inference;
  o.model = a.model;
  o.tp = a.tp;
  o.dp = a.dp;
  o.dp_rank = a.dp_rank;
  o.backend = a.backend;
  o.timeout_seconds = a.timeout;
  if (a.session_lease >= 0) o.session_lease_seconds = a.session_lease;
  if (!a.allowed_store_hosts.empty()) o.backend_config["allowed_store_hosts"] = a.allowed_store_hosts;
  o.fault_never_join = a.fault == "never-join";
  o.fault_corrupt_landed = a.fault == "corrupt-landed";
  // A real process death in the data phase: the nccl receiver SIGKILLs this process once
  // its first worker has loaded one chunk of an update (what an OOM kill or a crashed
  // worker does to the trainer's group). Only the timing is chosen.
  if (a.fault == "die-mid-update") o.backend_config["fault"] = "die-mid-update";
  if (!a.base_checkpoint.empty()) o.backend_config["base_checkpoint"] = a.base_checkpoint;
  if (!a.local_checkpoint_dir.empty()) o.backend_config["local_checkpoint_dir"] = a.local_checkpoint_dir;
  if (!a.ipc_shm_dir.empty()) o.backend_config["ipc_shm_dir"] = a.ipc_shm_dir;
  if (!a.sync_root.empty()) o.backend_config["sync_root"] = a.sync_root;
  o.token_interval_ms = a.token_interval_ms;
  if (a.kv_cache_mib < 0 || a.kv_cache_mib > 1 << 20) {
    fmt::print(stderr, "wsync serve: error: --kv-cache-mib {} must be in [0, {}]\n", a.kv_cache_mib, 1 << 20);
    return 2;
  }
  o.kv_cache_bytes = static_cast<size_t>(a.kv_cache_mib * (1 << 20));
  o.checkpoint = a.checkpoint;
  o.init_seed = a.init_seed;
  o.offload_dir = a.offload_dir;
  o.quantization = a.quantization;
  o.speculative = a.speculative;
  o.max_loras = a.max_loras;
  Result<Device> device = Device::Parse(a.device);
  if (!device.ok()) {
    fmt::print(stderr, "wsync serve: error: {}\n", device.status().message());
    return 2;
  }
  o.device = *device;
  HttpServerOptions& h = options.http;
  h.host = a.host;
  h.port = a.port;
  h.api_key = a.api_key;
  h.max_body_bytes = static_cast<size_t>(a.max_body_mb * (1 << 20));
  h.header_timeout_seconds = a.http_header_timeout;
  h.body_timeout_seconds = a.http_body_timeout;
  h.max_connections = a.http_max_connections;
  h.worker_threads = a.http_threads;
  // Every HTTP connection holds a descriptor: raise the soft limit (within the hard one)
  // so that --http-max-connections, not EMFILE, is what bounds them.
  rlimit nofile{};
  rlim_t want = static_cast<rlim_t>(a.http_max_connections) + 1024;
  if (getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur < want) {
    nofile.rlim_cur = std::min(want, nofile.rlim_max);
    setrlimit(RLIMIT_NOFILE, &nofile);
  }
  Result<std::unique_ptr<Server>> server = Server::Start(options);
  if (!server.ok()) {
    fmt::print(stderr, "wsync serve: error: {}\n", server.status().message());
    return 1;
  }
  const std::string& url = (*server)->url();
  WSYNC_LOG_INFO("serving {} (tp {}, dp {}{}, {} worker(s), backend {}) on {}",
                 (*server)->Health()["model"].get<std::string>(), a.tp, a.dp,
                 a.dp_rank >= 0 ? fmt::format(", dp rank {}", a.dp_rank) : "", (*server)->num_workers(), a.backend,
                 url);
  fmt::print("listening on {}\n", url);
  std::fflush(stdout);
  if (!a.ready_file.empty()) {
    std::string tmp = a.ready_file + ".tmp";
    std::ofstream(tmp) << url << "\n";
    std::filesystem::rename(tmp, a.ready_file);
  }
  int sig = 0;
  sigwait(&signals, &sig);
  WSYNC_LOG_INFO("signal {}: shutting down", sig);
  (*server)->Stop();
  return 0;
}

}  // namespace wsync::cli
