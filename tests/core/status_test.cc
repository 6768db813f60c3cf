#include "m3attn/status.h"

#include <gtest/gtest.h>

#include <memory>
#include <set>
#include <string>

namespace m3attn {
namespace {

TEST(Status, DefaultIsOk) {
  const Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kOk);
  EXPECT_EQ(s.to_string(), "ok");
  EXPECT_TRUE(Status::Ok().ok());
  EXPECT_TRUE(s.message().empty());
}

TEST(Status, BuildersStreamTheirArguments) {
  const Status s = invalid_argument("page stride ", 130, " is not a multiple of ", 4);
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "page stride 130 is not a multiple of 4");
  EXPECT_EQ(s.to_string(), "invalid argument: page stride 130 is not a multiple of 4");
  EXPECT_EQ(unsupported("x").code(), StatusCode::kUnsupported);
  EXPECT_EQ(out_of_range("x").code(), StatusCode::kOutOfRange);
  EXPECT_EQ(resource_exhausted("x").code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(io_error("x").code(), StatusCode::kIoError);
  EXPECT_EQ(data_loss("x").code(), StatusCode::kDataLoss);
  EXPECT_EQ(internal_error("x").code(), StatusCode::kInternal);
  EXPECT_EQ(make_status(StatusCode::kCudaError, "a", 1.5, 'c').message(), "a1.5c");
  EXPECT_EQ(data_loss("truncated at ", int64_t{1} << 40).message(), "truncated at 1099511627776");
}

TEST(Status, CodeNamesAreDistinct) {
  std::set<std::string> names;
  for (StatusCode c :
       {StatusCode::kOk, StatusCode::kInvalidArgument, StatusCode::kUnsupported,
        StatusCode::kOutOfRange, StatusCode::kResourceExhausted, StatusCode::kIoError,
        StatusCode::kDataLoss, StatusCode::kCudaError, StatusCode::kInternal}) {
    const std::string n = status_code_name(c);
    EXPECT_FALSE(n.empty());
    EXPECT_NE(n, "unknown");
    EXPECT_TRUE(names.insert(n).second) << n;
  }
  EXPECT_EQ(unsupported("top-k 8").to_string(), "unsupported: top-k 8");
}

Result<int> parse_positive(int x) {
  if (x <= 0) return invalid_argument("value ", x, " must be > 0");
  return x * 2;
}

Status chain(int x, int* out) {
  auto r = parse_positive(x);
  M3_RETURN_IF_ERROR(r.status());
  *out = r.value();
  return Status::Ok();
}

Status checked(int x) {
  M3_CHECK_ARG(x % 4 == 0, "stride ", x, " is not a multiple of 4");
  return Status::Ok();
}

TEST(Result, ValueOrStatus) {
  auto good = parse_positive(21);
  ASSERT_TRUE(good.ok());
  EXPECT_EQ(good.value(), 42);
  EXPECT_TRUE(good.status().ok());
  auto bad = parse_positive(-3);
  EXPECT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(), "value -3 must be > 0");
  // Move-only payloads.
  Result<std::unique_ptr<int>> owned(std::make_unique<int>(7));
  ASSERT_TRUE(owned.ok());
  std::unique_ptr<int> p = std::move(owned).value();
  EXPECT_EQ(*p, 7);
}

TEST(Result, MacrosPropagate) {
  int out = 0;
  EXPECT_TRUE(chain(5, &out).ok());
  EXPECT_EQ(out, 10);
  out = -1;
  const Status s = chain(0, &out);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "value 0 must be > 0");
  EXPECT_EQ(out, -1);  // untouched on error
  EXPECT_TRUE(checked(8).ok());
  EXPECT_EQ(checked(130).message(), "stride 130 is not a multiple of 4");
  EXPECT_EQ(checked(130).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace m3attn
