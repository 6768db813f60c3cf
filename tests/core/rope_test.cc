#include "core/rope.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "m3attn/config.h"

namespace m3attn {
namespace {

// Independent evaluation of SPEC section 3: f_i = theta^(-i/32), a = p * f_i.
double angle(int64_t p, int i, double theta) {
  return static_cast<double>(p) * std::exp(-std::log(theta) * i / 32.0);
}

TEST(RopeTable, MatchesTheFormula) {
  const double theta = 5e6;
  const int64_t max_pos = 3000;
  auto t = make_rope_table(max_pos, theta);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  const Tensor& table = t.value();
  EXPECT_EQ(table.dtype(), DType::kF32);
  EXPECT_EQ(table.shape(), (std::vector<int64_t>{max_pos, 2, 32}));
  const float* v = table.ptr<float>();
  // Position 0: identity rotation.
  for (int i = 0; i < 32; ++i) {
    EXPECT_EQ(v[i], 1.0f);
    EXPECT_EQ(v[32 + i], 0.0f);
  }
  // Channel 0 rotates by exactly p radians.
  EXPECT_FLOAT_EQ(v[(1 * 2 + 0) * 32], static_cast<float>(std::cos(1.0)));
  EXPECT_FLOAT_EQ(v[(1 * 2 + 1) * 32], static_cast<float>(std::sin(1.0)));
  double worst = 0;
  for (int64_t p = 0; p < max_pos; ++p) {
    for (int i = 0; i < 32; ++i) {
      const double a = angle(p, i, theta);
      // Rounded once from double: within half an fp32 ulp of 1 plus the double error in `a`.
      worst = std::fmax(worst, std::fabs(v[(p * 2 + 0) * 32 + i] - std::cos(a)));
      worst = std::fmax(worst, std::fabs(v[(p * 2 + 1) * 32 + i] - std::sin(a)));
      // cos^2 + sin^2 == 1 to fp32 precision.
      const double c = v[(p * 2 + 0) * 32 + i], s = v[(p * 2 + 1) * 32 + i];
      ASSERT_NEAR(c * c + s * s, 1.0, 2.5e-7) << p << ", " << i;
    }
  }
  EXPECT_LE(worst, 6.0e-8 + 1e-12);  // 2^-24 ~ 5.96e-8
}

TEST(RopeTable, LargePositionsAndOtherTheta) {
  // Positions past 2^16: the angle is formed in double, so the table stays accurate.
  auto t = make_rope_table(70005, 1e4);
  ASSERT_TRUE(t.ok());
  const float* v = t.value().ptr<float>();
  for (int64_t p : {int64_t{65536}, int64_t{70004}}) {
    for (int i : {0, 1, 17, 31}) {
      const double a = angle(p, i, 1e4);
      EXPECT_NEAR(v[(p * 2 + 0) * 32 + i], std::cos(a), 1e-7) << p << ", " << i;
      EXPECT_NEAR(v[(p * 2 + 1) * 32 + i], std::sin(a), 1e-7) << p << ", " << i;
    }
  }
  // The slowest channel of theta 1e4 turns by 1e4^(-31/32) per position.
  EXPECT_NEAR(v[(1 * 2 + 1) * 32 + 31], std::sin(std::pow(1e4, -31.0 / 32.0)), 1e-9);
}

TEST(RopeTable, RejectsBadArguments) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  struct Case {
    int64_t max_pos;
    double theta;
    const char* needle;
  };
  for (const Case& c : {Case{0, 5e6, "max_pos > 0, got 0"}, Case{-4, 5e6, "max_pos > 0, got -4"},
                        Case{16, 0.0, "rope theta must be finite and > 0"},
                        Case{16, -5e6, "rope theta must be finite and > 0"},
                        Case{16, nan, "rope theta must be finite and > 0"},
                        Case{16, inf, "rope theta must be finite and > 0"}}) {
    auto t = make_rope_table(c.max_pos, c.theta);
    ASSERT_FALSE(t.ok()) << c.needle;
    EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(t.status().message().find(c.needle), std::string::npos) << t.status().to_string();
  }
}

}  // namespace
}  // namespace m3attn
