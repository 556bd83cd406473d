#include "backends/ipc/sigbus_guard.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>

namespace wsync {
namespace {

constexpr size_t kBytes = 64 << 10;

// An unsealed memfd of kBytes, mapped shared; the caller unmaps it.
std::byte* MapFile(int* fd) {
  *fd = memfd_create("sigbus-guard-test", MFD_CLOEXEC);
  if (*fd < 0 || ftruncate(*fd, kBytes) != 0) return nullptr;
  void* p = mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, *fd, 0);
  return p == MAP_FAILED ? nullptr : static_cast<std::byte*>(p);
}

TEST(SigbusGuard, AReadPastATruncatedFileSeesZerosAndTripsTheGuard) {
  int fd = -1;
  std::byte* base = MapFile(&fd);
  ASSERT_NE(base, nullptr);
  base[kBytes - 1] = std::byte{7};
  auto guard = SigbusGuard::Register(base, kBytes);
  ASSERT_TRUE(guard.ok()) << guard.status().ToString();
  EXPECT_FALSE((*guard)->tripped());
  EXPECT_EQ(base[kBytes - 1], std::byte{7});
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  volatile std::byte* past = base + kBytes - 1;
  std::byte got = *past;  // SIGBUS without the guard
  EXPECT_EQ(got, std::byte{0});
  EXPECT_TRUE((*guard)->tripped());
  guard->reset();
  munmap(base, kBytes);
  close(fd);
}

TEST(SigbusGuardDeathTest, ASigbusOutsideEveryGuardStillEndsTheProcess) {
  int fd = -1;
  std::byte* base = MapFile(&fd);
  ASSERT_NE(base, nullptr);
  int other = -1;
  std::byte* guarded = MapFile(&other);
  auto guard = SigbusGuard::Register(guarded, kBytes);  // installs the handler
  ASSERT_TRUE(guard.ok());
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  EXPECT_DEATH(
      {
        volatile std::byte* past = base + kBytes - 1;
        (void)*past;
      },
      "");
  guard->reset();
  munmap(guarded, kBytes);
  munmap(base, kBytes);
  close(fd);
  close(other);
}

TEST(SigbusGuard, SlotsAreReusedOnceReleased) {
  int fd = -1;
  std::byte* base = MapFile(&fd);
  ASSERT_NE(base, nullptr);
  for (int i = 0; i < 200; ++i) {  // more than the 64 slots, one at a time
    auto guard = SigbusGuard::Register(base, kBytes);
    ASSERT_TRUE(guard.ok()) << i << ": " << guard.status().ToString();
  }
  munmap(base, kBytes);
  close(fd);
}

}  // namespace
}  // namespace wsync
