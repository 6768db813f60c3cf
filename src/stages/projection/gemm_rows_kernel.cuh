// Decode-size block-scaled FP8 GEMM without split-K (GemmWgmmaOptions::row_split, opt-in,
// session 17): out bf16 [M, N] = A e4m3 [M, K] (1x128 scales) x B e4m3 [N, K] (128x128 scales)^T,
// the math of run_gemm_cpu for M <= 64 (n = 8, 16, 32 or 64 activation rows in the MMA).
//
// Why: the stream-K wgmma kernel (gemm_wgmma_kernel.cuh) spends ~2.7 us after its last weight
// lands on the split-K reduction (a partial store, a gpu-scope fence, an atomic, the partial loads;
// session 16). Here every warpgroup owns N / (2 x SMs) = 37-38 whole weight rows (fused N 9856)
// over the whole K: no partials, counters, fences or atomics. Each warpgroup's rows are the A tile
// (64 rows, K-major, 128B swizzle) of an m64nNk32 wgmma; rows past the warpgroup's count stay zero
// and their outputs are never written. Fragment row f = 16 w + i (w the warp, i < 16) is the
// warpgroup's local weight row 4 i + w, so the valid rows spread over the four warps' loads.
// (Round A of session 17 loaded the weights with 16-byte loads straight into register A
// fragments instead: 58-82 us at M 1 against 19.9 for the stream-K kernel: the wgmma fence the
// compiler puts before each register-A wgmma waits for every load in flight, so the register
// prefetch never overlapped: one memory latency per K group.)
//
// Pipeline per CTA (one CTA per SM): kWg consumer warpgroups and kProducerWarps producer warps.
// The producers copy each K block's weights (every valid row's eight 16-byte chunks; kBurst K
// blocks of a row back to back), activations and scales with cp.async into a ring of
// shared-memory slots; each producer thread then arrives on the slot's full barrier with
// cp.async.mbarrier.arrive.noinc (the arrival fires when its copies have landed), and waits on
// a slot's empty barrier before refilling it. Consumers per K block: wait for the full barrier,
// fence.proxy.async (the copies are generic-proxy writes, wgmma reads through the async proxy;
// the consumers have no copies of their own in flight, so the fence costs nothing), four
// wgmmas, wait, fold the block's fp32 dot products with sa[m, kb] x sb[n / 128, kb] into the
// accumulators in K order (the twin's order), release the slot. Epilogue: bf16 stores of the
// valid rows.
// (Round B of session 17: the same loop with every thread copying and waiting on its own
// cp.async groups, then fence.proxy.async and a CTA barrier per K group, also took 58-73 us: a
// proxy fence in a thread with copies in flight waits for all of them, so the ring drained at
// every group.)
//
// Bytes: weights N K once from HBM; activations M K per CTA from L2. Bound: HBM bandwidth; the
// row split's access pattern (37 rows x kBurst x 128 bytes per visit) streams at 17.4 us back to
// back for the fused weights without compute (bandwidth_bench --lsu frag-rows, session 17 round
// A), against 16.2 for the stream-K kernel's TMA order and 14.9 for a plain read.
#pragma once

#include <cstdint>

#include "core/mbarrier.cuh"
#include "core/numeric.h"

