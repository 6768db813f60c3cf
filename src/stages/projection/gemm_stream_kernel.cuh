// Streaming block-scaled FP8 GEMM for decode (M <= 16): the math of run_gemm_cpu (SPEC section 2),
//   out bf16 [M, N] = A e4m3 [M, K] (1x128 fp32 scales) x B e4m3 [N, K] (128x128 fp32 scales)^T,
// per 128-wide K block an fp32 dot product from the tensor cores (wgmma, e4m3), multiplied by
// sa[m, kb] * sb[n / 128, kb] and accumulated in fp32, rounded once to bf16.
//
// Why: at M <= 16 the GEMM is a read of the N K weight bytes (60.6 MB for the fused projection; a
// plain read of them takes 17.15 us isolated / 15.18 back-to-back, bandwidth_bench session 12).
// The wgmma kernel (gemm_wgmma_kernel.cuh) loads 128 x 128 TMA boxes: 128 weight rows, 128 bytes
// each, 6 KB apart (ncu: 2.9 TB/s from DRAM against 4.0 for the plain read). This kernel requests
// every weight row in contiguous runs of W x 128 bytes (W = 8 or 16 K blocks: 1 or 2 KB), one 1D
// bulk copy (cp.async.bulk, no tensor map) per row and run, straight into shared memory.
// (Round A of session 13 measured a first version that fed those bytes to mma.sync m16n8k32 e4m3:
// sm_90 has no FP8 mma.sync, the compiler converts every fragment to f16 (F2FP) and the kernel was
// instruction-bound at 36 us. FP8 on Hopper means wgmma.)
//
// The wgmma trick: a run of W K blocks of one weight row is W consecutive 128-byte "rows" in
// shared memory, so a 64-row wgmma A tile (8 KB) holds 64 / W weight rows x W K blocks: A row
// i = W r + q is K block q of weight row r. The activation tile of the same K range (B operand)
// holds activation m's W K blocks as rows j = W m + q. Then D[i][j] with q(i) == q(j) is exactly
// the 128-wide block dot product of weight row r and activation m at K block q; the other entries
// (q(i) != q(j)) are wasted tensor work (a factor W / ... of the useful MACs: N_wgmma = W x M_pad
// columns for M_pad tokens). Both tiles are written by plain (unswizzled) copies but described to
// wgmma as 128B-swizzled: the hardware then reads 16-byte chunk c of a row at chunk c ^ (row & 7).
// Rows i and j with q(i) == q(j) have i & 7 == j & 7 (W is a multiple of 8), so both operands of
// every useful product see the same permutation of the row's 128 bytes, and a dot product does
// not depend on the order of k. (Wasted entries pair different permutations: never read.)
//
// Work decomposition: "group" = R = 128 / W consecutive weight rows (16 for W = 8, 8 for W = 16),
// "chunk" = W K blocks (the last one may be shorter); unit = (group, chunk) = one 16 KB ring stage
// = two 8 KB A tiles, one per consumer warpgroup. The units, group-major, are cut into `grid`
// contiguous ranges (+-1), one per CTA (stream-K), one CTA per SM; a CTA walks its split groups
// first (its last group, then its first: UnitOrder). A group whose chunks all lie in one CTA is
// written as bf16 by that CTA; a group split between CTAs is summed like the wgmma kernel does it:
// each contributor writes an fp32 partial to its workspace slot (2c for its first group, 2c + 1
// for its last) and counts an arrival on the group's counter; the last to arrive sums the partials
// in CTA order and writes bf16, then resets the counter. Deterministic, no inter-CTA waiting.
//
// CTA: two consumer warpgroups and one producer warp. The producer streams the units through a
// ring of `stages` 16 KB stages (full / empty mbarriers): per unit, lanes 0 .. R - 1 each issue
// the bulk copy of one weight row's run (L2 evict-first: read once), or (async_copies) every lane
// copies 16 bytes per cp.async, 512 contiguous bytes of a run per warp instruction, and arrives on
// the stage's barrier when its copies land (the consumers then fence the async proxy). (Round B,
// session 13: with bulk copies the kernel read only 1.8 TB/s from DRAM at M = 1 (ncu: the
// consumers wait on the full barriers, the ring is never full), for 1 or 2 KB runs and 4 or 12
// stages alike; cp.async is the alternative path into shared memory.) The activations are copied
// once per CTA, chunk by chunk just before the first unit that needs the chunk (one mbarrier per
// chunk), into [chunk][M_pad][W x 128 B] tiles. The activation scales are staged by the consumers
// ([K / 128][16] floats, zero for rows >= M).
//
// Consumers per unit: 4 wgmma m64nNk32 (N = W x M_pad) into a fresh accumulator, wait, release
// the stage, then fold the useful entries: lane (g = lane / 4, t = lane % 4) of warp w holds them
// when t == g / 2 (rows g and g + 8 of the warp's 16, column 8 b + g); acc[h][m] += D * sa[m, kb] *
// sb[n / 128, kb]. At the end of a group each warp sums its lanes (xor shuffles, fixed order) and
// lanes m < M write output row m.
//
// Bytes: weights N K once from HBM; activations M K per CTA and partials from / to L2. Tensor
// work: N_wgmma x 64 x 128 MACs per 8 KB tile: at N_wgmma = 128 (M <= 16 with W = 8) about half of
// the time a 16 KB stage takes to arrive at 4 TB/s, a quarter at 64. Intended bound: HBM.
//
// Measured (session 13, H200, projection_bench --stream-only, fused N 9856 K 6144, isolated /
// back-to-back us; the wgmma kernel 22.3 / 20.2 and cuBLASLt 22.8 / 21.3 at M 1 on the same runs):
// round B (one unit per wait) M 1 36.2 / 34.0, M 8 42.6 / 40.1, M 16 54.0 / 51.4; ncu at M 1: 1.79
// TB/s from DRAM, consumers on the full barriers and ~245 instructions per unit and warp at 6.7
// cycles each. Round C: 2 KB runs, 4 or 12 stages, no L2 hint: all within 5 %; 2 CTAs per SM
// 30.4 / 27.8, 3 CTAs 29.2 / 26.3; cp.async weights (async_copies) 87.7 / 85.5. So the consumers'
// per-unit latency, not the copies, bound it; round D measures two units per wait (pair_units).
// Slower than both other paths everywhere measured: opt-in only (stream_max_m, stream_auto_max_m).
#pragma once

