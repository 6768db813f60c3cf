// Activation quantization kernel (SPEC section 2): BF16 [M, K] -> E4M3 [M_pad, K] plus one fp32
// scale per row per 128 channels.
//
// Work decomposition: one "group" = one (row, 128-channel block). 16 consecutive threads (half a
// warp) own a group: each loads 8 bf16 (one 16-byte vector), the half-warp reduces amax with four
// xor shuffles, every thread converts its 8 values and stores 8 bytes, and the group's first
// thread stores the scale. Groups are walked with a grid-stride loop; the group order is chosen so
// that the scale stores of neighbouring groups are contiguous: row-fastest when the scales are
// row-fastest in memory (the cuBLASLt 1x128 layout, stride (1, M_pad)), block-fastest otherwise.
//
// Numerics are those of the CPU twin (run_quantize_cpu), operation for operation:
//   amax = fmax over |x| (a NaN input never becomes the amax), scale = amax / 448 (IEEE division,
//   1 when amax == 0), q = e4m3(x / scale) with IEEE division (not x * (1 / scale)), round to
//   nearest even with saturation. __fdiv_rn pins the division to round-to-nearest whatever the
//   compiler flags. The only difference from the twin is the sign bit of a NaN code: the device
//   produces canonical NaNs, x86 keeps the sign of the NaN it divides (and makes inf/inf
//   negative), so NaN inputs give NaN codes on both sides whose sign may differ.
//
// Programmatic dependent launch (core/pdl.cuh): every thread waits for the preceding grid
// (pdl_wait) before its first load of `in` and its first store, and lets the next grid launch at
// once (pdl_launch_dependents: it waits for this grid in turn). Both are no-ops under a normal
// launch; run_quantize_cuda's `programmatic` picks the launch. Session 13 measured a PDL launch of
// this kernel alone as noise (its neighbours launched normally); session 14 built the whole
// decode chain that way (CudaMsaLayer::set_programmatic_stages), measured it faster only for the
// unfused layer step, and left it off by default (docs/PERF.md).
//
// Bytes moved: 2 M K (read) + M_pad K (write) + 4 M_pad K / 128 (scales). Memory bound: at M = 4,
// K = 6144 the whole call moves ~75 KB and costs a launch (~3 us); at M = 16384 it moves ~300 MB
// (~75 us at 4 TB/s).
#pragma once

#include <cstdint>

#include "core/numeric.h"
#include "core/pdl.cuh"
#include "stages/quantize/quantize_group.cuh"

namespace m3attn::quantize_detail {

constexpr int kBlockThreads = 256;  // 16 groups per thread block

struct QuantizeKernelArgs {
  const uint16_t* in;     // bf16 [rows, K], row stride in_row_stride (multiple of 8), 16 B aligned
  int64_t in_row_stride;  // elements
  uint8_t* out;           // e4m3 [m_pad, K] contiguous, 16 B aligned
  float* scales;          // f32 [m_pad, K / 128] at scales[m * s0 + kb * s1]
  int64_t s0;
  int64_t s1;
  int64_t rows;      // valid rows
  int64_t m_pad;     // rows of out / scales
  int64_t kblocks;   // K / 128
  bool row_fastest;  // group order: row index fastest (true) or block index fastest
};

__global__ void __launch_bounds__(kBlockThreads) quantize_rows_kernel(QuantizeKernelArgs a) {
  pdl_launch_dependents();
  pdl_wait();
  const int64_t groups = a.m_pad * a.kblocks;
  const int sub = static_cast<int>(threadIdx.x) % kThreadsPerGroup;  // lane within the group
  // The two groups of a warp may leave the loop on different iterations: shuffles name only the
  // 16 lanes of this thread's own half-warp.
  const unsigned half_mask = half_warp_mask();
  const int64_t groups_per_grid =
      static_cast<int64_t>(gridDim.x) * (kBlockThreads / kThreadsPerGroup);
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * (kBlockThreads / kThreadsPerGroup) +
                   threadIdx.x / kThreadsPerGroup;
       g < groups; g += groups_per_grid) {
    int64_t m, kb;
    if (a.row_fastest) {
      m = g % a.m_pad;
      kb = g / a.m_pad;
    } else {
      m = g / a.kblocks;
      kb = g % a.kblocks;
    }
    const int64_t k_total = a.kblocks * 128;
    uint8_t* q = a.out + m * k_total + kb * 128 + sub * 8;
    float* scale_out = a.scales + m * a.s0 + kb * a.s1;
    if (m >= a.rows) {  // padding row: contributes nothing to a GEMM
      *reinterpret_cast<uint2*>(q) = make_uint2(0u, 0u);
      if (sub == 0) *scale_out = 1.0f;
      continue;
    }
    float x[8];
    unpack_bf16x8(
        __ldg(reinterpret_cast<const uint4*>(a.in + m * a.in_row_stride + kb * 128 + sub * 8)), x);
    float scale;
    *reinterpret_cast<uint2*>(q) = quantize_group8(x, half_mask, &scale);
    if (sub == 0) *scale_out = scale;
  }
}

}  // namespace m3attn::quantize_detail
