// Decode-size block-scaled FP8 GEMM on Hopper tensor cores (wgmma), M <= 64:
//   out bf16 [M, N] = A e4m3 [M, K] (1x128 fp32 scales) x B e4m3 [N, K] (128x128 fp32 scales)^T,
// the math of SPEC section 2 and of run_gemm_cpu: per 128-wide K block an fp32 dot product from
// the tensor cores, multiplied by sa[m, kb] * sb[n / 128, kb] and accumulated in fp32 registers
// (the promotion keeps the reduced-precision FP8 accumulator to 128 products), rounded once to
// bf16.
//
// Why: at M <= 64 the GEMM streams the weights (N K bytes: 60.6 MB for the fused projection,
// ideally 14.1 us at 4.3 TB/s; a pure streaming read of those bytes, timed like the benchmarks,
// takes 16.96 us = 3570 GB/s: bandwidth_bench, session 11); cuBLASLt reaches 22.9-23.9 us.
//
// Swap-AB: the weights are the wgmma A operand (64 weight rows = 64 output columns per consumer
// warpgroup), the activations are B (n = M rounded up to 8, 16, 32 or 64). Both are K-major in
// shared memory, as FP8 wgmma requires: a weight row and an activation row are K-contiguous in
// global memory, and one 128-wide K block is exactly one 128-byte row of the 128B swizzle.
//
// Work decomposition ("unit" = one 128-row weight tile x one 128-wide K block = 16 KB of weights):
// the tiles x K-blocks units, tile-major, are cut into `grid` contiguous ranges of equal length
// (+-1), one per CTA (stream-K). A CTA walks its range; each maximal run of units inside one tile
// (a "segment") is accumulated in registers. A segment covering the whole K of its tile is written
// as bf16 at once; otherwise the segment's fp32 partial goes to the workspace (slot 2c for the
// first segment of CTA c, 2c + 1 for its last one), and the CTA that completes a tile's arrival
// counter sums the tile's partials in CTA order and writes bf16 (then resets the counter to 0):
// deterministic (the order depends only on the grid), no inter-CTA waiting, one launch. The sum
// is done in the accumulator layout (each thread loads the other CTAs' values at its own
// fragment positions, its own from registers), so a fixup costs one L2 round trip per
// contributing CTA, which the ring absorbs.
//
// CTA: warps 0-7 are two consumer warpgroups (64 weight rows each), warp 8 the producer. The
// producer's lane 0 streams each unit with two TMA loads (weights box 128 x 128, activations box
// 128 x n: rows >= M are zero-filled by TMA) into a ring of kStages stages, full/empty mbarriers,
// in bursts: it waits for `burst` free stages and issues their loads back to back, so each weight
// row is requested burst x 128 contiguous bytes at once (a lone 128-byte piece per row per visit
// leaves the HBM row buffers mostly unused: round 2 measured ~2.3 TB/s with single-unit issue).
// With each unit the producer warp also stages its scales (the unit's weight scale and the
// activation scales of its K block, one cp.async of 4 bytes per row, lane r copying rows r and
// r + 32) into the stage's scale slot in shared memory; the full barrier counts lane 0's
// arrive.expect_tx plus one cp.async.mbarrier.arrive.noinc per lane, so a stage is full when its
// TMA bytes and its scales have landed. (Session 11, ncu round 1: with the scales loaded by the
// consumers from global memory at every unit, 30-47 % of the warp stalls sat on those loads and
// the consumers, not HBM, set the pace: 2.2-2.5 TB/s, SMs 18 % above / below the mean busy time.)
// Programmatic dependent launch both ways: programmatic_launch lets this grid request its first
// ring of weights while the preceding kernel finishes; trigger_dependents (variant) lets the next
// PDL-launched kernel start while this grid's last CTAs finish.
// (Session 12 measured and dropped an L2-prefetch variant: the producer warp requested each
// weight row's next 4-16 units as one contiguous cp.async.bulk.prefetch.L2 ahead of the TMA
// loads; 19-55 % slower at every M, DRAM throughput 2.36 vs 2.88 TB/s in ncu at M = 1.)
// (Session 13 built and deleted a "streaming" decode kernel for M <= 16, to test whether long
// contiguous weight runs beat this kernel's 128-byte box rows: one CTA per SM, each weight row
// read in 1 or 2 KB runs by 1D bulk copies (cp.async.bulk), activations staged once per CTA,
// stream-K over (8-row group, K run) units. FP8 mma.sync is emulated on sm_90 (the compiler
// converts every fragment to f16: 36 us at M 1, instruction-bound), so it fed the runs to wgmma:
// a run of W K blocks is W rows of a 64-row A tile, the activation tile holds activation m's W
// blocks as rows W m + q, and the block dot products are the "diagonal" entries q(row) == q(col);
// both tiles are copied unswizzled and described as 128B-swizzled, which permutes the 16-byte
// chunks of matching rows (row & 7 equal) identically. Correct (exact on integer inputs) but never
// faster: fused N 9856 at M 1 36-37 us isolated / 34-35 back-to-back (this kernel 22.2 / 20.2,
// cuBLASLt 22.8 / 21.3), M 8 42.6, M 16 51.7-54 us. ncu at M 1: 1.79 TB/s from DRAM, the consumers
// waiting on full barriers yet issuing ~245 instructions per 16 KB unit and warp at ~6.7 cycles
// each: per-unit consumer latency, not the copies, set the pace. 2 KB instead of 1 KB runs, 4 vs 12
// stages and no L2 hint changed < 5 %; 2-3 CTAs per SM helped (29.2 / 26.3 us at 3), issuing two
// units' wgmmas per wait helped (27.9 / 25.8 us with 2 CTAs per SM) but broke the results in its
// first version (round D), and weights by 16-byte cp.async from one producer warp were 2.4x
// slower (87.7 us). Whether long runs help DRAM at all stayed unanswered: the consumer side
// never let the copies run at full rate.)
// Consumers per unit: 4 wgmma m64nNk32 into a temporary fragment; at n >= 32, while the tensor
// cores work, the unit's scale products (weight scale x activation scale of each of the thread's
// activation rows) are read from the stage's slot; wait, fold, release the stage.
// Session 14, round A (projection_bench --shape, bandwidth_bench --tiles): at M 64 the kernel
// takes 30.6 us for o_proj (N 6144, K 8192) while its weight stream alone, read the same way
// without compute (TMA 2D boxes, stream-K order, the same ring, the activation boxes included),
// takes 16.4-16.8 us, and 1D bulk copies of pre-tiled 16 KB units are no faster (within 2 %): the
// consumers, not the copies, set the pace at n = 64 (ncu: the SMs active 72 % of the time). Two
// units in flight per warpgroup (wgmma.wait_group 1) changed nothing (+-0.2 us at every M) and
// units of two tiles sharing one activation box (256-row boxes, 5-stage ring) were much slower
// (42 vs 30.6 us at M 64, 29.8 vs 24.7 at M 32): both removed. Round B: reading the scale
// products under the wgmmas took o_proj M 64 from 30.6 to 28.1 us (fused 32.4 -> 29.7; at n <= 16
// the fold stays as it was: +0.3-0.5 us there in round B); the owner fixup (below) 28.1 -> 26.8
// (fused 29.7 -> 28.7, M 32 24.1 -> 23.1; +0.2-0.4 us at M <= 16); four consumer warpgroups, each
// on half the activation rows (more warps per unit), were slower (29.9 vs 28.1 us): removed.
// cuBLASLt: 22.5-23.3 us at M 64; ncu with the owner fixup: SMs active 74 % of the time, 21 % of
// the warp samples waiting for full stages, 26 % in the epilogue and the producer.
// Session 15 (fused N 9856 x K 6144; projection_bench --shape --trace, with ablations since
// removed): each CTA's timeline (globaltimer) shows the CTAs' weight streams ending 12-17 us after
// the first start at M 1 (a 4 us spread from DRAM service alone: every CTA has the same units) and
// the split-K reduction after the last unit: removing the MMAs saved 0.9-1.1 us at M 1, removing
// the fixup 2.2 us, both 3.3 us (M 1 back to back 20.6 -> 17.3 us, against 16.96 us for the same
// TMA stream without compute and 15.56 for a plain read in round A); at M 64 the fixup cost 7 us,
// the scattered bf16 tile stores 1.4 us. So: the partials are fragment-major (coalesced 16-byte
// stores and loads, a contributor's whole partial in flight at once), the CTA's last tile goes out
// through shared memory in whole rows, and two CTAs per SM are automatic at every M (M 64 26.9 vs
// 30.4 us with one). The cluster split (opt-in, below) replaces the global fixup with a
// distributed-shared-memory exchange inside a cluster of the tile's CTAs: 0.4-0.6 us faster at
// M <= 8, slower at M >= 16 and with one CTA per SM (77 x C CTAs do not fit one wave for C >= 2).
// Whole tiles per CTA (77 CTAs, no reduction) took 34-37 us: a single CTA's ring (6-9 stages)
// cannot pull more than ~27 GB/s. Scale loads cost nothing measurable (ablated: equal).
// Session 16 (fused N 9856 x K 6144 unless noted; us isolated / back to back): (1) dynamic chunks
// (fixed K chunks of C blocks per tile, handed to CTAs from a ticket counter prefetched one chunk
// ahead, one fp32 partial slot per chunk summed in chunk order by the tile's last arriver:
// deterministic) lost everywhere: M 1 28.0-48.2 vs 22.6 (C = 8 ... 2, round A): every chunk pays a
// partial store, a gpu-scope fence and an atomic under full HBM load (1-2 us each with the CTA's
// consumers waiting), and chunks big enough to amortize that leave 1-2 chunks per CTA; the
// weight stream alone read as dynamic chunks was no faster than static ranges either
// (bandwidth_bench --tiles: 18.6-19.5 / 16.5-17.6 vs 18.1-18.6 / 16.2-16.8), so the CTAs' spread
// is not what separates the stream from a plain read. (2) A row split without split-K (CTA c owns
// ~37 whole weight rows, one m64 tile per K block from a TMA box of its rows, no reduction) was
// exact but took 32 us at M 1 (o_proj 40 us): each CTA walks 48 K blocks through one warpgroup,
// one wgmma group + wait + fold at a time. Both removed. (3) Packed weights (below) stay opt-in.
// The plain read with one contiguous range per CTA is as fast as the grid-stride read (17.25 /
// 15.21 vs 17.18 / 15.29, round B), while TMA or bulk-copy streams of the same bytes take 17.8-18.1
// / 15.9-16.2 in any order: the copy engine path, not the access pattern, costs ~0.7 us.
// Session 17 (same-round A/Bs; fused M 1 this kernel 21.8 / 19.9): (1) the weight stream read
// without compute by every thread with 16-byte loads (bandwidth_bench --lsu, round A): in this
// kernel's unit order 18.9 / 16.9 into registers and 18.8 / 16.8 by cp.async, against 18.2 / 16.2
// for its TMA stream and 17.1 / 14.9 for a plain read, so the gap to the plain read is the unit
// order (128-byte row pieces of 128-row tiles), not the copy engine; a row split's order (37-38
// whole rows per warpgroup, 2-4 K blocks per row per visit) 19.4 / 17.4 at best. (2) A row split
// without split-K (each warpgroup owning 37-38 whole weight rows, no partials): with the weights
// loaded straight into wgmma's register A fragments 58-82 us (the compiler's wgmma fence before a
// register-A wgmma waits for every load in flight: one memory latency per K group); through a
// cp.async ring with a proxy fence in the copying threads 58-73 us (the fence waits for the
// thread's copies in flight); warp-specialized (producer warps with cp.async and mbarriers)
// 27-31 us at M 1-16, 35-36 at M 64 (round C2; the producers were first instruction-bound at
// ~100 instructions per 16-byte copy: 45-60 us). Exact and sanitizer-clean, but slower than this
// kernel at every M: removed. (3) Early last (the idle producer polls the counter of its CTA's
// last split tile and, when every other contributor has arrived, the CTA sums the tile without
// publishing its own partial): 22.0-22.1 / 20.1 vs 21.8 / 19.9 at M 1, equal at M 16 / 64 (rounds
// C, C2): removed.
// Session 18: a row split over a packed linear image (gemm_wgmma_rows_kernel.cuh, opt-in
// GemmWgmmaOptions::row_packed_weights, Fp8BlockGemm::pack_weights_rows): no split-K, each of
// 2 x 132 CTAs owns 37-38 whole rows, the image stores every step of 4 K blocks of all CTAs'
// rows in CTA order in wgmma's unswizzled K-major layout, so a ring stage is one 1D bulk copy and
// the grid sweeps the image front to back; one consumer warpgroup per CTA keeps each K block's
// wgmmas in their own fragment and commit group and folds stage i after issuing stage i + 1.
// Fused M 1 19.3-19.6 / 17.2-17.5 us (isolated / back to back; this kernel 21.8-22.2 / 19.8-20.3
// in the same rounds), M 16 19.4 / 17.2-17.5, M 32 19.6 / 17.5 (2 K blocks per stage); M 64
// 26.4 / 23.8 (cuBLASLt 23.0 / 21.3). Its stream alone (bandwidth_bench --rows) 17.4-17.6 /
// 15.5-15.6.
// Grid: (1 or 2, automatic 2) x SMs CTAs, at least `min_units_per_cta` units each, at most
// `max_waves` waves of resident CTAs (default one; the stream-K fixup never waits for another
// CTA, so later waves are safe); cluster split: N / 128 x C CTAs in clusters of C.
//
// Bytes: weights N K once from HBM; activations M_pad K per tile from L2; partials
// ~(tiles + 2 grid) x 128 x n x 4 B to and from L2 (n = M rounded up to 8, 16, 32, 64). Bound:
// HBM bandwidth (~14 us at N = 9856).
#pragma once

