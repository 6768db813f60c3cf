// CUDA launcher of the paged FP8 attention: the CPU twin's validation, the CUDA-only rules, a
// launch plan derived from host-known shapes only, then one kernel (plus attention_merge_kernel
// when the blocks of a tile are split over several CTAs, and the quantize stage when out_q is set
// and the kernel has no quantizing epilogue). No sync, no allocation, no copy: the launch is
// CUDA-graph capturable. Shared device code: attention_kernel.cuh; the kernels:
//   - decode (batches averaging < 2 query tokens per request): the 8-warp mma.sync decode kernel
//     (attention_decode_kernel.cuh, 1-token tiles), bound by HBM reads of the selected K/V tiles
//     (32 KB per block and KV head) and, at one wave (B64), by its per-block latency; B1 is launch-
//     and latency-bound whatever the kernel (splits + merge);
//   - verify (2 .. 15 tokens per request): the wgmma verify kernel (attention_verify_wgmma.cuh,
//     4-token tiles x 16 heads = 64 rows, each distinct block of a tile read once);
//   - prefill and mixed chunks (>= 16 tokens per request): the warp-specialised persistent wgmma
//     kernel (attention_prefill_ws.cuh, kernel 15) where TMA can address the pool, else the
//     cp.async wgmma kernel (attention_prefill_wgmma.cuh, kernel 4).
#include <algorithm>
#include <cstdint>
#include <limits>

#include "core/cuda_check.h"
#include "core/pdl.cuh"
#include "m3attn/config.h"
#include "stages/attention/attention.h"
#include "stages/attention/attention_decode_kernel.cuh"
#include "stages/attention/attention_kernel.cuh"
#include "stages/attention/attention_merge.cuh"
#include "stages/attention/attention_prefill_wgmma.cuh"
#include "stages/attention/attention_prefill_ws.cuh"
#include "stages/attention/attention_verify_wgmma.cuh"

