// Small-M block-scaled FP8 GEMM (decode): out bf16 [M, N] = A e4m3 [M, K] x B e4m3 [N, K]^T with
// 1x128 activation scales and 128x128 weight scales, M <= 16. The same math as the cuBLASLt path
// and the CPU twin: per 128-wide K block an fp32 partial from the tensor cores, multiplied by
// sa[m, kb] * sb[n / 128, kb] and accumulated in fp32, rounded once to bf16.
//
// Why: at M <= 16 the GEMM is a weight stream (N K bytes, 60.6 MB for the fused projection) and
// cuBLASLt's block-scaled kernels reach ~64 % of the copy bandwidth there. This kernel aims at the
// bandwidth: every weight byte is loaded once, 16 bytes per thread, with a streaming cache hint,
// several blocks ahead of its use.
//
// Work decomposition: a CTA owns 16 weight rows (two n8 groups) and all of K; its W warps (4, or 8
// when N is small) split K into W contiguous ranges of 128-blocks and each warp streams its 16 rows
// x K/W bytes, kP blocks ahead. The K-range partials of the W warps are summed in shared memory in
// warp order (deterministic: the result depends only on N's launch shape, never on timing).
// Grid: N / 16 CTAs (616 for N = 9856). Activations (M K bytes, L2-resident) are re-read by every
// CTA: M / 16 of the weight bytes in L2 traffic.
//
// Tensor-core mapping: mma.sync m16n8k32 e4m3 (A 16x32 row-major = activations, B 32x8 "col" =
// weight rows, K contiguous). Lane (g = lane / 4, t = lane % 4) loads 16 contiguous bytes of weight
// row n0 + g and of activation rows g, g + 8 at K offset 16 t of each 64-byte chunk; the 64 bytes
// of a chunk feed two mma steps. The dot product does not care in which order K is summed, so the
// fragment's logical k (t * 4 + j and 16 + t * 4 + j) is mapped to physical k = 16 t + 8 h + j and
// 16 t + 8 h + 4 + j for step h, identically in A and B: every physical k of the chunk is used
// once.
//
// Numerics: the Hopper tensor core accumulates the 128-wide partial with reduced precision (exact
// for small integers), like cuBLASLt; see tests/stages/projection/gemm_gpu_test.cu for the bound.
#pragma once

#include <cstdint>

#include "core/numeric.h"

