// `wsync demo`: two TP=2 qwen3-0.6b servers, three trainer steps, verified. Labelled "slow".
#include "e2e_test_base.h"

namespace wsync::e2e {
namespace {

class DemoTest : public E2eTest {};

TEST_F(DemoTest, DemoExitsZeroWithAVerifiedRowForEachOfItsFourSyncs) {
  RunResult r = RunWsync("demo", {"demo"}, /*timeout_seconds=*/840);
  ASSERT_TRUE(r.success()) << r.description;
  EXPECT_TRUE(HasVerifiedTable(r.out, 4));
  std::cout << "[e2e] demo took " << r.seconds << " s\n";
}

}  // namespace
}  // namespace wsync::e2e
