// Device pieces shared by the indexer kernels (see indexer_kernel_mma.cuh for the design): the
// kernel arguments, the work decomposition (which query tokens and which key blocks a CTA owns),
// the NaN-propagating block max and the guarded page lookup.
//
// Work decomposition (a fixed grid derived from host-known T, R and max_pages; device data only
// decides early exits):
//   grid.x = num_overflow + R. CTA x >= num_overflow is the "decode unit" of request
//            r = x - num_overflow: the first dec_tokens (= 32 / n_kv) query tokens of r, i.e. a
//            whole generation request (1 + draft_len <= 8 tokens at n_kv 4). CTA x < num_overflow
//            is an "overflow tile": the flat token range [x * pre_tokens, (x + 1) * pre_tokens)
//            minus the tokens decode units own; it may hold segments of several requests (prefill
//            chunks). num_overflow is 0 when T <= dec_tokens (no token can lie past its request's
//            decode unit; IndexerCudaOptions::overflow_tiles_always).
//   grid.y = k_splits: the visible blocks [0, nvis) of a segment (nvis from its largest position)
//            are cut into k_splits chunks of max(min_chunk, ceil(nvis / k_splits)) blocks
//            (overflow tiles, CUDA-core scorer); decode units of the tensor-core scorer use
//            chunks of dec_chunk blocks from host-known max_pages (k_splits * dec_chunk >=
//            max_pages), clipped to nvis.
// Every (token, head, visible block) score is written by exactly one CTA into the workspace
// scores[t * n_kv + h][b] (f32, row stride max_pages); the select kernel reads them. The fused
// kernel (score_fused_kernel) keeps a decode unit's split's block maxima in shared memory and
// writes them at the CTA's end; the single pass (score_fused_single_kernel, the cluster kernel)
// selects a decode unit's rows itself and writes no decode scores.
//
// Device-side guards (the host cannot check device data without a sync):
//   - query_start values are clamped to [0, T]; an empty or inverted request does nothing.
//   - a block whose page id is outside [0, num_pages) reads nothing and scores NaN: never chosen
//     unless it is the token's forced local block.
//   - blocks at or beyond max_pages are not visible; a token whose position is negative or whose
//     local block is >= max_pages gets a row of -1 (nothing selected).
// Tokens no request covers (a query_start that does not partition [0, T)) read stale scores: their
// output ids are in range but meaningless.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "core/pdl.cuh"
#include "m3attn/config.h"

