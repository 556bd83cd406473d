#include "backends/delta/apply/sparse_apply.h"

#include <gtest/gtest.h>
#include <zstd.h>

#include <cstdio>
#include <cstdlib>
#include <random>

#include "backends/delta/codec.h"

namespace wsync::delta {
namespace {

std::vector<std::byte> Random(size_t n, std::mt19937& rng) {
  std::vector<std::byte> v(n);
  for (auto& b : v) b = std::byte(rng() & 0xff);
  return v;
}

// A patch shaped like a bf16 RL step: each 2-byte element changes with probability
// `density`, mostly in its low byte by a carry chain (0x01, 0x03, 0x07, ... 0xff).
std::vector<std::byte> SparsePatch(size_t n, double density, std::mt19937& rng) {
  std::vector<std::byte> p(n);
  std::uniform_real_distribution<double> u(0, 1);
  for (size_t i = 0; i + 1 < n; i += 2) {
    if (u(rng) >= density) continue;
    int chain = 0;
    while (chain < 8 && u(rng) < 0.5) ++chain;
    p[i] = std::byte((2u << chain) - 1);
    if (chain == 8 || u(rng) < 0.02) p[i + 1] = std::byte(1u << (rng() % 8));
  }
  return p;
}

std::vector<uint8_t> Stock(const std::vector<std::byte>& patch, int level, bool checksum) {
  ZSTD_CCtx* c = ZSTD_createCCtx();
  ZSTD_CCtx_setParameter(c, ZSTD_c_compressionLevel, level);
  ZSTD_CCtx_setParameter(c, ZSTD_c_checksumFlag, checksum ? 1 : 0);
  std::vector<uint8_t> out(ZSTD_compressBound(patch.size()));
  size_t n = ZSTD_compress2(c, out.data(), out.size(), patch.data(), patch.size());
  ZSTD_freeCCtx(c);
  EXPECT_FALSE(ZSTD_isError(n));
  out.resize(n);
  return out;
}

// The frame DeltaCodec writes for `patch` (encoding old -> old ^ patch).
std::vector<uint8_t> Ours(const std::vector<std::byte>& old, const std::vector<std::byte>& patch) {
  std::vector<std::byte> next = old, snap = old;
  for (size_t i = 0; i < next.size(); ++i) next[i] ^= patch[i];
  auto codec = DeltaCodec::Create();
  auto enc = (*codec)->Encode(next, snap, DigestAlgorithm::kXxh3_128);
  EXPECT_TRUE(enc.ok());
  return enc->compressed;
}

std::vector<std::byte> Xor(std::vector<std::byte> a, const std::vector<std::byte>& b) {
  for (size_t i = 0; i < a.size(); ++i) a[i] ^= b[i];
  return a;
}

TEST(SparseApplierTest, AppliesEveryFrameDeltaCodecWritesExactly) {
  std::mt19937 rng(1);
  SparseApplier applier;
  for (size_t n : {size_t{2}, size_t{64}, size_t{4097}, size_t{131072}, size_t{300'001}, size_t{1} << 21}) {
    for (double density : {0.001, 0.04, 0.3}) {
      std::vector<std::byte> old = Random(n, rng), patch = SparsePatch(n, density, rng);
      if (std::all_of(patch.begin(), patch.end(), [](std::byte b) { return b == std::byte{0}; })) continue;
      std::vector<uint8_t> frame = Ours(old, patch);
      std::vector<std::byte> region = old;
      ASSERT_TRUE(applier.Apply(frame, region)) << n << " " << density;
      ASSERT_EQ(region, Xor(old, patch)) << n << " " << density;
    }
  }
}

TEST(SparseApplierTest, DenseAndRandomLiteralsToo) {
  // Every byte changed (raw or Huffman blocks with all 256 literal values).
  std::mt19937 rng(2);
  SparseApplier applier;
  std::vector<std::byte> old = Random(400'000, rng), patch = Random(400'000, rng);
  std::vector<uint8_t> frame = Ours(old, patch);
  std::vector<std::byte> region = old;
  ASSERT_TRUE(applier.Apply(frame, region));
  EXPECT_EQ(region, Xor(old, patch));
}

TEST(SparseApplierTest, StockFramesAreAppliedExactlyOrLeftUntouched) {
  std::mt19937 rng(3);
  SparseApplier applier;
  int applied = 0, declined = 0;
  for (int level : {1, 3, 19}) {
    for (bool checksum : {false, true}) {
      for (size_t n : {size_t{100}, size_t{70'000}, size_t{500'000}}) {
        std::vector<std::byte> old = Random(n, rng), patch = SparsePatch(n, 0.04, rng);
        std::vector<uint8_t> frame = Stock(patch, level, checksum);
        std::vector<std::byte> region = old;
        if (applier.Apply(frame, region)) {
          ++applied;
          ASSERT_EQ(region, Xor(old, patch)) << level << " " << n;
        } else {
          ++declined;
          ASSERT_EQ(region, old) << level << " " << n;
        }
      }
    }
  }
  EXPECT_GT(declined, 0);  // stock match finders copy from non-zero places
  std::cout << "stock frames: " << applied << " applied sparsely, " << declined << " declined\n";
}

TEST(SparseApplierTest, CorruptOrMisSizedFramesNeverCrashAndDeclineUntouchedOrDiffer) {
  std::mt19937 rng(4);
  SparseApplier applier;
  const size_t n = 200'000;
  std::vector<std::byte> old = Random(n, rng), patch = SparsePatch(n, 0.04, rng);
  std::vector<uint8_t> frame = Ours(old, patch);
  std::vector<std::byte> want = Xor(old, patch);
  // Single bit flips, and bursts of random bytes (half of them in the first 96 bytes:
  // frame, block and Huffman/FSE table headers), some truncated. The same loop at 20000
  // trials ran clean under AddressSanitizer and UBSan.
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<uint8_t> bad = frame;
    if (trial % 2 == 0) {
      bad[rng() % bad.size()] ^= static_cast<uint8_t>(1u << (rng() % 8));
    } else {
      int k = 1 + rng() % 8;
      for (int j = 0; j < k; ++j) {
        size_t pos = (trial % 4 == 1) ? rng() % std::min<size_t>(bad.size(), 96) : rng() % bad.size();
        bad[pos] = static_cast<uint8_t>(rng());
      }
    }
    if (trial % 3 == 0) bad.resize(rng() % bad.size());
    std::vector<std::byte> region = old;
    if (!applier.Apply(bad, region)) {
      ASSERT_EQ(region, old) << trial;
    } else {
      // Accepted: then libzstd, where it accepts the frame too, decodes the same patch.
      std::vector<std::byte> patch(n);
      size_t r = ZSTD_decompress(patch.data(), n, bad.data(), bad.size());
      ASSERT_TRUE(!ZSTD_isError(r) && r == n) << trial << ": accepted a frame libzstd rejects";
      ASSERT_EQ(region, Xor(old, patch)) << trial;
    }
  }
  std::vector<std::byte> small(n - 1);
  EXPECT_FALSE(applier.Apply(frame, small));
  std::vector<std::byte> region = old;
  ASSERT_TRUE(applier.Apply(frame, region));  // and it still works afterwards
  EXPECT_EQ(region, want);
}

// Frames RFC 8878 forbids, which libzstd rejects: SparseApplier declines each (region
// untouched) and DeltaCodec::Apply, whose fallback is libzstd, refuses it. Each is also a
// seed of delta_sparse_apply_fuzz (the differential target against libzstd).
// Whether libzstd decodes `frame` whole to exactly `size` bytes both one-shot
// (ZSTD_decompress) and streaming, fed output room in 64 KiB pieces as DeltaCodec's
// fallback does. Each takes some frames the format forbids that the other refuses:
// one-shot a raw block over 128 KiB, streaming a compressed block of 0 bytes.
bool LibzstdAccepts(const std::vector<uint8_t>& frame, size_t size) {
  std::vector<uint8_t> whole(size);
  size_t n = ZSTD_decompress(whole.data(), whole.size(), frame.data(), frame.size());
  if (ZSTD_isError(n) || n != size) return false;
  ZSTD_DCtx* d = ZSTD_createDCtx();
  std::vector<uint8_t> out(64 << 10);
  ZSTD_inBuffer in{frame.data(), frame.size(), 0};
  size_t r = 1, total = 0;
  while (r != 0) {
    ZSTD_outBuffer o{out.data(), out.size(), 0};
    size_t before_in = in.pos;
    r = ZSTD_decompressStream(d, &o, &in);
    total += o.pos;
    if (ZSTD_isError(r) || (in.pos == before_in && o.pos == 0)) break;
  }
  ZSTD_freeDCtx(d);
  return r == 0 && in.pos == in.size && total == size;
}

struct ForbiddenFrame {
  const char* what;
  std::vector<uint8_t> bytes;
  size_t region;
};

void Le(std::vector<uint8_t>& f, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) f.push_back(static_cast<uint8_t>(v >> (8 * i)));
}
void BlockHeader(std::vector<uint8_t>& f, bool last, unsigned type, uint32_t size) {
  Le(f, (size << 3) | (type << 1) | (last ? 1 : 0), 3);
}
// Magic, then a single-segment header with a 4-byte content size.
std::vector<uint8_t> SingleSegment(uint32_t content, uint8_t extra_fhd = 0) {
  std::vector<uint8_t> f;
  Le(f, 0xFD2FB528u, 4);
  f.push_back(static_cast<uint8_t>(0xA0 | extra_fhd));  // FCS 4 bytes, single segment
  Le(f, content, 4);
  return f;
}

std::vector<ForbiddenFrame> ForbiddenFrames() {
  std::vector<ForbiddenFrame> out;
  {  // a raw block over Block_Maximum_Size (128 KiB)
    const uint32_t n = (128 << 10) + 1;
    std::vector<uint8_t> f = SingleSegment(n);
    BlockHeader(f, true, 0, n);
    f.insert(f.end(), n, 0x5a);
    out.push_back({"raw block over 128 KiB", f, n});
  }
  {  // an RLE block over Block_Maximum_Size
    const uint32_t n = (128 << 10) + 1;
    std::vector<uint8_t> f = SingleSegment(n);
    BlockHeader(f, true, 1, n);
    f.push_back(0x5a);
    out.push_back({"RLE block over 128 KiB", f, n});
  }
  {  // a content checksum that does not match (the sparse decoder never holds the content)
    std::vector<uint8_t> f = SingleSegment(16, 0x04);
    BlockHeader(f, true, 0, 16);
    f.insert(f.end(), 16, 0x11);
    Le(f, 0xdeadbeef, 4);
    out.push_back({"wrong content checksum", f, 16});
  }
  {  // a window over 2^31 bytes (Window_Descriptor exponent 30: 2^40)
    std::vector<uint8_t> f;
    Le(f, 0xFD2FB528u, 4);
    f.push_back(0x80);       // FCS 4 bytes, not single segment
    f.push_back(30u << 3);   // Window_Descriptor
    Le(f, 16, 4);
    BlockHeader(f, true, 0, 16);
    f.insert(f.end(), 16, 0x11);
    out.push_back({"window over 2^31", f, 16});
  }
  {  // a window of 2^27 + 7 * 2^24 bytes: exponent 17, under the limit, and a mantissa over it
    std::vector<uint8_t> f;
    Le(f, 0xFD2FB528u, 4);
    f.push_back(0x00);                // no content size, not single segment
    f.push_back((17u << 3) | 7u);     // Window_Descriptor
    BlockHeader(f, true, 0, 16);
    f.insert(f.end(), 16, 0x11);
    out.push_back({"window over 2^27 by its mantissa", f, 16});
  }
  {  // a compressed block of 0 bytes (libzstd's streaming decoder takes it for an empty one)
    std::vector<uint8_t> f;
    Le(f, 0xFD2FB528u, 4);
    f.push_back(0x00);       // no content size, not single segment
    f.push_back(8u << 3);    // Window_Descriptor: 256 KiB
    BlockHeader(f, true, 2, 0);
    out.push_back({"compressed block of 0 bytes", f, 0});
  }
  {  // the reserved bit of Frame_Header_Descriptor
    std::vector<uint8_t> f = SingleSegment(16, 0x08);
    BlockHeader(f, true, 0, 16);
    f.insert(f.end(), 16, 0x11);
    out.push_back({"reserved bit", f, 16});
  }
  return out;
}

TEST(SparseApplierTest, FramesTheFormatForbidsAreRefusedLikeLibzstdDoes) {
  SparseApplier applier;
  auto codec = DeltaCodec::Create();
  ASSERT_TRUE(codec.ok());
  for (const ForbiddenFrame& f : ForbiddenFrames()) {
    SCOPED_TRACE(f.what);
    ASSERT_FALSE(LibzstdAccepts(f.bytes, f.region)) << "libzstd accepts it: not a forbidden frame";
    std::vector<std::byte> region(f.region, std::byte{0x33});
    EXPECT_FALSE(applier.Apply(f.bytes, region));
    EXPECT_TRUE(std::all_of(region.begin(), region.end(), [](std::byte b) { return b == std::byte{0x33}; }));
    Status s = (*codec)->Apply(f.bytes, region, DigestAlgorithm::kXxh3_128, "", f.what);
    EXPECT_FALSE(s.ok());
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
  }
}

// A single segment's window is its content size: over 2^27 bytes libzstd's streaming
// decoder (DeltaCodec's fallback) refuses the frame, so SparseApplier declines it too.
TEST(SparseApplierTest, SingleSegmentOverTheWindowLimitIsDeclined) {
  const uint32_t block = 128 << 10;
  const uint32_t size = (uint32_t{1} << 27) + block;
  std::vector<uint8_t> f = SingleSegment(size);
  for (uint32_t at = 0; at < size; at += block) {
    BlockHeader(f, at + block == size, 1, block);  // RLE blocks of 0x5a
    f.push_back(0x5a);
  }
  ASSERT_FALSE(LibzstdAccepts(f, size));
  std::vector<std::byte> region(size, std::byte{0x33});
  SparseApplier applier;
  EXPECT_FALSE(applier.Apply(f, region));
  EXPECT_TRUE(std::all_of(region.begin(), region.end(), [](std::byte b) { return b == std::byte{0x33}; }));
}

// Writes the forbidden frames and real DeltaCodec frames as seeds of the differential
// fuzz target when WSYNC_WRITE_FUZZ_SEEDS names a directory (fuzz/corpus/delta_sparse_apply_fuzz).
TEST(SparseApplierTest, WritesFuzzSeedsOnRequest) {
  const char* dir = std::getenv("WSYNC_WRITE_FUZZ_SEEDS");
  if (dir == nullptr) GTEST_SKIP() << "set WSYNC_WRITE_FUZZ_SEEDS=DIR to write seeds";
  auto write = [&](const std::string& name, const std::vector<uint8_t>& bytes) {
    FILE* f = std::fopen((std::string(dir) + "/" + name).c_str(), "wb");
    ASSERT_NE(f, nullptr);
    std::fwrite(bytes.data(), 1, bytes.size(), f);
    std::fclose(f);
  };
  int i = 0;
  for (const ForbiddenFrame& f : ForbiddenFrames()) write("forbidden-" + std::to_string(i++), f.bytes);
  std::mt19937 rng(5);
  for (size_t n : {size_t{64}, size_t{4097}, size_t{70'000}, size_t{300'001}}) {
    std::vector<std::byte> old = Random(n, rng), patch = SparsePatch(n, 0.04, rng);
    write("ours-" + std::to_string(n), Ours(old, patch));
    write("stock-" + std::to_string(n), Stock(patch, 1, false));
    write("stock-checksum-" + std::to_string(n), Stock(patch, 3, true));
  }
}

}  // namespace
}  // namespace wsync::delta
