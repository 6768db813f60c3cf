// Decode-size block-scaled FP8 GEMM without split-K (GemmWgmmaOptions::register_rows, opt-in,
// session 17): out bf16 [M, N] = A e4m3 [M, K] (1x128 scales) x B e4m3 [N, K] (128x128 scales)^T,
// the math of run_gemm_cpu for M <= 64 (n = 8, 16, 32 or 64 activation rows in the MMA).
//
// Why: the stream-K wgmma kernel (gemm_wgmma_kernel.cuh) spends ~2.7 us after its last weight
// lands on the split-K reduction (a partial store, a gpu-scope fence, an atomic, the partial loads)
// and its TMA stream is 0.7-0.9 us behind a plain LSU read of the same bytes (session 16). Here
// every warpgroup owns N / (2 x SMs) = 37-38 whole weight rows (fused N 9856) over the whole K: no
// partials, counters, fences or atomics, and the weights go from HBM straight into registers with
// 16-byte loads, which are the A operand of wgmma (register-sourced A, m64nNk32; rows >= the
// warpgroup's row count are don't-care rows whose outputs are never written).
//
// Register A fragment (m64k32, 8-bit, four 32-bit registers per thread): thread (warp w, lane l)
// holds rows 16 w + l / 4 (registers 0, 2) and + 8 (registers 1, 3), bytes k = 4 (l % 4) .. + 3
// (registers 0, 1) and 16 + 4 (l % 4) .. + 3 (registers 2, 3). The sum over a 128-wide K block
// does not depend on the order of its k, so a thread loads contiguous bytes instead: per row and
// K block the 16-byte chunks q = l % 4 and 4 + q (bytes 16 q and 64 + 16 q: a warp load covers 8
// rows x 64 contiguous bytes), and physical word pw = 16 h + 4 q + r (chunk h, register word r)
// plays the role of logical word kw = 8 (rho / 2) + 4 (rho % 2) + q with rho = 4 h + r (k32 step
// rho / 2, register pair rho % 2). The activations (the B operand, in shared memory, K-major,
// 128B swizzle as TMA would write it) are stored with the same permutation: logical word kw of
// activation row m holds physical word pw. Fragment row f = 16 w + i (i = l / 4 or l / 4 + 8)
// is the warpgroup's local weight row 4 i + w, so the valid rows spread over the four warps.
//
// Pipeline per CTA (kWg warpgroups, one CTA per SM): the K blocks in groups of kBurst, kGroups
// groups of weights in registers (each group's loads issued back to back: a row's kBurst x 128
// contiguous bytes); each group's activation K blocks (permuted 4-byte cp.async, every thread a
// word) and their scales go to a ring of shared-memory slots (see smem_bytes), one cp.async
// group per K group, waited kGroups - 1 behind. Per K group: cp.async.wait_group,
// fence.proxy.async, CTA barrier, the group's wgmmas (one temporary fragment per K block), wait,
// fold each K block's fp32 dot products with sa[m, kb] x sb[n / 128, kb] into the accumulators in K
// order, then the loads of group + kGroups. Epilogue: bf16 stores of the valid rows.
//
// Bytes: weights N K once from HBM (the whole call's traffic); activations M K per CTA from L2.
// Bound: HBM bandwidth.
#pragma once

#include <cstdint>

#include "core/numeric.h"

namespace m3attn::gemm_rows_detail {

constexpr int kBlockK = 128;
constexpr int kAlignSlack = 1024;

struct RowsArgs {
  const uint8_t* b;  // e4m3 [N, K], row stride ldb bytes (16-byte aligned rows)
  int64_t ldb;
  const uint8_t* a;  // e4m3 [M, K], row stride lda bytes (4-byte aligned)
  int64_t lda;
  const float* sa;  // f32 (m, kb) at sa[m * sa_s0 + kb * sa_s1]
  int64_t sa_s0, sa_s1;
  const float* sb;  // f32 (n / 128, kb) at sb[nb * sb_s0 + kb * sb_s1]
  int64_t sb_s0, sb_s1;
  uint16_t* out;  // bf16 [M, N], row stride ldo
  int64_t ldo;
  int m, n, kblocks;
  int slots;               // activation K-block slots in shared memory (a ring; see smem_bytes)
  int trigger_dependents;  // griddepcontrol.launch_dependents at the start of every CTA
};

// Dynamic shared memory: `slots` activation K-block slots (K block kb in slot kb % slots), then
// their activation and weight scales. slots >= (kGroups + 1) kBurst (or the whole K): group g +
// kGroups is staged after the barrier of group g, which every thread passes only after its
// wgmmas of group g - 1 completed, so the slots it overwrites (K blocks of group g + kGroups -
// slots / kBurst <= g - 1) are no longer read.
template <int kNw>
constexpr int act_slot_bytes() {
  return kNw * kBlockK;
}
template <int kNw>
__host__ __device__ constexpr int smem_bytes(int slots) {
  return kAlignSlack + slots * (act_slot_bytes<kNw>() + kNw * 4 + 2 * 4);
}
__host__ __device__ constexpr int ring_slots(int kblocks, int groups, int burst) {
  return kblocks < (groups + 1) * burst ? kblocks : (groups + 1) * burst;
}

// Logical 4-byte word of the activation row's K block that holds physical word pw (see above).
__host__ __device__ constexpr int logical_word(int pw) {
  return 8 * ((4 * (pw / 16) + pw % 4) / 2) + 4 * ((4 * (pw / 16) + pw % 4) % 2) + (pw / 4) % 4;
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ uint64_t smem_desc_sw128(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFFu) >> 4) | (uint64_t{1} << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (uint64_t{1} << 62);
}

__device__ __forceinline__ void ldg_nc_v4(uint4& d, const uint8_t* p) {
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(d.x), "=r"(d.y), "=r"(d.z), "=r"(d.w)
               : "l"(p));
}