namespace m3attn::indexer_kernel {

constexpr int kMaxKv = 8;                          // index heads per rank supported by the kernels
constexpr int kDecRows = 32;                       // query rows (token x head) of a decode unit
constexpr int kPreRows = 128;                      // query rows of an overflow tile
constexpr int kRowBytes = kHeadDim;                // one index-K / index-Q row (E4M3)
constexpr int kPageBytes = kPageSize * kRowBytes;  // one index-K page (16 KB, contiguous)

struct KernelArgs {
  const uint8_t* iq = nullptr;     // e4m3 [T, n_kv, 128] contiguous
  const uint8_t* cache = nullptr;  // index cache base
  int64_t page_stride = 0;         // bytes between pages
  int64_t num_pages = 0;
  const int32_t* query_start = nullptr;  // [R + 1]
  const int32_t* positions = nullptr;    // [T]
  const int32_t* seq_lens = nullptr;     // [R] (decode units: early start bound only)
  const int32_t* page_table = nullptr;   // [R, pt_stride]
  int64_t pt_stride = 0;                 // elements between page-table rows
  int num_tokens = 0;                    // T (< 2^31, validated)
  int num_requests = 0;                  // R
  int n_kv = 0;
  int max_pages = 0;
  int dec_tokens = 0;    // tokens of a decode unit: kDecRows / n_kv
  int pre_tokens = 0;    // tokens of an overflow tile: kPreRows / n_kv
  int num_overflow = 0;  // overflow tiles (grid.x offset of the decode units)
  int k_splits = 1;      // grid.y
  int min_chunk = 1;     // smallest block chunk of one split
  int dec_chunk = 1;     // blocks per split of a decode unit (mma path; see decode_path)
  // IndexerCudaOptions::flat_decode (two-kernel tensor-core path): the decode warps, 4 per CTA
  // after the overflow tiles (grid.y 1), each serving a contiguous block range of one request
  // (decode_path); 0: decode units of k_splits splits.
  int flat_warps = 0;
  // Flat decode's warp assignment in 32-bit integer divisions (set by the host where every product
  // fits in 32 bits; decode_path).
  int flat_div32 = 0;
  float* scores = nullptr;       // workspace f32 [T * n_kv, max_pages]
  int32_t* block_ids = nullptr;  // i32 [T, n_kv, 16]
  // IndexerCudaOptions::programmatic_launch: the first kernel may run before the previous stage
  // (the producer) finished. Then decode units issue, before pdl_wait, only copies of index-K
  // blocks that lie entirely before their request's first new position (seq_lens[r] minus the
  // request's tokens: rows no kernel of this step writes), and load index_q after it.
  int pdl = 0;
  // With pdl: blocks per decode warp, after its first, prefetched into L2 before pdl_wait
  // (IndexerCudaOptions::pdl_prefetch_blocks; decode_path).
  int pdl_prefetch = 0;
  int guess = 1;        // guess_request_bounds and one token per request (decode units)
  int early = 0;        // early_query_loads (decode units without the guess, not the single pass)
  int fast_select = 0;  // select_kernel: long rows by select_by_threshold (fast_select)
  // IndexerCudaOptions::timeline (benchmarks): per decode warp, kTimelineStride uint64, see
  // timeline_mark.
  uint64_t* timeline = nullptr;
  // IndexerCudaOptions::stream_evict_first: the fraction (1 or 0) of the decode units' index-K
  // copies marked L2 evict_first.
  float evict_fraction = 0.0f;
  int async_maxima = 0;  // IndexerCudaOptions::cluster_async_maxima
};

// Diagnostics (IndexerCudaOptions::timeline; benchmarks only, null otherwise): lane 0 of every
// warp of a decode unit records clock64 in word 8 + slot (and 1 in word slot) of its
// kTimelineStride words at (CTA x * gridDim.y + y) * 4 + warp. Slots: 0 entry, 1 ready to
// score (query rows and positions in, after pdl_wait), 2 its blocks scored, 3 the CTA's (or
// cluster's) barrier passed, 4 done (rows written); word 7 holds the SM id (%smid) of the warp.
// %globaltimer is read only twice per CTA (warp 0 at entry, words 13 / 14 = globaltimer / clock64)
// and once per warp at its end (words 5 / 6), which the benchmark uses to put every SM's clock64
// on one time base: a globaltimer read takes ~0.3 us and the reads of an SM's warps serialize
// (session 17 round A: 1.2 us between two marks with 4 warps per SM, 2.4 us with 8, whatever the
// warps did between them), so marking every phase with it distorted the phases it measured.
// Written even before pdl_wait (the buffer is the caller's own).
// Words 16 / 17 (timeline_stamp): the single pass's lean final selection, clock64 once the
// warp's first row's scores are in registers and once it is ranked (each read waits for that
// value). Words 18 / 19: the decode warp's front, clock64 once its first index-K copies are
// issued (decode_path's early start) and once its first tile has landed (decode_unit); words
// 22 / 23: once its first page-table entry and its request's seq_lens value are in registers.
constexpr int kTimelineSlots = 5;
constexpr int kTimelineStride = 24;
__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t g;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g));
  return g;
}
__device__ __forceinline__ void timeline_mark(const KernelArgs& a, int slot) {
  if (a.timeline == nullptr || (threadIdx.x & 31) != 0) return;
  const uint64_t c = static_cast<uint64_t>(clock64());
  const int64_t w =
      (int64_t{blockIdx.x} * gridDim.y + blockIdx.y) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  uint64_t* e = a.timeline + w * kTimelineStride;
  e[8 + slot] = c;
  e[slot] = 1;
  if (slot == 0) {
    uint32_t sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    e[7] = sm;
    if (threadIdx.x == 0) {
      e[13] = globaltimer_ns();
      e[14] = static_cast<uint64_t>(clock64());
    }
  }
  if (slot == kTimelineSlots - 1) {
    e[5] = globaltimer_ns();
    e[6] = static_cast<uint64_t>(clock64());
  }
}

