// The decode-size block-scaled FP8 GEMM on Hopper wgmma (gemm_wgmma_kernel.cuh): the math of
// run_gemm_cpu (SPEC section 2) for M <= 64, streaming the weights with TMA.
// Contract (besides validate_gemm):
//   - every tensor on the current CUDA device, an sm_90 device;
//   - 1 <= M <= 64 (any M: no padding rows needed; M == 0 launches nothing); any scale strides
//     validate_gemm accepts (the token-major layout of Fp8BlockGemm included);
//   - a workspace of at least gemm_wgmma_workspace_bytes(N, M) bytes, 256-byte aligned, whose
//     first gemm_wgmma_counter_bytes(N) bytes are zero before the first call (cudaMemset once at
//     allocation): every launch leaves them zero again. One workspace serves one stream at a time.
//     The row split (GemmWgmmaOptions::row_packed_weights) uses none: it may be null there.
// Deterministic: for a given device and options, results do not depend on timing (split-K
// partials are summed in a fixed order). Allocates nothing, never synchronizes, CUDA-graph
// capturable (the TMA descriptors are encoded on the host at every call and passed by value).
#pragma once

#if defined(M3ATTN_WITH_CUDA)
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "m3attn/status.h"
#include "stages/projection/projection.h"

namespace m3attn {

struct GemmWgmmaOptions {
  // CTAs per SM: 1 (deeper ring, fewer split-K partials) or 2; 0 = automatic = 2 at every M (rings
  // of 4 / 5 stages and 96 registers per thread at M > 16; session 15 round B: 3.4-3.5 us faster
  // than one CTA per SM at M 32 / 64; until then the automatic choice was 1 above M 16).
  int ctas_per_sm = 0;
  // Variant: the stream-K fixup of a split tile is done by the tile's first CTA (whose last
  // segment it is) after waiting for the other contributors' arrivals, instead of by whichever
  // CTA arrives last: contributors publish and go on, the owner stores no partial and pays no
  // atomic. Same bits. Only with max_waves = 1 (ignored otherwise): it waits for other CTAs.
  // Session 14, round B: o_proj M 64 26.8 vs 28.1 us, M 32 23.1 vs 24.1; at M <= 16 0.2-0.4 us
  // slower. Session 15, round C (two CTAs per SM automatic): within 0.2 us of the default at every
  // M for both shapes; with one CTA per SM the fastest wgmma at o_proj M 64 (25.06 us; cuBLASLt
  // 22.78).
  bool owner_fixup = false;
  // Variant: 0 = stream-K (the default). C in [1, 8]: one thread-block cluster of C CTAs per
  // 128-column tile (grid = N / 128 x C; min_units_per_cta, max_waves and owner_fixup are
  // ignored), rank r computing K blocks [r KB / C, (r + 1) KB / C) of the tile; ranks >= 1 hand
  // their fp32 partial to rank 0 through distributed shared memory, which sums them in rank order
  // and writes bf16 (C = 1: whole tiles, no reduction). No workspace traffic and no atomics; the
  // workspace is still required (untouched). Deterministic; not the stream-K split's bits.
  // Session 15 (C = 3, two CTAs per SM): fused N 9856 x K 6144 at M 1 22.08 / 20.04 us (isolated /
  // back to back) against 22.53 / 20.60 with stream-K in round B (round A 22.43 / 20.29 against
  // 23.04 / 20.96; round C 22.30 / 20.05 against 22.59 / 20.53), M 4 the same; slower at M >= 16
  // and for o_proj (N 6144 x K 8192 at M 1: 22.53 against 19.65; C = 5 29.5 us). Opt-in:
  // compute-sanitizer's racecheck cannot run it (the launch fails under the tool; memcheck is
  // clean and every test passes).
  int cluster_split = 0;
  // Variant: the weights as gemm_wgmma_pack_weights packed them for these options (nullptr: b read
  // with TMA 2D boxes, the default). Each 16 KB unit (128 rows x 128 K blocks) is stored as the
  // swizzled shared-memory tile, unit v of CTA c at position v x grid + c, so at every step the
  // grid's CTAs read neighbouring 16 KB blocks (one 1D bulk copy each) instead of 128-byte row
  // pieces spread over the whole weight. b's scales and shape still come from the call; its data
  // is not read. Stream-K only (not with cluster_split). Session 16 (same-round A/Bs, us isolated
  // / back to back): o_proj N 6144 K 8192 M 1 / 16 / 32 19.90 / 17.80, 20.80 / 18.60, 22.50 /
  // 20.21 vs 20.96 / 18.77, 21.95 / 19.62, 23.52 / 21.11 (round B; round C the same within 0.1);
  // fused N 9856 M 1 / 16 / 64 21.86 / 19.89, 22.02 / 20.19, 28.35 / 25.74 vs 22.27 / 20.38,
  // 22.78 / 20.75, 29.63 / 27.12 (round C). Opt-in: the caller keeps the packed image (N K bytes).
  const void* packed_weights = nullptr;
  // Variant (session 18): the row split over a packed linear image (gemm_wgmma_rows_kernel.cuh):
  // the image gemm_wgmma_pack_weights_rows wrote for this device (nullptr: off). Each of
  // min(2 x SMs, N) CTAs owns ceil-or-floor(N / CTAs) whole weight rows (at most 40: N <= 40 x
  // that) over the whole K (K <= 8192), so there is no split-K and no workspace (null allowed),
  // and the grid reads the image front to back. b's scales and shape still come from the call; its
  // data is not read. At M > 32 it runs its token-major form (activations as the wgmma A operand,
  // the CTA's weight rows as B; session 19). `burst` is the K blocks per ring stage there (0: 4
  // at M <= 16, else 2; 1, 2, 4; 4 is unsupported at M > 32). ctas_per_sm = 1 runs one CTA of two
  // consumer warpgroups per SM instead of two CTAs of one (the same image; one ring and one set of
  // activation boxes per SM; the default K blocks per stage): session 18 round I, us isolated /
  // back to back, o_proj (N 6144, K 8192) M 1 17.79 / 15.40 and M 16 18.91 / 16.62 against 17.89 /
  // 16.13 and 21.31 / 17.33 with two CTAs, but the fused N 9856 x K 6144 M 1 / 16 / 32 19.62 /
  // 17.55, 19.42 / 17.48, 22.53 / 20.29 against 19.26 / 17.24, 19.33 / 17.30, 19.62 / 17.73.
  // Session 18 measurements of the row split (fused, rounds C-I): M 1 19.2-19.5 / 17.2-17.3 us, M
  // 16 19.2- 19.4 / 17.2-17.3, M 32 19.5-19.7 / 17.5-17.7 against the stream-K kernel's 21.7-22.2
  // / 19.8-20.3 and cuBLASLt's 22.7-23.1 / 21.1-21.4; M 64 26.4-27.3 / 23.8-24.9 against
  // cuBLASLt's 23.0-23.2 / 21.4-21.5; o_proj M 1 17.9-18.1 / 16.1, M 16 21.1-21.3 / 17.1-17.3. Not
  // with cluster_split or packed_weights; min_units_per_cta, max_waves, owner_fixup and
  // weight_l2_promotion do not apply. Opt-in: the caller keeps the image (N K bytes, as much again
  // as the weight).
  const void* row_packed_weights = nullptr;
  // The row split's CTA count: the `ctas` the image was packed for (gemm_wgmma_pack_weights_rows);
  // required with row_packed_weights. The kernel runs that many (virtual) CTAs whatever the device,
  // so an image packed for another SM count stays exact (later CTAs wait for a second wave: only
  // slower); gemm_wgmma_rows_ctas gives the current device's one-wave count.
  int row_packed_ctas = 0;
  // Variant (session 23; with row_packed_weights; M 33 ... 64): the row split's K split
  // (gemm_wgmma_rows_ksplit_kernel.cuh). Each image CTA's rows (at most 76) go to one CTA of two
  // halves (one CTA per SM); half h takes the K blocks of the image steps s with s % 2 == h, folds
  // its token-major m64n80k32 products, and the halves reduce-scatter their fp32 sums through
  // shared memory; half h then stores the pair's rows 40 h ... 40 h + 39 of every token. Pack the
  // image for gemm_wgmma_rows_ctas(N, true) CTAs (one per SM) with row_align row_k_split_align (4
  // by default) and pass that count as row_packed_ctas; ctas_per_sm does not apply; burst must
  // be 0 or 2 (3 stages of 2 K blocks); K up to 6400 (gemm_wgmma_rows_supported(N, K, true)); M
  // <= 32 is unsupported (slower than the row split there). Same products as the row split; the
  // fp32 sum of the two halves' partial sums instead of one running sum over K. Session 23
  // (fused N 9856 x K 6144, b2b us, same rounds): M 64 chained 18.19-18.38 against the row
  // split's 18.50-18.72, plain 19.84-20.08 against 19.43-19.71.
  bool row_k_split = false;
  // With row_k_split (session 26): the image's partition, the row_align it was packed with
  // (gemm_wgmma_pack_weights_rows; the two must agree): 4 (default), each pair's first row a
  // multiple of 4 where N % 4 == 0 and N / 4 >= row_packed_ctas (at N 9856 over 132 pairs of 72
  // and 76 rows; elsewhere the plain partition), or 1, the plain partition (74-75 rows). Session
  // 26 round F (fused N 9856 x K 6144, same round, 3 runs, b2b us plain / chained): M 64
  // 19.30-19.33 / 17.34-17.43 against 19.50-19.57 / 17.56-17.57, M 48 19.08-19.10 / 17.11-17.16
  // against 19.23-19.26 / 17.34-17.40, M 33 18.90-18.95 / 16.99-17.03 against 18.97-19.08 /
  // 17.08-17.11; round FINAL2 M 64 19.32-19.38 / 17.33-17.42 against 19.56-19.60 / 17.56-17.62.
  int row_k_split_align = 4;
  // With row_packed_weights and programmatic_launch (session 24): the weights of at most this many
  // ring stages are requested before griddepcontrol.wait; 0: the kernels' default (a few K blocks:
  // gemm_wgmma_rows_kernel.cuh rows_early_stages; the K split two stages per half). Requesting the
  // whole first ring early made the first stage land late (behind the ring's burst). Results do
  // not depend on it.
  int row_early_stages = 0;
  // With row_packed_weights (session 24): each K block's activation slot of n token rows as one
  // box even where it reaches past row M - 1 (the tensor unit fills those rows with zeros), instead
  // of two boxes of n / 2 inside the tensor (gemm_wgmma_rows_kernel.cuh, SlotTokens). Two boxes
  // were faster on the fused weight at M 17-48, one box on o_proj's (N 6144, K 8192) at M 9-31 and
  // 48-63 (round G). Results do not depend on it.
  bool row_one_box = false;
  // Fewer CTAs than ctas_per_sm x SMs when the GEMM has fewer than this many 16 KB units per CTA.
  int min_units_per_cta = 16;  // (session 11: 16 beat 4 by 17 % at M 1 and 16 on the H200)
  // Load the weights with an L2 evict-first policy (they are read once per call).
  bool weight_evict_first = true;
  // The producer issues the loads of `burst` consecutive units back to back; 0 = automatic: 2 for
  // the two-CTA-per-SM kernels (6-stage rings), half the ring for one CTA per SM; clamped to the
  // ring depth. (Session 12, N 9856: burst 2 vs 3 at M 1: 22.56 / 22.05 vs 22.66 / 22.37 us
  // isolated in rounds A / B, 20.17 / 20.00 vs 20.23 / 20.13 back-to-back; M 16: 23.46 / 23.20 vs
  // 23.84 / 23.36, 21.17 / 20.97 vs 21.35 / 21.15; at M 64 (9 stages) burst 2 was slower, 32.2 vs
  // 31.5.) A TMA box is traversed row by row, so a burst does not place one row's consecutive
  // 128-byte pieces next to each other in the request stream.
  int burst = 0;
  // L2 promotion of the weight loads (bytes fetched into L2 per request): 0 (none, default), 64,
  // 128 or 256 (also fetches the neighbouring 128-byte K block of each weight row, which the CTA's
  // next unit reads). Session 12, projection_bench at N 9856: 0 beat 256 at M = 1 (22.66 vs 23.68
  // us isolated, 20.23 vs 21.14 back-to-back) and M = 16 (23.84 vs 24.74, 21.35 vs 22.19), equal at
  // M = 64 (31.81 vs 31.81, 29.10 vs 29.41); session 11 saw the same. Results do not depend on it.
  int weight_l2_promotion = 0;
  // Waves of resident CTAs the grid may span (variant; 1 = one wave, the default). With more, the
  // hardware hands the remaining CTAs to SMs as CTAs finish. The stream-K fixup never waits for
  // another CTA, so any number of waves is safe. Needs a workspace of
  // gemm_wgmma_workspace_bytes(N, M, max_waves). Session 12, round B: 10-60 % slower than one wave
  // at every M and CTA size tried (each CTA pays its pipeline fill: 1-unit CTAs took ~5 us a
  // wave), so SMs idling at the tail are not what limits the kernel.
  int max_waves = 1;
  // Programmatic dependent launch: the kernel may start while the preceding kernel in the stream
  // finishes and requests its first ring of weights (the row split: its first few stages,
  // row_early_stages) before waiting for it (griddepcontrol.wait);
  // activations, scales and every write come after the wait. The preceding kernel must not write
  // the weights. Graph-capturable (a programmatic edge).
  bool programmatic_launch = false;
  // Variant: every CTA executes griddepcontrol.launch_dependents at its start, so a kernel
  // launched next with programmatic dependent launch (which must griddepcontrol.wait before
  // reading or writing what this GEMM writes, as this kernel does with programmatic_launch) may
  // start on the SMs this grid's first finishers leave, overlapping its tail. No effect on plain
  // launches that follow.
  bool trigger_dependents = false;
  // Kept for source compatibility; ignored: the producer warp now always stages every unit's
  // scales into shared memory with the unit's data (the former register prefetch is gone).
  bool prefetch_scales = false;
  // Benchmark diagnostics (projection_bench --trace): a device buffer of gemm_wgmma_trace_words()
  // x grid uint64 (grid <= ctas_per_sm x SMs x max_waves, or N / 128 x cluster_split) where every
  // CTA records when it started, got its first and last unit, and ended (%globaltimer ns and
  // clock64 cycles) and its cycles in segment epilogues; the row split (grid = its CTAs) records
  // its own words (gemm_wgmma_rows_kernel.cuh, kRowsTraceWords: entry, first / middle / last
  // stage full, last fold, epilogue done). Results are unchanged.
  unsigned long long* debug_trace = nullptr;
  // Benchmark diagnostics (projection_bench variants; results WRONG): the row split (one warpgroup
  // per CTA, burst 0) at M <= 8 or 17-64 without its wgmmas and folds (1: its own ring, waits and
  // releases, i.e. its stream), without its scaled folds (2: fragments only summed), 1 without
  // the output stores (3), the whole kernel without the output stores (4), 3 without the
  // activation scales' loads (5), 4 with each stage released as soon as it is full, before its
  // wgmmas read it (6, M > 32); the K split also 7: its output stores issued with a false
  // predicate (fetched and issued, nothing written). 0: off.
  int debug_rows_diag = 0;
};

// uint64 words per CTA in GemmWgmmaOptions::debug_trace.
int gemm_wgmma_trace_words();

constexpr int64_t kGemmWgmmaMaxM = 64;

// Bytes of the arrival counters at the start of the workspace (zero between calls).
size_t gemm_wgmma_counter_bytes(int64_t n);
// Workspace bytes for N columns and up to max_m rows on the current device (any options with
// max_waves <= the given value and the given ctas_per_sm; 0 = the automatic choice).
Result<size_t> gemm_wgmma_workspace_bytes(int64_t n, int64_t max_m, int max_waves = 1,
                                          int ctas_per_sm = 0);

// Bytes of the packed weight image (GemmWgmmaOptions::packed_weights) of an N x K weight for the
// grid these options give on the current device.
Result<size_t> gemm_wgmma_packed_bytes(int64_t n, int64_t k, const GemmWgmmaOptions& options);
// Writes b (E4M3 [N, K], K-contiguous, 16-byte aligned rows) packed for `options` into `packed`
// (gemm_wgmma_packed_bytes bytes, 16-byte aligned), on `stream`. The image serves calls with the
// same grid options (ctas_per_sm, min_units_per_cta, max_waves) on a device with as many SMs.
Status gemm_wgmma_pack_weights(const TensorView& b, void* packed, size_t packed_bytes,
                               const GemmWgmmaOptions& options, cudaStream_t stream);

// Whether the row split (GemmWgmmaOptions::row_packed_weights) serves N x K on the current device:
// OK, or unsupported naming the limit (at most 40 weight rows per CTA, K <= 8192).
// k_split: whether its K split (GemmWgmmaOptions::row_k_split) does (at most 76 rows per pair of
// halves, K <= 6400).
Status gemm_wgmma_rows_supported(int64_t n, int64_t k, bool k_split = false);
// The row split's CTA count for N weight rows on the current device: min(2 x SMs, N), one wave;
// k_split: the K split's image CTAs (pairs of halves), min(SMs, N).
Result<int> gemm_wgmma_rows_ctas(int64_t n, bool k_split = false);
// Bytes of the row split's image (GemmWgmmaOptions::row_packed_weights) of an N x K weight: N K.
Result<size_t> gemm_wgmma_rows_packed_bytes(int64_t n, int64_t k);
// Writes b (E4M3 [N, K], K-contiguous, 16-byte aligned rows) as the row split's image for `ctas`
// CTAs (1 <= ctas <= N, at most 76 rows each: 40 for the row split, 76 for its K split;
// gemm_wgmma_rows_ctas for this device) into `packed`
// (gemm_wgmma_rows_packed_bytes bytes, 16-byte aligned), on `stream`. Calls then pass the same
// count as GemmWgmmaOptions::row_packed_ctas.
// row_align 4 (the K split's image, session 26): the aligned partition, each image CTA's first row
// a multiple of 4 where N % 4 == 0 and N / 4 >= ctas (else the plain one), what the K split reads
// by default (GemmWgmmaOptions::row_k_split_align 4); 1: the plain one (the row split's). No
// default: the image does not record its partition, and a K split reading an image packed with
// another one computes wrong outputs without an error, so every caller states it.
Status gemm_wgmma_pack_weights_rows(const TensorView& b, int ctas, void* packed,
                                    size_t packed_bytes, cudaStream_t stream, int row_align);

// Whether the current device can run the kernel (sm_90 with TMA and wgmma).
bool gemm_wgmma_device_supported();

Status run_gemm_wgmma_cuda(const GemmParams& p, void* workspace, size_t workspace_bytes,
                           cudaStream_t stream, const GemmWgmmaOptions& options = {});

}  // namespace m3attn

#endif  // M3ATTN_WITH_CUDA
