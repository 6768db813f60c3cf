// Streaming block-scaled FP8 GEMM for decode (M <= 16): the math of run_gemm_cpu (SPEC section 2),
//   out bf16 [M, N] = A e4m3 [M, K] (1x128 fp32 scales) x B e4m3 [N, K] (128x128 fp32 scales)^T,
// per 128-wide K block an fp32 dot product from the tensor cores (mma.sync m16n8k32 e4m3),
// multiplied by sa[m, kb] * sb[n / 128, kb] and accumulated in fp32, rounded once to bf16.
//
// Why: at M <= 16 the GEMM is a read of the N K weight bytes (60.6 MB for the fused projection; a
// plain read of them takes 17.15 us isolated / 15.18 back-to-back, bandwidth_bench session 12).
// The wgmma kernel (gemm_wgmma_kernel.cuh) loads 128 x 128 TMA boxes: 128 weight rows, 128 bytes
// each, 6 KB apart; ncu measured 2.9 TB/s from DRAM there against 4.0 for the plain read. This
// kernel requests every weight row in long contiguous runs instead: one 1D bulk copy
// (cp.async.bulk, no tensor map) of `chunk_blocks` x 128 bytes (2 KB by default) per row.
//
// Work decomposition: "group" = 8 consecutive weight rows (the n8 of the mma), "chunk" = a range
// of chunk_blocks K blocks (the last one may be shorter); unit = (group, chunk), group-major. The
// units are cut into `grid` contiguous ranges of equal length (+-1), one per CTA (stream-K), one
// CTA per SM: for the fused projection (1232 groups x 3 chunks = 3696 units on 132 SMs) every CTA
// streams 28 units = 448 KB. A group whose chunks all lie in one CTA is written as bf16 by that
// CTA; a group split between CTAs (at most the first and the last of each CTA's range) is summed
// like the wgmma kernel does it: each contributor writes an fp32 partial to its workspace slot
// (2c for the CTA's first segment, 2c + 1 for its last) and counts an arrival on the group's
// counter; the last to arrive sums the partials in CTA order and writes bf16, then resets the
// counter. Deterministic (the order depends only on the launch shape), no inter-CTA waiting. A
// CTA walks its split groups first (its last group, then its first: UnitOrder), so the fixups
// happen while the weights stream, not at the end of the kernel.
//
// CTA: kWarps consumer warps and one producer warp. The producer streams the CTA's units in order
// through a ring of `stages` stages (full / empty mbarriers): per unit, lanes 0-7 each issue the
// bulk copy of one weight row's chunk (with an L2 evict-first hint: the weights are read once),
// into rows chunk_bytes + 64 apart (the 64-byte skew keeps the fragment loads free of bank
// conflicts). The activations (M rows x K, at most 16 x K bytes) are copied into shared memory
// once per CTA, chunk by chunk just before the first unit that needs the chunk (one mbarrier per
// chunk). The activation scales are staged by the consumers at the start ([K / 128][16] floats,
// zero for rows >= M).
//
// Consumers: all kWarps warps work on every stage; warp w takes the stage's K blocks w, w + kWarps,
// ... For one K block: lane (g = lane / 4, t = lane % 4) loads 16 bytes of weight row g and of
// activation rows g and g + 8 at offset 16 t of each 64-byte half; each 16-byte piece feeds two
// mma steps (the fragment's logical k t * 4 + j and 16 + t * 4 + j are mapped to physical
// 16 t + 8 h + j and 16 t + 8 h + 4 + j for step h, identically in A and B, so every physical k is
// used once: the dot product does not depend on the order of k). Four mma per K block into a
// fresh fragment, then acc += part * sa[m, kb] * sb[n / 128, kb]. At the end of a group the
// warps' accumulators are summed in warp order through shared memory (double-buffered, one named
// barrier per group) and warp 0 writes the group (bf16, or the partial and the fixup above).
//
// Bytes: weights N K once from HBM (each row in chunk-sized runs); activations M K per CTA and
// partials 2 x 8 x M x 4 B per CTA from / to L2. Bound: HBM bandwidth.
#pragma once