namespace m3attn {

namespace {

namespace ak = attention_kernel;
namespace ad = attention_decode;
namespace ap = attention_prefill;
namespace av = attention_verify;

// The automatic plan picks the wgmma prefill kernel (kernel 4) for batches averaging at least
// kWgmmaMinAvgTokens query tokens per request (prefill and mixed chunks); decode and verify batches
// keep the mma.sync kernel.
constexpr bool kAutoWgmma = true;
// ... and runs it as the warp-specialised persistent kernel where TMA can address the pool (H200,
// 8K chunk, sparse at 8K / 64K, session 12: kernel 8 1265 / 1426 us vs 1350 / 1516 us for kernel 4;
// the union by minimum extraction 915 / 1038 us vs 998 / 1112 us (round A); a 4-stage ring
// (kernel 11) 939-946 / 1061-1071 us vs 1000-1006 / 1139-1148 us (round B); session 13 round B:
// kernel 15 (64 / 216 registers, no spills) sparse 900.3 / 906.0 and 1016.9 / 1028.3 us vs
// 922.2 / 929.3 and 1046.9 / 1058.4 for 11, lowoverlap 2096 / 2121 vs 2168 / 2182 us, dense 1-3 %
// slower; round C: 15 519-523 / 522-527 TFLOP/s sparse, dense within the spread of 11). Kernels
// 2, 3, 6-10 (never faster), 12-14, 16-18 (session 13: slower) were removed.
constexpr bool kAutoWs = true;
// It is kernel 15 (64 / 216 registers) for sparse and dense attention; kernel 11 (40 / 232) was
// removed in session 14 (round A, dense 8K chunk at 8K / 64K: 15 572.8 / 590.4 TFLOP/s vs 517.3 /
// 541.2 for 11; session 13 rounds C / D: 15 2-4 % faster on dense, faster on sparse everywhere).
constexpr int64_t kWgmmaMinAvgTokens = 16;
// The automatic plan picks the wgmma decode / verify kernel (4-token tiles, one warpgroup) for
// batches averaging 2 .. kWgmmaMinAvgTokens - 1 query tokens per request (speculative verify).
constexpr bool kAutoVerifyWgmma = true;  // H200: verify B256 x 4 tokens 192 vs 404 us
constexpr int64_t kVerifyMinAvgTokens = 2;
// Its variant (attention_verify_wgmma.cuh: 8 cp.async loads, 9 TMA loads and the two-pass V NaN
// test; 9 runs as 8 where TMA cannot address the pool). H200, session 12, round C (8K, isolated /
// back-to-back us), before the two-pass test: verify
// B256 x 4 v9 175.0 / 169.8 (71.4 / 73.5 % of copy), v8 188.7 / 179.9; B64 x 4 v9 47.7 / 46.3, v8
// 49.6 / 48.0; dense B64 x 4 v9 157.0, v8 166.1. Variants 1 .. 7 (never faster) were deleted in
// session 13.
// Session 14: the two-pass NaN test (opt-in variant 10 in rounds A / B, since then part of 9):
// round A (sparse draft 3, isolated us at 8K / 32K / 128K) B64 47.6 / 47.6 / 47.7 vs 48.5 / 48.4 /
// 48.9 without, B256 172.1 / 173.6 / 173.7 vs 175.4 / 176.7 / 176.6; round B (one run, 8K) draft
// 0 / 1 / 3: B64 48.0 / 48.0 / 48.3 vs 48.4 / 48.8 / 47.7, B256 171.0 / 174.3 / 178.9 vs 172.8 /
// 175.1 / 179.6 (~1 % on average).
// Session 15 (round B, sparse draft 3, isolated us at 8K / 32K / 128K, one run each): 13 (9 with
// the lazy running max and a plain mbarrier poll) B64 47.7 / 47.6 / 47.6 vs 48.2 / 48.2 / 48.4 for
// 9, B256 172.8 / 173.3 / 173.4 vs 175.2 / 177.5 / 176.0; 12 (9 with the plain poll alone) 48.8 /
// 48.4 / 48.7 and 176.0 / 176.4 / 177.1 (no gain): 9 and 12 were removed, 13 is automatic.
// Session 16 (round B, sparse draft 3, isolated us at 8K / 32K / 128K, two runs each): 17 (13 with
// conflict-free f16 V stores, the proxy fence after the softmax and a shorter epilogue, the same
// bytes) B256 164.7 / 165.7 / 166.2 and 164.6 / 165.4 / 166.1 vs 173.1 / 175.2 / 175.1 and
// 173.0 / 173.6 / 174.5 for 13 (75.7 % of copy), B64 47.4 / 46.4 / 46.6 and 47.9 / 47.2 / 46.6 vs
// 48.0 / 47.9 / 48.1 and 47.8 / 47.9 / 48.2; 16 (without the epilogue) B256 168.2-169.9 (round A
// too: 169.4-171.1 vs 174.0-176.1), B64 unchanged; round C: 17 B256 165.8-167.5, B64 46.2-47.4 vs
// 173.9-175.6, 47.8-48.2 for 13. 17 is automatic; 13 and 16 were removed, and so were the opt-in
// 18 (speculative row max: a wash), 19 (ring started on one block: slower at B256) and 20 (o_proj's
// codes converted in pairs: slower).
// Session 17 (sparse draft 3, isolated us, two runs per round): 21 (17 with the page-table row
// prefetched at entry and the first two blocks requested as soon as their pages are known, before
// the union is complete; the same bytes in the same order) B64 x 4 45.6-46.3 (round A) and
// 45.3-46.6 (round B) vs 46.4-47.5 and 46.6-47.2 for 17 (8K / 32K / 128K), B256 x 4 @ 32K 160.4 /
// 160.6 and 161.1 / 161.3 vs 164.9 / 164.4 and 165.1 / 165.3. 17 was removed after round B, and so
// were 22-25 (see attention_verify_kernel) and, for the decode kernel, the page-table prefetch
// alone (decode_kernel 8: B64 40.9-42.4 vs 40.7-41.8) and the refill at the end of the iteration
// (9: 41.5-42.1).
// Session 20: 53 (21 with the rows out by bulk copies, attention_verify_wgmma.cuh write_rows_bulk)
// replaces 21: B256 x 4 @ 32K 157.5-158.1 and 158.7-159.9 vs 160.7-160.8 and 160.5-161.6 us (rounds
// D / E, same-run alternating runs); 21 was removed.
// Session 21: 64 (53 with one bulk copy of a token's rows per warp, which also takes out_q)
// replaces 53: B256 x 4 isolated us, same-run alternating runs, tie: 157.6-158.4 vs 157.7-160.3 @
// 32K (round F), 158.9-162.0 vs 158.8-161.8 @ 8K and 161.2-161.5 vs 159.1-163.0 @ 32K (round G); 53
// removed. 69 (64 with the K / V copies L2 evict-first, as 67) replaces 64: round H, B256 x 4 at
// 8K / 32K, three alternating runs each, isolated 158.0-161.4 (mean 159.8) vs 158.6-164.6
// (161.5) us, b2b 154.2-157.4 (155.9) vs 156.4-158.9 (158.1); round I 156.2-158.9 (157.4) vs
// 157.4-159.3 (158.1), b2b 153.3 vs 155.4; 64 removed.
constexpr int kAutoVerifyVariant = 69;  // sparse and dense (layers 0-2) alike
// ... except for one-wave grids (make_plan), where 27 (21's loop on cp.async loads, the early
// copies by TMA, as in the decode kernel) runs. Round C2 (two runs, sparse draft 3, isolated us at
// 8K / 32K / 128K): B64 x 4 44.7 / 44.4 / 44.7 and 44.8 / 44.6 / 44.3 vs 45.5 / 46.3 / 46.0
// and 45.4 / 46.2 / 45.7 for 21 (back to back 43.2-43.7 vs 44.0-44.3), but B256 x 4 @ 32K 162.3 /
// 162.2 vs 160.3 / 160.8. 26 (27 without the early copies: B64 x 4 44.6-46.0, B256 x 4 165.6 /
// 165.7) was removed.
// Session 18: 34 (27 with one early copy instead of two) replaces 27 there. Rounds D / F (three and
// two alternating runs, B64 x 4 at 8K / 32K / 128K, isolated us): 42.2-43.1 and 41.8-42.5 vs
// 42.9-44.8 and 43.3-44.7 for 27; see attention_verify_kernel for what lost (28-33, 35, 36).
// Session 19: 42 (34 with the Q fragments loaded at entry for the guessed tile) replaces 34 there.
// Rounds E / G (three alternating runs, B64 x 4 at 8K / 32K / 128K, isolated us): 42.2-43.6 and
// 42.3-42.9 vs 43.2-44.4 and 43.9-44.4 for 34 (then removed); see attention_verify_kernel for
// what lost (37-41, 43-45). 46 (21 with the early Q, for B256 x 4) was built but never ran (no
// device time left) and was removed.
// Session 20: 52 (42 with the rows out by bulk copies) replaces 42: B64 x 4 at 8K / 32K / 128K
// 41.4-42.1 vs 42.2-42.8 (round D), 41.6-42.0 (mean 41.77) vs 42.0-42.6 (42.24) (round E); 42 was
// removed, and so were 50, 51, 54-57 (see attention_verify_kernel).
// Session 21: 67 replaces 52: 52 with the guessed tile's page-table reads issued before the tile
// scan and list entry 0 copied right after it (kPageEarly), one bulk copy of a token's output rows
// per warp (kBulkOut) and the K / V copies L2 evict-first (kEvictFirst); the steps were 60, 63
// (removed). B64 x 4 at 8K / 32K / 128K, isolated us, same-run alternating runs (3 each): round G
// 67 41.3-41.6 (mean 41.49, b2b 39.5-39.7) vs 52 41.9-42.5 (42.19, b2b 41.8-42.4); 63 (67 without
// evict-first) 41.0-42.2 (41.48, b2b 41.3-41.9). Rounds C / D / F: 60 41.66 / 41.91 / 41.3 vs 52
// 42.24 / 42.31 / 41.9 (means); see attention_verify_kernel for what lost (58, 59, 61, 62, 65,
// 66, 68). 70 (67 with request `tile`'s page-table row in shared memory, one copy per candidate
// warp, and Q loaded after the ids) replaces 67: round H 40.8-41.4 (mean 41.21) vs 41.1-41.8
// (41.44), b2b 39.2-39.8 (39.62) vs 39.3-39.8 (39.63); timeline @ 32K: ids 1.38 vs 1.60 us,
// first block landed 4.42 vs 4.54; round I 40.4-41.2 (mean 40.81) vs 40.6-41.3 (41.03), b2b 39.04
// vs 38.98; 67 removed.
constexpr int kAutoVerifyOneWave = 70;
// No L2 prefetch ahead of the shared-memory ring (AttentionCudaConfig::l2_prefetch, which had no
// effect since session 13, was removed in session 16): it was never faster (session 11: 4-15 %
// slower per line, session 12: bulk prefetches of whole tiles 8-33 % slower) and was removed in
// session 13; session 16's prefetch of each decode / verify CTA's first 2 / 4 blocks into L2 as
// soon as the union read their pages was slower too (round B: the first blocks landed later, 10.8
// vs 6.7 us after entry at B64 x 4 with 4; verify B64 x 4 47.2-48.5 vs 46.6-47.6 us, decode
// B64 42.1-43.7 vs 41.1-42.0) and was removed.

struct Plan {
  bool wgmma = false;   // the Hopper prefill kernel (8-token tiles) instead of the decode one
  bool verify = false;  // the Hopper decode / verify kernel (4-token tiles, one warpgroup)
  bool ws = false;      // the warp-specialised prefill kernel (wgmma tiles; kernel 4 its fallback)
  int ctas = 0;         // its persistent CTAs
  int qt = 1;           // tokens per tile
  int splits = 1;       // CTAs per (tile, KV head)
  int verify_variant = 53;   // variant of the verify kernel (AttentionCudaConfig)
  bool pdl = false;          // programmatic launches of the decode / verify kernels, merge
  bool decode_early = true;  // decode_kernel 0 / 10 / 11: attention_decode_early_kernel
  int decode_first = 2;      // its early copies (decode_kernel 11: 1)
  int64_t tiles = 0;         // grid.x: an upper bound of sum_r ceil(n_r / qt)
};

int sm_count() {
  int dev = 0, n = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0) {
    (void)cudaGetLastError();
    n = 132;
  }
  return n;
}

// Reference CTA count of the workspace bound (the automatic plan never splits more than
// ceil(split_target() / ctas) ways).
int64_t split_target() { return 4 * int64_t{sm_count()}; }

// CTAs the automatic plan fills by splitting: one wave of two resident CTAs per SM. Measured on an
// H200 (sparse, 32K context): batch 64 decode 44 us unsplit vs 57 / 63 / 67 us with 2 / 3 / 4
// splits, verify (4 tokens) 109 vs 132 / 145 / 157 us, batch 256 fastest unsplit: a second wave
// of split CTAs costs more than the extra parallelism brings.
int64_t split_wave() { return 2 * int64_t{sm_count()}; }

Status make_plan(const AttentionParams& p, const AttentionCudaConfig& cfg, Plan* out) {
  const int64_t T = p.batch.num_tokens;
  const int64_t R = p.batch.num_requests;
  Plan pl;
  const int64_t avg = R > 0 ? (T + R - 1) / R : 1;  // query tokens per request
  switch (cfg.kernel) {
    case 0:
      // One token per tile or a V conversion choice only exist on the mma.sync kernel: asking for
      // them selects it.
      pl.wgmma = kAutoWgmma && avg >= kWgmmaMinAvgTokens &&
                 (cfg.tokens_per_tile == 0 || cfg.tokens_per_tile == ap::kQT) && cfg.v_convert == 0;
      pl.ws = pl.wgmma && kAutoWs;
      pl.verify = !pl.wgmma && kAutoVerifyWgmma && avg >= kVerifyMinAvgTokens &&
                  cfg.tokens_per_tile == 0 && cfg.v_convert == 0;
      break;
    case 1:
      pl.wgmma = false;
      break;
    case 4:
      pl.wgmma = true;
      break;
    case 5:
      pl.verify = true;
      break;
    case 15:
      pl.wgmma = true;
      pl.ws = true;
      break;  // kernel 4 where TMA cannot address the pool
    default:
      return unsupported("run_attention_cuda: kernel ", cfg.kernel,
                         " is not one of 0, 1, 4, 5, 15 (2, 3, 6 .. 14, 16 .. 18 were "
                         "removed)");
  }
  if (pl.ws) {
    if (cfg.persistent_ctas < 0)
      return unsupported("run_attention_cuda: persistent_ctas ", cfg.persistent_ctas,
                         " is negative");
    pl.ctas = cfg.persistent_ctas > 0 ? cfg.persistent_ctas : sm_count();
  }
  if (cfg.verify_variant != 0 && cfg.verify_variant != 8 && cfg.verify_variant != 27 &&
      cfg.verify_variant != 69 && cfg.verify_variant != 70)
    return unsupported(
        "run_attention_cuda: verify_variant ", cfg.verify_variant,
        " is not 0, 8, 27, 69 or 70 (9, 11, 12, 14 and 15 were removed in session 15; 13, 16 and "
        "18-20 in session 16; 17, 22-26 in session 17; 28-33, 35 and 36 in session 18; 34, 37-41 "
        "and 43-46 in session 19; 21 (53 without the bulk-copied rows), 42 (52 without them), 50, "
        "51 and 54-57 in session 20; 52 and 53 (the defaults before session 21), 58-68 in session "
        "21)");
  if (pl.verify) {
    pl.verify_variant = cfg.verify_variant != 0 ? cfg.verify_variant : kAutoVerifyVariant;
    if (cfg.tokens_per_tile != 0 && cfg.tokens_per_tile != av::kQT)
      return unsupported("run_attention_cuda: the wgmma verify kernel has ", av::kQT,
                         " tokens per tile, got ", cfg.tokens_per_tile);
    if (cfg.v_convert != 0)
      return unsupported("run_attention_cuda: v_convert ", cfg.v_convert,
                         " does not apply to the wgmma verify kernel (V is converted in place)");
    pl.qt = av::kQT;
  } else if (pl.wgmma) {
    if (cfg.tokens_per_tile != 0 && cfg.tokens_per_tile != ap::kQT)
      return unsupported("run_attention_cuda: the wgmma kernel has ", ap::kQT,
                         " tokens per tile, got ", cfg.tokens_per_tile);
    if (cfg.v_convert != 0)
      return unsupported("run_attention_cuda: v_convert ", cfg.v_convert,
                         " does not apply to the wgmma kernel (its V is always an f16 tile)");
    pl.qt = ap::kQT;
  } else {
    // The mma.sync decode kernel: one token per tile (its 2- and 4-token tiles went with the
    // 4-warp tile kernel in session 14); V converted in registers (v_convert 1; the shared f16 V
    // tile, 2, was removed in session 13).
    if (cfg.tokens_per_tile != 0 && cfg.tokens_per_tile != 1)
      return unsupported(
          "run_attention_cuda: the mma.sync decode kernel has 1 token per tile, got ",
          cfg.tokens_per_tile, " (2 and 4 were removed in session 14)");
    if (cfg.v_convert != 0 && cfg.v_convert != 1)
      return unsupported("run_attention_cuda: v_convert ", cfg.v_convert,
                         " is not 0 or 1 (the f16 V tile, 2, was removed)");
    pl.qt = 1;
  }
  if (cfg.decode_kernel != 0 && cfg.decode_kernel != 2 && cfg.decode_kernel != 10 &&
      cfg.decode_kernel != 11)
    return unsupported(
        "run_attention_cuda: decode_kernel ", cfg.decode_kernel,
        " is not 0, 2, 10 or 11 (1, the 4-warp tile kernel, and 3, two barriers per block, "
        "were removed in session 14; 4, TMA loads, in session 15; 5-7 in session "
        "16; 8, 9 in session 17)");
  pl.decode_early = cfg.decode_kernel != 2;
  pl.decode_first = cfg.decode_kernel == 11 ? 1 : 2;
  // decode_kernel 0: 11 (one early copy) for one-wave grids (the likely CTA count T x n_kv fits 2
  // CTAs per SM), 10 otherwise. Session 18 round F (three alternating runs, sparse draft 0,
  // isolated us): B64 at 8K / 32K / 128K 40.4-41.0 vs 40.5-41.3 for 10, B256 @ 32K 141.9-142.3 vs
  // 141.2-141.9 (as in the verify kernel's one-wave rule: fewer early blocks per CTA let the first
  // one land sooner in the grid's initial burst).
  if (cfg.decode_kernel == 0 && T * p.n_kv <= split_wave()) pl.decode_first = 1;
  pl.pdl = cfg.programmatic_launch && !pl.wgmma;
  // sum_r ceil(n_r / qt) <= (T + R (qt - 1)) / qt, and never more than T tiles.
  pl.tiles = (T == 0 || R == 0) ? 0 : std::min<int64_t>(T, (T + R * (pl.qt - 1)) / pl.qt);
  if (cfg.splits != 0) {
    if (cfg.splits < 1 || cfg.splits > ak::kMaxSplits)
      return unsupported("run_attention_cuda: splits ", cfg.splits, " is outside [1, ",
                         ak::kMaxSplits, "]");
    pl.splits = cfg.splits;
  } else {
    // Split only as far as one wave of resident CTAs holds (floor(split_wave() / ctas) ways, at
    // least 1); never more splits than a tile has blocks (sparse: about 16 per tile; dense: up to
    // the page-table width).
    const int64_t ctas = std::max<int64_t>(1, pl.tiles * p.n_kv);
    const int64_t blocks = std::max<int64_t>(
        1, p.sparse ? std::min<int64_t>(kTopK, p.batch.max_pages) : p.batch.max_pages);
    const int64_t s = std::max<int64_t>(1, split_wave() / ctas);
    pl.splits = static_cast<int>(std::min<int64_t>({s, blocks, ak::kMaxSplits}));
  }
  if (pl.verify && cfg.verify_variant == 0 && pl.splits == 1 && R > 0) {
    // One wave (the likely CTA count, R requests of ceil(T / R) tokens each, fits 2 CTAs per SM):
    // 70, the loop on cp.async loads with one early copy, the guessed tile's page-table entries
    // (from a shared-memory copy of its row) and Q read early; more waves: 69 (kAutoVerifyVariant),
    // the TMA ring; both write their rows by bulk copies and copy K / V L2 evict-first.
    const int64_t per_request = (T + R - 1) / R;
    const int64_t likely_ctas = R * ((per_request + av::kQT - 1) / av::kQT) * p.n_kv;
    if (likely_ctas <= split_wave()) pl.verify_variant = kAutoVerifyOneWave;
  }
  *out = pl;
  return Status::Ok();
}

// Floats of the partial outputs and of the (m, l) pairs.
int64_t ws_o_floats(const AttentionParams& p, const Plan& pl) {
  return p.batch.num_tokens * p.n_kv * pl.splits * ak::kRows * ak::kDim;
}
int64_t ws_ml_floats(const AttentionParams& p, const Plan& pl) {
  return p.batch.num_tokens * p.n_kv * pl.splits * ak::kRows * 2;
}
size_t workspace_for(const AttentionParams& p, const Plan& pl) {
  if (pl.splits <= 1) return 0;
  return static_cast<size_t>(ws_o_floats(p, pl) + ws_ml_floats(p, pl)) * sizeof(float);
}

template <bool kVec16>
Status launch_prefill(const ak::AttnArgs& args, const Plan& pl, int n_kv, cudaStream_t stream) {
  auto kernel = ap::attention_prefill_kernel<kVec16>;
  M3_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, ap::kSmemBytes));
  const dim3 grid(static_cast<unsigned>(pl.tiles), static_cast<unsigned>(n_kv),
                  static_cast<unsigned>(pl.splits));
  kernel<<<grid, ap::kThreads, ap::kSmemBytes, stream>>>(args);
  M3_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