#include <cuda.h>  // CUtensorMap (type only: the map is encoded on the host)

#include <cstdint>

#include "core/mbarrier.cuh"
#include "core/ptx.cuh"
#include "core/numeric.h"

namespace m3attn::gemm_wgmma_detail {

constexpr int kTileN = 128;            // weight rows per unit (= one 128-row weight-scale block)
constexpr int kBlockK = 128;           // K per unit (= one quantization block = one swizzle row)
constexpr int kConsumerThreads = 256;  // two consumer warpgroups
constexpr int kThreads = kConsumerThreads + 32;
constexpr int kMaxM = 64;
constexpr int kWeightTileBytes = kTileN * kBlockK;
constexpr int kMaxCtasPerSm = 2;
constexpr int kAlignSlack = 1024;  // the dynamic shared memory base is rounded up to 1024 bytes

template <int kNw>
constexpr int stage_bytes() {
  return kWeightTileBytes + kNw * kBlockK;
}

// Ring depth: fits two CTAs per SM (110 KB each) or one (220 KB), at most 12 stages.
template <int kNw, int kCtasPerSm>
constexpr int stages() {
  constexpr int budget = kCtasPerSm == 1 ? 220 * 1024 : 110 * 1024;
  return budget / stage_bytes<kNw>() < 12 ? budget / stage_bytes<kNw>() : 12;
}

template <int kNw, int kCtasPerSm>
constexpr int smem_bytes() {
  return stages<kNw, kCtasPerSm>() * stage_bytes<kNw>() + kAlignSlack;
}

// The scales and the output of a call, as every decode kernel here reads them.
struct ScalesOut {
  const float* sa;  // f32 (m, kb) at sa[m * sa_s0 + kb * sa_s1]
  int64_t sa_s0, sa_s1;
  const float* sb;  // f32 (n / 128, kb) at sb[nb * sb_s0 + kb * sb_s1]
  int64_t sb_s0, sb_s1;
  uint16_t* out;  // bf16 [m, N], row stride ldo
  int64_t ldo;
};

struct WgmmaArgs : ScalesOut {
  float* partials;         // 2 * grid slots of [m][128] fp32
  unsigned* counters;      // [tiles], zero before and after every launch
  int m;                   // 1 .. 64
  int weight_evict_first;  // weights loaded with an L2 evict-first policy (read once)
  int early_weights;       // programmatic launch: first ring of weights before griddepcontrol.wait
  int burst;               // units whose loads the producer issues back to back (1 .. stages)
  int kblocks;             // K / 128
  int units;               // tiles * kblocks (< 2^31: checked on the host)
  int trigger_dependents;  // griddepcontrol.launch_dependents at the start of every CTA
  int owner_fixup;         // the tile's first CTA sums its partials (one wave only; see below)
  int cluster;             // > 0: clusters of this many CTAs split each tile's K (see below)
  // Packed weights (GemmWgmmaOptions::packed_weights): unit u of CTA c (its v-th) is the 16 KB
  // smem image at packed + (v grid + c) 16 KB, loaded with one 1D bulk copy; nullptr: TMA 2D.
  const uint8_t* packed;
  // Bench diagnostics (GemmWgmmaOptions::debug_*; off in every production call):
  unsigned long long* trace;  // kTraceWords per CTA (see below), or nullptr
};

// Trace words per CTA, written by consumer thread 0: %globaltimer (ns) at the CTA's start, when
// its first unit was full, when its last unit was full, at its end; clock64 cycles from the start
// to the same three points; cycles spent in segment epilogues (partials, fixup, bf16 stores).
constexpr int kTraceWords = 8;

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// ---- PTX helpers ------------------------------------------------------------------------------

using sm90::mbar_arrive;
using sm90::mbar_arrive_expect_tx;
using sm90::mbar_init;
using sm90::mbar_try_wait;
using sm90::mbar_wait;
using sm90::map_to_rank;
using sm90::prefetch_tensor_map;
using sm90::smem_addr;
using sm90::smem_desc;
using sm90::tma_load_2d;
using sm90::wgmma_commit;
using sm90::wgmma_fence;


// The same with an L2 cache policy (createpolicy), e.g. evict-first for data read once.
__device__ __forceinline__ void tma_load_2d_hint(uint32_t dst, const CUtensorMap* map, int x, int y,
                                                 uint32_t bar, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint "
      "[%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar), "l"(policy)
      : "memory");
}

