#include "backends/delta/codec.h"

#include <gtest/gtest.h>
#include <zstd.h>

#include <algorithm>
#include <random>

namespace wsync::delta {
namespace {

std::vector<std::byte> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::byte> v(n);
  for (auto& b : v) b = std::byte(rng() & 0xff);
  return v;
}

// `base` with every `stride`-th byte (starting at `first`) flipped.
std::vector<std::byte> Changed(std::vector<std::byte> base, size_t first, size_t stride) {
  for (size_t i = first; i < base.size(); i += stride) base[i] ^= std::byte{0x5a};
  return base;
}

// Every test runs twice: Apply() through SparseApplier, and through libzstd alone.
class DeltaCodecTest : public ::testing::TestWithParam<bool> {};

std::unique_ptr<DeltaCodec> NewCodec(size_t block = kDefaultBlockBytes) {
  auto c = DeltaCodec::Create(block, DeltaCodecTest::GetParam());
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return std::move(*c);
}

TEST_P(DeltaCodecTest, EncodeThenApplyRoundTripsAndUpdatesTheSnapshot) {
  for (size_t n : {size_t{1}, size_t{13}, size_t{4096}, size_t{1} << 20, (size_t{1} << 20) + 7}) {
    auto codec = NewCodec(4096);
    std::vector<std::byte> old = RandomBytes(n, 1), next = Changed(old, 0, 37);
    std::vector<std::byte> snap = old;
    auto enc = codec->Encode(next, snap, DigestAlgorithm::kXxh3_128);
    ASSERT_TRUE(enc.ok()) << enc.status().ToString();
    EXPECT_TRUE(enc->changed);
    EXPECT_EQ(enc->changed_bytes, (n + 36) / 37);
    EXPECT_EQ(snap, next);
    EXPECT_EQ(enc->checksum, HexDigest(DigestAlgorithm::kXxh3_128, next));
    std::vector<std::byte> region = old;
    Status s = codec->Apply(enc->compressed, region, DigestAlgorithm::kXxh3_128, enc->checksum, "t");
    ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_EQ(region, next) << n;
  }
}

TEST_P(DeltaCodecTest, FrameIsOneStandardZstdFrameOfTheXorWithItsContentSize) {
  auto codec = NewCodec();
  const size_t n = 300'000;
  std::vector<std::byte> old = RandomBytes(n, 2), next = Changed(old, 5, 101), snap = old;
  auto enc = codec->Encode(next, snap, DigestAlgorithm::kXxh3_128);
  ASSERT_TRUE(enc.ok());
  EXPECT_EQ(ZSTD_getFrameContentSize(enc->compressed.data(), enc->compressed.size()), n);
  EXPECT_EQ(ZSTD_findFrameCompressedSize(enc->compressed.data(), enc->compressed.size()), enc->compressed.size());
  std::vector<std::byte> patch(n);
  ASSERT_EQ(ZSTD_decompress(patch.data(), n, enc->compressed.data(), enc->compressed.size()), n);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(patch[i], old[i] ^ next[i]) << i;
  EXPECT_LT(enc->compressed.size(), n / 10);
}

// A large tensor's parts, encoded apart (by two codecs, as two threads would) and joined,
// make one standard frame that libzstd and SparseApplier both read bit-exactly, about as
// small as the frame of the whole tensor. Part boundaries need not fall on blocks.
TEST_P(DeltaCodecTest, PartsEncodedApartJoinIntoOneFrameThatEveryDecoderReads) {
  const size_t n = (size_t{1} << 20) + 4099;
  std::vector<std::byte> old = RandomBytes(n, 9), next = Changed(old, 3, 29);
  std::copy(old.begin() + 300'000, old.begin() + 520'000, next.begin() + 300'000);  // unchanged parts too
  std::vector<std::byte> whole_snap = old;
  auto whole = NewCodec()->Encode(next, whole_snap, DigestAlgorithm::kXxh3_128);
  ASSERT_TRUE(whole.ok());
  std::unique_ptr<DeltaCodec> codecs[2] = {NewCodec(), NewCodec()};
  for (size_t part : {size_t{65536}, size_t{200'000}, size_t{1} << 20}) {
    std::vector<std::byte> snap = old;
    std::vector<EncodedPart> parts;
    uint64_t changed = 0;
    for (size_t off = 0; off < n; off += part) {
      size_t len = std::min(part, n - off);
      parts.push_back(codecs[parts.size() % 2]->EncodePart(std::span(next).subspan(off, len),
                                                          std::span(snap).subspan(off, len), off + len == n));
      changed += parts.back().changed_bytes;
    }
    EXPECT_EQ(snap, next) << part;
    EXPECT_EQ(changed, whole->changed_bytes) << part;
    std::vector<uint8_t> frame = DeltaCodec::JoinParts(n, parts);
    EXPECT_EQ(ZSTD_findFrameCompressedSize(frame.data(), frame.size()), frame.size()) << part;
    std::vector<std::byte> patch(n);
    ASSERT_EQ(ZSTD_decompress(patch.data(), n, frame.data(), frame.size()), n) << part;
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(patch[i], old[i] ^ next[i]) << part << " byte " << i;
    std::vector<std::byte> region = old;
    Status s = codecs[0]->Apply(frame, region, DigestAlgorithm::kXxh3_128, whole->checksum, "t");
    ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_EQ(region, next) << part;
    if (GetParam()) {
      EXPECT_EQ(codecs[0]->libzstd_frames(), 0u) << "SparseApplier declined a joined frame";
    }
    // Each part writes its own tables: a few hundred bytes per part.
    EXPECT_LT(frame.size(), whole->compressed.size() + 600 * parts.size()) << part;
  }
  // Every part unchanged: no frame, as for a whole unchanged tensor.
  std::vector<std::byte> snap = next;
  std::vector<EncodedPart> parts = {codecs[0]->EncodePart(std::span(next).first(n / 2), std::span(snap).first(n / 2), false),
                                    codecs[1]->EncodePart(std::span(next).subspan(n / 2), std::span(snap).subspan(n / 2), true)};
  EXPECT_TRUE(DeltaCodec::JoinParts(n, parts).empty());
}

TEST_P(DeltaCodecTest, UnchangedTensorHasNoFrameButStillAChecksum) {
  auto codec = NewCodec();
  std::vector<std::byte> old = RandomBytes(200'000, 3), snap = old;
  auto enc = codec->Encode(old, snap, DigestAlgorithm::kXxh3_128);
  ASSERT_TRUE(enc.ok());
  EXPECT_FALSE(enc->changed);
  EXPECT_TRUE(enc->compressed.empty());
  EXPECT_EQ(enc->changed_bytes, 0u);
  EXPECT_EQ(enc->checksum, HexDigest(DigestAlgorithm::kXxh3_128, old));
}

TEST_P(DeltaCodecTest, ChangeOnlyInTheLastBlockKeepsTheLeadingZeros) {
  auto codec = NewCodec(4096);
  const size_t n = 4096 * 50 + 100;
  std::vector<std::byte> old = RandomBytes(n, 4), next = old, snap = old;
  next[n - 1] ^= std::byte{1};
  auto enc = codec->Encode(next, snap, DigestAlgorithm::kSha256);
  ASSERT_TRUE(enc.ok());
  EXPECT_EQ(enc->changed_bytes, 1u);
  std::vector<std::byte> region = old;
  ASSERT_TRUE(codec->Apply(enc->compressed, region, DigestAlgorithm::kSha256, enc->checksum, "t").ok());
  EXPECT_EQ(region, next);
}

TEST_P(DeltaCodecTest, CorruptTruncatedOrMisSizedPatchesAreDataLoss) {
  auto codec = NewCodec();
  const size_t n = 100'000;
  std::vector<std::byte> old = RandomBytes(n, 5), next = Changed(old, 0, 9), snap = old;
  auto enc = codec->Encode(next, snap, DigestAlgorithm::kXxh3_128);
  ASSERT_TRUE(enc.ok());
  for (size_t at : {enc->compressed.size() / 2, enc->compressed.size() - 5}) {
    std::vector<uint8_t> bad = enc->compressed;
    bad[at] ^= 0x10;
    std::vector<std::byte> region = old;
    Status s = codec->Apply(bad, region, DigestAlgorithm::kXxh3_128, enc->checksum, "layer.w");
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << at << ": " << s.ToString();
    EXPECT_NE(s.message().find("layer.w"), std::string::npos) << s.message();
  }
  std::vector<uint8_t> cut(enc->compressed.begin(), enc->compressed.end() - 10);
  std::vector<std::byte> region = old;
  EXPECT_EQ(codec->Apply(cut, region, DigestAlgorithm::kXxh3_128, enc->checksum, "t").code(), StatusCode::kDataLoss);
  std::vector<std::byte> small(n - 1);
  EXPECT_EQ(codec->Apply(enc->compressed, small, DigestAlgorithm::kXxh3_128, enc->checksum, "t").code(),
            StatusCode::kDataLoss);
  region = old;
  EXPECT_EQ(codec->Apply(enc->compressed, region, DigestAlgorithm::kXxh3_128, std::string(32, '0'), "t").code(),
            StatusCode::kDataLoss);
  // An empty expected checksum skips verification (the publisher's rollback).
  region = next;
  ASSERT_TRUE(codec->Apply(enc->compressed, region, DigestAlgorithm::kXxh3_128, "", "t").ok());
  EXPECT_EQ(region, old);
}

TEST_P(DeltaCodecTest, DenseAndRunHeavyPatchesRoundTrip) {
  // Every byte changed (an f32 tensor after a real step), runs of exactly 3 and 4 zeros
  // (the producer's literal/match boundary), and zeros across block boundaries.
  auto codec = NewCodec(4096);
  const size_t n = 3 * 131072 + 333;
  std::vector<std::byte> old = RandomBytes(n, 8);
  std::vector<std::vector<std::byte>> nexts;
  std::vector<std::byte> dense = old;
  for (auto& b : dense) b ^= std::byte{0xa5};
  nexts.push_back(dense);
  for (size_t gap : {3, 4, 5, 131071}) {
    std::vector<std::byte> next = old;
    for (size_t i = 0; i < n; i += gap + 1) next[i] ^= std::byte{0x80};
    nexts.push_back(next);
  }
  for (const auto& next : nexts) {
    std::vector<std::byte> snap = old, region = old;
    auto enc = codec->Encode(next, snap, DigestAlgorithm::kXxh3_128);
    ASSERT_TRUE(enc.ok()) << enc.status().ToString();
    std::vector<std::byte> patch(n);
    ASSERT_EQ(ZSTD_decompress(patch.data(), n, enc->compressed.data(), enc->compressed.size()), n);
    ASSERT_TRUE(codec->Apply(enc->compressed, region, DigestAlgorithm::kXxh3_128, enc->checksum, "t").ok());
    EXPECT_EQ(region, next);
  }
}

TEST_P(DeltaCodecTest, MismatchedSizesAreRefused) {
  auto codec = NewCodec();
  std::vector<std::byte> a(10), b(11);
  EXPECT_EQ(codec->Encode(a, b, DigestAlgorithm::kXxh3_128).status().code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(DeltaCodec::Create(0).ok());
}

TEST(DeltaCodecIsaTest, BaselineAndAvx2LoopsWriteTheSameFrames) {
  for (size_t n : {size_t{1}, size_t{100}, size_t{65536 + 17}, size_t{1} << 20}) {
    std::vector<std::byte> old = RandomBytes(n, 9), next = Changed(old, 3, 29);
    std::vector<std::vector<uint8_t>> frames;
    for (bool baseline : {false, true}) {
      zstd::UseBaselineIsaForTesting(baseline);
      auto codec = DeltaCodec::Create();
      ASSERT_TRUE(codec.ok());
      std::vector<std::byte> snap = old;
      auto enc = (*codec)->Encode(next, snap, DigestAlgorithm::kXxh3_128);
      ASSERT_TRUE(enc.ok());
      EXPECT_EQ(snap, next);
      EXPECT_EQ(enc->changed_bytes, (n - 3 + 28) / 29);
      frames.push_back(enc->compressed);
    }
    zstd::UseBaselineIsaForTesting(false);
    EXPECT_EQ(frames[0], frames[1]) << n;
  }
}

TEST(DeltaCodecXorTest, XorIntoHandlesTails) {
  std::vector<std::byte> a = RandomBytes(21, 6), b = RandomBytes(21, 7), c = a;
  XorInto(c, b);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(c[i], a[i] ^ b[i]);
}

INSTANTIATE_TEST_SUITE_P(ApplyPaths, DeltaCodecTest, ::testing::Values(true, false),
                         [](const auto& info) { return info.param ? "Sparse" : "Libzstd"; });

}  // namespace
}  // namespace wsync::delta
