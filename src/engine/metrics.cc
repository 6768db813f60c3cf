#include "engine/metrics.h"

#include <algorithm>
#include <cmath>

namespace m3attn {

double percentile(std::vector<double> values, double p) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  const double h = std::clamp(p, 0.0, 100.0) / 100.0 * static_cast<double>(values.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(h));
  const size_t hi = std::min(lo + 1, values.size() - 1);
  return values[lo] + (h - static_cast<double>(lo)) * (values[hi] - values[lo]);
}

const PhaseStats& ServingMetrics::phase(StepPhase p) const {
  switch (p) {
    case StepPhase::kPrefill:
      return prefill;
    case StepPhase::kMixed:
      return mixed;
    case StepPhase::kDecode:
      break;
  }
  return decode;
}

ServingMetrics compute_metrics(const std::vector<StepRecord>& steps,
                               const std::vector<RequestRecord>& requests, int64_t output_len) {
  ServingMetrics m;
  for (const StepRecord& s : steps) {
    PhaseStats& p = s.phase == StepPhase::kPrefill ? m.prefill
                    : s.phase == StepPhase::kMixed ? m.mixed
                                                   : m.decode;
    ++p.steps;
    p.tokens += s.context_tokens + s.generation_tokens;
    p.total_us += s.step_us;
    ++m.steps;
    m.duration_us += s.step_us;
    m.input_tokens += s.context_tokens;
    m.output_tokens += s.output_tokens;
  }
  std::vector<double> ttft, tpot;
  for (const RequestRecord& r : requests) {
    if (!r.finished()) continue;
    ++m.requests;
    ttft.push_back(r.first_token_us - r.admit_us);
    if (output_len > 1)
      tpot.push_back((r.finish_us - r.first_token_us) / static_cast<double>(output_len - 1));
  }
  auto mean = [](const std::vector<double>& v) {
    double s = 0;
    for (double x : v) s += x;
    return v.empty() ? 0.0 : s / static_cast<double>(v.size());
  };
  m.ttft_median_us = percentile(ttft, 50);
  m.ttft_p90_us = percentile(ttft, 90);
  m.ttft_mean_us = mean(ttft);
  m.tpot_median_us = percentile(tpot, 50);
  m.tpot_p90_us = percentile(tpot, 90);
  m.tpot_mean_us = mean(tpot);
  if (m.duration_us > 0) {
    m.output_tokens_per_s = static_cast<double>(m.output_tokens) / (m.duration_us * 1e-6);
    m.total_tokens_per_s =
        static_cast<double>(m.input_tokens + m.output_tokens) / (m.duration_us * 1e-6);
  }
  return m;
}

}  // namespace m3attn
