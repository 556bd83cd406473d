#include "children.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

#include <fmt/format.h>

#include "core/syscall.h"

namespace wsync::cli {

Result<std::string> MakeTempDir(const std::string& tag) {
  const char* base = std::getenv("TMPDIR");
  std::string tmpl = fmt::format("{}/wsync-{}-XXXXXX", base ? base : "/tmp", tag);
  if (mkdtemp(tmpl.data()) == nullptr) return ErrnoStatus(errno, fmt::format("mkdtemp {}", tmpl));
  return tmpl;
}

Result<Child> StartServer(std::vector<std::string> args, const std::string& log_path,
                          Deadline deadline) {
  std::string ready = log_path + ".ready";
  std::filesystem::remove(ready);
  SpawnOptions o;
  o.args = {"serve"};
  o.args.insert(o.args.end(), args.begin(), args.end());
  o.args.insert(o.args.end(), {"--port", "0", "--ready-file", ready});
  o.stdout_path = o.stderr_path = log_path;
  // The server dies with this process, even if it is SIGKILLed, and shares its process
  // group, so a terminal's Ctrl-C reaches it too.
  o.death_signal = SIGTERM;
  o.new_process_group = false;
  WSYNC_ASSIGN_OR_RETURN(std::unique_ptr<Subprocess> p, Subprocess::Spawn(SelfExe(), std::move(o)));
  Child child{std::move(p), "", log_path};
  while (!deadline.expired()) {
    std::ifstream in(ready);
    if (in && std::getline(in, child.url) && !child.url.empty()) return child;
    if (!child.process->Running()) {
      return Unavailable(fmt::format("server exited before listening ({}); its log:\n{}",
                                     child.process->exit_status()->ToString(), ReadFileTail(log_path, 2000)));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  StopChild(child, 1);
  return DeadlineExceeded(fmt::format("server did not listen in time; its log:\n{}", ReadFileTail(log_path, 2000)));
}

void StopChild(Child& child, double grace_seconds) {
  if (!child.process) return;
  child.process->Stop(std::chrono::milliseconds(static_cast<int64_t>(grace_seconds * 1000)));
  child.process.reset();
}

}  // namespace wsync::cli
