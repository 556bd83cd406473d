// Child processes for `wsync demo` and `wsync bench`: servers started from this very
// binary on free loopback ports, found through their --ready-file, stopped with SIGTERM
// (then SIGKILL after a grace period). Every wait has a deadline.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/deadline.h"
#include "core/subprocess.h"
#include "wsync/status.h"

namespace wsync::cli {

struct Child {
  std::shared_ptr<Subprocess> process;  // null once stopped
  std::string url;
  std::string log_path;
};

// Starts `wsync serve <args> --port 0 --ready-file <tmp>` with output to `log_path` and
// waits until it listens. The error carries the tail of the child's log.
Result<Child> StartServer(std::vector<std::string> args, const std::string& log_path,
                          Deadline deadline);

// SIGTERM, wait up to `grace_seconds`, then SIGKILL; always reaps.
void StopChild(Child& child, double grace_seconds = 10);

// A fresh directory under $TMPDIR (or /tmp).
Result<std::string> MakeTempDir(const std::string& tag);

}  // namespace wsync::cli