// 1D bulk copy of `bytes` contiguous bytes (16-byte multiple) global -> shared, L2 cache policy.
__device__ __forceinline__ void bulk_load_hint(uint32_t dst, const void* src, uint32_t bytes,
                                               uint32_t bar, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], "
      "[%1], %2, [%3], %4;\n" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar), "l"(policy)
      : "memory");
}

// bulk_load_hint when `hint`, else the same copy without a cache policy (the row split's weight
// stages, GemmWgmmaOptions::weight_evict_first).
__device__ __forceinline__ void bulk_load_maybe_hint(uint32_t dst, const void* src, uint32_t bytes,
                                                     uint32_t bar, uint64_t policy, bool hint) {
  if (hint) {
    bulk_load_hint(dst, src, bytes, bar, policy);
  } else {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
        "[%3];\n" ::"r"(dst),
        "l"(src), "r"(bytes), "r"(bar)
        : "memory");
  }
}

__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}


// 4-byte asynchronous global -> shared copy (cp.async), and an arrival on `bar` once every
// cp.async this thread issued before has landed (.noinc: the barrier's count includes it).
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src) : "memory");
}

// Acquire load of a counter another CTA releases.
__device__ __forceinline__ unsigned ld_acquire_gpu(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void cp_async_mbar_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}


