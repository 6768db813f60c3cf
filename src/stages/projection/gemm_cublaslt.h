// The FP8 block-scaled GEMM of SPEC section 2 on Hopper, through cuBLASLt:
//   out bf16 [M, N] = A e4m3 [M, K] (1x128 fp32 scales) x B e4m3 [N, K] (128x128 fp32 scales)^T,
// fp32 accumulation, fast accumulation off. Same GemmParams and validate_gemm() as the CPU twin,
// plus the rules of this path (checked by Fp8BlockGemm::check, before anything is launched):
//   - every tensor on the CUDA device the object was created on (the current device at run time);
//   - M % 4 == 0 and M <= max_m (pad with the quantizer: gemm_padded_rows, rows [M, M_pad) have
//     q = 0, scale = 1); N and K as given at creation;
//   - A scales "token-major": element (m, kb) at m + kb * M, i.e. strides (1, M)
//     (gemm_activation_scales_view builds it; the quantizer writes it when given that view);
//   - B scales row-major [N / 128, K / 128] with the row stride rounded up to a multiple of 4:
//     strides (gemm_weight_scales_row_stride(K), 1) (the same as contiguous when K % 512 == 0;
//     cuBLASLt reads the 128x128 scales in rows of round_up(K / 128, 4), so the buffer must hold
//     N / 128 full rows, padding included);
//   - A, B, out, A scales and B scales 16-byte aligned; row strides of A and B multiples of 16
//     elements, of out a multiple of 8 elements (validate_gemm checks those).
//
// cuBLASLt is column-major, so the row-major product is computed transposed, out^T = B A^T, in the
// "TN" form FP8 needs:
//   cuBLAS A := weights B (K x N column-major, ld = B row stride, op T), scale mode BLK128x128_32F;
//   cuBLAS B := activations A (K x M column-major, ld = A row stride, op N), scale mode VEC128_32F;
//   cuBLAS D := out (N x M column-major, ld = out row stride, bf16).
//
// Algorithm choice: once per M bucket (powers of two from 4, last one round_up(max_m, 4)) at
// creation with cublasLtMatmulAlgoGetHeuristic, for the bucket's largest M; the first candidate
// that cublasLtMatmulAlgoCheck accepts at both ends of the bucket within the workspace is kept. Two
// algorithms per bucket: one for 256-byte aligned operands (cuBLASLt's default assumption) and one
// that needs only 16-byte alignment; run() picks by the actual pointers and row strides. With
// Fp8BlockGemmOptions::deterministic (default) the search excludes the in-place (atomic) split-K
// reduction, so a replay reproduces an eager run bit for bit.
//
// Autotuning (Fp8BlockGemmOptions::autotune, on by default): after the heuristic's choice, the
// 256-byte algorithm of every bucket with m_hi <= autotune_max_m is timed against alternatives on
// the bucket's largest M over scratch buffers allocated (and freed) inside create():
//   - the heuristic's algorithm under the other cluster shapes, with and without CTA swizzling
//     (the only alternatives that pass at M >= 512, where split-K needs too much workspace);
//   - the heuristic's other candidates (up to 32 asked);
//   - configurations enumerated explicitly (cublasLtMatmulAlgoGetIds / AlgoInit and the
//     capabilities: every tile, a few cluster shapes, the first stages id that passes), then
//     split-K 2..8 with the fp32 out-of-place reduction (CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE:
//     deterministic, partial sums in fp32) and CTA swizzle on the fastest shapes;
// every candidate must pass cublasLtMatmulAlgoCheck at both ends of the bucket within the
// workspace, launch without error, and write an output identical byte for byte to the
// heuristic's on integer-valued data (exact in every summation order); anything else is skipped.
// Timing: CUDA events around each launch, L2 flushed (memset of twice its size, then a read sweep
// of it, so no dirty line is written back inside the timed launch) before each,
// median of a few launches; buckets with m_hi >= 1024 are timed on random E4M3 operands (every
// finite code), where the GPU's power cap decides the clocks as it does on real activations
// (kTuneRandomMinM in gemm_cublaslt_internal.h), the output check stays on the integer ones. Rule:
// the fastest candidate replaces the heuristic's only if it is at least 2% faster. Bounded by
// autotune_budget_ms of wall time per object (what is left when the time is spent keeps the
// heuristic's choice). The result depends on measured times, so two objects may choose differently;
// each choice is deterministic run to run (no atomics) and describe() says what was chosen and why.
// Any failure of the tuning itself (allocation, ...) leaves the heuristic's choice and is reported
// by describe(); create() still succeeds.
//
// With Fp8BlockGemmOptions::small_m_max > 0, calls with M <= small_m_max run the small-M kernel
// (run_gemm_small_m_cuda, gemm_small_m_kernel.cuh) instead: same math, equal up to fp32
// accumulation order (off by default until measured faster on the device).
//
// With Fp8BlockGemmOptions::wgmma_max_m > 0, calls with M <= wgmma_max_m (at most 64) run the
// wgmma kernel (run_gemm_wgmma_cuda, gemm_wgmma.h / gemm_wgmma_kernel.cuh): TMA-streamed weights,
// swap-AB wgmma, stream-K split with a deterministic in-kernel reduction, its own workspace
// allocated (and zeroed) by create(). Same contract as the cuBLASLt path. wgmma_max_m = -1 (the
// default) resolves at create(): the environment variable M3ATTN_GEMM_PATH = "wgmma" gives 64,
// "cublaslt" gives 0, "auto" gives 0 and an auto range of 64; unset gives kGemmWgmmaDefaultMaxM
// and, with autotuning on, "auto" up to Fp8BlockGemmOptions::wgmma_auto_max_m (default
// kGemmWgmmaAutoMaxM): for every M bucket with m_hi in the auto range the autotuner also times the
// wgmma kernel on its scratch operands (after the cuBLASLt candidates; with the default
// GemmWgmmaOptions, also at 24 and 4 units per CTA and with L2 promotion 256, keeping the fastest
// shape),
// both it and the kept cuBLASLt algorithm as CUDA-graph replays with a cold L2 (memset + read
// sweep, as the benchmarks), and runs it for that bucket when its output is identical to the kept
// cuBLASLt algorithm's and gemm_prefer_wgmma says so (describe() and algorithm_for() show it).
//
// Prefill (gemm_prefill.h): for every M bucket with m_hi >= Fp8BlockGemmOptions::prefill_min_m
// (and m_hi <= autotune_max_m) the autotuner also times the prefill kernel (clusters 1x2 and 2x1)
// on its scratch operands, as CUDA-graph replays with a cold L2 against the kept cuBLASLt
// algorithm, and runs the faster shape for that bucket when its output is identical to
// cuBLASLt's and it is at least 2 % faster; Fp8BlockGemmOptions::force_prefill runs it for every
// M >= prefill_min_m instead (tests, benchmarks). Session 20 (round E, fused N 9856, K 6144): the
// kernel is 14-22 % slower than cuBLASLt at M 4096 and 4-12 % at M 16384, so the tuner keeps
// cuBLASLt there today.
//
// run() allocates nothing, never synchronizes and may be captured in a CUDA graph. It updates the
// object's cuBLASLt descriptors and uses its one workspace: an object serves one stream at a time
// (two GEMMs in flight on different streams need two objects). Any cuBLASLt failure becomes a
// kCudaError Status naming the call and the cuBLAS status.
#pragma once

