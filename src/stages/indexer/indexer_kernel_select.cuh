// Top-16 block selection from the workspace block scores: one warp per (token, head) row (calls
// of at most 32 rows of more than 64 candidates: one CTA per row, select_wide_kernel below).
//
//   n_valid = pos / 128 + 1, local = pos / 128.
//   n_valid <= 16: ids 0 .. n_valid - 1, then -1 (no score is read).
//   otherwise: the local block plus up to 15 best non-NaN blocks among 0 .. local - 1 in the order
//   (score descending, id ascending; -0 == +0), ascending ids, then -1.
// A position < 0 or a local block >= max_pages (no page-table column) gives a row of -1.
//
// Each candidate becomes one 64-bit key (candidate_key in indexer_kernel_common.cuh), larger =
// better. Keys are distinct (one per id).
//
// Rows of <= 64 candidates (local <= 64: contexts up to 8K): the row is copied to shared memory
// and each lane ranks its two candidates by counting the candidates that beat them
// (rank_by_counting, ~600 independent instructions), then the selected ids are written in order
// by ballot prefix counts (emit_ranked_row). Where max_pages <= 64 (every row that short),
// select_short_kernel ranks with 2 (or 4) warps per row, each counting its share by strict counts
// with the tie rule at the selection's boundary (gt_counts, take_by_counts;
// IndexerCudaOptions::short_select, the default; short_select_warps). Longer rows:
// one pass over the row: lane l reads blocks l, l + 32, ... (4 loads in flight per lane) and keeps
// its own 15 largest keys sorted in registers (an unrolled insertion, static indices only). The
// row's 15 best keys are among the union of the lanes' lists, so 15 merge rounds pop the largest
// list head: redux.sync max over the high words, then over the low words of the lanes that tie on
// the high word (keys are distinct, so exactly one lane wins and pops its head).
// Cost model (the previous version rescanned the row from L1 in each of 15 rounds): the row is
// read once with all of a lane's loads issued in groups of 4 (local / 128 + 1 L2 round trips); an
// insertion is ~90 integer instructions and happens ~26 times for 32 keys per lane (random
// order); a merge round is 2 dependent redux.sync. At 128K context (1023 candidates) about
// 3-4 us per warp instead of ~7-20 us; at 8K about 1 us.
//
// The kernel is launched with programmatic stream serialization (PDL) after the scorer (when no
// scorer runs: a normal launch, or a programmatic one behind the previous stage with
// IndexerCudaOptions::programmatic_launch): it waits (pdl_wait) for the prerequisite grid to
// complete and flush before reading scores or writing ids, so it may become resident while the
// scorer's last CTAs still run; the position (batch metadata, which no kernel of the step writes)
// is loaded before the wait. The wait is a no-op when the kernel was launched without the
// attribute. It lets its own dependent (the attention) be scheduled at once
// (pdl_launch_dependents).
#pragma once

#include <climits>

#include "stages/indexer/indexer_kernel_common.cuh"

namespace m3attn::indexer_kernel {

constexpr int kSelectWarps = 8;
constexpr int kSelectThreads = kSelectWarps * 32;

// Rows of at most kCountRow candidates are ranked by counting (rank_by_counting) and written by
// emit_ranked_row; longer ones take the per-lane sorted lists and warp_top15.
constexpr int kCountRow = 64;

// The counts of rank_by_counting over the candidates kJ0 .. kJ0 + kN - 1 of the row only (row:
// 64 entries, NaN past the row's candidates; kJ0, kN multiples of 4): r0 / r1 = how many of them
// beat the lane's candidates lane / lane + 32.
template <int kJ0, int kN>
__device__ __forceinline__ void count_beats(const float* row, float s0, float s1, int& r0,
                                            int& r1) {
  static_assert(kJ0 % 4 == 0 && kN % 4 == 0 && kJ0 + kN <= kCountRow, "whole float4s");
  const int lane = threadIdx.x & 31;
  int c0[4] = {0, 0, 0, 0}, c1[4] = {0, 0, 0, 0};
#pragma unroll
  for (int q = kJ0 / 4; q < (kJ0 + kN) / 4; ++q) {
    const float4 v4 = *reinterpret_cast<const float4*>(row + 4 * q);
    const float vv[4] = {v4.x, v4.y, v4.z, v4.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int j = 4 * q + e;
      const float v = vv[e];
      if (j < 32) {  // index j beats lane on a tie iff j < lane; always beats lane + 32 on a tie
        c0[e] += (v > s0 || (v == s0 && j < lane)) ? 1 : 0;
        c1[e] += v >= s1 ? 1 : 0;
      } else {  // never beats lane on a tie; beats lane + 32 iff j - 32 < lane
        c0[e] += v > s0 ? 1 : 0;
        c1[e] += (v > s1 || (v == s1 && j - 32 < lane)) ? 1 : 0;
      }
    }
  }
  r0 = (c0[0] + c0[1]) + (c0[2] + c0[3]);
  r1 = (c1[0] + c1[1]) + (c1[2] + c1[3]);
}

// One row per warp: the ranks r0 / r1 of the lane's candidates lane and lane + 32 (scores s0 / s1,
// NaN = none) among the row's candidates row[0 .. nb) (shared memory: a block-max table row, or the
// select kernel's copy of a row's block scores):
// the number of candidates that beat each, i.e. have a larger score or an equal one and a smaller
// index (the order of candidate_key: -0 ties with +0, NaN never beats), so the ranks are distinct
// and equal those of the former single pass's rank_by_rounds wherever that one reported them
// (< 15). The entries [nb, 64) are set to
// NaN first (this warp owns the row), then every lane reads the whole row as broadcast 16-byte
// loads and counts into 8 independent accumulators (~8 instructions per candidate, no dependent
// chain) instead of 15 rounds of two dependent redux.sync. Session 14 timelines, 64 x 8K draft 0
// (one row per warp), cluster barrier to the written rows: 1.54 us with the rounds (round A), 1.02
// us with one accumulator per candidate (round B: a 64-long dependent add chain per lane). (Those
// phases held ~1 us of %globaltimer reads; session 17's clock64 timeline: the selecting warps take
// ~1.3 us from the cluster barrier to their row written, their stalls mostly instruction fetch.
// Session 18 round A: one out-of-line copy of this path, run once on scratch at the kernel's
// start to warm the instruction caches, lost: 64 x 8K draft 0 21.1-21.2 us back to back vs
// 20.8-20.9. ncu still put 68 % of the function's stall samples on instruction fetch. The dry run
// delayed its warps' start by ~1.1 us, and the final selection took 1.7 us (p50) vs 1.3.
// Session 20 round E: the same counts as two rolled loops of 8 float4 (~60 distinct instructions
// instead of ~600) in the single pass's final selection: 64 x 8K draft 0 21.4-21.5 vs 21.3-21.4
// us back to back: the unrolled code's instruction fetch is not what sets those ~1.3 us.)
__device__ __forceinline__ void rank_by_counting(float* row, int nb, float s0, float s1, int& r0,
                                                 int& r1) {
  const int lane = threadIdx.x & 31;
  if (lane >= nb) row[lane] = quiet_nan();
  if (lane + 32 >= nb) row[lane + 32] = quiet_nan();
  __syncwarp();
  count_beats<0, kCountRow>(row, s0, s1, r0, r1);
}

// 1.0f when a > b (ordered: false with a NaN), else 0.0f: one FSET.BF.
__device__ __forceinline__ float set_gt(float a, float b) {
  float m;
  asm("set.gt.f32.f32 %0, %1, %2;" : "=f"(m) : "f"(a), "f"(b));
  return m;
}
__device__ __forceinline__ float set_ge(float a, float b) {
  float m;
  asm("set.ge.f32.f32 %0, %1, %2;" : "=f"(m) : "f"(a), "f"(b));
  return m;
}

// The beats of rank_lean over the candidates kJ0 .. kJ0 + kN - 1 of the row only (kJ0, kN
// multiples of 4; row: 64 entries, NaN at non-candidates), without the ties inside a half: c0 /
// c1 = how many of them beat the lane's candidates lane / lane + 32 on score alone (>, and >= for
// ids below 32 against lane + 32).
template <int kJ0, int kN>
__device__ __forceinline__ void lean_beats(const float* row, float s0, float s1, float& c0,
                                           float& c1) {
  static_assert(kJ0 % 4 == 0 && kN % 4 == 0 && kJ0 + kN <= kCountRow, "whole float4s");
  float a0[4] = {0.0f, 0.0f, 0.0f, 0.0f}, a1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int q = kJ0 / 4; q < (kJ0 + kN) / 4; ++q) {
    const float4 v4 = *reinterpret_cast<const float4*>(row + 4 * q);
    const float v[4] = {v4.x, v4.y, v4.z, v4.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      // id 4 q + e: the first half (q < 8) is below lane + 32, the second above lane.
      a0[e] += set_gt(v[e], s0);
      a1[e] += q < 8 ? set_ge(v[e], s1) : set_gt(v[e], s1);
    }
  }
  c0 = (a0[0] + a0[1]) + (a0[2] + a0[3]);
  c1 = (a1[0] + a1[1]) + (a1[2] + a1[3]);
}

