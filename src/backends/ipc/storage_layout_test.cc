#include "backends/ipc/storage_layout.h"

#include <gtest/gtest.h>

#include <cstddef>
#include <memory>
#include <vector>

namespace wsync {
namespace {

// Yields the tensors it is given, as a source's pass does.
class ListStream final : public TensorStream {
 public:
  explicit ListStream(std::vector<TensorRef> refs) : refs_(std::move(refs)) {}
  Result<bool> Next(TensorRef* out) override {
    if (i_ == refs_.size()) return false;
    *out = refs_[i_++];
    return true;
  }

 private:
  std::vector<TensorRef> refs_;
  size_t i_ = 0;
};

constexpr Device kCuda0{Device::Kind::kCuda, 0};

struct Block {
  std::vector<std::byte> bytes = std::vector<std::byte>(4096);
  SourceStorage storage(Device d = kCuda0) const { return SourceStorage{bytes.data(), bytes.size(), d}; }
  TensorRef at(size_t offset, size_t n, Device d = kCuda0) const {
    return TensorRef{"", DType::kF32, {}, std::span<const std::byte>(bytes.data() + offset, n), d};
  }
};

std::vector<TensorMeta> Meta(std::vector<int64_t> elements) {
  std::vector<TensorMeta> m;
  for (size_t i = 0; i < elements.size(); ++i) m.push_back({"t" + std::to_string(i), DType::kF32, {elements[i]}});
  return m;
}

TEST(StorageLayout, OffsetsAreWhereTheTensorsLieWithGapsBetween) {
  Block b;
  auto meta = Meta({16, 64, 4});
  ListStream s({b.at(0, 64), b.at(1024, 256), b.at(4080, 16)});
  Result<StorageLayout> l = ReadStorageLayout(s, meta, b.storage());
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  EXPECT_EQ(l->offsets, (std::vector<uint64_t>{0, 1024, 4080}));
  EXPECT_TRUE(l->SameBlock(b.storage()));
  EXPECT_FALSE(l->SameBlock(b.storage(Device{Device::Kind::kCuda, 1})));
  SourceStorage shorter = b.storage();
  shorter.bytes -= 1;
  EXPECT_FALSE(l->SameBlock(shorter));
}

TEST(StorageLayout, ATensorOutsideOrOnAnotherDeviceIsNamed) {
  Block b, other;
  auto meta = Meta({16, 16});
  std::vector<TensorRef> refs = {b.at(0, 64), b.at(4090, 6)};
  refs[1].bytes = std::span<const std::byte>(b.bytes.data() + 4090, 64);  // runs 58 bytes past the block
  ListStream overrun(refs);
  Result<StorageLayout> l = ReadStorageLayout(overrun, meta, b.storage());
  ASSERT_FALSE(l.ok());
  EXPECT_EQ(l.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(l.status().message().find("tensor t1 (64 bytes at"), std::string::npos) << l.status().message();
  EXPECT_NE(l.status().message().find("does not lie inside the source's storage (4096 bytes at"), std::string::npos)
      << l.status().message();

  ListStream elsewhere({other.at(0, 64), b.at(64, 64)});
  l = ReadStorageLayout(elsewhere, meta, b.storage());
  ASSERT_FALSE(l.ok());
  EXPECT_NE(l.status().message().find("tensor t0 "), std::string::npos) << l.status().message();

  ListStream host({b.at(0, 64, Device{}), b.at(64, 64)});
  l = ReadStorageLayout(host, meta, b.storage());
  ASSERT_FALSE(l.ok());
  EXPECT_NE(l.status().message().find("tensor t0 (64 bytes at"), std::string::npos) << l.status().message();
  EXPECT_NE(l.status().message().find("on cpu)"), std::string::npos) << l.status().message();
}

TEST(StorageLayout, TensorsOutOfOrderOrOverlappingAreNamed) {
  Block b;
  auto meta = Meta({16, 16});
  ListStream reversed({b.at(64, 64), b.at(0, 64)});
  Result<StorageLayout> l = ReadStorageLayout(reversed, meta, b.storage());
  ASSERT_FALSE(l.ok());
  EXPECT_EQ(l.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(l.status().message(), "tensor t1 lies at offset 0 of the source's storage, inside t0 before it (which "
                                  "ends at 128): receivers take the tensors in iteration order, without overlap");
  ListStream overlapping({b.at(0, 64), b.at(32, 64)});
  EXPECT_FALSE(ReadStorageLayout(overlapping, meta, b.storage()).ok());
  ListStream shared({b.at(0, 64), b.at(0, 64)});  // tied weights: one tensor under two names
  EXPECT_FALSE(ReadStorageLayout(shared, meta, b.storage()).ok());
  ListStream adjacent({b.at(0, 64), b.at(64, 64)});
  EXPECT_TRUE(ReadStorageLayout(adjacent, meta, b.storage()).ok());
}

TEST(StorageLayout, APassLongerOrShorterThanItsMetadataFails) {
  Block b;
  ListStream longer({b.at(0, 64), b.at(64, 64)});
  EXPECT_FALSE(ReadStorageLayout(longer, Meta({16}), b.storage()).ok());
  ListStream shorter({b.at(0, 64)});
  Result<StorageLayout> l = ReadStorageLayout(shorter, Meta({16, 16}), b.storage());
  ASSERT_FALSE(l.ok());
  EXPECT_NE(l.status().message().find("before tensor t1"), std::string::npos) << l.status().message();
}

TEST(StorageLayout, TheRecorderLearnsOnlyWhenEveryTensorLiesInside) {
  Block b;
  auto meta = Meta({16, 16});
  StorageLayoutRecorder none(std::nullopt, 2);
  none.Add(meta[0], b.at(0, 64));
  EXPECT_EQ(none.Finish().status().code(), StatusCode::kFailedPrecondition);

  StorageLayoutRecorder inside(b.storage(), 2);
  inside.Add(meta[0], b.at(128, 64));
  inside.Add(meta[1], b.at(512, 64));
  ASSERT_TRUE(inside.Finish().ok());
  EXPECT_EQ(inside.Finish()->offsets, (std::vector<uint64_t>{128, 512}));

  StorageLayoutRecorder half(b.storage(), 2);
  half.Add(meta[0], b.at(0, 64));
  Block other;
  half.Add(meta[1], other.at(0, 64));
  ASSERT_FALSE(half.Finish().ok());
  EXPECT_NE(half.Finish().status().message().find("tensor t1 "), std::string::npos);
}

TEST(StorageLayout, DigestsDifferWithOffsetsAndSize) {
  Block b;
  StorageLayout x{b.storage(), {0, 64}}, y{b.storage(), {64, 0}}, z = x;
  EXPECT_NE(x.Digest(), y.Digest());
  EXPECT_EQ(x.Digest(), z.Digest());
  z.storage.bytes = 8192;
  EXPECT_NE(x.Digest(), z.Digest());
}

}  // namespace
}  // namespace wsync