// Variants 27, 69, 70 (kTma: TMA loads, kEarly: the early copies, kTwoPass: the two-pass V NaN
// test, kLazy: the lazy running max, kBulkOut: the rows out by bulk copies, kPageEarly: the guessed
// tile's page-table reads before the scan, kEvictFirst: the K / V copies L2 evict-first) run as 8
// (cp.async, the NaN test in every block) where the pool is not 16-byte aligned or the driver
// refuses the tensor maps.
template <bool kVec16, bool kTma, bool kTwoPass = false, bool kLazy = false, bool kEarly = kTma,
          int kFirst = av::kStages - 1, bool kQEarly = false, bool kBulkOut = false,
          bool kPageEarly = false, bool kEvictFirst = false, int kRowPages = 0>
Status launch_verify(const ak::AttnArgs& args, const Plan& pl, int n_kv, cudaStream_t stream) {
  M3_CHECK_ARG(pl.tiles * n_kv <= std::numeric_limits<int32_t>::max(),
               "run_attention_cuda: ", pl.tiles, " tiles x ", n_kv,
               " KV heads exceed the grid's x limit");
  CUtensorMap kmap{}, vmap{}, qmap{};
  if constexpr (kTma || kEarly) {
    if (!attention_prefill_ws::encode_maps(args, &kmap, &vmap, &qmap))
      return launch_verify<kVec16, false>(args, pl, n_kv, stream);
  }
  auto kernel = av::attention_verify_kernel<kVec16, kTma, kTwoPass, kLazy, kEarly, kFirst, kQEarly,
                                            kBulkOut, kPageEarly, kEvictFirst, kRowPages>;
  M3_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, av::kSmemBytes));
  const dim3 grid(static_cast<unsigned>(pl.tiles * n_kv), 1u, static_cast<unsigned>(pl.splits));
  M3_CUDA_RETURN_IF_ERROR(launch_pdl(kernel, grid, dim3(av::kThreads), av::kSmemBytes, stream,
                                     pl.pdl, args, kmap, vmap));
  return Status::Ok();
}

