#include "backends/delta/zstd_writer.h"

#include <gtest/gtest.h>
#include <unistd.h>
#include <zstd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>

#include "backends/delta/apply/sparse_apply.h"
#include "backends/delta/apply/zstd_decode.h"

namespace wsync::delta::zstd {
namespace {

// A frame of `patch` written in blocks of `block` bytes (all-zero blocks as RLE).
std::vector<uint8_t> Frame(const std::vector<uint8_t>& patch, size_t block = kMaxBlock) {
  FrameWriter w;
  std::vector<uint8_t> out;
  size_t used = 0;
  w.Begin(patch.size(), &out, &used);
  std::vector<uint8_t> padded(block + 64);
  for (size_t off = 0; off < patch.size() || off == 0; off += block) {
    size_t n = std::min(block, patch.size() - off);
    bool last = off + n == patch.size();
    bool zero = std::all_of(patch.begin() + off, patch.begin() + off + n, [](uint8_t b) { return b == 0; });
    if (zero) {
      w.AddZeros(n, last);
    } else {
      std::memcpy(padded.data(), patch.data() + off, n);
      w.AddBlock(padded.data(), n, last);
    }
    if (last) break;
  }
  out.resize(used);
  return out;
}

// A patch shaped like a bf16 RL step: each 2-byte element changes with probability
// `density`, mostly in its low byte by a carry chain (0x01, 0x03, ... 0xff).
std::vector<uint8_t> SparsePatch(size_t n, double density, std::mt19937& rng) {
  std::vector<uint8_t> p(n);
  std::uniform_real_distribution<double> u(0, 1);
  for (size_t i = 0; i + 1 < n; i += 2) {
    if (u(rng) >= density) continue;
    int chain = 0;
    while (chain < 8 && u(rng) < 0.5) ++chain;
    p[i] = static_cast<uint8_t>((2u << chain) - 1);
    if (chain == 8 || u(rng) < 0.02) p[i + 1] = static_cast<uint8_t>(1u << (rng() % 8));
  }
  return p;
}

std::vector<std::vector<uint8_t>> Patches() {
  std::mt19937 rng(11);
  std::vector<std::vector<uint8_t>> v;
  for (size_t n : {size_t{1}, size_t{5}, size_t{64}, size_t{1000}, size_t{4097}, size_t{131072}, size_t{300'001}}) {
    for (double d : {0.0005, 0.04, 0.3, 1.0}) v.push_back(SparsePatch(n, d, rng));
  }
  std::vector<uint8_t> dense(200'000);
  for (auto& b : dense) b = static_cast<uint8_t>(rng());
  v.push_back(dense);
  for (size_t gap : {1, 2, 3, 4, 5, 200'000}) {  // runs around the 4-byte match minimum
    std::vector<uint8_t> p(300'000);
    for (size_t i = 0; i < p.size(); i += gap + 1) p[i] = static_cast<uint8_t>(1 + rng() % 255);
    v.push_back(p);
  }
  std::vector<uint8_t> one(500'000);
  one[499'999] = 7;
  v.push_back(one);
  // A sparse start then a dense tail (tables built on few sequences are rebuilt later).
  std::vector<uint8_t> mixed = SparsePatch(600'000, 0.3, rng);
  for (size_t i = 0; i < 131072; ++i) mixed[i] = i == 1000 ? 3 : 0;
  v.push_back(mixed);
  // Every byte value, skewed counts (code lengths beyond 11 bits must be flattened).
  std::vector<uint8_t> skew(400'000);
  for (size_t i = 0; i < skew.size(); i += 5) skew[i] = static_cast<uint8_t>(std::min<int>(255, std::countr_zero(static_cast<uint32_t>(rng())) * 16 + 1));
  v.push_back(skew);
  return v;
}

// Runs with the scan the CPU picks, then with the baseline x86-64 one.
class FrameWriterIsaTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override { UseBaselineIsaForTesting(GetParam()); }
  void TearDown() override { UseBaselineIsaForTesting(false); }
};

TEST_P(FrameWriterIsaTest, FramesDecodeBitExactlyWithLibzstdAndSparseApplier) {
  SparseApplier applier;
  ZSTD_DCtx* d = ZSTD_createDCtx();
  ZSTD_DCtx_setParameter(d, ZSTD_d_windowLogMax, 17);  // the frame asks for no more
  int k = 0;
  for (const auto& patch : Patches()) {
    for (size_t block : {kMaxBlock, size_t{4096}, size_t{1000}}) {
      std::vector<uint8_t> frame = Frame(patch, block);
      ASSERT_EQ(ZSTD_getFrameContentSize(frame.data(), frame.size()), patch.size());
      std::vector<uint8_t> out(patch.size() + 1);
      size_t r = ZSTD_decompress(out.data(), out.size(), frame.data(), frame.size());
      ASSERT_FALSE(ZSTD_isError(r)) << k << " " << block << ": " << ZSTD_getErrorName(r);
      ASSERT_EQ(r, patch.size());
      out.resize(r);
      ASSERT_EQ(out, patch) << k << " " << block;
      // Streaming, with a 128 KiB window limit.
      std::vector<uint8_t> streamed(patch.size());
      ZSTD_DCtx_reset(d, ZSTD_reset_session_only);
      ZSTD_inBuffer in{frame.data(), frame.size(), 0};
      ZSTD_outBuffer o{streamed.data(), streamed.size(), 0};
      r = ZSTD_decompressStream(d, &o, &in);
      ASSERT_EQ(r, 0u) << k << ": " << (ZSTD_isError(r) ? ZSTD_getErrorName(r) : "more input wanted");
      ASSERT_EQ(streamed, patch);
      std::vector<std::byte> region(patch.size(), std::byte{0x5c});
      ASSERT_TRUE(applier.Apply(frame, region)) << k << " " << block;
      for (size_t i = 0; i < patch.size(); ++i) ASSERT_EQ(region[i], std::byte(0x5c ^ patch[i])) << k << " " << i;
    }
    ++k;
  }
  ZSTD_freeDCtx(d);
}

INSTANTIATE_TEST_SUITE_P(Scan, FrameWriterIsaTest, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "Baseline" : "Native"; });

TEST(FrameWriterTest, SparsePatchesCompressLikeBf16Steps) {
  std::mt19937 rng(5);
  std::vector<uint8_t> patch = SparsePatch(size_t{4} << 20, 0.04, rng);
  std::vector<uint8_t> frame = Frame(patch);
  double ratio = static_cast<double>(frame.size()) / patch.size();
  std::cout << "4 MiB patch at 4% density: " << 100 * ratio << "% (stock zstd -1: "
            << 100.0 * ZSTD_compress(std::vector<uint8_t>(ZSTD_compressBound(patch.size())).data(),
                                     ZSTD_compressBound(patch.size()), patch.data(), patch.size(), 1) /
                   patch.size()
            << "%)\n";
  EXPECT_LT(ratio, 0.05);
}

TEST(FrameWriterTest, ZstdCliDecodesTheFrames) {
  if (std::system("zstd --version > /dev/null 2>&1") != 0) GTEST_SKIP() << "no zstd CLI";
  auto dir = std::filesystem::temp_directory_path() / ("wsync_zstd_writer_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  int k = 0;
  for (const auto& patch : Patches()) {
    std::vector<uint8_t> frame = Frame(patch, k % 2 ? 4096 : kMaxBlock);
    auto in = dir / "p.zst", out = dir / "p";
    std::ofstream(in, std::ios::binary).write(reinterpret_cast<const char*>(frame.data()), frame.size());
    std::string cmd = "zstd -q -d -f -o " + out.string() + " " + in.string();
    ASSERT_EQ(std::system(cmd.c_str()), 0) << k;
    std::ifstream f(out, std::ios::binary);
    std::vector<uint8_t> got((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    ASSERT_EQ(got, patch) << k;
    ++k;
  }
  std::filesystem::remove_all(dir);
}

TEST(FrameWriterTest, FseTablesRoundTripThroughTheReader) {
  std::mt19937 rng(3);
  for (int trial = 0; trial < 500; ++trial) {
    unsigned max_sym = 1 + rng() % 52, al = 5 + rng() % 5;
    std::vector<uint32_t> counts(max_sym + 1);
    for (auto& c : counts) c = rng() % 3 == 0 ? 0 : rng() % (1u << (rng() % 16));
    counts[max_sym] = 1 + rng() % 100;
    std::vector<int16_t> norm(max_sym + 1);
    if (!NormalizeCounts(counts.data(), max_sym, al, norm.data())) continue;
    int sum = 0;
    for (unsigned s = 0; s <= max_sym; ++s) {
      EXPECT_EQ(norm[s] > 0, counts[s] > 0);
      sum += norm[s];
    }
    ASSERT_EQ(sum, 1 << al);
    uint8_t buf[256] = {};
    size_t n = WriteFseTable(norm.data(), max_sym, al, buf);
    FseTable read, built;
    ASSERT_EQ(ReadFse(buf, n, 9, 255, &read), n) << trial;
    ASSERT_TRUE(BuildFse(norm.data(), max_sym, al, &built));
    ASSERT_EQ(read.al, built.al);
    for (size_t i = 0; i < built.t.size(); ++i) {
      ASSERT_EQ(read.t[i].sym, built.t[i].sym) << trial;
      ASSERT_EQ(read.t[i].nb, built.t[i].nb);
      ASSERT_EQ(read.t[i].base, built.t[i].base);
    }
  }
}

TEST(FrameWriterTest, HuffmanCodesOfRandomHistogramsAreReadBackExactly) {
  std::mt19937 rng(4);
  int built = 0;
  for (int trial = 0; trial < 300; ++trial) {
    std::array<uint32_t, 256> counts{};
    unsigned symbols = 2 + rng() % 255;
    for (unsigned i = 0; i < symbols; ++i) counts[rng() % 256] = 1 + (rng() % (1u << (rng() % 20)));
    HufCTable t;
    if (!BuildHuffman(counts.data(), &t)) continue;  // BuildHuffman checked the read-back
    ++built;
    for (unsigned s = 0; s < 256; ++s) {
      EXPECT_EQ(t.len[s] != 0, counts[s] != 0);
      EXPECT_LE(t.len[s], 11);
    }
  }
  EXPECT_GT(built, 250);
}

}  // namespace
}  // namespace wsync::delta::zstd
