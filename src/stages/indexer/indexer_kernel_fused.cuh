// The single pass's selection inside the scorer (see indexer_kernel_mma.cuh): after a decode
// unit's CTA (or cluster) scored every block, the block maxima of its rows sit in a shared table
// [kDecRows][kFusedMaxChunk]; fused_local_select turns each row's candidates into the row's final
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
static_assert(kFusedMaxChunk == kCountRow, "rank_by_counting ranks a table row");

// Ranks among a warp's 64 candidates, for N rows at once (row i: lane l holds scores s0[i] of id0
// and s1[i] of id1; NaN = none) by 15 rounds of a warp-wide maximum of the lanes' larger remaining
// key (candidate_key: score, then smaller id; distinct), as warp_top15 does: r0 / r1 = the round
// that took the candidate, or 15 when it is not among the 15 best. ~12 instructions per round and
// row instead of ~10 per candidate of a counting loop (64 candidates: ~180 instead of ~700 per
// row). A round is two dependent redux.sync, so one row is a latency chain of 30; the N rows'
// chains are independent and interleave (session 12 round B ncu, 256 x 8K draft 3: the
// selection of 4 rows per warp, one after the other, held ~14 % of the single pass's warp stall
// samples at the end of every CTA).
template <int N>
__device__ __forceinline__ void rank_by_rounds(const float (&s0)[N], const float (&s1)[N], int id0,
                                               int id1, int (&r0)[N], int (&r1)[N]) {
  uint64_t head[N], tail[N];
  bool head_is_1[N];
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const uint64_t k0 = candidate_key(s0[i], id0), k1 = candidate_key(s1[i], id1);
    head_is_1[i] = k1 > k0;
    head[i] = head_is_1[i] ? k1 : k0;
    tail[i] = head_is_1[i] ? k0 : k1;
    r0[i] = r1[i] = kTopK - 1;
  }
  for (int r = 0; r < kTopK - 1; ++r) {
    uint32_t any = 0;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const uint32_t hh = static_cast<uint32_t>(head[i] >> 32), hl = static_cast<uint32_t>(head[i]);
      const uint32_t best_hi = __reduce_max_sync(0xffffffffu, hh);
      const uint32_t best_lo = __reduce_max_sync(0xffffffffu, hh == best_hi ? hl : 0u);
      any |= best_hi;
      // One lane (keys are distinct) takes its head; best_hi == 0: no candidate left in row i.
      if (best_hi != 0 && hh == best_hi && hl == best_lo) {
        if (head_is_1[i])
          r1[i] = r;
        else
          r0[i] = r;
        head[i] = tail[i];
        tail[i] = 0;
        head_is_1[i] = !head_is_1[i];
      }
    }
    if (any == 0) break;  // no candidate left in any row (uniform)
  }
}

