#include "core/subprocess.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <sstream>
#include <string_view>
#include <thread>

#include <fmt/format.h>

#include "core/syscall.h"

extern char** environ;

namespace wsync {
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

// The child's environment: this process's, less `unset` and what `extra` replaces, plus `extra`.
std::vector<std::string> ChildEnvironment(const SpawnOptions& o) {
  std::vector<std::string> env;
  for (char** e = environ; e && *e; ++e) {
    std::string_view kv(*e);
    std::string key(kv.substr(0, kv.find('=')));
    if (o.env.count(key)) continue;
    bool unset = false;
    for (const auto& u : o.unset_env) unset |= u == key;
    if (!unset) env.emplace_back(kv);
  }
  for (const auto& [k, v] : o.env) env.push_back(k + "=" + v);
  return env;
}

// File descriptors the child's stdio comes from, opened before fork (after it, only
// async-signal-safe calls).
struct ChildFds {
  int in = -1, out = -1, err = -1, pipe_read = -1;
  ~ChildFds() {
    for (int fd : {in, out, err}) {
      if (fd >= 0) ::close(fd);
    }
  }
};

Result<int> OpenOutput(const std::filesystem::path& path) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoStatus(errno, fmt::format("opening {} for a child's output", path.string()));
  return fd;
}

Status OpenChildFds(const SpawnOptions& o, ChildFds& fds) {
  fds.in = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (o.capture_stdout) {
    int p[2];
    if (::pipe2(p, O_CLOEXEC) != 0) return ErrnoStatus(errno, "pipe for a child's stdout");
    fds.pipe_read = p[0];
    fds.out = p[1];
  } else if (!o.stdout_path.empty()) {
    WSYNC_ASSIGN_OR_RETURN(fds.out, OpenOutput(o.stdout_path));
  }
  if (!o.stderr_path.empty()) {
    if (o.stderr_path == o.stdout_path && !o.capture_stdout) {
      fds.err = ::dup(fds.out);
      if (fds.err < 0) return ErrnoStatus(errno, "dup of a child's output");
    } else {
      WSYNC_ASSIGN_OR_RETURN(fds.err, OpenOutput(o.stderr_path));
    }
  }
  return Status::Ok();
}

// In the child, between fork and exec or body: async-signal-safe calls only.
void SetUpChild(const SpawnOptions& o, const ChildFds& fds, pid_t parent) {
  if (o.new_process_group) setpgid(0, 0);
  if (o.death_signal != 0) {
    prctl(PR_SET_PDEATHSIG, o.death_signal);
    if (getppid() != parent) _exit(127);  // the parent died between fork and prctl
  }
  if (fds.in >= 0) dup2(fds.in, STDIN_FILENO);
  if (fds.out >= 0) dup2(fds.out, STDOUT_FILENO);
  if (fds.err >= 0) dup2(fds.err, STDERR_FILENO);
  // Undo signal state a test runner or a server may have set.
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
  signal(SIGPIPE, SIG_DFL);
}

}  // namespace

std::string ExitStatus::ToString() const {
  if (exited) return fmt::format("exit {}", code);
  return fmt::format("signal {} ({})", signal, strsignal(signal));
}

Result<std::unique_ptr<Subprocess>> Subprocess::Spawn(const std::string& binary, SpawnOptions options) {
  return Start(binary, std::move(options), nullptr);
}

Result<std::unique_ptr<Subprocess>> Subprocess::Fork(std::function<int()> body, SpawnOptions options) {
  return Start(SelfExe() + " (forked)", std::move(options), std::move(body));
}

