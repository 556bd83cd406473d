#include "core/json_limits.h"

#include <chrono>
#include <string>

#include <gtest/gtest.h>

namespace wsync {
namespace {

using nlohmann::json;

std::string Nested(int depth, std::string_view inner = "1") {
  return std::string(depth, '[') + std::string(inner) + std::string(depth, ']');
}

TEST(JsonLimits, DepthAtTheLimitParses) {
  Result<json> j = ParseUntrustedJson(Nested(kMaxJsonDepth), "test");
  ASSERT_TRUE(j.ok()) << j.status().ToString();
  EXPECT_TRUE(j->is_array());
}

TEST(JsonLimits, DeepNestingIsRefusedNamingTheField) {
  std::string body = R"({"prompt":"a","max_tokens":)" + Nested(100000) + "}";
  Result<json> j = ParseUntrustedJson(body, "body of /v1/completions");
  ASSERT_FALSE(j.ok());
  EXPECT_EQ(j.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(j.status().message(), "body of /v1/completions: field 'max_tokens' nests deeper than 64 levels");
}

TEST(JsonLimits, DeepObjectsAndTopLevelArrays) {
  std::string objects;
  for (int i = 0; i < 70; ++i) objects += R"({"a":)";
  objects += "1" + std::string(70, '}');
  Result<json> j = ParseUntrustedJson(objects, "config.json");
  ASSERT_FALSE(j.ok());
  EXPECT_EQ(j.status().message(), "config.json: field 'a' nests deeper than 64 levels");
  j = ParseUntrustedJson(Nested(65), "x");
  ASSERT_FALSE(j.ok());
  EXPECT_EQ(j.status().message(), "x: JSON nests deeper than 64 levels");
}

TEST(JsonLimits, BracketsInsideStringsDoNotCount) {
  std::string s = R"({"k":")" + std::string(1000, '[') + R"(\"]]", "n": [1]})";
  Result<json> j = ParseUntrustedJson(s, "x");
  ASSERT_TRUE(j.ok()) << j.status().ToString();
  EXPECT_EQ((*j)["n"][0], 1);
}

TEST(JsonLimits, ParseUntrustedObjectKeepsOnlyTheNamedFields) {
  constexpr std::string_view kFields[] = {"a", "b"};
  Result<json> j = ParseUntrustedObject(R"({"a":{"x":1},"pad":[[1],[2]],"b":[1,{"pad":2}],"c":3})", "x", kFields);
  ASSERT_TRUE(j.ok()) << j.status().ToString();
  EXPECT_EQ(*j, json::parse(R"({"a":{"x":1},"b":[1,{"pad":2}]})"));
  j = ParseUntrustedObject("[1]", "body of /pause", kFields);
  ASSERT_FALSE(j.ok());
  EXPECT_EQ(j.status().message(), "body of /pause must be a JSON object");
  j = ParseUntrustedObject(R"({"pad":)" + Nested(100) + "}", "body of /pause", kFields);
  ASSERT_FALSE(j.ok());
  EXPECT_EQ(j.status().message(), "body of /pause: field 'pad' nests deeper than 64 levels");
}

// A kept field that is a long list of objects parses in linear time.
TEST(JsonLimits, ParseUntrustedObjectIsLinearInAListsLength) {
  constexpr std::string_view kFields[] = {"a"};
  std::string list = "[{}";
  for (int i = 1; i < 400000; ++i) list += ",{\"k\":[{}]}";
  const auto start = std::chrono::steady_clock::now();
  Result<json> j = ParseUntrustedObject(R"({"pad":)" + list + R"(],"a":)" + list + "]}", "x", kFields);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(j.ok()) << j.status().ToString();
  EXPECT_EQ(j->size(), 1u);
  EXPECT_EQ(j->at("a").size(), 400000u);
  EXPECT_EQ(j->at("a")[1], json::parse(R"({"k":[{}]})"));
  EXPECT_LT(seconds, 10.0);
}

TEST(JsonLimits, MalformedIsInvalidArgument) {
  Result<json> j = ParseUntrustedJson("{\"a\":", "body of /pause");
  ASSERT_FALSE(j.ok());
  EXPECT_EQ(j.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(j.status().message().rfind("malformed JSON in body of /pause: ", 0), 0u) << j.status().message();
}

TEST(JsonLimits, ExcerptIsShortAndFlat) {
  EXPECT_EQ(JsonExcerpt(json::parse(Nested(60))), "a list of 1 items");
  EXPECT_EQ(JsonExcerpt(json{{"a", 1}, {"b", 2}}), "an object of 2 fields");
  EXPECT_EQ(JsonExcerpt(json(2.5)), "2.5");
  EXPECT_EQ(JsonExcerpt(json("abc")), "\"abc\"");
  std::string shown = JsonExcerpt(json(std::string(100000, 'x')), 8);
  EXPECT_EQ(shown, "\"xxxxxxxx...\" (100000 bytes)");
  // A cut never splits a UTF-8 sequence.
  shown = JsonExcerpt(json(std::string("\xc3\xa9\xc3\xa9\xc3\xa9")), 3);
  EXPECT_EQ(shown, "\"\xc3\xa9...\" (6 bytes)");
}

TEST(JsonLimits, BoundedStringField) {
  json body{{"new_version", std::string(65536, 'v')}, {"n", 3}, {"ok", "v1"}};
  Result<std::string> s = BoundedStringField(body, "new_version", "body of /update_weight_version", 256);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().message(),
            "body of /update_weight_version: field 'new_version' is 65536 bytes, over the limit of 256");
  s = BoundedStringField(body, "n", "b", 256);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().message(), "b: field 'n' must be a string, not number");
  EXPECT_EQ(*BoundedStringField(body, "ok", "b", 2), "v1");
  EXPECT_EQ(*BoundedStringField(body, "absent", "b", 2, "dflt"), "dflt");
}

TEST(JsonLimits, TextExcerpt) {
  EXPECT_EQ(TextExcerpt("model.layers.0.mlp"), "model.layers.0.mlp");
  EXPECT_EQ(TextExcerpt(std::string(100, 'n'), 4), "nnnn... (100 bytes)");
  // A cut never splits a UTF-8 sequence.
  EXPECT_EQ(TextExcerpt("\xc3\xa9\xc3\xa9\xc3\xa9", 3), "\xc3\xa9... (6 bytes)");
  // The field named by a depth error is cut the same way.
  std::string key(100, 'k');
  Status s = CheckJsonDepth("{\"" + key + "\": [[[1]]]}", "t", 2);
  EXPECT_EQ(s.message(), "t: field '" + std::string(64, 'k') + "... (100 bytes)' nests deeper than 2 levels");
}

}  // namespace
}  // namespace wsync
