#include "core/numeric.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

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

// ---- exhaustive checks against an independent model of E4M3 "fn" ----

// Value of a code from the format definition: bias 7, subnormals m * 2^-9, S.1111.111 is NaN.
double e4m3_model(int code) {
  const int sign = code & 0x80, e = (code >> 3) & 0xf, m = code & 7;
  const double mag = e == 0 ? m * std::ldexp(1.0, -9) : std::ldexp(1.0 + m / 8.0, e - 7);
  return sign ? -mag : mag;
}

// Nearest representable value with ties to the even code, saturating to +-448 (SATFINITE).
uint8_t nearest_e4m3(float x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const double a = std::fabs(static_cast<double>(x));
  if (a >= 448.0) return sign | 0x7e;
  int best = 0;
  for (int c = 1; c <= 0x7e; ++c) {
    const double d = std::fabs(e4m3_model(c) - a), db = std::fabs(e4m3_model(best) - a);
    if (d < db || (d == db && (c & 1) == 0)) best = c;
  }
  return sign | static_cast<uint8_t>(best);
}

TEST(E4M3, DecodeMatchesTheFormatForAll256Codes) {
  int nan_codes = 0;
  for (int c = 0; c < 256; ++c) {
    const float v = e4m3_to_float(static_cast<uint8_t>(c));
    if ((c & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(v)) << c;
      EXPECT_TRUE(e4m3_is_nan(static_cast<uint8_t>(c)));
      ++nan_codes;
      continue;
    }
    EXPECT_FALSE(e4m3_is_nan(static_cast<uint8_t>(c))) << c;
    EXPECT_EQ(static_cast<double>(v), e4m3_model(c)) << "code " << c;
    EXPECT_EQ(std::signbit(v), (c & 0x80) != 0) << c;  // -0 decodes to -0
  }
  EXPECT_EQ(nan_codes, 2);
}

TEST(E4M3, EncodeEveryCodeAndBothNeighbouringMidpoints) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;
    const float v = e4m3_to_float(static_cast<uint8_t>(c));
    EXPECT_EQ(float_to_e4m3(v), c) << "exact value of code " << c;  // -0 keeps its sign bit
    // Midpoint to the next larger magnitude, and just either side of it.
    const int up = (c & 0x7f) + 1;
    if (up > 0x7e) continue;
    const uint8_t next = static_cast<uint8_t>((c & 0x80) | up);
    const float mid = static_cast<float>((e4m3_model(c) + e4m3_model(next)) / 2);
    const uint8_t even = (c & 1) == 0 ? static_cast<uint8_t>(c) : next;
    EXPECT_EQ(float_to_e4m3(mid), even) << "tie between codes " << c << " and " << int{next};
    EXPECT_EQ(float_to_e4m3(std::nextafter(mid, 0.0f)), c) << "below the midpoint of " << c;
    EXPECT_EQ(float_to_e4m3(std::nextafter(mid, mid * 2)), next) << "above the midpoint of " << c;
  }
}

TEST(E4M3, EncodeEveryBf16ValueToTheNearest) {
  // All 65536 BF16 bit patterns cover every exponent with 8 bits of mantissa: ties, subnormals,
  // saturation and NaN included.
  int64_t bad = 0;
  for (uint32_t b = 0; b < 65536; ++b) {
    const float x = bf16_to_float(static_cast<uint16_t>(b));
    const uint8_t got = float_to_e4m3(x);
    if (std::isnan(x)) {
      EXPECT_TRUE(e4m3_is_nan(got)) << b;
      EXPECT_EQ(got & 0x80, std::signbit(x) ? 0x80 : 0) << "NaN keeps its sign, bf16 " << b;
      continue;
    }
    const uint8_t want = nearest_e4m3(x);
    if (got != want && ++bad <= 8)
      ADD_FAILURE() << "x " << x << ": got 0x" << std::hex << int{got} << " want 0x" << int{want};
  }
  EXPECT_EQ(bad, 0);
}

TEST(E4M3, EncodeRandomFloatsToTheNearest) {
  std::mt19937 gen(12345);  // fixed: this sweep is a property check, not a random-input test
  std::uniform_int_distribution<uint32_t> bits;
  int64_t bad = 0;
  for (int i = 0; i < 200000; ++i) {
    // Random magnitudes in [2^-14, 2^10) plus random signs: the interesting range.
    uint32_t u = bits(gen);
    const uint32_t exp = 113 + (u % 24);  // biased fp32 exponents 113..136
    u = (u & 0x807fffffu) | (exp << 23);
    float x;
    std::memcpy(&x, &u, 4);
    if (float_to_e4m3(x) != nearest_e4m3(x) && ++bad <= 8)
      ADD_FAILURE() << "x " << x << " got " << int{float_to_e4m3(x)} << " want "
                    << int{nearest_e4m3(x)};
  }
  EXPECT_EQ(bad, 0);
}

