// The indexer (SPEC section 5): raw fp32 dot products of index-Q with every visible index-K, max
// per 128-token block, forced local block, top-16 block ids per (token, KV head): ascending ids
// then -1, exact ties to the smaller id, NaN scores never chosen (the forced local block still is).
#pragma once

#include <cstdint>

#include "cache/batch.h"
#include "m3attn/tensor.h"

#if defined(M3ATTN_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace m3attn {

struct IndexerParams {
  int n_kv = 0;            // index heads == KV heads
  int top_k = 16;          // must equal kTopK (the compiled value)
  TensorView index_q;      // e4m3 [T, n_kv, 128] contiguous
  TensorView index_cache;  // e4m3 [pages, 1, 128, 128] strided
  BatchView batch;
  TensorView block_ids;  // i32 [T, n_kv, top_k] contiguous (output)
};

// Every SPEC section 8 rule that applies (n_kv > 0, top_k == kTopK, dtypes, shapes, the index cache
// layout, the batch views, one device); reads no tensor data, touches nothing.
Status validate_indexer(const IndexerParams& p);
// The output contract shared with attention: i32 [T, n_kv, 16], contiguous, 16-byte aligned.
Status validate_block_ids(const TensorView& block_ids, int64_t num_tokens, int n_kv,
                          const char* what);

// CPU twin (the oracle); requires CPU views and also checks the batch contents (positions, page ids
// inside the pool). Exact semantics, which the CUDA indexer must match:
//   - s(t,h,p) = fp32 rounding of the EXACT dot product sum_d iq[t,h,d] * ik[p,d]. (E4M3 values are
//     multiples of 2^-9 below 2^9, so the 128 products and every partial sum are exact in double;
//     the twin accumulates in double and rounds once, so the score is independent of summation
//     order. A GPU accumulating in fp32 differs by rounding only: compare with
//     verify_block_selection and a tolerance, not bit for bit, when scores come close.)
//   - B(t,h,b) = max of s over p in block b with p <= pos_t, NaN-propagating: a block with any NaN
//     score has score NaN (E4M3 has no infinities, so NaN comes only from NaN inputs).
//   - n_valid = pos_t / 128 + 1, local = pos_t / 128. If n_valid <= 16 all blocks 0 .. n_valid-1
//     are selected whatever their scores (NaN included), so MSA == dense holds unconditionally and
//     scoring may be skipped. Otherwise: the local block, plus the 15 best non-NaN other blocks
//     ordered by (score descending, id ascending); fewer when fewer non-NaN blocks exist.
//   - Output row: selected ids ascending, then -1 up to 16.
Status run_indexer_cpu(const IndexerParams& p);

// Test and tooling helpers (host only, CPU views).
//
// Block scores of the twin: scores f32 [T, n_kv, max_blocks] contiguous, entry (t, h, b) = B(t,h,b)
// for b < n_valid(t) and -inf beyond. max_blocks must be >= every token's n_valid. Validates like
// run_indexer_cpu (block_ids is not written and may be any valid output view).
Status indexer_block_scores_cpu(const IndexerParams& p, const TensorView& scores);

// The selection rule alone: block scores b[0 .. n_valid) of one (token, head) -> 16 ids (ascending,
// -1 padded) into out. n_valid >= 1.
void select_blocks_ref(const float* block_scores, int n_valid, int32_t* out);

// Checks a selection `ids` (16 entries) made from scores that may differ from block_scores by up
// to `tolerance` (a GPU's fp32 accumulation order): the format (ascending, unique, in range, -1
// padding only at the end, local block present), the count (min(16, n_valid) when n_valid <= 16,
// else 1 + min(15, non-NaN other blocks)), no NaN block chosen when n_valid > 16, and for every
// chosen non-local block c and every unchosen non-NaN block u: B(c) >= B(u) - tolerance, with
// exact ties going to the smaller id when tolerance is 0. The message names the first violation.
Status verify_block_selection(const float* block_scores, int n_valid, const int32_t* ids,
                              float tolerance);

