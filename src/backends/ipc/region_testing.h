// Test helper: writes words of an ipc region's header in place, as a hostile or broken
// trainer may rewrite them in shared memory after IpcRegion::Create (a real trainer never
// writes these words again). Offsets are those of IpcRegion::Header. Tests only.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include "backends/ipc/region.h"

namespace wsync::ipc_testing {

constexpr off_t kNumSlotsAt = 12, kSlotStrideAt = 24, kHeaderBytesAt = 32, kTotalBytesAt = 40;

// Writes `value` at byte `at` of the region's file (gtest ASSERTs on failure).
template <typename T>
void Poke(const IpcRegion& region, off_t at, T value) {
  int fd = open(region.path().c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0) << region.path();
  ASSERT_EQ(pwrite(fd, &value, sizeof(value), at), static_cast<ssize_t>(sizeof(value)));
  close(fd);
}

}  // namespace wsync::ipc_testing
