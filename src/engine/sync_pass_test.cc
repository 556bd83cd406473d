// SyncPass: one pass per sync, checked as it streams, over after a failure.
#include "engine/sync_pass.h"

#include <gtest/gtest.h>

#include "core/digest.h"

namespace wsync {
namespace {

HostTensorSource Source(int n) {
  std::vector<HostTensor> tensors;
  for (int i = 0; i < n; ++i) {
    tensors.push_back(*HostTensor::Zeros(TensorMeta{"t" + std::to_string(i), DType::kF32, {2, 2}}));
  }
  return HostTensorSource(std::move(tensors));
}

// Counts passes and tensors read; its metadata lists one tensor more than it yields
// when `short_by_one`.
class Counting : public WeightSource {
 public:
  Counting(WeightSource& inner, bool short_by_one) : inner_(inner), meta_(inner.metadata()) {
    if (short_by_one) meta_.push_back(TensorMeta{"missing", DType::kF32, {1}});
  }
  const std::vector<TensorMeta>& metadata() const override { return meta_; }
  Result<std::unique_ptr<TensorStream>> Iterate() override {
    ++passes;
    WSYNC_ASSIGN_OR_RETURN(auto s, inner_.Iterate());
    class Stream final : public TensorStream {
     public:
      Stream(std::unique_ptr<TensorStream> s, int* read) : s_(std::move(s)), read_(read) {}
      Result<bool> Next(TensorRef* out) override {
        WSYNC_ASSIGN_OR_RETURN(bool more, s_->Next(out));
        if (more) ++*read_;
        return more;
      }

     private:
      std::unique_ptr<TensorStream> s_;
      int* read_;
    };
    return std::unique_ptr<TensorStream>(std::make_unique<Stream>(std::move(s), &read));
  }
  int passes = 0;
  int read = 0;

 private:
  WeightSource& inner_;
  std::vector<TensorMeta> meta_;
};

TEST(SyncPass, OnePassSharedByStreamAndView) {
  HostTensorSource host = Source(3);
  Counting source(host, false);
  SyncPass pass(source);
  auto a = *pass.Stream();
  auto b = *pass.Stream();
  EXPECT_EQ(a, b);
  TensorRef t;
  EXPECT_TRUE(*a->Next(&t));
  auto view = pass.AsSource().Iterate();
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(pass.AsSource().Iterate().status().code(), StatusCode::kFailedPrecondition);
  while (*(*view)->Next(&t)) {
  }
  EXPECT_TRUE(pass.complete());
  EXPECT_EQ(source.passes, 1);
  EXPECT_EQ(source.read, 3);
}

TEST(SyncPass, AMismatchNamesTheTensorAndEndsThePass) {
  HostTensorSource host = Source(4);
  Counting source(host, true);
  SyncPass pass(source);
  auto s = *pass.Stream();
  TensorRef t;
  Result<bool> more = true;
  while (more.ok() && *more) more = s->Next(&t);
  ASSERT_FALSE(more.ok());
  EXPECT_NE(more.status().message().find("missing"), std::string::npos) << more.status().message();
  EXPECT_EQ(s->Next(&t).status().code(), StatusCode::kFailedPrecondition);  // the pass is over
  EXPECT_FALSE(pass.complete());
  EXPECT_EQ(source.passes, 1);
  EXPECT_EQ(source.read, 4);
}

TEST(SyncPass, ReadAllReadsOnePassChecked) {
  HostTensorSource host = Source(2);
  Counting source(host, false);
  SyncPass pass(source);
  EXPECT_TRUE(pass.ReadAll().ok());
  EXPECT_TRUE(pass.complete());
  EXPECT_EQ(source.passes, 1);
  EXPECT_EQ(source.read, 2);
  Counting short_one(host, true);
  SyncPass broken(short_one);
  Status s = broken.ReadAll();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("missing"), std::string::npos) << s.message();
}

// Holds the even-numbered tensors of its host source and passes over only those.
class EvenHolder : public HostTensorSource {
 public:
  using HostTensorSource::HostTensorSource;
  std::optional<std::vector<std::string>> HeldNames() const override {
    std::vector<std::string> names;
    for (size_t i = 0; i < metadata().size(); i += 2) names.emplace_back(metadata()[i].name);
    return names;
  }
  Result<std::unique_ptr<TensorStream>> IterateHeld() override {
    ++held_passes;
    std::vector<HostTensor> held;
    for (size_t i = 0; i < tensors().size(); i += 2) {
      held.push_back(*HostTensor::Zeros(tensors()[i].meta));
    }
    held_ = std::make_unique<HostTensorSource>(std::move(held));
    return held_->Iterate();
  }
  int held_passes = 0;

