// Row split of the decode GEMM over a packed linear weight image (GemmWgmmaOptions::
// row_packed_weights; session 18, opt-in): the math of gemm_wgmma_kernel.cuh (swap-AB wgmma, per
// 128-wide K block an fp32 dot product from the tensor cores folded into fp32 registers with
// sa[m, kb] x sb[n / 128, kb]) without split-K: no partials, counters, fences or fixup.
//
// Work decomposition: CTA c of G = min(2 x SMs, N) owns weight rows [c N / G, (c + 1) N / G)
// (37-38 rows for N 9856 on 132 SMs; at most kRowsMax) over the whole K. Two CTAs per SM, each one
// consumer warpgroup (an m64 wgmma A tile: rows past the CTA's count read other bytes of the same
// stage and their outputs are never stored) and one producer warp (or one CTA per SM with two
// consumer warpgroups: see kWg below).
//
// Weights: gemm_wgmma_pack_weights_rows stores them once as an image that the grid reads linearly:
// K in steps of kImageStep K blocks; step s holds every CTA's rows in CTA order, CTA c's chunk as
// [16-byte K column j][row r][16 bytes] (R rows: column j at j R 16 bytes), which is exactly
// wgmma's K-major layout without swizzle (core matrices of 8 rows x 16 bytes; 8-row groups 128
// bytes apart (SBO), K-adjacent core matrices R 16 bytes apart (LBO)) for any R and any 16-byte
// aligned start. So at every step the grid's CTAs read neighbouring bytes (a front through memory,
// as a plain read's grid-stride loop) and a ring stage of kKpb K blocks (kKpb divides kImageStep)
// is ONE contiguous 1D bulk copy of R x kKpb x 128 bytes (session 18 round A, bandwidth_bench
// --rows: a copy per step 15.47 us back to back against 16.16 for a 4.8 KB copy per K block into
// 1024-byte aligned swizzled slots, and 13.23 against 20.18 for o_proj's 23-row pieces). The
// producer's lane 0 also loads each K block's activation box (n rows x 128 bytes, 128B swizzle, by
// TMA, L2-resident); a full / empty mbarrier pair per stage.
//
// Consumers, one stage at a time: each K block's 4 wgmma m64nNk32 go into their own temporary
// fragment (kNw / 2 fp32 registers; 20 in the token-major form) and their own commit group; the
// warpgroup folds each K block's fragment as soon as its group completes (wgmma.wait_group
// kKpb - 1 - q, session 21) into the accumulators (scale products from shared memory, staged once
// per CTA: the activation scales of every K block and the CTA's two possible weight-scale blocks,
// a CTA's rows straddling at most one 128-row boundary), releasing the stage once its last group
// completes (before that K block's fold), and waits for the next one. (Session 18
// issued stage i + 1's wgmmas before folding stage i, so that the tensor cores never waited for a
// fold; session 19 round G, same round, back to back: serial stages 17.20-17.24 vs 17.61-17.75 us
// at M 32, 21.76-21.78 vs 23.91-23.95 at M 64, 17.26-17.34 vs 17.56-17.58 at M 16, equal at M 1
// (17.41-17.46 vs 17.32-17.41); chained by PDL 15.40-15.42 vs 15.77-15.80 at M 1, 16.09-16.15 vs
// 16.87-16.88 at M 16; o_proj M 16 15.84 vs 17.50. A fold while the next stage's wgmmas are in
// flight costs more than the overlap gains: round D's ablations at M 1 had the kernel without its
// folds as fast as its stream (15.8 us) and the fold's arithmetic is ~20 instructions per K
// block.) (The fragments are not zeroed: the first wgmma of a K block ignores them (scale-d = 0),
// and a non-wgmma write of an accumulator register while other groups are in flight makes ptxas
// serialize every wgmma, C7515.) Epilogue: each thread writes its fragment's bf16 outputs (rows <
// the CTA's count, m < M) without allocating them in L1, as bf16 pairs in the token-major form
// (session 22: see the epilogue).
//
// Lost (session 21 round B, same round, b2b us, deleted): a wide form — an image of one CTA per
// SM (74-75 rows for N 9856), one CTA of one consumer warpgroup per SM, token-major m64n80k32 at
// every M, activation boxes first in each stage (read once per SM), a 5-7 stage ring of 2 K
// blocks: fused M 1 / 16 / 32 / 64 21.5 / 19.3 / 19.5 / 21.0 against 17.4 / 17.4 / 17.3 / 21.2
// (chained 20.4 / 20.4 / 20.5 / 21.0 against 15.4 / 16.2 / 17.5 / 20.2); 1 K block per stage
// 23.8-25.8; o_proj M 1 chained 23.4 against 14.9. Its own ring without compute was already
// slower (M 32 17.16 against 16.34), and one warpgroup per SM pays the fold serially (M 32:
// wgmma +0.9 us, scaled fold +1.45 over its stream).
//
// Lost too (session 21 rounds D-E, deleted): the activation boxes in their own ring of one-K-block
// slots (weight-only stages of 4 K blocks at every n: 5 / 4 / 4 / 3 stages at n 8 / 16 / 32 / 64,
// 3-13 slots, a second producer warp; each K block folded as its group completed): fused M 1 /
// 16 / 32 / 64 20.0 / 19.0 / 23.4 / 28.9 us b2b against 17.3 / 17.2 / 17.2 / 21.2 (2 K blocks
// per stage: 20.7 / 22.6 / 24.1 / 26.8). The weights landed as early or earlier (M 32 first ->
// last full 13.5 us against 13.7) but the consumers ended 4.6-6.5 us after the last weight
// stage: a box requested only when a slot frees (L2 under the stream's load) comes too late; in
// the stage, it is requested a ring ahead like the weights.
//
// Lost as well (session 21 round F, deleted): a staged epilogue (each warpgroup's [token][row]
// outputs through the drained ring, then one warp store of 4-byte pairs per token): fused M 1 /
// 16 / 32 17.54-17.60 / 17.64-17.65 / 18.03-18.17 us b2b against 17.37-17.46 / 17.19-17.23 /
// 17.21-17.24, M 64 equal (21.35-21.43 against 21.26-21.36). (Session 22 measured the stores
// themselves at 2.4 us of M 64's 21.1 (the kernel without them 18.6) and found a pattern that
// costs less: the token-major bf16 pairs of the epilogue below.)
//
// Lost (session 22 rounds B-C, same round, b2b us, deleted): for two warpgroups per CTA, issuing
// each stage's wgmmas in turns (named barriers; one folds while the other's run): fused M 1 / 16
// / 32 / 64 18.03-18.06 / 17.90-17.92 / 21.17-21.26 / 24.63-24.74 against 17.49-17.51 /
// 17.56-17.61 / 20.91-20.94 / 24.52-24.72 without, 17.24-17.34 / 17.17-17.22 / 17.06-17.22 /
// 21.07-21.08 with two CTAs per SM; the ring of two warpgroups alone (no wgmma, no fold) was
// already 20.31-20.36 at M 64 against 19.48-19.51 for two CTAs (traces: first -> last full stage
// 15.6 us against 12.7).
//
// Session 23 (opt-in, GemmWgmmaOptions::row_k_split, gemm_wgmma_rows_ksplit_kernel.cuh): the K
// split — each image CTA's rows (74-75 over 132 image CTAs) shared by the two halves of one CTA
// per SM, half h taking the image steps s % 2 == h, token-major m64n80k32, a reduce-scatter of
// the fp32 sums through shared memory, each half storing half the columns. Same rounds, b2b us,
// fused M 64: chained 18.19-18.38 against 18.50-18.72 here (rounds C-H), plain 19.84-20.08
// against 19.43-19.71; at M <= 32 slower (M 32 plain 19.4 against 17.3: M 33-64 only). Its
// traces (rounds D / E, isolated): the stream runs at its ring's pace with the compute on (first
// -> last full stage 11.5 us, ring alone 11.5-11.7) where this kernel's slows from 12.5 to 15.4,
// but its tail (last stage full -> CTA done) is 2.5 us against 1.2 here. Diagnostic 6 (round D:
// stages released before their wgmmas) puts the hold of this kernel's consumers on its ring at
// 0.3 us of its ~1.9 us of compute at M 64 (18.48 against 18.77 without stores; chained 17.72
// against 17.84).
//
// Session 24: a programmatic launch requests only its first few stages' weights before
// griddepcontrol.wait (rows_early_stages: M 32 chained 16.08-16.38 us b2b against 17.20-17.49 with
// the whole first ring), and activation slots of n >= 16 token rows that would reach past row M - 1
// load as two in-bounds boxes (SlotTokens: M 33 19.93-20.02 against 28.33-28.50). Lost (same
// rounds, b2b us, deleted): two consumer warpgroups per CTA over the same rows taking alternate
// stages (round B: M 16 17.93-18.00 / chained 16.62-16.65 against 17.44-17.46 / 16.15-16.20, M 32
// 17.62-17.67 / 17.62-17.64 against 17.46-17.55 / 17.43-17.44; round C: M 64 20.47-20.56 /
// 19.59-19.68 against 19.56-19.64 / 18.60-18.62): the pace at M 32 is not one warpgroup's serial
// wgmma -> fold -> issue; one empty arrival per warp instead of per thread (round B: equal at every
// M); at M 32 chained, 1 K block per stage (20.66-20.73 against 17.40-17.46), one CTA of two
// warpgroups (19.89-19.93), no evict-first hint (17.56-17.57).
//
// Lost (session 25, rounds A-F, same rounds, b2b us, fused M 64, deleted): the token-major form
// with its wgmma A operand in REGISTERS, loaded by each consumer thread from global memory (the
// L2-resident activations) 4 K blocks ahead, so that the ring held weights only (11 stages of 2 K
// blocks; the weight scales staged once, the activation scales loaded with the fragments; exact
// against the twin at every M). Its ring alone was the fastest yet (17.42 plain / 14.77 chained,
// 3 stages 17.10-17.21 / 15.11-15.25, against this kernel's ring with its activation boxes 18.04 /
// 16.76), but the loads never kept up: 4-byte fragment loads 52.0-52.1 / 51.4-51.5 (round A);
// 16-byte column loads with a 4 x 4 quad transpose 42.2-46.1 / 40.4-43.7 (rounds B-E, rings of
// 3 to 11 stages alike); 2 K blocks ahead instead of 4 faster (36.0 / 34.4 at 3 stages), L1
// prefetches 8 / 12 K blocks ahead slower (49.0-50.8 / 46.0-49.1); the ring with the 16-byte
// loads and no wgmma 29.2-35.9. This kernel: 19.72-19.90 / 18.52-18.63. ncu (rounds C / E): L2
// throughput 26-30 %, DRAM 22-25 %, issue slots 15-24 %, L1 hit rate 48 %, 2 % excess sectors;
// every warp waits on the long scoreboard at the first use of each K block's fragments. Round F
// found the cause: the same loads with no weight ring at all (no copies, no barrier waits) took
// 25.0-26.0 us b2b (ld.cg, L2 only: 36.0-37.9 with the ring), i.e. the per-thread load path moved
// the 104 MB that every CTA's copy of the activations amounts to at ~4 TB/s (~31 GB/s per SM),
// where this kernel's TMA boxes bring them with the weights in ~18 us. (Round C's SASS had also
// shown "row < M ? load : 0" compiled as load + move into the ring, each move waiting for its
// load; unconditional loads (round D) changed nothing measurable.)
//
// Two warpgroups per CTA (kWg = 2, GemmWgmmaOptions::ctas_per_sm = 1): one CTA per SM whose
// warpgroup w is the image's CTA 2c + w (the same image), one ring of deeper stages (4-11) and
// one set of activation boxes for both, each warpgroup's rows one bulk copy per stage. Round I:
// faster for o_proj (M 1 15.40 vs 16.13 us back to back, M 16 16.62 vs 17.33), slower for the
// fused weights (M 1 17.55 vs 17.24, M 16 17.48 vs 17.30, M 32 20.29 vs 17.73): opt-in.
//
// Measured (session 18, rounds C-I, fused N 9856 x K 6144, us isolated / back to back): M 1
// 19.2-19.5 / 17.2-17.3, M 16 19.2-19.4 / 17.2-17.3, M 32 19.5-19.7 / 17.5-17.7, M 64 26.4-27.3 /
// 23.8-24.9; its stream without compute (bandwidth_bench --rows: the same copies, 4 K blocks per
// stage, 8 activation rows) 17.4-17.6 / 15.5-15.6, with a stage held until the next one is full
// (as the consumers do) 17.7 / 15.7; a plain read of the bytes 17.0-17.1 / 14.9-15.2.
// Session 19 (round G, same round, b2b; serial stages, token-major at M > 32): fused M 1 / 16 /
// 32 / 64 17.41-17.46 / 17.26-17.34 / 17.20-17.24 / 21.76-21.78 us, chained by programmatic
// dependent launch (programmatic_launch + trigger_dependents, as in a captured decode chain)
// 15.40-15.42 / 16.09-16.15 / 17.30-17.31 / 20.66-20.71 (cuBLASLt 21.4-21.6 at every M); o_proj M
// 1 / 16 16.11 / 15.84, chained 14.87 / 15.68. Where M 1 loses to its stream (15.8 b2b, round
// F): per-CTA traces (projection_bench --trace) show the stages landing at the stream's pace
// (first -> last full 11.0-11.2 us in both) and the kernel ending ~1.0 us after its last stage
// landed (the stream 0.1): the last stage's wgmmas, fold and epilogue; chaining hides most of it.
//
// Bytes: weights N K once from HBM in image order; activations M_pad K per CTA from L2 (G x the
// stream-K kernel's per-unit share: 264 x 48 KB = 13 MB at n = 8, 101 MB at n = 64); no workspace
// traffic. Tensor work: G x K / 32 wgmma m64nNk32 (64 / 37 of the useful rows' work).
#pragma once

