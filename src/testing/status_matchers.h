// gtest matchers for Status and Result<T>, so that a test states the code and the words
// it expects in one assertion and a failure prints the whole Status:
//
//   EXPECT_THAT(engine->Init(meta), IsOk());
//   EXPECT_THAT(r, StatusIs(StatusCode::kFailedPrecondition, HasSubstr("trainer rank 1")));
//   ASSERT_OK(server->Start());                       // ASSERT_THAT(..., IsOk())
//   ASSERT_OK_AND_ASSIGN(auto engine, CreateTrainerEngine(o));
//
// They accept a Status or any Result<T>. Tests only; header-only.
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ostream>
#include <string>
#include <utility>

#include "wsync/status.h"

namespace wsync {

// Prints a Status as its ToString() in gtest messages.
inline void PrintTo(const Status& s, std::ostream* os) { *os << s.ToString(); }

namespace testing {

inline const Status& StatusOf(const Status& s) { return s; }
template <typename T>
const Status& StatusOf(const Result<T>& r) {
  return r.status();
}

MATCHER(IsOk, "is OK") {
  const Status& s = ::wsync::testing::StatusOf(arg);
  if (!s.ok()) *result_listener << "which is " << s.ToString();
  return s.ok();
}

MATCHER_P(StatusIs, code, "has status code " + std::string(::wsync::StatusCodeName(code))) {
  const Status& s = ::wsync::testing::StatusOf(arg);
  *result_listener << "which is " << s.ToString();
  return s.code() == code;
}

MATCHER_P2(StatusIs, code, message_matcher,
           "has status code " + std::string(::wsync::StatusCodeName(code)) + " and a message that " +
               ::testing::DescribeMatcher<std::string>(message_matcher)) {
  const Status& s = ::wsync::testing::StatusOf(arg);
  *result_listener << "which is " << s.ToString();
  return s.code() == code &&
         ::testing::Matcher<const std::string&>(message_matcher).Matches(s.message());
}

}  // namespace testing
}  // namespace wsync

#define ASSERT_OK(expr) ASSERT_THAT((expr), ::wsync::testing::IsOk())
#define EXPECT_OK(expr) EXPECT_THAT((expr), ::wsync::testing::IsOk())
// ASSERTs that a Result is OK (printing its Status) and moves its value into `lhs`.
#define ASSERT_OK_AND_ASSIGN(lhs, expr) ASSERT_OK_AND_ASSIGN_IMPL_(WSYNC_CONCAT_(testing_result_, __LINE__), lhs, expr)
#define ASSERT_OK_AND_ASSIGN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  ASSERT_TRUE(tmp.ok()) << tmp.status().ToString(); \
  lhs = std::move(tmp).value()