__device__ __forceinline__ void wgmma_wait_all() {
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
__device__ __forceinline__ void keep_register(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// ---- Thread-block clusters (the cluster split variant) ----------------------------------------
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// Arrival with cluster-scope release on an mbarrier of another CTA (a mapa address).
__device__ __forceinline__ void mbar_arrive_remote(uint32_t cluster_addr) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(cluster_addr)
               : "memory");
}
__device__ __forceinline__ void st_shared_v4(uint32_t addr, float a, float b, float c, float d) {
  asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "f"(a), "f"(b), "f"(c),
               "f"(d)
               : "memory");
}
__device__ __forceinline__ float4 ld_shared_cluster_v4(uint32_t cluster_addr) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(cluster_addr)
               : "memory");
  return v;
}

// Named barrier 1 over the consumer threads (the producer warp never joins it).
__device__ __forceinline__ void consumer_barrier() {
  asm volatile("bar.sync 1, %0;\n" ::"n"(kConsumerThreads) : "memory");
}

// wgmma m64nNk32, e4m3 x e4m3 -> f32, both operands from shared memory. d = (scale_d ? d : 0) +
// A B.
template <int kNw>
struct Wgmma;

template <>
struct Wgmma<8> {
  __device__ __forceinline__ static void mma(float (&d)[4], uint64_t a, uint64_t b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, %4, %5, p, 1, "
        "1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "l"(a), "l"(b), "r"(scale_d));
  }
};

template <>
struct Wgmma<16> {
  __device__ __forceinline__ static void mma(float (&d)[8], uint64_t a, uint64_t b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7}, "
        "%8, %9, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7])
        : "l"(a), "l"(b), "r"(scale_d));
  }
};

// m64n40k32: the row split's token-major form (gemm_wgmma_rows_kernel.cuh, kTok).
template <>
struct Wgmma<40> {
  __device__ __forceinline__ static void mma(float (&d)[20], uint64_t a, uint64_t b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %22, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n40k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, "
        "%9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19}, %20, %21, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19])
        : "l"(a), "l"(b), "r"(scale_d));
  }
};

template <>
struct Wgmma<32> {
  __device__ __forceinline__ static void mma(float (&d)[16], uint64_t a, uint64_t b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, "
        "%9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15])
        : "l"(a), "l"(b), "r"(scale_d));
  }
};

template <>
struct Wgmma<64> {
  __device__ __forceinline__ static void mma(float (&d)[32], uint64_t a, uint64_t b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, "
        "%9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, "
        "%27, %28, %29, %30, %31}, %32, %33, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
          "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
          "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(a), "l"(b), "r"(scale_d));
  }
};

// First unit of CTA c among `grid` CTAs sharing `units` units; the owner of unit u.
__device__ __forceinline__ int unit_begin(int c, int grid, int units) {
  return static_cast<int>(int64_t{c} * units / grid);
}
__device__ __forceinline__ int unit_owner(int u, int grid, int units) {
  return static_cast<int>((int64_t{u + 1} * grid - 1) / units);
}

// Scale slot of one ring stage: the activation scales of the unit's K block for rows 0 .. kNw - 1
// (rows >= M stay zero) and the unit's weight scale at index kNw.
template <int kNw>
constexpr int scale_slot_floats() {
  return kNw + 4;
}

