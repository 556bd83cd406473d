// Subprocess: one child process of an end-to-end test (a `wsync serve`, a `wsync push`).
//
// Spawn() forks and execs a binary with its stdout and stderr redirected to files, in a
// new process group of its own (so that whatever it starts in turn, e.g. the servers of
// `wsync demo`, can be signalled with it), with PR_SET_PDEATHSIG set so that it dies with
// the test process even when the test crashes. The destructor stops it — SIGTERM to the
// group, a grace period, then SIGKILL — and reaps it, so no test leaves a process behind,
// whether it passes, fails an assertion or throws. Spawn from the test's main thread
// (PDEATHSIG fires when the spawning thread exits). Not thread-safe.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/deadline.h"
#include "wsync/status.h"

namespace wsync::e2e {

// How a child ended.
struct ExitStatus {
  bool exited = false;  // exited normally: `code` is the exit status
  int code = -1;
  int signal = 0;       // killed by this signal (when !exited)

  bool success() const { return exited && code == 0; }
  std::string ToString() const;  // "exit 0", "exit 3", "signal 9 (Killed)"
};

struct SpawnOptions {
  std::vector<std::string> args;            // argv[1..]
  std::filesystem::path stdout_path;        // created or truncated
  std::filesystem::path stderr_path;
  // Added to (or replacing in) the test's environment. WSYNC_API_KEY is removed from
  // the inherited environment so that a developer's shell cannot change a test's
  // outcome; set it here to pass one.
  std::map<std::string, std::string> env;
};

class Subprocess {
 public:
  static Result<std::unique_ptr<Subprocess>> Spawn(const std::string& binary, SpawnOptions options);
  ~Subprocess();  // Stop(), ignoring the outcome
  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;

  pid_t pid() const { return pid_; }
  // The command line, shell-quoted, for failure messages.
  std::string CommandLine() const;

  // True until the child has exited (reaps it when it has).
  bool Running();
  // Waits until the child exits or `deadline` passes; nullopt on timeout.
  std::optional<ExitStatus> Wait(Deadline deadline);
  // Sends `sig` to the child's process group; no-op once it is reaped.
  void Signal(int sig);
  // SIGTERM to the group, up to `grace` for the child to exit, then SIGKILL to the group
  // and a blocking reap. Returns how the child ended. Idempotent.
  ExitStatus Stop(std::chrono::milliseconds grace = std::chrono::seconds(5));
  // The exit status, once reaped.
  const std::optional<ExitStatus>& exit_status() const { return exit_; }

  std::string Stdout() const;
  std::string Stderr() const;
  // "<command line>\n<exit status>\n--- stdout (tail) ---\n...\n--- stderr (tail) ---\n...":
  // what a failed assertion should print about this child.
  std::string Describe(size_t tail_bytes = 4000) const;

 private:
  Subprocess() = default;
  void Reaped(int wait_status);
  void SweepAndReap();

  std::string binary_;
  SpawnOptions options_;
  pid_t pid_ = -1;
  std::optional<ExitStatus> exit_;
};

// The last `n` bytes of a file (all of it when shorter); empty when it cannot be read.
std::string ReadFileTail(const std::filesystem::path& path, size_t n);
std::string ReadFile(const std::filesystem::path& path);

}  // namespace wsync::e2e
