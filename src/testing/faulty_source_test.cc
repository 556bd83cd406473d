// FaultySource over a small in-memory model: it passes tensors through untouched, fails
// the pass and tensor it is told to with the code it is told to, lies about the shape
// and bytes it is told to, and counts passes and tensors, held passes included. Also
// checks the matchers.
#include "testing/faulty_source.h"

#include <gtest/gtest.h>

#include "testing/status_matchers.h"

namespace wsync::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

HostTensorSource Model() {
  std::vector<HostTensor> tensors;
  for (int i = 0; i < 4; ++i) {
    HostTensor t = *HostTensor::Zeros(TensorMeta{"t" + std::to_string(i), DType::kBF16, {2, 3}});
    t.storage.span()[0] = std::byte(i + 1);
    tensors.push_back(std::move(t));
  }
  return HostTensorSource(std::move(tensors));
}

// A source that holds t1 and t3 of Model(): its held pass yields those two only.
class HeldSubset final : public WeightSource {
 public:
  HeldSubset() : all_(Model()), held_(Subset()) {}
  const std::vector<TensorMeta>& metadata() const override { return all_.metadata(); }
  Result<std::unique_ptr<TensorStream>> Iterate() override { return all_.Iterate(); }
  std::optional<std::vector<std::string>> HeldNames() const override {
    return std::vector<std::string>{"t1", "t3"};
  }
  Result<std::unique_ptr<TensorStream>> IterateHeld() override { return held_.Iterate(); }

 private:
  static HostTensorSource Subset() {
    HostTensorSource model = Model();
    std::vector<HostTensor> held;
    held.push_back(std::move(model.tensors()[1]));
    held.push_back(std::move(model.tensors()[3]));
    return HostTensorSource(std::move(held));
  }
  HostTensorSource all_;
  HostTensorSource held_;
};

// The names yielded by one pass (the held pass with `held`), or its error.
Result<std::vector<std::string>> Drain(WeightSource& source, bool held = false) {
  WSYNC_ASSIGN_OR_RETURN(auto stream, held ? source.IterateHeld() : source.Iterate());
  std::vector<std::string> names;
  TensorRef t;
  while (true) {
    WSYNC_ASSIGN_OR_RETURN(bool more, stream->Next(&t));
    if (!more) return names;
    names.push_back(std::string(t.name) + "/" + std::to_string(t.bytes.size()));
  }
}

TEST(FaultySource, PassesThroughAndCountsPassesAndTensors) {
  HostTensorSource inner = Model();
  FaultySource s(&inner);
  EXPECT_EQ(s.metadata(), inner.metadata());
  for (int pass = 1; pass <= 2; ++pass) {
    ASSERT_OK_AND_ASSIGN(auto names, Drain(s));
    EXPECT_EQ(names, (std::vector<std::string>{"t0/12", "t1/12", "t2/12", "t3/12"}));
  }
  EXPECT_EQ(s.passes(), 2);
  EXPECT_EQ(s.completed_passes(), 2);
  EXPECT_EQ(s.tensors_yielded(), 8u);
  // A pass abandoned halfway counts as started, not completed.
  auto stream = *s.Iterate();
  TensorRef t;
  ASSERT_TRUE(*stream->Next(&t));
  EXPECT_EQ(s.passes(), 3);
  EXPECT_EQ(s.completed_passes(), 2);
  EXPECT_EQ(s.tensors_yielded(), 9u);
}

TEST(FaultySource, FailsTheChosenPassAtTheChosenTensor) {
  HostTensorSource inner = Model();
  FaultySource s(&inner, {.fail_pass = 2, .fail_at = 1});
  EXPECT_OK(Drain(s));
  EXPECT_THAT(Drain(s), StatusIs(StatusCode::kInternal,
                                 "injected: the source broke at tensor 1 of pass 2"));
  EXPECT_OK(Drain(s));
  EXPECT_EQ(s.tensors_yielded(), 4u + 1u + 4u);
  s.options().fail_pass = -1;
  s.options().fail_at = 0;
  s.options().fail_code = StatusCode::kUnavailable;
  s.options().fail_message = "gather of a shard failed";
  EXPECT_THAT(Drain(s), StatusIs(StatusCode::kUnavailable, HasSubstr("gather")));
  EXPECT_THAT(Drain(s), StatusIs(StatusCode::kUnavailable));
  EXPECT_THAT(Drain(s), Not(IsOk()));
}

TEST(FaultySource, HeldPassGoesThroughTheSameFaultsAndCounters) {
  HeldSubset inner;
  FaultySource s(&inner, {.fail_pass = 2, .fail_at = 1});
  EXPECT_EQ(s.HeldNames(), inner.HeldNames());
  ASSERT_OK_AND_ASSIGN(auto held, Drain(s, true));
  EXPECT_EQ(held, (std::vector<std::string>{"t1/12", "t3/12"}));
  EXPECT_THAT(Drain(s, true), StatusIs(StatusCode::kInternal, "injected: the source broke at tensor 1 of pass 2"));
  ASSERT_OK_AND_ASSIGN(auto full, Drain(s));
  EXPECT_EQ(full.size(), 4u);
  EXPECT_EQ(s.passes(), 3);
  EXPECT_EQ(s.completed_passes(), 2);
  EXPECT_EQ(s.tensors_yielded(), 2u + 1u + 4u);
  // Over a source that holds everything, the held pass is the full pass.
  HostTensorSource everything = Model();
  FaultySource all(&everything);
  EXPECT_FALSE(all.HeldNames().has_value());
  ASSERT_OK_AND_ASSIGN(auto names, Drain(all, true));
  EXPECT_EQ(names, (std::vector<std::string>{"t0/12", "t1/12", "t2/12", "t3/12"}));
}

TEST(FaultySource, LiesAboutAShapeInMetadataAndAboutBytesInTheStream) {
  HostTensorSource inner = Model();
  FaultySource liar(&inner, {.lie_shape_at = 2, .lie_bytes_at = 1, .lie_bytes_pass = 2});
  EXPECT_EQ(liar.metadata()[2].shape, (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(liar.metadata()[1].shape, inner.metadata()[1].shape);
  ASSERT_OK_AND_ASSIGN(auto first, Drain(liar));
  EXPECT_EQ(first[1], "t1/12");
  ASSERT_OK_AND_ASSIGN(auto second, Drain(liar));
  EXPECT_EQ(second[1], "t1/11");
  // The engine's checked iteration names the tensor whose metadata lies.
  auto checked = CheckedStream(*liar.Iterate(), liar.metadata());
  TensorRef t;
  Status s;
  while (true) {
    Result<bool> more = checked->Next(&t);
    if (!more.ok() || !*more) {
      s = more.status();
      break;
    }
  }
  EXPECT_THAT(s, StatusIs(StatusCode::kInvalidArgument, HasSubstr("t2")));
}

}  // namespace
}  // namespace wsync::testing
