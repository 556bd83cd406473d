// The device digest kernel (DeviceRuntime::Xxh3Digests) against libxxhash on the host:
// every length class, every alignment of a span's start, spans across many blocks, and
// many spans in one launch. Skips without a GPU.
#include <gtest/gtest.h>
#include <xxhash.h>

#include <random>
#include <vector>

#include "core/digest.h"
#include "cuda/device.h"
#include "cuda/runtime.h"
#include "wsync/device_runtime.h"

namespace wsync::cuda {
namespace {

class DeviceDigestTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    InstallDeviceRuntime();
    Result<DeviceRuntime*> rt = CudaRuntimeFor(Device{Device::Kind::kCuda, 0});
    ASSERT_TRUE(rt.ok()) << rt.status().ToString();
    rt_ = *rt;
    ASSERT_TRUE(rt_->SetDevice(0).ok());
  }

  // `n` random bytes on the device, and their host copy.
  void Fill(size_t n, uint32_t seed) {
    host_.resize(n);
    std::mt19937_64 rng(seed);
    for (auto& b : host_) b = static_cast<unsigned char>(rng());
    Result<DeviceBuffer> b = DeviceBuffer::Allocate(Device{Device::Kind::kCuda, 0}, n);
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    device_ = std::move(*b);
    ASSERT_TRUE(CopyAndWait(device_.device(), device_.data(), n, host_.data(), n, n, 1).ok());
  }

  // Digests [offset, offset + len) spans on the device and on the host; every one equal.
  void ExpectSpans(const std::vector<std::pair<size_t, size_t>>& spans) {
    std::vector<DeviceRuntime::Span> list;
    for (auto [offset, len] : spans) list.push_back({device_.data() + offset, len});
    std::vector<uint64_t> out(2 * list.size());
    Status s = rt_->Xxh3Digests(list, out);
    ASSERT_TRUE(s.ok()) << s.ToString();
    for (size_t i = 0; i < spans.size(); ++i) {
      const XXH128_hash_t want = XXH3_128bits(host_.data() + spans[i].first, spans[i].second);
      ASSERT_EQ(out[2 * i], want.low64) << "span at " << spans[i].first << " of " << spans[i].second << " bytes";
      ASSERT_EQ(out[2 * i + 1], want.high64) << "span at " << spans[i].first << " of " << spans[i].second << " bytes";
    }
  }

  DeviceRuntime* rt_ = nullptr;
  DeviceBuffer device_;
  std::vector<unsigned char> host_;
};

TEST_F(DeviceDigestTest, EveryLengthAndAlignmentMatchesLibxxhash) {
  Fill(size_t{1} << 20, 3);
  std::vector<std::pair<size_t, size_t>> spans;
  for (size_t len = 0; len <= 3 * 1024 + 70; ++len) spans.push_back({(len * 5) % 64 + 4096, len});
  ExpectSpans(spans);
}

TEST_F(DeviceDigestTest, LongSpansAtBlockEdgesMatchLibxxhash) {
  Fill(size_t{40} << 20, 5);
  std::vector<std::pair<size_t, size_t>> spans;
  for (size_t shift = 0; shift < 8; ++shift) {
    for (size_t blocks : {size_t{4}, size_t{5}, size_t{1023}, size_t{4096}}) {
      for (long d : {-65L, -64L, -1L, 0L, 1L, 64L, 65L}) spans.push_back({shift, blocks * 1024 + d});
    }
  }
  spans.push_back({0, host_.size()});  // 40 MiB, one warp
  spans.push_back({1, host_.size() - 8});
  ExpectSpans(spans);
}

TEST_F(DeviceDigestTest, ManySpansInOneLaunch) {
  Fill(size_t{64} << 20, 9);
  std::vector<std::pair<size_t, size_t>> spans;
  for (size_t at = 0; at + (size_t{1} << 16) <= host_.size(); at += size_t{1} << 16) spans.push_back({at, 65536 - at % 7});
  ASSERT_EQ(spans.size(), 1024u);
  ExpectSpans(spans);
}

TEST_F(DeviceDigestTest, WrongOutputSizeIsRefused) {
  Fill(4096, 1);
  std::vector<DeviceRuntime::Span> list{{device_.data(), 100}};
  std::vector<uint64_t> out(3);
  Status s = rt_->Xxh3Digests(list, out);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
}

}  // namespace
}  // namespace wsync::cuda