// Adds the ties inside the halves to ranks counted by lean_beats (r0 / r1 for the lane's
// candidates lane / lane + 32; NaN scores = none), every lane of the warp calling: a candidate
// beats an equal one of the same half with a larger id. Such ties are rare on real scores, and
// lean_beats' ranks of the non-NaN candidates are a permutation of 0 .. n - 1 exactly when there
// is none (a tie group of m candidates in a half has m ranks equal instead of m consecutive ones:
// a sum short by m (m - 1) / 2), so one sum (redux.sync) decides; only then the lanes below with
// the same score bits (-0 as +0) in the lane's half are counted (__match_any_sync).
__device__ __forceinline__ void lean_add_ties(float s0, float s1, int& r0, int& r1) {
  const bool c0 = s0 == s0, c1 = s1 == s1;
  const int n = __popc(__ballot_sync(0xffffffffu, c0)) + __popc(__ballot_sync(0xffffffffu, c1));
  const int sum = static_cast<int>(
      __reduce_add_sync(0xffffffffu, static_cast<uint32_t>((c0 ? r0 : 0) + (c1 ? r1 : 0))));
  if (sum == n * (n - 1) / 2) return;  // warp-uniform: no tie inside a half
  const uint32_t below = (1u << (threadIdx.x & 31)) - 1u;
  r0 += __popc(__match_any_sync(0xffffffffu, __float_as_uint(s0 == 0.0f ? 0.0f : s0)) & below);
  r1 += __popc(__match_any_sync(0xffffffffu, __float_as_uint(s1 == 0.0f ? 0.0f : s1)) & below);
}

// rank_by_counting's ranks with about half of its instructions (the single pass's final
// selection, select_rows_lean): row[0 .. 64) holds the row's candidates in shared memory with NaN
// at every non-candidate (the caller wrote them), s0 / s1 the lane's candidates lane / lane + 32
// (NaN = none). A candidate j beats lane's on a larger score, or an equal one (-0 == +0) with a
// smaller id. Across the halves the id order is fixed (every j < 32 is below lane + 32, every
// j >= 32 above lane), so there the tie rule is the comparison itself (>= or >: lean_beats); the
// ties inside a half are added by lean_add_ties. Per candidate and lane: a set.{gt,ge}.f32.f32
// (1.0 / 0.0) and an FADD into one of 8 independent accumulators (exact: sums <= 64); no
// per-lane tie predicate (rank_by_counting: ~540 instructions, this: ~290, sm_90a cubin sizes).
__device__ __forceinline__ void rank_lean(const float* row, float s0, float s1, int& r0, int& r1) {
  float c0 = 0.0f, c1 = 0.0f;
  lean_beats<0, kCountRow>(row, s0, s1, c0, c1);
  r0 = static_cast<int>(c0);
  r1 = static_cast<int>(c1);
  lean_add_ties(s0, s1, r0, r1);
}

