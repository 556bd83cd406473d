#include "engine/watched.h"

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <random>
#include <thread>

#include <fmt/format.h>

namespace wsync {

using nlohmann::json;

Status Watched(std::function<Status()> op, Communicator& comm, SessionDriver::Pending* http,
               Deadline deadline, const char* what) {
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    Status status;
  };
  auto state = std::make_shared<State>();
  std::thread([state, op = std::move(op)]() mutable {
    Status s = op();
    op = nullptr;  // what it holds goes before the caller may return; this thread may outlive it
    std::lock_guard lock(state->mu);
    state->done = true;
    state->status = s;
    state->cv.notify_all();
  }).detach();
  std::unique_lock lock(state->mu);
  for (;;) {
    if (state->cv.wait_for(lock, std::chrono::milliseconds(20), [&] { return state->done; })) {
      if (state->status.ok() || http == nullptr) return state->status;
      // A server that dies breaks every rank's connections at once, and the collective
      // may report a surviving rank first; the dead server's own HTTP call fails within
      // moments, and its error is the one that names the culprit.
      Status op_status = state->status;
      lock.unlock();
      Deadline grace = Deadline::InSeconds(std::min(2.0, std::max(0.0, deadline.remaining_seconds())));
      while (!http->AnyFailed() && !http->Done() && !grace.expired()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      if (!http->AnyFailed()) return op_status;
      Result<std::vector<json>> r = http->Wait(Deadline::InSeconds(1));
      if (r.ok()) return op_status;
      return Status(r.status().code(),
                    fmt::format("{} (the {} failed with: {})", r.status().message(), what, op_status.message()));
    }
    if (http != nullptr && http->AnyFailed()) {
      // The op may have failed first and so broken the servers' connections (a source
      // that lied mid-pass): an op that ends on its own within a moment keeps its error
      // beside the server's; one still blocked is aborted.
      const bool ended = state->cv.wait_for(lock, std::chrono::milliseconds(200), [&] { return state->done; });
      const Status op_status = ended ? state->status : Status::Ok();
      if (!ended) {
        comm.Abort();
        state->cv.wait_for(lock, std::chrono::seconds(10), [&] { return state->done; });
      }
      lock.unlock();
      Result<std::vector<json>> r = http->Wait(Deadline::InSeconds(1));
      if (r.ok()) return ended && !op_status.ok() ? op_status : Aborted(fmt::format("{} aborted", what));
      if (op_status.ok()) return r.status();
      return Status(r.status().code(),
                    fmt::format("{} (the {} failed with: {})", r.status().message(), what, op_status.message()));
    }
    if (deadline.expired()) {
      comm.Abort();
      return DeadlineExceeded(fmt::format("{} did not finish within the timeout", what));
    }
  }
}

std::string RandomHex(int bytes) {
  std::random_device rd;
  std::string out;
  for (int i = 0; i < bytes; ++i) out += fmt::format("{:02x}", rd() & 0xff);
  return out;
}

}  // namespace wsync