__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// wgmma m64nNk32, e4m3 x e4m3 -> f32, A from registers, B from shared memory: d = A B (kFirst:
// d is write-only, so no other instruction defines the accumulators inside the pipeline stage)
// or d += A B.
template <int kNw>
struct WgmmaRs;

template <>
struct WgmmaRs<8> {
  template <bool kFirst>
  __device__ __forceinline__ static void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                             uint32_t a3, uint64_t b) {
    if constexpr (kFirst) {
      asm volatile(
          "{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, {%4, %5, %6, "
          "%7}, %8, p, 1, 1;\n}\n"
          : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
          : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b));
    } else {
      asm volatile(
          "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, {%4, %5, %6, "
          "%7}, %8, 1, 1, 1;\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
          : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b));
    }
  }
};

template <>
struct WgmmaRs<16> {
  template <bool kFirst>
  __device__ __forceinline__ static void mma(float (&d)[8], uint32_t a0, uint32_t a1, uint32_t a2,
                                             uint32_t a3, uint64_t b) {
    if constexpr (kFirst) {
      asm volatile(
          "{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, "
          "%7}, {%8, %9, %10, %11}, %12, p, 1, 1;\n}\n"
          : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]),
            "=f"(d[7])
          : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b));
    } else {
      asm volatile(
          "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, "
          "%7}, {%8, %9, %10, %11}, %12, 1, 1, 1;\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
            "+f"(d[7])
          : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b));
    }
  }
};

template <>
struct WgmmaRs<32> {
  template <bool kFirst>
  __device__ __forceinline__ static void mma(float (&d)[16], uint32_t a0, uint32_t a1, uint32_t a2,
                                             uint32_t a3, uint64_t b) {
    if constexpr (kFirst) {
      asm volatile(
          "{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, "
          "%8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1;\n}\n"
          : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]),
            "=f"(d[7]), "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]),
            "=f"(d[14]), "=f"(d[15])
          : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b));
    } else {
      asm volatile(
          "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, "
          "%8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, 1, 1, 1;\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
            "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
            "+f"(d[14]), "+f"(d[15])
          : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b));
    }
  }
};

