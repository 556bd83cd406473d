#include "subprocess.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include <fmt/format.h>

extern char** environ;

namespace wsync::e2e {
namespace {

std::string ShellQuote(const std::string& s) {
  if (!s.empty() && s.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                        "0123456789-_./:=,@+") == std::string::npos) {
    return s;
  }
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// The child's environment: the test's, without WSYNC_API_KEY, plus `extra`.
std::vector<std::string> ChildEnvironment(const std::map<std::string, std::string>& extra) {
  std::vector<std::string> env;
  for (char** e = environ; e && *e; ++e) {
    std::string_view kv(*e);
    std::string key(kv.substr(0, kv.find('=')));
    if (key == "WSYNC_API_KEY" || extra.count(key)) continue;
    env.emplace_back(kv);
  }
  for (const auto& [k, v] : extra) env.push_back(k + "=" + v);
  return env;
}

}  // namespace

std::string ExitStatus::ToString() const {
  if (exited) return fmt::format("exit {}", code);
  return fmt::format("signal {} ({})", signal, strsignal(signal));
}

Result<std::unique_ptr<Subprocess>> Subprocess::Spawn(const std::string& binary,
                                                      SpawnOptions options) {
  std::unique_ptr<Subprocess> p(new Subprocess());
  p->binary_ = binary;
  p->options_ = std::move(options);

  // Everything the child needs is prepared before fork(): after it, only
  // async-signal-safe calls.
  std::vector<std::string> argv_store;
  argv_store.push_back(binary);
  for (const auto& a : p->options_.args) argv_store.push_back(a);
  std::vector<char*> argv;
  for (auto& a : argv_store) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<std::string> env_store = ChildEnvironment(p->options_.env);
  std::vector<char*> envp;
  for (auto& e : env_store) envp.push_back(e.data());
  envp.push_back(nullptr);

  int out_fd = open(p->options_.stdout_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (out_fd < 0) {
    return Internal(fmt::format("open {}: {}", p->options_.stdout_path.string(), strerror(errno)));
  }
  int err_fd = open(p->options_.stderr_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (err_fd < 0) {
    close(out_fd);
    return Internal(fmt::format("open {}: {}", p->options_.stderr_path.string(), strerror(errno)));
  }
  int null_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  pid_t parent = getpid();

  pid_t pid = fork();
  if (pid < 0) {
    int e = errno;
    close(out_fd);
    close(err_fd);
    if (null_fd >= 0) close(null_fd);
    return Internal(fmt::format("fork for {}: {}", binary, strerror(e)));
  }
  if (pid == 0) {
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);  // the test died between fork and prctl
    if (null_fd >= 0) dup2(null_fd, STDIN_FILENO);
    dup2(out_fd, STDOUT_FILENO);
    dup2(err_fd, STDERR_FILENO);
    // Undo signal state a test runner may have set.
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    signal(SIGPIPE, SIG_DFL);
    execve(binary.c_str(), argv.data(), envp.data());
    const char msg[] = "e2e: execve failed\n";
    (void)!write(STDERR_FILENO, msg, sizeof(msg) - 1);
    _exit(127);
  }
  // Also from the parent, so that Signal() works even before the child runs setpgid.
  setpgid(pid, pid);
  close(out_fd);
  close(err_fd);
  if (null_fd >= 0) close(null_fd);
  p->pid_ = pid;
  return p;
}

Subprocess::~Subprocess() { (void)Stop(); }

std::string Subprocess::CommandLine() const {
  std::string s = ShellQuote(binary_);
  for (const auto& a : options_.args) s += " " + ShellQuote(a);
  return s;
}

void Subprocess::Reaped(int wait_status) {
  ExitStatus st;
  if (WIFEXITED(wait_status)) {
    st.exited = true;
    st.code = WEXITSTATUS(wait_status);
  } else if (WIFSIGNALED(wait_status)) {
    st.signal = WTERMSIG(wait_status);
  }
  exit_ = st;
}

// Sweeps whatever the child left in its group (servers a `demo` started, say) while the
// child is still an unreaped zombie, so its pid, and with it the group id, cannot have
// been reused; then reaps it.
void Subprocess::SweepAndReap() {
  kill(-pid_, SIGKILL);
  int ws = 0;
  while (waitpid(pid_, &ws, 0) < 0 && errno == EINTR) {
  }
  Reaped(ws);
}

bool Subprocess::Running() {
  if (exit_) return false;
  siginfo_t info{};
  // WNOWAIT: look without reaping.
  if (waitid(P_PID, pid_, &info, WEXITED | WNOHANG | WNOWAIT) == 0 && info.si_pid == pid_) {
    SweepAndReap();
    return false;
  }
  return true;
}

std::optional<ExitStatus> Subprocess::Wait(Deadline deadline) {
  while (Running()) {
    if (deadline.expired()) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return exit_;
}

void Subprocess::Signal(int sig) {
  if (!exit_ && pid_ > 0) kill(-pid_, sig);
}

ExitStatus Subprocess::Stop(std::chrono::milliseconds grace) {
  if (pid_ <= 0) return ExitStatus{};
  if (!exit_) {
    Signal(SIGTERM);
    Wait(Deadline::In(grace));
  }
  if (!exit_) SweepAndReap();
  return *exit_;
}

std::string Subprocess::Stdout() const { return ReadFile(options_.stdout_path); }
std::string Subprocess::Stderr() const { return ReadFile(options_.stderr_path); }

std::string Subprocess::Describe(size_t tail_bytes) const {
  return fmt::format("$ {}\n[{}]\n--- stdout (last {} bytes) ---\n{}\n--- stderr (last {} bytes) ---\n{}",
                     CommandLine(), exit_ ? exit_->ToString() : std::string("running"),
                     tail_bytes, ReadFileTail(options_.stdout_path, tail_bytes), tail_bytes,
                     ReadFileTail(options_.stderr_path, tail_bytes));
}

std::string ReadFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string ReadFileTail(const std::filesystem::path& path, size_t n) {
  std::string all = ReadFile(path);
  return all.size() <= n ? all : "..." + all.substr(all.size() - n);
}

}  // namespace wsync::e2e