#if defined(M3ATTN_WITH_CUDA)
// ---- CUDA indexer (indexer.cu) ----
//
// Workspace: device memory the caller owns (no allocation inside the run). Its first
// T * n_kv * max_pages * 4 bytes hold the block scores, f32 [T, n_kv, max_pages]: after a run,
// entry (t, h, b) is the GPU's B(t, h, b) for every token with more than 16 visible blocks and
// every b < n_valid(t) (tests read them; other entries are unspecified), except the rows of
// decode units when the single pass runs (IndexerCudaPlan::single): their block scores stay on
// chip. Contents need no initialization and are not preserved between runs. (Until session 16 the
// fused path's candidate lists followed the scores.)
size_t indexer_workspace_bytes(int64_t num_tokens, int n_kv, int max_pages);

struct IndexerCudaOptions {
  // Use the exact CUDA-core scorer even where the tensor-core one applies. The CUDA-core scorer
  // (fp64 accumulation: scores bit-identical to the twin) also runs whenever the index cache base
  // or page stride is not 16-byte aligned.
  bool force_cuda_cores = false;
  // Key splits per work unit (grid.y); 0 picks a value from the SM count. Tests set it to put
  // split edges everywhere; any value >= 1 gives the same result.
  int k_splits = 0;
  // Decode units (the first 32 / n_kv tokens of each request) of the tensor-core scorer use the
  // fused path by default (see fused_decode_always): each CTA keeps its split's block maxima in
  // shared memory and writes them to the workspace in one burst at its end, then the selection
  // kernel finishes (ids identical to the two-kernel path). true: the two-kernel path (every
  // block's scores written to the workspace when the block is done, then the selection kernel).
  bool unfused_decode = false;
  // The fused path is the automatic choice when max_pages > 128 (contexts above 16K): at 8K the
  // H200 measured the two-kernel path as fast or faster (session 11 round 2, batch 256: 78.7 vs
  // 81.0 us at draft 0, 84.3 vs 96.2 us at draft 3; batch 64 with 16-block chunks 26.8 vs 28.4
  // us), at 32K and 128K the fused one faster (256 x 128K: 973 vs 1072 us). true: fused wherever
  // it applies, whatever max_pages (tests and benchmarks set it).
  bool fused_decode_always = false;
  // Single pass: where max_pages <= 64 (contexts up to 8K) and the tensor-core fused path can
  // run (!unfused_decode), the fused scorer with one split per unit (k_splits
  // is ignored) writes block_ids itself: a decode unit's CTA selects from all its block maxima at
  // once, an overflow tile from the block scores it wrote; no selection kernel follows (same
  // ids).
  // The automatic plan (k_splits 0, !fused_decode_always) picks it for batches of one query token
  // per request from 1/17 request per SM, and of 2-4 tokens per request at 0.7-1 requests per SM
  // (3-4 tokens: 0.7-0.95; see single_pass_ctas; above, the two-kernel path: in 12-block splits
  // above one request per SM, sessions 24-25); true forces it.
  // Device data that breaks the contract: with a query_start that is not monotone, rows of tokens
  // that no decode unit and no overflow tile claims are left unwritten (the two-kernel path
  // writes in-range but meaningless ids there).
  bool single_pass = false;
  // Single pass only (forced or automatic): CTAs per decode unit, run as one thread-block cluster
  // of (1, k, 1) CTAs (1..8; 0 = automatic: where the automatic plan picks the single pass, its
  // count (sms / R at one token per request, 2 at 2-4 tokens), else 1). With k > 1 the unit's
  // blocks are cut into k chunks of a multiple of 4 blocks (fewer CTAs when the chunks cover
  // max_pages sooner); each CTA scores its chunk and writes the block maxima into the first CTA's
  // shared table (distributed shared memory), which finishes the rows after a cluster barrier: the
  // single pass's one launch with up to k times the CTAs (more bytes in flight at small batches).
  // Same ids.
  int single_pass_ctas = 0;
  // L2 policy of the decode units' index-K tile copies: evict_first (1 or 0, the default:
  // automatic, on for every plan; -1: never) makes the read-once stream the L2's first victims, so
  // that what every call reads again (page tables, query rows, positions, the kernels' code) stays
  // in L2 across back-to-back calls. Session 23, same-round A/Bs back to back (us, three
  // alternating runs, with vs without): 64 x 8K draft 0 21.2 / 21.3 / 21.2 vs 21.7 / 21.8 / 21.7
  // (round D), 21.0 / 21.1 / 20.9 vs 21.2 / 21.3 / 21.0 (E), 20.6 / 20.8 / 20.6 vs 20.9 / 21.0 /
  // 20.7 (F), 21.2 / 21.3 / 21.2 vs 21.8 / 21.6 / 21.7 (H); round I: 256 x 8K draft 3 72.2 / 72.1 /
  // 72.4 vs 75.1 / 74.8 / 75.5, draft 0 64.9 / 64.8 / 64.6 vs 65.0 / 65.0 / 65.0; 64 x 32K draft 3
  // 73.4 / 73.3 / 73.4 vs 74.3 / 74.5 / 74.7; 64 x 8K draft 3 (flat) 22.7 / 22.8 / 22.8 vs 23.1 /
  // 23.1 / 23.1; batch 1 x 8K draft 0 / 3 5.2 / 6.1 vs 5.3 / 6.2 (all three runs). Same ids.
  int stream_evict_first = 0;
  // Programmatic dependent launch (src/core/pdl.cuh) of the indexer's first kernel (the scorer,
  // or the selection kernel when nothing is scored): it may start while the previous kernel in
  // the stream (the producer) still runs, and waits for it (pdl_wait) before it reads index_q or
  // this step's index-K rows and before any global write. Before the wait it reads the batch
  // metadata and, for decode units, the first index-K tiles of blocks that end before the
  // request's first new position (seq_lens[r] minus the request's tokens in this step). So the
  // kernels it may overlap must not write query_start, positions, seq_lens, the page table or
  // index-K rows other than this step's tokens' (true of the layer's decode chain: the metadata
  // is copied before the step's first kernel, the producer writes the step's rows only). Same
  // ids as a normal launch. The scorer then also requests enough (unused) shared memory that at
  // most ceil(CTAs / SMs) of its CTAs fit on one SM: a grid placed while the previous kernel still
  // occupies SMs would otherwise stack on the SMs it leaves free (session 14 round B). Every
  // indexer kernel triggers its dependents at its start (pdl_launch_dependents), whatever this
  // flag.
  bool programmatic_launch = false;
  // With programmatic_launch: before pdl_wait, each decode warp also asks the L2 for the next
  // pdl_prefetch_blocks of its blocks after the first (whole 16 KB pages, one
  // cp.async.bulk.prefetch.L2 each; blocks that end before the request's first new position
  // only, as the early tiles), so that the index-K stream runs while the previous kernel (the
  // producer: latency-bound, the DRAM idle) finishes; after the wait the copies of those blocks
  // find them in L2 or in flight. 0: automatic (as many blocks per warp as fill a quarter of the
  // L2 over all decode warps, at most 8); -1: none; N: up to N. Without programmatic_launch
  // nothing is prefetched. Same ids. Session 28 round B (indexer_bench --pdl: behind a stand-in
  // that lets it start, spins ~3 us and rewrites index_q; the indexer's share of the pair back to
  // back): 64 x 8K draft 0 18.6 us automatic (3 blocks per warp) and with 2 vs 19.2 with none,
  // 4 blocks 19.8, 8 blocks 22.7 (more than the L2 holds); draft 3 (flat decode) 23.0 automatic
  // or none; 256 x 8K draft 0 63.2-63.5 either way. layer_bench decode with the indexer launched
  // programmatically (not the layer's default): within 1 us of the default at 16-256 x 8K.
  int pdl_prefetch_blocks = 0;
  // Decode units of batches with one query token per request guess their request's token range as
  // [r T / R, (r + 1) T / R) (right for batches of equal-length requests) and load its positions
  // and query rows before query_start arrives, reloading when the guess was wrong (same ids
  // either way). Session 14 round B, same-run A/B: 64 x 8K draft 0 23.0 vs 23.65 us without;
  // 256 x 8K draft 3 (4 tokens per request) 79.0 vs 76.65 us without, hence one token only.
  // false: never (the A/B switch, bench --no-guess).
  bool guess_request_bounds = true;
  // Where no guess applies (several tokens per request), except in the single pass: load the
  // positions and query rows at the request's real bounds as soon as query_start arrives, before
  // the warp's first index-K copies, instead of after them (behind every CTA's first tiles: ready
  // to score 6.3 us after entry vs 2.0 us, 64 x 32K draft 3 timeline). Session 16 rounds A / B,
  // same-run A/Bs: 64 x 8K draft 3 25.2-25.5 vs 25.9-26.4 us, 256 x 32K draft 3 282.6-286.2 vs
  // 286.0-289.5; the single pass at 256 x 8K draft 3 lost (77.9-79.4 vs 75.1-76.4), hence not
  // there. Same ids. false: the former order (the A/B switch).
  bool early_query_loads = true;
  // The selection kernel ranks rows of more than 64 candidates by a threshold: the survivors of
  // the 15th largest of the lanes' largest keys, ranked by counting (the per-lane sorted lists
  // where more than 64 survive). Same ids. false: the per-lane sorted lists (the A/B switch).
  bool fast_select = true;
  // Rows of more than 64 candidates in calls of few rows (batch-1 decode at long contexts: 4 rows
  // of 1023 candidates at 128K, 16 at draft 3): select_wide_kernel ranks each row on one CTA of
  // wide_select warps (each warp a share of the row's candidates, a threshold from the 32 groups'
  // largest keys, the survivors ranked by one warp) instead of one warp per row. 0: automatic
  // (8 warps where the call has at most 32 rows, indexer.cu kWideSelectMaxRows); -1: never; 4, 8
  // or 16: that many warps per row wherever the selection kernel ranks rows of more than 64
  // candidates. Session 27 round E (back to back, three alternating runs, with the grid without
  // overflow tiles): 1 x 128K draft 0 10.0 / 9.9 / 9.9 us vs 14.0 with -1, draft 3 10.3-10.4 vs
  // 14.7-14.8; 1 x 32K draft 0 6.3-6.4 vs 7.7-7.8, draft 3 7.2 vs 8.6-8.7 (round D: 4 and 16 warps
  // slower than 8; select_wide_kernel). Same ids.
  int wide_select = 0;
  // Calls of at most 32 / n_kv query tokens (batch-1 decode and verify: 1-8 tokens at n_kv 4)
  // launch no overflow tiles: every token then belongs to a decode unit (a request's first 32 /
  // n_kv tokens), so an overflow tile could find no work (with or without device data that
  // breaks the contract). Round D timeline, 1 x 128K: the grid (2, 128) put its 128 empty
  // overflow CTAs on the even SMs and the 128 decode CTAs twice on 44 odd SMs (CTA i on SM i mod
  // 132), 48 SMs idle; the doubled SMs' CTAs ended ~1.5 us after the others. true: the former
  // grid (the A/B switch). Round E (back to back, three alternating runs, with the wide
  // selection): 1 x 128K draft 0 10.0 / 9.9 / 9.9 us vs 10.4 / 10.4 / 10.4 with the former grid,
  // draft 3 10.3-10.4 vs 11.0; 1 x 32K draft 0 6.3-6.4 vs 6.8 (there the 64 decode CTAs sat on the
  // odd SMs, one each, behind the 64 overflow CTAs), draft 3 7.2 vs 7.3; 1 x 8K (two-kernel plan)
  // draft 0 5.2 vs 5.2 (main's options), draft 3 5.9-6.0 vs 6.1-6.2. Same ids.
  bool overflow_tiles_always = false;
  // The automatic fused plan below one wave (fewer decode CTAs than SMs at its default chunks:
  // batch 1 above 16K, small batches at long contexts): chunks of a multiple of 4 blocks sized for
  // about fused_small_ctas_per_sm CTAs per SM (0: automatic, 2 for one request of at most 32 /
  // n_kv tokens, else 1, indexer.cu kFusedSmallCtasPerSm; 1: the former rule, one per SM; 1-3).
  // Session 27 round F: 1 x 128K draft 0 9.6 us back to back vs 9.9-10.0 with 1. Same ids.
  int fused_small_ctas_per_sm = 0;
  // Where the selection kernel runs, max_pages <= 64 (contexts up to 8K: every row has at most
  // 63 candidates) and the call has at most 32 rows (tokens x n_kv) per SM (decode and verify
  // batches, not prefill chunks: indexer.cu), each row is ranked by short_select_warps warps
  // (select_short_kernel: each counts the beats against its share of the row's candidates;
  // session 17 measured 4) instead of one. Session 17,
  // same-run A/Bs, 64 x 8K draft 3 (two-kernel path): round B 25.7 / 23.5 us (isolated / back to
  // back) vs 28.0 / 25.2, round C 25.6-25.7 / 23.5 vs 29.1-29.2 / 25.6-25.9. Same ids. false: one
  // warp per row (the A/B switch).
  bool short_select = true;
  // Warps per row of select_short_kernel: 2 (each counts 32 of the 64 candidates, 4 rows per
  // CTA of 8 warps) or 4 (16 each, 2 rows per CTA); 0: automatic, 2 where the call has at least
  // one row per SM, else 4. Session 21, same-round A/Bs (back to back): 64 x 8K draft 3 (flat
  // decode, 1024 rows), three alternating runs, 2 warps 23.5 / 23.4 / 23.4 us vs 4 warps
  // 23.8 / 23.6 / 23.6 (round G), 23.6 / 23.4 / 23.4 vs 23.8 / 23.7 / 23.7 (round H), 23.3 /
  // 23.1 / 23.1 vs 23.3 / 23.2 / 23.2 (round I); batch 1 (two-kernel plan, 4 / 16 rows): draft 0
  // 5.4 / 5.3 with 2 vs 5.2 / 5.2 with 4, draft 3 6.2 / 6.2 vs 6.0 / 6.0 (round H), 5.3 / 5.3 vs
  // 5.2 / 5.2 and 6.2 / 6.2 vs 6.1 / 6.1 (round I); between 16 and 1024 rows not measured.
  // Lost: 8 warps per row (24.1 / 23.9 / 24.1, round G), each warp's share counted by lean_beats
  // (23.7 / 23.5 / 23.5 with 2 warps, round H; 23.5 / 23.4 / 23.6 vs 23.4 / 23.2 / 23.3 with 4,
  // round E). Timeline with 4 (round G): the rows counted 0.96 us (p50) after their scores arrived.
  // (Session 21's counts; since session 24 strict counts, see select_short_body.) Same ids.
  int short_select_warps = 0;
  // Flat decode (1-3: CTAs per SM; 0: automatic; -1: never): the two-kernel tensor-core path
  // with the decode units' blocks dealt over flat_decode x SMs CTAs of 4 warps (one wave) instead
  // of k_splits splits per request: request r owns the warps [r W / R, (r + 1) W / R) of the W
  // decode warps, and each of its warps a contiguous range of its max_pages blocks, so every SM
  // gets the same number of blocks within a few; then the selection kernel. Applies where the
  // tensor-core scorer runs and W >= R (elsewhere the plan without it); overflow tiles (prefill
  // tokens) then run one split each. Automatic (k_splits 0, !unfused_decode): one CTA per SM
  // (two at more than 3 and up to 4 tokens per request; session 23: 64 x 8K draft 3 23.0-23.1 vs
  // 23.2-23.3 us back to back, with a 40-register selection kernel beside them) where the plan is
  // the two-kernel path at <= 64 blocks and 24-block splits would give one to about three CTAs
  // per SM (at 132 SMs and 8K: 44-66 requests of 2-8 tokens; indexer.cu, kFlatRuleChunk; session
  // 19: 64 x 8K draft 3 23.3-23.7 vs 23.9-24.2 us back to back for the former 6 splits of 12
  // blocks). Same ids.
  int flat_decode = 0;
  // The clustered single pass with at most 4 rows per request (one token at n_kv 4): the CTAs of
  // rank > 0 send their block maxima to rank 0's table by st.async, which completes them on an
  // mbarrier of rank 0 as they land, and exit; rank 0's warps wait on it instead of the final
  // cluster barrier (no release round trip after the last block). Session 25 round D, same-run
  // A/Bs at 8K draft 0 (us isolated / back to back, three or two alternating runs): 64 requests
  // (2-CTA clusters) 23.3 / 23.6 / 23.4, 21.2 / 21.2 / 21.2 vs 23.4 / 23.7 / 23.5, 21.3 / 21.2 /
  // 21.3 with the barrier; 32 (4-CTA) 16.4 / 16.2, 14.1 / 14.0 vs 16.5 / 16.4, 14.2 / 14.1; 44
  // (3-CTA) 19.6 / 19.6, 17.5 / 17.5 vs 19.9 / 19.7, 17.6 / 17.6; round E, 64 requests: 23.5 /
  // 23.8 / 23.6, 21.5 / 21.6 / 21.5 vs 23.7 / 23.9 / 23.8, 21.7 / 21.7 / 21.7. false: the cluster
  // barrier (the A/B switch). Same ids.
  bool cluster_async_maxima = true;
  // Diagnostics for benchmarks (null: off): device buffer of 24 uint64 per warp of the scorer's
  // grid (grid.x * grid.y * 4 warps) where the decode warps record clock64 at their phases (and a
  // few %globaltimer pairs), then 16 spare words, then 8 per warp of the selection kernel
  // (indexer_kernel_common.cuh, timeline_mark / select_timeline_mark; bench --timeline). Not
  // validated: the caller guarantees the size.
  uint64_t* timeline = nullptr;
};