template <>
struct WgmmaRs<64> {
  template <bool kFirst>
  __device__ __forceinline__ static void mma(float (&d)[32], uint32_t a0, uint32_t a1, uint32_t a2,
                                             uint32_t a3, uint64_t b) {
    if constexpr (kFirst) {
      asm volatile(
          "{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, "
          "%8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, "
          "%26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
          : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]),
            "=f"(d[7]), "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]),
            "=f"(d[14]), "=f"(d[15]), "=f"(d[16]), "=f"(d[17]), "=f"(d[18]), "=f"(d[19]),
            "=f"(d[20]), "=f"(d[21]), "=f"(d[22]), "=f"(d[23]), "=f"(d[24]), "=f"(d[25]),
            "=f"(d[26]), "=f"(d[27]), "=f"(d[28]), "=f"(d[29]), "=f"(d[30]), "=f"(d[31])
          : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b));
    } else {
      asm volatile(
          "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, "
          "%8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, "
          "%26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, 1, 1, 1;\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
            "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
            "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),
            "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),
            "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
          : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b));
    }
  }
};

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Grid: one CTA per SM (kWg warpgroups), warpgroup gw of G = grid x kWg owns weight rows
// [gw N / G, (gw + 1) N / G) (at most 64: checked on the host).
template <int kNw, int kWg, int kGroups, int kBurst>
__global__ void __launch_bounds__(128 * kWg, 1) gemm_rows_kernel(const RowsArgs p) {
  constexpr int kThreads = 128 * kWg;
  constexpr int kAcc = kNw / 2;  // fp32 accumulators per thread: 64 x kNw over 128 threads
  constexpr int kSlot = act_slot_bytes<kNw>();
  extern __shared__ uint8_t smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const int kblocks = p.kblocks, m_count = p.m, slots = p.slots;
  // Scales after the activation slots: sa_s[slot][kNw], then sb_s[slot][2].
  const uint32_t sa_base = base + static_cast<uint32_t>(slots * kSlot);
  const uint32_t sb_base = sa_base + static_cast<uint32_t>(slots * kNw * 4);
  uint8_t* const smem = smem_raw + (base - smem_u32(smem_raw));
  const float* sa_s = reinterpret_cast<const float*>(smem + slots * kSlot);
  const float* sb_s = sa_s + slots * kNw;

  const int tid = static_cast<int>(threadIdx.x);
  const int wg = tid / 128, warp = (tid / 32) % 4, lane = tid % 32, q = lane % 4;
  const int groups_total = static_cast<int>(gridDim.x) * kWg;
  const int gw = static_cast<int>(blockIdx.x) * kWg + wg;
  const int r_begin = static_cast<int>(int64_t{gw} * p.n / groups_total);
  const int rows = static_cast<int>(int64_t{gw + 1} * p.n / groups_total) - r_begin;
  // The CTA's first weight-scale block (its rows span at most two).
  const int cta_row0 = static_cast<int>(int64_t{blockIdx.x} * kWg * p.n / groups_total);
  const int rb0 = cta_row0 / 128;
  const int rb_count = p.n / 128 - rb0 < 2 ? p.n / 128 - rb0 : 2;
  const int l0 = 4 * (lane / 4) + warp, l1 = l0 + 32;  // local rows of fragment rows f, f + 8
  const bool v0 = l0 < rows, v1 = l1 < rows;
  const int rbi0 = v0 ? (r_begin + l0) / 128 - rb0 : 0;
  const int rbi1 = v1 ? (r_begin + l1) / 128 - rb0 : 0;
  const uint8_t* const p0 = p.b + int64_t{r_begin + (v0 ? l0 : 0)} * p.ldb + 16 * q;
  const uint8_t* const p1 = p.b + int64_t{r_begin + (v1 ? l1 : 0)} * p.ldb + 16 * q;
  const int groups = (kblocks + kBurst - 1) / kBurst;

  if (p.trigger_dependents) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");

  // Weights of K group g into registers (rows the warpgroup does not have keep their zeros).
  uint4 w[kGroups][kBurst][4];
  auto load_weights = [&](uint4(&d)[kBurst][4], int g) {
#pragma unroll
    for (int b = 0; b < kBurst; ++b) {
      const int kb = g * kBurst + b;
      if (kb < kblocks) {
        if (v0) {
          ldg_nc_v4(d[b][0], p0 + kb * kBlockK);
          ldg_nc_v4(d[b][1], p0 + kb * kBlockK + 64);
        }
        if (v1) {
          ldg_nc_v4(d[b][2], p1 + kb * kBlockK);
          ldg_nc_v4(d[b][3], p1 + kb * kBlockK + 64);
        }
      }
    }
  };
#pragma unroll
  for (int s = 0; s < kGroups; ++s)
#pragma unroll
    for (int b = 0; b < kBurst; ++b)
#pragma unroll
      for (int j = 0; j < 4; ++j) w[s][b][j] = make_uint4(0, 0, 0, 0);
        // The weights are never written by a preceding kernel: their first groups are requested
        // before the programmatic-launch wait (a no-op without PDL); activations, scales and every
        // write after.
#pragma unroll
  for (int s = 0; s < kGroups; ++s) load_weights(w[s], s);
  asm volatile("griddepcontrol.wait;\n" ::: "memory");

  // Activation rows m_count .. kNw - 1 and their scales are zero in every slot.
  for (int i = tid; i < slots * (kNw - m_count) * 8; i += kThreads) {
    const int kb = i / ((kNw - m_count) * 8), rem = i % ((kNw - m_count) * 8);
    const uint32_t a =
        base + static_cast<uint32_t>(kb * kSlot + (m_count + rem / 8) * 128 + (rem % 8) * 16);
    asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(a), "r"(0) : "memory");
  }
  for (int i = tid; i < slots * kNw; i += kThreads)
    if (i % kNw >= m_count)
      asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(sa_base + 4 * i), "f"(0.0f) : "memory");
  for (int i = tid; i < slots * 2; i += kThreads)
    if (i % 2 >= rb_count)
      asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(sb_base + 4 * i), "f"(0.0f) : "memory");
  // Activations, activation scales and weight scales of K group g (one cp.async group).
  auto stage = [&](int g) {
    const int kb0 = g * kBurst;
    const int nkb = kb0 >= kblocks ? 0 : (kblocks - kb0 < kBurst ? kblocks - kb0 : kBurst);
    const int words = nkb * m_count * 32;
    for (int i = tid; i < words; i += kThreads) {
      const int kb = kb0 + i / (m_count * 32), m = (i / 32) % m_count, pw = i % 32;
      const int kw = logical_word(pw);
      const uint32_t dst = base + static_cast<uint32_t>((kb % slots) * kSlot + m * 128 +
                                                        (((kw / 4) ^ (m % 8)) * 16) + (kw % 4) * 4);
      cp_async_4(dst, p.a + m * p.lda + kb * kBlockK + 4 * pw);
    }
    for (int i = tid; i < nkb * m_count; i += kThreads) {
      const int kb = kb0 + i / m_count, m = i % m_count;
      cp_async_4(sa_base + static_cast<uint32_t>(4 * ((kb % slots) * kNw + m)),
                 p.sa + m * p.sa_s0 + kb * p.sa_s1);
    }
    for (int i = tid; i < nkb * rb_count; i += kThreads) {
      const int kb = kb0 + i / rb_count, r = i % rb_count;
      cp_async_4(sb_base + static_cast<uint32_t>(4 * ((kb % slots) * 2 + r)),
                 p.sb + (rb0 + r) * p.sb_s0 + kb * p.sb_s1);
    }
    cp_async_commit();
  };