namespace m3attn::gemm_rows_detail {

constexpr int kBlockK = 128;
constexpr int kAlignSlack = 1024;
constexpr int kWeightTile = 64 * kBlockK;  // one warpgroup's A tile of one K block

struct RowsArgs {
  const uint8_t* b;  // e4m3 [N, K], row stride ldb bytes (16-byte aligned rows)
  int64_t ldb;
  const uint8_t* a;  // e4m3 [M, K], row stride lda bytes (16-byte aligned rows)
  int64_t lda;
  const float* sa;  // f32 (m, kb) at sa[m * sa_s0 + kb * sa_s1]
  int64_t sa_s0, sa_s1;
  const float* sb;  // f32 (n / 128, kb) at sb[nb * sb_s0 + kb * sb_s1]
  int64_t sb_s0, sb_s1;
  uint16_t* out;  // bf16 [M, N], row stride ldo
  int64_t ldo;
  int m, n, kblocks;
  int early_weights;       // programmatic launch: L2 prefetch of the first weights before the wait
  int trigger_dependents;  // griddepcontrol.launch_dependents at the start of every CTA
};

// One slot: kWg weight tiles, the activation tile (kNw rows), then (after all slots) the slots'
// activation and weight scales.
template <int kNw, int kWg>
__host__ __device__ constexpr int slot_bytes() {
  return kWg * kWeightTile + kNw * kBlockK;
}
template <int kNw, int kWg>
__host__ __device__ constexpr int smem_bytes(int slots) {
  return kAlignSlack + slots * (slot_bytes<kNw, kWg>() + kNw * 4 + 2 * 4);
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// K-major operand, 128B swizzle: rows 128 bytes apart, 8-row groups 1024 bytes apart.
__device__ __forceinline__ uint64_t smem_desc_sw128(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFFu) >> 4) | (uint64_t{1} << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (uint64_t{1} << 62);
}
// Byte offset of 16-byte chunk c of row r in a 128B-swizzled K-major tile.
__device__ __forceinline__ uint32_t swizzled(int r, int c) {
  return static_cast<uint32_t>(r * 128 + ((c ^ (r % 8)) * 16));
}

__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src) : "memory");
}

// wgmma m64nNk32, e4m3 x e4m3 -> f32, both operands from shared memory: d = A B (kFirst: d is
// write-only, so no other instruction defines the accumulators inside the pipeline stage) or
// d += A B.
template <int kNw>
struct WgmmaSs;

template <>
struct WgmmaSs<8> {
  template <bool kFirst>
  __device__ __forceinline__ static void mma(float (&d)[4], uint64_t a, uint64_t b) {
    if constexpr (kFirst) {
      asm volatile(
          "{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, %4, %5, p, 1, "
          "1;\n}\n"
          : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
          : "l"(a), "l"(b));
    } else {
      asm volatile(
          "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, %4, %5, 1, 1, 1;\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
          : "l"(a), "l"(b));
    }
  }
};

template <>
struct WgmmaSs<16> {
  template <bool kFirst>
  __device__ __forceinline__ static void mma(float (&d)[8], uint64_t a, uint64_t b) {
    if constexpr (kFirst) {
      asm volatile(
          "{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7}, "
          "%8, %9, p, 1, 1;\n}\n"
          : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]),
            "=f"(d[7])
          : "l"(a), "l"(b));
    } else {
      asm volatile(
          "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7}, "
          "%8, %9, 1, 1, 1;\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
            "+f"(d[7])
          : "l"(a), "l"(b));
    }
  }
};

template <>
struct WgmmaSs<32> {
  template <bool kFirst>
  __device__ __forceinline__ static void mma(float (&d)[16], uint64_t a, uint64_t b) {
    if constexpr (kFirst) {
      asm volatile(
          "{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, "
          "%8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1;\n}\n"
          : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]),
            "=f"(d[7]), "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]),
            "=f"(d[14]), "=f"(d[15])
          : "l"(a), "l"(b));
    } else {
      asm volatile(
          "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, "
          "%8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, 1, 1, 1;\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
            "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
            "+f"(d[14]), "+f"(d[15])
          : "l"(a), "l"(b));
    }
  }
};

template <>
struct WgmmaSs<64> {
  template <bool kFirst>
  __device__ __forceinline__ static void mma(float (&d)[32], uint64_t a, uint64_t b) {
    if constexpr (kFirst) {
      asm volatile(
          "{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, "
          "%8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, "
          "%26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1;\n}\n"
          : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]),
            "=f"(d[7]), "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]),
            "=f"(d[14]), "=f"(d[15]), "=f"(d[16]), "=f"(d[17]), "=f"(d[18]), "=f"(d[19]),
            "=f"(d[20]), "=f"(d[21]), "=f"(d[22]), "=f"(d[23]), "=f"(d[24]), "=f"(d[25]),
            "=f"(d[26]), "=f"(d[27]), "=f"(d[28]), "=f"(d[29]), "=f"(d[30]), "=f"(d[31])
          : "l"(a), "l"(b));
    } else {
      asm volatile(
          "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, "
          "%8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, "
          "%26, %27, %28, %29, %30, %31}, %32, %33, 1, 1, 1;\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
            "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
            "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),
            "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),
            "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
          : "l"(a), "l"(b));
    }
  }
};