// Writes a row of block_ids from ranked candidates: the lane's candidates have ids lane and
// lane + 32 (scores s0 / s1, NaN = none; ranks r0 / r1 from rank_by_counting or rank_lean,
// distinct) and are all below the local block; the ranks < 15 are selected. Candidate ids ascend
// with (half, lane), so a selected id's slot is the count of selected ids before it (ballot
// prefix); the local block follows them, -1 fills the rest.
__device__ __forceinline__ void emit_ranked_row(int32_t* out, float s0, float s1, int r0, int r1,
                                                int local) {
  const int lane = threadIdx.x & 31;
  const uint32_t below = (1u << lane) - 1u;
  int count = 0;
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    const float sc = c == 0 ? s0 : s1;
    const bool take = sc == sc && (c == 0 ? r0 : r1) < kTopK - 1;
    const uint32_t taken = __ballot_sync(0xffffffffu, take);
    if (take) out[count + __popc(taken & below)] = lane + 32 * c;
    count += __popc(taken);
  }
  // count <= 15 (distinct ranks); the local block exceeds every candidate id.
  if (lane == count) out[lane] = local;
  if (lane > count && lane < kTopK) out[lane] = -1;
}

// The strict counts of take_by_counts over the candidates kJ0 .. kJ0 + kN - 1 of the row only
// (row: 64 entries, NaN past the row's candidates; kJ0, kN multiples of 16): c0 / c1 = how many of
// them have a larger score than the lane's candidates lane / lane + 32 (set.gt: NaN never larger,
// -0 == +0). No tie rule, so one set.gt and one FADD per candidate and lane candidate (exact:
// sums <= 64), half of count_beats' instructions whatever the data's ties.
template <int kJ0, int kN>
__device__ __forceinline__ void gt_counts(const float* row, float s0, float s1, float& c0,
                                          float& c1) {
  static_assert(kJ0 % 16 == 0 && kN % 16 == 0 && kJ0 + kN <= kCountRow, "whole groups");
  float a0[4] = {0.0f, 0.0f, 0.0f, 0.0f}, a1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  // Groups of 16 candidates (4 float4) in a rolled loop: with the whole range unrolled ptxas
  // hoisted every load (64 registers for 64 candidates) and spilled in the 40-register forms.
#pragma unroll 1
  for (int g = kJ0; g < kJ0 + kN; g += 16) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float4 v4 = *reinterpret_cast<const float4*>(row + g + 4 * q);
      const float v[4] = {v4.x, v4.y, v4.z, v4.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        a0[e] += set_gt(v[e], s0);
        a1[e] += set_gt(v[e], s1);
      }
    }
  }
  c0 = (a0[0] + a0[1]) + (a0[2] + a0[3]);
  c1 = (a1[0] + a1[1]) + (a1[2] + a1[3]);
}

