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
  // Thread-block cluster of cluster_m x cluster_n CTAs: 1 x 2 (default), 2 x 1 or 1 x 1. The CTAs
  // of a cluster compute a cluster_m x cluster_n block of output tiles; those sharing weight rows
  // (a cluster column) load 1 / cluster_m of the weight tile each and multicast it, those sharing
  // activation rows (a cluster row) 1 / cluster_n of the activation tile. Session 20 round E
  // (fused N 9856, K 6144, M 4096, integer operands): 1x2 1218 TFLOP/s, 2x1 1170, 1x1 991
  // (cuBLASLt 1421); 2x2 (1052, 120 CTAs resident) was deleted.
  int cluster_m = 1;
  int cluster_n = 2;
  // Raster group: tiles are visited in groups of `group_m` m tiles (rounded up to whole clusters)
  // by every n tile, m fastest. Session 22 (round G, 1x2, M 4096, random operands): 16 429.2-429.4
  // us, 8 435.7-436.5, 32 435.3-435.6.
  int group_m = 16;
};

// The CTAs run_gemm_prefill_cuda launches at most on the current device with these options (one
// wave of resident clusters).
Result<int> gemm_prefill_max_ctas(const GemmPrefillOptions& options = {});

// OK when run_gemm_prefill_cuda can serve `p` on the current device (sm_90, token-major
// activation scales with s1 % 4 == 0); unsupported naming the reason otherwise.
Status gemm_prefill_supported(const GemmParams& p);

Status run_gemm_prefill_cuda(const GemmParams& p, cudaStream_t stream,
                             const GemmPrefillOptions& options = {});

}  // namespace m3attn

#endif  // M3ATTN_WITH_CUDA