constexpr int kProducerWarps = 4;

// Grid: one CTA per SM (kWg consumer warpgroups + kProducerWarps producer warps), warpgroup gw of
// G = grid x kWg owns weight rows [gw N / G, (gw + 1) N / G) (at most 64: checked on the host).
template <int kNw, int kWg, int kSlots, int kBurst>
__global__ void __launch_bounds__(128 * kWg + 32 * kProducerWarps, 1)
    gemm_rows_kernel(const RowsArgs p) {
  constexpr int kConsumers = 128 * kWg;
  constexpr int kProducers = 32 * kProducerWarps;
  constexpr int kThreads = kConsumers + kProducers;
  constexpr int kAcc = kNw / 2;  // fp32 accumulators per thread: 64 x kNw over 128 threads
  constexpr int kSlot = slot_bytes<kNw, kWg>();
  constexpr int kActOffset = kWg * kWeightTile;
  static_assert(kSlot % 1024 == 0, "slots keep the 1024-byte swizzle alignment");
  static_assert(kSlots % kBurst == 0, "bursts fill whole slots");
  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t full_bar[kSlots];
  __shared__ __align__(8) uint64_t empty_bar[kSlots];
  const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const int kblocks = p.kblocks, m_count = p.m;
  // Scales after the slots: sa_s[slot][kNw], then sb_s[slot][2].
  const uint32_t sa_base = base + static_cast<uint32_t>(kSlots * kSlot);
  const uint32_t sb_base = sa_base + static_cast<uint32_t>(kSlots * kNw * 4);
  uint8_t* const smem = smem_raw + (base - smem_u32(smem_raw));
  const float* sa_s = reinterpret_cast<const float*>(smem + kSlots * kSlot);
  const float* sb_s = sa_s + kSlots * kNw;

  const int tid = static_cast<int>(threadIdx.x);
  const int groups_total = static_cast<int>(gridDim.x) * kWg;
  const int cta_gw = static_cast<int>(blockIdx.x) * kWg;
  auto rows_begin = [&](int gw) { return static_cast<int>(int64_t{gw} * p.n / groups_total); };
  // The CTA's first weight-scale block (its rows span at most two).
  const int rb0 = rows_begin(cta_gw) / 128;
  const int rb_count = p.n / 128 - rb0 < 2 ? p.n / 128 - rb0 : 2;

  if (p.trigger_dependents) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  if (tid == 0) {
    for (int s = 0; s < kSlots; ++s) {
      sm90::mbar_init(smem_u32(&full_bar[s]), kProducers);  // one noinc arrival per producer
      sm90::mbar_init(smem_u32(&empty_bar[s]), kConsumers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  static_assert(kWg == 2, "the row bookkeeping assumes two warpgroups");
  const int rows_wg0 = rows_begin(cta_gw + 1) - rows_begin(cta_gw);
  const int rows_wg1 = rows_begin(cta_gw + 2) - rows_begin(cta_gw + 1);
  // Rows no producer copies stay zero in every slot: fragment rows past a warpgroup's row count,
  // activation rows m_count .. kNw - 1 and their scales, a missing second weight-scale block.
  for (int i = tid; i < kSlots * (kSlot / 16); i += kThreads) {
    const int sl = i / (kSlot / 16), off = (i % (kSlot / 16)) * 16;
    bool copied;
    if (off < kActOffset) {
      const int w = off / kWeightTile, f = (off % kWeightTile) / 128;
      copied = 4 * (f % 16) + f / 16 < (w == 0 ? rows_wg0 : rows_wg1);
    } else {
      copied = (off - kActOffset) / 128 < m_count;
    }
    if (!copied)
      asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(
                       base + static_cast<uint32_t>(sl * kSlot + off)),
                   "r"(0)
                   : "memory");
  }
  for (int i = tid; i < kSlots * kNw; i += kThreads)
    if (i % kNw >= m_count)
      asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(sa_base + 4 * i), "f"(0.0f) : "memory");
  for (int i = tid; i < kSlots * 2; i += kThreads)
    if (i % 2 >= rb_count)
      asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(sb_base + 4 * i), "f"(0.0f) : "memory");
  __syncthreads();

  if (tid >= kConsumers) {
    // Producers: thread t copies items t, t + kProducers, ... of each burst: weight chunks
    // (warpgroup, local row, K block of the burst, chunk; the chunk fastest, so 8 threads copy a
    // row's 128 bytes and a row's burst is contiguous), then activation chunks, then scales.
    const int pt = tid - kConsumers;
    // (The two warpgroups' rows are contiguous: [b0, b0 + n0) and [b0 + n0, b0 + wg_total).)
    const int b0 = rows_begin(cta_gw), n0 = rows_wg0, wg_total = rows_wg0 + rows_wg1;
    // The weights are never written by a preceding kernel: with programmatic launch the first
    // ring of weight lines is prefetched into L2 before the wait (a no-op without PDL).
    if (p.early_weights) {
      for (int i = pt; i < wg_total * kSlots; i += kProducers) {
        const int kb = i % kSlots;
        if (kb < kblocks)
          asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p.b + int64_t{b0 + i / kSlots} * p.ldb +
                                                          kb * kBlockK));
      }
    }
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    // Each producer thread copies the same pieces of every K block: weight pieces pt + 128 j
    // ((valid row v, 16-byte chunk c), c fastest: 8 threads copy a row's 128 bytes), activation
    // pieces likewise, the activation scale of row pt, and (the last threads) the weight scales.
    // Sources and destinations are set up once (session 17 round C: decoding them per copy made
    // the producers instruction-bound, ~100 instructions per 16-byte copy).
    constexpr int kWPieces = kWg * 64 * 8 / kProducers, kAPieces = kNw * 8 / kProducers + 1;
    const uint8_t* wsrc[kWPieces];
    uint32_t wdst[kWPieces];