// The row's selected candidates from strict counts (gt_counts over every candidate; every lane
// of the warp calling): t0 / t1 = whether the lane's candidates lane / lane + 32 (scores s0 / s1,
// NaN = none; c0 / c1 candidates with a larger score) are among the 15 best in the order (score
// descending, id ascending). A candidate with c >= 15 is out; the candidates with c < 15 ("in")
// are exactly those scoring at least the boundary score t = the smallest "in" score. When at
// most 15 are in, they are the selection. Otherwise ties straddle the boundary: every in
// candidate above t is selected (c_gt(t) of them, < 15), and of the candidates scoring t the
// 15 - c_gt(t) with the smallest ids (id order = (half, lane): ballot prefix counts). The tie rule
// thus costs a few warp-wide steps per row instead of a per-candidate predicate (count_beats), and
// unlike lean_add_ties it does not depend on how many ties the row holds.
__device__ __forceinline__ void take_by_counts(float s0, float s1, int c0, int c1, bool& t0,
                                               bool& t1) {
  const uint32_t below = (1u << (threadIdx.x & 31)) - 1u;
  t0 = s0 == s0 && c0 < kTopK - 1;
  t1 = s1 == s1 && c1 < kTopK - 1;
  const int n = __popc(__ballot_sync(0xffffffffu, t0)) + __popc(__ballot_sync(0xffffffffu, t1));
  if (n <= kTopK - 1) return;  // warp-uniform
  // The boundary score as an order-preserving key (-0 as +0; NaN is never "in"), its minimum by
  // one redux.sync instead of a chain of five shuffles (this step is on the row's critical path).
  const auto key = [](float x) {
    const uint32_t u = __float_as_uint(x == 0.0f ? 0.0f : x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  };
  const uint32_t k0 = t0 ? key(s0) : 0xffffffffu, k1 = t1 ? key(s1) : 0xffffffffu;
  const uint32_t t = __reduce_min_sync(0xffffffffu, min(k0, k1));
  const uint32_t e0 = __ballot_sync(0xffffffffu, t0 && k0 == t);
  const uint32_t e1 = __ballot_sync(0xffffffffu, t1 && k1 == t);
  const int keep = kTopK - 1 - (n - __popc(e0) - __popc(e1));  // boundary candidates kept, >= 1
  if (t0 && k0 == t) t0 = __popc(e0 & below) < keep;
  if (t1 && k1 == t) t1 = __popc(e0) + __popc(e1 & below) < keep;
}

// emit_ranked_row with the selection given as flags (take_by_counts): the taken candidates' ids
// in ascending order (ballot prefix counts), then the local block, then -1.
__device__ __forceinline__ void emit_taken_row(int32_t* out, bool t0, bool t1, int local) {
  const int lane = threadIdx.x & 31;
  const uint32_t below = (1u << lane) - 1u;
  const uint32_t b0 = __ballot_sync(0xffffffffu, t0), b1 = __ballot_sync(0xffffffffu, t1);
  if (t0) out[__popc(b0 & below)] = lane;
  if (t1) out[__popc(b0) + __popc(b1 & below)] = lane + 32;
  const int count = __popc(b0) + __popc(b1);  // <= 15; the local block exceeds every candidate id
  if (lane == count) out[lane] = local;
  if (lane > count && lane < kTopK) out[lane] = -1;
}

// Inserts key into a lane's list top[0] >= top[1] >= ... (15 entries, 0 = empty) if it beats the
// smallest entry. Distinct keys: entry i becomes top[i - 1] (shifted down), key, or stays.
__device__ __forceinline__ void insert_key(uint64_t (&top)[kTopK - 1], uint64_t key) {
  if (key > top[kTopK - 2]) {
#pragma unroll
    for (int i = kTopK - 2; i > 0; --i)
      top[i] = key > top[i - 1] ? top[i - 1] : (key > top[i] ? key : top[i]);
    top[0] = key > top[0] ? key : top[0];
  }
}

// The warp's 15 best keys from the lanes' sorted lists (consumed): lane k < 15 gets the k-th best
// key, 0 where fewer than k + 1 non-zero keys exist; lanes >= 15 get 0.
__device__ __forceinline__ uint64_t warp_top15(uint64_t (&top)[kTopK - 1]) {
  const int lane = threadIdx.x & 31;
  uint64_t mine = 0;
  for (int k = 0; k < kTopK - 1; ++k) {
    const uint32_t hi = static_cast<uint32_t>(top[0] >> 32);
    const uint32_t lo = static_cast<uint32_t>(top[0]);
    const uint32_t best_hi = __reduce_max_sync(0xffffffffu, hi);
    if (best_hi == 0) break;  // no non-NaN key left (uniform)
    const uint32_t best_lo = __reduce_max_sync(0xffffffffu, hi == best_hi ? lo : 0u);
    if (hi == best_hi && lo == best_lo) {  // one lane (keys are distinct): pop its head
#pragma unroll
      for (int i = 0; i < kTopK - 2; ++i) top[i] = top[i + 1];
      top[kTopK - 2] = 0;
    }
    if (lane == k) mine = (static_cast<uint64_t>(best_hi) << 32) | best_lo;
  }
  return mine;
}

// Rows whose ids need no score: a negative position or a local block past the page table gives a
// row of -1, n_valid = local + 1 <= 16 the blocks 0 .. local. Returns the local block when scores
// decide (>= 16), else -1 after lanes < 16 wrote the row (when `write`).
__device__ __forceinline__ int trivial_row(const KernelArgs& a, int32_t* out, int pos, bool write) {
  const int lane = threadIdx.x & 31;
  if (pos < 0 || pos / kPageSize >= a.max_pages) {
    if (write && lane < kTopK) out[lane] = -1;
    return -1;
  }
  const int local = pos / kPageSize;
  if (local < kTopK) {
    if (write && lane < kTopK) out[lane] = lane <= local ? lane : -1;
    return -1;
  }
  return local;
}

// Writes a row from its local block and the 15 best other keys (lane k < 15 holds the k-th best
// in `best`, 0 = none): ascending distinct ids, then -1.
__device__ __forceinline__ void emit_row(int32_t* out, int local, uint64_t best) {
  const int lane = threadIdx.x & 31;
  // Lane 0 holds the local block, lane k (1..15) the k-th best other block (or -1).
  const uint64_t prev = __shfl_up_sync(0xffffffffu, best, 1);
  int my_id = lane == 0 ? local : (lane < kTopK && prev != 0 ? candidate_id(prev) : -1);
  // Ids are distinct for any data the scorer wrote this run; a repeat (only from stale lists under
  // corrupted query_start) is dropped so that every output slot is written.
  bool repeat = false;
#pragma unroll
  for (int j = 0; j < kTopK; ++j) {
    const int other = __shfl_sync(0xffffffffu, my_id, j);
    repeat = repeat || (j < lane && other == my_id);
  }
  if (repeat) my_id = -1;
  // Ascending ids (distinct), then -1.
  int rank = 0, picked = 0;
#pragma unroll
  for (int j = 0; j < kTopK; ++j) {
    const int other = __shfl_sync(0xffffffffu, my_id, j);
    if (other >= 0) {
      ++picked;
      rank += other < my_id ? 1 : 0;
    }
  }
  if (lane < kTopK) {
    if (my_id >= 0) out[rank] = my_id;
    if (lane >= picked) out[lane] = -1;
  }
}

// Rows of more than kCountRow candidates by a threshold (IndexerCudaOptions::fast_select): the
// row's 15 best keys are among the keys >= L, L = the 15th largest of the 32 lanes' largest keys
// (15 distinct lanes each hold a key >= L, so the row's 15th best is >= L). Pass 1 finds the
// lanes' largest keys (32 loads per lane in flight), L comes from counting the lanes that beat
// each lane's (32 shuffles) and two redux; pass 2 (the same registers up to 1024 candidates, else
// the row again in chunks) compacts the survivors into
// `buf` in id order (ballot prefix per slot), which are ranked by counting (no ties: keys are
// distinct) and the 15 best written in id order, then the local block, then -1. ~300-500
// instructions per row instead of ~1300 for the per-lane sorted lists and 15 redux rounds.
// Returns false, having written nothing, when more than 64 keys survive (the caller falls back).
__device__ __forceinline__ bool select_by_threshold(const float* scores, int local, int32_t* out,
                                                    uint64_t* buf) {
  const int lane = threadIdx.x & 31;
  // Chunks of 1024 candidates, 32 per lane, loaded at once (one L2 round trip up to 128K); a row
  // of one chunk stays in registers for pass 2.
  constexpr int kPer = 32;
  constexpr int kChunk = 32 * kPer;
  float v[kPer];
  const auto load_chunk = [&](int c0) {
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int b = c0 + lane + 32 * i;
      v[i] = b < local ? scores[b] : 0.0f;
    }
  };
  uint64_t m = 0;
  for (int c0 = 0; c0 < local; c0 += kChunk) {
    load_chunk(c0);
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int b = c0 + lane + 32 * i;
      const uint64_t k = b < local ? candidate_key(v[i], b) : 0;
      m = k > m ? k : m;
    }
  }
  int beats = 0;  // lanes whose largest key beats this lane's
