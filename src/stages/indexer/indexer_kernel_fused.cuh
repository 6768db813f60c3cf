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
// b2b): the first warp of rank 0 to finish its blocks ranking a scratch row (an out-of-line
// rank-and-emit, so the real rows then ran the same, cached instructions) before the cluster
// barrier: 22.0 / 21.9 / 21.9 vs 21.8 / 21.9 / 21.8 (round A); back-to-back timeline: ranked 0.75
// us (p50) after the barrier vs 0.66 without, so instruction fetch is not what paces the count
// between calls (one warp per scheduler, ~1100 cycles for ~290 instructions).
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

// IndexerCudaOptions::single_pass_early_rank: the clustered single pass's final selection
// (rows <= kMmaWarps, the table in rank 0) started before the cluster's last blocks are scored.
// Rank 0 filled its table with kUnwritten before the start barrier and every block max is written
// once (st_relaxed_cluster). Rank 0's warps take the rows in the order they finish their own
// blocks (at most kEarlyRowsPerWarp each, so the CTA's last warp usually takes none), and for each
// row early_row_begin takes a snapshot: the entries already written are final, and lean_beats on
// the snapshot (the unwritten ones as NaN, which beat nothing) ranks them among themselves. Then
// early_row_finish polls the unwritten ("late") entries until they are in (with a pause between
// polls, so that the poll does not take the shared-memory pipe from the warps still streaming;
// bounded: after kEarlyRankSpin cycles it waits for the end of the cluster instead, after which
// every entry is final), adds the late entries' beats of the early candidates (one compare per
// lane and late entry) and counts the late candidates' beats by ballots (the same rule: on score
// alone inside a half, by id order across the halves), four late entries at a time, adds the ties
// inside the halves (lean_add_ties) and writes the row.
constexpr uint32_t kUnwritten = 0xffbadbadu;  // a NaN no flush writes (max.NaN gives 0x7fffffff)
constexpr long long kEarlyRankSpin = 20000;   // cycles (~11 us): a fallback, never the rule
constexpr long long kEarlyRankTrap = 2000000;  // cycles (~1 ms): single_pass_early_rank 2's
                                               // count never complete (a bug): trap, no hang
constexpr int kEarlyRowsPerWarp = 2;
struct EarlyRow {
  const float* row = nullptr;  // null: nothing left to do (trivial row, already written)
  int32_t* out = nullptr;
  int local = 0;
  float f0 = 0.0f, f1 = 0.0f;  // the lane's candidates lane / lane + 32 (NaN: none)
  float c0 = 0.0f, c1 = 0.0f;  // their beats among the snapshot's entries
  uint32_t m0 = 0, m1 = 0;     // late entries (unwritten at the snapshot) of each half
};

// Row j's snapshot and early pass (see above); scratch: 64 floats of shared memory the warp owns
// (its idle tile ring).
__device__ __forceinline__ EarlyRow early_row_begin(const KernelArgs& a, const float* sblk, int t0,
                                                    int b1, int lane_pos, int j, float* scratch) {
  const int lane = threadIdx.x & 31;
  EarlyRow e;
  const int pos = __shfl_sync(0xffffffffu, lane_pos, j / a.n_kv);  // j / n_kv < 32
  e.out = a.block_ids + (int64_t{t0} * a.n_kv + j) * kTopK;
  e.local = trivial_row(a, e.out, pos, true);
  if (e.local < 0) return e;
  const int nb = min(b1, e.local);  // candidates 0 .. nb - 1 (b0 == 0)
  e.row = sblk + j * kFusedMaxChunk;
  const bool in0 = lane < nb, in1 = lane + 32 < nb;
  e.f0 = in0 ? ld_relaxed_cluster(e.row + lane) : quiet_nan();
  e.f1 = in1 ? ld_relaxed_cluster(e.row + lane + 32) : quiet_nan();
  const bool late0 = in0 && __float_as_uint(e.f0) == kUnwritten;
  const bool late1 = in1 && __float_as_uint(e.f1) == kUnwritten;
  e.m0 = __ballot_sync(0xffffffffu, late0);
  e.m1 = __ballot_sync(0xffffffffu, late1);
  __syncwarp();  // every lane's earlier reads of the scratch (and tile copies into it) are done
  scratch[lane] = late0 ? quiet_nan() : e.f0;
  scratch[lane + 32] = late1 ? quiet_nan() : e.f1;
  __syncwarp();
  lean_beats<0, kCountRow>(scratch, scratch[lane], scratch[lane + 32], e.c0, e.c1);
  return e;
}