 private:
  std::unique_ptr<HostTensorSource> held_;
};

TEST(SyncPass, TheViewPassesOverTheHeldNamesOnceChecked) {
  std::vector<HostTensor> tensors;
  for (int i = 0; i < 5; ++i) {
    tensors.push_back(*HostTensor::Zeros(TensorMeta{"t" + std::to_string(i), DType::kF32, {2}}));
  }
  EvenHolder source(std::move(tensors));
  SyncPass pass(source);
  WeightSource& view = pass.AsSource();
  ASSERT_TRUE(view.HeldNames().has_value());
  auto stream = view.IterateHeld();
  ASSERT_TRUE(stream.ok()) << stream.status().ToString();
  EXPECT_EQ(view.IterateHeld().status().code(), StatusCode::kFailedPrecondition);  // one pass
  EXPECT_EQ(view.Iterate().status().code(), StatusCode::kFailedPrecondition);
  std::vector<std::string> seen;
  TensorRef t;
  while (*(*stream)->Next(&t)) seen.emplace_back(t.name);
  EXPECT_EQ(seen, (std::vector<std::string>{"t0", "t2", "t4"}));
  EXPECT_EQ(source.held_passes, 1);
  // A source that holds everything passes over its whole metadata.
  HostTensorSource all = Source(3);
  SyncPass whole(all);
  auto every = whole.AsSource().IterateHeld();
  ASSERT_TRUE(every.ok()) << every.status().ToString();
  int n = 0;
  while (*(*every)->Next(&t)) ++n;
  EXPECT_EQ(n, 3);
  EXPECT_TRUE(whole.complete());
}

}  // namespace
}  // namespace wsync

namespace wsync {
namespace {

// In-line verification: the pass hashes each host tensor it hands out, and only when asked.
TEST(SyncPass, DigestsEveryHostTensorItYieldsWhenAsked) {
  std::vector<HostTensor> tensors;
  for (int i = 0; i < 3; ++i) {
    HostTensor t = *HostTensor::Zeros(TensorMeta{"t" + std::to_string(i), DType::kF32, {2, 2}});
    t.storage.span()[0] = static_cast<std::byte>(i + 1);
    tensors.push_back(std::move(t));
  }
  std::vector<std::string> want;
  for (const HostTensor& t : tensors) want.push_back(HexDigest(DigestAlgorithm::kXxh3_128, t.ref().bytes));
  HostTensorSource source(std::move(tensors));

  SyncPass plain(source);
  ASSERT_TRUE(plain.ReadAll().ok());
  EXPECT_TRUE(plain.digests().empty());

  SyncPass hashed(source);
  hashed.CollectDigests();
  ASSERT_TRUE(hashed.ReadAll().ok());
  ASSERT_TRUE(hashed.complete());
  ASSERT_EQ(hashed.digests().size(), 3u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(hashed.digests().at("t" + std::to_string(i)), want[i]);
  EXPECT_TRUE(hashed.digests_complete());
  EXPECT_FALSE(plain.digests_complete());

  // A reader that takes the hashing over: the pass hashes nothing itself, and its digests
  // are complete only once the reader has recorded every host tensor it read.
  SyncPass taken(source);
  EXPECT_EQ(taken.TakeDigests(), nullptr);  // not collecting
  taken.CollectDigests();
  std::shared_ptr<PassDigests> mine = taken.TakeDigests();
  ASSERT_NE(mine, nullptr);
  std::shared_ptr<TensorStream> stream = *taken.Stream();
  EXPECT_EQ(taken.TakeDigests(), nullptr);  // the pass has started
  TensorRef t;
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(*stream->Next(&t));
    EXPECT_EQ(taken.digests().size(), static_cast<size_t>(i));
    if (i < 2) mine->Record(t.name, HexDigest(DigestAlgorithm::kXxh3_128, t.bytes));
  }
  ASSERT_FALSE(*stream->Next(&t));
  EXPECT_FALSE(taken.digests_complete());
  mine->Record("t2", want[2]);
  EXPECT_TRUE(taken.digests_complete());
  EXPECT_EQ(taken.digests(), hashed.digests());
}

}  // namespace
}  // namespace wsync