#pragma unroll 8
  for (int i = 0; i < 32; ++i) {
    const uint64_t o = __shfl_sync(0xffffffffu, m, i);
    beats += o > m ? 1 : 0;
  }
  const bool top = beats < kTopK - 1;  // this lane's largest is among the 15 largest
  const uint32_t mh = static_cast<uint32_t>(m >> 32), ml = static_cast<uint32_t>(m);
  const uint32_t lh = __reduce_min_sync(0xffffffffu, top ? mh : 0xffffffffu);
  const uint32_t ll = __reduce_min_sync(0xffffffffu, top && mh == lh ? ml : 0xffffffffu);
  const uint64_t L = (static_cast<uint64_t>(lh) << 32) | ll;
  const uint32_t below = (1u << lane) - 1u;
  int n = 0;  // survivors so far (uniform)
  for (int c0 = 0; c0 < local; c0 += kChunk) {
    if (local > kChunk) load_chunk(c0);  // uniform; one chunk is still in v
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      if (c0 + 32 * i >= local) break;  // uniform
      const int b = c0 + lane + 32 * i;
      const uint64_t k = b < local ? candidate_key(v[i], b) : 0;
      const bool sv = k != 0 && k >= L;
      const uint32_t bal = __ballot_sync(0xffffffffu, sv);
      if (n + __popc(bal) > 64) return false;  // uniform; nothing written yet
      if (sv) buf[n + __popc(bal & below)] = k;
      n += __popc(bal);
    }
  }
  __syncwarp();
  const uint64_t k0 = lane < n ? buf[lane] : 0, k1 = lane + 32 < n ? buf[lane + 32] : 0;
  int r0 = 0, r1 = 0;
  for (int j = 0; j < n; ++j) {
    const uint64_t o = buf[j];
    r0 += o > k0 ? 1 : 0;
    r1 += o > k1 ? 1 : 0;
  }
  __syncwarp();  // buf is reused by the warp's next row
  // Survivors are in id order; the 15 best (rank < 15) keep it.
  int count = 0;
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    const uint64_t k = c == 0 ? k0 : k1;
    const bool take = k != 0 && (c == 0 ? r0 : r1) < kTopK - 1;
    const uint32_t taken = __ballot_sync(0xffffffffu, take);
    if (take) out[count + __popc(taken & below)] = candidate_id(k);
    count += __popc(taken);
  }
  if (lane == count) out[lane] = local;  // count <= 15; local exceeds every candidate id
  if (lane > count && lane < kTopK) out[lane] = -1;
  return true;
}

// The per-lane sorted lists of a row of `local` candidates (one warp): lane l inserts the keys of
// blocks l, l + 32, ... into its 15-entry list, warp_top15 merges, emit_row writes the row. Exact
// for any row; the fallback of the threshold selections.
__device__ __forceinline__ void select_row_sorted(const float* scores, int local, int32_t* out) {
  const int lane = threadIdx.x & 31;
  uint64_t top[kTopK - 1];
#pragma unroll
  for (int i = 0; i < kTopK - 1; ++i) top[i] = 0;
  int b = lane;
  for (; b + 96 < local; b += 128) {
    const float s0 = scores[b], s1 = scores[b + 32], s2 = scores[b + 64], s3 = scores[b + 96];
    insert_key(top, candidate_key(s0, b));
    insert_key(top, candidate_key(s1, b + 32));
    insert_key(top, candidate_key(s2, b + 64));
    insert_key(top, candidate_key(s3, b + 96));
  }
  for (; b < local; b += 32) insert_key(top, candidate_key(scores[b], b));
  emit_row(out, local, warp_top15(top));
}

// One row of the selection kernel (one warp), after the dependency wait: the row's ids from its
// workspace block scores. srow: the warp's 64-float shared row, buf: its 64 survivor keys.
__device__ __forceinline__ void select_row(const KernelArgs& a, int64_t row, int pos, float* srow,
                                           uint64_t* buf) {
  const int lane = threadIdx.x & 31;
  int32_t* out = a.block_ids + row * kTopK;
  const int local = trivial_row(a, out, pos, true);
  if (local < 0) return;
  // The scores are written by the scorer in this stream: plain loads (not the read-only path).
  const float* scores = a.scores + row * a.max_pages;
  if (local <= kCountRow) {
    // Candidates 0 .. local - 1 (contexts up to 8K): one copy of the row in shared memory, ranked
    // by counting (session 14: the insertion lists and 15 redux rounds below took ~3000+ cycles
    // per row).
    const float s0 = lane < local ? scores[lane] : quiet_nan();
    const float s1 = lane + 32 < local ? scores[lane + 32] : quiet_nan();
    srow[lane] = s0;
    srow[lane + 32] = s1;
    __syncwarp();
    int r0 = 0, r1 = 0;
    rank_by_counting(srow, local, s0, s1, r0, r1);
    emit_ranked_row(out, s0, s1, r0, r1, local);
    return;
  }
  if (a.fast_select && select_by_threshold(scores, local, out, buf)) return;
  select_row_sorted(scores, local, out);
}

__global__ void __launch_bounds__(kSelectThreads) select_kernel(const KernelArgs a) {
  __shared__ __align__(16) float row_copy[kSelectWarps][kCountRow];
  __shared__ uint64_t survivors[kSelectWarps][64];
  pdl_launch_dependents();
  select_timeline_mark(a, 0);
  const int64_t row = int64_t{blockIdx.x} * kSelectWarps + (threadIdx.x >> 5);
  const bool in_range = row < int64_t{a.num_tokens} * a.n_kv;
  // The position is an input written before the scorer was launched (a normal launch, after
  // every earlier operation of the stream completed, so it is visible already): loaded before the
  // dependency wait; the scores and block_ids only after it.
  const int pos = in_range ? __ldg(a.positions + row / a.n_kv) : -1;
  pdl_wait();
  select_timeline_mark(a, 1);
  if (!in_range) return;
  select_row(a, row, pos, row_copy[threadIdx.x >> 5], survivors[threadIdx.x >> 5]);
  select_timeline_mark(a, 2);
}