// The rest of a row begun by early_row_begin: the late entries polled and added, the row written.
// wait(): the end of the cluster (every entry final), called at most once per warp (*waited).
template <typename Wait>
__device__ __forceinline__ void early_row_finish(const KernelArgs& a, EarlyRow& e, Wait&& wait,
                                                 bool* waited) {
  const int lane = threadIdx.x & 31;
  if (e.row == nullptr) return;  // warp-uniform
  const bool late0 = (e.m0 >> lane) & 1u, late1 = (e.m1 >> lane) & 1u;
  const long long start = clock64();
  for (uint32_t p = e.m0 | e.m1; p != 0;) {  // warp-uniform
    if (!*waited && clock64() - start > kEarlyRankSpin) {
      wait();
      *waited = true;
    }
    if (late0 && __float_as_uint(e.f0) == kUnwritten) e.f0 = ld_relaxed_cluster(e.row + lane);
    if (late1 && __float_as_uint(e.f1) == kUnwritten) e.f1 = ld_relaxed_cluster(e.row + lane + 32);
    if (*waited) break;  // every entry is final after the end of the cluster
    p = __ballot_sync(0xffffffffu, (late0 && __float_as_uint(e.f0) == kUnwritten) ||
                                       (late1 && __float_as_uint(e.f1) == kUnwritten));
    if (p != 0) __nanosleep(64);
  }
  timeline_mark(a, 3);
  timeline_stamp(a, 16, __float_as_uint(e.f0) ^ __float_as_uint(e.f1));
  // Late entries, four at a time: their beats of every candidate, and (ballots) every
  // candidate's beats of them.
  int r0 = 0, r1 = 0;
  for (uint64_t late = (uint64_t{e.m1} << 32) | e.m0; late != 0;) {  // warp-uniform
    int id[4];
    float v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      id[u] = late != 0 ? __ffsll(static_cast<long long>(late)) - 1 : -1;
      late &= late - 1;
    }
#pragma unroll
    for (int u = 0; u < 4; ++u)
      v[u] = __shfl_sync(0xffffffffu, id[u] < 32 ? e.f0 : e.f1, id[u] & 31);
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      if (id[u] < 0) continue;  // warp-uniform
      const bool first_half = id[u] < 32;
      e.c0 += set_gt(v[u], e.f0);
      e.c1 += first_half ? set_ge(v[u], e.f1) : set_gt(v[u], e.f1);
      const int n = __popc(__ballot_sync(0xffffffffu, first_half ? e.f0 > v[u] : e.f0 >= v[u])) +
                    __popc(__ballot_sync(0xffffffffu, e.f1 > v[u]));
      if (lane == (id[u] & 31)) (first_half ? r0 : r1) = n;
    }
  }
  if (!late0) r0 = static_cast<int>(e.c0);
  if (!late1) r1 = static_cast<int>(e.c1);
  lean_add_ties(e.f0, e.f1, r0, r1);
  timeline_stamp(a, 17, static_cast<uint32_t>(r0 + r1));
  emit_ranked_row(e.out, e.f0, e.f1, r0, r1, e.local);
}

// Rank 0's warp in early-rank mode, once its own blocks are done: up to kEarlyRowsPerWarp rows
// claimed in finish order from *claims (rank 0's shared counter, 0 at the start), begun at once,
// then finished; wait() (the end of the cluster) last, once.
template <typename Wait>
__device__ __forceinline__ void select_rows_early(const KernelArgs& a, const float* sblk, int t0,
                                                  int rows, int b1, int lane_pos, int* claims,
                                                  float* scratch, Wait&& wait) {
  const int lane = threadIdx.x & 31;
  EarlyRow e[kEarlyRowsPerWarp];
  int taken = 0;
#pragma unroll
  for (int k = 0; k < kEarlyRowsPerWarp; ++k) {
    if (taken < k) break;  // warp-uniform: no row left
    int j = 0;
    if (lane == 0) j = atomicAdd(claims, 1);
    j = __shfl_sync(0xffffffffu, j, 0);
    if (j >= rows) break;
    e[k] = early_row_begin(a, sblk, t0, b1, lane_pos, j, scratch);
    taken = k + 1;
  }
  bool waited = false;
#pragma unroll
  for (int k = 0; k < kEarlyRowsPerWarp; ++k)
    if (k < taken) early_row_finish(a, e[k], wait, &waited);
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
