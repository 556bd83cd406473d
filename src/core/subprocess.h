// Subprocess: one child process that wsync starts and owns — a `wsync serve` of `wsync
// demo`, a rank of a benchmark, a `wsync push` of an end-to-end test, a test binary run
// again with other flags — and the one place that forks.
//
// Spawn() execs a binary (no PATH search) with argv, an environment derived from this
// process's, stdin from /dev/null and stdout/stderr to files, to a pipe this object
// drains, or inherited. By default the child leads a new process group of its own, so
// that whatever it starts in turn (the servers of `wsync demo`) is signalled with it, and
// gets SIGKILL when the spawning thread exits (PR_SET_PDEATHSIG), even on a crash: spawn
// from a thread that outlives the child. Fork() runs a function in a forked copy of this
// process instead (tests that need a process to die at a chosen point), with the same
// ownership.
//
// The destructor stops the child — SIGTERM to its group, a grace period, SIGKILL — and
// reaps it, so none is left behind whether the owner returns, fails or throws. Every
// wait takes a deadline. Not thread-safe: one owner drives a Subprocess.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <csignal>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/deadline.h"
#include "wsync/status.h"

namespace wsync {

// How a child ended.
struct ExitStatus {
  bool exited = false;  // exited normally: `code` is the exit status
  int code = -1;
  int signal = 0;       // killed by this signal (when !exited)

  bool success() const { return exited && code == 0; }
  // The shell's convention: the exit code, or 128 + the signal.
  int ShellCode() const { return exited ? code : 128 + signal; }
  std::string ToString() const;  // "exit 0", "exit 3", "signal 9 (Killed)"
};

struct SpawnOptions {
  std::vector<std::string> args;  // argv[1..]; argv[0] is the binary
  // Where stdout and stderr go: a file (created or truncated; the same path for both
  // shares one file), or, when empty, this process's own stream.
  std::filesystem::path stdout_path;
  std::filesystem::path stderr_path;
  // Stdout into a pipe instead of a file; Wait() drains it and Stdout() returns it.
  bool capture_stdout = false;
  // Added to (or replacing in) this process's environment.
  std::map<std::string, std::string> env;
  // Removed from the inherited environment (unless `env` sets them).
  std::vector<std::string> unset_env;
  // A process group of its own, signalled as a whole; false keeps this process's group
  // (a terminal's Ctrl-C then reaches the child too).
  bool new_process_group = true;
  // Sent to the child when the spawning thread exits; 0 for none.
  int death_signal = SIGKILL;
};

class Subprocess {
 public:
  // Starts `binary` (a path) with `options`.
  static Result<std::unique_ptr<Subprocess>> Spawn(const std::string& binary, SpawnOptions options);
  // Runs `body` in a forked copy of this process and exits with what it returns. Only the
  // output and group fields of `options` apply. The child inherits every mutex of this
  // process in its current state: `body` must not need one another thread may hold.
  static Result<std::unique_ptr<Subprocess>> Fork(std::function<int()> body, SpawnOptions options = {});

  ~Subprocess();  // Stop(), ignoring the outcome
  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;

  pid_t pid() const { return pid_; }
  // The command line, shell-quoted, for messages.
  std::string CommandLine() const;

  // True until the child has exited (reaps it when it has).
  bool Running();
  // Waits until the child exits or `deadline` passes; nullopt on timeout.
  std::optional<ExitStatus> Wait(Deadline deadline);
  // Sends `sig` to the child (its group when it leads one); no-op once it is reaped.
  void Signal(int sig);
  // SIGTERM, up to `grace` for the child to exit, then SIGKILL and a blocking reap.
  // Returns how the child ended. Idempotent.
  ExitStatus Stop(std::chrono::milliseconds grace = std::chrono::seconds(5));
  // The exit status, once reaped.
  const std::optional<ExitStatus>& exit_status() const { return exit_; }

  // What the child wrote to stdout (the captured pipe or the file) and stderr (the file);
  // empty for an inherited stream.
  std::string Stdout() const;
  std::string Stderr() const;
  // "$ <command line>\n[<exit status>]\n--- stdout (last N bytes) ---\n...": what an
  // error or a failed assertion should say about this child.
  std::string Describe(size_t tail_bytes = 4000) const;

 private:
  Subprocess() = default;
  static Result<std::unique_ptr<Subprocess>> Start(const std::string& binary, SpawnOptions options,
                                                   std::function<int()> body);
  void Reaped(int wait_status);
  void SweepAndReap();
  void DrainPipe(bool block_until_eof);

  std::string binary_;
  SpawnOptions options_;
  pid_t pid_ = -1;
  int pipe_fd_ = -1;  // read end of the captured stdout
  std::string captured_;
  std::optional<ExitStatus> exit_;
};

// The whole file, or its last `n` bytes behind "..." (ReadFileTail); empty when it cannot
// be read.
std::string ReadFileOrEmpty(const std::filesystem::path& path);
std::string ReadFileTail(const std::filesystem::path& path, size_t n);

// The path of the running binary (/proc/self/exe resolved), for spawning this binary again.
std::string SelfExe();

}  // namespace wsync