#include <cstdint>

#include "core/mbarrier.cuh"
#include "core/numeric.h"

namespace m3attn::gemm_stream_detail {

constexpr int kMaxM = 16;
constexpr int kGroupRows = 8;  // weight rows per group (the n8 of the mma)
constexpr int kWarps = 8;      // consumer warps
constexpr int kThreads = 32 * (kWarps + 1);
constexpr int kMaxStages = 16;  // ring depth limit (barrier arrays)
constexpr int kMaxChunks = 32;  // K / (chunk_blocks x 128) limit (one barrier per chunk)
constexpr int kMaxChunkBlocks = 32;
constexpr int kRowSkew = 64;  // bytes added to every shared-memory row (bank-conflict skew)

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
  float* partials;     // 2 * grid slots of [16][8] fp32
  unsigned* counters;  // [N / 8], zero before and after every launch
  int m;               // 1 .. 16
  int kblocks;         // K / 128
  int chunk_blocks;    // K blocks per chunk (1 .. kMaxChunkBlocks)
  int chunks;          // ceil(kblocks / chunk_blocks) (<= kMaxChunks)
  int units;           // N / 8 * chunks
  int stages;          // ring depth (2 .. kMaxStages)
  int act_stride;      // bytes between activation rows in shared memory (K + kRowSkew)
  int stage_stride;    // bytes between weight rows of a stage (chunk_blocks x 128 + kRowSkew)
  int weight_evict_first;
  int early_weights;       // programmatic launch: first ring of weights before griddepcontrol.wait
  int trigger_dependents;  // griddepcontrol.launch_dependents at the start of every CTA
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

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

__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr));
  return v;
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

