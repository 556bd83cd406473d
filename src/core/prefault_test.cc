#include "core/prefault.h"

#include <unistd.h>

#include <cstring>

#include <gtest/gtest.h>

#include "wsync/tensor.h"

namespace wsync {
namespace {

long Pages(size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return static_cast<long>((bytes + page - 1) / page);
}

TEST(Prefault, MakesEveryPageResidentAndKeepsTheBytes) {
  for (size_t bytes : {size_t{2}, size_t{3} << 12, size_t{5} << 20, (size_t{130} << 20) + 123}) {
    SCOPED_TRACE(bytes);
    auto buf = HostBuffer::Allocate(bytes);
    ASSERT_TRUE(buf.ok()) << buf.status().ToString();
    // Written before: the first and last bytes; never written: everything between.
    buf->data()[0] = std::byte{0x11};
    buf->data()[bytes - 1] = std::byte{0x22};
    Prefault(buf->span(), 3);
    EXPECT_EQ(ResidentPages(buf->span()), Pages(bytes));
    EXPECT_EQ(buf->data()[0], std::byte{0x11});
    EXPECT_EQ(buf->data()[bytes - 1], std::byte{0x22});
    for (size_t i = 1; i + 1 < bytes; i += 4093) ASSERT_EQ(buf->data()[i], std::byte{0}) << i;
  }
}

TEST(Prefault, AnUnalignedSpanCoversThePagesItTouches) {
  auto buf = HostBuffer::Allocate(size_t{64} << 12);
  ASSERT_TRUE(buf.ok());
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  // From the middle of page 3 to the middle of page 7: pages 3..7.
  std::span<std::byte> part = buf->span().subspan(3 * page + page / 2, 4 * page);
  Prefault(part);
  EXPECT_EQ(ResidentPages(part), 5);
  EXPECT_EQ(ResidentPages(buf->span().subspan(20 * page, 10 * page)), 0);
}

TEST(Prefault, EmptySpansAreNoOps) {
  Prefault({});
  EXPECT_EQ(ResidentPages({}), 0);
}

}  // namespace
}  // namespace wsync