// clock64 once `dep` is available (the read is issued after the register is written), into word
// `word` of the warp's kTimelineStride words (lane 0; timeline only).
__device__ __forceinline__ uint64_t clock_after(uint32_t dep) {
  uint64_t c;
  asm volatile("{\n .reg .b32 t;\n mov.b32 t, %1;\n mov.u64 %0, %%clock64;\n}"
               : "=l"(c)
               : "r"(dep));
  return c;
}
__device__ __forceinline__ void timeline_stamp(const KernelArgs& a, int word, uint32_t dep) {
  if (a.timeline == nullptr || (threadIdx.x & 31) != 0) return;
  const uint64_t c = clock_after(dep);
  const int64_t w =
      (int64_t{blockIdx.x} * gridDim.y + blockIdx.y) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  a.timeline[w * kTimelineStride + word] = c;
}

// Slot `slot` (< kTimelineSlots - 1) of timeline_mark with a clock64 value `c` read earlier, so
// that the mark's global stores come after the release arrive that ends the clustered single
// pass's stream (a release waits for the thread's earlier stores: writing the mark before it
// would make the arrive wait for an L2 round trip that the normal path does not have).
__device__ __forceinline__ uint64_t timeline_clock(const KernelArgs& a) {
  return a.timeline != nullptr ? static_cast<uint64_t>(clock64()) : 0u;
}
__device__ __forceinline__ void timeline_mark_at(const KernelArgs& a, int slot, uint64_t c) {
  if (a.timeline == nullptr || (threadIdx.x & 31) != 0) return;
  const int64_t w =
      (int64_t{blockIdx.x} * gridDim.y + blockIdx.y) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  uint64_t* e = a.timeline + w * kTimelineStride;
  e[8 + slot] = c;
  e[slot] = 1;
}

// A value (not a clock) into `word` of the warp's kTimelineStride words (lane 0; timeline only).
// Word 20: the number of blocks the decode warp scores (decode_path); word 21 (timeline_stamp,
// clustered single pass): clock64 once the warp's release arrive at the end returned.
__device__ __forceinline__ void timeline_word(const KernelArgs& a, int word, uint64_t value) {
  if (a.timeline == nullptr || (threadIdx.x & 31) != 0) return;
  const int64_t w =
      (int64_t{blockIdx.x} * gridDim.y + blockIdx.y) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  a.timeline[w * kTimelineStride + word] = value;
}

// The selection kernel's marks (same buffer, after the scorer's warps' words and 16 more: from
// word kTimelineStride * (grid.x * grid.y * 4) + 16 of the scorer's grid), kSelectTimelineWords
// words per selection warp (global warp index): the SM id + 1, clock64 at entry, at the release
// from pdl_wait, when its row is written, and (select_timeline_stamp) once its scores are loaded
// and once they are ranked (the benchmark converts them with the scorer warps' globaltimer pairs
// of the same SM, or its own globaltimer / clock64 pair at entry in words 6 / 7 where no scorer
// warp ran on that SM).
constexpr int kSelectTimelineWords = 8;
__device__ __forceinline__ uint64_t* select_timeline_entry(const KernelArgs& a) {
  const int64_t score_ctas = a.flat_warps > 0
                                 ? int64_t{a.num_overflow} + a.flat_warps / 4
                                 : (int64_t{a.num_overflow} + a.num_requests) * a.k_splits;
  const int64_t base = score_ctas * 4 * kTimelineStride + 16;
  const int64_t w = int64_t{blockIdx.x} * (blockDim.x >> 5) + (threadIdx.x >> 5);
  return a.timeline + base + w * kSelectTimelineWords;
}
// Word 4 + k (k 0: scores loaded, 1: ranked) once `dep` is available.
__device__ __forceinline__ void select_timeline_stamp(const KernelArgs& a, int k, uint32_t dep) {
  if (a.timeline == nullptr || (threadIdx.x & 31) != 0) return;
  const uint64_t c = clock_after(dep);
  select_timeline_entry(a)[4 + k] = c;
}
__device__ __forceinline__ void select_timeline_mark(const KernelArgs& a, int slot) {
  if (a.timeline == nullptr || (threadIdx.x & 31) != 0) return;
  const uint64_t c = static_cast<uint64_t>(clock64());
  uint64_t* e = select_timeline_entry(a);
  if (slot == 0) {
    uint32_t sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    e[0] = sm + 1;
    // A (globaltimer, clock64) pair for SMs where no scorer warp ran (words 6 / 7).
    e[6] = globaltimer_ns();
    e[7] = static_cast<uint64_t>(clock64());
  }
  e[1 + slot] = c;
}