#pragma unroll
    for (int j = 0; j < kWPieces; ++j) {
      const int it = pt + kProducers * j, v = it / 8, c = it % 8;
      const int w = v >= n0 ? 1 : 0, l = v - w * n0;  // warpgroup, local row
      const int f = 16 * (l % 4) + l / 4;             // the fragment row of local row l
      wsrc[j] = it < wg_total * 8 ? p.b + int64_t{b0 + v} * p.ldb + 16 * c : nullptr;
      wdst[j] = static_cast<uint32_t>(w * kWeightTile) + swizzled(f, c);
    }
    const uint8_t* asrc[kAPieces];
    uint32_t adst[kAPieces];
#pragma unroll
    for (int j = 0; j < kAPieces; ++j) {
      const int it = pt + kProducers * j, m = it / 8, c = it % 8;
      asrc[j] = it < m_count * 8 ? p.a + m * p.lda + 16 * c : nullptr;
      adst[j] = static_cast<uint32_t>(kActOffset) + swizzled(m, c);
    }
    const int sb_row = kProducers - 1 - pt;  // weight-scale block of the last threads
    for (int kb0 = 0, i = 0; kb0 < kblocks; kb0 += kBurst) {
      const int nkb = kblocks - kb0 < kBurst ? kblocks - kb0 : kBurst;
      for (int b = 0; b < nkb; ++b) {
        const int ib = i + b;
        if (ib >= kSlots)
          sm90::mbar_wait(smem_u32(&empty_bar[ib % kSlots]), ((ib / kSlots) - 1) & 1);
      }
      uint32_t slot[kBurst];
#pragma unroll
      for (int b = 0; b < kBurst; ++b)
        slot[b] = base + static_cast<uint32_t>(((i + b) % kSlots) * kSlot);
        // A row's burst of K blocks back to back.
#pragma unroll
      for (int j = 0; j < kWPieces; ++j)
        if (wsrc[j] != nullptr)
#pragma unroll
          for (int b = 0; b < kBurst; ++b)
            if (b < nkb) cp_async_16(slot[b] + wdst[j], wsrc[j] + (kb0 + b) * kBlockK);
#pragma unroll
      for (int j = 0; j < kAPieces; ++j)
        if (asrc[j] != nullptr)
#pragma unroll
          for (int b = 0; b < kBurst; ++b)
            if (b < nkb) cp_async_16(slot[b] + adst[j], asrc[j] + (kb0 + b) * kBlockK);
#pragma unroll
      for (int b = 0; b < kBurst; ++b) {
        if (b < nkb) {
          const int sl = (i + b) % kSlots;
          if (pt < m_count)
            cp_async_4(sa_base + static_cast<uint32_t>(4 * (sl * kNw + pt)),
                       p.sa + pt * p.sa_s0 + (kb0 + b) * p.sa_s1);
          if (sb_row < rb_count)
            cp_async_4(sb_base + static_cast<uint32_t>(4 * (sl * 2 + sb_row)),
                       p.sb + (rb0 + sb_row) * p.sb_s0 + (kb0 + b) * p.sb_s1);
        }
      }
      // One arrival per slot of the burst, when all of this thread's copies so far have landed.
      for (int b = 0; b < nkb; ++b)
        asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(
                         smem_u32(&full_bar[(i + b) % kSlots]))
                     : "memory");
      i += nkb;
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");  // no copy outlives its thread
    return;
  }

  // Consumers: their global writes follow the preceding grid.
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  const int wg = tid / 128, warp = (tid / 32) % 4, lane = tid % 32, q = lane % 4;
  const int r_begin = rows_begin(cta_gw + wg);
  const int rows = rows_begin(cta_gw + wg + 1) - r_begin;
  const int l0 = 4 * (lane / 4) + warp, l1 = l0 + 32;  // local rows of fragment rows f, f + 8
  const bool v0 = l0 < rows, v1 = l1 < rows;
  const int rbi0 = v0 ? (r_begin + l0) / 128 - rb0 : 0;
  const int rbi1 = v1 ? (r_begin + l1) / 128 - rb0 : 0;
  const uint32_t a_tile = static_cast<uint32_t>(wg * kWeightTile);
  const int m0 = 2 * q;
  float acc[kAcc];
