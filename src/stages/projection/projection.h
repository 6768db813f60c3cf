// FP8 block-scaled GEMM (SPEC section 2): out[m, n] = bf16( sum_kb sa[m, kb] * sb[n/128, kb] *
// sum_{k in kb} a[m, k] * b[n, k] ), E4M3 operands, fp32 accumulation, BF16 out. Serves the fused
// [Q|K|V|iQ|iK] projection, the unfused pair and o_proj.
#pragma once

#include <cstdint>

#include "m3attn/tensor.h"

#if defined(M3ATTN_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace m3attn {

struct GemmParams {
  TensorView a;         // e4m3 [M, K] activations, K % 128 == 0
  TensorView a_scales;  // f32 [M, K / 128], any strides
  TensorView b;         // e4m3 [N, K] weights (row n produces output column n), N % 128 == 0
  TensorView b_scales;  // f32 [N / 128, K / 128], any strides
  TensorView out;       // bf16 [M, N], last stride 1
};

Status validate_gemm(const GemmParams& p);
Status run_gemm_cpu(const GemmParams& p);

}  // namespace m3attn