__device__ __forceinline__ void mma_e4m3(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void consumer_barrier() {
  asm volatile("bar.sync 1, %0;\n" ::"n"(kWarps * 32) : "memory");
}

// First unit of CTA c among `grid` CTAs sharing `units` units; the owner of unit u.
__device__ __forceinline__ int unit_begin(int c, int grid, int units) {
  return static_cast<int>(int64_t{c} * units / grid);
}
__device__ __forceinline__ int unit_owner(int u, int grid, int units) {
  return static_cast<int>((int64_t{u + 1} * grid - 1) / units);
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

// kHalves: 1 for M <= 8 (the upper half of the m16 fragment is zero), 2 for M <= 16.
template <int kHalves>
__global__ void __launch_bounds__(kThreads, 1) gemm_stream_kernel(const StreamArgs p) {
  extern __shared__ __align__(128) uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t full_bar[kMaxStages];
  __shared__ __align__(8) uint64_t empty_bar[kMaxStages];
  __shared__ __align__(8) uint64_t act_bar[kMaxChunks];
  __shared__ __align__(16) float red[2][kWarps][4][32];

  // Dynamic shared memory: activations [kHalves * 8][act_stride], then the ring
  // [stages][8][stage_stride], then the activation scales [kblocks][16] floats.
  const uint32_t base = (smem_addr(smem_raw) + 127u) & ~127u;
  const uint32_t act_base = base;
  const uint32_t ring_base = act_base + static_cast<uint32_t>(kHalves * 8 * p.act_stride);
  const int stage_bytes = kGroupRows * p.stage_stride;
  const uint32_t sa_base = ring_base + static_cast<uint32_t>(p.stages * stage_bytes);
  float* s_sa = reinterpret_cast<float*>(smem_raw + (sa_base - smem_addr(smem_raw)));

  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31, warp = tid >> 5;
  const int grid = static_cast<int>(gridDim.x), cta = static_cast<int>(blockIdx.x);
  const int units = p.units, chunks = p.chunks, cb = p.chunk_blocks, stages = p.stages;
  const int u_begin = unit_begin(cta, grid, units);
  const int u_end = unit_begin(cta + 1, grid, units);
  const int n_units = u_end - u_begin;
  const UnitOrder order(u_begin, u_end, chunks);
  const int m_count = p.m;

  if (tid == 0) {
    for (int s = 0; s < stages; ++s) {
      sm90::mbar_init(smem_addr(&full_bar[s]), 1);
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

  if (warp == kWarps) {
    // ---- Producer warp ----
    const uint64_t policy = evict_first_policy();
    auto chunk_len = [&](int c) {  // K blocks of chunk c
      return (c + 1) * cb <= p.kblocks ? cb : p.kblocks - c * cb;
    };
    auto load_weights = [&](int s, int u) {
      const int group = u / chunks, c = u - group * chunks;
      const uint32_t bytes = static_cast<uint32_t>(chunk_len(c) * 128);
      const uint32_t full = smem_addr(&full_bar[s]);
      if (lane == 0) sm90::mbar_arrive_expect_tx(full, bytes * kGroupRows);
      __syncwarp();
      if (lane < kGroupRows) {
        const uint8_t* src =
            p.b + (int64_t{group} * kGroupRows + lane) * p.ldb + int64_t{c} * cb * 128;
        const uint32_t dst =
            ring_base + static_cast<uint32_t>(s * stage_bytes + lane * p.stage_stride);
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
          const uint8_t* src = p.a + int64_t{lane} * p.lda + int64_t{c} * cb * 128;
          const uint32_t dst = act_base + static_cast<uint32_t>(lane * p.act_stride + c * cb * 128);
          bulk_load(dst, src, bytes, bar);
        }
      }
      if (i < early) continue;
      if (i >= stages) sm90::mbar_wait(smem_addr(&empty_bar[s]), ((i / stages) - 1) & 1);
      load_weights(s, u);
    }
    return;  // (no block-wide barrier follows: consumers synchronize with bar.sync 1)
  }

  // ---- Consumer warps ----
  asm volatile("griddepcontrol.wait;\n" ::: "memory");  // sa, out, partials follow the last grid
  for (int idx = tid; idx < p.kblocks * 16; idx += kWarps * 32) {
    const int kb = idx >> 4, m = idx & 15;
    s_sa[idx] = m < m_count ? p.sa[int64_t{m} * p.sa_s0 + int64_t{kb} * p.sa_s1] : 0.0f;
  }
  consumer_barrier();

  const int g = lane >> 2, t = lane & 3;
  const bool row_lo = g < m_count;
  const bool row_hi = kHalves == 2 && g + 8 < m_count;
  const uint32_t act_lo = act_base + static_cast<uint32_t>(g * p.act_stride + 16 * t);
  const uint32_t act_hi = act_lo + static_cast<uint32_t>(8 * p.act_stride);
  const int first_group = u_begin / chunks;
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);

  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  int seg_begin = -1;  // first unit of the current segment (-1: the next unit starts one)
  int groups_done = 0;
  for (int i = 0; i < n_units; ++i) {
    const int u = order.at(i);
    if (seg_begin < 0) seg_begin = u;
    const int s = i % stages;
    const int group = u / chunks, c = u - group * chunks;
    const int nkb = (c + 1) * cb <= p.kblocks ? cb : p.kblocks - c * cb;
    sm90::mbar_wait(smem_addr(&act_bar[c]), 0);
    sm90::mbar_wait(smem_addr(&full_bar[s]), (i / stages) & 1);
    const uint32_t w_row =
        ring_base + static_cast<uint32_t>(s * stage_bytes + g * p.stage_stride + 16 * t);
    const float* sb_row = p.sb + int64_t{group * kGroupRows / 128} * p.sb_s0;
#pragma unroll 2
    for (int kbl = warp; kbl < nkb; kbl += kWarps) {
      const int kb = c * cb + kbl;
      const float sbv = __ldg(sb_row + int64_t{kb} * p.sb_s1);
      float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const uint32_t off = static_cast<uint32_t>(kbl * 128 + 64 * half);
        const uint32_t koff = static_cast<uint32_t>(kb * 128 + 64 * half);
        const uint4 w = lds128(w_row + off);
        const uint4 xl = row_lo ? lds128(act_lo + koff) : zero;
        const uint4 xh = row_hi ? lds128(act_hi + koff) : zero;
#pragma unroll
        for (int h = 0; h < 2; ++h)
          mma_e4m3(part, word(xl, 2 * h), word(xh, 2 * h), word(xl, 2 * h + 1), word(xh, 2 * h + 1),
                   word(w, 2 * h), word(w, 2 * h + 1));
      }
      const float f_lo = s_sa[kb * 16 + g] * sbv;
      const float f_hi = s_sa[kb * 16 + g + 8] * sbv;
      acc[0] = fmaf(part[0], f_lo, acc[0]);
      acc[1] = fmaf(part[1], f_lo, acc[1]);
      acc[2] = fmaf(part[2], f_hi, acc[2]);
      acc[3] = fmaf(part[3], f_hi, acc[3]);
    }
    __syncwarp();
    if (lane == 0) sm90::mbar_arrive(smem_addr(&empty_bar[s]));

    const int seg_end_group = (group + 1) * chunks;
    if (i + 1 < n_units && order.at(i + 1) / chunks == group) continue;

    // ---- End of this CTA's segment of the group: sum the warps, write ----
    float(*buf)[4][32] = red[groups_done & 1];
#pragma unroll
    for (int j = 0; j < 4; ++j) buf[warp][j][lane] = acc[j];
    consumer_barrier();
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[j] = 0.0f;
    const int this_begin = seg_begin;
    seg_begin = -1;
    ++groups_done;
    if (warp != 0) continue;

    float v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float sum = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) sum += buf[w][j][lane];
      v[j] = sum;
    }
    // Fragment element j: token row g + 8 (j / 2), output column group * 8 + 2 t + j % 2.
    const int64_t col = int64_t{group} * kGroupRows + 2 * t;
    auto store = [&](const float(&x)[4]) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int m = g + 8 * (j >> 1);
        if (m < m_count) p.out[int64_t{m} * p.ldo + col + (j & 1)] = float_to_bf16(x[j]);
      }
    };
    const bool whole = this_begin == group * chunks && u + 1 == seg_end_group;
    if (whole) {
      store(v);
      continue;
    }
    // Partial segment: publish, count the arrival; the last arriving CTA finishes the group.
    const int slot = group == first_group ? 2 * cta : 2 * cta + 1;
    float* part_out = p.partials + int64_t{slot} * (kMaxM * kGroupRows);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int m = g + 8 * (j >> 1);
      if (m < m_count) __stcg(part_out + m * kGroupRows + 2 * t + (j & 1), v[j]);
    }
    const int c_lo = unit_owner(group * chunks, grid, units);
    const int c_hi = unit_owner(seg_end_group - 1, grid, units);
    __syncwarp();
    int last = 0;
    if (lane == 0) {
      __threadfence();
      const unsigned arrived = atomicAdd(p.counters + group, 1u);
      last = arrived == static_cast<unsigned>(c_hi - c_lo);
      if (last) __threadfence();
    }
    last = __shfl_sync(0xffffffffu, last, 0);
    __syncwarp();
    if (!last) continue;
    // Sum the group's partials in CTA order, each lane at its own fragment positions (its own
    // contribution from registers: the values it stored). The slot of contributor c is 2c, except
    // for c_lo when it started in an earlier group (its last segment: 2 c_lo + 1).
    const bool lo_second = unit_begin(c_lo, grid, units) < group * chunks;
    float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int cc = c_lo; cc <= c_hi; ++cc) {
      if (cc == cta) {
#pragma unroll
        for (int j = 0; j < 4; ++j) sum[j] += v[j];
        continue;
      }
      const int c_slot = cc == c_lo && lo_second ? 2 * cc + 1 : 2 * cc;
      const float* q = p.partials + int64_t{c_slot} * (kMaxM * kGroupRows);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int m = g + 8 * (j >> 1);
        sum[j] += m < m_count ? __ldcg(q + m * kGroupRows + 2 * t + (j & 1)) : 0.0f;
      }
    }
    store(sum);
    if (lane == 0) atomicExch(p.counters + group, 0u);
  }
}

}  // namespace m3attn::gemm_stream_detail
