// The single pass's selection inside the scorer (see indexer_kernel_mma.cuh): after a decode
// unit's CTA (or cluster) scored every block, the block maxima of its rows sit in a shared table
// [kDecRows][kFusedMaxChunk]; select_rows_lean turns each row's candidates into the row's final
// block_ids; finish_overflow_rows completes a single-pass overflow tile's rows from its block
// scores.
#pragma once

#include "stages/indexer/indexer_kernel_common.cuh"
#include "stages/indexer/indexer_kernel_select.cuh"

namespace m3attn::indexer_kernel {

constexpr int kMmaWarps = 4;  // warps of a tensor-core scorer CTA
constexpr int kMmaThreads = kMmaWarps * 32;
// Fused decode: blocks per split at most (the host sizes dec_chunk accordingly): the shared
// block-max table holds [kDecRows][kFusedMaxChunk] f32 (8 KB).
constexpr int kFusedMaxChunk = 64;
static_assert(kFusedMaxChunk % 32 == 0 && kFusedMaxChunk % kMmaWarps == 0, "chunk shape");
static_assert(kFusedMaxChunk == kCountRow, "rank_lean ranks a table row");

// The single pass's final selection (session 21: rank_lean; until then rank_by_rounds, 15 rounds
// of two dependent redux.sync per row, 4 rows of a warp interleaved, and rank_by_counting for
// rows of more than 16 candidates): rows first_row, first_row + row_step, ... < rows of the
// unit, one at a time per warp, from the table sblk (b0 == 0; columns [0, min(b1, local)) are the
// row's candidates, the rest of the row is set to NaN here: the warp owns the row). Up to 15
// candidates are all chosen (ranks 0, no counting). Row j's token is t0 + j / n_kv; lane_pos: lane
// l < rows / n_kv holds the position of token t0 + l (no reload at the CTA's end). wait(): called
// once by every lane, before the first read of the table (the barrier that completes it): the
// first row's position, trivial-row output and bounds are worked out before it, while the
// barrier completes (session 21 round F timeline, 64 x 8K draft 0: the first row's scores in
// registers 0.05 us after the barrier instead of 0.29). The row of block_ids is written at once
// by emit_ranked_row. Timeline words 16 / 17: the warp's first row's scores loaded / ranked.
// Session 21, 64 x 8K draft 0 back to back (2-CTA clusters), same-round A/Bs against the former
// selection: 20.7 / 20.8 / 20.7 us vs 20.9 / 21.2 / 20.9 (round F), 20.8 / 21.0 / 20.7 vs
// 21.0 / 21.3 / 21.0 (round E); 256 x 8K: draft 3 (4-CTA clusters, rows shared) 74.7 / 73.6 vs
// 74.3 / 74.1, draft 0 64.9 vs 65.4 (round F). Lost: rank_lean's count as two rolled,
// software-pipelined loops (~80 instructions of code instead of ~280, against the instruction
// fetch stalls of the cold count: round E ncu, 86 of its ~92 stall samples "no instruction"):
// 20.8 / 21.1 / 20.9 (round F; ranked 0.82 us after the barrier vs 0.65); a dry run of the
// selection on scratch between the barrier's arrive and wait, so that its code is cached
// (22.0-22.1 vs 21.8-21.9, round C); an mbarrier per table instead of the final cluster barrier
// (22.0-22.1; 256 x 8K draft 3 82.3 vs 74.5, round C). Session 24 (64 x 8K draft 0, same-round
// b2b, us): the first warp of rank 0 to finish its blocks ranking a scratch row (an out-of-line
// rank-and-emit, so the real rows then ran the same, cached instructions) before the cluster
// barrier: 22.0 / 21.9 / 21.9 vs 21.8 / 21.9 / 21.8 (round A); back-to-back timeline: ranked 0.75
// us (p50) after the barrier vs 0.66 without, so instruction fetch is not what paces the count
// between calls (one warp per scheduler, ~1100 cycles for ~290 instructions). An early ranking
// (rank 0's table filled with an "unwritten" NaN before a release arrive at the start, block
// maxima stored with st.relaxed.cluster; rank 0's warps ranked a snapshot of their row once their
// own blocks were done, polled the entries written later and added them by one compare per lane
// and ballots; after the row, the cluster barrier (1) or a count of writer lanes in rank 0 by
// release adds, the other CTAs exiting at once (2)): round E 21.8 / 21.7 / 21.8 (1) and 21.8 /
// 21.8 / 21.8 (2) vs 21.7 / 21.6 / 21.6 (the row's own warp, often the cluster's last, ran the
// 0.6 us early pass after its blocks; the late entries one at a time took 0.44 us); reworked
// (rows claimed in finish order, late entries four at a time, a pause between polls) round F
// 21.8-22.0 / 21.8-22.0 vs 20.7-20.9. Timelines: the release arrive and the table fill delayed the
// first copies by 0.44 us, and the end after the last block scored took 1.9-2.2 us vs 1.4. The
// count with the row's 64 scores loaded into registers first and eight accumulators per
// candidate: 21.5 / 21.5 / 21.5 vs 21.5 / 21.4 / 21.4 (round I).
template <typename Wait>
__device__ __forceinline__ void select_rows_lean(const KernelArgs& a, float* sblk, int t0,
                                                 int rows, int b0, int b1, int lane_pos,
                                                 int first_row, int row_step, Wait&& wait) {
  const int lane = threadIdx.x & 31;
  bool waited = false;
  for (int j = first_row; j < rows; j += row_step) {  // warp-uniform
    const int pos = __shfl_sync(0xffffffffu, lane_pos, j / a.n_kv);  // j / n_kv < 32
    int32_t* out = a.block_ids + (int64_t{t0} * a.n_kv + j) * kTopK;
    const int local = trivial_row(a, out, pos, true);
    if (local < 0) continue;
    const int nb = min(b1, local) - b0;  // <= kFusedMaxChunk
    float* row = sblk + j * kFusedMaxChunk;
    if (!waited) {
      wait();
      waited = true;
    }
    const float s0 = lane < nb ? row[lane] : quiet_nan();
    const float s1 = lane + 32 < nb ? row[lane + 32] : quiet_nan();
    if (j == first_row) timeline_stamp(a, 16, __float_as_uint(s0) ^ __float_as_uint(s1));
    int r0 = 0, r1 = 0;
    if (nb > kTopK - 1) {
      if (lane >= nb) row[lane] = quiet_nan();
      if (lane + 32 >= nb) row[lane + 32] = quiet_nan();
      __syncwarp();
      rank_lean(row, s0, s1, r0, r1);
    }
    if (j == first_row) timeline_stamp(a, 17, static_cast<uint32_t>(r0 + r1));
    emit_ranked_row(out, s0, s1, r0, r1, local);
  }
  if (!waited) wait();
}

// The final selection of every row of a one-CTA unit (after its CTA barrier): warp w the rows w,
// w + 4, ...
__device__ __forceinline__ void fused_local_select(const KernelArgs& a, float* sblk, int t0,
                                                   int rows, int b0, int b1, int lane_pos) {
  select_rows_lean(a, sblk, t0, rows, b0, b1, lane_pos, threadIdx.x >> 5, kMmaWarps, [] {});
}

// True when token t belongs to a decode unit: the first dec_tokens tokens of its request. The
// caller loaded query_start[guess] and [guess + 1] for guess = t * R / T (right at once for
// equal-length requests: no further round trip); otherwise a binary search finds the last r with
// query_start[r] <= t.
__device__ __forceinline__ bool is_decode_token(const KernelArgs& a, int t, int gqa, int gqe) {
  if (t >= gqa && t < gqe) return t - gqa < a.dec_tokens;
  int lo = 0, hi = a.num_requests - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (load_query_start(a, mid) <= t)
      lo = mid;
    else
      hi = mid - 1;
  }
  const int qa = load_query_start(a, lo);
  const int qe = load_query_start(a, lo + 1);
  return t >= qa && t < qe && t - qa < a.dec_tokens;
}

