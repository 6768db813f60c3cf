// The math between the layers of the CUDA LayerStack (layer_stack.h), as device kernels; the host
// reference is stack_math.h (embed_synthetic_tokens, rmsnorm_unit_bf16, residual_add_bf16).
//
//   run_synthetic_embed_cuda   h[t, c] = synthetic_hidden_bf16(seed, token_request[t],
//   positions[t], c)
//                              (bit-identical to the host: integer hash + one exact fp32 multiply)
//   run_residual_rmsnorm_cuda  optionally h = bf16(h + a) (when a != null), then optionally
//                              x = bf16(h * (1 / sqrt(sum(h^2) / hidden + eps))) (when x != null);
//                              one CTA per row, fp32 tree sum (differs from the host's sequential
//                              sum by fp32 rounding only, so x may differ by one bf16 ulp), IEEE
//                              sqrt and division like the host.
//   run_residual_rmsnorm_quantize_cuda
//                              the same residual add and RMSNorm (same sums, same bf16 x), with x
//                              not stored but quantized in the same kernel exactly as
//                              run_quantize_cuda (1x128 E4M3 + fp32 scales, padding rows q = 0 /
//                              scale = 1): byte-identical to run_residual_rmsnorm_cuda followed by
//                              run_quantize_cuda, one kernel and one bf16 round trip less.
// All: rows x hidden bf16 row-major (row stride = hidden), no sync, no allocation, capturable.
// `programmatic`: launched with programmatic dependent launch (core/pdl.cuh): the kernel may start
// while the preceding kernel finishes and waits for it before touching memory (same bytes).
#pragma once

#if defined(M3ATTN_WITH_CUDA)
#include <cuda_runtime_api.h>

#include <cstdint>

#include "m3attn/status.h"
#include "stages/quantize/quantize.h"

namespace m3attn {

Status run_synthetic_embed_cuda(uint64_t seed, const int64_t* token_request,
                                const int32_t* positions, int64_t rows, int hidden, uint16_t* h,
                                cudaStream_t stream);

Status run_residual_rmsnorm_cuda(uint16_t* h, const uint16_t* a, uint16_t* x, int64_t rows,
                                 int hidden, float eps, cudaStream_t stream,
                                 bool programmatic = false);

// h (and a, when not null) bf16 [q.rows, hidden] with hidden = q.in.shape[1]; writes q.out and
// q.scales as run_quantize_cuda(q) would for x = rmsnorm(h) (q.in is validated but not read: it
// names the x the layer would have read). q.rows == 0 launches nothing.
Status run_residual_rmsnorm_quantize_cuda(uint16_t* h, const uint16_t* a, const QuantizeParams& q,
                                          float eps, cudaStream_t stream,
                                          bool programmatic = false);

}  // namespace m3attn

#endif  // M3ATTN_WITH_CUDA
