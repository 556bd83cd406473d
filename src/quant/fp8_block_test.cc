// QuantizeFp8Blocks against the independent reference of fp8_reference_testutil.h: random
// bf16 with zeros, partial edge blocks, blocks below the 1e-4 amax clamp, huge values,
// non-finite blocks, f16 and f32 inputs, stacked matrices, any thread count; and its errors.
#include <bit>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "core/dtype_convert.h"
#include "quant/fp8_block.h"
#include "quant/fp8_digest.h"
#include "quant/fp8_reference_testutil.h"
#include "testing/host_backed_device.h"
#include "wsync/status.h"

namespace wsync {
namespace {

namespace ref = fp8_reference;

// Random bf16 bits: about one in eight zero (either sign), magnitudes over a wide range
// scaled by `scale`.
std::vector<uint16_t> RandomBF16(size_t n, float scale, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> pick(0, 7), expo(-20, 4);
  std::vector<uint16_t> out(n);
  for (auto& h : out) {
    const int p = pick(rng);
    float v = p == 0 ? (rng() & 1 ? -0.0f : 0.0f) : normal(rng) * std::ldexp(scale, p == 1 ? expo(rng) : 0);
    h = FloatToBF16(v);
  }
  return out;
}

std::vector<float> Widen(const std::vector<uint16_t>& bf16) {
  std::vector<float> out(bf16.size());
  for (size_t i = 0; i < bf16.size(); ++i) out[i] = BF16ToFloat(bf16[i]);
  return out;
}

std::span<const std::byte> Bytes(const auto& v) { return std::as_bytes(std::span(v)); }

// Quantizes with the library and checks it bit for bit against the reference, per matrix.
void ExpectMatchesReference(std::span<const std::byte> src, DType dtype, const std::vector<float>& wide,
                            Fp8MatrixShape shape, size_t threads) {
  std::vector<uint8_t> q(shape.elements());
  std::vector<float> s(shape.scales());
  ASSERT_TRUE(QuantizeFp8Blocks(src, dtype, shape, q, s, threads, "t").ok());
  const int64_t m = shape.rows * shape.cols, ms = shape.scales_per_matrix();
  for (int64_t e = 0; e < shape.count; ++e) {
    std::vector<float> x(wide.begin() + e * m, wide.begin() + (e + 1) * m);
    const ref::Quantized want = ref::Quantize(x, shape.rows, shape.cols);
    ASSERT_EQ(std::memcmp(q.data() + e * m, want.q.data(), m), 0)
        << "matrix " << e << " of [" << shape.rows << ", " << shape.cols << "]";
    for (int64_t i = 0; i < ms; ++i) {
      ASSERT_EQ(std::bit_cast<uint32_t>(s[e * ms + i]), std::bit_cast<uint32_t>(want.scale_inv[i]))
          << "scale " << i << " of matrix " << e;
    }
  }
}

TEST(Fp8BlockTest, RandomBf16MatchesTheReferenceForFullAndPartialBlocks) {
  struct Case {
    int64_t rows, cols;
  };
  for (Case c : {Case{128, 128}, Case{256, 384}, Case{300, 200}, Case{1, 1}, Case{5, 700}, Case{257, 129},
                 Case{129, 1}}) {
    SCOPED_TRACE(::testing::Message() << "[" << c.rows << ", " << c.cols << "]");
    const std::vector<uint16_t> x = RandomBF16(c.rows * c.cols, 0.02f, c.rows * 1000 + c.cols);
    ExpectMatchesReference(Bytes(x), DType::kBF16, Widen(x), {1, c.rows, c.cols}, 1);
  }
}

TEST(Fp8BlockTest, TinyBlocksUseTheClampAndHugeValuesStayFinite) {
  const int64_t rows = 256, cols = 256;
  std::vector<uint16_t> x = RandomBF16(rows * cols, 1e-6f, 3);  // every block's amax < 1e-4
  // Block (0, 1): huge values up to bf16's largest finite; block (1, 1): all zero.
  for (int64_t r = 0; r < 128; ++r) {
    x[r * cols + 128 + r % 128] = FloatToBF16(r % 2 ? 3e38f : -1e30f);
    x[r * cols + 129] = 0x7f7f;  // 3.39e38
  }
  for (int64_t r = 128; r < 256; ++r) {
    for (int64_t c = 128; c < 256; ++c) x[r * cols + c] = (r + c) % 2 ? 0x8000 : 0x0000;
  }
  ExpectMatchesReference(Bytes(x), DType::kBF16, Widen(x), {1, rows, cols}, 1);
  std::vector<uint8_t> q(rows * cols);
  std::vector<float> s(4);
  ASSERT_TRUE(QuantizeFp8Blocks(Bytes(x), DType::kBF16, {1, rows, cols}, q, s, 1, "t").ok());
  EXPECT_EQ(s[0], 1e-4f / 448.0f);  // the clamp
  EXPECT_EQ(s[3], 1e-4f / 448.0f);  // all zeros: the clamp too
  EXPECT_EQ(s[1], BF16ToFloat(0x7f7f) / 448.0f);
  EXPECT_EQ(q[129], 0x7e);                       // the block's amax maps to 448
  EXPECT_EQ(q[128 * cols + 128], 0x00);           // +0 stays +0
  EXPECT_EQ(q[128 * cols + 129], 0x80);           // -0 stays -0
}

TEST(Fp8BlockTest, NonFiniteBlocksAreAllNaNWithNaNScale) {
  const int64_t rows = 130, cols = 260;
  std::vector<uint16_t> x = RandomBF16(rows * cols, 0.5f, 4);
  x[5 * cols + 7] = 0x7f80;           // +inf in block (0, 0)
  x[129 * cols + 259] = 0xffc1;       // a negative NaN in block (1, 2), the partial corner
  ExpectMatchesReference(Bytes(x), DType::kBF16, Widen(x), {1, rows, cols}, 1);
  std::vector<uint8_t> q(rows * cols);
  std::vector<float> s(6);
  ASSERT_TRUE(QuantizeFp8Blocks(Bytes(x), DType::kBF16, {1, rows, cols}, q, s, 1, "t").ok());
  EXPECT_EQ(std::bit_cast<uint32_t>(s[0]), 0x7fc00000u);
  EXPECT_EQ(std::bit_cast<uint32_t>(s[5]), 0x7fc00000u);
  EXPECT_TRUE(std::isfinite(s[1]));
  EXPECT_EQ(q[0], 0x7f);
  EXPECT_EQ(q[129 * cols + 258], 0x7f);
}

TEST(Fp8BlockTest, F16AndF32InputsMatchTheReference) {
  const int64_t rows = 200, cols = 150;
  const std::vector<uint16_t> b = RandomBF16(rows * cols, 0.1f, 5);
  std::vector<float> f32 = Widen(b);
  f32[17] = std::numeric_limits<float>::denorm_min();
  f32[18] = -3.0e-40f;
  ExpectMatchesReference(Bytes(f32), DType::kF32, f32, {1, rows, cols}, 1);
  std::vector<uint16_t> f16(f32.size());
  std::vector<float> f16_wide(f32.size());
  for (size_t i = 0; i < f32.size(); ++i) {
    f16[i] = FloatToF16(f32[i] * (i % 3 == 0 ? 1e-4f : 1.0f));  // subnormal halves too
    f16_wide[i] = F16ToFloat(f16[i]);
  }
  ExpectMatchesReference(Bytes(f16), DType::kF16, f16_wide, {1, rows, cols}, 1);
}

TEST(Fp8BlockTest, StackedMatricesAndThreadCountsGiveTheSameBytes) {
  const Fp8MatrixShape shape{3, 384, 320};
  const std::vector<uint16_t> x = RandomBF16(shape.elements(), 0.03f, 6);
  ExpectMatchesReference(Bytes(x), DType::kBF16, Widen(x), shape, 1);
  ExpectMatchesReference(Bytes(x), DType::kBF16, Widen(x), shape, 3);
  ExpectMatchesReference(Bytes(x), DType::kBF16, Widen(x), shape, 64);
}

TEST(Fp8BlockTest, ErrorsNameTheTensor) {
  std::vector<uint16_t> x(128 * 128);
  std::vector<uint8_t> q(x.size());
  std::vector<float> s(1);
  Status st = QuantizeFp8Blocks(Bytes(x), DType::kI16, {1, 128, 128}, q, s, 1, "layer.w");
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("layer.w"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("int16"), std::string::npos) << st.message();
  std::vector<float> s2(2);
  st = QuantizeFp8Blocks(Bytes(x), DType::kBF16, {1, 128, 128}, q, s2, 1, "layer.w");
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("layer.w"), std::string::npos) << st.message();
  st = QuantizeFp8Blocks(Bytes(x), DType::kBF16, {int64_t{1} << 40, int64_t{1} << 40, 128}, q, s, 1, "big");
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("overflows"), std::string::npos) << st.message();
  st = QuantizeFp8Blocks(Bytes(x), DType::kBF16, {1, -1, 128}, q, s, 1, "neg");
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
}

