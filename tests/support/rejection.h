// Checks shared by the validation tests: a call built from bad params is rejected with the
// expected code and a message naming the rule, and leaves its output untouched.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "m3attn/status.h"
#include "m3attn/tensor.h"

namespace m3attn::testing {

// Expects `validate(p)` (unless `host_only`: a rule only the CPU twin can see) and `run(p)` to
// fail with `code` and a message holding `needle`; `out` is filled with `poison` (of its element
// type Elem) before `run` and must hold nothing else after it.
template <typename Elem, typename Params, typename Validate, typename Run>
void expect_rejected_untouched(const Params& p, Validate validate, Run run, Tensor& out,
                               Elem poison, StatusCode code, const std::string& needle,
                               bool host_only) {
  if (!host_only) {
    const Status v = validate(p);
    EXPECT_EQ(v.code(), code) << v.to_string();
    EXPECT_NE(v.message().find(needle), std::string::npos) << v.to_string();
  }
  std::fill(out.ptr<Elem>(), out.ptr<Elem>() + out.numel(), poison);
  const Status st = run(p);
  EXPECT_EQ(st.code(), code) << st.to_string();
  EXPECT_NE(st.message().find(needle), std::string::npos) << st.to_string();
  EXPECT_TRUE(std::all_of(out.ptr<Elem>(), out.ptr<Elem>() + out.numel(), [poison](Elem v) {
    return v == poison;
  })) << "a rejected call wrote its output";
}

// For EXPECT_TRUE: whether `s` is a kInvalidArgument error whose message holds `needle`.
inline ::testing::AssertionResult rejects(const Status& s, const std::string& needle) {
  if (s.ok()) return ::testing::AssertionFailure() << "accepted; expected: " << needle;
  if (s.code() != StatusCode::kInvalidArgument)
    return ::testing::AssertionFailure() << "wrong code: " << s.to_string();
  if (s.message().find(needle) == std::string::npos)
    return ::testing::AssertionFailure() << "\"" << s.message() << "\" lacks \"" << needle << "\"";
  return ::testing::AssertionSuccess();
}

// Fails fatally unless `st` is an error (callers wrap it in ASSERT_NO_FATAL_FAILURE); then
// expects kInvalidArgument and every word of `keywords` in the message.
inline void expect_invalid_naming(const Status& st, const std::vector<std::string>& keywords) {
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  for (const std::string& word : keywords)
    EXPECT_NE(st.message().find(word), std::string::npos)
        << "message \"" << st.message() << "\" lacks \"" << word << "\"";
}

}  // namespace m3attn::testing
