// Prefetch: memory a hot loop will touch soon, pulled into cache one 64-byte line per
// Step() from inside another, compute-bound loop. The encoder alternates between
// memory-bound work (hash, XOR and snapshot update over a block of tensor bytes) and
// compute-bound work (entropy coding of that block); stepping a Prefetch of the NEXT
// block from the coding loops overlaps its DRAM traffic with them instead of stalling the
// memory-bound pass. Lines of `read` are fetched first, then lines of `write` (for
// writing). Results never depend on it. A value type.
//
// The decoder does not use it: prefetching the next block's region (a mapped file) for
// writing while SparseApplier decodes makes the server's apply slower (docs/benchmarks.md,
// "delta"); SparseApplier prefetches a single line a short distance ahead of each
// sequence instead (kRegionPrefetchAhead).
#pragma once

#include <cstddef>
#include <cstdint>

namespace wsync::delta {

struct Prefetch {
  const void* read = nullptr;
  size_t read_bytes = 0;
  void* write = nullptr;
  size_t write_bytes = 0;

  void Step() {
    if (read_bytes != 0) {
      __builtin_prefetch(read, 0, 3);
      read = static_cast<const uint8_t*>(read) + 64;
      read_bytes = read_bytes > 64 ? read_bytes - 64 : 0;
    } else if (write_bytes != 0) {
      __builtin_prefetch(write, 1, 3);
      write = static_cast<uint8_t*>(write) + 64;
      write_bytes = write_bytes > 64 ? write_bytes - 64 : 0;
    }
  }
};

}  // namespace wsync::delta