// Long rows in calls of few rows (IndexerCudaOptions::wide_select; batch-1 decode at long
// contexts: 4 rows of 1023 candidates at 128K, where select_kernel ranks each row on one warp):
// one CTA of kW warps per row. Thread (w, l) holds the blocks c kW 32 + 32 w + l (c = 0, 1, ...;
// kWidePer of them per pass, in registers), so group l (the blocks = l mod 32) is
// select_by_threshold's lane l. Every warp writes its lanes' largest keys to shared memory; after
// a CTA barrier every warp (redundantly, so that no second barrier follows) takes the groups'
// largest keys G_l (the maximum over the warps) and the threshold L = the 15th largest G: 15
// distinct groups hold a key >= L, so the row's 15 best keys are all >= L (exact under the strict
// order of candidate_key: score descending, then id ascending; NaN = key 0, never taken). The
// count of the G that beat a lane's runs over the warp's own shared copy of the 32 G (broadcast
// 16-byte loads), not shuffles (8 warps x 64 shuffles queue on the SM's shuffle unit). The keys
// >= L (the survivors) are appended to a shared list (one shared atomic per warp and pass); after
// a second CTA barrier warp 0 ranks them by counting (keys are distinct) over the zero-padded
// list in unrolled groups of 16, puts the 15 best ids in rank order and places each by counting
// the smaller ones (ascending ids), then the local block, then -1. More than kWideCap survivors
// (rows with fewer than 15 groups holding a non-NaN candidate, or data built against the groups):
// warp 0 selects the row by the per-lane sorted lists. Same ids as select_kernel.
// Session 27, same-round A/Bs (back to back, us, three alternating runs unless noted; "one warp"
// = select_kernel, wide_select -1): round D (this kernel's first form, see below; with the former
// grid) 1 x 128K draft 0 10.9 / 10.9 vs 14.9-15.0 for one warp per row (4 warps per row 11.6-11.7,
// 16 warps 11.2), draft 3 11.5 / 11.5 vs 15.4 (4: 12.4, 16: 11.9); 1 x 32K draft 0 7.0 / 7.0 vs
// 8.2, draft 3 7.6 / 7.6 vs 8.8 (two runs each). Round D timeline (1 x 128K draft 0): released
// 0.58 us after the scorer's last warp, scores in registers +0.54, ranked +1.79, row written
// +0.42. Round E (this form, without overflow tiles): 1 x 128K draft 0 10.0 / 9.9 / 9.9 vs 14.0
// for one warp and 10.3 / 10.3 / 10.3 for the first form; draft 3 10.3 / 10.4 / 10.3 vs 14.7-14.8
// and 11.2; 1 x 32K draft 0 6.3 / 6.4 / 6.4 vs 7.7-7.8 and 6.7; draft 3 7.2 vs 8.6-8.7. The first
// form, deleted: the counts by 32 shuffles in every warp, one shared atomic per warp and candidate
// slot holding survivors, a rolled ranking loop over the survivors, emit_row. Round F timeline
// (this form, 1 x 128K draft 0, 256 splits of 4 blocks, back to back, 9.6 us per call): released
// 0.44 us after the scorer's last warp, scores in registers +0.62, ranked +1.33, row written
// +0.28; the next call's scorer entered 3.58 us after this call's last scorer warp. Not tried: the
// path from the first barrier on is ~2400 cycles for a few hundred instructions per warp, and the
// CTAs sit ~6 us before the dependency wait, so a dry run of the body on stand-in data there (its
// code fetched before the release) may shorten it; sessions 18 / 23 lost that trick at 64 x 8K,
// where thousands of selection warps competed with the scorer.
constexpr int kWidePer = 4;   // a thread's candidates per pass (registers)
constexpr int kWideCap = 64;  // survivors ranked by counting (two per lane of warp 0)

template <int kW>
__global__ void __launch_bounds__(kW * 32) select_wide_kernel(const KernelArgs a) {
  constexpr int kStride = kW * 32;
  constexpr int kPass = kStride * kWidePer;
  static_assert(kStride >= kWideCap, "the padding is zeroed by one store per thread");
  __shared__ uint64_t gmax[kW][32];
  __shared__ __align__(16) uint64_t gcopy[kW][32];
  __shared__ __align__(16) uint64_t surv[kWideCap];
  __shared__ __align__(16) int sel[kTopK];
  __shared__ int count;
  pdl_launch_dependents();
  select_timeline_mark(a, 0);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t row = blockIdx.x;  // one CTA per row: grid.x == T * n_kv
  // As in select_kernel: the position before the dependency wait, scores and ids after it.
  const int pos = __ldg(a.positions + row / a.n_kv);
  // Ordered before their readers by the first CTA barrier (shared memory only: before the wait).
  if (threadIdx.x == 0) count = 0;
  if (threadIdx.x < kWideCap) surv[threadIdx.x] = 0;  // key 0 never beats a survivor
  if (threadIdx.x < kTopK) sel[threadIdx.x] = INT_MAX;
  pdl_wait();
  select_timeline_mark(a, 1);
  int32_t* out = a.block_ids + row * kTopK;
  const int local = trivial_row(a, out, pos, warp == 0);
  if (local < 0) return;  // CTA-uniform (one row)
  const float* scores = a.scores + row * a.max_pages;
  uint64_t k[kWidePer];
  const auto load = [&](int c0) {
    float v[kWidePer];
#pragma unroll
    for (int i = 0; i < kWidePer; ++i) {
      const int b = c0 + i * kStride + warp * 32 + lane;
      v[i] = b < local ? __ldcg(scores + b) : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < kWidePer; ++i) {
      const int b = c0 + i * kStride + warp * 32 + lane;
      k[i] = b < local ? candidate_key(v[i], b) : 0;
    }
  };
  uint64_t m = 0;
  for (int c0 = 0; c0 < local; c0 += kPass) {
    load(c0);
#pragma unroll
    for (int i = 0; i < kWidePer; ++i) m = k[i] > m ? k[i] : m;
  }
  gmax[warp][lane] = m;
  select_timeline_stamp(a, 0, static_cast<uint32_t>(m));
  __syncthreads();  // every warp's lane maxima are in gmax
  uint64_t g = gmax[0][lane];
#pragma unroll
  for (int w = 1; w < kW; ++w) {
    const uint64_t o = gmax[w][lane];
    g = o > g ? o : g;
  }
  // The groups whose largest key beats this lane's group's, from the warp's own copy.
  gcopy[warp][lane] = g;
  __syncwarp();
  const ulonglong2* gc = reinterpret_cast<const ulonglong2*>(gcopy[warp]);
  int b2[2] = {0, 0};
#pragma unroll
  for (int q = 0; q < 16; ++q) {
    const ulonglong2 o = gc[q];
    b2[0] += o.x > g ? 1 : 0;
    b2[1] += o.y > g ? 1 : 0;
  }
  const bool top = b2[0] + b2[1] < kTopK - 1;  // among the 15 largest group maxima
  const uint32_t gh = static_cast<uint32_t>(g >> 32), gl = static_cast<uint32_t>(g);
  const uint32_t lh = __reduce_min_sync(0xffffffffu, top ? gh : 0xffffffffu);
  const uint32_t ll = __reduce_min_sync(0xffffffffu, top && gh == lh ? gl : 0xffffffffu);
  const uint64_t L = (static_cast<uint64_t>(lh) << 32) | ll;
  const uint32_t below = (1u << lane) - 1u;
  for (int c0 = 0; c0 < local; c0 += kPass) {
    if (local > kPass) load(c0);  // CTA-uniform; a one-pass row is still in k
    // The pass's survivors of the warp at one shared atomic.
    uint32_t bal[kWidePer];
    int total = 0;
#pragma unroll
    for (int i = 0; i < kWidePer; ++i) {
      bal[i] = __ballot_sync(0xffffffffu, k[i] != 0 && k[i] >= L);
      total += __popc(bal[i]);
    }
    if (total == 0) continue;  // warp-uniform
    int at = 0;
    if (lane == 0) at = atomicAdd(&count, total);
    at = __shfl_sync(0xffffffffu, at, 0);
#pragma unroll
    for (int i = 0; i < kWidePer; ++i) {
      const int slot = at + __popc(bal[i] & below);
      if ((bal[i] >> lane) & 1u && slot < kWideCap) surv[slot] = k[i];
      at += __popc(bal[i]);
    }
  }
  __syncthreads();  // every survivor is in surv (count: how many there were)
  if (warp != 0) return;
  const int n = count;
  if (n > kWideCap) {  // warp-uniform
    select_row_sorted(scores, local, out);
    select_timeline_mark(a, 2);
    return;
  }
  const uint64_t k0 = surv[lane], k1 = surv[lane + 32];  // 0 past n
  // Survivors beating k0 / k1 (distinct keys: distinct ranks), in groups of 16 (8 broadcast
  // 16-byte loads each); the entries past n are 0 and beat nothing.
  int r0 = 0, r1 = 0;
  const ulonglong2* sv2 = reinterpret_cast<const ulonglong2*>(surv);
  for (int j0 = 0; j0 < n; j0 += 16) {  // warp-uniform
    int c[4] = {0, 0, 0, 0};
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      const ulonglong2 o = sv2[j0 / 2 + q];
      c[0] += o.x > k0 ? 1 : 0;
      c[1] += o.y > k0 ? 1 : 0;
      c[2] += o.x > k1 ? 1 : 0;
      c[3] += o.y > k1 ? 1 : 0;
    }
    r0 += c[0] + c[1];
    r1 += c[2] + c[3];
  }
  select_timeline_stamp(a, 1, static_cast<uint32_t>(r0 + r1));
  // The 15 best ids by rank into sel (INT_MAX past them), then each its slot among them in
  // ascending order by counting the smaller ones (distinct ids); the local block (larger than
  // every candidate id) after them, then -1.
  if (lane < n && r0 < kTopK - 1) sel[r0] = candidate_id(k0);
  if (lane + 32 < n && r1 < kTopK - 1) sel[r1] = candidate_id(k1);
  __syncwarp();
  const int cnt = min(n, kTopK - 1);
  const int my = sel[lane & (kTopK - 1)];
  int slot = 0;
  const int4* s4 = reinterpret_cast<const int4*>(sel);
