// The prefill-size block-scaled FP8 GEMM on Hopper (gemm_prefill_kernel.cuh): the math of
// run_gemm_cpu (SPEC section 2) for large M, a persistent warp-specialised wgmma kernel with
// 128 x 128 output tiles.
// Contract (besides validate_gemm):
//   - every tensor on the current CUDA device, an sm_90 device;
//   - any M >= 0 (rows past M are neither read from A beyond its extent nor written; M == 0
//     launches nothing), N % 128 == 0, K % 128 == 0, M, N, K < 2^31;
//   - activation scales token-major: strides (1, s1) with s1 % 4 == 0 and a 16-byte aligned base
//     (the layout of gemm_activation_scales_view for a padded M); any weight-scale strides.
// Deterministic (each output is summed by one thread in K order). Allocates nothing, never
// synchronizes, CUDA-graph capturable (the TMA descriptors are encoded on the host at every call).
#pragma once

#if defined(M3ATTN_WITH_CUDA)
#include <cuda_runtime_api.h>

#include "m3attn/status.h"
#include "stages/projection/projection.h"

namespace m3attn {

struct GemmPrefillOptions {
  // CTAs per thread-block cluster: 1, or 2 (the pair computes vertically adjacent tiles and
  // multicasts the shared weight tile, each CTA loading half of it).
  int cluster = 2;
  // Raster group: tiles are visited in groups of `group_m` m tiles (rounded up to whole clusters)
  // by every n tile, m fastest.
  int group_m = 16;
};

// OK when run_gemm_prefill_cuda can serve `p` on the current device (sm_90, token-major
// activation scales with s1 % 4 == 0); unsupported naming the reason otherwise.
Status gemm_prefill_supported(const GemmParams& p);

Status run_gemm_prefill_cuda(const GemmParams& p, cudaStream_t stream,
                             const GemmPrefillOptions& options = {});

}  // namespace m3attn

#endif  // M3ATTN_WITH_CUDA
