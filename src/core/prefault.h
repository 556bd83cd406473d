// Prefault: makes freshly mapped host memory resident before the hot path needs it.
//
// Anonymous memory costs nothing until it is first written; then every page is a fault
// that allocates and zeroes it (and, in a VM, may fault on the host as well: see
// prefault.cc). Buffers
// that a sync fills (worker shards, chunk staging buffers) are prefaulted where they are
// allocated, at server start or Init, so that the first sync moves bytes at the same
// speed as every later one. Memory stays resident as long as its mapping lives.
//
// Thread-safe: callers prefault disjoint ranges; the calls block until every page is
// resident (or the kernel refuses: then the pages are touched one by one instead).
#pragma once

#include <cstddef>
#include <span>

namespace wsync {

// Makes every page of `bytes` resident and written once, without changing its contents
// (MADV_POPULATE_WRITE where the kernel has it, then a read-and-write of one byte per
// page). Runs on up to `threads` threads, in 64 MiB ranges, for large spans.
void Prefault(std::span<std::byte> bytes, size_t threads = 1);

// The number of pages of `bytes` that are resident in memory (mincore), for tests and
// diagnostics; -1 if the kernel cannot say.
long ResidentPages(std::span<const std::byte> bytes);

}  // namespace wsync