template <bool kVec16>
Status launch_decode(const ak::AttnArgs& args, const Plan& pl, int n_kv, cudaStream_t stream) {
  auto kernel = ad::attention_decode_kernel<kVec16>;
  M3_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, ad::kSmemBytes));
  const dim3 grid(static_cast<unsigned>(pl.tiles), static_cast<unsigned>(n_kv),
                  static_cast<unsigned>(pl.splits));
  M3_CUDA_RETURN_IF_ERROR(
      launch_pdl(kernel, grid, dim3(ad::kThreads), ad::kSmemBytes, stream, pl.pdl, args));
  return Status::Ok();
}

// decode_kernel 0 / 10 (automatic since session 17; 11 for one-wave grids, see make_plan): the
// decode kernel with the early TMA copies of its first two blocks, 11 of the first one only; the
// plain decode kernel (decode_kernel 2) where TMA cannot address the pool. Session 17 round B
// (sparse, isolated us): B64 41.1-42.1 vs 41.2-42.9 (8K / 32K / 128K), B256 @ 32K 142.6 / 142.7
// vs 144.3-145.1 without the early copies.
Status launch_decode_early(const ak::AttnArgs& args, const Plan& pl, int n_kv,
                           cudaStream_t stream) {
  CUtensorMap kmap{}, vmap{}, qmap{};
  if (!attention_prefill_ws::encode_maps(args, &kmap, &vmap, &qmap))
    return launch_decode<true>(args, pl, n_kv, stream);
  auto kernel = pl.decode_first == 1 ? ad::attention_decode_early_kernel<1>
                                     : ad::attention_decode_early_kernel<ad::kStages - 1>;
  constexpr int kBytes = ad::kSmemBytes + 1024;  // + slack to align the base to 1 KB
  M3_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes));
  const dim3 grid(static_cast<unsigned>(pl.tiles), static_cast<unsigned>(n_kv),
                  static_cast<unsigned>(pl.splits));
  M3_CUDA_RETURN_IF_ERROR(
      launch_pdl(kernel, grid, dim3(ad::kThreads), kBytes, stream, pl.pdl, args, kmap, vmap));
  return Status::Ok();
}