#include <cstdint>

#include "core/mbarrier.cuh"
#include "core/numeric.h"
#include "stages/projection/gemm_wgmma_kernel.cuh"

namespace m3attn::gemm_stream_detail {

constexpr int kMaxM = 16;
constexpr int kConsumerThreads = 256;  // two warpgroups
constexpr int kWarps = kConsumerThreads / 32;
constexpr int kThreads = kConsumerThreads + 32;
constexpr int kMaxStages = 16;  // ring depth limit (barrier arrays)
constexpr int kMaxChunks = 32;  // K / (W x 128) limit (one barrier per chunk)
constexpr int kStageBytes = 16384;
constexpr int kTileBytes = 8192;  // one warpgroup's A tile (64 rows x 128 bytes)
constexpr int kMaxGroupRows = 16;
constexpr int kSlotFloats = kMaxGroupRows * kMaxM;  // one partial slot: [16 rows][16 tokens]

struct StreamArgs {
  const uint8_t* a;  // e4m3 [m, K], rows lda bytes apart (16-byte aligned rows)
  int64_t lda;
  const float* sa;  // f32 (m, kb) at sa[m * sa_s0 + kb * sa_s1]
  int64_t sa_s0, sa_s1;
  const uint8_t* b;  // e4m3 [N, K], rows ldb bytes apart (16-byte aligned rows)
  int64_t ldb;
  const float* sb;  // f32 (n / 128, kb) at sb[nb * sb_s0 + kb * sb_s1]
  int64_t sb_s0, sb_s1;
  uint16_t* out;  // bf16 [m, N], row stride ldo
  int64_t ldo;
  float* partials;     // 2 * grid slots of kSlotFloats fp32
  unsigned* counters;  // [N / R], zero before and after every launch
  int m;               // 1 .. 16
  int kblocks;         // K / 128
  int chunks;          // ceil(kblocks / W) (<= kMaxChunks)
  int units;           // N / R * chunks
  int stages;          // ring depth (2 .. kMaxStages)
  int weight_evict_first;
  int early_weights;       // programmatic launch: first ring of weights before griddepcontrol.wait
  int trigger_dependents;  // griddepcontrol.launch_dependents at the start of every CTA
  int pair_units;          // consumers take two units per wgmma wait where registers allow
  int async_copies;        // weights by 16-byte cp.async per lane instead of bulk copies
};

// ---- PTX helpers (shared with the wgmma kernel) ------------------------------------------------

using gemm_wgmma_detail::cp_async_mbar_arrive_noinc;
using gemm_wgmma_detail::evict_first_policy;
using gemm_wgmma_detail::keep_register;
using gemm_wgmma_detail::smem_addr;
using gemm_wgmma_detail::smem_desc;
using gemm_wgmma_detail::unit_begin;
using gemm_wgmma_detail::unit_owner;
using gemm_wgmma_detail::Wgmma;
using gemm_wgmma_detail::wgmma_commit;
using gemm_wgmma_detail::wgmma_fence;
using gemm_wgmma_detail::wgmma_wait_all;

// 1D bulk copy global -> shared, completion counted in bytes on `bar`.
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes,
                                          uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}

