#include "children.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <fmt/format.h>

namespace wsync::cli {
namespace {

std::string Tail(const std::string& path, size_t max_bytes = 2000) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string s = ss.str();
  return s.size() > max_bytes ? s.substr(s.size() - max_bytes) : s;
}

std::string SelfExe() {
  std::error_code ec;
  auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string("wsync") : p.string();
}

}  // namespace

Result<std::string> MakeTempDir(const std::string& tag) {
  const char* base = std::getenv("TMPDIR");
  std::string tmpl = fmt::format("{}/wsync-{}-XXXXXX", base ? base : "/tmp", tag);
  if (mkdtemp(tmpl.data()) == nullptr) {
    return Internal(fmt::format("mkdtemp {}: {}", tmpl, std::strerror(errno)));
  }
  return tmpl;
}

Result<Child> StartServer(std::vector<std::string> args, const std::string& log_path,
                          Deadline deadline) {
  std::string ready = log_path + ".ready";
  std::filesystem::remove(ready);
  std::vector<std::string> argv = {SelfExe(), "serve"};
  argv.insert(argv.end(), args.begin(), args.end());
  argv.insert(argv.end(), {"--port", "0", "--ready-file", ready});
  std::vector<char*> cargv;
  for (auto& a : argv) cargv.push_back(a.data());
  cargv.push_back(nullptr);

  Child child;
  child.log_path = log_path;
  int log_fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (log_fd < 0) return Internal(fmt::format("opening {}: {}", log_path, std::strerror(errno)));
  pid_t parent = getpid();
  child.pid = fork();
  if (child.pid == 0) {
    // The server dies with this process, even if it is SIGKILLed.
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(1);
    dup2(log_fd, STDOUT_FILENO);
    dup2(log_fd, STDERR_FILENO);
    int devnull = open("/dev/null", O_RDONLY);
    if (devnull >= 0) dup2(devnull, STDIN_FILENO);
    execv(cargv[0], cargv.data());
    _exit(127);
  }
  close(log_fd);
  if (child.pid < 0) return Internal(fmt::format("fork: {}", std::strerror(errno)));

  while (!deadline.expired()) {
    std::ifstream in(ready);
    if (in && std::getline(in, child.url) && !child.url.empty()) return child;
    int status = 0;
    if (waitpid(child.pid, &status, WNOHANG) == child.pid) {
      child.pid = -1;
      return Unavailable(fmt::format("server exited before listening (status {}); its log:\n{}",
                                     status, Tail(log_path)));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  StopChild(child, 1);
  return DeadlineExceeded(fmt::format("server did not listen in time; its log:\n{}", Tail(log_path)));
}

void StopChild(Child& child, double grace_seconds) {
  if (child.pid <= 0) return;
  kill(child.pid, SIGTERM);
  Deadline d = Deadline::InSeconds(grace_seconds);
  int status = 0;
  while (!d.expired()) {
    if (waitpid(child.pid, &status, WNOHANG) == child.pid) {
      child.pid = -1;
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  kill(child.pid, SIGKILL);
  waitpid(child.pid, &status, 0);
  child.pid = -1;
}

}  // namespace wsync::cli
