// How a GPU trainer's tensors are cut for the device digest kernel, and that the digests
// it records are the host digests of the same bytes (whole, or per row range), through
// the host-backed device stand-in (which runs the kernel's schedule on host memory).
#include "engine/device_digests.h"

#include <gtest/gtest.h>

#include <random>

#include "core/digest.h"
#include "testing/host_backed_device.h"

namespace wsync {
namespace {

TEST(DeviceDigestPieces, SmallTensorsAreWholeAndLargeOnesTileDimZeroInOrder) {
  auto pieces = DeviceDigestPieces(TensorMeta{"norm", DType::kBF16, {1024}});
  ASSERT_EQ(pieces.size(), 1u);
  EXPECT_TRUE(pieces[0].whole);
  EXPECT_EQ(pieces[0].bytes, 2048u);
  EXPECT_EQ(DeviceDigestPieces(TensorMeta{"scalar", DType::kF32, {}}).size(), 1u);

  EXPECT_EQ(DeviceDigestPieces(TensorMeta{"q_proj", DType::kBF16, {4096, 4096}}).size(), 1u);  // 32 MiB: whole
  const TensorMeta embed{"embed", DType::kBF16, {151936, 1024}};
  pieces = DeviceDigestPieces(embed);
  ASSERT_EQ(pieces.size(), 19u);  // 8192 rows (16 MiB) each, the last shorter
  int64_t next = 0;
  size_t bytes = 0;
  for (const DeviceDigestPiece& p : pieces) {
    EXPECT_FALSE(p.whole);
    EXPECT_EQ(p.row_begin, next);
    EXPECT_EQ(p.offset, static_cast<size_t>(p.row_begin) * 2048);
    EXPECT_EQ(p.bytes, static_cast<size_t>(p.row_end - p.row_begin) * 2048);
    EXPECT_LE(p.bytes, kDeviceRowDigestBytes);
    next = p.row_end;
    bytes += p.bytes;
  }
  EXPECT_EQ(next, 151936);
  EXPECT_EQ(bytes, embed.nbytes());

  // Many narrow rows: never more ranges than kMaxDeviceRowDigests.
  pieces = DeviceDigestPieces(TensorMeta{"narrow", DType::kF32, {100'000'000, 1}});
  EXPECT_LE(pieces.size(), static_cast<size_t>(kMaxDeviceRowDigests));
  EXPECT_EQ(pieces.back().row_end, 100'000'000);
  // One huge row a piece.
  pieces = DeviceDigestPieces(TensorMeta{"wide", DType::kBF16, {3, 16 << 20}});
  ASSERT_EQ(pieces.size(), 3u);
  EXPECT_EQ(pieces[2].row_begin, 2);
}

TEST(RecordDeviceDigests, RecordsTheHostDigestsOfTheSameBytesWholeAndByRows) {
  HostBackedDevice device;
  const Device gpu{Device::Kind::kCuda, 0};
  const TensorMeta small{"small", DType::kBF16, {7, 33}};
  const TensorMeta big{"big", DType::kBF16, {20000, 1000}};  // 40 MB: 3 row ranges
  std::vector<std::byte> a(small.nbytes()), b(big.nbytes());
  std::mt19937 rng(3);
  for (auto& x : a) x = static_cast<std::byte>(rng());
  for (auto& x : b) x = static_cast<std::byte>(rng());
  PassDigests digests;
  const std::vector<DeviceTensorBytes> tensors{{&small, a.data()}, {&big, b.data()}};
  ASSERT_TRUE(RecordDeviceDigests(gpu, tensors, digests).ok());
  EXPECT_EQ(device.digest_launches(), 1);
  EXPECT_EQ(digests.map().at("small"), HexDigest(DigestAlgorithm::kXxh3_128, a));
  EXPECT_TRUE(digests.Covers("big", 20000));
  const nlohmann::json rows = digests.Json()["big"]["rows"];
  ASSERT_EQ(rows.size(), 3u);
  for (const auto& r : rows) {
    const size_t begin = r[0].get<size_t>() * 2000, end = r[1].get<size_t>() * 2000;
    EXPECT_EQ(r[2], HexDigest(DigestAlgorithm::kXxh3_128, std::span(b).subspan(begin, end - begin)));
  }
}

TEST(RecordDeviceDigests, ARuntimeWithoutTheKernelIsAnErrorNamingTheTensor) {
  const TensorMeta m{"model.norm.weight", DType::kBF16, {8}};
  std::vector<std::byte> bytes(16);
  PassDigests digests;
  const std::vector<DeviceTensorBytes> tensors{{&m, bytes.data()}};
  Status s = RecordDeviceDigests(Device{Device::Kind::kCuda, 0}, tensors, digests);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("model.norm.weight"), std::string::npos) << s.ToString();
  EXPECT_EQ(digests.size(), 0u);
}

}  // namespace
}  // namespace wsync