// True when run_indexer_cuda with these params and options scores on tensor cores (E4M3
// converted exactly to f16, mma.sync f16 with fp32 accumulation: scores within a few fp32 ulps of
// sum_d |q_d k_d| of the twin, exact for integer-valued inputs); false for the exact CUDA-core
// scorer.
bool indexer_cuda_uses_tensor_cores(const IndexerParams& p, const IndexerCudaOptions& options);

// True when run_indexer_cuda with these params and options runs the fused decode path (tensor
// cores, !unfused_decode, max_pages > 128 or fused_decode_always (and > 16), at most 64 blocks per
// split): the decode units' block maxima are kept in shared memory to the CTA's end (written to
// the workspace scores then, or in the single pass not at all).
bool indexer_cuda_uses_fused_decode(const IndexerParams& p, const IndexerCudaOptions& options);

// The launch plan run_indexer_cuda picks on the current device (benchmarks print it).
struct IndexerCudaPlan {
  bool tensor_cores = false;
  bool fused = false;
  int k_splits = 0;     // grid.y of the scorer
  int dec_chunk = 0;    // blocks per split of a decode unit (tensor cores)
  bool single = false;  // fused, rows finished by the scorer (no selection kernel); k_splits > 1:
                        // one thread-block cluster of k_splits CTAs per unit
  int flat_ctas = 0;    // flat decode (IndexerCudaOptions::flat_decode): decode CTAs of the
                        // scorer (k_splits 1); 0: R units of k_splits splits
  int overflow_tiles = 0;  // grid.x of the scorer before the decode units (prefill tiles)
};
IndexerCudaPlan indexer_cuda_plan(const IndexerParams& p, const IndexerCudaOptions& options);

// The CUDA indexer: validate_indexer + CUDA-only rules (every view on the current CUDA device,
// n_kv <= 8, R > 0 when T > 0, workspace size / alignment / device, no overlap of the workspace
// with the other tensors, grid limits), then two kernels (block scores, then the selection) or
// the single pass alone on `stream`. No sync,
// no allocation, grid derived from T, R and max_pages only: CUDA-graph capturable. Device data
// that breaks the contract is guarded, never trusted: page ids outside the pool score NaN (never
// chosen unless forced), a negative position or a local block beyond the page table gives a row
// of -1. `workspace` is any contiguous CUDA view of >= indexer_workspace_bytes(T, n_kv,
// max_pages) bytes, 16-byte aligned.
Status run_indexer_cuda(const IndexerParams& p, const TensorView& workspace, cudaStream_t stream,
                        const IndexerCudaOptions& options = {});
#endif

}  // namespace m3attn