Result<std::unique_ptr<Subprocess>> Subprocess::Start(const std::string& binary, SpawnOptions options,
                                                      std::function<int()> body) {
  std::unique_ptr<Subprocess> p(new Subprocess());
  p->binary_ = binary;
  p->options_ = std::move(options);
  const SpawnOptions& o = p->options_;

  std::vector<std::string> argv_store = {binary};
  argv_store.insert(argv_store.end(), o.args.begin(), o.args.end());
  std::vector<char*> argv;
  for (auto& a : argv_store) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<std::string> env_store = ChildEnvironment(o);
  std::vector<char*> envp;
  for (auto& e : env_store) envp.push_back(e.data());
  envp.push_back(nullptr);
  ChildFds fds;
  WSYNC_RETURN_IF_ERROR(OpenChildFds(o, fds));
  p->pipe_fd_ = fds.pipe_read;  // closed by the destructor from here on
  pid_t parent = getpid();

  pid_t pid = fork();
  if (pid < 0) return ErrnoStatus(errno, fmt::format("fork for {}", binary));
  if (pid == 0) {
    SetUpChild(o, fds, parent);
    if (body) {
      int code = 125;
      try {
        code = body();
      } catch (...) {
      }
      _exit(code);
    }
    execve(binary.c_str(), argv.data(), envp.data());
    const char msg[] = "wsync: execve of a child failed\n";
    (void)!write(STDERR_FILENO, msg, sizeof(msg) - 1);
    _exit(127);
  }
  // Also from the parent, so that Signal() reaches the group before the child runs setpgid.
  if (o.new_process_group) setpgid(pid, pid);
  if (p->pipe_fd_ >= 0) fcntl(p->pipe_fd_, F_SETFL, fcntl(p->pipe_fd_, F_GETFL) | O_NONBLOCK);
  p->pid_ = pid;
  return p;
}

Subprocess::~Subprocess() {
  (void)Stop();
  if (pipe_fd_ >= 0) ::close(pipe_fd_);
}

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
  DrainPipe(false);
}

// Sweeps whatever the child left in its group (servers a `demo` started, say) while the
// child is still an unreaped zombie, so its pid, and with it the group id, cannot have
// been reused; then reaps it.
void Subprocess::SweepAndReap() {
  if (options_.new_process_group) {
    kill(-pid_, SIGKILL);
  } else {
    kill(pid_, SIGKILL);
  }
  int ws = 0;
  RetryOnEintr([&] { return waitpid(pid_, &ws, 0); });
  Reaped(ws);
}

void Subprocess::DrainPipe(bool wait_for_data) {
  if (pipe_fd_ < 0) return;
  if (wait_for_data) {
    pollfd pfd{pipe_fd_, POLLIN, 0};
    RetryOnEintr([&] { return poll(&pfd, 1, 10); });
  }
  char buf[4096];
  for (;;) {
    ssize_t n = RetryOnEintr([&] { return ::read(pipe_fd_, buf, sizeof(buf)); });
    if (n > 0) {
      captured_.append(buf, static_cast<size_t>(n));
      continue;
    }
    if (n == 0) {  // every writer closed it
      ::close(pipe_fd_);
      pipe_fd_ = -1;
    }
    return;  // EOF, or nothing more for now (EAGAIN)
  }
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
    if (pipe_fd_ >= 0) {
      DrainPipe(true);
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  return exit_;
}

void Subprocess::Signal(int sig) {
  if (exit_ || pid_ <= 0) return;
  kill(options_.new_process_group ? -pid_ : pid_, sig);
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

std::string Subprocess::Stdout() const {
  if (options_.capture_stdout) return captured_;
  return options_.stdout_path.empty() ? std::string() : ReadFileOrEmpty(options_.stdout_path);
}

std::string Subprocess::Stderr() const {
  return options_.stderr_path.empty() ? std::string() : ReadFileOrEmpty(options_.stderr_path);
}

std::string Subprocess::Describe(size_t tail_bytes) const {
  auto tail = [&](std::string s) { return s.size() <= tail_bytes ? s : "..." + s.substr(s.size() - tail_bytes); };
  return fmt::format("$ {}\n[{}]\n--- stdout (last {} bytes) ---\n{}\n--- stderr (last {} bytes) ---\n{}",
                     CommandLine(), exit_ ? exit_->ToString() : std::string("running"), tail_bytes,
                     tail(Stdout()), tail_bytes, tail(Stderr()));
}

std::string ReadFileOrEmpty(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string ReadFileTail(const std::filesystem::path& path, size_t n) {
  std::string all = ReadFileOrEmpty(path);
  return all.size() <= n ? all : "..." + all.substr(all.size() - n);
}

std::string SelfExe() {
  std::error_code ec;
  auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string("/proc/self/exe") : p.string();
}

}  // namespace wsync
