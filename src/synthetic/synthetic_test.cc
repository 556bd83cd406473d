#include "synthetic/synthetic.h"

#include <stdlib.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>

#include <gtest/gtest.h>

#include "core/parallel.h"
#include "core/sanitizers.h"
#include "core/dtype_convert.h"
#include "synthetic/synthetic_kernels.h"
#include "testing/host_backed_device.h"

namespace wsync {
namespace {

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
}

// The values a step of the kernels must land between: x = w - lr * u in fp32, with u the
// kernels' uniform of element i, recomputed here from the public hash.
float UpdatedValue(float w, uint32_t i, synthetic::HashKey key, float lr) {
  const uint32_t h = synthetic::Hash32(i * key.mul + key.add);
  return w - lr * (static_cast<float>(static_cast<int32_t>(h)) * 0x1p-31f);
}

// Stochastic rounding lands every value on a neighbour of its exact update, and is
// unbiased: the mean of the rounded values follows the mean of the exact ones, which
// round-to-nearest would lose entirely (the updates are far below half an ulp).
template <typename Decode, typename Kernel>
void ExpectStochasticRounding(uint16_t start, Decode decode, Kernel kernel, float lr) {
  const size_t n = 1 << 20;
  const synthetic::HashKey key = synthetic::MakeKey(9, 1, synthetic::NameKey("w"), 0);
  std::vector<uint16_t> w(n, start);
  const uint64_t changed = kernel(w.data(), n, 0, key, lr);
  const double w0 = decode(start);
  const double ulp = decode(static_cast<uint16_t>(start + 1)) - w0;
  double exact_sum = 0, rounded_sum = 0;
  uint64_t moved = 0;
  for (size_t i = 0; i < n; ++i) {
    const float x = UpdatedValue(static_cast<float>(w0), static_cast<uint32_t>(i), key, lr);
    const double got = decode(w[i]);
    exact_sum += x;
    rounded_sum += got;
    moved += w[i] != start;
    // A neighbour of x: nothing representable lies strictly between x and got.
    ASSERT_LT(std::fabs(got - x), ulp) << i;
  }
  EXPECT_EQ(changed, moved);
  EXPECT_GT(moved, n / 100);
  // The per-element rounding error is at most one ulp with mean zero: over 2^20 elements
  // its mean is within a few ulp / 1024 of zero.
  EXPECT_NEAR(rounded_sum / n, exact_sum / n, 4 * ulp / 1024);
}

TEST(SyntheticKernels, StepsRoundStochasticallyWithoutBias) {
  // w = 1.0 (bf16 ulp 2^-7, f16 ulp 2^-10) moved by lr * u far below half an ulp.
  ExpectStochasticRounding(0x3f80, BF16ToFloat, synthetic::StepBF16, 1e-3f);
  ExpectStochasticRounding(0x3c00, F16ToFloat, synthetic::StepF16, 1e-4f);
}

TEST(SyntheticTrainer, OnADeviceMatchesTheHostBitForBitThroughSmallPieces) {
  HostBackedDevice device;
  const Device gpu{Device::Kind::kCuda, 0};
  auto host = Make(21, 2);
  auto on_device = SyntheticTrainer::FromMetadata(SmallModel(), 21, 2, gpu);
  ASSERT_TRUE(on_device.ok()) << on_device.status().ToString();
  SyntheticTrainer& d = **on_device;
  EXPECT_TRUE(d.tensors().empty());
  ASSERT_NE(d.device_source(), nullptr);
  EXPECT_EQ(&d.source(), static_cast<WeightSource*>(d.device_source()));
  auto expect_same = [&] {
    for (size_t i = 0; i < host->tensors().size(); ++i) {
      const HostTensor& t = host->tensors()[i];
      if (t.meta.nbytes() == 0) continue;
      const std::byte* dev = d.device_source()->device_buffer().data() + d.device_source()->offset(i);
      EXPECT_EQ(std::memcmp(dev, t.storage.data(), t.meta.nbytes()), 0) << t.meta.name;
    }
  };
  expect_same();
  for (uint64_t step = 1; step <= 3; ++step) {
    auto a = host->Step(step);
    auto b = d.Step(step);
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    EXPECT_EQ(a->changed_elements, b->changed_elements);
  }
  expect_same();
  // The host held one piece per thread at a time, never a tensor.
  const size_t largest_piece = SyntheticTrainer::kChunkElements * sizeof(double);
  EXPECT_LE(device.largest_.load(), largest_piece);
  EXPECT_EQ(device.allocated_.load(), d.device_source()->device_buffer().size());
}

TEST(SyntheticTrainer, OnADeviceWithoutARuntimeFailsNamingTheDevice) {
  auto t = SyntheticTrainer::FromMetadata(SmallModel(), 1, 1, Device{Device::Kind::kCuda, 3});
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("cuda:3"), std::string::npos) << t.status().ToString();
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