// What push --verify expects of an fp8 server: the digests of the reference quantization
// of the whole tensor, from a tensor on the host or on a device, strip by strip.
TEST(Fp8DigestTest, StripByStripDigestsEqualTheWholeTensorsReferenceQuantization) {
  HostBackedDevice device;
  const int64_t rows = 300, cols = 200;  // partial blocks along both dimensions
  const std::vector<uint16_t> bf16 = RandomBF16(rows * cols, 0.02f, 7);
  const ref::Quantized want = ref::Quantize(Widen(bf16), rows, cols);
  const Shape shape{rows, cols};
  auto mem = DeviceBuffer::Allocate(Device{Device::Kind::kCuda, 0}, bf16.size() * 2);
  ASSERT_TRUE(mem.ok()) << mem.status().ToString();
  ASSERT_TRUE(device.Copy2D(mem->data(), mem->size(), bf16.data(), mem->size(), mem->size(), 1).ok());
  device.largest_ = 0;
  for (const TensorRef& t : {TensorRef{"w", DType::kBF16, shape, Bytes(bf16), Device{}},
                             TensorRef{"w", DType::kBF16, shape, mem->span(), mem->device()}}) {
    std::vector<std::byte> scratch;
    auto got = Fp8TensorDigests(DigestAlgorithm::kSha256, t, scratch);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(got->weight, HexDigest(DigestAlgorithm::kSha256, Bytes(want.q))) << t.device.ToString();
    EXPECT_EQ(got->scale_inv, HexDigest(DigestAlgorithm::kSha256, Bytes(want.scale_inv))) << t.device.ToString();
  }
  EXPECT_EQ(device.largest_.load(), static_cast<size_t>(128 * cols * 2));  // one strip of rows at a time
  const Shape flat{rows * cols};
  TensorRef one_d{"model.norm.weight", DType::kBF16, flat, Bytes(bf16), Device{}};
  std::vector<std::byte> scratch;
  auto bad = Fp8TensorDigests(DigestAlgorithm::kSha256, one_d, scratch);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("model.norm.weight"), std::string::npos) << bad.status().ToString();
}

}  // namespace
}  // namespace wsync
