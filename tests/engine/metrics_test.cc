// Serving metrics on hand-built traces: percentiles, per-phase means, TTFT, TPOT and throughput.
#include "engine/metrics.h"

#include <gtest/gtest.h>

namespace m3attn {
namespace {

TEST(Metrics, PercentileInterpolatesBetweenRanks) {
  EXPECT_EQ(percentile({}, 50), 0.0);
  EXPECT_EQ(percentile({7}, 90), 7.0);
  EXPECT_DOUBLE_EQ(percentile({4, 1, 3, 2}, 50), 2.5);                     // h = 1.5
  EXPECT_DOUBLE_EQ(percentile({1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, 90), 9.1);  // h = 8.1
  EXPECT_DOUBLE_EQ(percentile({10, 20, 30}, 0), 10.0);
  EXPECT_DOUBLE_EQ(percentile({10, 20, 30}, 100), 30.0);
  EXPECT_DOUBLE_EQ(percentile({10, 20, 30}, 75), 25.0);
}

StepRecord step(StepPhase phase, int64_t ctx, int64_t gen, int64_t out, double us) {
  StepRecord s;
  s.phase = phase;
  s.context_tokens = ctx;
  s.generation_tokens = gen;
  s.output_tokens = out;
  s.step_us = us;
  return s;
}

RequestRecord request(int64_t id, double admit, double first, double finish) {
  RequestRecord r;
  r.id = id;
  r.admit_us = admit;
  r.first_token_us = first;
  r.finish_us = finish;
  return r;
}

TEST(Metrics, HandBuiltTrace) {
  // Two requests of input 100 and output 3 (TPOT over 2 intervals):
  //   step 1 prefill 100 tokens (r0 first token), 400 us
  //   step 2 mixed   100 + 1 tokens (r1 first, r0 2nd), 500 us
  //   step 3 decode  2 tokens (r0 done, r1 2nd), 100 us
  //   step 4 decode  1 token (r1 done), 60 us
  const std::vector<StepRecord> steps = {
      step(StepPhase::kPrefill, 100, 0, 1, 400), step(StepPhase::kMixed, 100, 1, 2, 500),
      step(StepPhase::kDecode, 0, 2, 2, 100), step(StepPhase::kDecode, 0, 1, 1, 60)};
  const std::vector<RequestRecord> reqs = {request(0, 0, 400, 1000), request(1, 0, 900, 1060)};
  const ServingMetrics m = compute_metrics(steps, reqs, 3);
  EXPECT_EQ(m.steps, 4);
  EXPECT_DOUBLE_EQ(m.duration_us, 1060);
  EXPECT_EQ(m.prefill.steps, 1);
  EXPECT_EQ(m.mixed.steps, 1);
  EXPECT_EQ(m.decode.steps, 2);
  EXPECT_EQ(m.mixed.tokens, 101);
  EXPECT_DOUBLE_EQ(m.prefill.mean_us(), 400);
  EXPECT_DOUBLE_EQ(m.mixed.mean_us(), 500);
  EXPECT_DOUBLE_EQ(m.decode.mean_us(), 80);
  EXPECT_EQ(m.requests, 2);
  EXPECT_EQ(m.input_tokens, 200);
  EXPECT_EQ(m.output_tokens, 6);
  // TTFT 400 and 900: median 650, p90 = 400 + 0.9 * 500 = 850.
  EXPECT_DOUBLE_EQ(m.ttft_median_us, 650);
  EXPECT_DOUBLE_EQ(m.ttft_p90_us, 850);
  EXPECT_DOUBLE_EQ(m.ttft_mean_us, 650);
  // TPOT (1000 - 400) / 2 = 300 and (1060 - 900) / 2 = 80: median 190, p90 = 80 + 0.9 * 220.
  EXPECT_DOUBLE_EQ(m.tpot_median_us, 190);
  EXPECT_DOUBLE_EQ(m.tpot_p90_us, 278);
  EXPECT_DOUBLE_EQ(m.output_tokens_per_s, 6 / 1060e-6);
  EXPECT_DOUBLE_EQ(m.total_tokens_per_s, 206 / 1060e-6);
}

TEST(Metrics, UnfinishedRequestsAndSingleTokenOutputs) {
  const std::vector<StepRecord> steps = {step(StepPhase::kPrefill, 10, 0, 1, 50)};
  const std::vector<RequestRecord> reqs = {request(0, 0, 50, 50), request(1, 0, -1, -1),
                                           RequestRecord{}};
  const ServingMetrics m = compute_metrics(steps, reqs, 1);
  EXPECT_EQ(m.requests, 1);
  EXPECT_DOUBLE_EQ(m.ttft_median_us, 50);
  EXPECT_EQ(m.tpot_median_us, 0.0);  // output length 1 has no TPOT
  EXPECT_EQ(m.mixed.mean_us(), 0.0);
  const ServingMetrics empty = compute_metrics({}, {}, 4);
  EXPECT_EQ(empty.output_tokens_per_s, 0.0);
  EXPECT_EQ(empty.steps, 0);
}

}  // namespace
}  // namespace m3attn