#pragma unroll
  for (int j = 0; j < kAcc; ++j) acc[j] = 0.0f;
    // Fragment element j = 4 g + 2 h + e: fragment row f + 8 h (local row h ? l1 : l0),
    // activation row m0 + 8 g + e.
#pragma unroll 1
  for (int kb = 0; kb < kblocks; ++kb) {
    const int s = kb % kSlots;
    sm90::mbar_wait(smem_u32(&full_bar[s]), (kb / kSlots) & 1);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    const uint32_t slot = base + static_cast<uint32_t>(s * kSlot);
    float tmp[kAcc];  // (written by the block's first wgmma)
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint64_t a = smem_desc_sw128(slot + a_tile + 32 * k);
      const uint64_t bd = smem_desc_sw128(slot + kActOffset + 32 * k);
      if (k == 0) {
        WgmmaSs<kNw>::template mma<true>(tmp, a, bd);
      } else {
        WgmmaSs<kNw>::template mma<false>(tmp, a, bd);
      }
    }
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#pragma unroll
    for (int j = 0; j < kAcc; ++j) asm volatile("" : "+f"(tmp[j])::"memory");
    const float sb0 = sb_s[s * 2 + rbi0], sb1 = sb_s[s * 2 + rbi1];
#pragma unroll
    for (int j = 0; j < kAcc; ++j) {
      const float sa = sa_s[s * kNw + m0 + 8 * (j / 4) + j % 2];
      acc[j] = fmaf(tmp[j], ((j / 2) % 2 ? sb1 : sb0) * sa, acc[j]);
    }
    sm90::mbar_arrive(smem_u32(&empty_bar[s]));  // each thread releases its own reads
  }

#pragma unroll
  for (int j = 0; j < kAcc; ++j) {
    const int m = m0 + 8 * (j / 4) + j % 2;
    const bool h = (j / 2) % 2 != 0;
    if (m < m_count && (h ? v1 : v0))
      p.out[m * p.ldo + r_begin + (h ? l1 : l0)] = float_to_bf16(acc[j]);
  }
}

}  // namespace m3attn::gemm_rows_detail