#pragma unroll
  for (int q = 0; q < kTopK / 4; ++q) {
    const int4 o = s4[q];
    slot += (o.x < my ? 1 : 0) + (o.y < my ? 1 : 0) + (o.z < my ? 1 : 0) + (o.w < my ? 1 : 0);
  }
  if (lane < cnt) out[slot] = my;
  if (lane == cnt) out[cnt] = local;
  if (lane > cnt && lane < kTopK) out[lane] = -1;
  select_timeline_mark(a, 2);
}

// Selection of short rows (IndexerCudaOptions::short_select; max_pages <= kCountRow, so every
// row has at most 63 candidates): kW warps per row instead of one (short_select_warps: 2 where
// the call has a row per SM or more, else 4), kSelectWarps / kW rows per CTA. Each loads the row's
// scores (the first also copies them to shared memory), warp q counts the candidates of
// [q 64 / kW, (q + 1) 64 / kW) scoring above the lane's (gt_counts), and after a CTA barrier the
// first sums the partial counts, applies the tie rule at the boundary (take_by_counts) and writes
// the row (emit_taken_row; trivial rows by trivial_row). A share of
// rank_by_counting's dependent work per warp and more warps to hide it (session 17 round A ncu,
// 64 x 8K draft 3: select_kernel ~730 instructions per warp at ~16 cycles each; the selection
// kernel then ended ~3 us after the scorer). Same-run A/Bs at 64 x 8K draft 3, back to back, 4
// warps per row vs one: 23.5 vs 25.2-25.9 us (session 17 rounds B, C), 23.3 vs 25.5 (C2); 2 vs 4:
// see IndexerCudaOptions::short_select_warps.
// Session 23 (64 x 8K draft 3, flat decode, 1024 rows, 2 warps per row; same-round A/Bs, back
// to back), lost and deleted:
//  - the body run once before the dependency wait on stand-in data (no score load, no store), to
//    have the code cached when the scorer completes: 23.7-23.9 vs 23.4-23.5 us (round B); scores
//    loaded to ranked still 1.26 us. ncu (round B, timeline build): 615 instructions per warp
//    (~290 of them the 32 candidates' counts with the tie rule), 1.26 M for the 2048 warps;
//  - early selection: each flat warp signalled its request in a control word after the
//    workspace scores (atomic add, the request's first warp clearing the arrivals), the selection
//    CTAs polled their rows' requests before the dependency wait and selected as soon as the
//    request's warps were done; after the wait one atomic per warp counted its arrival and
//    verified that the word had started at 0 (else the rows were selected again), the last
//    arrival reset it (correct with any workspace content; a test on a poisoned then reused
//    workspace passed). 28.4-28.7 vs 23.2-23.6 us with an acquire load per poll of every warp
//    (rounds C, D: the scorer's last warp 2.3 us later), 24.9-25.1 vs 23.6-23.9 with one relaxed
//    poll per request and CTA, a 128-byte line per word, 500 ns sleeps (round E). Timeline (E):
//    a request is done only when the last of its warps on 2-3 SMs is (early decisions 20.3-23.8
//    us, scorer's last warp 22.75), and its rows then still need ~0.5 us to notice, ~1.2 us to
//    rank and ~1 us to write and arrive: the last row written 26.2 us, 3.5 us after the scorer's
//    last warp, where the dependency wait's selection needs ~2.5.
// Session 24 (same-round A/Bs, back to back): strict counts replace count_beats' per-candidate
// tie rule (each warp's share ~150 instead of ~290 instructions; the rows of the bench's integer
// data are full of exact ties, which cost a few warp-wide steps at the boundary only). 64 x 8K
// draft 3 (2 warps per row): 22.7 / 22.9 vs 23.0 / 23.2 us (round A), 22.8 / 22.7 / 22.7 vs 23.1
// / 22.9 / 23.1 (B), 22.7 / 22.8 / 22.7 vs 23.0 / 23.2 / 23.1 (D); timeline (A): the rows ranked
// 0.71 us after their scores arrived vs 1.08. Batch 1 x 8K (4 warps per row), with the boundary's
// minimum by redux.sync: draft 3 6.0 / 6.0 / 6.0 vs 6.1 / 6.1 / 6.0, draft 0 5.1 / 5.1 vs 5.1 /
// 5.1 (D; with five shuffles for that minimum, round A: 6.1 / 6.1 vs 6.0 / 6.0). Lost and
// deleted: one warp per row with strict counts (8 rows per CTA, no CTA barrier), 22.9 / 23.0 and
// 22.9 / 22.8 / 22.7 vs 22.7 / 22.9 and 22.8 / 22.7 / 22.7 for 2 warps (rounds A, B); the counts
// as 0 / -1 compare masks (set.gt.u32.f32), two per three-input add (8 compares and 4 adds per
// float4 instead of 8 and 8): 22.9 / 23.1 / 23.2 vs 22.5 / 22.7 / 22.6 (round G); a row copy per
// warp and a named barrier per row (its two warps) instead of the two CTA barriers: 22.2 / 22.4 /
// 22.4 vs 22.2 / 22.4 / 22.3 (round H, a tie: the barriers are not the cost); the flat
// scorer as a cooperative grid selecting its rows itself (see make_plan in indexer.cu). ncu
// (round G, one launch, no timeline): 745 K warp instructions for the 2048 warps (364 per warp),
// issue slots 17 % busy, 10.8 cycles per issued instruction (the kernel alone: no scorer beside).
template <int kW>
__device__ __forceinline__ void select_short_body(const KernelArgs& a) {
  static_assert(kW == 2 || kW == 4, "warps per row");
  constexpr int kRows = kSelectWarps / kW;  // rows per CTA
  constexpr int kPart = kCountRow / kW;     // candidates per warp
  __shared__ __align__(16) float srow[kRows][kCountRow];
  __shared__ int part[kRows][kW][kCountRow];
  pdl_launch_dependents();
  select_timeline_mark(a, 0);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int rg = warp / kW, q = warp % kW;
  const int64_t row = int64_t{blockIdx.x} * kRows + rg;
  const bool in_range = row < int64_t{a.num_tokens} * a.n_kv;
  // As in select_kernel: the position before the dependency wait, scores and ids after it.
  const int pos = in_range ? __ldg(a.positions + row / a.n_kv) : -1;
  pdl_wait();
  select_timeline_mark(a, 1);
  int32_t* out = a.block_ids + row * kTopK;
  int local = -1;  // uniform over the row's warps
  float s0 = quiet_nan(), s1 = quiet_nan();
  if (in_range) {
    local = trivial_row(a, out, pos, q == 0);
    if (local >= 0) {
      const float* scores = a.scores + row * a.max_pages;
      if (lane < local) s0 = __ldcg(scores + lane);
      if (lane + 32 < local) s1 = __ldcg(scores + lane + 32);
      select_timeline_stamp(a, 0, __float_as_uint(s0) ^ __float_as_uint(s1));
      if (q == 0) {
        srow[rg][lane] = s0;
        srow[rg][lane + 32] = s1;
      }
    }
  }
  __syncthreads();  // the rows' copies are in srow
  if (local >= 0) {
    int r0 = 0, r1 = 0;
    // The counts need their range at compile time: one case per warp of the row.
    const auto count = [&](auto j0) {
      float c0 = 0.0f, c1 = 0.0f;
      gt_counts<decltype(j0)::value, kPart>(srow[rg], s0, s1, c0, c1);
      r0 = static_cast<int>(c0);
      r1 = static_cast<int>(c1);
    };
    switch (q) {
      case 0:
        count(std::integral_constant<int, 0>{});
        break;
      case 1:
        count(std::integral_constant<int, kPart>{});
        break;
      case 2:
        if constexpr (kW > 2) count(std::integral_constant<int, 2 * kPart>{});
        break;
      default:
        if constexpr (kW > 2) count(std::integral_constant<int, 3 * kPart>{});
        break;
    }
    part[rg][q][lane] = r0;
    part[rg][q][lane + 32] = r1;
    select_timeline_stamp(a, 1, static_cast<uint32_t>(r0 + r1));
  }
  __syncthreads();  // every warp's counts are in part
  if (local >= 0 && q == 0) {
    int r0 = 0, r1 = 0;
#pragma unroll
    for (int i = 0; i < kW; ++i) {
      r0 += part[rg][i][lane];
      r1 += part[rg][i][lane + 32];
    }
    bool t0 = false, t1 = false;
    take_by_counts(s0, s1, r0, r1, t0, t1);
    emit_taken_row(out, t0, t1, local);
  }
  select_timeline_mark(a, 2);
}
template <int kW>
__global__ void __launch_bounds__(kSelectThreads) select_short_kernel(const KernelArgs a) {
  select_short_body<kW>(a);
}
// At most 40 registers (6 CTAs per SM): two CTAs fit beside two flat decode CTAs per SM (2 x 168 x
// 128 registers), so every CTA of a 1024-row call is resident while the scorer runs (flat decode at
// 2 or more CTAs per SM).
template <int kW>
__global__ void __launch_bounds__(kSelectThreads, 6)
    select_short_resident_kernel(const KernelArgs a) {
  select_short_body<kW>(a);
}

}  // namespace m3attn::indexer_kernel