#if defined(M3ATTN_WITH_CUDA)
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "m3attn/status.h"
#include "m3attn/tensor.h"
#include "stages/projection/gemm_prefill.h"
#include "stages/projection/gemm_wgmma.h"
#include "stages/projection/projection.h"

namespace m3attn {

// Rows the GEMM needs for m token rows: cuBLASLt's 1x128 activation scaling wants M % 4 == 0.
constexpr int64_t gemm_padded_rows(int64_t m) { return (m + 3) / 4 * 4; }

// Row stride (elements) of the weight scales [N / 128, K / 128]: round_up(K / 128, 4).
constexpr int64_t gemm_weight_scales_row_stride(int64_t k) { return (k / 128 + 3) / 4 * 4; }

// f32 [m_pad, K / 128] view with strides (1, m_pad): the activation-scale layout of Fp8BlockGemm
// (pass it as QuantizeParams::scales and as GemmParams::a_scales). Needs m_pad * K / 128 floats.
TensorView gemm_activation_scales_view(float* data, int64_t m_pad, int64_t k, Device device);

// The decode GEMM without cuBLASLt (gemm_small_m_kernel.cuh): M <= 16 (any M, no padding needed),
// any scale strides validate_gemm accepts; deterministic; no workspace, no allocation, no sync.
// Returns unsupported for M > 16.
Status run_gemm_small_m_cuda(const GemmParams& p, cudaStream_t stream);

// What wgmma_max_m = -1 means without M3ATTN_GEMM_PATH: this forced limit, and up to which M
// bucket (m_hi) the autotuner may choose the wgmma kernel ("auto"; 0: never). Session 11 turned
// auto off: the tuner's cold-L2 flush was a plain memset whose dirty lines were written back inside
// the timed region (it timed cuBLASLt at 29.8 us where projection_bench measured 23.7 us), and
// under that bias it chose the wgmma kernel for M <= 16, which the benchmark measured slower.
// Session 12: the tuner flushes like bench_util (memset + read sweep); the auto range is set from
// the benchmark's measurements (see gemm_prefer_wgmma).
// Session 12, round A (projection_bench, fused N 9856; tuner and bench agreed at every bucket):
// the tuner chose the wgmma kernel at M 4 and 8, which the bench measured at 22.43 / 20.01 us
// (isolated / back-to-back) at M 1 against cuBLASLt's 23.71 / 21.55, and cuBLASLt at M 16 (tie
// within 2 %) and 64 (wgmma 35 % slower). The auto range covers the buckets measured competitive.
// Session 15, round C (projection_bench --shape, two CTAs per SM now automatic at every M): o_proj
// (N 6144, K 8192) at M 32 wgmma 21.47 / 19.40 us against cuBLASLt's 23.07 / 21.49, so the range
// grew from 16 to 32 (the fused N 9856 at M 32: wgmma 24.03 against 22.69, where the tuner keeps
// cuBLASLt); at M 64 cuBLASLt wins both shapes (22.8-22.9 against 25.1-27.1).
constexpr int kGemmWgmmaDefaultMaxM = 0;
constexpr int kGemmWgmmaAutoMaxM = 32;

// Buckets with m_hi <= kGemmWgmmaTieMaxM in the auto range take the wgmma kernel unless cuBLASLt
// was timed at least kGemmWgmmaTieMargin faster. Why (session 18): projection_bench measured the
// wgmma kernel faster than cuBLASLt at fused M 1-16 (N 9856, K 6144) in every round of sessions
// 16-18 (isolated by 0.2-1.5 us, back to back by 0.5-1.5 us) and at o_proj M 1-32 by 2-3 us, but
// the tuner's replays time it 0.8-1.5 us (up to 6 %) slower than the benchmark does while cuBLASLt
// comes out within 0.5 us, so the 2 % rule kept cuBLASLt at fused M 4-16 in most objects
// (session 17: rounds A-D). Session 18 (projection_bench --tuner-probe): not the replay
// procedure (round A: flush of 2 x L2 or 256 MB, 1 or 3 warm-ups, 5 to 30 replays, a host sync
// per replay or not: the tuner's wgmma medians stayed 22.2-23.7 us against the benchmark's
// 21.4-21.8 for the same kernel and M), not the operand values (the benchmark timing the tuner's
// values: the same 21.44 us); where the weights and workspace are allocated moves both paths
// (round B: three other copies 0.2-0.7 us slower than the first, medians of 30), so the tuner,
// timing its own scratch copy, cannot resolve a few percent. With the rule, the default object
// ran the wgmma kernel at fused M 1-16 in rounds B-E (e.g. round C: 21.86 / 19.99 us at M 1,
// 22.08 / 20.22 at M 16 against cuBLASLt's 23.07 / 21.41 and 23.04 / 21.10) and kept cuBLASLt at
// M 32 and 64.
constexpr int kGemmWgmmaTieMaxM = 16;
constexpr double kGemmWgmmaTieMargin = 0.05;

// The autotuner's choice for one M bucket (pure; both times are the tuner's cold-L2 replays of
// the bucket's largest M, with outputs already checked identical): the wgmma kernel runs when the
// bucket lies in the auto range (m_hi <= auto_max_m) and, for m_hi <= kGemmWgmmaTieMaxM, cuBLASLt
// is not at least kGemmWgmmaTieMargin faster; above, the wgmma kernel is at least 2 % faster. A
// time <= 0 (not measured, failed) never wins.
inline bool gemm_prefer_wgmma(double lt_us, double wgmma_us, int64_t m_hi, int64_t auto_max_m) {
  if (!(m_hi <= auto_max_m && lt_us > 0 && wgmma_us > 0)) return false;
  if (m_hi <= kGemmWgmmaTieMaxM) return lt_us >= (1.0 - kGemmWgmmaTieMargin) * wgmma_us;
  return wgmma_us < 0.98 * lt_us;
}

struct Fp8BlockGemmOptions {
  size_t workspace_bytes = size_t{32} << 20;  // cuBLASLt's recommendation for Hopper
  int heuristic_candidates = 16;              // how many heuristic results to try per bucket
  bool deterministic = true;                  // exclude in-place (atomic) split-K reductions
  // M <= small_m_max runs run_gemm_small_m_cuda instead of cuBLASLt (0: never; at most 16).
  int small_m_max = 0;
  // M <= wgmma_max_m runs run_gemm_wgmma_cuda (0: never; at most 64; -1: M3ATTN_GEMM_PATH, or
  // kGemmWgmmaDefaultMaxM plus the autotuner's per-bucket choice). Takes precedence over
  // small_m_max (the autotuner's choice does not).
  int wgmma_max_m = -1;
  // Auto range when wgmma_max_m = -1 resolves to the default path: buckets with m_hi <= this may
  // be given to the wgmma kernel by the autotuner (-1: kGemmWgmmaAutoMaxM, or 64 with
  // M3ATTN_GEMM_PATH = "auto"; 0: never; at most 64). Needs autotune.
  int wgmma_auto_max_m = -1;
  GemmWgmmaOptions wgmma;  // grid shape of the wgmma kernel
  // Time alternatives to the heuristic's algorithm at creation (see above). Tests may turn it off
  // for speed.
  bool autotune = true;
  double autotune_budget_ms = 2000;  // wall-clock bound of the whole tuning of one object
  int64_t autotune_max_m = 16384;    // buckets above keep the heuristic's choice (scratch memory)
  int autotune_max_timed = 48;       // timed candidates per bucket at most
  // Calls with M <= this run the row split (GemmWgmmaOptions::row_packed_weights) once
  // pack_weights_rows() gave the object an image of the weight they use (0: never; at most 64).
  // Session 18 round B (fused N 9856 x K 6144, us isolated / back to back): the row split 19.5 /
  // 17.5 at M 1-8, 20.2 / 17.8 at M 16, 21.2 / 18.7 at M 32 against cuBLASLt's 22.6-22.9 /
  // 20.8-21.1 and the stream-K wgmma kernel's 21.7-23.3 / 19.8-21.2; at M 64 28.7 / 25.5 against
  // cuBLASLt's 22.9 / 21.3. Session 19 round G (serial stages, token-major at M > 32; back to
  // back): 17.3-17.5 us at M 1-32 against cuBLASLt's 21.2-21.4, 21.8 at M 64 against 21.4-21.6
  // (20.7 when chained by programmatic dependent launch): 32 stays. (Session 24 round G: the fused
  // weight's row split at M 33-64 19.8-20.2 against the default object's 21.4-21.6, o_proj's
  // 23.7-25.4 against 21.4-22.2; the layer's fused object takes 64, CudaLayerWorkspace.)
  int row_split_max_m = 32;
  // run_row_split calls whose image has a K-split image (GemmRowImage::ks_data) and M >= this (>
  // 32) run the row split's K split over that image (GemmWgmmaOptions::row_k_split) where it
  // serves the shape, the row split otherwise; 0: never. (Session 25 round H, fused N 9856 x K
  // 6144, b2b us plain / chained: M 33 19.10-19.19 / 16.99-17.10 against the row split's
  // 19.98-20.13 / 18.96-19.04; M 48 19.24-19.30 / 17.18-17.24 against 20.04-20.07 / 18.89-18.96;
  // M 64 19.54-19.61 / 17.49-17.51 against 19.76-19.79 / 18.54-18.56. The layer does not use it:
  // a second image of the fused weight, +60.55 MB per sparse layer at TP1, gave its decode 64x8K
  // step nothing in round H's layer_bench, graph 121.5 against 121.0 us, b2b 120.7 against 120.1.)
  int row_k_split_min_m = 0;
  // Buckets with m_hi >= this may run the prefill kernel (run_gemm_prefill_cuda) when the
  // autotuner times it faster than cuBLASLt (0: never).
  int64_t prefill_min_m = 1024;
  // Every call with M >= prefill_min_m (> 0) runs the prefill kernel with `prefill`, whatever the
  // autotuner found.
  bool force_prefill = false;
  GemmPrefillOptions prefill;  // the forced path's options (the autotuner picks its own)
};

// A row-split image of one weight that the caller owns: gemm_wgmma_pack_weights_rows of that
// weight for `ctas` CTAs (gemm_wgmma_rows_ctas on this device), gemm_wgmma_rows_packed_bytes
// bytes. See Fp8BlockGemm::run_row_split.
struct GemmRowImage {
  const void* data = nullptr;
  int ctas = 0;
  // Optionally the same weight's K-split image (gemm_wgmma_pack_weights_rows for ks_ctas =
  // gemm_wgmma_rows_ctas(N, true) CTAs and row_align ks_row_align, by default 4;
  // Fp8BlockGemmOptions::row_k_split_min_m); null: none.
  const void* ks_data = nullptr;
  int ks_ctas = 0;
  int ks_row_align = 4;
};

class Fp8BlockGemm {
 public:
  // Chooses the algorithms and allocates the workspace on the current device.
  static Result<std::unique_ptr<Fp8BlockGemm>> create(int64_t max_m, int64_t n, int64_t k,
                                                      const Fp8BlockGemmOptions& options = {});
  ~Fp8BlockGemm();
  Fp8BlockGemm(const Fp8BlockGemm&) = delete;
  Fp8BlockGemm& operator=(const Fp8BlockGemm&) = delete;