namespace m3attn::gemm_small_m_detail {

constexpr int kMaxRows = 16;     // M limit of this kernel
constexpr int kRowsPerCta = 16;  // weight rows (output columns) per CTA: kGroups n8 groups
constexpr int kGroups = 2;
constexpr int kStages = 3;    // 128-blocks loaded ahead of use
constexpr int kMaxWarps = 8;  // K split of a CTA

struct SmallMArgs {
  const uint8_t* a;  // e4m3 [m, K], row stride lda (multiple of 16), 16-byte aligned
  int64_t lda;
  const float* sa;  // f32 (m, kb) at sa[m * sa_s0 + kb * sa_s1]
  int64_t sa_s0, sa_s1;
  const uint8_t* b;  // e4m3 [N, K], row stride ldb (multiple of 16), 16-byte aligned
  int64_t ldb;
  const float* sb;  // f32 (n / 128, kb) at sb[nb * sb_s0 + kb * sb_s1]
  int64_t sb_s0, sb_s1;
  uint16_t* out;  // bf16 [m, N], row stride ldo (multiple of 8), 16-byte aligned
  int64_t ldo;
  int m;        // 1 .. 16
  int kblocks;  // K / 128
};

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

__device__ __forceinline__ void mma_e4m3_16x8x32(float (&d)[4], uint32_t a0, uint32_t a1,
                                                 uint32_t a2, uint32_t a3, uint32_t b0,
                                                 uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// kTwoHalves: M > 8, rows g + 8 exist (otherwise the upper half of the A fragment is zero).
template <bool kTwoHalves>
__global__ void __launch_bounds__(kMaxWarps * 32) gemm_small_m_kernel(const SmallMArgs p) {
  __shared__ float partials[kMaxWarps][kGroups * 4][32];

  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int warps = static_cast<int>(blockDim.x) >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kRowsPerCta;
  const int kb_begin = warp * p.kblocks / warps;
  const int nblk = (warp + 1) * p.kblocks / warps - kb_begin;
  const bool row_lo = g < p.m;
  const bool row_hi = kTwoHalves && g + 8 < p.m;

  const uint8_t* wptr[kGroups];
#pragma unroll
  for (int r = 0; r < kGroups; ++r) wptr[r] = p.b + (n0 + 8 * r + g) * p.ldb + 16 * t;
  // Row pointers of absent rows are never dereferenced.
  const uint8_t* a_lo = p.a + static_cast<int64_t>(g) * p.lda + 16 * t;
  const uint8_t* a_hi = p.a + static_cast<int64_t>(g + 8) * p.lda + 16 * t;
  const float* sa_lo = p.sa + static_cast<int64_t>(g) * p.sa_s0;
  const float* sa_hi = p.sa + static_cast<int64_t>(g + 8) * p.sa_s0;
  const float* sb_row = p.sb + (n0 / 128) * p.sb_s0;  // 16 rows never straddle a 128-row block

  uint4 w[kStages][kGroups][2];
  uint4 x_lo[kStages][2];
  uint4 x_hi[kStages][2];
  float s_lo[kStages], s_hi[kStages], s_b[kStages];
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);

  // Loads block kb (absolute) into stage s (a compile-time index after unrolling).
#define M3_SMALL_M_LOAD(s, kb)                                                              \
  do {                                                                                      \
    const int64_t off_ = static_cast<int64_t>(kb) * 128;                                    \
    _Pragma("unroll") for (int r = 0; r < kGroups; ++r) {                                   \
      w[s][r][0] = __ldcs(reinterpret_cast<const uint4*>(wptr[r] + off_));                  \
      w[s][r][1] = __ldcs(reinterpret_cast<const uint4*>(wptr[r] + off_ + 64));             \
    }                                                                                       \
    x_lo[s][0] = row_lo ? __ldg(reinterpret_cast<const uint4*>(a_lo + off_)) : zero;        \
    x_lo[s][1] = row_lo ? __ldg(reinterpret_cast<const uint4*>(a_lo + off_ + 64)) : zero;   \
    if (kTwoHalves) {                                                                       \
      x_hi[s][0] = row_hi ? __ldg(reinterpret_cast<const uint4*>(a_hi + off_)) : zero;      \
      x_hi[s][1] = row_hi ? __ldg(reinterpret_cast<const uint4*>(a_hi + off_ + 64)) : zero; \
    }                                                                                       \
    s_lo[s] = row_lo ? __ldg(sa_lo + static_cast<int64_t>(kb) * p.sa_s1) : 0.0f;            \
    s_hi[s] = row_hi ? __ldg(sa_hi + static_cast<int64_t>(kb) * p.sa_s1) : 0.0f;            \
    s_b[s] = __ldg(sb_row + static_cast<int64_t>(kb) * p.sb_s1);                            \
  } while (0)

#pragma unroll
  for (int s = 0; s < kStages; ++s) {
    if (s < nblk) M3_SMALL_M_LOAD(s, kb_begin + s);
  }

  float total[kGroups][4];
#pragma unroll
  for (int r = 0; r < kGroups; ++r) total[r][0] = total[r][1] = total[r][2] = total[r][3] = 0.0f;

  for (int i0 = 0; i0 < nblk; i0 += kStages) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      const int i = i0 + s;
      if (i < nblk) {  // warp-uniform
        float part[kGroups][4];
#pragma unroll
        for (int r = 0; r < kGroups; ++r) part[r][0] = part[r][1] = part[r][2] = part[r][3] = 0.0f;
#pragma unroll
        for (int c = 0; c < 2; ++c) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const uint32_t a0 = word(x_lo[s][c], 2 * h), a2 = word(x_lo[s][c], 2 * h + 1);
            const uint32_t a1 = kTwoHalves ? word(x_hi[s][c], 2 * h) : 0u;
            const uint32_t a3 = kTwoHalves ? word(x_hi[s][c], 2 * h + 1) : 0u;
#pragma unroll
            for (int r = 0; r < kGroups; ++r)
              mma_e4m3_16x8x32(part[r], a0, a1, a2, a3, word(w[s][r][c], 2 * h),
                               word(w[s][r][c], 2 * h + 1));
          }
        }
        const float f_lo = s_lo[s] * s_b[s], f_hi = s_hi[s] * s_b[s];
#pragma unroll
        for (int r = 0; r < kGroups; ++r) {
          total[r][0] += part[r][0] * f_lo;
          total[r][1] += part[r][1] * f_lo;
          total[r][2] += part[r][2] * f_hi;
          total[r][3] += part[r][3] * f_hi;
        }
        if (i + kStages < nblk) M3_SMALL_M_LOAD(s, kb_begin + i + kStages);
      }
    }
  }
#undef M3_SMALL_M_LOAD

#pragma unroll
  for (int r = 0; r < kGroups; ++r) {
#pragma unroll
    for (int j = 0; j < 4; ++j) partials[warp][r * 4 + j][lane] = total[r][j];
  }
  __syncthreads();
  if (warp != 0) return;
    // Accumulator j of group r is output (row g + 8 (j / 2), column n0 + 8 r + 2 t + j % 2).
#pragma unroll
  for (int r = 0; r < kGroups; ++r) {
    float v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float acc = 0.0f;
      for (int k = 0; k < warps; ++k) acc += partials[k][r * 4 + j][lane];
      v[j] = acc;
    }
    const int64_t col = n0 + 8 * r + 2 * t;
    if (row_lo) {
      const uint32_t pair = static_cast<uint32_t>(float_to_bf16(v[0])) |
                            (static_cast<uint32_t>(float_to_bf16(v[1])) << 16);
      *reinterpret_cast<uint32_t*>(p.out + static_cast<int64_t>(g) * p.ldo + col) = pair;
    }
    if (row_hi) {
      const uint32_t pair = static_cast<uint32_t>(float_to_bf16(v[2])) |
                            (static_cast<uint32_t>(float_to_bf16(v[3])) << 16);
      *reinterpret_cast<uint32_t*>(p.out + static_cast<int64_t>(g + 8) * p.ldo + col) = pair;
    }
  }
}

}  // namespace m3attn::gemm_small_m_detail
