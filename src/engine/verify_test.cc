// The trainer's side of read-back verification (TrainerDigests): xxh3 of tensors on a GPU
// is taken on the device in one launch, never read back, and equals the host digest of
// the same bytes; host tensors and sha256 are hashed on the host. Through the
// host-backed device stand-in, which runs the kernel's schedule on host memory.
#include "engine/verify.h"

#include <gtest/gtest.h>

#include <random>

#include "testing/host_backed_device.h"

namespace wsync {
namespace {

TEST(TrainerDigests, Xxh3OfGpuTensorsIsOneDeviceLaunchAndHostOnesAreHashedInPlace) {
  HostBackedDevice device;
  const Device gpu{Device::Kind::kCuda, 0};
  std::mt19937 rng(9);
  std::vector<std::vector<std::byte>> bytes;
  for (size_t n : {size_t{4096}, size_t{3} << 20, size_t{777}}) {
    std::vector<std::byte> b(n);
    for (auto& x : b) x = static_cast<std::byte>(rng());
    bytes.push_back(std::move(b));
  }
  const std::vector<int64_t> shapes[] = {{4096}, {int64_t{3} << 20}, {777}};
  const std::vector<TensorRef> refs{
      {"model.embed_tokens.weight", DType::kU8, shapes[0], bytes[0], gpu},
      {"model.layers.0.mlp.up_proj.weight", DType::kU8, shapes[1], bytes[1], gpu},
      {"model.norm.weight", DType::kU8, shapes[2], bytes[2], Device{}},
  };
  Result<std::vector<std::string>> got = TrainerDigests(DigestAlgorithm::kXxh3_128, refs);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  ASSERT_EQ(got->size(), 3u);
  for (size_t i = 0; i < refs.size(); ++i) EXPECT_EQ((*got)[i], HexDigest(DigestAlgorithm::kXxh3_128, bytes[i])) << i;
  EXPECT_EQ(device.digest_launches(), 1);
  EXPECT_EQ(device.largest_.load(), 0u);  // nothing read back

  got = TrainerDigests(DigestAlgorithm::kSha256, refs);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  for (size_t i = 0; i < refs.size(); ++i) EXPECT_EQ((*got)[i], HexDigest(DigestAlgorithm::kSha256, bytes[i])) << i;
  EXPECT_EQ(device.digest_launches(), 1);
  EXPECT_EQ(device.largest_.load(), bytes[1].size());  // read back (in blocks of at most 16 MiB)
}

TEST(TrainerDigests, AGpuTensorWithoutARuntimeIsAnErrorNamingTheTensorAndDevice) {
  std::vector<std::byte> bytes(64);
  const Shape shape{64};
  Result<std::vector<std::string>> got = TrainerDigests(
      DigestAlgorithm::kXxh3_128, {{"model.norm.weight", DType::kU8, shape, bytes, Device{Device::Kind::kCuda, 1}}});
  ASSERT_FALSE(got.ok());
  EXPECT_NE(got.status().message().find("model.norm.weight"), std::string::npos) << got.status().ToString();
  EXPECT_NE(got.status().message().find("cuda:1"), std::string::npos) << got.status().ToString();
}

}  // namespace
}  // namespace wsync
