// synthetic_input.h: determinism, bf16 values, the Irwin-Hall(4) construction against an fp64
// evaluation, and the distribution (mean 0, variance 1, bounded, bell-shaped).
#include "engine/synthetic_input.h"

#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "cache/step_plan.h"
#include "engine/stack_math.h"
#include "support/test_util.h"

namespace m3attn {
namespace {

TEST(SyntheticInput, DeterministicAndSensitiveToEveryCoordinate) {
  const uint64_t seed = testing::fresh_seed();
  M3_SEED_TRACE(seed);
  testing::Rng rng(seed);
  for (int i = 0; i < 1000; ++i) {
    const uint64_t s = seed + static_cast<uint64_t>(rng.integer(0, 1 << 20));
    const int64_t r = rng.integer(0, 1 << 20), p = rng.integer(0, 1 << 20),
                  c = rng.integer(0, 6143);
    EXPECT_EQ(synthetic_hidden_bf16(s, r, p, c), synthetic_hidden_bf16(s, r, p, c));
    const uint64_t h = synthetic_hash(s, r, p, c);
    // 64-bit hashes: a collision between neighbours would mean a coordinate is ignored.
    EXPECT_NE(h, synthetic_hash(s + 1, r, p, c));
    EXPECT_NE(h, synthetic_hash(s, r + 1, p, c));
    EXPECT_NE(h, synthetic_hash(s, r, p + 1, c));
    EXPECT_NE(h, synthetic_hash(s, r, p, c + 1));
    // Swapping coordinates gives other values (the chain is ordered).
    if (r != p) {
      EXPECT_NE(h, synthetic_hash(s, p, r, c));
    }
  }
}

TEST(SyntheticInput, ValueIsTheBf16OfTheIrwinHallSum) {
  const uint64_t seed = testing::fresh_seed();
  M3_SEED_TRACE(seed);
  const double sigma = std::sqrt((65536.0 * 65536.0 - 1.0) / 3.0);
  for (int64_t c = 0; c < 20000; ++c) {
    const uint64_t h = synthetic_hash(seed, 3, 1000 + c / 7, c);
    const double s =
        static_cast<double>((h & 0xffff) + ((h >> 16) & 0xffff) + ((h >> 32) & 0xffff) + (h >> 48));
    const double expect = (s - 131070.0) / sigma;
    const uint16_t b = synthetic_hidden_bf16(seed, 3, 1000 + c / 7, c);
    const float v = synthetic_hidden_value(seed, 3, 1000 + c / 7, c);
    ASSERT_EQ(float_to_bf16(v), b) << "value is not a bf16 number";
    ASSERT_EQ(bf16_to_float(b), v);
    // Within one bf16 rounding (2^-8 relative) of the exact value (plus the fp32 rounding).
    ASSERT_LE(std::fabs(v - expect), std::fabs(expect) * (1.0 / 256.0) + 1e-7) << "channel " << c;
  }
}

TEST(SyntheticInput, ApproximatelyStandardNormal) {
  const uint64_t seed = testing::fresh_seed();
  M3_SEED_TRACE(seed);
  const int64_t n = 200000;
  double sum = 0, sq = 0;
  int64_t within1 = 0, beyond2 = 0, positive = 0;
  std::set<uint16_t> distinct;
  for (int64_t i = 0; i < n; ++i) {
    const double x = synthetic_hidden_value(seed, i % 97, i / 97, i % 1024);
    ASSERT_TRUE(std::isfinite(x));
    ASSERT_LE(std::fabs(x), 3.47);  // Irwin-Hall(4) range: +-2 sqrt(3)
    sum += x;
    sq += x * x;
    within1 += std::fabs(x) < 1.0;
    beyond2 += std::fabs(x) > 2.0;
    positive += x > 0;
    distinct.insert(synthetic_hidden_bf16(seed, i % 97, i / 97, i % 1024));
  }
  const double mean = sum / n, var = sq / n - mean * mean;
  // Standard error of the mean is 1 / sqrt(n) = 0.0022; of the variance about sqrt(1.8 / n).
  EXPECT_NEAR(mean, 0.0, 0.012);
  EXPECT_NEAR(var, 1.0, 0.02);
  // Irwin-Hall(4): P(|x| < 1) = 0.6693, P(|x| > 2) = 0.0425 (normal: 0.6827, 0.0455).
  EXPECT_NEAR(static_cast<double>(within1) / n, 0.6693, 0.01);
  EXPECT_NEAR(static_cast<double>(beyond2) / n, 0.0425, 0.004);
  EXPECT_NEAR(static_cast<double>(positive) / n, 0.5, 0.01);
  EXPECT_GT(distinct.size(), 1000u);  // many distinct bf16 values, not a handful
}

TEST(SyntheticInput, EmbedFollowsTheRequestAndPositionOfEachToken) {
  const uint64_t seed = testing::fresh_seed();
  M3_SEED_TRACE(seed);
  CacheManager cache(8);
  ASSERT_TRUE(cache.add_request(7).ok());
  ASSERT_TRUE(cache.reserve(7, 130).ok());
  ASSERT_TRUE(cache.add_request(9).ok());
  ASSERT_TRUE(cache.reserve(9, 5).ok());
  // A context chunk of new request 4, then requests 7 and 9 generating with one draft.
  Result<StepPlan> plan = plan_step(cache, {{{4, 0, 3}}, {{7, 130}, {9, 5}}, 1});
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  const int hidden = 136;
  std::vector<uint16_t> h(static_cast<size_t>(plan.value().num_tokens() * hidden), 0xffff);
  embed_synthetic_tokens(plan.value(), seed, hidden, h.data());
  const int64_t ids[] = {4, 4, 4, 7, 7, 9, 9};
  const int64_t pos[] = {0, 1, 2, 130, 131, 5, 6};
  ASSERT_EQ(plan.value().num_tokens(), 7);
  for (int t = 0; t < 7; ++t)
    for (int c = 0; c < hidden; ++c)
      ASSERT_EQ(h[static_cast<size_t>(t * hidden + c)],
                synthetic_hidden_bf16(seed, ids[t], pos[t], c))
          << "token " << t << " channel " << c;
}

}  // namespace
}  // namespace m3attn
