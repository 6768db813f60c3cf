// The fused decode path's selection inside the scorer (see indexer_kernel_mma.cuh): after a
// decode unit's CTA scored its split, the block maxima of its rows sit in a shared table
// [kDecRows][kFusedMaxChunk]; fused_local_select turns each row's candidates into the split's 15
// best (candidate lists for merge_kernel) or, in the single pass, into the row's final block_ids;
// finish_overflow_rows completes a single-pass overflow tile's rows from its block scores.
#pragma once

#include "stages/indexer/indexer_kernel_common.cuh"
#include "stages/indexer/indexer_kernel_merge.cuh"
#include "stages/indexer/indexer_kernel_select.cuh"

namespace m3attn::indexer_kernel {

constexpr int kMmaWarps = 4;  // warps of a tensor-core scorer CTA
constexpr int kMmaThreads = kMmaWarps * 32;
// Fused decode: blocks per split at most (the host sizes dec_chunk accordingly): the shared
// block-max table holds [kDecRows][kFusedMaxChunk] f32 (8 KB).
constexpr int kFusedMaxChunk = 64;
static_assert(kFusedMaxChunk % 32 == 0 && kFusedMaxChunk % kMmaWarps == 0, "chunk shape");

// Ranks among a warp's 64 candidates (lane l holds scores s0 of id0 and s1 of id1; NaN = none) by
// 15 rounds of a warp-wide maximum of the lanes' larger remaining key (candidate_key: score, then
// smaller id; distinct), as warp_top15 does: r0 / r1 = the round that took the candidate, or 15
// when it is not among the 15 best. ~12 instructions per round instead of ~10 per candidate of
// the counting loop (64 candidates: ~180 instead of ~700 per row).
__device__ __forceinline__ void rank_by_rounds(float s0, float s1, int id0, int id1, int& r0,
                                               int& r1) {
  const uint64_t k0 = candidate_key(s0, id0), k1 = candidate_key(s1, id1);
  bool head_is_1 = k1 > k0;
  uint64_t head = head_is_1 ? k1 : k0, tail = head_is_1 ? k0 : k1;
  r0 = r1 = kTopK - 1;
  for (int r = 0; r < kTopK - 1; ++r) {
    const uint32_t hh = static_cast<uint32_t>(head >> 32), hl = static_cast<uint32_t>(head);
    const uint32_t best_hi = __reduce_max_sync(0xffffffffu, hh);
    if (best_hi == 0) break;  // no candidate left (uniform)
    const uint32_t best_lo = __reduce_max_sync(0xffffffffu, hh == best_hi ? hl : 0u);
    if (hh == best_hi && hl == best_lo) {  // one lane (keys are distinct): its head is taken
      if (head_is_1)
        r1 = r;
      else
        r0 = r;
      head = tail;
      tail = 0;
      head_is_1 = !head_is_1;
    }
  }
}

// Fused decode, after the split's blocks are scored: the local selection of split y. Row j of the
// unit (warp j % 4) has the candidates [b0, min(b1, local)): its local block is forced by the
// merge (no candidate), blocks past it are invisible to the row. Each lane holds the scores of
// blocks b0 + lane and b0 + lane + 32 and counts the better candidates (score greater, or equal
// with a smaller id; NaN never counts and is never a candidate) against every block of the range,
// read back from shared memory as broadcasts: that count is the rank, so no sorting is needed
// (ranks are distinct: keys are); above 32 candidates rank_by_rounds gives the same ranks below 15
// in fewer instructions. Ranks < 15 are stored as keys at their rank, the rest of the 16 slots are
// zero. Rows whose merge reads no list of this split (a local block < 16, outside the page table,
// <= b0, or a negative position) write nothing. Cost: nb <= 32 broadcast loads and ~4
// instructions per candidate per load, per row, or 15 rounds of 2 redux.sync.
// kDirect (single pass, b0 == 0, one split): the ranks < 15 are the row's final choice; the row of
// block_ids is written at once (trivial rows included): candidate ids are < local and ascend with
// the lane, so a selected id's slot is the count of selected ids before it (ballot prefix), the
// local block follows them, -1 fills the rest.
// lane_pos: lane l < n holds the position of token t0 + l (no reload at the CTA's end).
template <bool kDirect>
__device__ __forceinline__ void fused_local_select(const KernelArgs& a, const float* sblk, int t0,
                                                   int rows, int b0, int b1, int lane_pos) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  constexpr int kPer = kFusedMaxChunk / 32;
  static_assert(kPer == 2, "rank_by_rounds takes two candidates per lane");
  for (int j = warp; j < rows; j += kMmaWarps) {  // warp-uniform conditions from here on
    const int pos = __shfl_sync(0xffffffffu, lane_pos, j / a.n_kv);  // j / n_kv < n <= 32
    const int64_t row_index = int64_t{t0} * a.n_kv + j;
    int local = -1;
    if constexpr (kDirect) {
      local = trivial_row(a, a.block_ids + row_index * kTopK, pos, true);
      if (local < 0) continue;
    } else {
      if (pos < 0) continue;
      local = pos / kPageSize;
      if (local < kTopK || local >= a.max_pages) continue;
    }
    const int nb = min(b1, local) - b0;  // <= kFusedMaxChunk
    if (!kDirect && nb <= 0) continue;
    const float* row = sblk + j * kFusedMaxChunk;
    float s[kPer];
    int rank[kPer];
#pragma unroll
    for (int c = 0; c < kPer; ++c) {
      const int i = lane + 32 * c;
      s[c] = i < nb ? row[i] : quiet_nan();
      rank[c] = 0;
    }
    if (nb > 32) {  // warp-uniform; both ways give the same ranks below 15
      rank_by_rounds(s[0], s[1], b0 + lane, b0 + lane + 32, rank[0], rank[1]);
    } else {
#pragma unroll 4
      for (int m = 0; m < nb; ++m) {
        const float v = row[m];
#pragma unroll
        for (int c = 0; c < kPer; ++c)
          rank[c] += (v > s[c] || (v == s[c] && m < lane + 32 * c)) ? 1 : 0;
      }
    }
    if constexpr (kDirect) {
      int32_t* out = a.block_ids + row_index * kTopK;
      const uint32_t below = (1u << lane) - 1u;
      int count = 0;
#pragma unroll
      for (int c = 0; c < kPer; ++c) {
        const bool take = s[c] == s[c] && rank[c] < kTopK - 1;
        const uint32_t taken = __ballot_sync(0xffffffffu, take);
        if (take) out[count + __popc(taken & below)] = b0 + lane + 32 * c;
        count += __popc(taken);
      }
      // count <= 15 (distinct ranks); the local block exceeds every candidate id.
      if (lane == count) out[lane] = local;
      if (lane > count && lane < kTopK) out[lane] = -1;
    } else {
      uint64_t* list = a.cand + (row_index * a.k_splits + blockIdx.y) * int64_t{kTopK};
      int count = 0;
#pragma unroll
      for (int c = 0; c < kPer; ++c) {
        const bool valid = s[c] == s[c];
        count += __popc(__ballot_sync(0xffffffffu, valid));
        if (valid && rank[c] < kTopK - 1) list[rank[c]] = candidate_key(s[c], b0 + lane + 32 * c);
      }
      count = min(count, kTopK - 1);
      if (lane >= count && lane < kTopK) list[lane] = 0;
    }
  }
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
