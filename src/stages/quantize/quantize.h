// Activation quantization (SPEC section 2): BF16 [M, K] -> E4M3 [M_pad, K] with one fp32 scale per
// token per 128 channels. scale = amax / 448 (1 where the block is all zero), q = e4m3(x / scale),
// so x ~= q * scale. Rows in [M, M_pad) (padding so cuBLASLt sees M % 4 == 0) get q = 0, scale = 1.
#pragma once

#include <cstdint>

#include "m3attn/tensor.h"

#if defined(M3ATTN_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace m3attn {

struct QuantizeParams {
  int64_t rows = 0;   // M (valid rows of `in`)
  TensorView in;      // bf16 [M, K], K % 128 == 0, last stride 1
  TensorView out;     // e4m3 [M_pad, K], M_pad >= M, contiguous
  TensorView scales;  // f32 [M_pad, K / 128], any strides (the GEMM picks the layout it needs)
};

Status validate_quantize(const QuantizeParams& p);
Status run_quantize_cpu(const QuantizeParams& p);
#if defined(M3ATTN_WITH_CUDA)
// programmatic: launch with programmatic dependent launch (core/pdl.cuh; the kernel waits for the
// preceding grid before touching memory, so the result is the same either way).
Status run_quantize_cuda(const QuantizeParams& p, cudaStream_t stream, bool programmatic = false);
#endif

}  // namespace m3attn
