// Host reference of the math between the layers of a LayerStack (layer_stack.h): synthetic token
// embedding, plain unit-weight RMSNorm and the bf16 residual add. The CPU stack runs these; the
// CUDA stack's kernels are tested against them.
#pragma once

#include <cstdint>

#include "cache/step_plan.h"

namespace m3attn {

// h[t, c] = synthetic_hidden_bf16(seed, request of token t, positions[t], c) for the plan's tokens
// (request of token t from request_ids and query_start). h: bf16 bits [T, hidden], row-major.
void embed_synthetic_tokens(const StepPlan& plan, uint64_t seed, int hidden, uint16_t* h);

// x[t, :] = bf16(h[t, :] * rsqrt(mean(h[t, :]^2) + eps)), fp32 math (sum in fp32, channel order).
void rmsnorm_unit_bf16(const uint16_t* h, int64_t tokens, int hidden, float eps, uint16_t* x);

// h[i] = bf16(float(h[i]) + float(a[i])) for i in [0, n).
void residual_add_bf16(uint16_t* h, const uint16_t* a, int64_t n);

}  // namespace m3attn
