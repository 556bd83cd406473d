// The update_info tensor-list parser: every malformed list is InvalidArgument naming the
// field and index, and no shape reaches the model check with a byte count that overflows.
#include "control/tensor_list.h"

#include <gtest/gtest.h>

#include "core/json_limits.h"

namespace wsync {
namespace {

using nlohmann::json;

std::string ErrorOf(const json& info) { return ParseTensorList(info).status().message(); }

TEST(TensorList, ParsesVllmLists) {
  json info = {{"names", {"a", "b"}}, {"dtype_names", {"bfloat16", "float32"}}, {"shapes", {{2, 3}, json::array()}}};
  auto t = ParseTensorList(info);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ASSERT_EQ(t->size(), 2u);
  EXPECT_EQ((*t)[0].nbytes(), 12u);
  EXPECT_EQ((*t)[1].nbytes(), 4u);
  EXPECT_EQ(ParseTensorList(TensorListJson(*t))->at(0), (*t)[0]);
}

TEST(TensorList, ShapesWhoseBytesOverflowAreRefused) {
  json info = {{"names", {"w"}}, {"dtype_names", {"bfloat16"}},
               {"shapes", {{int64_t{4294967296}, int64_t{4294967296}}}}};
  EXPECT_EQ(ErrorOf(info), "shapes[0] (w) [4294967296, 4294967296] has more bytes than int64 counts");
  info["shapes"] = {{int64_t{1} << 62, 2, 0}};  // overflows before the zero
  EXPECT_NE(ErrorOf(info).find("more bytes than int64 counts"), std::string::npos);
  info["shapes"] = {{int64_t{1} << 62}};  // numel fits, bytes (x2) do not
  EXPECT_NE(ErrorOf(info).find("more bytes than int64 counts"), std::string::npos);
  info["shapes"] = {{uint64_t{18446744073709551615u}}};
  EXPECT_NE(ErrorOf(info).find("non-negative integers"), std::string::npos);
  info["shapes"] = {{-1}};
  EXPECT_NE(ErrorOf(info).find("non-negative integers"), std::string::npos);
  info["shapes"] = {{2.5}};
  EXPECT_NE(ErrorOf(info).find("non-negative integers"), std::string::npos);
}

TEST(TensorList, MalformedListsNameTheField) {
  EXPECT_EQ(ErrorOf(json::object()), "update_info is missing 'names'");
  EXPECT_EQ(ErrorOf(json::array()), "update_info must be an object");
  EXPECT_EQ(ErrorOf(json{{"names", 1}, {"dtype_names", json::array()}, {"shapes", json::array()}}),
            "update_info 'names' must be a list");
  json info = {{"names", {1}}, {"dtype_names", {"bfloat16"}}, {"shapes", {{1}}}};
  EXPECT_EQ(ErrorOf(info), "names[0] must be a string");
  info = {{"names", {"w"}}, {"dtype_names", {"complex32"}}, {"shapes", {{1}}}};
  EXPECT_NE(ErrorOf(info).find("dtype_names[0] (w)"), std::string::npos);
  info = {{"names", {"w"}}, {"dtype_names", {"bfloat16"}}, {"shapes", {5}}};
  EXPECT_NE(ErrorOf(info).find("shapes[0] (w)"), std::string::npos);
}

// Names are bounded; refused values are shown flat, so a deep or long value never makes
// a long message or a recursive dump.
TEST(TensorList, LongNamesAndDeepValuesAreRefusedFlat) {
  json info = {{"names", {std::string(kMaxNameBytes + 1, 'n')}}, {"dtype_names", {"bfloat16"}}, {"shapes", {{1}}}};
  EXPECT_EQ(ErrorOf(info), "names[0] is 1025 bytes, over the limit of 1024");
  info["names"] = {std::string(kMaxNameBytes, 'n')};
  EXPECT_TRUE(ParseTensorList(info).ok());
  info = {{"names", {"w"}}, {"dtype_names", {std::string(100000, 'd')}}, {"shapes", {{1}}}};
  EXPECT_EQ(ErrorOf(info), "dtype_names[0] (w): unknown dtype '" + std::string(64, 'd') + "... (100000 bytes)'");
  json deep = json::array();
  for (int i = 0; i < 60; ++i) deep = json::array({deep});
  info = {{"names", {"w"}}, {"dtype_names", {"bfloat16"}}, {"shapes", {{2, deep}}}};
  EXPECT_EQ(ErrorOf(info), "shapes[0] (w) must be a list of non-negative integers; item 1 is a list of 1 items");
}

// update_info as a request carries it: text nested 100,000 deep is refused by the bounded
// parser before ParseTensorList sees it, naming the field.
TEST(TensorList, DeepUpdateInfoTextIsRefusedBeforeParsing) {
  const std::string text = R"({"names": ["w"], "dtype_names": ["bfloat16"], "shapes": )" +
                           std::string(100000, '[') + std::string(100000, ']') + "}";
  Result<json> j = ParseUntrustedJson(text, "update_info");
  ASSERT_FALSE(j.ok());
  EXPECT_EQ(j.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(j.status().message(), "update_info: field 'shapes' nests deeper than 64 levels");
}

}  // namespace
}  // namespace wsync