__device__ __forceinline__ void bulk_load_hint(uint32_t dst, const void* src, uint32_t bytes,
                                               uint32_t bar, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], "
      "[%1], %2, [%3], %4;\n" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar), "l"(policy)
      : "memory");
}

// 16-byte cp.async global -> shared (L2 only), optionally with an L2 cache policy.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_16_hint(uint32_t dst, const void* src, uint64_t policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n" ::"r"(dst),
               "l"(src), "l"(policy)
               : "memory");
}

// (The wgmma kernel's consumer barrier is the same named barrier 1 over 256 threads.)
__device__ __forceinline__ void consumer_barrier() {
  asm volatile("bar.sync 1, %0;\n" ::"n"(kConsumerThreads) : "memory");
}

// The order in which a CTA walks its units [u_begin, u_end): its partial last group ("tail",
// which the next CTA shares) first, then its partial first group ("head", shared with the previous
// CTA), then the whole groups. Both contributors of a split group thus reach it in their first
// few units and its fixup overlaps the stream, instead of the last CTA to finish its range paying
// a fence, an atomic and an L2 round trip at the very end of the kernel.
struct UnitOrder {
  int tail0, tail_len, head0, head_len, mid0;
  __device__ __forceinline__ UnitOrder(int u_begin, int u_end, int chunks) {
    const int first_boundary = (u_begin + chunks - 1) / chunks * chunks;
    head0 = u_begin;
    head_len = u_begin % chunks != 0 ? min(u_end, first_boundary) - u_begin : 0;
    mid0 = u_begin + head_len;
    tail0 = max(mid0, u_end / chunks * chunks);
    tail_len = u_end - tail0;
  }
  // The unit at position j (0 <= j < u_end - u_begin).
  __device__ __forceinline__ int at(int j) const {
    return j < tail_len              ? tail0 + j
           : j < tail_len + head_len ? head0 + (j - tail_len)
                                     : mid0 + (j - tail_len - head_len);
  }
};