  // validate_gemm + the rules above; launches nothing.
  Status check(const GemmParams& p) const;
  // out = A x B^T on `stream`. M == 0 launches nothing.
  Status run(const GemmParams& p, cudaStream_t stream);

  // The decode row split (gemm_wgmma.h, GemmWgmmaOptions::row_packed_weights): packs `b` (E4M3
  // [N, K] of this object, on its device, 16-byte aligned rows) into an image the object keeps
  // (N K more device bytes; allocated on the first call, which synchronizes the device once) on
  // `stream`. From then on run() with that weight (same data pointer and row stride) and M <=
  // Fp8BlockGemmOptions::row_split_max_m runs the row split kernel; other calls are unchanged.
  // The weight must not change afterwards (pack it again after a change). Returns unsupported
  // where the row split cannot serve the shape or device (N above 40 rows per CTA, K > 8192, no
  // sm_90): nothing changes then.
  Status pack_weights_rows(const TensorView& b, cudaStream_t stream);
  // run() with a caller-owned row-split image of p.b (one object serving many weights, e.g. one
  // image per layer): calls with M <= row_split_max_m run the row split over `image`; with
  // `programmatic` it is launched with programmatic dependent launch and lets the next kernel
  // launch early (GemmWgmmaOptions::programmatic_launch + trigger_dependents: the preceding kernel
  // must not write the weight or the image). Other calls (and image.data null) run as run().
  Status run_row_split(const GemmParams& p, const GemmRowImage& image, bool programmatic,
                       cudaStream_t stream);