template <int kNw, int kStages, int kCtasPerSm>
__global__ void __launch_bounds__(kThreads, kCtasPerSm)
    gemm_wgmma_kernel(const __grid_constant__ CUtensorMap wmap,
                      const __grid_constant__ CUtensorMap xmap, const WgmmaArgs p) {
  constexpr int kStageBytes = stage_bytes<kNw>();
  constexpr int kAcc = kNw / 2;  // fp32 accumulators per thread: 64 x kNw over 128 threads
  constexpr int kSlot = scale_slot_floats<kNw>();
  static_assert(kStageBytes % 1024 == 0, "stages must keep the 1024-byte swizzle alignment");

  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t full_bar[kStages];
  __shared__ __align__(8) uint64_t empty_bar[kStages];
  __shared__ __align__(16) float s_scales[kStages * kSlot];
  __shared__ int s_is_last;
  // Cluster split: rank 0's barrier for the other ranks' "partial ready" arrivals; each other
  // rank's barrier for rank 0's "partial read" arrival.
  __shared__ __align__(8) uint64_t xred_bar, xdone_bar;

  const uint32_t base = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid % 32;
  const int grid = static_cast<int>(gridDim.x), cta = static_cast<int>(blockIdx.x);
  const int units = p.units;
  const int kb_count = p.kblocks;
  // Stream-K: contiguous ranges of the tile-major units; cluster split: CTA c is rank c % C of
  // the cluster of tile c / C (1D grid and cluster) and takes the rank's share of the tile's K.
  const int csplit = p.cluster;
  const int c_tile = csplit > 0 ? cta / csplit : 0, c_rank = csplit > 0 ? cta - c_tile * csplit : 0;
  const int u_begin =
      csplit > 0 ? c_tile * kb_count + c_rank * kb_count / csplit : unit_begin(cta, grid, units);
  const int u_end = csplit > 0 ? c_tile * kb_count + (c_rank + 1) * kb_count / csplit
                               : unit_begin(cta + 1, grid, units);
  const int m_count = p.m;
  // Diagnostics (bench only): consumer thread 0 keeps the trace's timestamps in shared memory
  // (kTraceWords, then the clock at the start and at the last segment's end), not in registers.
  __shared__ long long s_trace[kTraceWords + 2];
  const bool tracing = p.trace != nullptr && tid == 0;
  if (tracing) {
    for (int w = 0; w < kTraceWords + 2; ++w) s_trace[w] = 0;
    s_trace[0] = static_cast<long long>(global_ns());
    s_trace[kTraceWords] = clock64();
  }

  // Scale slots start at zero: rows >= M are never written, so the fold reads zeros there.
  for (int i = tid; i < kStages * kSlot; i += kThreads) s_scales[i] = 0.0f;
  if (tid == kConsumerThreads) {
    prefetch_tensor_map(&wmap);
    prefetch_tensor_map(&xmap);
    for (int s = 0; s < kStages; ++s) {
      // Lane 0's arrive.expect_tx plus one cp.async arrival per producer lane.
      mbar_init(smem_addr(&full_bar[s]), 1 + 32);
      // One arrival per consumer thread, each releasing its own reads of the stage (session 16:
      // one lane-0 arrival per warp after __syncwarp measured the same speed, but racecheck
      // reported the scale slots' cp.async refill as racing with the other lanes' reads).
      mbar_init(smem_addr(&empty_bar[s]), kConsumerThreads);
    }
    if (csplit > 1) {
      mbar_init(smem_addr(&xred_bar), static_cast<uint32_t>(csplit - 1));
      mbar_init(smem_addr(&xdone_bar), 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    sm90::fence_proxy_async();
  }
  __syncthreads();
  // Cluster split: no CTA touches another's barriers before every CTA of the cluster has
  // initialized its own (arrive here, wait before the first remote access).
  if (csplit > 1) cluster_arrive();
  // A kernel launched after this one with programmatic dependent launch may start once every CTA
  // of this grid has started (it must griddepcontrol.wait before touching what this grid writes),
  // so its CTAs take the SMs this grid's early finishers leave and overlap this grid's tail.
  if (p.trigger_dependents) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");

  if (tid >= kConsumerThreads) {
    // Producer warp: lane 0 streams the CTA's units in order through the ring with TMA; every
    // lane copies its rows' activation scales of the unit (lane 0 also the weight scale) into the
    // stage's scale slot with cp.async, whose completion the full barrier also waits for.
    const uint64_t policy = evict_first_policy();
    const int burst = p.burst;  // 1 .. kStages (host-clamped)
    auto load_weights = [&](int s, int u) {
      const uint32_t full = smem_addr(&full_bar[s]);
      const uint32_t dst = base + static_cast<uint32_t>(s * kStageBytes);
      const int tile = u / kb_count, kb = u - tile * kb_count;
      mbar_arrive_expect_tx(full, kStageBytes);  // weights + activations of the unit
      if (p.packed != nullptr) {  // (the unit's 16 KB smem image, at position v G + c)
        const int64_t pos = int64_t{u - u_begin} * grid + cta;
        bulk_load_hint(dst, p.packed + pos * kWeightTileBytes, kWeightTileBytes, full, policy);
      } else if (p.weight_evict_first) {
        tma_load_2d_hint(dst, &wmap, kb * kBlockK, tile * kTileN, full, policy);
      } else {
        tma_load_2d(dst, &wmap, kb * kBlockK, tile * kTileN, full);
      }
    };
    // Stages the unit's scales (all lanes) and counts their arrival on the full barrier.
    auto load_scales = [&](int s, int u) {
      const int tile = u / kb_count, kb = u - tile * kb_count;
      float* slot = s_scales + s * kSlot;
#pragma unroll
      for (int r = lane; r < kNw; r += 32)
        if (r < m_count) cp_async_4(smem_addr(slot + r), p.sa + r * p.sa_s0 + kb * p.sa_s1);
      if (lane == 0) cp_async_4(smem_addr(slot + kNw), p.sb + tile * p.sb_s0 + kb * p.sb_s1);
      cp_async_mbar_arrive_noinc(smem_addr(&full_bar[s]));
    };
    // Programmatic launch: the weights (which no preceding kernel writes) of the first ring of
    // units are requested before waiting for the preceding grid, whose outputs (activations and
    // their scales) are read only after griddepcontrol.wait. Without PDL the wait is a no-op.
    const int early = p.early_weights ? (u_end - u_begin < kStages ? u_end - u_begin : kStages) : 0;
    if (lane == 0)
      for (int j = 0; j < early; ++j) load_weights(j, u_begin + j);
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    int i = 0;
    for (int u = u_begin; u < u_end;) {
      // Bursts: wait until `burst` slots are free, then issue their loads back to back, so each
      // weight row is requested burst x 128 contiguous bytes at a time (DRAM row locality).
      const int nb = u_end - u < burst ? static_cast<int>(u_end - u) : burst;
      for (int j = 0; j < nb; ++j) {
        const int ij = i + j;
        if (ij >= kStages) mbar_wait(smem_addr(&empty_bar[ij % kStages]), ((ij / kStages) - 1) & 1);
      }
      for (int j = 0; j < nb; ++j, ++u, ++i) {
        const int s = i % kStages;
        const int kb = u - (u / kb_count) * kb_count;
        const uint32_t full = smem_addr(&full_bar[s]);
        if (lane == 0) {
          if (i >= early) load_weights(s, u);
          const uint32_t dst = base + static_cast<uint32_t>(s * kStageBytes);
          tma_load_2d(dst + kWeightTileBytes, &xmap, kb * kBlockK, 0, full);
        }
        load_scales(s, u);
      }
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");  // no copy outlives its thread
    if (csplit > 1) cluster_wait();                     // (every thread that arrived waits once)
    return;  // (no block-wide barrier follows: consumers synchronize with bar.sync 1)
  }

  // Consumers: their global writes (output, partials, counters) follow the preceding grid.
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  if (csplit > 1) cluster_wait();  // the cluster's barriers are initialized (see above)
  // Warpgroup wg owns weight rows [64 wg, 64 wg + 64) of each tile.
  const int wg = tid / 128;
  const int warp = (tid / 32) % 4;
  const int q = lane % 4;
  const int row0 = 64 * wg + 16 * warp + lane / 4;  // this thread's rows: row0 and row0 + 8
  const int m0 = 2 * q;
  const int first_tile = u_begin / kb_count;
  const uint32_t full0 = smem_addr(full_bar), empty0 = smem_addr(empty_bar);

  // Fragment element j = 4 g + 2 h + e is (weight row row0 + 8 h, activation row m0 + 8 g + e);
  // its scale product is prod[2 g + e].
  auto frag_m = [&](int j) { return m0 + 8 * (j / 4) + j % 2; };
  auto frag_row = [&](int j) { return row0 + 8 * ((j / 2) % 2); };
  auto store_bf16 = [&](int j, float v, int tile) {
    if (frag_m(j) < m_count)
      p.out[frag_m(j) * p.ldo + tile * kTileN + frag_row(j)] = float_to_bf16(v);
  };
  // The CTA's last segment writes its bf16 tile through shared memory (the ring's first
  // kNw x kStagePitch bytes, free once every consumer has passed a consumer barrier after its last
  // unit): rows of 128 columns, copied out in whole 256-byte rows of 16-byte stores, instead of the
  // fragments' scattered 2-byte stores (1.4 us for a 128 x 64 tile in session 15 round A). The
  // pitch keeps the fragment writes free of bank conflicts.
  constexpr int kStagePitch = kTileN * 2 + 16;
  auto stage_bf16 = [&](int j, float v) {
    const uint32_t a = base + static_cast<uint32_t>(frag_m(j) * kStagePitch + frag_row(j) * 2);
    const uint16_t b = float_to_bf16(v);
    asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(a), "h"(b) : "memory");
  };
  auto copy_out_staged = [&](int tile) {
    consumer_barrier();  // every fragment is staged
    for (int c = tid; c < m_count * 16; c += kConsumerThreads) {
      const int m = c / 16, piece = c % 16;
      const uint32_t a = base + static_cast<uint32_t>(m * kStagePitch + piece * 16);
      uint16_t* dst = p.out + m * p.ldo + tile * kTileN + piece * 8;
      // (validate_gemm: out is 16-byte aligned, its rows a multiple of 16 bytes apart.)
      uint4 v;
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                   : "r"(a));
      *reinterpret_cast<uint4*>(dst) = v;
    }
  };
  // The whole tile's bf16 values v[0 .. kAcc): staged when this is the CTA's last segment.
  auto write_tile = [&](const float(&v)[kAcc], int tile, bool last_segment) {
    if (last_segment) {
      consumer_barrier();  // no consumer still reads the ring
#pragma unroll
      for (int j = 0; j < kAcc; ++j)
        if (frag_m(j) < m_count) stage_bf16(j, v[j]);
      copy_out_staged(tile);
    } else {
#pragma unroll
      for (int j = 0; j < kAcc; ++j) store_bf16(j, v[j], tile);
    }
  };
  // Split-K partials in the workspace are fragment-major: slot element (q, t) = thread t's
  // fragment elements 4q .. 4q + 3, so every 16-byte store / load of a warp covers 512
  // contiguous bytes (the thread-to-fragment map is the same in every CTA).
  auto partial_v4 = [&](int slot) {
    return reinterpret_cast<float4*>(p.partials + int64_t{slot} * kNw * kTileN) + tid;
  };

  float acc[kAcc];
  // One full stage s: the unit's wgmmas into a temporary fragment, folded into acc with the
  // scale products; then the stage is released to the producer.
  auto consume_unit = [&](int s) {
    float tmp[kAcc];
    const uint32_t a_addr = base + static_cast<uint32_t>(s * kStageBytes + wg * 64 * kBlockK);
    const uint32_t b_addr = base + static_cast<uint32_t>(s * kStageBytes + kWeightTileBytes);
    // Fresh zeros (the first wgmma ignores them: scale-d = 0) keep tmp dead between units, so
    // its registers are free in the epilogue.
#pragma unroll
    for (int j = 0; j < kAcc; ++j) tmp[j] = 0.0f;
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < kBlockK / 32; ++k)
      Wgmma<kNw>::mma(tmp, smem_desc(a_addr + 32 * k), smem_desc(b_addr + 32 * k), k);
    wgmma_commit();
    // At n >= 32 the unit's scale products are read while the tensor cores work (the stage's
    // scales landed with its data), except where the registers are short (n = 64 with two CTAs
    // per SM: 96 per thread); elsewhere (and at n <= 16, where round B measured it 0.3-0.5 us
    // slower) the fold multiplies them as before. Same products either way.
    const float* slot = s_scales + s * kSlot;
    const float w_scale = slot[kNw];
    if constexpr (kAcc >= 16 && !(kCtasPerSm == 2 && kAcc >= 32)) {
      float prod[kAcc / 2];
#pragma unroll
      for (int g = 0; g < kAcc / 4; ++g)
#pragma unroll
        for (int e = 0; e < 2; ++e) prod[2 * g + e] = w_scale * slot[m0 + 8 * g + e];
      wgmma_wait_all();
#pragma unroll
      for (int j = 0; j < kAcc; ++j) keep_register(tmp[j]);
#pragma unroll
      for (int j = 0; j < kAcc; ++j) acc[j] = fmaf(tmp[j], prod[2 * (j / 4) + j % 2], acc[j]);
    } else {
      wgmma_wait_all();
#pragma unroll
      for (int j = 0; j < kAcc; ++j) keep_register(tmp[j]);
#pragma unroll
      for (int j = 0; j < kAcc; ++j) acc[j] = fmaf(tmp[j], w_scale * slot[frag_m(j)], acc[j]);
    }
    mbar_arrive(empty0 + 8 * s);  // each thread releases its own reads of the stage
  };

  // Trace (thread 0): the CTA's end and its epilogue cycles, then the words to global memory.
  auto write_trace = [&]() {
    if (!tracing) return;
    const long long c_end = clock64();
    if (s_trace[kTraceWords + 1] != 0) s_trace[7] += c_end - s_trace[kTraceWords + 1];
    s_trace[3] = static_cast<long long>(global_ns());
    s_trace[6] = c_end - s_trace[kTraceWords];
    unsigned long long* t = p.trace + int64_t{cta} * kTraceWords;
    for (int w = 0; w < kTraceWords; ++w) t[w] = static_cast<unsigned long long>(s_trace[w]);
  };

  int i = 0;
  int u = u_begin;
  while (u < u_end) {
    if (tracing && s_trace[kTraceWords + 1] != 0)
      s_trace[7] += clock64() - s_trace[kTraceWords + 1];
    const int tile = u / kb_count;
    const int seg_begin = u;
    const int seg_end = u_end < (tile + 1) * kb_count ? u_end : (tile + 1) * kb_count;
#pragma unroll
    for (int j = 0; j < kAcc; ++j) acc[j] = 0.0f;

    for (; u < seg_end; ++u, ++i) {
      const int s = i % kStages;
      mbar_wait(full0 + 8 * s, (i / kStages) & 1);
      if (tracing) {
        if (u == u_begin) {
          s_trace[1] = static_cast<long long>(global_ns());
          s_trace[4] = clock64() - s_trace[kTraceWords];
        }
        if (u == u_end - 1) {
          s_trace[2] = static_cast<long long>(global_ns());
          s_trace[5] = clock64() - s_trace[kTraceWords];
        }
      }
      consume_unit(s);
    }

    if (tracing) s_trace[kTraceWords + 1] = clock64();
    // Cluster split (variant): the cluster's ranks cover the tile's K blocks in rank order; ranks
    // >= 1 leave their partial in their own shared memory (the ring's first bytes: every unit is
    // consumed), rank 0 reads them through distributed shared memory, sums in rank order (the
    // order of the stream-K fixup) and writes bf16: no workspace, no atomics, and a CTA waits only
    // for CTAs of its own cluster, which are co-scheduled.
    if (csplit > 1) {
      const uint32_t mine = base + static_cast<uint32_t>(tid * kAcc * 4);
      if (c_rank != 0) {
        consumer_barrier();  // both warpgroups are done with the ring
#pragma unroll
        for (int j = 0; j < kAcc; j += 4)
          st_shared_v4(mine + 4 * j, acc[j], acc[j + 1], acc[j + 2], acc[j + 3]);
        consumer_barrier();
        if (tid == 0) {
          asm volatile("fence.acq_rel.cluster;\n" ::: "memory");
          mbar_arrive_remote(map_to_rank(smem_addr(&xred_bar), 0));
        }
        mbar_wait<true>(smem_addr(&xdone_bar), 0);  // rank 0 has read it: the CTA may exit
      } else {
        mbar_wait<true>(smem_addr(&xred_bar), 0);
        for (int r = 1; r < csplit; ++r) {
          const uint32_t remote = map_to_rank(mine, static_cast<uint32_t>(r));
#pragma unroll
          for (int j = 0; j < kAcc; j += 4) {
            const float4 v = ld_shared_cluster_v4(remote + 4 * j);
            acc[j] += v.x;
            acc[j + 1] += v.y;
            acc[j + 2] += v.z;
            acc[j + 3] += v.w;
          }
        }
        write_tile(acc, tile, true);  // (its barriers also order every thread's remote reads)
        if (tid == 0)
          for (int r = 1; r < csplit; ++r)
            mbar_arrive_remote(map_to_rank(smem_addr(&xdone_bar), static_cast<uint32_t>(r)));
      }
      continue;
    }
    const bool whole = seg_begin == tile * kb_count && seg_end == (tile + 1) * kb_count;
    if (whole) {
      write_tile(acc, tile, seg_end == u_end);
      continue;
    }

    const int c_lo = unit_owner(tile * kb_count, grid, units);
    const int c_hi = unit_owner((tile + 1) * kb_count - 1, grid, units);
    // Owner fixup (variant, one wave of resident CTAs only): the tile's first CTA c_lo, for
    // which this head segment is its last one, sums the tile; the others (the tail segment is a
    // CTA's first one, a middle segment its only one) publish their partial in slot 2c, count it
    // and go on at once (only thread 0 waits for its fence). The owner waits for c_hi - c_lo
    // arrivals, so it stores no partial of its own and pays no atomic round trip. Waits only go
    // to higher CTAs, which never wait for lower ones: no cycle; every CTA is resident (one
    // wave), so the wait ends. The sum below is the same in both schemes: same bits.
    const bool owner_mode = p.owner_fixup != 0;
    const bool owner = owner_mode && seg_begin == tile * kb_count;
    if (!owner) {
      // Publish the partial (a contributor's is always its first segment: slot 2c).
      float4* part = partial_v4(tile == first_tile ? 2 * cta : 2 * cta + 1);
#pragma unroll
      for (int q4 = 0; q4 < kAcc / 4; ++q4)
        __stcg(part + q4 * kConsumerThreads,
               make_float4(acc[4 * q4], acc[4 * q4 + 1], acc[4 * q4 + 2], acc[4 * q4 + 3]));
    }
    // Release / acquire through one thread (the stream-K pattern of CUTLASS's GenericBarrier):
    // the barrier orders every consumer's stores before thread 0's gpu-scope fence, which is
    // cumulative, then the arrival; the last arriving CTA's (the owner's) thread 0 fences again
    // after its atomic (its wait) and the barrier orders the other threads' partial loads after
    // it. (A fence in every thread made each one wait for its own stores: 5-7 % of the stall
    // samples.)
    consumer_barrier();
    if (owner_mode && !owner) {
      if (tid == 0) {
        __threadfence();
        atomicAdd(p.counters + tile, 1u);
      }
      continue;
    }
    if (tid == 0) {
      const unsigned others = static_cast<unsigned>(c_hi - c_lo);
      bool last;
      if (owner) {
        if (ld_acquire_gpu(p.counters + tile) != others) {
          const long long start = clock64();
          while (ld_acquire_gpu(p.counters + tile) != others)
            if (clock64() - start > (1ll << 34)) __trap();  // a lost arrival: fail, not hang
        }
        last = true;
      } else {
        __threadfence();
        last = atomicAdd(p.counters + tile, 1u) == others;
      }
      if (last) __threadfence();
      s_is_last = last;
    }
    consumer_barrier();
    if (s_is_last) {
      // Sum the tile's partials in CTA order, each thread at its own fragment positions: the other
      // CTAs' partials from the workspace (all 16-byte loads of one contributor in flight at
      // once), its own from registers (the same fp32 values it stored). The slot of contributor c
      // is 2c, except for c_lo when it started in an earlier tile (its last segment: 2 c_lo + 1).
      const bool lo_second = unit_begin(c_lo, grid, units) < tile * kb_count;
      // The CTA's last segment stages its bf16 tile (the barriers above follow every consumer's
      // last unit, so the ring is free).
      const bool staged = seg_end == u_end;
      // (In chunks of 16 fragment elements with two CTAs per SM at n = 64: registers.)
      constexpr int kChunk = kCtasPerSm == 2 && kAcc > 16 ? 16 : kAcc;
#pragma unroll
      for (int j0 = 0; j0 < kAcc; j0 += kChunk) {
        float sum[kChunk];
#pragma unroll
        for (int jj = 0; jj < kChunk; ++jj) sum[jj] = 0.0f;
        for (int c = c_lo; c <= c_hi; ++c) {
          if (c == cta) {
#pragma unroll
            for (int jj = 0; jj < kChunk; ++jj) sum[jj] += acc[j0 + jj];
          } else {
            const float4* q_part =
                partial_v4(c == c_lo && lo_second ? 2 * c + 1 : 2 * c) + j0 / 4 * kConsumerThreads;
            float4 v[kChunk / 4];
#pragma unroll
            for (int q4 = 0; q4 < kChunk / 4; ++q4) v[q4] = __ldcg(q_part + q4 * kConsumerThreads);
#pragma unroll
            for (int q4 = 0; q4 < kChunk / 4; ++q4) {
              sum[4 * q4] += v[q4].x;
              sum[4 * q4 + 1] += v[q4].y;
              sum[4 * q4 + 2] += v[q4].z;
              sum[4 * q4 + 3] += v[q4].w;
            }
          }
        }
#pragma unroll
        for (int jj = 0; jj < kChunk; ++jj) {
          if (!staged) {
            store_bf16(j0 + jj, sum[jj], tile);
          } else if (frag_m(j0 + jj) < m_count) {
            stage_bf16(j0 + jj, sum[jj]);
          }
        }
      }
      if (staged) copy_out_staged(tile);
      if (tid == 0) atomicExch(p.counters + tile, 0u);
    }
  }
  write_trace();
}