// kW: K blocks per weight-row run (8 or 16); kN: wgmma N = kW x M_pad (16, 32, 64 or 128).
template <int kW, int kN>
__global__ void __launch_bounds__(kThreads, 1) gemm_stream_kernel(const StreamArgs p) {
  static_assert(kW == 8 || kW == 16, "runs of 8 or 16 K blocks (a multiple of the swizzle's 8)");
  constexpr int kR = 128 / kW;        // weight rows per group (unit)
  constexpr int kRowsPerWg = kR / 2;  // weight rows per warpgroup tile
  constexpr int kMPad = kN / kW;      // activation rows per chunk tile
  constexpr int kAcc = kN / 2;        // fp32 accumulators per thread: 64 x kN over 128 threads
  constexpr int kRunBytes = kW * 128;
  static_assert(kMPad <= kMaxM, "at most 16 activation rows");

  extern __shared__ __align__(1024) uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t full_bar[kMaxStages];
  __shared__ __align__(8) uint64_t empty_bar[kMaxStages];
  __shared__ __align__(8) uint64_t act_bar[kMaxChunks];
  __shared__ int s_is_last;

  // Dynamic shared memory (1024-byte aligned): the ring [stages][16 KB], the activation tiles
  // [chunks][kMPad][kRunBytes], then the activation scales [kblocks][16] floats.
  const uint32_t base = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const uint32_t ring_base = base;
  const uint32_t act_base = ring_base + static_cast<uint32_t>(p.stages * kStageBytes);
  constexpr int kActTileBytes = kMPad * kRunBytes;
  const uint32_t sa_base = act_base + static_cast<uint32_t>(p.chunks * kActTileBytes);
  float* s_sa = reinterpret_cast<float*>(smem_raw + (sa_base - smem_addr(smem_raw)));

  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31, warp = tid >> 5;
  const int grid = static_cast<int>(gridDim.x), cta = static_cast<int>(blockIdx.x);
  const int units = p.units, chunks = p.chunks, stages = p.stages;
  const int u_begin = unit_begin(cta, grid, units);
  const int u_end = unit_begin(cta + 1, grid, units);
  const int n_units = u_end - u_begin;
  const UnitOrder order(u_begin, u_end, chunks);
  const int m_count = p.m;

  if (tid == 0) {
    for (int s = 0; s < stages; ++s) {
      // Bulk copies: lane 0's arrive.expect_tx; cp.async: one arrival per producer lane.
      sm90::mbar_init(smem_addr(&full_bar[s]), p.async_copies ? 32 : 1);
      sm90::mbar_init(smem_addr(&empty_bar[s]), kWarps);  // one arrival per consumer warp
    }
    for (int c = 0; c < chunks; ++c) sm90::mbar_init(smem_addr(&act_bar[c]), 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  }
  __syncthreads();
  // A kernel launched next with programmatic dependent launch may start once every CTA of this
  // grid has started (it must griddepcontrol.wait before touching what this grid writes): its
  // CTAs take the SMs this grid's first finishers leave.
  if (p.trigger_dependents) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");

  auto chunk_len = [&](int c) {  // K blocks of chunk c
    return (c + 1) * kW <= p.kblocks ? kW : p.kblocks - c * kW;
  };

  if (warp == kWarps) {
    // ---- Producer warp ----
    const uint64_t policy = evict_first_policy();
    auto load_weights = [&](int s, int u) {
      const int group = u / chunks, c = u - group * chunks;
      const uint32_t bytes = static_cast<uint32_t>(chunk_len(c) * 128);
      const uint32_t full = smem_addr(&full_bar[s]);
      if (p.async_copies) {
        // 16 bytes per lane and instruction: each instruction covers 512 contiguous bytes of one
        // row's run.
        const uint8_t* src0 = p.b + int64_t{group} * kR * p.ldb + int64_t{c} * kRunBytes;
        const uint32_t dst0 = ring_base + static_cast<uint32_t>(s * kStageBytes);
#pragma unroll 4
        for (int r = 0; r < kR; ++r) {
          for (uint32_t off = 16u * static_cast<uint32_t>(lane); off < bytes; off += 512u) {
            const uint8_t* src = src0 + int64_t{r} * p.ldb + off;
            const uint32_t dst = dst0 + static_cast<uint32_t>(r * kRunBytes) + off;
            if (p.weight_evict_first) {
              cp_async_16_hint(dst, src, policy);
            } else {
              cp_async_16(dst, src);
            }
          }
        }
        cp_async_mbar_arrive_noinc(full);
        return;
      }
      if (lane == 0) sm90::mbar_arrive_expect_tx(full, bytes * kR);
      __syncwarp();
      if (lane < kR) {
        const uint8_t* src = p.b + (int64_t{group} * kR + lane) * p.ldb + int64_t{c} * kRunBytes;
        const uint32_t dst = ring_base + static_cast<uint32_t>(s * kStageBytes + lane * kRunBytes);
        if (p.weight_evict_first) {
          bulk_load_hint(dst, src, bytes, full, policy);
        } else {
          bulk_load(dst, src, bytes, full);
        }
      }
    };
    // Programmatic launch: the first ring of weights (which no preceding kernel writes) is
    // requested before waiting for the preceding grid; activations only after the wait.
    const int early = p.early_weights ? (n_units < stages ? n_units : stages) : 0;
    for (int j = 0; j < early; ++j) load_weights(j, order.at(j));
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    uint32_t loaded = 0;  // activation chunks requested
    for (int i = 0; i < n_units; ++i) {
      const int u = order.at(i);
      const int s = i % stages;
      const int c = u % chunks;
      if (!(loaded >> c & 1u)) {
        loaded |= 1u << c;
        const uint32_t bar = smem_addr(&act_bar[c]);
        const uint32_t bytes = static_cast<uint32_t>(chunk_len(c) * 128);
        if (lane == 0) sm90::mbar_arrive_expect_tx(bar, bytes * static_cast<uint32_t>(m_count));
        __syncwarp();
        if (lane < m_count) {
          const uint8_t* src = p.a + int64_t{lane} * p.lda + int64_t{c} * kRunBytes;
          const uint32_t dst =
              act_base + static_cast<uint32_t>(c * kActTileBytes + lane * kRunBytes);
          bulk_load(dst, src, bytes, bar);
        }
      }
      if (i < early) continue;
      if (i >= stages) sm90::mbar_wait(smem_addr(&empty_bar[s]), ((i / stages) - 1) & 1);
      load_weights(s, u);
    }
    if (p.async_copies) asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;  // (no block-wide barrier follows: consumers synchronize with bar.sync 1)
  }

  // ---- Consumer warpgroups ----
  asm volatile("griddepcontrol.wait;\n" ::: "memory");  // sa, out, partials follow the last grid
  for (int idx = tid; idx < p.kblocks * 16; idx += kConsumerThreads) {
    const int kb = idx >> 4, m = idx & 15;
    s_sa[idx] = m < m_count ? p.sa[int64_t{m} * p.sa_s0 + int64_t{kb} * p.sa_s1] : 0.0f;
  }
  consumer_barrier();

  const int wg = warp >> 2, wq = warp & 3;  // warpgroup, warp within it
  const int g = lane >> 2, t = lane & 3;
  // This lane holds useful entries (q(row) == q(column)) when 2 t + (g & 1) == g.
  const bool holder = t == (g >> 1);
  const int e = g & 1;
  // Half h of the warp's rows (row 16 wq + g + 8 h of the warpgroup tile): its weight row within
  // the group and its K block within the chunk.
  auto row_of = [&](int h) { return kRowsPerWg * wg + (kW == 8 ? 2 * wq + h : wq); };
  auto q_of = [&](int h) { return kW == 8 ? g : g + 8 * h; };
  const int first_group = u_begin / chunks;

  float acc[2][kMPad];
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int m = 0; m < kMPad; ++m) acc[h][m] = 0.0f;

  int seg_begin = -1;  // first unit of the current segment (-1: the next unit starts one)
  // Fold unit i (unit u, its wgmma result d) into the accumulators; at the end of the CTA's
  // segment of a group, sum the lanes and write (bf16, or the partial and the fixup).
  auto finish_unit = [&](int i, int u, const float(&d)[kAcc]) {
    if (seg_begin < 0) seg_begin = u;
    const int group = u / chunks, c = u - group * chunks;
    const int nkb = chunk_len(c);
    // Fold the useful entries: column j = kW m + q sits in n8 block (kW m + q) / 8 at column
    // (q % 8) = g of the block, i.e. fragment element 4 b + 2 h + e of the holder lane.
    const float* sb_row = p.sb + int64_t{group * kR / 128} * p.sb_s0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int q = q_of(h);
      const bool live = holder && q < nkb;
      const int kb = c * kW + (q < nkb ? q : 0);
      const float sbv = live ? __ldg(sb_row + int64_t{kb} * p.sb_s1) : 0.0f;
      const float* sa_kb = s_sa + kb * 16;
#pragma unroll
      for (int m = 0; m < kMPad; ++m) {
        const int b = (kW * m + (kW == 8 ? 0 : 8 * h)) / 8;
        const float v = e ? d[4 * b + 2 * h + 1] : d[4 * b + 2 * h];
        if (live) acc[h][m] = fmaf(v, sa_kb[m] * sbv, acc[h][m]);
      }
    }

    const int seg_end_group = (group + 1) * chunks;
    if (i + 1 < n_units && order.at(i + 1) / chunks == group) return;

    // ---- End of this CTA's segment of the group: sum the lanes, write ----
    // v[h][m]: the segment's sum for weight row row_of(h) (kW == 16: both halves are one row).
    float v[2][kMPad];
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int m = 0; m < kMPad; ++m) {
        float x = acc[h][m];
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
        v[h][m] = x;
        acc[h][m] = 0.0f;
      }
    constexpr int kHalves = kW == 8 ? 2 : 1;
    if (kW == 16) {
#pragma unroll
      for (int m = 0; m < kMPad; ++m) v[0][m] += v[1][m];
    }
    const int this_begin = seg_begin;
    seg_begin = -1;
    const bool whole = this_begin == group * chunks && u + 1 == seg_end_group;
    // Lane m < M writes token row m; the value for m is v[h][m] (a compile-time index: select).
    auto pick = [&](int h) {
      float x = 0.0f;
#pragma unroll
      for (int m = 0; m < kMPad; ++m)
        if (lane == m) x = v[h][m];
      return x;
    };
    if (whole) {
#pragma unroll
      for (int h = 0; h < kHalves; ++h) {
        const float x = pick(h);
        if (lane < m_count)
          p.out[int64_t{lane} * p.ldo + int64_t{group} * kR + row_of(h)] = float_to_bf16(x);
      }
      return;
    }
    // Partial segment: publish, count the arrival; the last arriving CTA finishes the group.
    const int slot = group == first_group ? 2 * cta : 2 * cta + 1;
    float* part_out = p.partials + int64_t{slot} * kSlotFloats;
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      const float x = pick(h);
      if (lane < m_count) __stcg(part_out + row_of(h) * kMaxM + lane, x);
    }
    // Release / acquire through one thread (the stream-K pattern of CUTLASS's GenericBarrier):
    // the barrier orders every consumer's stores before thread 0's gpu-scope fence, which is
    // cumulative, then the arrival; the last arriving CTA's thread 0 fences again after its
    // atomic (acquire) and the barrier orders the other threads' partial loads after it.
    consumer_barrier();
    const int c_lo = unit_owner(group * chunks, grid, units);
    const int c_hi = unit_owner(seg_end_group - 1, grid, units);
    if (tid == 0) {
      __threadfence();
      const unsigned arrived = atomicAdd(p.counters + group, 1u);
      const bool last = arrived == static_cast<unsigned>(c_hi - c_lo);
      if (last) __threadfence();
      s_is_last = last;
    }
    consumer_barrier();
    // (s_is_last is rewritten only after the next partial group's first barrier, which every
    // consumer reaches after this read.)
    if (!s_is_last) return;
    // Sum the group's partials in CTA order (its own contribution from registers: the values it
    // stored). The slot of contributor c is 2c, except for c_lo when it started in an earlier
    // group (its last segment: 2 c_lo + 1).
    const bool lo_second = unit_begin(c_lo, grid, units) < group * chunks;
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      const float mine = pick(h);
      float sum = 0.0f;
      for (int cc = c_lo; cc <= c_hi; ++cc) {
        if (cc == cta) {
          sum += mine;
          return;
        }
        const int c_slot = cc == c_lo && lo_second ? 2 * cc + 1 : 2 * cc;
        const float* q_part = p.partials + int64_t{c_slot} * kSlotFloats;
        sum += lane < m_count ? __ldcg(q_part + row_of(h) * kMaxM + lane) : 0.0f;
      }
      if (lane < m_count)
        p.out[int64_t{lane} * p.ldo + int64_t{group} * kR + row_of(h)] = float_to_bf16(sum);
    }
    if (tid == 0) atomicExch(p.counters + group, 0u);
  };

  // Units are taken one or two at a time (p.pair_units, kN <= 64: registers): both stages' wgmmas
  // are issued before one wait, so the tensor latency and the fold of two units overlap.
  constexpr bool kPairOk = kN <= 64;
  constexpr int kAcc1 = kPairOk ? kAcc : 1;
  for (int i = 0; i < n_units;) {
    const bool two = kPairOk && p.pair_units && i + 1 < n_units;  // (uniform)
    const int u0 = order.at(i);
    const int u1 = two ? order.at(i + 1) : u0;
    const int s0 = i % stages, s1 = (i + 1) % stages;
    const int c0 = u0 % chunks, c1 = u1 % chunks;
    sm90::mbar_wait(smem_addr(&act_bar[c0]), 0);
    sm90::mbar_wait(smem_addr(&full_bar[s0]), (i / stages) & 1);
    if (two) {
      sm90::mbar_wait(smem_addr(&act_bar[c1]), 0);
      sm90::mbar_wait(smem_addr(&full_bar[s1]), ((i + 1) / stages) & 1);
    }
    // cp.async writes are generic-proxy writes: order them before the wgmma's async-proxy reads.
    if (p.async_copies) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    const uint32_t a0 = ring_base + static_cast<uint32_t>(s0 * kStageBytes + wg * kTileBytes);
    const uint32_t b0 = act_base + static_cast<uint32_t>(c0 * kActTileBytes);
    const uint32_t a1 =
        two ? ring_base + static_cast<uint32_t>(s1 * kStageBytes + wg * kTileBytes) : a0;
    const uint32_t b1 = two ? act_base + static_cast<uint32_t>(c1 * kActTileBytes) : b0;
    float d0[kAcc], d1[kAcc1];
#pragma unroll
    for (int j = 0; j < kAcc; ++j) d0[j] = 0.0f;
#pragma unroll
    for (int j = 0; j < kAcc1; ++j) d1[j] = 0.0f;
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < 4; ++k)
      Wgmma<kN>::mma(d0, smem_desc(a0 + 32 * k), smem_desc(b0 + 32 * k), k);
    // (Issued unconditionally: a wgmma under a branch makes the compiler serialize the group.
    // Without a second unit it recomputes the first into d1, which is discarded.)
    if constexpr (kPairOk) {
#pragma unroll
      for (int k = 0; k < 4; ++k)
        Wgmma<kN>::mma(d1, smem_desc(a1 + 32 * k), smem_desc(b1 + 32 * k), k);
    }
    wgmma_commit();
    wgmma_wait_all();
#pragma unroll
    for (int j = 0; j < kAcc; ++j) keep_register(d0[j]);
#pragma unroll
    for (int j = 0; j < kAcc1; ++j) keep_register(d1[j]);
    __syncwarp();
    if (lane == 0) {
      sm90::mbar_arrive(smem_addr(&empty_bar[s0]));
      if (two) sm90::mbar_arrive(smem_addr(&empty_bar[s1]));
    }
    finish_unit(i, u0, d0);
    if constexpr (kPairOk) {
      if (two) finish_unit(i + 1, u1, d1);
    }
    i += two ? 2 : 1;
  }
}

}  // namespace m3attn::gemm_stream_detail
