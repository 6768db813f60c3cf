// Split merge of the paged FP8 attention (flash-decoding): when the blocks of a (tile, KV head) are
// split over several CTAs (AttentionCudaConfig::splits > 1), every kernel of attention_kernel.cuh,
// attention_verify_wgmma.cuh and attention_prefill_wgmma.cuh writes unnormalised partials (o, m, l)
// into the workspace and this kernel combines them with log-sum-exp weights.
#pragma once

#include <cstdint>

#include "core/pdl.cuh"
#include "stages/attention/attention_kernel.cuh"

namespace m3attn {
namespace attention_kernel {

// Split merge: o = sum_s 2^(m_s - M) o_s / sum_s 2^(m_s - M) l_s. Grid (T, n_kv, group): one
// (token, KV head, query head) per CTA, kMergeThreads threads, one pair of dims per thread (a
// grid over heads keeps enough CTAs and loads in flight at batch 1, where the partials may come
// from DRAM).
constexpr int kMergeThreads = kDim / 2;
__global__ void __launch_bounds__(kMergeThreads) attention_merge_kernel(const AttnArgs a) {
  __shared__ float s_w[kMaxSplits];
  __shared__ float s_red[kMergeThreads / 32];
  const int64_t t = blockIdx.x;
  const int g = blockIdx.y, h = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t slot0 = (t * a.n_kv + g) * a.splits;
  pdl_wait();  // the partials of the attention kernel (launched programmatically or not)
  pdl_launch_dependents();
  // Only tokens that a request owns got partials (for monotone query_start: [qs[0], qs[R])); the
  // outputs of other rows stay untouched, as without a split.
  if (a.R <= 0 || t < a.query_start[0] || t >= a.query_start[a.R]) return;
  const float* ml = a.ws_ml + (slot0 * kRows + h) * 2;  // split s: ml[s * kRows * 2 + {0, 1}]
  float M = -INFINITY;
  for (int s = tid; s < a.splits; s += kMergeThreads) M = fmaxf(M, ml[s * kRows * 2]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
  if (lane == 0) s_red[warp] = M;
  __syncthreads();
  M = s_red[0];
#pragma unroll
  for (int w = 1; w < kMergeThreads / 32; ++w) M = fmaxf(M, s_red[w]);
  __syncthreads();  // s_red is reused
  float L = 0.0f;
  for (int s = tid; s < a.splits; s += kMergeThreads) {
    const float w = M == -INFINITY ? 0.0f : exp2f(ml[s * kRows * 2] - M);
    s_w[s] = w;
    L += w * ml[s * kRows * 2 + 1];
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) L += __shfl_xor_sync(0xffffffffu, L, o);
  if (lane == 0) s_red[warp] = L;
  __syncthreads();  // s_w and s_red complete
  L = 0.0f;
#pragma unroll
  for (int w = 0; w < kMergeThreads / 32; ++w) L += s_red[w];
  const float inv = L > 0.0f ? 1.0f / L : 0.0f;
  const float* op = a.ws_o + (slot0 * kRows + h) * kDim + 2 * tid;  // split s: + s * kRows * kDim
  float ox = 0.0f, oy = 0.0f;
#pragma unroll 4
  for (int s = 0; s < a.splits; ++s) {
    const float w = s_w[s];
    const float2 v = *reinterpret_cast<const float2*>(op + static_cast<int64_t>(s) * kRows * kDim);
    ox += w * v.x;
    oy += w * v.y;
  }
  const uint32_t w = pack_bf16x2(ox * inv, oy * inv);
  const int64_t col = static_cast<int64_t>(g * a.group + h) * kDim;
  *reinterpret_cast<uint32_t*>(a.out + t * a.out_stride + col + 2 * tid) = w;
  if (a.out_q == nullptr) return;  // CTA-uniform
  // o_proj's E4M3 input: the row's 1x128 block over the CTA (s_red reused after the barrier).
  float am = amax_pair(w);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, o));
  __syncthreads();  // every thread read s_red (L) above
  if (lane == 0) s_red[warp] = am;
  __syncthreads();
  am = s_red[0];
#pragma unroll
  for (int k = 1; k < kMergeThreads / 32; ++k) am = fmaxf(am, s_red[k]);
  const float sc = quant_scale(am);
  *reinterpret_cast<uint16_t*>(a.out_q + t * (int64_t{a.n_kv} * a.group * kDim) + col + 2 * tid) =
      static_cast<uint16_t>(quant_pair(w, sc, quant_rcp(sc)));
  if (tid == 0) a.out_scales[t * a.sc_stride_t + (g * a.group + h) * a.sc_stride_h] = sc;
}

}  // namespace attention_kernel
}  // namespace m3attn