// Packs the weights b [N, K] (row stride ldb bytes) into the image the kernel's CTAs read with
// packed weights: unit u = (tile, kb) of CTA c = unit_owner(u), its v-th, goes to position
// v grid + c as the 128 x 128 tile TMA would have written into shared memory (128B swizzle: row r
// at r 128 bytes, its 16-byte chunk j at chunk j ^ (r % 8)), so at every step of the stream the
// grid's CTAs read neighbouring 16 KB blocks. One thread per 16-byte chunk.
static __global__ void pack_weights_kernel(const uint8_t* __restrict__ b, int64_t ldb, int kblocks,
                                           int units, int grid, uint8_t* __restrict__ packed) {
  const int64_t chunks = int64_t{units} * (kWeightTileBytes / 16);
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < chunks;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int u = static_cast<int>(i / (kWeightTileBytes / 16));
    const int in_unit = static_cast<int>(i % (kWeightTileBytes / 16));
    const int r = in_unit / 8, j = in_unit % 8;
    const int tile = u / kblocks, kb = u - tile * kblocks;
    const int c = unit_owner(u, grid, units);
    const int64_t pos = int64_t{u - unit_begin(c, grid, units)} * grid + c;
    const uint4 v = *reinterpret_cast<const uint4*>(b + (int64_t{tile} * kTileN + r) * ldb +
                                                    int64_t{kb} * kBlockK + j * 16);
    *reinterpret_cast<uint4*>(packed + pos * kWeightTileBytes + r * 128 + ((j ^ (r % 8)) * 16)) = v;
  }
}

}  // namespace m3attn::gemm_wgmma_detail
