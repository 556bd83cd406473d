#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "wsync/backend.h"

namespace wsync::cli {

struct ServeArgs {
  std::string host = "127.0.0.1";
  int port = 8000;
  std::string model = "qwen3-tiny";
  int tp = 1;
  int dp = 1;
  int dp_rank = -1;
  std::string device = "cpu";
  std::string backend = kDefaultBackend;
  std::string api_key;
  double timeout = 300;
  double session_lease = -1;                    // < 0: --timeout; 0: sessions never expire
  std::vector<std::string> allowed_store_hosts;  // nccl: stores besides the peer's own
  double max_body_mb = 256;
  double http_header_timeout = 10;  // see HttpServerOptions
  double http_body_timeout = 30;
  int http_max_connections = 1024;
  int http_threads = 32;
  std::string ready_file;
  std::string fault;
  std::string base_checkpoint;       // delta: the checkpoint version 0 is
  std::string local_checkpoint_dir;  // delta: this host's mutable copy
  std::string ipc_shm_dir;           // ipc: where POSIX shm regions may be opened (empty: sealed memfds only)
  std::string sync_root;             // delta: the directory request-named sync dirs lie below
  double token_interval_ms = 0;      // toy generation: milliseconds between a request's tokens
  double kv_cache_mib = 16;          // toy generation: prefix cache pool; 0 disables prefix caching
  // Weights at start-up and sleep (see InferenceServerOptions).
  std::string checkpoint;            // a safetensors checkpoint to load at start; empty: synthetic
  uint64_t init_seed = 0;            // synthetic weights' seed (set from the options' default)
  std::string offload_dir;           // where sleep level 1 keeps host weights; empty: $TMPDIR or /tmp
  std::string quantization = "none";  // none | fp8 (InferenceServerOptions::quantization)
  std::string speculative = "none";   // none | mtp (InferenceServerOptions::speculative)
  int max_loras = 0;                  // LoRA adapters held at once (InferenceServerOptions::max_loras)
};

int RunServe(const ServeArgs& args);

}  // namespace wsync::cli