// Ordering key of a candidate block, larger = better: the high word is the score's bits made
// monotone (0 is reserved for NaN, never chosen; -0 ties with +0), the low word ~id so that an
// exact tie prefers the smaller id. Keys of distinct ids are distinct.
__device__ __forceinline__ uint64_t candidate_key(float score, int id) {
  if (score != score) return 0;     // NaN: never selected
  if (score == 0.0f) score = 0.0f;  // -0 ties with +0
  const uint32_t u = __float_as_uint(score);
  const uint32_t mono = (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // >= 0x007fffff (-inf)
  return (static_cast<uint64_t>(mono) << 32) |
         static_cast<uint64_t>(0xffffffffu - static_cast<uint32_t>(id));
}
__device__ __forceinline__ int candidate_id(uint64_t key) {
  return static_cast<int>(0xffffffffu - static_cast<uint32_t>(key));
}

// Thread-block cluster pieces of the clustered single pass (score_fused_cluster_kernel). Every
// thread of every CTA of the cluster executes each arrive and each wait exactly once, in order.
// Arrive without memory ordering (the start: only says "this CTA runs").
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed;" ::: "memory");
}
// Arrive publishing this thread's earlier writes (shared memory of any CTA of the cluster, global
// memory) to the threads that complete the matching wait.
__device__ __forceinline__ void cluster_arrive_release() {
  asm volatile("barrier.cluster.arrive.release;" ::: "memory");
}
// Waits until every (non-exited) thread of the cluster has arrived; acquires their published
// writes.
__device__ __forceinline__ void cluster_wait_acquire() {
  asm volatile("barrier.cluster.wait.acquire;" ::: "memory");
}
// The generic address of `p` (a shared-memory variable of this CTA) in the shared memory of the
// cluster's CTA `rank`: ordinary loads and stores through it reach that CTA (distributed shared
// memory).
template <typename T>
__device__ __forceinline__ T* map_to_cluster_rank(T* p, uint32_t rank) {
  uint64_t out;
  asm volatile("mapa.u64 %0, %1, %2;" : "=l"(out) : "l"(reinterpret_cast<uint64_t>(p)), "r"(rank));
  return reinterpret_cast<T*>(out);
}

// The shared::cluster address of `p` (a shared-memory variable of this CTA) in the CTA `rank`
// of the cluster (for st.async and remote mbarrier operands).
__device__ __forceinline__ uint32_t cluster_smem_addr(const void* p, uint32_t rank) {
  const uint32_t local = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  uint32_t out;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(out) : "r"(local), "r"(rank));
  return out;
}