// Single pass (score_fused_single_kernel, after a CTA barrier): one warp selects row `row`
// (position pos) from the block scores its own CTA wrote this run (overflow rows), the rule of
// select_kernel. Loads go out 4 per lane at a time (one L2 round trip per 128 blocks).
__device__ __forceinline__ void finish_row(const KernelArgs& a, int64_t row, int pos) {
  const int lane = threadIdx.x & 31;
  int32_t* out = a.block_ids + row * kTopK;
  const int local = trivial_row(a, out, pos, true);
  if (local < 0) return;
  uint64_t top[kTopK - 1];
#pragma unroll
  for (int i = 0; i < kTopK - 1; ++i) top[i] = 0;
  const float* scores = a.scores + row * a.max_pages;
  for (int b = lane; b < local; b += 4 * 32) {
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = b + 32 * i < local ? __ldcg(scores + b + 32 * i) : 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (b + 32 * i < local) insert_key(top, candidate_key(v[i], b + 32 * i));
  }
  emit_row(out, local, warp_top15(top));
}

// Single pass, overflow tile (after a CTA barrier, or a cluster barrier when its grid.y splits are
// one cluster): the rows of its flat token range that no decode unit owns (prefill tokens, and
// tokens of no request: stale scores, ids in range), from the block scores this CTA (or its
// cluster) wrote: every visible block. One warp per row; rows shared out over the grid.y CTAs.
__device__ __forceinline__ void finish_overflow_rows(const KernelArgs& a) {
  const int ta = static_cast<int>(blockIdx.x) * a.pre_tokens;
  const int te = min(ta + a.pre_tokens, a.num_tokens);
  const int rows = max(te - ta, 0) * a.n_kv;
  for (int j = static_cast<int>(blockIdx.y) * kMmaWarps + (threadIdx.x >> 5); j < rows;
       j += static_cast<int>(gridDim.y) * kMmaWarps) {
    const int t = ta + j / a.n_kv;
    const int guess = static_cast<int>(int64_t{t} * a.num_requests / a.num_tokens);
    const int pos = __ldg(a.positions + t);
    if (!is_decode_token(a, t, load_query_start(a, guess), load_query_start(a, guess + 1)))
      finish_row(a, int64_t{ta} * a.n_kv + j, pos);
  }
}

}  // namespace m3attn::indexer_kernel
