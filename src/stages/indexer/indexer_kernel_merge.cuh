// Final selection of the fused path (score_fused_kernel, then this kernel with programmatic
// dependent launch). Same output rule as select_kernel (indexer_kernel_select.cuh):
//   position < 0 or local block >= max_pages: a row of -1;
//   n_valid = local + 1 <= 16: ids 0 .. local, then -1 (nothing is read);
//   otherwise the local block plus the 15 best non-NaN blocks among 0 .. local - 1 (score
//   descending, id ascending), ascending ids, then -1.
// Sources of the 15 best:
//   - rows of decode units (the first dec_tokens tokens of a request): the candidate lists the
//     scorer's splits wrote, list y covering blocks [y * dec_chunk, (y + 1) * dec_chunk), for
//     y < ceil(local / dec_chunk): the best 15 of the row are among the union of the lists' best
//     15 (each non-selected block of a split is beaten by 15 of that split's blocks);
//   - other rows (overflow tiles, prefill): the block scores in the workspace, as select_kernel.
// A row is a decode row iff t - query_start[r] < dec_tokens for the request r holding token t, the
// scorer's own rule (r guessed as t * R / T, else a binary search over query_start).
// Latency: the position, the guessed request bounds and each lane's first 4 list keys are loaded
// together right after the dependency wait, so a decode row of equal-length requests costs one
// round trip (two when it has more than 4 keys per lane).
//
// Work: merge_wpr warps per row (1, 2, 4 or 8, from the host-known bound on keys per row); each
// warp scans its share with per-lane sorted top-15 lists (insert_key), reduces them to the warp's
// top 15 (15 redux rounds), and with several warps per row the first warp merges their 15s from
// shared memory the same way. Keys are exact (score bits and id), so every step is exact and the
// result is the one select_kernel gives on the same block scores.
// Corrupted device data stays memory-safe: a list key whose id is outside its split's visible
// range (only possible when no CTA wrote that list this run) is dropped.
#pragma once

#include "stages/indexer/indexer_kernel_common.cuh"
#include "stages/indexer/indexer_kernel_select.cuh"