#pragma unroll 1
  for (int s = 0; s < kGroups; ++s) stage(s);

  const int m0 = 2 * q;
  float acc[kAcc];
#pragma unroll
  for (int j = 0; j < kAcc; ++j) acc[j] = 0.0f;
  // Fragment element j = 4 g + 2 h + e: weight row f + 8 h (local row h ? l1 : l0), activation
  // row m0 + 8 g + e.
  for (int g0 = 0; g0 < groups; g0 += kGroups) {
#pragma unroll
    for (int s = 0; s < kGroups; ++s) {
      const int g = g0 + s;
      if (g >= groups) break;
      // Group g's activations and scales have landed (every thread's copies: the barrier), and
      // the async proxy (wgmma) sees them.
      cp_async_wait<kGroups - 1>();
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      __syncthreads();
      float tmp[kBurst][kAcc];  // (written by each K block's first wgmma)
      asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
      for (int b = 0; b < kBurst; ++b) {
        const int kb = g * kBurst + b;
        if (kb < kblocks) {
          const uint32_t b_addr = base + static_cast<uint32_t>((kb % slots) * kSlot);
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            // k32 step k: registers rho = 2 k (rows f, f + 8) and 2 k + 1 (the same rows).
            const int r0 = 2 * k, r1 = 2 * k + 1;
            const uint32_t a0 = word(w[s][b][r0 / 4], r0 % 4),
                           a1 = word(w[s][b][2 + r0 / 4], r0 % 4);
            const uint32_t a2 = word(w[s][b][r1 / 4], r1 % 4),
                           a3 = word(w[s][b][2 + r1 / 4], r1 % 4);
            const uint64_t desc = smem_desc_sw128(b_addr + 32 * k);
            if (k == 0) {
              WgmmaRs<kNw>::template mma<true>(tmp[b], a0, a1, a2, a3, desc);
            } else {
              WgmmaRs<kNw>::template mma<false>(tmp[b], a0, a1, a2, a3, desc);
            }
          }
        }
      }
      asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
      asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#pragma unroll
      for (int b = 0; b < kBurst; ++b)
#pragma unroll
        for (int j = 0; j < kAcc; ++j) asm volatile("" : "+f"(tmp[b][j])::"memory");
#pragma unroll
      for (int b = 0; b < kBurst; ++b) {
        const int kb = g * kBurst + b;
        if (kb < kblocks) {
          const int slot = kb % slots;
          const float sb0 = sb_s[slot * 2 + rbi0], sb1 = sb_s[slot * 2 + rbi1];
#pragma unroll
          for (int j = 0; j < kAcc; ++j) {
            const float sa = sa_s[slot * kNw + m0 + 8 * (j / 4) + j % 2];
            acc[j] = fmaf(tmp[b][j], ((j / 2) % 2 ? sb1 : sb0) * sa, acc[j]);
          }
        }
      }
      // The group's registers are free (the wgmmas are complete): load group g + kGroups.
      load_weights(w[s], g + kGroups);
      stage(g + kGroups);
    }
  }
  asm volatile("cp.async.wait_all;\n" ::: "memory");  // (empty groups only: no copy outlives)

#pragma unroll
  for (int j = 0; j < kAcc; ++j) {
    const int m = m0 + 8 * (j / 4) + j % 2;
    const bool h = (j / 2) % 2 != 0;
    if (m < m_count && (h ? v1 : v0))
      p.out[m * p.ldo + r_begin + (h ? l1 : l0)] = float_to_bf16(acc[j]);
  }
}

}  // namespace m3attn::gemm_rows_detail
