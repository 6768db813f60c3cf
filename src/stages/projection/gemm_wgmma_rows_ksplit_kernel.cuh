// The row split's K split (GemmWgmmaOptions::row_k_split; session 23, opt-in): the math and the
// packed image of gemm_wgmma_rows_kernel.cuh, with the weight rows of one image CTA (72 / 76 for N
// 9856 over 132 image CTAs, one per SM: the aligned partition, session 26 below; 74-75 over the
// plain one) shared by the two HALVES of one CTA (two consumer
// warpgroups, two producer warps), which split its K: half h in {0, 1} takes the image steps s
// with s % 2 == h (K blocks 8 j + 4 h ... 8 j + 4 h + 3), so both halves read neighbouring steps
// of the image (the grid still reads a front through memory) and each reads only the activation
// boxes of its own K blocks.
//
// Why (the lead's arithmetic for session 23, M 64): the row split's 264 CTAs each read the whole
// activation matrix (64 x 6144 B) from L2 for 37-38 weight rows (104 MB of L2 -> shared traffic
// for 60.55 MB of weights) and issue 192 m64n40k32 per CTA; per SM ~1.25 MB of TMA writes and as
// many wgmma operand reads. A pair of halves over 74-75 rows reads the activations once per pair
// (52 MB) and issues 96 token-major m64n80k32 per half (N 80 >= the rows: 94 % useful): ~31 %
// less shared-memory traffic per SM, and twice the weight bytes per stage (a deeper DRAM ring at
// the same shared memory).
//
// Per half: one consumer warpgroup (token-major: A = the activation slot, m64 = 64 token rows,
// loaded as two boxes of 32 (SlotTokens, gemm_wgmma_rows_kernel.cuh; session 24); B =
// the pair's weight rows, n80) and one producer warp (warp 8 + h); a ring of 3 stages of 2 K
// blocks; all activation slots first (1024-byte aligned, 64
// token rows each whatever M: the m64 A tile never reads past its slot), then the weight slots
// (the n80 B tile of the last K column reads (80 - rows) x 16 bytes past the stage's rows: each
// weight slot keeps that much room), then the scales of the half's own K blocks. The release of
// each stage is the row split's; the fold picks each column pair's scale by a predicate and the
// epilogue converts pairs by cvt.rn.bf16x2 (session 25, below).
//
// Session 25 (same rounds, b2b us plain / chained, fused M 64): round A's tail trace (last stage
// full -> last consumer warp's stores 2.5-3.0 us; summed -> stored 1.0-1.25 of it) and round C's
// diagnostics (the scaled fold 0.8 us, the stores 0.8 us chained) led to the epilogue without
// wasted conversions (round B: 19.78-19.79 / 17.61-17.63 against 20.19-20.20 / 17.70-17.75) and
// the fold by predicate (round D: 19.36-19.47 / 17.37-17.38 against 19.72-19.73 / 17.57-17.60);
// round H: M 33 / 48 / 64 19.10-19.19 / 16.99-17.10, 19.24-19.30 / 17.18-17.24, 19.54-19.61 /
// 17.49-17.51 against the row split's 19.98-20.13 / 18.96-19.04, 20.04-20.07 / 18.89-18.96,
// 19.76-19.79 / 18.54-18.56. Still 0.9 us from 16.57 at M 64 chained: round F without the stores
// 16.56, without the scaled fold 16.83-16.85 (against 17.40-17.44). Lost (deleted; numbers at the
// code): the epilogue's pairs staged in shared memory (B), a pipelined consumer loop and a gated
// first ring (C), incremental wgmma descriptors and the K split over the row split's image (D),
// an epilogue fast path and 1 / 3 early stages (E), the last stage split in two and setmaxnreg
// (F), a TMA-store epilogue (G, X: see the epilogue).
//
// The end: a reduce-scatter of the fp32 accumulators through the CTA's shared memory. Both halves
// hold the same fragment layout (warp w: tokens 16 w ... 16 w + 15; column groups c = 0 ... 9 of
// 8 weight rows); half h stores column groups 5 h ... 5 h + 4 (the pair's rows 40 h ... 40 h +
// 39) of every token. Between two named barriers of the 256 consumer threads (both rings
// drained; the writes landed) each thread writes its five groups of the other half's columns
// into the other half's drained ring (its first activation slots), then adds what it received to
// its own five and stores them: every warp of the SM stores, 80-byte runs per token.
//
// Session 26 (rounds A-B, same rounds, b2b us, fused M 64 chained; lost and deleted): the halves
// staggered, the last 1 / 2 K blocks of half 1 (the image's last step) moved to the end of half
// 0's share, half 1's sums handed over one way (left in its drained ring, bar.arrive; half 0
// bar.sync after its last fold, then either storing all 80 columns or handing half 1's five
// groups back through a second named barrier): 17.78-17.92 / 17.76-17.92 against 17.64-17.67 (M
// 33 / 48 +0.1-0.25 too); the one-way hand-over without the stagger 17.62-17.68 (tie). The
// trace: half 0's consumers 0.5-0.6 us behind its last stage when it lands (against ~0 for the
// even split): once half 1 stops, half 0's last stages arrive at the SM's whole share of DRAM,
// faster than one warpgroup computes them (~0.2 us per K block), so the tail after the last byte
// did not shrink (last full -> last warp 2.2-2.4 us either way). Without the scaled fold (diag 2)
// the stagger tied (17.06-17.20 against 17.09); without the stores (diag 4) it lost (16.92-17.00
// against 16.74-16.79). Racecheck also flagged half 1's writes before bar.arrive against half 0's
// reads after bar.sync (likely its model of bar.arrive; the results were exact in every test).
//
// Session 26, the stores (rounds C-D, same rounds, b2b us, M 64 chained): about to store ->
// stored is 0.8-0.9 us of the tail, diag 4 (no stores) 16.60 against 17.45. Not the number of
// store transactions: round C's chunk stores (each row's whole 16-byte chunks gathered by the
// row's quad through shared memory, 16-byte stores: ~4x fewer, fuller L2 writes) tied, 17.56-17.67
// against 17.64-17.66, and lost at M 33 / 48 (+0.15-0.2; deleted). Round D: diag 7 (the same
// store instructions under a false predicate: issued, nothing written) 17.03-17.07 against
// 17.45 and diag 4's 16.60; its trace about to store -> stored 0.50 us against 0.85, the first
// store 0.1 us after the mark in both: ~half the store phase is the epilogue's instructions (two
// warps per scheduler, a dependent chain with a branch per store), half the writes (the second
// token row's stores wait 0.5 us against 0.24 without writes). Round E (lost, deleted): the
// epilogue's pointers and clip masks worked out before the hand-over and its stores issued
// without branches, plain 19.85-19.93 against 19.67-19.76 (M 33 / 48 +0.05-0.2): its trace has
// the first token row's five stores issued within 0.04 us and the second row's taking 0.7 us,
// about to store -> stored 0.79 against 0.75, and the hand-over 0.3 us later (the hoisted work
// before its barrier). So the stores stall on the writes in flight once a warp has issued about
// five (of ten); what bounds them (L2 write latency under the other SMs' weight stream, the SM's
// outstanding writes) is open.
//
// Session 26, round F (same round, 3 runs, b2b us plain / chained): the aligned partition (each
// pair's first row a multiple of 4: rows_begin with RowsArgs::row_align 4, the image packed the
// same way; 72 / 76 rows per pair at N 9856 against 74-75) won although its largest pair has 76
// rows against 75: M 64 19.30-19.33 / 17.34-17.43 against 19.50-19.57 / 17.56-17.57, M 48
// 19.08-19.10 / 17.11-17.16 against 19.23-19.26 / 17.34-17.40, M 33 18.90-18.95 / 16.99-17.03
// against 18.97-19.08 / 17.08-17.11; the default since (GemmWgmmaOptions::row_k_split_align 4).
// Round FINAL2 (the default's tip, same round, 3 runs): M 64 19.32-19.38 / 17.33-17.42 against
// 19.56-19.60 / 17.56-17.62, M 48 19.08-19.20 / 17.18-17.20 against 19.22-19.28 / 17.29-17.32, M
// 33 18.94-19.02 / 17.02-17.07 against 19.06-19.13 / 17.07-17.15.
// (Why is not measured apart: every pair's outputs then start on an even element, so no pair
// straddles two lanes and no column is stored alone, and each pair's weight bytes per K block start
// 512-byte aligned in the image. Its trace, M 64 chained: about to store -> h0 stored 0.54 us
// against 0.73, last warp stored 2.20 after the last stage full against 2.31.) Lost there and
// deleted: over the aligned partition, the outputs as 8-byte stores of 4 columns (one shuffle per
// group between lanes q and q ^ 1 of a quad: lane q even keeping token row0's columns 8 j + 2 q ...
// + 3, lane q odd row0 + 8's; 5 stores per thread instead of 10): M 64 19.27-19.33 / 17.39-17.46, M
// 48 19.09-19.19 / 17.15-17.22, M 33 18.84-18.95 / 16.97-17.00 against the 4-byte pairs' numbers
// above (a tie). Its trace: the five 8-byte stores issued over 0.38 us after the first (against ten
// 4-byte ones over ~0.45): half the store instructions, the same bytes and about the same stall:
// not the number of stores a warp has in flight, more likely the writes themselves.
//
// M > 32 only: at M <= 32 (a 32-row box, warps 2-3 holding padding) it was slower than the row
// split in every round, plain and chained (round H, b2b us: M 1 23.05-23.07 / 20.02-20.10 against
// 17.26-17.28 / 15.27-15.31, M 16 19.62 / 17.89-17.95 against 17.23-17.25 / 15.94-15.98, M 32
// 19.39-19.40 / 17.58-17.61 against 17.26-17.39 / 17.35-17.39); that form was deleted.
//
// Session 27 (rounds A-B, same rounds, b2b us plain / chained, fused M 64; lost and deleted): a
// compact form that fit TWICE on an SM (~113 KB of shared memory, 96 registers: stages of one K
// block, 3 weight and 2 activation slots per half, weights issued 3 stages ahead and activations
// 2; still one CTA per SM per call: 132 distinct SMs in every traced grid), so that a chained
// call's CTA could enter during this CTA's tail and stream its weight ring then, with
// griddepcontrol.launch_dependents at the start or late (once both halves' last stages were full /
// their last loads issued). Round A: 19.68-19.74 / 18.33-18.35 (start trigger), 18.84-19.40 (once
// full), 19.02-19.04 (once issued) against 19.24-19.30 / 17.40-17.42; M 33 / 48 chained
// 18.20-18.28 / 18.23-18.24 at the start and 21.9-23.6 late, against 17.04 / 17.18-17.20. Round
// B: 19.75-19.79 / 18.35-18.41 against 19.25-19.33 / 17.34-17.41; with 4 weight slots (the
// activation scales read into registers per stage, which made room) 21.34-21.40 / 19.83-19.93.
// Its ring alone (diagnostic 3): 17.29-17.36 / 15.95 (3 slots), 16.94-16.98 / 15.86-15.92 (4)
// against 16.99-17.01 / 15.23-15.25. Why (traces): the start trigger did move the boundary (the
// next call's first stage full 1.1-1.3 us after the previous call's last warp anywhere against
// 2.4-4.1), but the 3-slot CTA streamed its share in 13.4-14.0 us (first -> last stage full)
// against 10.5-10.6, its consumers about level with the ring at the last stage (ready for it
// -0.1 to +0.2 us, as the default form's): likely the ring, two stages of one K block in flight per
// half while one is computed (not measured apart); the 4-slot one in 14.1, its consumers 0.3 us
// behind the ring (the per-stage scale reads exposed). And even without compute the
// co-resident ring loses chained by ~0.65 us: the weights the early-entered CTAs stream during
// the previous call are taken from that call's stream (zero-sum), and nothing is left at the
// boundary to gain in exchange. A late trigger let the next call's CTAs enter only 1.6-2.7 us
// after the previous call's last stage full on their SM (the dependent launch's own latency after
// the grid's last trigger), i.e. as the tail ended.
// Round C (the default form's boundary, M 64 chained, same round, 2 runs, b2b us): 17.43-17.47;
// without the output stores (diagnostic 4) 16.76-16.79, the stores under a false predicate (7)
// 17.19, the ring alone (3) 15.24-15.28. Its traces (second call, medians): the next CTA enters
// 0.89-0.90 us after the previous CTA's last warp on its SM with stores, 0.99-1.02 without (4, 7)
// and with the ring alone (3): not the stores draining before the CTA retires, but the turnover
// itself (retire, dispatch, the prologue up to the entry mark). Its half 0 passes
// griddepcontrol.wait 0.42-0.46 us after the previous call's last warp anywhere and its first
// stage is full 1.65 us after that (ring alone 2.37-2.41; what bounds it, the early weights all
// SMs request at entry or the activation boxes after the wait, is not measured apart). Last stage
// full -> CTA done 1.96-1.99 us, 1.55-1.63 without stores, 0.50-0.52 for the ring alone.
//
// Lost (session 23, same rounds, b2b us plain / chained, fused N 9856 x K 6144; deleted): the
// pair as a 2-CTA cluster (two CTAs per SM, the reduce-scatter through distributed shared memory
// between two cluster barriers): round A M 64 21.24-21.28 / 19.51-19.55 against 19.97-19.99 /
// 18.51-18.54 for one CTA of two halves, its ring alone (diagnostic 3) 18.11 against 17.11; M 32
// 20.57-20.61 / 18.55-18.58 against 19.21-19.30 / 17.56-17.57. (Traced, its launch hung in rounds
// A and C; not understood, not pursued.) Each half storing half the TOKENS (warps 2 h, 2 h + 1 at
// M > 32; 150-byte runs per token by half the warps): round C M 64 19.88-19.96 / 18.42-18.43
// against 19.84-19.86 / 18.32-18.36 for half the columns (M 32: 19.14-19.15 / 17.36-17.40 against
// 19.36-19.37 / 17.62-17.65; the row split is faster there anyway: 17.22-17.24 / 17.40-17.49).
//
// Trace (GemmWgmmaOptions::debug_trace; projection_bench --trace, bench diagnostics): the row
// split's kRowsTraceWords per CTA (below), and a second block of kKsTraceExtWords per CTA after
// the grid's (trace + gridDim.x x kRowsTraceWords + blockIdx.x x kKsTraceExtWords; the buffer
// holds 3 x grid blocks of kRowsTraceWords): the SM id, then clock64 marks of the tail (session
// 25): each half's consumers ready for their last stage (its previous fold done) and done with
// their last fold, the hand-over summed (half 0's thread 0), half 1's stores issued, the last
// consumer warp's stores issued; then each half's producer past griddepcontrol.wait, half 0's
// thread 0 about to store; session 26: half 0's thread 0 after its first output store, after its
// first token row's stores and with its second row converted (words 11-13, read into registers
// and written after the stores).
//
// kDiag (GemmWgmmaOptions::debug_rows_diag; bench diagnostics, results wrong): 3 = its ring
// alone (no wgmma, no fold) without the output stores, 4 = the whole kernel without the output
// stores (accumulators kept live), 6 = 4 with each stage released as soon as it is full, before
// its wgmmas read it (no hold on the ring); the reduce-scatter runs in all three. Session 25: 2 =
// the whole kernel with each K block's fragments only summed into the accumulators (no scaled
// fold; stores kept), what the fold costs. Session 26: 7 = the whole kernel with its output
// stores issued under a false predicate (the store instructions fetched and issued, nothing
// written): whether the stores' time is their instructions or their writes.
#pragma once

