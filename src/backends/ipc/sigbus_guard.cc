#include "backends/ipc/sigbus_guard.h"

#include <signal.h>
#include <sys/mman.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>

#include <fmt/format.h>

namespace wsync {
namespace {

constexpr int kMaxGuards = 64;

struct Slot {
  std::atomic<uintptr_t> base{0};  // 0: free
  std::atomic<size_t> bytes{0};
  std::atomic<bool> tripped{false};
  std::atomic<bool> taken{false};
};
Slot g_slots[kMaxGuards];
struct sigaction g_previous;
std::once_flag g_installed;
int g_install_errno = 0;

static_assert(std::atomic<uintptr_t>::is_always_lock_free && std::atomic<bool>::is_always_lock_free);

void OnSigbus(int sig, siginfo_t* info, void* context) {
  auto addr = reinterpret_cast<uintptr_t>(info->si_addr);
  for (Slot& s : g_slots) {
    uintptr_t base = s.base.load(std::memory_order_acquire);
    size_t bytes = s.bytes.load(std::memory_order_acquire);
    if (base == 0 || addr < base || addr - base >= bytes) continue;
    void* p = mmap(reinterpret_cast<void*>(base), bytes, PROT_READ | PROT_WRITE,
                   MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p != MAP_FAILED) {
      s.tripped.store(true, std::memory_order_release);
      return;  // the faulting access runs again, on zero pages
    }
  }
  if ((g_previous.sa_flags & SA_SIGINFO) != 0 && g_previous.sa_sigaction != nullptr) {
    g_previous.sa_sigaction(sig, info, context);
    return;
  }
  if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN) {
    g_previous.sa_handler(sig);
    return;
  }
  // Not ours: the default action, when the faulting access runs again.
  signal(SIGBUS, SIG_DFL);
}

}  // namespace

Result<std::unique_ptr<SigbusGuard>> SigbusGuard::Register(void* base, size_t bytes) {
  std::call_once(g_installed, [] {
    struct sigaction sa {};
    sa.sa_sigaction = OnSigbus;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, &g_previous) != 0) g_install_errno = errno;
  });
  if (g_install_errno != 0) {
    return Internal(fmt::format("installing the SIGBUS handler for shared mappings: {}", std::strerror(g_install_errno)));
  }
  for (int i = 0; i < kMaxGuards; ++i) {
    bool expected = false;
    if (!g_slots[i].taken.compare_exchange_strong(expected, true)) continue;
    g_slots[i].tripped.store(false);
    g_slots[i].bytes.store(bytes, std::memory_order_release);
    g_slots[i].base.store(reinterpret_cast<uintptr_t>(base), std::memory_order_release);
    return std::unique_ptr<SigbusGuard>(new SigbusGuard(i));
  }
  return Unavailable(fmt::format("more than {} guarded shared mappings at once", kMaxGuards));
}

SigbusGuard::~SigbusGuard() {
  g_slots[slot_].base.store(0, std::memory_order_release);
  g_slots[slot_].bytes.store(0, std::memory_order_release);
  g_slots[slot_].taken.store(false, std::memory_order_release);
}

bool SigbusGuard::tripped() const { return g_slots[slot_].tripped.load(std::memory_order_acquire); }

}  // namespace wsync
