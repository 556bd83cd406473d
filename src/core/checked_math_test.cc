#include "core/checked_math.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>

namespace wsync {
namespace {

constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();

TEST(CheckedMath, AddAndSubRefuseWhatDoesNotFit) {
  EXPECT_EQ(CheckedAdd(uint64_t{1}, uint64_t{2}), 3u);
  EXPECT_EQ(CheckedAdd(kMax, 1), std::nullopt);
  EXPECT_EQ(CheckedAdd(kMax - 1, 1), kMax);
  EXPECT_EQ(CheckedSub(uint64_t{1}, uint64_t{2}), std::nullopt);
  EXPECT_EQ(CheckedSub<int64_t>(uint64_t{1}, uint64_t{2}), -1);
  EXPECT_EQ(CheckedAdd<int>(std::numeric_limits<int>::max(), 1), std::nullopt);
}

TEST(CheckedMath, MulAddOfAStrideNearTwoToThe62Overflows) {
  const uint64_t stride = uint64_t{1} << 62;
  EXPECT_EQ(CheckedMul(stride, 3), 3 * stride);
  EXPECT_EQ(CheckedMul(stride, 4), std::nullopt);  // wraps to 0 unchecked
  EXPECT_EQ(CheckedMulAdd(stride, 4, 4096), std::nullopt);
  EXPECT_EQ(CheckedMulAdd(stride, 3, stride), std::nullopt);
  EXPECT_EQ(CheckedMulAdd(uint64_t{2} << 20, 2, 4096), (uint64_t{4} << 20) + 4096);
  EXPECT_EQ(CheckedMul(uint64_t{1} << 32, uint64_t{1} << 32), std::nullopt);
  EXPECT_EQ(CheckedMul<int64_t>(int64_t{-1}, std::numeric_limits<int64_t>::min()), std::nullopt);
}

TEST(CheckedMath, CastIsExact) {
  EXPECT_EQ(CheckedCast<int>(uint64_t{4294967297}), std::nullopt);  // not 1
  EXPECT_EQ(CheckedCast<int>(int64_t{-7}), -7);
  EXPECT_EQ(CheckedCast<uint32_t>(int64_t{-7}), std::nullopt);
  EXPECT_EQ(CheckedCast<uint8_t>(255), 255);
  EXPECT_EQ(CheckedCast<uint8_t>(256), std::nullopt);
}

TEST(CheckedMath, RangeWithinNeverWraps) {
  EXPECT_TRUE(RangeWithin(0, 10, 10));
  EXPECT_TRUE(RangeWithin(10, 0, 10));
  EXPECT_FALSE(RangeWithin(11, 0, 10));
  EXPECT_FALSE(RangeWithin(1, 10, 10));
  EXPECT_FALSE(RangeWithin(8, kMax, 10));  // 8 + kMax wraps to 7
  EXPECT_FALSE(RangeWithin(kMax, 2, kMax));
  static_assert(RangeWithin(4096, 4096, 8192));
}

}  // namespace
}  // namespace wsync