// Calls f(std::integral_constant<int, I>) for I = kI .. kN - 1 (a compile-time unrolled loop).
template <int kI, int kN, typename F>
__device__ __forceinline__ void static_for(F&& f) {
  if constexpr (kI < kN) {
    f(std::integral_constant<int, kI>{});
    static_for<kI + 1, kN>(f);
  }
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float quiet_nan() { return __int_as_float(0x7fffffff); }

// Block max with NaN propagation (the twin's rule: a block holding any NaN score scores NaN).
// Masked keys enter as -inf, so garbage beyond a token's position never reaches the result.
__device__ __forceinline__ float block_max(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

__device__ __forceinline__ float warp_block_max_xor(float v, int mask) {
  return block_max(v, __shfl_xor_sync(0xffffffffu, v, mask));
}

__device__ __forceinline__ int clamp_token(const KernelArgs& a, int v) {
  return min(max(v, 0), a.num_tokens);
}

__device__ __forceinline__ int load_query_start(const KernelArgs& a, int r) {
  return clamp_token(a, __ldg(a.query_start + r));
}

// Page of block b of request r, or -1 when the page-table entry is outside the pool.
__device__ __forceinline__ int64_t guarded_page(const KernelArgs& a, int r, int b) {
  const int32_t pg = __ldg(a.page_table + int64_t{r} * a.pt_stride + b);
  return (pg >= 0 && int64_t{pg} < a.num_pages) ? int64_t{pg} : int64_t{-1};
}

__device__ __forceinline__ const uint8_t* page_base(const KernelArgs& a, int64_t page) {
  return a.cache + page * a.page_stride;
}

// Visible blocks of rows whose largest position is max_pos, clamped to the page table; 0 when no
// scoring is needed: no valid row, or every row sees <= 16 blocks (all of them are selected
// whatever their scores, so the select kernel never reads them).
__device__ __forceinline__ int blocks_to_score(const KernelArgs& a, int max_pos) {
  if (max_pos < 0) return 0;
  const int nvis = min(max_pos / kPageSize + 1, a.max_pages);
  return nvis <= kTopK ? 0 : nvis;
}

// The block range [b0, b1) of split blockIdx.y over nvis blocks; false when empty.
__device__ __forceinline__ bool split_range(const KernelArgs& a, int nvis, int& b0, int& b1) {
  const int per = (nvis + a.k_splits - 1) / a.k_splits;
  const int chunk = max(a.min_chunk, per);
  b0 = static_cast<int>(blockIdx.y) * chunk;
  b1 = min(nvis, b0 + chunk);
  return b0 < b1;
}

// Calls f(r, ta, te) for every token segment [ta, te) of request r that this CTA owns (see the
// decomposition above). Uniform across the CTA: every thread evaluates the same loads.
template <typename F>
__device__ __forceinline__ void for_each_segment(const KernelArgs& a, F&& f) {
  const int x = static_cast<int>(blockIdx.x);
  if (x >= a.num_overflow) {
    const int r = x - a.num_overflow;
    const int qa = load_query_start(a, r);
    const int qe = load_query_start(a, r + 1);
    const int se = min(qe, qa + a.dec_tokens);
    if (qa < se) f(r, qa, se);
    return;
  }
  const int ta = x * a.pre_tokens;
  const int te = min(ta + a.pre_tokens, a.num_tokens);
  if (ta >= te) return;
  // First request whose end passes ta (query_start monotone by contract; if it is not, the search
  // still ends and every index stays in range).
  int lo = 0, hi = a.num_requests;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (load_query_start(a, mid + 1) > ta)
      hi = mid;
    else
      lo = mid + 1;
  }
  // Requests from lo on, 32 at a time (one per lane; every warp computes the same masks, so the
  // calls stay uniform across the CTA), until one starts at or after te.
  const int lane = threadIdx.x & 31;
  for (int base = lo; base < a.num_requests; base += 32) {
    const int r = base + lane;
    const bool in = r < a.num_requests;
    const int qa = in ? load_query_start(a, r) : a.num_tokens;
    const int qe = in ? load_query_start(a, r + 1) : a.num_tokens;
    const int sa = max(ta, qa + a.dec_tokens);
    const int se = min(te, qe);
    const bool stop = !in || qa >= te;
    uint32_t todo = __ballot_sync(0xffffffffu, !stop && sa < se);
    const uint32_t stops = __ballot_sync(0xffffffffu, stop);
    // Only requests before the first stop count (query_start monotone: none after it would).
    if (stops) todo &= (1u << (__ffs(stops) - 1)) - 1u;
    while (todo) {
      const int i = __ffs(todo) - 1;
      todo &= todo - 1;
      f(base + i, __shfl_sync(0xffffffffu, sa, i), __shfl_sync(0xffffffffu, se, i));
    }
    if (stops) break;
  }
}

}  // namespace m3attn::indexer_kernel