#include "stages/projection/gemm_wgmma_kernel.cuh"

namespace m3attn::gemm_wgmma_detail {

constexpr int kRowsMax = 40;                    // weight rows per (virtual) CTA at most
constexpr int kRowBlockBytes = kRowsMax * 128;  // one K block of a CTA's rows, at most
constexpr int kImageStep = 4;                   // K blocks per step of the packed image
constexpr int kRowsMaxKblocks = 64;             // K <= 8192 (scales staged in shared memory)
// kWg consumer warpgroups per CTA (GemmWgmmaOptions::ctas_per_sm = 1 gives 2: one CTA per SM,
// each warpgroup the virtual CTA 2c + wg of the image's grid, one ring and one set of activation
// boxes for both); the producer warp after them.
template <int kWg>
constexpr int rows_threads() {
  return 128 * kWg + 32;
}
// Shared memory per CTA: two CTAs per SM (228 KB less 1 KB each) or one (227 KB less 1 KB).
template <int kWg>
constexpr int rows_smem_per_cta() {
  return kWg == 1 ? 115712 : 231424;
}

// K blocks per ring stage by default (fragments in flight: 2 x kKpb x kNw / 2 registers per
// thread; GemmWgmmaOptions::burst overrides it with 1, 2 or 4).
template <int kNw>
constexpr int rows_default_kpb() {
  // (Session 18 round C, fused / o_proj, us back to back: at n 8 4 K blocks 17.18 / 16.14 vs 2
  // 17.61 / 16.83, at n 16 17.24 / 17.08 vs 17.39 / 18.04; at n 32 2 (4 leaves two stages: 27-31
  // us). At n 64 the token-major form: 2 (session 19 round F: 23.0-23.1 vs 26.1-26.2 with 1).
  // Session 19 rounds D / F at n 16 fused: 2 K blocks 16.82 (plain), 16.12-16.44 (chained) vs 4
  // 17.40-17.48, 16.60-16.79; o_proj chained 19.25-19.29 vs 16.64-16.67: kept at 4.)
  return kNw <= 16 ? 4 : 2;
}
template <int kNw, int kKpb, int kWg>
constexpr int rows_stage_bytes() {
  return kKpb * (kWg * kRowBlockBytes + kNw * 128);
}
template <int kNw, int kWg>
constexpr int rows_scale_bytes(int kblocks) {
  return (kNw + 2 * kWg) * kblocks * 4;
}
// Ring depth: what fits next to the alignment slack, the scales of K 8192 and ~1 KB of static
// shared memory, at most 12 stages (the consumers hold two stages at a time: at least 2).
template <int kNw, int kKpb, int kWg>
constexpr int rows_stages() {
  constexpr int fit =
      (rows_smem_per_cta<kWg>() - 1024 - 1024 - rows_scale_bytes<kNw, kWg>(kRowsMaxKblocks)) /
      rows_stage_bytes<kNw, kKpb, kWg>();
  return fit < 12 ? fit : 12;
}
// Stages whose weights a programmatic launch requests before griddepcontrol.wait by default: a
// few K blocks, not the whole first ring. (Session 24 round C, same round, b2b us, chained, the
// whole ring against 1 / 2 / 3 stages: M 1 (4 stages of 4 K blocks) 15.49-15.50 against
// 15.64-15.66 / 15.24-15.33 / 15.17-15.18; M 16 (3 of 4) 15.91-15.92 against 15.57-15.60 /
// 15.38-15.39 / the ring; M 32 (5 of 2) 17.20-17.30 against 16.08-16.12 / 16.11 / 16.31-16.34;
// M 64 (3 of 2) 18.60-18.62 against 1 stage 18.40-18.47. Pair traces at M 32 (round B / C): with
// the whole ring every CTA requests 48 KB at entry (12.7 MB over the grid) and its first stage,
// whose activations come only after griddepcontrol.wait, lands 3.5 us after the CTA enters (a
// plain launch's: 2.0); with one stage 1.8 us.) In K blocks: 12 at n 8, 8 at n 16, 2 at n 32 and
// 64 (at least one stage).
template <int kNw, int kKpb>
constexpr int rows_early_stages() {
  constexpr int kblocks = kNw <= 8 ? 12 : kNw <= 16 ? 8 : 2;
  return kblocks / kKpb > 1 ? kblocks / kKpb : 1;
}
template <int kNw, int kKpb, int kWg>
constexpr int rows_smem_bytes(int kblocks) {
  return 1024 + rows_stages<kNw, kKpb, kWg>() * rows_stage_bytes<kNw, kKpb, kWg>() +
         rows_scale_bytes<kNw, kWg>(kblocks);
}

struct RowsArgs : ScalesOut {
  const uint8_t* image;  // gemm_wgmma_pack_weights_rows for this grid
  int n, m, kblocks;
  int weight_evict_first;
  // Programmatic launch: the weights of the first early_weights stages (at most a ring; < 0: the
  // kernel's default, rows_early_stages) before griddepcontrol.wait; 0: none.
  int early_weights;
  int trigger_dependents;
  int one_box;        // GemmWgmmaOptions::row_one_box: one activation box per slot whatever M
  int row_align = 1;  // the image's partition (rows_begin; the K split only: 1 or 4)
  // Bench diagnostics (GemmWgmmaOptions::debug_trace; nullptr in every production call):
  // kRowsTraceWords per CTA, written by consumer thread 0 (below).
  unsigned long long* trace;
};

// Trace words per CTA (projection_bench --trace; bandwidth_bench --rows --trace writes the same
// words for its stream without compute): %globaltimer ns at entry, clock64 at entry, clock64 when
// the first, the middle (steps / 2) and the last ring stage was full, when the last stage was
// released by every consumer (its wgmmas done; since session 21 before the last K block's fold),
// after the epilogue's stores, and %globaltimer ns at the
// end. Only two globaltimer reads per CTA (a read costs ~0.3 us); the host puts each CTA's
// clock64 marks on the globaltimer base with the CTA's own clock rate (cycles between the two
// reads over their ns). Words 0-5 come from the producer warp's idle lane 1, which follows the
// full barriers of every stage and the last stage's empty barrier; words 6-7 from consumer
// thread 0 after its last wgmma wait. (A trace branch in the consumers between wgmmas in flight
// made ptxas serialize every wgmma of the kernel (C7518 / C7520): session 19 round A measured
// that build 1 us slower back to back.)
constexpr int kRowsTraceWords = 8;
static_assert(kRowsTraceWords == kTraceWords, "gemm_wgmma_trace_words() serves both kernels");

// CTA c's first weight row among `grid` CTAs sharing n rows; the CTA owning row r. align 4 (the K
// split's aligned partition, session 26: RowsArgs::row_align) splits n / 4 runs of 4 rows the same
// way, so that every CTA starts on a multiple of 4, where n % 4 == 0 and every CTA gets a run
// (rows_aligned); otherwise (and for align 1) the plain partition.
__host__ __device__ __forceinline__ bool rows_aligned(int grid, int n, int align) {
  return align == 4 && n % 4 == 0 && n / 4 >= grid;
}
__host__ __device__ __forceinline__ int rows_begin(int c, int grid, int n, int align = 1) {
  return rows_aligned(grid, n, align) ? 4 * static_cast<int>(int64_t{c} * (n / 4) / grid)
                                      : static_cast<int>(int64_t{c} * n / grid);
}
__host__ __device__ __forceinline__ int rows_owner(int r, int grid, int n, int align = 1) {
  return rows_aligned(grid, n, align) ? static_cast<int>((int64_t{r / 4 + 1} * grid - 1) / (n / 4))
                                      : static_cast<int>((int64_t{r + 1} * grid - 1) / n);
}
// Byte offset in the image of K block kb of the CTA with rows [r_begin, r_begin + rows) (its
// columns 8 (kb % kImageStep) ... inside the CTA's chunk of kb's step).
__host__ __device__ __forceinline__ int64_t rows_image_offset(int kb, int r_begin, int rows, int n,
                                                              int kblocks) {
  const int st = kb / kImageStep, q = kb - st * kImageStep;
  const int snk = kblocks - st * kImageStep < kImageStep ? kblocks - st * kImageStep : kImageStep;
  return int64_t{st} * kImageStep * n * 128 + int64_t{r_begin} * snk * 128 +
         int64_t{q} * rows * 128;
}

// Activation slots of n token rows (session 24). A kernel of n >= 16 rows serves M in (n / 2, n];
// for M < n it loads each K block's activations as two boxes of n / 2 rows, both inside the
// activation tensor: tokens [0, n / 2) into slot rows [0, n / 2) and tokens [M - n / 2, M) into
// slot rows [n / 2, n) (a 1024-byte aligned half slot; tokens of both boxes are computed twice and
// stored from the first). One box of n rows reaching past row M - 1 (the tensor unit fills the
// rest with zeros) cost microseconds on the fused weight. Round G, same round, b2b us plain /
// chained, two boxes against one: fused M 17 18.26-18.27 / 17.19-17.23 against 19.82-19.89 /
// 18.74-18.76, M 33 20.00-20.02 / 18.89-18.90 against 28.43-28.50 / 26.89-26.90, M 48
// 20.11-20.24 / 18.93-19.00 against 22.07-22.08 / 20.77-20.80, M 9 equal; the K split M 33
// 20.03-20.06 / 17.71-17.75 against 23.44-23.49 / 20.75-20.76. At M = n one box (in bounds) is
// faster (fused M 64 19.83-19.89 / 18.46-18.61 against two boxes' 20.39-20.52 / 19.28-19.31), and
// o_proj (N 6144, K 8192) preferred one box even past M except at M 33 (M 17 21.19-21.20 /
// 20.32-20.37 against 22.73-22.76 / 21.77-21.82; M 48 24.64-24.68 against 25.14-25.23; M 33
// 35.74-35.76 against 25.26): GemmWgmmaOptions::row_one_box keeps one box (the layer's o_proj).
// n 8 keeps one box of 8 rows (M 1-8).
struct SlotTokens {
  int half, start2, m;  // rows per box (n / 2, or n for one box), first token of the 2nd box, M
  __device__ __forceinline__ int token(int r) const { return r < half ? r : start2 + r - half; }
  // Whether slot row r holds a token this thread's outputs are stored for (its first copy).
  __device__ __forceinline__ bool stored(int r) const {
    const int t = token(r);
    return t < m && (r < half || t >= half);
  }
};
// The slot's tokens for M (one_box: one box of kSlotRows rows whatever M).
template <int kSlotRows>
__device__ __forceinline__ SlotTokens slot_tokens(int m, bool one_box) {
  if (kSlotRows < 16 || one_box || m >= kSlotRows) return SlotTokens{kSlotRows, 0, m};
  constexpr int kHalf = kSlotRows / 2;
  return SlotTokens{kHalf, m - kHalf > 0 ? m - kHalf : 0, m};
}

// The epilogue's output stores, without allocating in L1 (session 22 round F, same round, b2b
// us, against plain st.global: fused M 32 17.68-17.72 vs 17.97-18.04, chained 17.59-17.61 vs
// 17.88-17.94; M 64 19.89-19.96 vs 20.02-20.06, chained 19.02 vs 19.14-19.15; .cs 17.77-17.97 /
// 19.95 at M 32 / 64, .cg no faster than plain).
__device__ __forceinline__ void store_out(uint16_t* p, uint16_t v) {
  asm volatile("st.global.L1::no_allocate.b16 [%0], %1;\n" ::"l"(p), "h"(v) : "memory");
}
__device__ __forceinline__ void store_out_pair(uint16_t* p, uint32_t v) {
  asm volatile("st.global.L1::no_allocate.b32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
// Columns col and col + 1 of an output row that ends at `limit`: one 4-byte store of the bf16 pair
// where both lie inside, the first alone where only it does (both epilogues' token-major stores).
__device__ __forceinline__ void store_out_clipped(uint16_t* row, int col, uint16_t lo, uint16_t hi,
                                                  int limit) {
  if (col + 1 < limit) {
    store_out_pair(row + col, lo | (static_cast<uint32_t>(hi) << 16));
  } else if (col < limit) {
    store_out(row + col, lo);
  }
}

template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// wgmma_wait<pending>() for a pending count in [0, kMax] known after unrolling.
template <int kMax>
__device__ __forceinline__ void wgmma_wait_upto(int pending) {
  if constexpr (kMax == 0) {
    wgmma_wait<0>();
  } else {
    if (pending == kMax) {
      wgmma_wait<kMax>();
    } else {
      wgmma_wait_upto<kMax - 1>(pending);
    }
  }
}

template <int kThreads>
__device__ __forceinline__ void rows_consumer_barrier() {
  asm volatile("bar.sync 1, %0;\n" ::"n"(kThreads) : "memory");
}

// Shared-memory matrix descriptor, K-major without swizzle: 8-row core-matrix groups 128 bytes
// apart (SBO), K-adjacent core matrices `lbo` bytes apart (LBO).
__device__ __forceinline__ uint64_t smem_desc_interleave(uint32_t addr, uint32_t lbo) {
  return static_cast<uint64_t>((addr & 0x3FFFFu) >> 4) |
         (static_cast<uint64_t>((lbo & 0x3FFFFu) >> 4) << 16) |
         (static_cast<uint64_t>(128 >> 4) << 32);
}

// Token-major fold (the row split at n 64 and its K split): a thread's accumulators 4 c ... 4 c + 3
// hold weight columns first_col + 8 c + {0, 1} of tokens row0 and row0 + 8; hsel[c][e] is all ones
// where column 8 c + e lies in the second weight-scale block past blk0 (a CTA's rows straddle at
// most one 128-row boundary), so each accumulator picks its scale product with one bitwise select.
template <int kGroups>
__device__ __forceinline__ void token_scale_masks(uint32_t (&hsel)[kGroups][2], int first_col,
                                                  int blk0) {
#pragma unroll
  for (int c = 0; c < kGroups; ++c)
#pragma unroll
    for (int e = 0; e < 2; ++e) hsel[c][e] = (first_col + 8 * c + e) / 128 - blk0 > 0 ? ~0u : 0u;
}

// acc += frag x sa[token] x sb[block]: two tokens (sa[row0], sa[row0 + 8]) times the two
// weight-scale blocks (sb0, sb1) give the K block's four scale products.
template <int kAcc>
__device__ __forceinline__ void fold_token_major(float (&acc)[kAcc], const float (&frag)[kAcc],
                                                 const uint32_t (&hsel)[kAcc / 4][2],
                                                 const float* sa, float sb0, float sb1, int row0) {
  const float t0 = sa[row0], t1 = sa[row0 + 8];
  const float p00 = t0 * sb0, p01 = t0 * sb1, p10 = t1 * sb0, p11 = t1 * sb1;
#pragma unroll
  for (int j = 0; j < kAcc; ++j) {
    const uint32_t m = hsel[j / 4][j % 2];
    const uint32_t lo = __float_as_uint((j / 2) % 2 ? p10 : p00);
    const uint32_t hi = __float_as_uint((j / 2) % 2 ? p11 : p01);
    acc[j] = fmaf(frag[j], __uint_as_float((lo & ~m) | (hi & m)), acc[j]);
  }
}

// n = 64 (M > 32) runs the token-major form (kTok, session 19): the activations are the wgmma A
// operand (m64 = the 64 token rows, K-major 128B-swizzled boxes) and the CTA's weight rows the B
// operand (n40: rows past the CTA's 37-38 read neighbouring bytes of the stage and are never
// stored) instead of swap-AB (A = 64 weight rows of which 37-38 are the CTA's, B = n tokens): 64 x
// 40 instead of 64 x 64 products per k step, 20 accumulators per thread instead of 32, and each
// thread's 20 values belong to two tokens and at most two weight-scale blocks, so a K block's
// fold needs 4 scale products instead of 32. Round F (same round, b2b, fused): M 64 23.0-23.1 us
// with 2 K blocks per stage against swap-AB's 26.5-26.7 (M 48 23.9 against 26.4-26.6; o_proj M 64
// 27.8-28.0 against 33.7-34.3); cuBLASLt 21.4 at M 64. kDiag (GemmWgmmaOptions::debug_rows_diag;
// bench diagnostics, n = 8 / 32 / 64, results wrong): 1 = no wgmma and no fold (the kernel's own
// ring, waits and releases: its stream), 2 = wgmma without the scaled fold (each fragment value
// only added to its accumulator, so that the wgmmas stay live: session 19's first version of 2 had
// no use of the fragments and ptxas dropped every wgmma (ncu, round G: tensor pipe 0 cycles), which
// made rounds D-G's "without folds" rows the same as 1). Session 21 round A (b2b plain / chained,
// fused): M 32 full 17.25-17.27 / 17.39-17.47, 1: 16.33-16.35 / 15.05-15.13, 2: 17.05-17.11 /
// 16.58-16.60; M 64 21.21-21.23 / 20.15-20.17, 19.34-19.35 / 17.96-18.02, 20.19-20.20 /
// 18.82-18.84; o_proj M 1 16.23-16.28 / 14.95-14.96, 14.34-14.49 / 12.79-12.86, 15.63-15.70 /
// 13.91. A third mode that loaded each ring slot's activation boxes only once (no activation
// traffic after the first ring) was slower at M 32 (17.46-17.53) and 0.5 us faster at M 64
// (20.64-20.71): the activation traffic is not what binds; deleted. Session 22: 3 = 1 without
// the epilogue's stores, 4 = the whole kernel without the epilogue's stores (its accumulators
// kept live), 5 = 3 without the activation scales' loads (the ring alone, as bandwidth_bench
// --rows streams it). Session 23: 6 = 4 with each stage released as soon as it is full, before
// its wgmmas read it (the kernel without its hold on the ring; n 64 only).
//
// Lost (session 22 round B, same round, b2b us, deleted): each stage's activation scales copied
// with the stage (the producer warp's 31 other lanes, 4-byte cp.async, noinc arrivals on the
// full barrier) instead of once per CTA, for a deeper ring (M 64 4 stages instead of 3, M 32 6
// instead of 5): M 32 / 64 24.05-24.07 / 31.68-31.72 against 17.45-17.46 / 21.20-21.22 (its ring
// alone 20.68-20.70 / 28.76-28.78 against 16.37-16.38 / 19.36-19.38): the whole grid reads the
// same few scale lines at each stage (one L2 slice), a stage's scales land microseconds late.
// kSlots = false: the kernel compiled without the two-box slot code (slot row = token, one box),
// run where one box serves (M = n or GemmWgmmaOptions::row_one_box; gemm_wgmma.cu, round L).
template <int kNw, int kKpb, int kWg, int kDiag = 0, bool kSlots = true>
__global__ void __launch_bounds__(rows_threads<kWg>(), kWg == 1 ? 2 : 1)
    gemm_rows_kernel(const __grid_constant__ CUtensorMap xmap, const RowsArgs p) {
  constexpr bool kTok = kNw == 64;                                // the token-major form (above)
  constexpr bool kRing = kDiag == 1 || kDiag == 3 || kDiag == 5;  // diagnostics: no wgmma, no fold
  constexpr bool kNoStores = kDiag >= 3;                          // diagnostics: no output stores
  constexpr int kConsumers = 128 * kWg;
  constexpr int kStages = rows_stages<kNw, kKpb, kWg>();
  constexpr int kStageBytes = rows_stage_bytes<kNw, kKpb, kWg>();
  constexpr int kWeightBytes = kWg * kKpb * kRowBlockBytes;  // per stage; activations after
  constexpr int kActBytes = kNw * 128;
  constexpr int kAcc = kTok ? 20 : kNw / 2;  // fp32 accumulators per thread (m64n40 / m64nN)
  static_assert(kImageStep % kKpb == 0, "a stage lies inside one image step");
  static_assert(kStages >= 2, "a ring of at least two stages");
  static_assert(kStageBytes % 1024 == 0 && kActBytes % 1024 == 0, "1024-byte swizzle alignment");
  // The m64 A tile of the last K column reads up to 64 x 16 bytes from its start: rows past the
  // CTA's count run at most 1 KB past its weights, into the stage's activation boxes (landed with
  // it).
  static_assert(kKpb * kActBytes >= 1024, "A tile overruns its stage");

  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t full_bar[kStages];
  __shared__ __align__(8) uint64_t empty_bar[kStages];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  // Scales: s_sa[kb * kNw + r] (slot row r's token's; zero past M), then per warpgroup s_sb[kb *
  // 2 + h] (weight-scale block r_begin / 128 + h of its rows, clamped to the last block).
  float* s_sa = reinterpret_cast<float*>(smem_raw + (base - raw) +
                                         static_cast<uint32_t>(kStages * kStageBytes));

  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid % 32;
  // Warpgroup wg of CTA c is the image's CTA c kWg + wg of kWg x gridDim.x (the producer warp:
  // wg = kWg).
  const int vgrid = static_cast<int>(gridDim.x) * kWg, vcta0 = static_cast<int>(blockIdx.x) * kWg;
  const int kb_count = p.kblocks;
  const int steps = (kb_count + kKpb - 1) / kKpb;
  // The token in each slot row.
  const SlotTokens slots = kSlots ? slot_tokens<kNw>(p.m, p.one_box) : SlotTokens{kNw, 0, p.m};

  if (tid == kConsumers) {
    prefetch_tensor_map(&xmap);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(smem_addr(&full_bar[s]), 1);
      mbar_init(smem_addr(&empty_bar[s]), kConsumers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (p.trigger_dependents) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");

  if (tid >= kConsumers) {
    if (lane == 1 && p.trace != nullptr) {
      // Diagnostics (bench only): the trace's words 0-5 (see kRowsTraceWords).
      unsigned long long* t = p.trace + int64_t{blockIdx.x} * kRowsTraceWords;
      t[0] = global_ns();
      t[1] = static_cast<unsigned long long>(clock64());
      for (int i = 0; i < steps; ++i) {
        mbar_wait(smem_addr(&full_bar[i % kStages]), (i / kStages) & 1);
        const unsigned long long c = static_cast<unsigned long long>(clock64());
        if (i == 0) t[2] = c;
        if (i == steps / 2) t[3] = c;
        if (i == steps - 1) t[4] = c;
      }
      mbar_wait(smem_addr(&empty_bar[(steps - 1) % kStages]), ((steps - 1) / kStages) & 1);
      t[5] = static_cast<unsigned long long>(clock64());
    }
    // Producer: lane 0 streams the stages. A stage's full barrier counts lane 0's
    // arrive.expect_tx (weights and activation boxes together) and the copies' bytes.
    if (lane == 0) {
      const uint64_t policy = evict_first_policy();
      const int r_cta = rows_begin(vcta0, vgrid, p.n);
      const uint32_t cta_rows = static_cast<uint32_t>(rows_begin(vcta0 + kWg, vgrid, p.n) - r_cta);
      auto stage_kblocks = [&](int i) {
        const int left = kb_count - i * kKpb;
        return left < kKpb ? left : kKpb;
      };
      auto load_weights = [&](int i) {
        const int s = i % kStages;
        const uint32_t full = smem_addr(&full_bar[s]);
        const uint32_t nk = static_cast<uint32_t>(stage_kblocks(i));
        mbar_arrive_expect_tx(full, nk * (cta_rows * 128 + kActBytes));
        // One copy per warpgroup's rows (its chunk's columns of the stage's K blocks).
        for (int w = 0; w < kWg; ++w) {
          const int rb = rows_begin(vcta0 + w, vgrid, p.n);
          const int rw = rows_begin(vcta0 + w + 1, vgrid, p.n) - rb;
          const uint32_t dst =
              base + static_cast<uint32_t>(s * kStageBytes + w * kKpb * kRowBlockBytes);
          const uint32_t bytes = nk * static_cast<uint32_t>(rw * 128);
          const uint8_t* src = p.image + rows_image_offset(i * kKpb, rb, rw, p.n, kb_count);
          bulk_load_maybe_hint(dst, src, bytes, full, policy, p.weight_evict_first);
        }
      };
      // Programmatic launch: the weights of the first stages (no preceding kernel writes them)
      // before waiting for the preceding grid, whose outputs (activations, scales) come after.
      const int ring = steps < kStages ? steps : kStages;
      const int want = p.early_weights < 0 ? rows_early_stages<kNw, kKpb>() : p.early_weights;
      const int early = want < ring ? want : ring;
      for (int i = 0; i < early; ++i) load_weights(i);
      asm volatile("griddepcontrol.wait;\n" ::: "memory");
      for (int i = 0; i < steps; ++i) {
        const int s = i % kStages;
        if (i >= kStages) mbar_wait(smem_addr(&empty_bar[s]), ((i / kStages) - 1) & 1);
        if (i >= early) load_weights(i);
        const uint32_t act = base + static_cast<uint32_t>(s * kStageBytes + kWeightBytes);
        const int nk = stage_kblocks(i);
        for (int q = 0; q < nk; ++q) {
          // (Two boxes of half the slot for M < n from n 16 on: SlotTokens.)
          const uint32_t dst = act + static_cast<uint32_t>(q * kActBytes);
          const int k0 = (i * kKpb + q) * kBlockK;
          tma_load_2d(dst, &xmap, k0, 0, smem_addr(&full_bar[s]));
          if (slots.half < kNw)
            tma_load_2d(dst + static_cast<uint32_t>(slots.half * kBlockK), &xmap, k0, slots.start2,
                        smem_addr(&full_bar[s]));
        }
      }
    }
    return;  // (consumers synchronize with bar.sync 1 only)
  }

  // Consumers. The scales go to shared memory by cp.async, every copy in flight at once, and are
  // waited for only after the first stage's wgmmas are issued (round B ncu, M 1: with one plain
  // load and store at a time, the consumers spent 24 % of all stall samples on these loads at the
  // start while the ring filled up). The weight scales are constant; the activation scales come
  // after the preceding grid (they are its outputs).
  const int wg = tid / 128;
  const int r_begin = rows_begin(vcta0 + wg, vgrid, p.n);
  const int rows = rows_begin(vcta0 + wg + 1, vgrid, p.n) - r_begin;
  float* s_sb = s_sa + kb_count * kNw + wg * kb_count * 2;
  const int blk0 = r_begin / 128, last_blk = p.n / 128 - 1;
  for (int i = tid % 128; i < kb_count * 2; i += 128) {
    const int kb = i / 2, blk = blk0 + (i % 2) < last_blk ? blk0 + (i % 2) : last_blk;
    cp_async_4(smem_addr(s_sb + i), p.sb + blk * p.sb_s0 + kb * p.sb_s1);
  }
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  for (int i = tid; i < (kDiag == 5 ? 0 : kb_count * kNw); i += kConsumers) {
    const int kb = i / kNw, m = slots.token(i - kb * kNw);  // (per slot row)
    if (m < p.m) {
      cp_async_4(smem_addr(s_sa + i), p.sa + m * p.sa_s0 + kb * p.sa_s1);
    } else {
      s_sa[i] = 0.0f;
    }
  }

  const int warp = (tid / 32) % 4;
  // The thread's accumulator rows row0, row0 + 8 (swap-AB: weight rows; kTok: tokens) and its
  // columns m0 + 8 c + {0, 1} (swap-AB: tokens; kTok: weight rows).
  const int row0 = 16 * warp + lane / 4;
  const int m0 = 2 * (lane % 4);
  // Weight-scale block (0 or 1 past blk0) of each of the thread's two rows (rows past the CTA's
  // count compute garbage that is never stored; their index stays in range); kTok: the block of
  // each of the thread's weight columns m0 + 8 c + e (accumulators 4 c + e and 4 c + 2 + e) as an
  // all-ones (the next block) or all-zero mask, so that the fold picks each accumulator's scale
  // product with one bitwise select (session 20 round E, same round, b2b, fused M 64: 22.86-22.98
  // us plain / 21.53 chained against 23.84-23.96 / 22.44 for a bit test, a compare and two
  // selects per accumulator; same products, same bits).
  const int h0 = (r_begin + row0) / 128 - blk0;
  const int h1 = (r_begin + row0 + 8) / 128 - blk0;
  [[maybe_unused]] uint32_t hsel[kAcc / 4][2] = {};
  if constexpr (kTok) token_scale_masks(hsel, r_begin + m0, blk0);
  const uint32_t full0 = smem_addr(full_bar), empty0 = smem_addr(empty_bar);
  const uint32_t lbo = static_cast<uint32_t>(rows * 16);  // one 16-byte K column of the chunk

  float acc[kAcc];
#pragma unroll
  for (int j = 0; j < kAcc; ++j) acc[j] = 0.0f;
  float frag[kKpb][kAcc];

  // Stage i's wgmmas, one commit group per K block (empty groups past the last K block keep the
  // group count per stage constant).
  auto issue = [&](int i, float(&f)[kKpb][kAcc]) {
    const int s = i % kStages;
    mbar_wait(full0 + 8 * s, (i / kStages) & 1);
    if (kDiag == 6) mbar_arrive(empty0 + 8 * s);  // (diagnostic: no hold; see kDiag)
    const int left = kb_count - i * kKpb;
    const uint32_t stage = base + static_cast<uint32_t>(s * kStageBytes);
    const uint32_t weights = stage + static_cast<uint32_t>(wg * kKpb * kRowBlockBytes);
    // (No zeroing of f: the first wgmma of a K block ignores it (scale-d = 0), and a non-wgmma
    // write of an accumulator register while other groups are in flight makes ptxas serialize
    // every wgmma, C7515.)
    wgmma_fence();
#pragma unroll
    for (int q = 0; q < kKpb; ++q) {
      if (q < left && !kRing) {
        // K block q: columns 8 q ... of the stage's chunk; a k32 step spans two columns.
        const uint32_t w_addr = weights + static_cast<uint32_t>(q) * 8 * lbo;
        const uint32_t x_addr = stage + static_cast<uint32_t>(kWeightBytes + q * kActBytes);
#pragma unroll
        for (int k = 0; k < kBlockK / 32; ++k) {
          if constexpr (kTok) {
            Wgmma<40>::mma(f[q], smem_desc(x_addr + 32 * k),
                           smem_desc_interleave(w_addr + 2 * k * lbo, lbo), k);
          } else {
            Wgmma<kNw>::mma(f[q], smem_desc_interleave(w_addr + 2 * k * lbo, lbo),
                            smem_desc(x_addr + 32 * k), k);
          }
        }
      }
      wgmma_commit();
    }
  };
  // Stage i's fragments folded into acc in K-block order, each K block q as soon as its own commit
  // group completes (wgmma.wait_group kKpb - 1 - q) while the stage's later K blocks' wgmmas still
  // run; the stage is released once its last group completes, before the last K block's fold (which
  // reads registers and scales only). (Session 21 round H, same round, b2b us, release before vs
  // after the last fold: fused M 64 21.12-21.13 vs 21.40-21.41, chained 20.06-20.12 vs 20.24-20.26;
  // M 16 chained 16.07 vs 16.16-16.19; o_proj M 1 chained 14.63-14.73 vs 14.77-14.80; M 1 / 32 and
  // o_proj M 16 equal. Round F, same round, b2b us, against folding after wait_group 0: o_proj M 1
  // 16.11-16.12 vs 16.28-16.32, chained 14.63-14.75 vs 14.94-15.00; o_proj M 16 15.78-15.81 vs
  // 16.08-16.09, chained 15.55-15.62 vs 15.86-15.87; fused M 1 / 16 / 32 / 64 17.32 / 17.13-17.14 /
  // 17.18-17.22 / 21.26 vs 17.37-17.46 / 17.19-17.23 / 17.21-17.24 / 21.26-21.36, chained
  // 15.30-15.35 / 15.95-16.02 / 17.32-17.33 / 20.21-20.23 vs 15.35 / 16.00-16.07 / 17.41-17.48 /
  // 20.25-20.27. Session 19 round F had released whole stages before their folds with the pipelined
  // order (stage i + 1 issued before stage i's fold): no faster, M 32 18.10 vs 17.61-17.62. Session
  // 21 round H also timed each n 32 k step as two m64n16k32 wgmmas, two independent chains per K
  // block with the same registers and fold: M 32 19.72-19.77 vs 17.40-17.49, deleted.)
  // kPre (n = 8, session 22): K block q's scales are read from shared memory before its wgmma
  // wait, so that their latency runs under the wgmmas instead of after them (the wait's memory
  // clobber keeps the compiler from hoisting them). Round G, same round, b2b us: o_proj M 1
  // 16.09 vs 16.28-16.34, chained 14.52-14.61 vs 14.65-14.75; fused M 1 17.42-17.44 vs
  // 17.47-17.48, chained 15.32-15.43 vs 15.40-15.42; slower at n 16 / 32 / 64 (o_proj M 16
  // 16.28-16.31 vs 15.73-15.75; fused M 32 17.65-17.82 vs 17.35-17.48, M 64 19.77-19.83 vs
  // 19.55-19.61, chained 18.77-18.80 vs 18.50-18.53).
  constexpr bool kPre = kNw == 8;  // (swap-AB)
  constexpr int kPreN = 2 + kNw / 4;
  auto fold = [&](int i, float(&f)[kKpb][kAcc]) {
    const int left = kb_count - i * kKpb;
#pragma unroll
    for (int q = 0; q < kKpb; ++q) {
      [[maybe_unused]] float pre[kPreN];
      if constexpr (kPre) {
        // (Clamped past the last K block: the loads stay inside the staged scales.)
        const int kb = i * kKpb + q < kb_count ? i * kKpb + q : kb_count - 1;
        const float* sa = s_sa + kb * kNw;
        pre[0] = s_sb[2 * kb + h0];
        pre[1] = s_sb[2 * kb + h1];
#pragma unroll
        for (int c = 0; c < kNw / 8; ++c)
#pragma unroll
          for (int e = 0; e < 2; ++e) pre[2 + 2 * c + e] = sa[m0 + 8 * c + e];
      }
      wgmma_wait_upto<kKpb - 1>(kKpb - 1 - q);  // K block q's group complete
      // After the last group: the stage's reads are done; each thread releases its own.
      if (q == kKpb - 1 && kDiag != 6) mbar_arrive(empty0 + 8 * (i % kStages));
      if (q < left && kDiag == 2) {
#pragma unroll
        for (int j = 0; j < kAcc; ++j) acc[j] += f[q][j];
      } else if (q < left && !kRing) {
        const int kb = i * kKpb + q;
        const float* sa = s_sa + kb * kNw;
        if constexpr (kTok) {
          fold_token_major(acc, f[q], hsel, sa, s_sb[2 * kb], s_sb[2 * kb + 1], row0);
        } else {
          float sb0, sb1;
          if constexpr (kPre) {
            sb0 = pre[0];
            sb1 = pre[1];
          } else {
            sb0 = s_sb[2 * kb + h0];
            sb1 = s_sb[2 * kb + h1];
          }
#pragma unroll
          for (int j = 0; j < kAcc; ++j) {
            const int m = m0 + 8 * (j / 4) + j % 2;
            float a;
            if constexpr (kPre) {
              a = pre[2 + 2 * (j / 4) + j % 2];
            } else {
              a = sa[m];
            }
            acc[j] = fmaf(f[q][j], ((j / 2) % 2 ? sb1 : sb0) * a, acc[j]);
          }
        }
      }
    }
  };

  issue(0, frag);
  asm volatile("cp.async.wait_all;\n" ::: "memory");  // this thread's scale copies
  rows_consumer_barrier<kConsumers>();                // everyone's
  fold(0, frag);
  for (int i = 1; i < steps; ++i) {
    issue(i, frag);
    fold(i, frag);
  }

  // Epilogue (no wgmma in flight any more). The token-major form stores its outputs as bf16 pairs
  // (4-byte stores), swap-AB each value alone (store_out: not allocated in L1). (Session 22, same
  // rounds, b2b us, fused M 64 / chained: round D pairs 19.62-19.67 / 18.44-18.48 against 2-byte
  // stores 20.86-21.08 / 19.84-19.87; the kernel without any stores 18.61-18.64 / 17.52-17.55, with
  // as many bytes written as whole 128-byte lines (a diagnostic) 18.76-18.85 / 17.72-17.78: the
  // outputs' pattern costs, not their bytes. Lost and deleted: the outputs through the drained
  // ring, one warp store of 4-byte pairs per token (round D: M 64 21.26, M 32 18.15-18.32
  // vs 17.28-17.35, M 16 17.83 vs 17.25); round E: the pairs joined into 8-byte aligned chunks (M
  // 64 21.37 vs 20.26-20.34, chained 20.49-20.53 vs 19.37-19.42), swap-AB pairs across lanes (M
  // 32 18.60-18.71 vs 17.93-18.03, M 16 17.58-17.60 vs 17.10-17.24).) (kNoStores: a condition never
  // true (M <= 64) that the compiler cannot fold, so that kDiag 4 keeps every wgmma and fold.)
  const bool store = kNoStores ? p.m > 64 : true;
  if constexpr (kTok) {
    // A quad (lanes 4 t ... 4 t + 3) holds columns 8 c + 2 q + {0, 1} (weight rows of the CTA) of
    // tokens row0 and row0 + 8: a pair per lane and c; where a token's outputs start on an odd
    // element, each lane pairs its odd column with the next lane's even one (a shuffle; lane 3
    // takes lane 0's of the next c) and lane 0 stores column 0 alone.
    const int q = lane % 4, next = (lane & ~3) | ((q + 1) & 3);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      uint16_t x0[kAcc / 4 + 1], x1[kAcc / 4], nb[kAcc / 4 + 1];
#pragma unroll
      for (int c = 0; c < kAcc / 4; ++c) {
        x0[c] = float_to_bf16(acc[4 * c + 2 * h]);
        x1[c] = float_to_bf16(acc[4 * c + 2 * h + 1]);
      }
      x0[kAcc / 4] = 0;
#pragma unroll
      for (int c = 0; c <= kAcc / 4; ++c)
        nb[c] = static_cast<uint16_t>(__shfl_sync(0xffffffffu, x0[c], next));
      const int m = slots.token(row0 + 8 * h);
      uint16_t* dst = p.out + m * p.ldo + r_begin;
      const bool odd = ((reinterpret_cast<uintptr_t>(dst) >> 1) & 1u) != 0;
      if (store && slots.stored(row0 + 8 * h)) {
        if (odd && q == 0 && rows > 0) store_out(dst, x0[0]);
#pragma unroll
        for (int c = 0; c < kAcc / 4; ++c) {
          const int col = 8 * c + 2 * q + (odd ? 1 : 0);
          const uint16_t lo = odd ? x1[c] : x0[c];
          const uint16_t hi = odd ? (q < 3 ? nb[c] : nb[c + 1]) : x1[c];
          store_out_clipped(dst, col, lo, hi, rows);
        }
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < kAcc; ++j) {
      const int col = m0 + 8 * (j / 4) + j % 2, row = row0 + 8 * ((j / 2) % 2);
      const int m = slots.token(col), r = row;  // token, weight row of the CTA
      if (store && slots.stored(col) && r < rows)
        store_out(p.out + m * p.ldo + r_begin + r, float_to_bf16(acc[j]));
    }
  }
  if (p.trace != nullptr && tid == 0) {  // (no wgmma in flight any more)
    unsigned long long* t = p.trace + int64_t{blockIdx.x} * kRowsTraceWords;
    t[6] = static_cast<unsigned long long>(clock64());
    t[7] = global_ns();
  }
}

// Packs b [N, K] (row stride ldb bytes) into the row split's image for `grid` CTAs (see the top of
// this file): 16-byte chunk j of row r (of its CTA) of K block kb at column 8 (kb % kImageStep) + j
// of the CTA's chunk of kb's step. One thread per 16-byte chunk of b.
// align: the partition (rows_begin; 4: the K split's aligned one).
static __global__ void pack_weights_rows_kernel(const uint8_t* __restrict__ b, int64_t ldb, int n,
                                                int kblocks, int grid, int align,
                                                uint8_t* __restrict__ image) {
  const int64_t row_chunks = int64_t{kblocks} * (kBlockK / 16);
  const int64_t chunks = int64_t{n} * row_chunks;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < chunks;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int row = static_cast<int>(i / row_chunks);
    const int cj = static_cast<int>(i - int64_t{row} * row_chunks);
    const int kb = cj / 8, j = cj % 8;
    const int c = rows_owner(row, grid, n, align);
    const int r_begin = rows_begin(c, grid, n, align);
    const int rows = rows_begin(c + 1, grid, n, align) - r_begin;
    const int r = row - r_begin;
    const uint4 v = *reinterpret_cast<const uint4*>(b + int64_t{row} * ldb + int64_t{cj} * 16);
    *reinterpret_cast<uint4*>(image + rows_image_offset(kb, r_begin, rows, n, kblocks) +
                              (int64_t{j} * rows + r) * 16) = v;
  }
}

}  // namespace m3attn::gemm_wgmma_detail
