// ParseRowDigests: the row-digest entry of a split tensor, as a trainer sends it and as a
// hostile one might.
#include "receiver/row_digests.h"

#include <gtest/gtest.h>

namespace wsync {
namespace {

using nlohmann::json;

TEST(RowDigests, RangesThatTileTheRowsParseWithOneHexEach) {
  Result<RowDigests> r = ParseRowDigests(json::parse(R"({"rows": [[0, 3, "0a"], [3, 8, "ff01"]]})"), "w", 8);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->ranges, (std::vector<std::pair<int64_t, int64_t>>{{0, 3}, {3, 8}}));
  EXPECT_EQ(r->joined, "0a,ff01");
}

TEST(RowDigests, HexesThatCouldBlurTheJoinedFormAreRefused) {
  // An empty hex or one holding a comma would make the joined form of one tiling equal
  // another's; anything but lowercase hex digits is refused, naming the tensor.
  for (const char* text : {R"({"rows": [[0, 3, ""], [3, 8, "cd"]]})", R"({"rows": [[0, 3, "a,b"], [3, 8, "cd"]]})",
                           R"({"rows": [[0, 8, "AB"]]})", R"({"rows": [[0, 8, "0x1"]]})"}) {
    Result<RowDigests> r = ParseRowDigests(json::parse(text), "model.w", 8);
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("wsync_digests[model.w]: each range must be [begin, end, hex] with 1 to 128 "
                                        "lowercase hex digits"),
              std::string::npos)
        << r.status().message();
  }
  EXPECT_FALSE(ParseRowDigests(json::parse(R"({"rows": [[0, 8, ")" + std::string(129, 'a') + R"("]]})"), "w", 8).ok());
}

TEST(RowDigests, GapsOverlapsAndShortTilingsAreRefused) {
  EXPECT_FALSE(ParseRowDigests(json::parse(R"({"rows": [[0, 3, "a"], [4, 8, "b"]]})"), "w", 8).ok());
  EXPECT_FALSE(ParseRowDigests(json::parse(R"({"rows": [[0, 3, "a"], [2, 8, "b"]]})"), "w", 8).ok());
  EXPECT_FALSE(ParseRowDigests(json::parse(R"({"rows": [[0, 3, "a"]]})"), "w", 8).ok());
  EXPECT_FALSE(ParseRowDigests(json::parse(R"({"rows": [[0, 9, "a"]]})"), "w", 8).ok());
  EXPECT_FALSE(ParseRowDigests(json::parse(R"({"rows": [], "x": 1})"), "w", 8).ok());
}

}  // namespace
}  // namespace wsync