// Single pass, after every block is scored (b0 == 0, one split or the cluster's table): the rows'
// final selection. Row j of the unit (warp j % 4) has the candidates [0, min(b1, local)): its
// local block is forced (no candidate), blocks past it are invisible to the row. Each lane holds
// the scores of blocks lane and lane + 32; rank_by_rounds ranks them (ranks are distinct: keys
// are; NaN is never a candidate), kG rows of the warp at a time (one row of more than 16
// candidates: rank_by_counting). The ranks < 15 are the row's choice; the row of block_ids is
// written at once (trivial rows included): candidate ids are < local and ascend with the lane, so a
// selected id's slot is the count of selected ids before it (ballot prefix), the local block
// follows them, -1 fills the rest. lane_pos: lane l < n holds the position of token t0 + l (no
// reload at the CTA's end).
template <int kG>
__device__ __forceinline__ void select_rows(const KernelArgs& a, float* sblk, int t0, int rows,
                                            int b0, int b1, int lane_pos) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  constexpr int kPer = kFusedMaxChunk / 32;
  static_assert(kPer == 2, "rank_by_rounds takes two candidates per lane");
  for (int j0 = warp; j0 < rows; j0 += kG * kMmaWarps) {  // warp-uniform conditions from here on
    float s[kPer][kG];
    int rank[kPer][kG];
    bool live[kG];
    int local[kG], nbs[kG];
#pragma unroll
    for (int g = 0; g < kG; ++g) {
      const int j = j0 + g * kMmaWarps;
      live[g] = false;
      local[g] = -1;
      if (j < rows) {
        const int pos = __shfl_sync(0xffffffffu, lane_pos, j / a.n_kv);  // j / n_kv < n <= 32
        local[g] = trivial_row(a, a.block_ids + (int64_t{t0} * a.n_kv + j) * kTopK, pos, true);
        live[g] = local[g] >= 0;
      }
      const int nb = live[g] ? min(b1, local[g]) - b0 : 0;  // <= kFusedMaxChunk
      nbs[g] = nb;
      const float* row = sblk + j * kFusedMaxChunk;
#pragma unroll
      for (int c = 0; c < kPer; ++c) {
        const int i = lane + 32 * c;
        s[c][g] = i < nb ? row[i] : quiet_nan();
      }
    }
    if constexpr (kG == 1) {
      // Counting only for rows of more than 16 candidates (warp-uniform; sblk may be null when no
      // row is live): its cost is fixed, while the rounds stop once the candidates run out
      // (session 14 round B / C, batch 1 at 32K, fused path, 4-block splits: 14.9 / 15.1 us with
      // counting vs 11.6 in round A with the rounds; 1 x 128K 20.5 vs 18.9).
      if (live[0] && nbs[0] > kTopK) {
        rank_by_counting(sblk + j0 * kFusedMaxChunk, nbs[0], s[0][0], s[1][0], rank[0][0],
                         rank[1][0]);
      } else {
        rank_by_rounds(s[0], s[1], b0 + lane, b0 + lane + 32, rank[0], rank[1]);
      }
    } else {
      rank_by_rounds(s[0], s[1], b0 + lane, b0 + lane + 32, rank[0], rank[1]);
    }
#pragma unroll
    for (int g = 0; g < kG; ++g) {
      if (!live[g]) continue;
      const int64_t row_index = int64_t{t0} * a.n_kv + j0 + g * kMmaWarps;
      emit_ranked_row(a.block_ids + row_index * kTopK, s[0][g], s[1][g], rank[0][g], rank[1][g],
                      local[g]);  // b0 == 0
    }
  }
}

// The single pass's final selection with rank_lean (IndexerCudaOptions::lean_select): rows
// first_row, first_row + row_step, ... < rows of the unit, one at a time per warp, from the
// table sblk (b0 == 0; columns [0, min(b1, local)) are the row's candidates, the rest of the row
// is set to NaN here: the warp owns the row). Up to 15 candidates are all chosen (ranks 0, no
// counting). lane_pos as in select_rows. wait(): called once by every lane, before the first
// read of the table (the barrier that completes it): the first row's position, trivial-row
// output and bounds are worked out before it, while the barrier completes. Timeline words 16 /
// 17: the warp's first row's scores loaded / ranked.
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
      if (a.lean == 2)
        rank_lean<true>(row, s0, s1, r0, r1);
      else
        rank_lean<false>(row, s0, s1, r0, r1);
    }
    if (j == first_row) timeline_stamp(a, 17, static_cast<uint32_t>(r0 + r1));
    emit_ranked_row(out, s0, s1, r0, r1, local);
  }
  if (!waited) wait();
}

// The final selection of every row of the unit (see select_rows): one row per warp at a time for
// <= 4 rows (draft 0 at n_kv 4), else 4 rows of a warp together; lean_select: select_rows_lean.
__device__ __forceinline__ void fused_local_select(const KernelArgs& a, float* sblk, int t0,
                                                   int rows, int b0, int b1, int lane_pos) {
  if (a.lean) {
    select_rows_lean(a, sblk, t0, rows, b0, b1, lane_pos, threadIdx.x >> 5, kMmaWarps, [] {});
    return;
  }
  if (rows <= kMmaWarps)
    select_rows<1>(a, sblk, t0, rows, b0, b1, lane_pos);
  else
    select_rows<4>(a, sblk, t0, rows, b0, b1, lane_pos);
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
