#include "engine/stack_math.h"

#include <cmath>

#include "core/numeric.h"
#include "engine/synthetic_input.h"

namespace m3attn {

void embed_synthetic_tokens(const StepPlan& plan, uint64_t seed, int hidden, uint16_t* h) {
  for (int r = 0; r < plan.num_requests(); ++r) {
    const int64_t id = plan.request_ids[static_cast<size_t>(r)];
    for (int32_t t = plan.query_start[static_cast<size_t>(r)];
         t < plan.query_start[static_cast<size_t>(r) + 1]; ++t) {
      const int64_t pos = plan.positions[static_cast<size_t>(t)];
      uint16_t* row = h + int64_t{t} * hidden;
      for (int c = 0; c < hidden; ++c) row[c] = synthetic_hidden_bf16(seed, id, pos, c);
    }
  }
}

void rmsnorm_unit_bf16(const uint16_t* h, int64_t tokens, int hidden, float eps, uint16_t* x) {
  for (int64_t t = 0; t < tokens; ++t) {
    const uint16_t* in = h + t * hidden;
    uint16_t* out = x + t * hidden;
    float ss = 0.0f;
    for (int c = 0; c < hidden; ++c) {
      const float v = bf16_to_float(in[c]);
      ss += v * v;
    }
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(hidden) + eps);
    for (int c = 0; c < hidden; ++c) out[c] = float_to_bf16(bf16_to_float(in[c]) * inv);
  }
}

void residual_add_bf16(uint16_t* h, const uint16_t* a, int64_t n) {
  for (int64_t i = 0; i < n; ++i) h[i] = float_to_bf16(bf16_to_float(h[i]) + bf16_to_float(a[i]));
}

}  // namespace m3attn