#include <type_traits>

#include "stages/projection/gemm_wgmma_rows_kernel.cuh"

namespace m3attn::gemm_wgmma_detail {

// m64n80k32: the K split's token-major wgmma (40 fp32 per thread).
template <>
struct Wgmma<80> {
  __device__ __forceinline__ static void mma(float (&d)[40], uint64_t a, uint64_t b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %42, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n80k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, "
        "%9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, "
        "%27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}, %40, %41, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
          "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
          "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
          "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39])
        : "l"(a), "l"(b), "r"(scale_d));
  }
};

constexpr int kKsRowsMax = 76;  // weight rows per pair at most (n80 B tile; see the slots)
constexpr int kKsActSlot = 64 * kBlockK;          // one K block's activations (64 token rows)
constexpr int kKsScaleBytesPerKb = (64 + 2) * 4;  // 64 activation scales, 2 weight-scale blocks
constexpr int kKsThreads = 2 * 128 + 2 * 32;      // two consumer warpgroups, two producer warps
constexpr int kKsTraceExtWords = 16;              // the trace's second block per CTA (below)
// One half's region: at most half of what one CTA per SM may hold (232448 B, at most 256 B of
// static shared memory, the 1024-byte alignment slack), a multiple of 1024 (the second half's
// activation slots stay aligned).
constexpr int kKsHalfBytes = (232448 - 256 - 1024) / 2 / 1024 * 1024;
constexpr int kKsKpb = 2;     // K blocks per ring stage
constexpr int kKsStages = 3;  // ring stages per half
constexpr int kKsActStage = kKsKpb * kKsActSlot;
// A stage's weights plus the n80 B tile's overrun past its last K column at kKsRowsMax rows
// (fewer rows leave more room than they overrun).
constexpr int kKsWeightStage = kKsKpb * kKsRowsMax * kBlockK + (80 - kKsRowsMax) * 16;
constexpr int kKsRing = kKsStages * (kKsActStage + kKsWeightStage);
// Local K blocks per half at most: the scales of what fits next to the ring (K 6144: 24; 26:
// K up to 6400).
constexpr int kKsMaxLocalKblocks = (kKsHalfBytes - kKsRing) / kKsScaleBytesPerKb;
static_assert(kKsActStage % 1024 == 0 && kKsWeightStage % 16 == 0, "slot alignment");
static_assert(kImageStep % kKsKpb == 0, "a stage lies inside one image step");
// (The reduce-scatter uses the drained activation slots, contiguous from the ring's start.)
static_assert(4 * 5 * 32 * 16 <= kKsStages * kKsActStage, "reduce-scatter space");