TEST(E4M3, SaturationAndSpecials) {
  EXPECT_EQ(float_to_e4m3(448.0f), 0x7e);
  EXPECT_EQ(float_to_e4m3(449.0f), 0x7e);
  EXPECT_EQ(float_to_e4m3(479.99f), 0x7e);  // beyond the 464 midpoint: still saturates
  EXPECT_EQ(float_to_e4m3(1e30f), 0x7e);
  EXPECT_EQ(float_to_e4m3(-1e30f), 0xfe);
  EXPECT_EQ(float_to_e4m3(std::numeric_limits<float>::max()), 0x7e);
  EXPECT_EQ(float_to_e4m3(0.0f), 0x00);
  EXPECT_EQ(float_to_e4m3(-0.0f), 0x80);
  EXPECT_EQ(float_to_e4m3(std::ldexp(1.0f, -11)), 0x00);   // a quarter step: rounds to 0
  EXPECT_EQ(float_to_e4m3(std::ldexp(1.0f, -10)), 0x00);   // half the smallest: tie to even 0
  EXPECT_EQ(float_to_e4m3(std::ldexp(1.5f, -10)), 0x01);   // above half: the smallest subnormal
  EXPECT_EQ(float_to_e4m3(-std::ldexp(1.0f, -10)), 0x80);  // -0
  EXPECT_EQ(float_to_e4m3(std::numeric_limits<float>::denorm_min()), 0x00);
  EXPECT_EQ(float_to_e4m3(NAN), 0x7f);
  EXPECT_EQ(float_to_e4m3(-NAN), 0xff);
}

TEST(E4M3, ComparatorOverAllCodes) {
  // Walk the number line from -448 to +448: each neighbour pair passes, each pair two steps apart
  // fails, in both orders.
  std::vector<uint8_t> line;
  for (int m = 0x7e; m >= 1; --m) line.push_back(static_cast<uint8_t>(0x80 | m));
  line.push_back(0x00);
  for (int m = 1; m <= 0x7e; ++m) line.push_back(static_cast<uint8_t>(m));
  ASSERT_EQ(line.size(), 253u);
  for (size_t i = 0; i < line.size(); ++i) {
    EXPECT_TRUE(e4m3_within_one_step(line[i], line[i]));
    if (i + 1 < line.size()) {
      EXPECT_TRUE(e4m3_within_one_step(line[i], line[i + 1])) << int{line[i]};
      EXPECT_TRUE(e4m3_within_one_step(line[i + 1], line[i])) << int{line[i]};
      EXPECT_LT(e4m3_to_float(line[i]), e4m3_to_float(line[i + 1]));
    }
    if (i + 2 < line.size()) {
      EXPECT_FALSE(e4m3_within_one_step(line[i], line[i + 2])) << int{line[i]};
      EXPECT_FALSE(e4m3_within_one_step(line[i + 2], line[i])) << int{line[i]};
    }
  }
  // +0 and -0 are the same point: equal, and both adjacent to +-smallest subnormal.
  EXPECT_TRUE(e4m3_within_one_step(0x00, 0x80));
  EXPECT_TRUE(e4m3_within_one_step(0x80, 0x00));
  EXPECT_TRUE(e4m3_within_one_step(0x80, 0x01));
  EXPECT_TRUE(e4m3_within_one_step(0x80, 0x81));
  EXPECT_FALSE(e4m3_within_one_step(0x81, 0x01));  // -2^-9 vs +2^-9: two steps across zero
  EXPECT_FALSE(e4m3_within_one_step(0x7e, 0xfe));
  EXPECT_EQ(e4m3_ordinal(0x80), 0);
  EXPECT_EQ(e4m3_ordinal(0x7e), 126);
  EXPECT_EQ(e4m3_ordinal(0xfe), -126);
  // NaN never passes, against anything, itself included.
  for (int c = 0; c < 256; ++c) {
    EXPECT_FALSE(e4m3_within_one_step(0x7f, static_cast<uint8_t>(c))) << c;
    EXPECT_FALSE(e4m3_within_one_step(static_cast<uint8_t>(c), 0xff)) << c;
  }
}

TEST(E8M0, AllCodes) {
  for (int v = 0; v < 255; ++v) {
    const float f = e8m0_to_float(static_cast<uint8_t>(v));
    EXPECT_EQ(static_cast<double>(f), std::ldexp(1.0, v - 127)) << v;
  }
  EXPECT_EQ(e8m0_to_float(0), std::ldexp(1.0f, -127));  // a subnormal fp32, still exact
  EXPECT_EQ(e8m0_to_float(254), std::ldexp(1.0f, 127));
}

TEST(BF16, EveryPatternRoundTrips) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const float x = bf16_to_float(static_cast<uint16_t>(b));
    if (std::isnan(x)) {
      EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(x))));
      continue;
    }
    EXPECT_EQ(float_to_bf16(x), b) << b;
  }
  EXPECT_EQ(float_to_bf16(INFINITY), 0x7f80);
  EXPECT_EQ(float_to_bf16(-INFINITY), 0xff80);
  // The largest finite float rounds up to infinity (round to nearest even, no saturation).
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()), 0x7f80);
}

}  // namespace
}  // namespace m3attn
