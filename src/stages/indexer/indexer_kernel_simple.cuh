// The CUDA-core scorer: the simple, exact path. It is the fallback for index caches whose base or
// page stride is not 16-byte aligned (the tensor-core path streams 16-byte vectors) and the second
// opinion the tests hold the tensor-core path against.
//
// One warp per (token, block) pair of the CTA's segment and split; lane l scores the keys
// l, l + 32, l + 64, l + 96 of the block for every head. Products of two E4M3 values are exact in
// double and so is every partial sum of 128 of them (multiples of 2^-18 below 2^25), so the score
// is the exact dot product rounded once to fp32: bit-identical to the CPU twin, whatever the order.
// Cost: ~2 x 128 x n_kv fp64 FMAs per key; fine for a fallback, far from the bandwidth bound.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "stages/indexer/indexer_kernel_common.cuh"

namespace m3attn::indexer_kernel {

constexpr int kSimpleWarps = 8;
constexpr int kSimpleThreads = kSimpleWarps * 32;

__device__ __forceinline__ float2 e4m3x2_to_float2(uint32_t two_bytes) {
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two_bytes & 0xffffu), __NV_E4M3);
  return __half22float2(__half2(h));
}

__device__ __forceinline__ void simple_segment(const KernelArgs& a, float (*q_smem)[kHeadDim],
                                               int r, int ta, int te) {
  const int lane = threadIdx.x & 31;
  // Largest position of the segment (each warp computes it; <= kPreRows tokens).
  int max_pos = -1;
  for (int t = ta + lane; t < te; t += 32) max_pos = max(max_pos, __ldg(a.positions + t));
  max_pos = __reduce_max_sync(0xffffffffu, max_pos);
  int b0 = 0, b1 = 0;
  const int nvis = blocks_to_score(a, max_pos);
  if (nvis == 0 || !split_range(a, nvis, b0, b1)) return;

  const int nb = b1 - b0;
  const int pairs = (te - ta) * nb;
  for (int pair = static_cast<int>(threadIdx.x >> 5); pair < pairs; pair += kSimpleWarps) {
    const int t = ta + pair / nb;
    const int b = b0 + pair % nb;
    const int pos = __ldg(a.positions + t);
    if (pos < 0 || b > pos / kPageSize) continue;  // not visible to this token: never read
    float* out = a.scores + (int64_t{t} * a.n_kv) * a.max_pages + b;
    const int64_t page = guarded_page(a, r, b);
    if (page < 0) {
      if (lane < a.n_kv) out[int64_t{lane} * a.max_pages] = quiet_nan();
      continue;
    }
    // The token's index-Q rows as floats (exact), one slot per head.
    __syncwarp();
    for (int i = lane; i < a.n_kv * kHeadDim; i += 32) {
      const uint8_t c = a.iq[int64_t{t} * a.n_kv * kHeadDim + i];
      q_smem[i / kHeadDim][i % kHeadDim] = e4m3x2_to_float2(c).x;
    }
    __syncwarp();

    float best[kMaxKv];
#pragma unroll
    for (int h = 0; h < kMaxKv; ++h) best[h] = neg_inf();
    const uint8_t* page_ptr = page_base(a, page);
    for (int row = lane; row < kPageSize; row += 32) {
      if (b * kPageSize + row > pos) break;  // rows ascend with the loop
      const uint32_t* key = reinterpret_cast<const uint32_t*>(page_ptr + row * kRowBytes);
      double acc[kMaxKv];
#pragma unroll
      for (int h = 0; h < kMaxKv; ++h) acc[h] = 0.0;
      for (int w = 0; w < kHeadDim / 4; ++w) {
        const uint32_t word = __ldg(key + w);
        const float2 k01 = e4m3x2_to_float2(word);
        const float2 k23 = e4m3x2_to_float2(word >> 16);
        const float k[4] = {k01.x, k01.y, k23.x, k23.y};
#pragma unroll
        for (int h = 0; h < kMaxKv; ++h) {
          if (h >= a.n_kv) break;
#pragma unroll
          for (int e = 0; e < 4; ++e)
            acc[h] =
                fma(static_cast<double>(q_smem[h][4 * w + e]), static_cast<double>(k[e]), acc[h]);
        }
      }
#pragma unroll
      for (int h = 0; h < kMaxKv; ++h) best[h] = block_max(best[h], __double2float_rn(acc[h]));
    }
    float mine = 0.0f;
#pragma unroll
    for (int h = 0; h < kMaxKv; ++h) {
      float v = best[h];
      v = warp_block_max_xor(v, 16);
      v = warp_block_max_xor(v, 8);
      v = warp_block_max_xor(v, 4);
      v = warp_block_max_xor(v, 2);
      v = warp_block_max_xor(v, 1);
      if (lane == h) mine = v;
    }
    if (lane < a.n_kv) out[int64_t{lane} * a.max_pages] = mine;
  }
}

__global__ void __launch_bounds__(kSimpleThreads, 1) score_simple_kernel(const KernelArgs a) {
  __shared__ float q_smem[kSimpleWarps][kMaxKv][kHeadDim];
  pdl_launch_dependents();
  pdl_wait();  // programmatic_launch: index_q and index-K may still be written before it
  float(*mine)[kHeadDim] = q_smem[threadIdx.x >> 5];
  for_each_segment(a, [&](int r, int ta, int te) { simple_segment(a, mine, r, ta, te); });
}

}  // namespace m3attn::indexer_kernel