// K blocks of half h (image steps s with s % 2 == h) for K / 128 = kblocks; the l-th one.
__host__ __device__ __forceinline__ int ksplit_local_kblocks(int kblocks, int h) {
  const int rem = kblocks % 8 - 4 * h;
  return 4 * (kblocks / 8) + (rem < 0 ? 0 : rem > 4 ? 4 : rem);
}
__host__ __device__ __forceinline__ int ksplit_kblock(int l, int h) {
  return 8 * (l / 4) + 4 * h + l % 4;
}
// Dynamic shared memory of a launch whose first half has kbl0 local K blocks.
__host__ __device__ constexpr int rows_ksplit_smem_bytes(int kbl0) {
  return 1024 + kKsHalfBytes + kKsRing + kbl0 * kKsScaleBytesPerKb;
}

// Two floats as a bf16 pair (lo in bits 0-15), each rounded to nearest even.
__device__ __forceinline__ uint32_t bf16x2_rn(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// Diagnostic 7 (bench only): the output stores issued with a false predicate (fetched and issued,
// nothing written).
__device__ __forceinline__ void store_out_dead(uint16_t* p, uint16_t v, int off) {
  asm volatile(
      "{\n.reg .pred q;\nsetp.ne.s32 q, %2, 0;\n"
      "@q st.global.L1::no_allocate.b16 [%0], %1;\n}\n" ::"l"(p),
      "h"(v), "r"(off)
      : "memory");
}
__device__ __forceinline__ void store_out_pair_dead(uint16_t* p, uint32_t v, int off) {
  asm volatile(
      "{\n.reg .pred q;\nsetp.ne.s32 q, %2, 0;\n"
      "@q st.global.L1::no_allocate.b32 [%0], %1;\n}\n" ::"l"(p),
      "r"(v), "r"(off)
      : "memory");
}

__device__ __forceinline__ float4 ld_shared_v4(uint32_t addr) {
  float4 v;
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

template <int kDiag = 0>
__global__ void __launch_bounds__(kKsThreads, 1)
    gemm_rows_ksplit_kernel(const __grid_constant__ CUtensorMap xmap, const RowsArgs p) {
  constexpr bool kRing = kDiag == 3;  // diagnostics: no wgmma, no fold
  // (diagnostics 3, 4, 6: no output stores)
  constexpr bool kNoStores = kDiag == 3 || kDiag == 4 || kDiag == 6;
  constexpr int kAcc = 40;           // fp32 accumulators per thread (m64n80)
  constexpr int kGroups = kAcc / 4;  // column groups of 8 (acc 4 c ... 4 c + 3)

  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t full_bar[2][kKsStages];
  __shared__ __align__(8) uint64_t empty_bar[2][kKsStages];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;

  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid % 32;
  // The half this thread works for: its warpgroup (consumers) or producer warp 8 + h. (A
  // warp-uniform value by a shuffle: with a per-thread one, the loop trip counts and stage sizes
  // below put the wgmmas on a divergent path for ptxas, which then serializes them, C7520.)
  const int h = __shfl_sync(0xffffffffu, tid < 256 ? tid / 128 : (tid - 256) / 32, 0);
  const int g = static_cast<int>(blockIdx.x), pairs = static_cast<int>(gridDim.x);
  const int r_begin = rows_begin(g, pairs, p.n, p.row_align);
  const int rows = rows_begin(g + 1, pairs, p.n, p.row_align) - r_begin;
  const int kb_count = p.kblocks;
  const int kbl = ksplit_local_kblocks(kb_count, h);
  // (Session 24 round I, same round, b2b us, lost and deleted: each half's last stage of two K
  // blocks as two stages of one, so that less compute follows the last bytes to land: M 64
  // 20.15-20.18 / chained 17.90-17.94 against 19.98-20.12 / 17.81-17.83, M 48 20.15-20.16 /
  // 17.79-17.80 against 19.91-19.92 / 17.77.)
  const int steps = (kbl + kKsKpb - 1) / kKsKpb;
  // Stage i's first local K block and its K blocks. (Session 25 round F, same round, b2b us: each
  // half's last stage of two K blocks as two stages of one re-measured with the cheaper fold and
  // epilogue, tied again: M 64 19.56-19.60 / chained 17.39-17.42 against 19.44-19.52 /
  // 17.40-17.44; M 33 / 48 chained +0.05-0.1.)
  static_assert(kKsKpb == 2, "stage_first / stage_nk");
  auto stage_first = [](int i) { return 2 * i; };
  auto stage_nk = [&](int i) { return kbl - 2 * i < 2 ? kbl - 2 * i : 2; };
  // Two boxes of 32 token rows per K block for M < 64 (SlotTokens; p.one_box: one of 64).
  const SlotTokens slots = slot_tokens<64>(p.m, p.one_box != 0);
  // The half's region: activation slots, weight slots, scales.
  const uint32_t hbase = base + static_cast<uint32_t>(h * kKsHalfBytes);
  const uint32_t wbase = hbase + static_cast<uint32_t>(kKsStages * kKsActStage);
  float* s_sa = reinterpret_cast<float*>(smem_raw + (hbase - raw) + kKsRing);
  float* s_sb = s_sa + kbl * 64;

  if (tid == 0) {
    prefetch_tensor_map(&xmap);
    for (int b = 0; b < 2; ++b)
      for (int s = 0; s < kKsStages; ++s) {
        mbar_init(smem_addr(&full_bar[b][s]), 1);
        mbar_init(smem_addr(&empty_bar[b][s]), 128);
      }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (p.trigger_dependents) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  // (Session 25 round F, same round, b2b us: 384 threads, the producer warpgroup's registers given
  // to the consumers by setmaxnreg 40 / 232 (no spills): M 64 19.35-19.43 / chained 17.34-17.46
  // against 19.44-19.52 / 17.40-17.44, M 33 / 48 within 0.1: tied, deleted.)
  if (tid >= 256) {
    if (lane == 1 && p.trace != nullptr) {
      // Diagnostics (bench only): the trace's words 0-4 (kRowsTraceWords) from half 0; word 5
      // (the row split's "last stage released") is half 1's last stage full (the summary's
      // "folded" mark).
      unsigned long long* t = p.trace + int64_t{blockIdx.x} * kRowsTraceWords;
      if (h == 0) {
        t[0] = global_ns();
        t[1] = static_cast<unsigned long long>(clock64());
      }
      for (int i = 0; i < steps; ++i) {
        mbar_wait(smem_addr(&full_bar[h][i % kKsStages]), (i / kKsStages) & 1);
        const unsigned long long c = static_cast<unsigned long long>(clock64());
        if (h == 0 && i == 0) t[2] = c;
        if (h == 0 && i == steps / 2) t[3] = c;
        if (i == steps - 1) t[h == 0 ? 4 : 5] = c;
      }
      if (h == 1 && steps == 0) t[5] = static_cast<unsigned long long>(clock64());
    }
    if (lane == 0) {
      // Lane 0 streams the half's stages: each stage's weights (one bulk copy of the pair's
      // rows, its K blocks' columns) and activation boxes on one full barrier.
      const uint64_t policy = evict_first_policy();
      auto load_weights = [&](int i) {
        const int s = i % kKsStages;
        const uint32_t full = smem_addr(&full_bar[h][s]);
        const uint32_t nk = static_cast<uint32_t>(stage_nk(i));
        mbar_arrive_expect_tx(full, nk * static_cast<uint32_t>(rows * 128 + kKsActSlot));
        const uint32_t dst = wbase + static_cast<uint32_t>(s * kKsWeightStage);
        const uint32_t bytes = nk * static_cast<uint32_t>(rows * 128);
        const uint8_t* src = p.image + rows_image_offset(ksplit_kblock(stage_first(i), h), r_begin,
                                                         rows, p.n, kb_count);
        bulk_load_maybe_hint(dst, src, bytes, full, policy, p.weight_evict_first);
      };
      // Programmatic launch: the weights of the first stages before waiting for the preceding grid.
      // (RowsArgs::early_weights; by default two of the three stages per half. Session 24, same
      // rounds, b2b us, M 64 chained: round D 2 stages 17.68-17.70, 1 stage 18.00-18.03, the whole
      // ring 18.39-18.41; round C 1 stage 17.79-17.84, the ring 18.34-18.36.)
      const int ring = steps < kKsStages ? steps : kKsStages;
      const int want = p.early_weights < 0 ? 2 : p.early_weights;
      const int early = want < ring ? want : ring;
      for (int i = 0; i < early; ++i) load_weights(i);
      // (Session 25, pa, same rounds, b2b us, lost and deleted: the weights of 1-8 stages past the
      // first ring prefetched into L2 before griddepcontrol.wait, to keep HBM busy until the first
      // stage. Round G, by this producer with bulk prefetches (cp.async.bulk.prefetch.L2), 2 / 4 /
      // 8 stages: M 64 chained 18.10-18.20 / 19.10-19.14 / 21.03-21.06 against 17.40-17.53, plain
      // 21.45-21.58 / 23.30-23.32 / 25.35-25.43 against 19.62-19.65, M 33 / 48 chained +0.6-3.4;
      // round I, by the half's consumers line by line (prefetch.global.L2), 1 / 2 / 4 stages: M 64
      // chained 17.89-17.91 / 18.15-18.20 / 19.17-19.20 against 17.41-17.48, plain (2) 21.08-21.26
      // against 19.49-19.64, M 33 / 48 (2 / 4) 17.77 / 18.79, 18.05 / 18.96 against 16.92 / 17.22.
      // Pair traces: entry -> first full 5.61 us at 4 bulk stages, 4.37 at 2 line stages, against
      // 2.65-2.82: the front is bandwidth-bound already (the two early stages per half and stage 2
      // keep each SM's share of HBM busy until the first stage is consumed), and any bytes asked
      // for ahead of the first stage make it land later. The boundary's cost is the previous call's
      // tail plus the ~0.85 us before the next call's CTA enters its SM (one ~224 KB CTA per SM).)
      asm volatile("griddepcontrol.wait;\n" ::: "memory");
      if (p.trace != nullptr)
        p.trace[int64_t{gridDim.x} * kRowsTraceWords + int64_t{blockIdx.x} * kKsTraceExtWords + 8 +
                h] = static_cast<unsigned long long>(clock64());
      // (Session 25 round C, same round, b2b us, lost and deleted: the first ring's weights at
      // once and its later activation boxes only after stage 0 had landed, so that stage 0's
      // boxes pass L2 first: M 64 20.72-20.81 / chained 18.49 against 19.73-19.91 / 17.65-17.73.)
      for (int i = 0; i < steps; ++i) {
        const int s = i % kKsStages;
        if (i >= kKsStages) mbar_wait(smem_addr(&empty_bar[h][s]), ((i / kKsStages) - 1) & 1);
        if (i >= early) load_weights(i);
        const uint32_t act = hbase + static_cast<uint32_t>(s * kKsActStage);
        const int nk = stage_nk(i);
        for (int q = 0; q < nk; ++q) {
          const uint32_t dst = act + static_cast<uint32_t>(q * kKsActSlot);
          const int k0 = ksplit_kblock(stage_first(i) + q, h) * kBlockK;
          tma_load_2d(dst, &xmap, k0, 0, smem_addr(&full_bar[h][s]));
          if (slots.half < 64)
            tma_load_2d(dst + static_cast<uint32_t>(slots.half * kBlockK), &xmap, k0, slots.start2,
                        smem_addr(&full_bar[h][s]));
        }
      }
    }
    return;  // (consumers synchronize with named barriers only)
  }

  // Consumers (warpgroup h). Scales by cp.async, waited for after the first stage's wgmmas are
  // issued (as the row split does).
  const int ct = tid % 128;
  const int blk0 = r_begin / 128, last_blk = p.n / 128 - 1;
  for (int i = ct; i < kbl * 2; i += 128) {
    const int l = i / 2, blk = blk0 + (i % 2) < last_blk ? blk0 + (i % 2) : last_blk;
    cp_async_4(smem_addr(s_sb + i), p.sb + blk * p.sb_s0 + ksplit_kblock(l, h) * p.sb_s1);
  }
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  for (int i = ct; i < kbl * 64; i += 128) {
    const int l = i / 64, m = slots.token(i - l * 64);  // (per slot row)
    if (m < p.m) {
      cp_async_4(smem_addr(s_sa + i), p.sa + m * p.sa_s0 + ksplit_kblock(l, h) * p.sa_s1);
    } else {
      s_sa[i] = 0.0f;
    }
  }

  const int warp = (tid / 32) % 4;
  // The thread's tokens row0, row0 + 8 and weight columns m0 + 8 c + {0, 1} of the pair's rows.
  const int row0 = 16 * warp + lane / 4;
  const int m0 = 2 * (lane % 4);
  const uint32_t full0 = smem_addr(&full_bar[h][0]), empty0 = smem_addr(&empty_bar[h][0]);
  const uint32_t lbo = static_cast<uint32_t>(rows * 16);  // one 16-byte K column of the rows
  // (Session 25 round D, same round, b2b us: each wgmma descriptor as the ring's first one plus a
  // constant in its address field instead of built per k step: M 64 chained 17.48-17.53 against
  // 17.57-17.60 alone, 17.45-17.46 with the fold below against its 17.37-17.38 (spills); not kept.)

  float acc[kAcc];
#pragma unroll
  for (int j = 0; j < kAcc; ++j) acc[j] = 0.0f;
  float frag[kKsKpb][kAcc];

  // The fold: acc += frag x sa[token] x sb[block] (a thread's values: tokens row0 / row0 + 8, its
  // columns 8 c + m0 + e of the CTA's rows, whose weight-scale block is blk0 or blk0 + 1: a CTA's
  // rows straddle at most one 128-row boundary), the block of column (c, e) by one compare
  // against the thread's first column past the boundary, bt. (The row split's fold_token_major
  // picks each value's scale product by a bit mask; ptxas turned that into predicate shuffling
  // and a multiply per value, ~140 instructions per K block per warp in round K's ncu counts
  // against ~105 here. Session 25 round D, same round, b2b us: M 64 19.36-19.47 / chained
  // 17.37-17.38 against 19.72-19.73 / 17.57-17.60 with fold_token_major; M 33 chained
  // 16.87-16.89 against 17.14-17.19, M 48 17.08-17.09 against 17.35-17.40. Round C's
  // diagnostic 2, each fragment only summed: 16.97-16.99 against 17.81-17.86.)
  const int bt = 128 * (blk0 + 1) - r_begin - m0;
  auto fold = [&](const float(&f)[kAcc], const float* sa, float sb0, float sb1) {
    const float t0 = sa[row0], t1 = sa[row0 + 8];
    const float p00 = t0 * sb0, p01 = t0 * sb1, p10 = t1 * sb0, p11 = t1 * sb1;
#pragma unroll
    for (int c = 0; c < kGroups; ++c) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        asm("{\n.reg .pred p;\n.reg .f32 s0, s1;\n"
            "setp.le.s32 p, %4, %5;\n"
            "selp.f32 s0, %6, %7, p;\n"
            "selp.f32 s1, %8, %9, p;\n"
            "fma.rn.f32 %0, %2, s0, %0;\n"
            "fma.rn.f32 %1, %3, s1, %1;\n}\n"
            : "+f"(acc[4 * c + e]), "+f"(acc[4 * c + 2 + e])
            : "f"(f[4 * c + e]), "f"(f[4 * c + 2 + e]), "r"(bt),
              "r"(8 * c + e), "f"(p01), "f"(p00), "f"(p11), "f"(p10));
      }
    }
  };

  auto issue = [&](int i) {
    const int s = i % kKsStages;
    mbar_wait(full0 + 8 * s, (i / kKsStages) & 1);
    if (kDiag == 6) mbar_arrive(empty0 + 8 * s);  // (diagnostic: no hold; see kDiag)
    const int left = stage_nk(i);
    const uint32_t act = hbase + static_cast<uint32_t>(s * kKsActStage);
    const uint32_t weights = wbase + static_cast<uint32_t>(s * kKsWeightStage);
    wgmma_fence();
#pragma unroll
    for (int q = 0; q < kKsKpb; ++q) {
      if (q < left && !kRing) {
        const uint32_t w_addr = weights + static_cast<uint32_t>(q) * 8 * lbo;
        const uint32_t x_addr = act + static_cast<uint32_t>(q * kKsActSlot);
#pragma unroll
        for (int k = 0; k < kBlockK / 32; ++k)
          Wgmma<80>::mma(frag[q], smem_desc(x_addr + 32 * k),
                         smem_desc_interleave(w_addr + 2 * k * lbo, lbo), k);
      }
      wgmma_commit();
    }
  };
  // Each K block folded as its group completes; the stage released after its last group, before
  // the last fold (the row split's order).
  auto fold_stage = [&](int i) {
    const int left = stage_nk(i);
#pragma unroll
    for (int q = 0; q < kKsKpb; ++q) {
      wgmma_wait_upto<kKsKpb - 1>(kKsKpb - 1 - q);
      if (q == kKsKpb - 1 && kDiag != 6) mbar_arrive(empty0 + 8 * (i % kKsStages));
      if (q < left && !kRing) {
        const int l = stage_first(i) + q;
        if constexpr (kDiag == 2) {
#pragma unroll
          for (int j = 0; j < kAcc; ++j) acc[j] += frag[q][j];
        } else {
          fold(frag[q], s_sa + l * 64, s_sb[2 * l], s_sb[2 * l + 1]);
        }
      }
    }
  };

  // Trace marks (thread 0 of each half; see the top): the second block of words.
  unsigned long long* const tx =
      p.trace != nullptr
          ? p.trace + int64_t{gridDim.x} * kRowsTraceWords + int64_t{blockIdx.x} * kKsTraceExtWords
          : nullptr;
  const bool tmark = tx != nullptr && ct == 0;
  // (Session 25 round C, same round, b2b us, lost and deleted: each K block's wgmmas issued as
  // soon as its fragment was folded, the next stage's first K block before this stage's second
  // fold: M 64 19.77-19.80 / chained 18.01-18.03 against 19.73-19.91 / 17.65-17.73.)
  if (steps > 0) {
    issue(0);
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    asm volatile("bar.sync %0, 128;\n" ::"r"(1 + h) : "memory");  // the half's scales
    fold_stage(0);
    for (int i = 1; i < steps; ++i) {
      // (No wgmma in flight here: fold(i - 1) waited for every group.)
      if (tmark && i == steps - 1) tx[1 + h] = static_cast<unsigned long long>(clock64());
      issue(i);
      fold_stage(i);
    }
  }
  if (tmark) {
    tx[3 + h] = static_cast<unsigned long long>(clock64());
    if (h == 0) {
      unsigned smid;
      asm volatile("mov.u32 %0, %%smid;\n" : "=r"(smid));
      tx[0] = smid;
    }
  }

  // Reduce-scatter (see the top): half h stores column groups 5 h ... 5 h + 4 and sends the
  // other five, as [warp][group - 5 (1 - h)][lane] x 16 bytes into the other half's drained ring.
  // (Session 23 round G, same round, b2b us, M 64: each half writing into its OWN drained ring
  // after its warpgroup's barrier, one wait for the other half: 19.97-20.00 / chained
  // 18.25-18.32 against 19.88-20.00 / 18.26-18.28; not kept.)
  const uint32_t xoff = static_cast<uint32_t>(((warp * (kGroups / 2)) * 32 + lane) * 16);
  // Whether group c (a constant after unrolling) is the other half's.
  auto other = [&](int c) { return (c >= kGroups / 2) != (h == 1); };
  asm volatile("bar.sync 3, 256;\n" ::: "memory");  // both halves' rings drained
  // (Trace: a counter of the consumer warps done with their stores, in half 0's drained weight
  // slots, which the hand-over does not touch; zeroed before the barrier below.)
  const uint32_t tcount = base + static_cast<uint32_t>(kKsStages * kKsActStage);
  if (tx != nullptr && tid == 0) asm volatile("st.shared.u32 [%0], 0;\n" ::"r"(tcount) : "memory");
  {
    const uint32_t dst = base + static_cast<uint32_t>((h ^ 1) * kKsHalfBytes) + xoff;
#pragma unroll
    for (int c = 0; c < kGroups; ++c)
      if (other(c))
        st_shared_v4(dst + (c % (kGroups / 2)) * 512, acc[4 * c], acc[4 * c + 1], acc[4 * c + 2],
                     acc[4 * c + 3]);
  }
  asm volatile("bar.sync 3, 256;\n" ::: "memory");  // both halves' hand-overs written
  {
    // Own + received: the same fp32 sum (a + b = b + a) whichever half stores.
#pragma unroll
    for (int c = 0; c < kGroups; ++c) {
      if (other(c)) continue;
      const float4 v = ld_shared_v4(hbase + xoff + (c % (kGroups / 2)) * 512);
      acc[4 * c] += v.x;
      acc[4 * c + 1] += v.y;
      acc[4 * c + 2] += v.z;
      acc[4 * c + 3] += v.w;
    }
  }
  if (tmark && h == 0) tx[5] = static_cast<unsigned long long>(clock64());

  // Epilogue: the row split's token-major bf16 pairs (gemm_wgmma_rows_kernel.cuh), n 80, over the
  // half's columns [lo_col, lo_col + limit) (a pair never crosses the limit: the column before it
  // is stored alone, as the first one is when the outputs start on an odd element). The half's own
  // sums picked once (h is not a constant), each bf16 pair by one cvt.rn.bf16x2.f32 (round to
  // nearest even, as float_to_bf16; NaNs here are GPU arithmetic's canonical one, which both turn
  // into 0x7fff), one shuffle of the packed pairs per group for rows that start on an odd element.
  // (Session 25 round B, same round, b2b us: the former epilogue, which converted and shuffled all
  // ten groups, ~530 instructions per warp: M 64 20.19-20.20 / chained 17.70-17.75 against
  // 19.78-19.79 / 17.61-17.63 now, M 33 chained 17.64-17.65 against 17.15-17.16. Lost there: the
  // pairs staged in shared memory as a [token][column] tile and stored a token row per warp, 128
  // contiguous bytes per store: M 64 21.06-21.11 / 19.04-19.09 (summed -> stored 2.6 us).)
  const bool store = kNoStores ? p.m > 64 : true;
  const int lo_col = 8 * (kGroups / 2) * h;
  // (Session 25 round G: the first 72 columns through a shared-memory tile and one TMA tensor
  // store per CTA faulted on the device (illegal instruction): a tensor store's innermost start
  // coordinate must be a multiple of 16 bytes, which a CTA's first column (74-75 columns per CTA)
  // mostly is not. Round X (branch s25-pc, e9d581b): 64 columns from the CTA's first 16-byte
  // aligned column through a 128-byte-swizzled tile in the drained weight slots, the rest by
  // 2-byte stores, bulk wait before exit: no fault, memcheck / racecheck clean, but slower, b2b
  // plain / chained M 64 19.91-19.93 / 17.79-17.80 against 19.53-19.54 / 17.44-17.45, M 48
  // 19.84-19.85 / 17.59-17.62 against 19.18-19.19 / 17.14-17.16, M 33 19.81-19.82 /
  // 17.50-17.58 against 18.99-19.02 / 16.88-16.90, and its edge test failed (M 48, output pitch
  // padded by 4: columns left zero). Not merged.)
  {
    constexpr int kOwn = kAcc / 2;  // 5 groups of 4
    float own[kOwn];
#pragma unroll
    for (int j = 0; j < kOwn; ++j) own[j] = h == 1 ? acc[kOwn + j] : acc[j];
    const int q = lane % 4, next = (lane & ~3) | ((q + 1) & 3);
    // (Trace, session 26: half 0's thread 0 reads the clock after its first output store, after
    // the first row's stores and before the second row's; written at the end, so that no trace
    // store sits between them.)
    unsigned long long c_first = 0, c_row0 = 0, c_row1 = 0;
    // (Diagnostic 7: the stores predicated off by a value the compiler cannot know.)
    const int live = kDiag == 7 ? static_cast<int>(p.m > 64) : 1;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      uint32_t w[kOwn / 4], nb[kOwn / 4];
#pragma unroll
      for (int j = 0; j < kOwn / 4; ++j)
        w[j] = bf16x2_rn(own[4 * j + 2 * hh], own[4 * j + 2 * hh + 1]);
      const int r = row0 + 8 * hh;
      uint16_t* dst = p.out + slots.token(r) * p.ldo + r_begin + lo_col;
      const int odd = static_cast<int>((reinterpret_cast<uintptr_t>(dst) >> 1) & 1u);
      const int limit = min(rows, lo_col + 8 * (kGroups / 2)) - lo_col;
      // Odd rows: the pair at column 8 j + 2 q + 1 is this lane's second column and the next
      // lane's first (q = 3: lane q = 0's of the next group, which that lane provides). (Session 25
      // round E, same round, b2b us: these shuffles only in warps with an odd row and the interior
      // pairs stored without the clip test: M 64 19.53-19.63 / chained 17.50-17.52 against
      // 19.58-19.61 / 17.48-17.49; not kept.)
#pragma unroll
      for (int j = 0; j < kOwn / 4; ++j)
        nb[j] = __shfl_sync(0xffffffffu, q == 0 ? (j + 1 < kOwn / 4 ? w[j + 1] : 0u) : w[j], next);
      if (tmark && h == 0 && hh == 0) tx[10] = static_cast<unsigned long long>(clock64());
      if (tmark && h == 0 && hh == 1) c_row1 = static_cast<unsigned long long>(clock64());
      if (store && slots.stored(r)) {
        if (odd && q == 0 && limit > 0) {
          if (kDiag == 7) {
            store_out_dead(dst, static_cast<uint16_t>(w[0] & 0xffffu), live);
          } else {
            store_out(dst, static_cast<uint16_t>(w[0] & 0xffffu));
          }
        }
#pragma unroll
        for (int j = 0; j < kOwn / 4; ++j) {
          const int col = 8 * j + 2 * q + odd;
          const uint32_t pair = odd ? __byte_perm(w[j], nb[j], 0x5432) : w[j];
          if (col + 1 < limit) {
            if (kDiag == 7) {
              store_out_pair_dead(dst + col, pair, live);
            } else {
              store_out_pair(dst + col, pair);
            }
          } else if (col < limit) {
            if (kDiag == 7) {
              store_out_dead(dst + col, static_cast<uint16_t>(pair & 0xffffu), live);
            } else {
              store_out(dst + col, static_cast<uint16_t>(pair & 0xffffu));
            }
          }
          if (tmark && h == 0 && hh == 0 && j == 0)
            c_first = static_cast<unsigned long long>(clock64());
        }
      }
      if (tmark && h == 0 && hh == 0) c_row0 = static_cast<unsigned long long>(clock64());
    }
    if (tmark && h == 0) {
      tx[11] = c_first;
      tx[12] = c_row0;
      tx[13] = c_row1;
    }
  }
  if (p.trace != nullptr && tid == 0) {
    unsigned long long* t = p.trace + int64_t{blockIdx.x} * kRowsTraceWords;
    t[6] = static_cast<unsigned long long>(clock64());
    t[7] = global_ns();
  }
  if (tx != nullptr) {
    if (tmark && h == 1) tx[6] = static_cast<unsigned long long>(clock64());
    if (lane == 0) {
      uint32_t before;
      asm volatile("atom.shared.add.u32 %0, [%1], 1;\n" : "=r"(before) : "r"(tcount) : "memory");
      if (before == 7) tx[7] = static_cast<unsigned long long>(clock64());
    }
  }
}

}  // namespace m3attn::gemm_wgmma_detail
