// The RoPE table shared by every head and both producer paths (SPEC section 3):
// f32 [max_pos, 2, 32], table[p][0][i] = cos(p * theta^(-i/32)), table[p][1][i] = sin(...),
// computed in double and rounded once to fp32.
#pragma once

#include "m3attn/tensor.h"

namespace m3attn {

Result<Tensor> make_rope_table(int64_t max_pos, double theta);

// A host, contiguous f32 [max_pos > 0, 2, 32] table (what the layers keep and upload).
Status validate_rope_table(const TensorView& rope);

}  // namespace m3attn