namespace m3attn::indexer_kernel {

constexpr int kMergeWarps = 8;
constexpr int kMergeThreads = kMergeWarps * 32;

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

// log2 of the slots read per candidate list: a split of dec_chunk blocks has at most dec_chunk
// candidates, so only the first 4 (4-block splits), 8 (8-block) or all 16 slots are read (slot 15
// is always zero). Key e of a row: list e >> lg, slot e & (2^lg - 1).
__device__ __forceinline__ int list_slots_log2(int dec_chunk) {
  return dec_chunk <= 4 ? 2 : (dec_chunk <= 8 ? 3 : 4);
}

// Key e of a decode row's lists enters the lane's top list if it is a real candidate whose id lies
// in its list's visible blocks [y0, min(local, y0 + dec_chunk)) (a stale list key, only possible
// under corrupted query_start, is dropped).
__device__ __forceinline__ void take_list_key(const KernelArgs& a, uint64_t (&top)[kTopK - 1],
                                              uint64_t key, int e, int lg, int local) {
  const int id = candidate_id(key);
  const int y0 = (e >> lg) * a.dec_chunk;
  if (key != 0 && id >= y0 && id < min(local, y0 + a.dec_chunk)) insert_key(top, key);
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

__global__ void __launch_bounds__(kMergeThreads) merge_kernel(const KernelArgs a) {
  __shared__ uint64_t part_keys[kMergeWarps][kTopK];
  pdl_launch_dependents();  // the next stage (attention) waits for this grid before reading
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int wpr = a.merge_wpr;
  const int64_t row = int64_t{blockIdx.x} * (kMergeWarps / wpr) + warp / wpr;
  const int part = warp % wpr;
  const int step = 32 * wpr;  // stride of a warp's keys
  // mode (uniform over the row's warps): 0 nothing to merge, 1 block scores, 2 candidate lists.
  int mode = 0;
  int local = -1;
  int32_t* out = nullptr;
  const bool in_range = row < int64_t{a.num_tokens} * a.n_kv;
  const int t = in_range ? static_cast<int>(row / a.n_kv) : 0;
  // The position and the guessed request's bounds are loaded before the dependency wait: the batch
  // views were written before the scorer was launched (a normal launch, after every earlier
  // operation of the stream completed), so they are visible already; the scorer's outputs (block
  // scores, candidate lists) and block_ids are touched only after the wait. Then each lane's first
  // 4 keys of the row's candidate lists go out together (one round trip; inside the row's k_splits
  // lists whatever the row turns out to need; unused unless it is a decode row).
  const int guess = static_cast<int>(int64_t{t} * a.num_requests / a.num_tokens);
  const int gqa = load_query_start(a, guess);
  const int gqe = load_query_start(a, guess + 1);
  const int pos = in_range ? __ldg(a.positions + t) : -1;
  pdl_wait();  // before any access to the scorer's outputs (PDL launch)
  const int lg = list_slots_log2(a.dec_chunk);
  const uint64_t* lists = a.cand + row * a.k_splits * kTopK;
  auto key_at = [&](int e) { return lists[((e >> lg) << 4) + (e & ((1 << lg) - 1))]; };
  const int e0 = lane + 32 * part;
  uint64_t pre[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    pre[i] = in_range && e0 + i * step < (a.k_splits << lg) ? key_at(e0 + i * step) : 0;
  if (in_range) {
    out = a.block_ids + row * kTopK;
    local = trivial_row(a, out, pos, part == 0);
    if (local >= 0) mode = is_decode_token(a, t, gqa, gqe) ? 2 : 1;
  }
  uint64_t top[kTopK - 1];
#pragma unroll
  for (int i = 0; i < kTopK - 1; ++i) top[i] = 0;
  if (mode == 1) {
    // Written by the scorer in this stream: plain loads (not the read-only path).
    const float* scores = a.scores + row * a.max_pages;
    int b = lane + 32 * part;
    for (; b + 3 * step < local; b += 4 * step) {
      const float s0 = scores[b], s1 = scores[b + step], s2 = scores[b + 2 * step],
                  s3 = scores[b + 3 * step];
      insert_key(top, candidate_key(s0, b));
      insert_key(top, candidate_key(s1, b + step));
      insert_key(top, candidate_key(s2, b + 2 * step));
      insert_key(top, candidate_key(s3, b + 3 * step));
    }
    for (; b < local; b += step) insert_key(top, candidate_key(scores[b], b));
  } else if (mode == 2) {
    const int n = ((local + a.dec_chunk - 1) / a.dec_chunk) << lg;  // lists 0 .. ceil - 1
    auto take = [&](uint64_t key, int e) { take_list_key(a, top, key, e, lg, local); };
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (e0 + i * step < n) take(pre[i], e0 + i * step);
    int e = e0 + 4 * step;
    for (; e + 3 * step < n; e += 4 * step) {
      const uint64_t k0 = key_at(e), k1 = key_at(e + step), k2 = key_at(e + 2 * step),
                     k3 = key_at(e + 3 * step);
      take(k0, e);
      take(k1, e + step);
      take(k2, e + 2 * step);
      take(k3, e + 3 * step);
    }
    for (; e < n; e += step) take(key_at(e), e);
  }
  uint64_t best = mode != 0 ? warp_top15(top) : 0;  // mode is warp-uniform
  if (wpr > 1) {                                    // CTA-uniform
    if (lane < kTopK) part_keys[warp][lane] = best;
    __syncthreads();
    if (part == 0 && mode != 0) {
#pragma unroll
      for (int i = 0; i < kTopK - 1; ++i) top[i] = 0;
      for (int e = lane; e < wpr * kTopK; e += 32)
        insert_key(top, part_keys[warp + e / kTopK][e % kTopK]);
      best = warp_top15(top);
    }
  }
  if (part != 0 || mode == 0) return;
  emit_row(out, local, best);
}

}  // namespace m3attn::indexer_kernel
