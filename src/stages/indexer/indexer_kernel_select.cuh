// Top-16 block selection from the workspace block scores: one warp per (token, head) row.
//
//   n_valid = pos / 128 + 1, local = pos / 128.
//   n_valid <= 16: ids 0 .. n_valid - 1, then -1 (no score is read).
//   otherwise: the local block plus up to 15 best non-NaN blocks among 0 .. local - 1 in the order
//   (score descending, id ascending; -0 == +0), ascending ids, then -1.
// A position < 0 or a local block >= max_pages (no page-table column) gives a row of -1.
//
// Each candidate becomes one 64-bit key, larger = better: the high word is the score's bits made
// monotone (0 is reserved for NaN, never chosen), the low word ~id so that an exact tie prefers
// the smaller id. Fifteen rounds of "largest key below the previous winner" (a strided scan of the
// row + a warp max) pick the winners in order; the row stays in L1 across rounds.
#pragma once

#include "stages/indexer/indexer_kernel_common.cuh"

namespace m3attn::indexer_kernel {

constexpr int kSelectWarps = 8;
constexpr int kSelectThreads = kSelectWarps * 32;

__device__ __forceinline__ uint64_t candidate_key(float score, int id) {
  if (score != score) return 0;     // NaN: never selected
  if (score == 0.0f) score = 0.0f;  // -0 ties with +0
  const uint32_t u = __float_as_uint(score);
  const uint32_t mono = (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // >= 0x007fffff (-inf)
  return (static_cast<uint64_t>(mono) << 32) |
         static_cast<uint64_t>(0xffffffffu - static_cast<uint32_t>(id));
}

__device__ __forceinline__ uint64_t warp_max_u64(uint64_t v) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) {
    const uint64_t o = __shfl_xor_sync(0xffffffffu, v, m);
    v = o > v ? o : v;
  }
  return v;
}

__global__ void __launch_bounds__(kSelectThreads) select_kernel(const KernelArgs a) {
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t{blockIdx.x} * kSelectWarps + (threadIdx.x >> 5);
  if (row >= int64_t{a.num_tokens} * a.n_kv) return;
  const int64_t t = row / a.n_kv;
  const int pos = __ldg(a.positions + t);
  int32_t* out = a.block_ids + row * kTopK;
  if (pos < 0 || pos / kPageSize >= a.max_pages) {
    if (lane < kTopK) out[lane] = -1;
    return;
  }
  const int local = pos / kPageSize;
  if (local < kTopK) {  // n_valid = local + 1 <= 16: everything visible
    if (lane < kTopK) out[lane] = lane <= local ? lane : -1;
    return;
  }
  const float* scores = a.scores + row * a.max_pages;
  int my_id = lane == 0 ? local : -1;  // lane k holds the k-th pick
  uint64_t prev = ~uint64_t{0};
  for (int k = 1; k < kTopK; ++k) {
    uint64_t best = 0;
    for (int b = lane; b < local; b += 32) {
      const uint64_t key = candidate_key(__ldg(scores + b), b);
      if (key < prev && key > best) best = key;
    }
    best = warp_max_u64(best);
    if (best == 0) break;  // fewer than 15 non-NaN candidates
    if (lane == k) my_id = static_cast<int>(0xffffffffu - static_cast<uint32_t>(best));
    prev = best;
  }
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

}  // namespace m3attn::indexer_kernel
