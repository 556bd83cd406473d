// core/xxh3_lanes.h against libxxhash: every length class of the short paths, the warp's
// long-input schedule across block and stripe boundaries, and loads at every alignment
// (the device kernel reads segments that start anywhere).
#include "core/xxh3_lanes.h"

#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>
#include <xxhash.h>

#include "core/digest.h"

namespace wsync {
namespace {

// The schedule with every read checked to lie inside the input (the device kernel may
// not read a word past a span's end).
xxh3::Hash128 Lanes(const unsigned char* data, uint64_t len, const xxh3::Secret& secret) {
  auto load = [&](uint64_t at) {
    EXPECT_LE(at + 8, len) << "a word read past the input";
    uint64_t v;
    std::memcpy(&v, data + at, 8);
    return v;
  };
  auto byte = [&](uint64_t at) {
    EXPECT_LT(at, len);
    return data[at];
  };
  if (len <= xxh3::kMidSizeMax) return xxh3::Short(load, byte, len, secret);
  return xxh3::LongByLanes(load, len, secret);
}

std::vector<unsigned char> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<unsigned char> v(n);
  for (auto& b : v) b = static_cast<unsigned char>(rng());
  return v;
}

void ExpectSame(const unsigned char* data, uint64_t len, const xxh3::Secret& secret) {
  const XXH128_hash_t want = XXH3_128bits(data, len);
  const xxh3::Hash128 got = Lanes(data, len, secret);
  ASSERT_EQ(got.low, want.low64) << "length " << len;
  ASSERT_EQ(got.high, want.high64) << "length " << len;
}

TEST(Xxh3Lanes, DefaultSecretIsLibxxhashs) {
  // The first and last words of the published default secret.
  const xxh3::Secret s = Xxh3DefaultSecret();
  EXPECT_EQ(s.Word(0), 0xbe4ba423396cfeb8ULL);
  EXPECT_EQ(s.Word(184), 0x7e404bbbcafbd7afULL);
}

TEST(Xxh3Lanes, EveryLengthUpToSixBlocksMatchesLibxxhash) {
  const xxh3::Secret secret = Xxh3DefaultSecret();
  const std::vector<unsigned char> data = RandomBytes(6 * 1024 + 70, 7);
  for (uint64_t len = 0; len <= data.size(); ++len) ExpectSame(data.data(), len, secret);
}

TEST(Xxh3Lanes, EveryAlignmentMatchesLibxxhash) {
  const xxh3::Secret secret = Xxh3DefaultSecret();
  const std::vector<unsigned char> data = RandomBytes(5000, 11);
  for (size_t shift = 0; shift < 8; ++shift) {
    for (uint64_t len : {0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1024, 1025, 2049, 4900}) {
      ExpectSame(data.data() + shift, len, secret);
    }
  }
}

TEST(Xxh3Lanes, LongInputsAtBlockEdgesMatchLibxxhash) {
  const xxh3::Secret secret = Xxh3DefaultSecret();
  const std::vector<unsigned char> data = RandomBytes((size_t{3} << 20) + 4096, 13);
  for (uint64_t blocks : {uint64_t{1000}, uint64_t{3072}}) {
    for (int64_t d : {-65, -64, -63, -1, 0, 1, 63, 64, 65}) ExpectSame(data.data(), blocks * 1024 + d, secret);
  }
  ExpectSame(data.data(), data.size(), secret);
}

TEST(Xxh3Lanes, ByLanesIsTheCheckedSchedule) {
  const std::vector<unsigned char> data = RandomBytes(5000, 19);
  for (uint64_t len : {0, 5, 100, 240, 241, 4999}) {
    const xxh3::Hash128 h = Xxh3ByLanes(std::span(reinterpret_cast<const std::byte*>(data.data()), len));
    const xxh3::Hash128 want = Lanes(data.data(), len, Xxh3DefaultSecret());
    EXPECT_EQ(h.low, want.low) << len;
    EXPECT_EQ(h.high, want.high) << len;
  }
}

TEST(Xxh3Lanes, HexIsTheHashersCanonicalForm) {
  const std::vector<unsigned char> data = RandomBytes(3000, 17);
  const xxh3::Hash128 h = Lanes(data.data(), data.size(), Xxh3DefaultSecret());
  EXPECT_EQ(Xxh3Hex(h), HexDigest(DigestAlgorithm::kXxh3_128,
                                  std::span(reinterpret_cast<const std::byte*>(data.data()), data.size())));
}

}  // namespace
}  // namespace wsync
