// The WSYNC_* environment variables wsync reads, in one table.
//
// Every setting a user may change is an option (TrainerOptions, a backend's options
// struct, a CLI flag); the environment only carries what cannot be a flag: the log level
// of any process, a secret, and the paths tests hand to their children. Code reads a
// variable only through WSYNC_ENV(), whose name must be in kEnvKnobs (checked at compile
// time), and `wsync env` prints the table. README.md lists the same table. Thread-safe.
#pragma once

#include <array>
#include <cstdlib>
#include <string_view>

namespace wsync {

struct EnvKnob {
  std::string_view name;
  std::string_view fallback;  // what applies when the variable is unset
  std::string_view help;
};

inline constexpr std::array<EnvKnob, 9> kEnvKnobs = {{
    {"WSYNC_LOG_LEVEL", "info", "log level of any wsync process: trace, debug, info, warn, error, off"},
    {"WSYNC_API_KEY", "", "serve/push --api-key, kept out of the command line"},
    {"WSYNC_BIN", "", "tests: the wsync CLI the end-to-end tests start (set by CTest)"},
    {"WSYNC_CUDA_CHILD", "", "tests: marks the child process a CUDA test starts"},
    {"WSYNC_IPC_RANK1_ORDERS", "", "tests: the orders of rank 1 in the two-GPU ipc test's child"},
    {"WSYNC_WRITE_FUZZ_SEEDS", "", "tests: a directory the sparse-apply test writes fuzz seeds to"},
    {"WSYNC_VLLM_OPTIONS", "", "vLLM plugin (wsync.vllm): the server's receiver settings as a JSON object "
                               "(allowed_store_hosts, ipc_shm_dir, base_checkpoint, local_checkpoint_dir, "
                               "sync_root), which vLLM's --weight-transfer-config cannot carry"},
    {"WSYNC_FAULT_TRAINER_STALL", "", "tests: 'after-start' makes a trainer stall, until killed, once its servers' "
                                      "start_weight_update succeeded (a trainer that dies inside a session)"},
    {"WSYNC_VLLM_TEST_FAULTS", "", "tests: '1' adds the vLLM plugin's fault RPC wsync_corrupt_next_landing (flips "
                                   "a byte of the next tensor a worker lands)"},
}};

consteval bool IsEnvKnob(std::string_view name) {
  for (const EnvKnob& k : kEnvKnobs) {
    if (k.name == name) return true;
  }
  return false;
}

// The variable's value, nullptr when unset. `name` must be a literal from kEnvKnobs.
template <size_t N>
const char* EnvRaw(const char (&name)[N]) {
  return std::getenv(name);
}

}  // namespace wsync

// WSYNC_ENV("WSYNC_X"): the value of a variable of the table, nullptr when unset; a name not in
// the table does not compile.
#define WSYNC_ENV(name)                                                  \
  ([]() -> const char* {                                                 \
    static_assert(::wsync::IsEnvKnob(name), name " is not in kEnvKnobs"); \
    return ::wsync::EnvRaw(name);                                        \
  }())
