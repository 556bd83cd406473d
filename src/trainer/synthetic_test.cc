#include "trainer/synthetic.h"

#include <stdlib.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>

#include <gtest/gtest.h>

#include "core/parallel.h"
#include "core/sanitizers.h"
#include "trainer/float_convert.h"

namespace wsync {
namespace {

float F(uint32_t bits) { return std::bit_cast<float>(bits); }

// Round-to-nearest-even of a finite fp32 to a format whose values are listed by `decode`,
// by comparing exact distances in double: the reference the bit tricks are checked against.
uint16_t ReferenceBF16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint16_t lo = static_cast<uint16_t>(x >> 16);
  if ((x & 0xffff) == 0) return lo;
  const uint16_t hi = lo + 1;
  const double vlo = BF16ToFloat(lo);
  // The value after the largest finite bf16 rounds as if it were 2^128.
  const double vhi = (hi & 0x7fff) == 0x7f80 ? std::copysign(std::ldexp(1.0, 128), f) : BF16ToFloat(hi);
  const double dlo = std::fabs(f - vlo), dhi = std::fabs(vhi - f);
  if (dlo < dhi) return lo;
  if (dhi < dlo) return hi;
  return (lo & 1) ? hi : lo;
}

TEST(FloatConvert, BF16EdgeCases) {
  EXPECT_EQ(FloatToBF16(1.0f), 0x3f80);
  EXPECT_EQ(FloatToBF16(-2.0f), 0xc000);
  EXPECT_EQ(FloatToBF16(0.0f), 0x0000);
  EXPECT_EQ(FloatToBF16(-0.0f), 0x8000);
  EXPECT_EQ(FloatToBF16(F(0x7f7fffff)), 0x7f80);  // FLT_MAX rounds up to inf, as in torch
  EXPECT_EQ(FloatToBF16(F(0x7f7f7fff)), 0x7f7f);  // just below the midpoint stays finite
  EXPECT_EQ(FloatToBF16(F(0x3f808000)), 0x3f80);  // tie, even below
  EXPECT_EQ(FloatToBF16(F(0x3f818000)), 0x3f82);  // tie, even above
  EXPECT_EQ(FloatToBF16(F(0x3f808001)), 0x3f81);  // just past the tie
  EXPECT_EQ(FloatToBF16(F(0x00008000)), 0x0000);  // subnormal tie to even zero
  EXPECT_EQ(FloatToBF16(F(0x00018000)), 0x0002);
  EXPECT_EQ(FloatToBF16(INFINITY), 0x7f80);
  EXPECT_EQ(FloatToBF16(-INFINITY), 0xff80);
  EXPECT_EQ(FloatToBF16(F(0x7fc00000)), 0x7fc0);
  // NaNs whose payload is only in the low 16 bits must not turn into inf.
  EXPECT_EQ(FloatToBF16(F(0x7f800001)), 0x7fc0);
  EXPECT_EQ(FloatToBF16(F(0xff800001)), 0xffc0);
  EXPECT_TRUE(std::isnan(BF16ToFloat(FloatToBF16(F(0x7fffffff)))));
  EXPECT_EQ(BF16ToFloat(0x3f80), 1.0f);
}

TEST(FloatConvert, BF16MatchesReferenceOnASweep) {
  // ~8M bit patterns spread over all finite floats (a prime stride visits every exponent).
  uint64_t mismatches = 0;
  for (uint64_t k = 0; k < (uint64_t{1} << 32); k += 509) {
    const uint32_t x = static_cast<uint32_t>(k);
    if ((x & 0x7f800000) == 0x7f800000) continue;
    if (FloatToBF16(F(x)) != ReferenceBF16(F(x)) && ++mismatches < 5) {
      ADD_FAILURE() << std::hex << "0x" << x << " -> 0x" << FloatToBF16(F(x)) << ", want 0x"
                    << ReferenceBF16(F(x));
    }
  }
  EXPECT_EQ(mismatches, 0u);
}

TEST(FloatConvert, F16Sanity) {
  EXPECT_EQ(FloatToF16(1.0f), 0x3c00);
  EXPECT_EQ(FloatToF16(-2.0f), 0xc000);
  EXPECT_EQ(FloatToF16(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToF16(65519.0f), 0x7bff);
  EXPECT_EQ(FloatToF16(65520.0f), 0x7c00);
  EXPECT_EQ(FloatToF16(1e10f), 0x7c00);
  EXPECT_EQ(FloatToF16(-INFINITY), 0xfc00);
  EXPECT_EQ(FloatToF16(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(FloatToF16(std::ldexp(1.0f, -25)), 0x0000);  // tie to even zero
  EXPECT_EQ(FloatToF16(std::ldexp(1.5f, -25)), 0x0001);
  EXPECT_EQ(FloatToF16(std::ldexp(1.0f, -14)), 0x0400);  // smallest normal
  EXPECT_EQ(FloatToF16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie, even below
  EXPECT_EQ(FloatToF16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);  // tie, even above
  EXPECT_EQ(FloatToF16(NAN) & 0x7e00, 0x7e00);
  EXPECT_TRUE(std::isnan(F16ToFloat(FloatToF16(F(0x7f800001)))));
  // Every non-NaN half survives a round trip through fp32.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7c00) == 0x7c00 && (h & 0x3ff)) continue;
    ASSERT_EQ(FloatToF16(F16ToFloat(static_cast<uint16_t>(h))), h) << std::hex << h;
  }
  EXPECT_EQ(F16ToFloat(0x0001), std::ldexp(1.0f, -24));
#ifdef __FLT16_MAX__
  // The compiler's own conversion is correctly rounded: compare on a sweep.
  for (uint64_t k = 0; k < (uint64_t{1} << 32); k += 4099) {
    const float f = F(static_cast<uint32_t>(k));
    if (std::isnan(f)) continue;
    const _Float16 h = static_cast<_Float16>(f);
    ASSERT_EQ(FloatToF16(f), std::bit_cast<uint16_t>(h)) << std::hex << k;
  }
#endif
}

TEST(FloatConvert, Fp8E4M3KnownValues) {
  EXPECT_EQ(FloatToF8E4M3(1.0f), 0x38);
  EXPECT_EQ(FloatToF8E4M3(448.0f), 0x7e);
  EXPECT_EQ(FloatToF8E4M3(-2.0f), 0xc0);
  EXPECT_EQ(FloatToF8E4M3(0.0f), 0x00);
  EXPECT_EQ(FloatToF8E4M3(-0.0f), 0x80);
  EXPECT_EQ(FloatToF8E4M3(0.0625f), 0x18);
  EXPECT_EQ(FloatToF8E4M3(500.0f), 0x7e);  // saturates
  EXPECT_EQ(FloatToF8E4M3(-1e30f), 0xfe);
  EXPECT_EQ(FloatToF8E4M3(INFINITY), 0x7e);
  EXPECT_EQ(FloatToF8E4M3(NAN), 0x7f);
  EXPECT_EQ(FloatToF8E4M3(std::ldexp(1.0f, -6)), 0x08);  // smallest normal
  EXPECT_EQ(FloatToF8E4M3(std::ldexp(1.0f, -9)), 0x01);  // smallest subnormal
  EXPECT_EQ(FloatToF8E4M3(std::ldexp(1.0f, -10)), 0x00);  // tie to even zero
  EXPECT_EQ(FloatToF8E4M3(std::ldexp(3.0f, -11)), 0x01);
  EXPECT_EQ(FloatToF8E4M3(1.0625f), 0x38);  // tie between 1 and 1.125, even below
  EXPECT_EQ(FloatToF8E4M3(1.1875f), 0x3a);  // tie between 1.125 and 1.25, even above
  EXPECT_EQ(FloatToF8E4M3(0.3f), 0x2a);     // 0.3 -> 0.3125 = 1.25 * 2^-2
  EXPECT_EQ(F8E4M3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(F8E4M3ToFloat(0x08), std::ldexp(1.0f, -6));
  EXPECT_TRUE(std::isnan(F8E4M3ToFloat(0xff)));
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;
    EXPECT_EQ(FloatToF8E4M3(F8E4M3ToFloat(static_cast<uint8_t>(c))), c) << c;
  }
}

TEST(FloatConvert, Fp8E5M2KnownValues) {
  EXPECT_EQ(FloatToF8E5M2(1.0f), 0x3c);
  EXPECT_EQ(FloatToF8E5M2(-2.0f), 0xc0);
  EXPECT_EQ(FloatToF8E5M2(57344.0f), 0x7b);
  EXPECT_EQ(FloatToF8E5M2(61440.0f), 0x7c);  // tie between max and inf: even is inf
  EXPECT_EQ(FloatToF8E5M2(INFINITY), 0x7c);
  EXPECT_EQ(FloatToF8E5M2(NAN), 0x7f);
  EXPECT_EQ(FloatToF8E5M2(std::ldexp(1.0f, -16)), 0x01);
  // 1 + 2^-3 + 2^-20 lies just above the tie between 1 and 1.25: it must round up,
  // which rounding through f16 first would get wrong.
  EXPECT_EQ(FloatToF8E5M2(1.0f + 0.125f + std::ldexp(1.0f, -20)), 0x3d);
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7c) == 0x7c && (c & 3)) continue;
    EXPECT_EQ(FloatToF8E5M2(F8E5M2ToFloat(static_cast<uint8_t>(c))), c) << c;
  }
}

std::vector<TensorMeta> SmallModel() {
  return {
      {"model.embed_tokens.weight", DType::kBF16, {1100, 1000}},  // > 1 chunk
      {"model.layers.0.input_layernorm.weight", DType::kBF16, {1000}},
      {"model.layers.0.mlp.up_proj.weight", DType::kF16, {300, 100}},
      {"model.layers.0.mlp.fp8.weight", DType::kF8E4M3, {64, 64}},
      {"model.layers.0.mlp.fp8.weight_e5", DType::kF8E5M2, {64}},
      {"model.norm.weight", DType::kF32, {1000}},
      {"model.head.bias", DType::kF32, {777}},
      {"buffers.positions", DType::kI64, {33}},
      {"buffers.mask", DType::kBool, {17}},
      {"buffers.f64", DType::kF64, {9}},
      {"scalar", DType::kBF16, {}},
      {"empty", DType::kBF16, {0, 8}},
  };
}

std::unique_ptr<SyntheticTrainer> Make(uint64_t seed, size_t threads, std::vector<TensorMeta> metas = SmallModel()) {
  auto t = SyntheticTrainer::FromMetadata(std::move(metas), seed, threads);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return std::move(t).value();
}

bool SameTensor(const HostTensor& a, const HostTensor& b) {
  if (a.meta != b.meta) return false;
  return a.meta.nbytes() == 0 || std::memcmp(a.storage.data(), b.storage.data(), a.meta.nbytes()) == 0;
}

void ExpectSameModel(SyntheticTrainer& a, SyntheticTrainer& b) {
  ASSERT_EQ(a.tensors().size(), b.tensors().size());
  for (size_t i = 0; i < a.tensors().size(); ++i) {
    EXPECT_TRUE(SameTensor(a.tensors()[i], b.tensors()[i])) << a.tensors()[i].meta.name;
  }
}

template <typename T>
std::span<const T> View(const HostTensor& t) {
  return {reinterpret_cast<const T*>(t.storage.data()), static_cast<size_t>(t.meta.numel())};
}

TEST(SyntheticTrainer, DeterministicAcrossThreadCounts) {
  auto a = Make(42, 1), b = Make(42, 2), c = Make(42, 3);
  ExpectSameModel(*a, *b);
  ExpectSameModel(*a, *c);
  auto d = Make(43, 2);
  EXPECT_FALSE(SameTensor(a->tensors()[0], d->tensors()[0]));
  // Values are keyed by name: a reordered subset agrees tensor by tensor.
  auto e = Make(42, 2, {SmallModel()[5], SmallModel()[2]});
  EXPECT_TRUE(SameTensor(e->tensors()[0], a->tensors()[5]));
  EXPECT_TRUE(SameTensor(e->tensors()[1], a->tensors()[2]));
}

TEST(SyntheticTrainer, InitialValuesLookLikeWeights) {
  auto t = Make(7, 2);
  auto stats = [](auto values, auto decode) {
    double sum = 0, sq = 0;
    for (auto v : values) {
      double x = decode(v);
      sum += x;
      sq += x * x;
    }
    double mean = sum / values.size();
    return std::pair{mean, std::sqrt(sq / values.size() - mean * mean)};
  };
  auto [m0, s0] = stats(View<uint16_t>(t->tensors()[0]), BF16ToFloat);
  EXPECT_NEAR(m0, 0.0, 1e-3);
  EXPECT_NEAR(s0, 0.02, 0.001);
  auto [m1, s1] = stats(View<uint16_t>(t->tensors()[1]), BF16ToFloat);
  EXPECT_NEAR(m1, 1.0, 3e-3);
  EXPECT_NEAR(s1, 0.02, 0.003);
  auto [m2, s2] = stats(View<uint16_t>(t->tensors()[2]), F16ToFloat);
  EXPECT_NEAR(s2, 0.02, 0.001);
  auto [m3, s3] = stats(View<uint8_t>(t->tensors()[3]), F8E4M3ToFloat);
  EXPECT_NEAR(s3, 0.02, 0.003);
  auto [m5, s5] = stats(View<float>(t->tensors()[5]), [](float f) { return f; });
  EXPECT_NEAR(m5, 1.0, 3e-3);
  for (uint8_t b : View<uint8_t>(t->tensors()[8])) EXPECT_LE(b, 1);
  // The bf16 model is the rounding of its master.
  auto master = t->master(0);
  auto model = View<uint16_t>(t->tensors()[0]);
  ASSERT_EQ(master.size(), model.size());
  for (size_t i = 0; i < model.size(); i += 997) EXPECT_EQ(model[i], FloatToBF16(master[i]));
  EXPECT_TRUE(t->master(3).empty());
}

TEST(SyntheticTrainer, StepChangesAFewPercentDeterministically) {
  auto a = Make(1, 1), b = Make(1, 2);
  std::vector<std::vector<std::byte>> before;
  for (const auto& t : a->tensors()) {
    before.emplace_back(t.storage.data(), t.storage.data() + t.meta.nbytes());
  }
  auto s = a->Step(1);
  ASSERT_TRUE(s.ok());
  ASSERT_TRUE(b->Step(1).ok());
  ExpectSameModel(*a, *b);

  uint64_t trained = 0, changed = 0, bf16_total = 0, bf16_changed = 0;
  for (size_t i = 0; i < a->tensors().size(); ++i) {
    const HostTensor& t = a->tensors()[i];
    const size_t item = ItemSize(t.meta.dtype);
    uint64_t diff = 0;
    for (int64_t e = 0; e < t.meta.numel(); ++e) {
      diff += std::memcmp(t.storage.data() + e * item, before[i].data() + e * item, item) != 0;
    }
    const bool is_trained = t.meta.dtype == DType::kBF16 || t.meta.dtype == DType::kF16 ||
                            t.meta.dtype == DType::kF32;
    if (is_trained) {
      trained += t.meta.numel();
    } else {
      EXPECT_EQ(diff, 0u) << t.meta.name << " is fixed but changed";
    }
    changed += diff;
    if (i == 0) {
      bf16_total = t.meta.numel();
      bf16_changed = diff;
    }
  }
  EXPECT_EQ(s->total_elements, trained);
  EXPECT_EQ(s->changed_elements, changed);
  EXPECT_GT(s->seconds, 0.0);
  const double bf16_fraction = static_cast<double>(bf16_changed) / bf16_total;
  EXPECT_GE(bf16_fraction, 0.01);
  EXPECT_LE(bf16_fraction, 0.10);
  std::printf("bf16 N(0,0.02) values changed by one step at lr %g: %.2f%%\n", a->lr(),
              100 * bf16_fraction);

  // More steps stay in the band and stay deterministic; replaying gives the same bytes.
  for (uint64_t step = 2; step <= 4; ++step) {
    auto sa = a->Step(step);
    ASSERT_TRUE(b->Step(step).ok());
    EXPECT_GE(sa->changed_fraction, 0.01);
    EXPECT_LE(sa->changed_fraction, 0.30);  // F32 tensors change almost every element
  }
  ExpectSameModel(*a, *b);
  auto model = View<uint16_t>(a->tensors()[0]);
  auto master = a->master(0);
  for (size_t i = 0; i < model.size(); i += 991) EXPECT_EQ(model[i], FloatToBF16(master[i]));
  auto f16 = View<uint16_t>(a->tensors()[2]);
  auto f16_master = a->master(2);
  for (size_t i = 0; i < f16.size(); i += 7) EXPECT_EQ(f16[i], FloatToF16(f16_master[i]));
}

TEST(SyntheticTrainer, RejectsBadMetadata) {
  auto dup = SyntheticTrainer::FromMetadata({{"a", DType::kBF16, {2}}, {"a", DType::kBF16, {2}}}, 0, 1);
  ASSERT_FALSE(dup.ok());
  EXPECT_NE(dup.status().message().find("a is listed twice"), std::string::npos);
  auto neg = SyntheticTrainer::FromMetadata({{"w", DType::kBF16, {2, -1}}}, 0, 1);
  ASSERT_FALSE(neg.ok());
  EXPECT_NE(neg.status().message().find("w"), std::string::npos);
}

TEST(SyntheticTrainer, SourceIsZeroCopyOverCurrentWeights) {
  auto t = Make(3, 2);
  auto stream = CheckedStream(*t->source().Iterate(), t->source().metadata());
  TensorRef r;
  size_t i = 0;
  while (*stream->Next(&r)) {
    EXPECT_EQ(r.name, t->tensors()[i].meta.name);
    EXPECT_EQ(static_cast<const void*>(r.bytes.data()), static_cast<const void*>(t->tensors()[i].storage.data()));
    ++i;
  }
  EXPECT_EQ(i, SmallModel().size());
  EXPECT_EQ(t->source().metadata(), SmallModel());
}

TEST(SyntheticTrainer, FromCheckpointContinuesTraining) {
  auto a = Make(11, 2);
  ASSERT_TRUE(a->Step(1).ok());
  char tmpl[] = "/tmp/wsync_trainer_XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  std::vector<TensorRef> refs;
  for (const auto& t : a->tensors()) refs.push_back(t.ref());
  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors", refs).ok());
  auto ckpt = CheckpointDir::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  auto b = SyntheticTrainer::FromCheckpoint(*ckpt, 2, /*seed=*/11);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  for (const auto& t : (*b)->tensors()) {
    auto orig = std::find_if(a->tensors().begin(), a->tensors().end(),
                             [&](const HostTensor& x) { return x.meta.name == t.meta.name; });
    ASSERT_NE(orig, a->tensors().end());
    EXPECT_TRUE(SameTensor(t, *orig)) << t.meta.name;
  }
  // Masters are the checkpoint values widened to fp32.
  for (size_t i = 0; i < (*b)->tensors().size(); ++i) {
    const HostTensor& t = (*b)->tensors()[i];
    if (t.meta.dtype != DType::kBF16 || t.meta.numel() == 0) continue;
    EXPECT_EQ((*b)->master(i)[0], BF16ToFloat(View<uint16_t>(t)[0])) << t.meta.name;
  }
  auto s = (*b)->Step(2);
  ASSERT_TRUE(s.ok());
  EXPECT_GT(s->changed_fraction, 0.01);
  std::filesystem::remove_all(dir);
}

TEST(SyntheticTrainer, StepThroughput) {
#ifdef WSYNC_SANITIZED
  GTEST_SKIP() << "a throughput floor means nothing under ASan/UBSan";
#endif
  // 64M bf16 elements: enough to measure, small enough for any test machine.
  const size_t threads = DefaultThreads();
  auto t = Make(5, threads, {{"w", DType::kBF16, {8192, 8192}}});
  ASSERT_TRUE(t->Step(1).ok());  // warm: pages touched
  double best = 1e9;
  for (uint64_t step = 2; step <= 4; ++step) best = std::min(best, t->Step(step)->seconds);
  const double rate = 8192.0 * 8192.0 / best;
  std::printf("step: %.0f M elements/s on %zu threads (%.0f M/s/thread)\n", rate / 1e6, threads,
              rate / 1e6 / threads);
  // A loose floor that only catches a lost vectorization or a serialized step.
  EXPECT_GT(rate / threads, 50e6);
}

}  // namespace
}  // namespace wsync
