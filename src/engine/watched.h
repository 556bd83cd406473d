// Helpers the trainer data planes share.
#pragma once

#include <functional>
#include <string>

#include "comm/communicator.h"
#include "control/session_driver.h"
#include "core/deadline.h"
#include "wsync/status.h"

namespace wsync {

// Runs `op` on its own thread and waits for it, for the first failure among the servers'
// HTTP replies (`http`, may be null), or for the deadline, whichever comes first. On an
// HTTP failure or the deadline it aborts `comm` (which wakes a blocked transfer) and
// returns that error; when the op fails while a server's call fails too (or within a
// moment of it), the server's error comes first (it names the culprit) and the op's follows. The op must keep only shared state: it may finish
// after this returns. `what` names the op in errors.
Status Watched(std::function<Status()> op, Communicator& comm, SessionDriver::Pending* http, Deadline deadline,
               const char* what);

// `bytes` random bytes as lowercase hex, for rendezvous prefixes unique per group.
std::string RandomHex(int bytes);

}  // namespace wsync
