// Serving metrics of one run, from the scheduler's step and request records (simulated time: the
// clock advances by each step's measured time, so host overheads between steps do not count).
//
//   per phase       steps, tokens and mean / total step time of prefill-only, mixed and
//                   decode-only steps
//   TTFT            first_token_us - admit_us per request (admission to the end of the step that
//                   ran its last prompt chunk)
//   TPOT            (finish_us - first_token_us) / (output_len - 1) per request with output_len > 1
//   percentiles     linear interpolation between closest ranks (numpy's default): p-th of n sorted
//                   values is v[floor(h)] + (h - floor(h)) * (v[floor(h) + 1] - v[floor(h)]),
//                   h = p / 100 * (n - 1)
//   throughput      output tokens / duration, (input + output tokens) / duration
#pragma once

#include <cstdint>
#include <vector>

#include "engine/scheduler.h"

namespace m3attn {

// Percentile p in [0, 100] of the values (linear interpolation); 0 for an empty list.
double percentile(std::vector<double> values, double p);

struct PhaseStats {
  int64_t steps = 0;
  int64_t tokens = 0;  // context + generation tokens processed
  double total_us = 0;
  double mean_us() const { return steps ? total_us / static_cast<double>(steps) : 0.0; }
};

struct ServingMetrics {
  int64_t steps = 0;
  double duration_us = 0;  // sum of step times
  PhaseStats prefill, mixed, decode;
  int requests = 0;  // finished requests
  int64_t input_tokens = 0;
  int64_t output_tokens = 0;
  double ttft_median_us = 0, ttft_p90_us = 0, ttft_mean_us = 0;
  double tpot_median_us = 0, tpot_p90_us = 0, tpot_mean_us = 0;
  double output_tokens_per_s = 0;
  double total_tokens_per_s = 0;

  const PhaseStats& phase(StepPhase p) const;
};

// output_len: tokens per request (TPOT's denominator is output_len - 1). Unfinished requests are
// left out of TTFT / TPOT (a complete run has none).
ServingMetrics compute_metrics(const std::vector<StepRecord>& steps,
                               const std::vector<RequestRecord>& requests, int64_t output_len);

}  // namespace m3attn
