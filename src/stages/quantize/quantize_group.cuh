// Device helpers of the activation quantization (quantize_kernel.cuh) shared with kernels that
// quantize rows they compute themselves (the stack's fused residual + RMSNorm + quantize,
// engine/residual_norm.cu): the 1x128 group math of the CPU twin, one group per half-warp.
// Inline device functions only, so any number of translation units may include it.
#pragma once

#include <cstdint>

#include "core/numeric.h"

namespace m3attn::quantize_detail {

constexpr int kThreadsPerGroup = 16;  // 16 threads x 8 bf16 = 128 channels

__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

// The 8 bf16 values of one 16-byte vector, in order.
__device__ __forceinline__ void unpack_bf16x8(const uint4& v, float (&x)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    x[2 * i] = bf16_lo(w[i]);
    x[2 * i + 1] = bf16_hi(w[i]);
  }
}

// One 128-channel group held by the 16 lanes of a half-warp (`half_mask`), 8 values per lane:
// returns this lane's 8 E4M3 codes (little-endian in a uint2) and the group's scale in *scale
// (every lane). The numerics of the CPU twin (see quantize_kernel.cuh).
__device__ __forceinline__ uint2 quantize_group8(const float (&x)[8], unsigned half_mask,
                                                 float* scale) {
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(x[i]));
#pragma unroll
  for (int off = kThreadsPerGroup / 2; off > 0; off /= 2)
    amax = fmaxf(amax, __shfl_xor_sync(half_mask, amax, off));
  const float s = amax > 0.0f ? __fdiv_rn(amax, kE4M3Max) : 1.0f;
  uint32_t packed[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t code = float_to_e4m3(__fdiv_rn(x[i], s));
    packed[i / 4] |= code << (8 * (i % 4));
  }
  *scale = s;
  return make_uint2(packed[0], packed[1]);
}

// The shuffle mask of this thread's half-warp.
__device__ __forceinline__ unsigned half_warp_mask() {
  return (threadIdx.x & 16u) ? 0xffff0000u : 0x0000ffffu;
}

}  // namespace m3attn::quantize_detail