// The one dispatch point from run-time (kernel, variant, 16-byte cache alignment) to a template.
Status dispatch(const ak::AttnArgs& args, const Plan& pl, int n_kv, bool vec16,
                cudaStream_t stream) {
  if (pl.verify) {
    if (!vec16) return launch_verify<false, false>(args, pl, n_kv, stream);  // TMA needs 16 B
    switch (pl.verify_variant) {
      case 27:
        return launch_verify<true, false, true, true, true>(args, pl, n_kv, stream);
      case 70:  // one early copy, Q after the ids, the guessed tile's page reads from a
                // shared-memory copy of its row before the scan, bulk rows, K / V copies L2
                // evict-first
        return launch_verify<true, false, true, true, true, 1, true, true, true, true, 1024>(
            args, pl, n_kv, stream);
      case 69:  // the TMA ring with two early copies, bulk rows, K / V copies L2 evict-first
        return launch_verify<true, true, true, true, true, av::kStages - 1, false, true, false,
                             true>(args, pl, n_kv, stream);
      default:
        return launch_verify<true, false>(args, pl, n_kv, stream);
    }
  }
  if (pl.wgmma) {
    // The warp-specialised kernel needs TMA-addressable tensors (16-byte pool base and strides, a
    // tensor map the driver accepts); otherwise the cp.async wgmma kernel (kernel 4) runs.
    if (pl.ws && vec16) {
      bool launched = false;
      M3_RETURN_IF_ERROR(attention_prefill_ws::launch(args, pl.tiles, pl.ctas, stream, &launched));
      if (launched) return Status::Ok();
    }
    return vec16 ? launch_prefill<true>(args, pl, n_kv, stream)
                 : launch_prefill<false>(args, pl, n_kv, stream);
  }
  if (pl.decode_early && vec16) return launch_decode_early(args, pl, n_kv, stream);
  return vec16 ? launch_decode<true>(args, pl, n_kv, stream)
               : launch_decode<false>(args, pl, n_kv, stream);
}

}  // namespace

