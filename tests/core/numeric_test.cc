#include "core/numeric.h"

#include <gtest/gtest.h>

#include <cmath>

namespace m3attn {
namespace {

TEST(E4M3, EveryCodeRoundTrips) {
  for (int c = 0; c < 256; ++c) {
    const uint8_t code = static_cast<uint8_t>(c);
    const float v = e4m3_to_float(code);
    if (e4m3_is_nan(code)) {
      EXPECT_TRUE(std::isnan(v)) << c;
      EXPECT_TRUE(e4m3_is_nan(float_to_e4m3(v)));
      continue;
    }
    const uint8_t back = float_to_e4m3(v);
    if (v == 0.0f) {
      EXPECT_EQ(back & 0x7f, 0) << c;
    } else {
      EXPECT_EQ(back, code) << "code " << c << " value " << v;
    }
  }
}

TEST(E4M3, KnownValuesAndSaturation) {
  EXPECT_EQ(e4m3_to_float(0x7e), 448.0f);
  EXPECT_EQ(e4m3_to_float(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(e4m3_to_float(0x08), std::ldexp(1.0f, -6));
  EXPECT_EQ(e4m3_to_float(0x38), 1.0f);
  EXPECT_EQ(float_to_e4m3(1000.0f), 0x7e);
  EXPECT_EQ(float_to_e4m3(-1000.0f), 0xfe);
  EXPECT_EQ(float_to_e4m3(INFINITY), 0x7e);
  EXPECT_EQ(float_to_e4m3(-INFINITY), 0xfe);
  EXPECT_EQ(float_to_e4m3(464.0f), 0x7e);  // would round to 480, which does not exist
}

TEST(E4M3, TiesRoundToEven) {
  // Between 1.0 (0x38, even) and 1.125 (0x39): the midpoint goes to 1.0.
  EXPECT_EQ(float_to_e4m3(1.0625f), 0x38);
  // Between 1.125 (0x39, odd) and 1.25 (0x3a, even): the midpoint goes to 1.25.
  EXPECT_EQ(float_to_e4m3(1.1875f), 0x3a);
  // Subnormal grid: 1.5 * 2^-9 lies between codes 1 and 2 and goes to the even code 2.
  EXPECT_EQ(float_to_e4m3(1.5f * std::ldexp(1.0f, -9)), 0x02);
  // Midpoint between the largest subnormal (7 * 2^-9) and the smallest normal (8 * 2^-9).
  EXPECT_EQ(float_to_e4m3(7.5f * std::ldexp(1.0f, -9)), 0x08);
}

TEST(E4M3, WithinOneStep) {
  EXPECT_TRUE(e4m3_within_one_step(0x38, 0x39));
  EXPECT_TRUE(e4m3_within_one_step(0x39, 0x38));
  EXPECT_FALSE(e4m3_within_one_step(0x38, 0x3a));
  EXPECT_TRUE(e4m3_within_one_step(0x00, 0x80));  // +0 == -0
  EXPECT_TRUE(e4m3_within_one_step(0x00, 0x81));
  EXPECT_FALSE(e4m3_within_one_step(0x7f, 0x7f));  // NaN never passes
  EXPECT_FALSE(e4m3_within_one_step(0x7e, 0x7f));
}

TEST(BF16, RoundToNearestEvenAndNaN) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  // 1 + 2^-8 is the midpoint between 1.0 (even) and 1 + 2^-7: goes to 1.0.
  EXPECT_EQ(float_to_bf16(1.00390625f), 0x3f80);
  // 1 + 3 * 2^-8 is the midpoint between 1 + 2^-7 (odd) and 1 + 2^-6: goes up.
  EXPECT_EQ(float_to_bf16(1.01171875f), 0x3f82);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(NAN))));
  EXPECT_EQ(bf16_to_float(float_to_bf16(-2.5f)), -2.5f);
}

TEST(E8M0, PowersOfTwo) {
  EXPECT_EQ(e8m0_to_float(127), 1.0f);
  EXPECT_EQ(e8m0_to_float(130), 8.0f);
  EXPECT_EQ(e8m0_to_float(120), std::ldexp(1.0f, -7));
  EXPECT_TRUE(std::isnan(e8m0_to_float(255)));
}

}  // namespace
}  // namespace m3attn