  int64_t max_m() const;
  int64_t n() const;
  int64_t k() const;
  // Device bytes the object holds: cuBLASLt's workspace plus the wgmma kernel's (when enabled)
  // plus the row split's image (after pack_weights_rows).
  size_t workspace_bytes() const;
  // One line per M bucket: the chosen algorithm ids, tiles, stages, split-K and workspace, and
  // with autotuning what was timed and chosen (µs of the heuristic's and of the chosen one).
  std::string describe() const;
  // The 256-byte-aligned algorithm run() uses for M (one line: ids, tile, stages, split-K, and
  // "autotuned" or "heuristic").
  std::string algorithm_for(int64_t m) const;
  // The M limit of the forced wgmma path after the environment override (0: none; buckets the
  // autotuner gave to the wgmma kernel are not counted: see algorithm_for).
  int64_t wgmma_max_m() const;
  // The resolved auto range: buckets with m_hi <= this may run the wgmma kernel when the autotuner
  // chose it (0: never).
  int64_t wgmma_auto_max_m() const;

  // Bench tool (projection_bench --lt-survey): every cuBLASLt configuration for this type
  // combination that cublasLtMatmulAlgoCheck accepts at M = m (rounded up to 4, <= max_m) within
  // the workspace -- every algorithm id x tile x stages id x custom option x cluster shape (no
  // split-K), each with and without CTA swizzle -- launched once on the autotuner's integer-valued
  // scratch operands; those writing the bits of the algorithm run() uses for m are timed like the
  // autotuner (eager launches, cold L2, median of 3) until budget_ms of wall time is spent; then
  // the `top` fastest and the kept algorithm re-timed on random operands, in turns, twice, their
  // output bits compared with the kept algorithm's. Returns the tables as text. Allocates scratch
  // memory (freed on return) and synchronizes.
  Result<std::string> survey_cublaslt(int64_t m, int top, double budget_ms);

  struct Impl;

 private:
  explicit Fp8BlockGemm(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace m3attn

#endif  // M3ATTN_WITH_CUDA