size_t attention_workspace_bound() {
  // Splits > 1 only when ctas = tiles * n_kv < split_wave() < target, with splits <=
  // floor(split_wave() / ctas) <= ceil(target / ctas); and
  // T <= qt * tiles <= 8 * tiles (tiles = min(T, floor((T + R (qt - 1)) / qt)) >= T / qt, qt <= 8
  // with the wgmma kernel). So T * n_kv * splits <= 8 ctas (target / ctas + 1) < 16 target.
  return static_cast<size_t>(16 * split_target() * ak::kRows * (ak::kDim + 2)) * sizeof(float);
}

size_t attention_workspace_bytes(const AttentionParams& p, const AttentionCudaConfig& cfg) {
  Plan pl;
  if (!make_plan(p, cfg, &pl).ok()) return 0;
  return workspace_for(p, pl);
}

Status run_attention_cuda(const AttentionParams& p, void* workspace, size_t workspace_bytes,
                          cudaStream_t stream, const AttentionCudaConfig& cfg) {
  M3_RETURN_IF_ERROR(validate_attention(p));
  // validate_attention puts every view on one device; it must be the current CUDA device.
  const Device dev = p.q.device;
  M3_CHECK_ARG(dev.type == DeviceType::kCUDA, "run_attention_cuda needs CUDA tensors, got ",
               dev.to_string());
  int current = -1;
  M3_CUDA_RETURN_IF_ERROR(cudaGetDevice(&current));
  M3_CHECK_ARG(dev.index == current, "run_attention_cuda: tensors are on ", dev.to_string(),
               " but the current CUDA device is cuda:", current);

  const int group = p.n_q / p.n_kv;
  if (group > ak::kRows)
    return unsupported("run_attention_cuda: group size n_q / n_kv = ", group,
                       " exceeds the kernel's ", ak::kRows, " MMA rows");
  M3_CHECK_ARG(p.batch.num_requests < std::numeric_limits<int32_t>::max(),
               "run_attention_cuda: request count ", p.batch.num_requests, " is too large");
  M3_CHECK_ARG(p.kv_cache.shape[0] <= std::numeric_limits<int32_t>::max(),
               "run_attention_cuda: pool of ", p.kv_cache.shape[0],
               " pages exceeds the int32 page ids");
  M3_CHECK_ARG(p.n_kv <= 65535, "run_attention_cuda: n_kv ", p.n_kv,
               " exceeds the grid's y limit 65535");

  Plan pl;
  M3_RETURN_IF_ERROR(make_plan(p, cfg, &pl));
  const size_t need = workspace_for(p, pl);
  if (need > 0) {
    M3_CHECK_ARG(workspace != nullptr && workspace_bytes >= need, "run_attention_cuda: ", pl.splits,
                 " splits need ", need, " workspace bytes, got ",
                 workspace == nullptr ? 0 : workspace_bytes);
    M3_CHECK_ARG(reinterpret_cast<uintptr_t>(workspace) % 16 == 0,
                 "run_attention_cuda: workspace is not 16-byte aligned");
  }
  if (pl.tiles == 0) {  // no tokens, or no request owns any: only out_q's padding rows
    return attention_quantizes_out(p) ? run_quantize_cuda(attention_out_quantize_params(p), stream,
                                                          cfg.programmatic_launch)
                                      : Status::Ok();
  }

  ak::AttnArgs a{};
  a.q = static_cast<const uint8_t*>(p.q.data);
  a.q_stride_t = p.q.stride[0];
  a.kv = static_cast<const uint8_t*>(p.kv_cache.data);
  a.page_stride = p.kv_cache.stride[0];
  a.plane_stride = p.kv_cache.stride[1];
  a.num_pages = static_cast<int>(p.kv_cache.shape[0]);
  a.block_ids = p.sparse ? static_cast<const int32_t*>(p.block_ids.data) : nullptr;
  a.bid_stride_t = p.sparse ? p.block_ids.stride[0] : 0;
  a.bid_stride_h = p.sparse ? p.block_ids.stride[1] : 0;
  a.query_start = static_cast<const int32_t*>(p.batch.query_start.data);
  a.positions = static_cast<const int32_t*>(p.batch.positions.data);
  a.page_table = static_cast<const int32_t*>(p.batch.page_table.data);
  a.pt_stride = p.batch.page_table.stride[0];
  a.T = static_cast<int>(p.batch.num_tokens);
  a.R = p.batch.num_requests;
  a.max_pages = p.batch.max_pages;
  a.n_kv = p.n_kv;
  a.group = group;
  a.splits = pl.splits;
  a.pdl = pl.pdl ? 1 : 0;
  a.sparse = p.sparse ? 1 : 0;
  a.timeline = cfg.timeline;
  const float scale = p.softmax_scale > 0.0f ? p.softmax_scale : 0.08838834764831845f;
  a.scale_log2 = scale * 1.4426950408889634f;
  a.out = static_cast<uint16_t*>(p.out.data);
  a.out_stride = p.out.stride[0];
  if (need > 0) {
    a.ws_o = static_cast<float*>(workspace);
    a.ws_ml = a.ws_o + ws_o_floats(p, pl);
  }

  // o_proj's E4M3 input: written by the epilogues of the decode and verify kernels and the merge;
  // after the prefill kernels, by the quantize stage on `out`.
  const bool quantize = attention_quantizes_out(p);
  const bool fused_quantize = quantize && !pl.wgmma;
  if (fused_quantize) {
    M3_CHECK_ARG(p.out_scales.shape[0] <= std::numeric_limits<int32_t>::max(),
                 "run_attention_cuda: out_scales has too many rows");
    a.out_q = static_cast<uint8_t*>(p.out_q.data);
    a.out_scales = static_cast<float*>(p.out_scales.data);
    a.sc_stride_t = p.out_scales.stride[0];
    a.sc_stride_h = p.out_scales.stride[1];
    a.q_rows = static_cast<int>(p.out_q.shape[0]);
  }

  const bool vec16 = reinterpret_cast<uintptr_t>(p.kv_cache.data) % 16 == 0 &&
                     p.kv_cache.stride[0] % 16 == 0 && p.kv_cache.stride[1] % 16 == 0;
  M3_RETURN_IF_ERROR(dispatch(a, pl, p.n_kv, vec16, stream));
  if (pl.splits > 1) {
    const dim3 grid(static_cast<unsigned>(p.batch.num_tokens), static_cast<unsigned>(p.n_kv),
                    static_cast<unsigned>(group));
    M3_CUDA_RETURN_IF_ERROR(launch_pdl(ak::attention_merge_kernel, grid, dim3(ak::kMergeThreads), 0,
                                       stream, pl.pdl, a));
  }
  if (quantize && !fused_quantize)
    return run_quantize_cuda(attention_out_quantize_params(p), stream, pl.pdl);
  return Status::Ok();
}

}  // namespace m3attn
