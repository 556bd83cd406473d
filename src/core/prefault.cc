#include "core/prefault.h"

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <vector>

#include "core/parallel.h"

namespace wsync {
namespace {

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14 and later
#endif

size_t PageSize() {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return page;
}

// Page-aligned bounds of the pages `bytes` overlaps.
std::span<std::byte> PageSpan(std::span<std::byte> bytes) {
  const uintptr_t page = PageSize();
  const uintptr_t begin = reinterpret_cast<uintptr_t>(bytes.data()) & ~(page - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(bytes.data()) + bytes.size() + page - 1) & ~(page - 1);
  return {reinterpret_cast<std::byte*>(begin), end - begin};
}

// Writes back the byte it reads at the start of every page: a write that keeps the
// contents.
void TouchPages(std::span<std::byte> pages) {
  for (size_t off = 0; off < pages.size(); off += PageSize()) {
    auto* p = reinterpret_cast<volatile unsigned char*>(pages.data() + off);
    *p = *p;
  }
}

// MADV_POPULATE_WRITE allocates the pages in bulk (huge pages where the mapping asks for
// them), but a page it maps may still cost its first write: a guest kernel may skip
// zeroing pages the hypervisor hands over zeroed, and the hypervisor then backs each one
// on its first write. So every page is written once as well.
void PrefaultRange(std::span<std::byte> pages) {
  static std::atomic<bool> populate_works{true};
  if (populate_works.load(std::memory_order_relaxed) &&
      madvise(pages.data(), pages.size(), MADV_POPULATE_WRITE) != 0) {
    // ENOMEM and the like: touching would not fare better; the pages fault in on use.
    if (errno != EINVAL && errno != EINTR) return;
    if (errno == EINVAL) populate_works.store(false, std::memory_order_relaxed);
  }
  TouchPages(pages);
}

}  // namespace

void Prefault(std::span<std::byte> bytes, size_t threads) {
  if (bytes.empty()) return;
  const std::span<std::byte> pages = PageSpan(bytes);
  constexpr size_t kRange = size_t{64} << 20;
  const size_t ranges = (pages.size() + kRange - 1) / kRange;
  ParallelFor(ranges, threads, [&](size_t begin, size_t end) {
    for (size_t r = begin; r < end; ++r) {
      const size_t off = r * kRange;
      PrefaultRange(pages.subspan(off, std::min(kRange, pages.size() - off)));
    }
  });
}

long ResidentPages(std::span<const std::byte> bytes) {
  if (bytes.empty()) return 0;
  const std::span<std::byte> pages = PageSpan({const_cast<std::byte*>(bytes.data()), bytes.size()});
  std::vector<unsigned char> vec(pages.size() / PageSize());
  if (mincore(pages.data(), pages.size(), vec.data()) != 0) return -1;
  long n = 0;
  for (unsigned char v : vec) n += v & 1;
  return n;
}

}  // namespace wsync
