// The sequence kernel (IndexerCudaOptions::seq_cluster): a single pass for decode batches of
// contexts up to 64 blocks in which each request's top-16 selection runs while the next request's
// index-K is still streaming, instead of after the last byte of the call.
//
// Why: at 64 x 8K the selection after the stream is the largest loss against a plain read of the
// same pages (session 19 round A timelines, cold call): the single pass's final selection ends
// 1.3-1.8 us after its last block is scored (draft 0), the selection kernel's rows 2-4.5 us after
// the scorer's last warp (draft 3), while the paged read's SMs end within ~1.5 us of each other.
//
// Layout: one thread-block cluster of K CTAs (grid.y, 4 warps each, one CTA per SM: ~162 KB of
// shared memory) per group of m consecutive requests (cluster j of seq_clusters owns requests
// [j R / seq_clusters, (j + 1) R / seq_clusters), m <= kSeqMaxRequests). The cluster's U = 4 K
// warps serve the requests one after the other; warp u owns blocks [u max_pages / U, (u + 1)
// max_pages / U) of every request (host-known max_pages, clipped to the request's visible blocks),
// so every warp streams the same number of blocks within one. A warp's block maxima go into the
// request's table in the shared memory of CTA s % K (s: the request's index in the group;
// distributed shared memory, column = block id). After its blocks of request s, every thread
// arrives at a cluster barrier and waits for it; then the request's rows are selected (row i by
// warp i % U: rank_by_counting on a copy of the table row, emit_ranked_row), and the warps go on
// with request s + 1, whose first block's tiles are already in flight: decode_unit chains the tile
// ring from one request into the next (its last block issues the next request's first tiles), so
// during a selection each warp still has 7 tiles (14 KB) in flight and the DRAM queue does not
// drain (the paged read at one CTA per SM sustains ~30 GB/s per SM: 56 KB per SM cover ~1.7 us).
// Only the last request's selection runs after the stream, spread over the cluster's warps.
//
// The group's positions and query rows are copied into shared memory at the start, at the bounds
// an equal-length batch would have (request r: tokens [r T / R, (r + 1) T / R)), by cp.async
// committed before the first tiles (so they do not queue behind the tile traffic), checked
// against query_start and reloaded when the guess was wrong.
//
// Overflow tiles (tokens past a request's first dec_tokens) run as in the clustered single pass
// (K splits per tile, rows finished after a cluster barrier). Not with programmatic launch (the
// plan does not pick it then): the first tiles are read before any dependency wait.
#pragma once

#include "stages/indexer/indexer_kernel_mma.cuh"

namespace m3attn::indexer_kernel {

constexpr int kSeqMaxRequests = 8;  // requests per cluster at most (the plan's bound)
constexpr int kSeqTableFloats = kDecRows * kFusedMaxChunk;  // one request's block-max table
// Dynamic shared memory: the warps' tile rings | block-max tables [kSeqMaxRequests] | query rows
// (E4M3) [kSeqMaxRequests][kDecRows][128] | positions [kSeqMaxRequests][kDecRows] | per-warp
// selection rows [kMmaWarps][kCountRow] f32 | partial ranks [kMmaWarps rows][kMmaWarps quarters]
// [kCountRow] i32 | the rows' local blocks [kMmaWarps].
constexpr int kSeqTablesOff = kMmaSmemBytes;
constexpr int kSeqQueryOff = kSeqTablesOff + kSeqMaxRequests * kSeqTableFloats * 4;
constexpr int kSeqPosOff = kSeqQueryOff + kSeqMaxRequests * kDecRows * kRowBytes;
constexpr int kSeqRowsOff = kSeqPosOff + kSeqMaxRequests * kDecRows * 4;
constexpr int kSeqPartOff = kSeqRowsOff + kMmaWarps * kCountRow * 4;
constexpr int kSeqLocalOff = kSeqPartOff + kMmaWarps * kMmaWarps * kCountRow * 4;
constexpr int kSeqSmemBytes = kSeqLocalOff + kMmaWarps * 4;
static_assert(kShortRowWarps == kMmaWarps, "a row's quarters are the CTA's warps");
static_assert(kSeqQueryOff % 16 == 0 && kSeqPosOff % 16 == 0, "16-byte copies");

__device__ __forceinline__ void cp_async4(void* smem_dst, const void* gmem_src) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(d), "l"(gmem_src) : "memory");
}

// Copies (cp.async, by the whole CTA, uncommitted) the positions and query rows of the group's
// requests s < m whose token ranges are [qa[s], qa[s] + n[s]) (n[s] <= dec_tokens) into the
// shared arrays. qa / n: functions of s.
template <typename QA, typename N>
__device__ __forceinline__ void seq_copy_meta(const KernelArgs& a, uint8_t* smem, int m, QA&& qa,
                                              N&& n) {
  int* spos = reinterpret_cast<int*>(smem + kSeqPosOff);
  uint8_t* sq = smem + kSeqQueryOff;
  for (int s = 0; s < m; ++s) {
    const int t0 = qa(s), nt = n(s);
    for (int i = static_cast<int>(threadIdx.x); i < nt; i += kMmaThreads)
      cp_async4(spos + s * kDecRows + i, a.positions + t0 + i);
    const int chunks = nt * a.n_kv * (kRowBytes / 16);
    const uint8_t* src = a.iq + int64_t{t0} * a.n_kv * kRowBytes;
    for (int i = static_cast<int>(threadIdx.x); i < chunks; i += kMmaThreads)
      cp_async16(sq + s * kDecRows * kRowBytes + i * 16, src + i * 16);
  }
}

// The selection of request s's rows [0, rows) (after the cluster barrier that completes its
// table `table`, in CTA s % K's shared memory): CTA `rank` of the K takes rows rank, rank + K, ...
// in batches of 4; warp w copies batch row w's candidates (blocks [0, local)) into the CTA's
// shared rows (trivial rows are written by trivial_row), then each warp counts the beats against
// a quarter of every batch row's candidates (count_quarter, as select_short_kernel), and warp w
// sums row w's partial ranks and writes it (emit_ranked_row). So every warp of the cluster does
// about the same share of every request's selection (4 rows at draft 0: one row per CTA of a
// 4-CTA cluster, a quarter per warp). CTA-uniform: every thread passes the barriers.
__device__ __forceinline__ void seq_select_rows(const KernelArgs& a, uint8_t* smem,
                                                const float* table, const int* spos, int qa,
                                                int rows, int K, int rank) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  float* srow = reinterpret_cast<float*>(smem + kSeqRowsOff);
  int* part = reinterpret_cast<int*>(smem + kSeqPartOff);
  int* slocal = reinterpret_cast<int*>(smem + kSeqLocalOff);
  for (int i0 = rank; i0 < rows; i0 += kMmaWarps * K) {
    const int i = i0 + warp * K;  // this warp's batch row
    int32_t* out = a.block_ids + (int64_t{qa} * a.n_kv + i) * kTopK;
    int local = -1;
    float s0 = quiet_nan(), s1 = quiet_nan();
    if (i < rows) {
      local = trivial_row(a, out, spos[i / a.n_kv], true);
      if (local >= 0) {
        const float* trow = table + i * kFusedMaxChunk;
        if (lane < local) s0 = trow[lane];
        if (lane + 32 < local) s1 = trow[lane + 32];
      }
    }
    srow[warp * kCountRow + lane] = s0;
    srow[warp * kCountRow + lane + 32] = s1;
    if (lane == 0) slocal[warp] = local;
    __syncthreads();  // the batch's rows and local blocks are in shared memory
#pragma unroll 1
    for (int b = 0; b < kMmaWarps; ++b) {
      if (slocal[b] < 0) continue;  // uniform
      const float* row = srow + b * kCountRow;
      const float c0 = row[lane], c1 = row[lane + 32];
      int r0 = 0, r1 = 0;
      switch (warp) {
        case 0:
          count_quarter<0>(row, c0, c1, r0, r1);
          break;
        case 1:
          count_quarter<1>(row, c0, c1, r0, r1);
          break;
        case 2:
          count_quarter<2>(row, c0, c1, r0, r1);
          break;
        default:
          count_quarter<3>(row, c0, c1, r0, r1);
          break;
      }
      part[(b * kMmaWarps + warp) * kCountRow + lane] = r0;
      part[(b * kMmaWarps + warp) * kCountRow + lane + 32] = r1;
    }
    __syncthreads();  // every quarter's counts are in part
    if (local >= 0) {
      int r0 = 0, r1 = 0;
#pragma unroll
      for (int q = 0; q < kMmaWarps; ++q) {
        r0 += part[(warp * kMmaWarps + q) * kCountRow + lane];
        r1 += part[(warp * kMmaWarps + q) * kCountRow + lane + 32];
      }
      emit_ranked_row(out, s0, s1, r0, r1, local);
    }
    __syncthreads();  // srow, part and slocal are reused by the next batch
  }
}

__device__ __forceinline__ void seq_path(const KernelArgs& a, uint8_t* smem) {
  timeline_mark(a, 0);
  cluster_arrive_relaxed();  // its wait comes before the first remote table write
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int K = static_cast<int>(gridDim.y);
  const int rank = static_cast<int>(blockIdx.y);
  const int j = static_cast<int>(blockIdx.x) - a.num_overflow;
  const int R = a.num_requests;
  const int ra = static_cast<int>(int64_t{j} * R / a.seq_clusters);
  const int m = static_cast<int>(int64_t{j + 1} * R / a.seq_clusters) - ra;  // <= kSeqMaxRequests
  const int U = K * kMmaWarps;
  const int u = rank * kMmaWarps + warp;
  const int lo = static_cast<int>(int64_t{u} * a.max_pages / U);
  const int hi = static_cast<int>(int64_t{u + 1} * a.max_pages / U);
  float* tables = reinterpret_cast<float*>(smem + kSeqTablesOff);
  const int* spos = reinterpret_cast<const int*>(smem + kSeqPosOff);
  const uint8_t* sq = smem + kSeqQueryOff;

  // The guessed bounds (an equal-length batch) of request ra + s.
  const auto gqa = [&](int s) { return static_cast<int>(int64_t{ra + s} * a.num_tokens / R); };
  const auto gn = [&](int s) {
    return min(static_cast<int>(int64_t{ra + s + 1} * a.num_tokens / R) - gqa(s), a.dec_tokens);
  };
  // At once: query_start / seq_lens of the group (lane s), the warp's first two pages of request
  // ra, and the positions and query rows at the guessed bounds (one commit group, before the
  // tiles).
  const int qs_l = lane <= m ? load_query_start(a, ra + lane) : 0;
  const int sl_l = lane < m ? __ldg(a.seq_lens + ra + lane) : 0;
  const int64_t pg0 = m > 0 && lo < hi ? guarded_page(a, ra, lo) : int64_t{-1};
  const int64_t pg0b = m > 0 && lo + 1 < hi ? guarded_page(a, ra, lo + 1) : int64_t{-1};
  seq_copy_meta(a, smem, m, gqa, gn);
  cp_async_commit();
  // Early start of request ra's first block (seq_lens bounds it, as in decode_path).
  bool pre = false;
  {
    const int sl0 = __shfl_sync(0xffffffffu, sl_l, 0);
    if (m > 0 && lo < min(blocks_to_score(a, sl0 - 1), hi)) {
      stream_prologue(a, smem + warp * (kDecStages * kTileBytes), pg0, lane);
      pre = true;
    }
  }
  if (pre)
    cp_async_wait<kDecStages - 1>();  // the metadata group (the oldest) has landed
  else
    cp_async_wait<0>();
  // The real bounds: lane s holds request ra + s's first token qa_l and token count n_l.
  const int qe_l = __shfl_down_sync(0xffffffffu, qs_l, 1);
  const int n_l = lane < m ? max(min(qe_l - qs_l, a.dec_tokens), 0) : 0;
  const bool wrong = __any_sync(0xffffffffu, lane < m && (qs_l != gqa(lane) || n_l != gn(lane)));
  __syncthreads();  // every thread's copies are visible
  if (wrong) {      // uniform: every warp loaded the same query_start
    seq_copy_meta(
        a, smem, m, [&](int s) { return __shfl_sync(0xffffffffu, qs_l, s); },
        [&](int s) { return __shfl_sync(0xffffffffu, n_l, s); });
    cp_async_commit();
    cp_async_wait<0>();  // also the prologue's tiles (rare path)
    __syncthreads();
  }
  // Per request (lane s): visible blocks and this warp's clipped end.
  int nvis_l = 0;
  for (int s = 0; s < m; ++s) {
    const int ns = __shfl_sync(0xffffffffu, n_l, s);
    const int p = lane < ns ? spos[s * kDecRows + lane] : -1;
    const int v = ns > 0 ? blocks_to_score(a, __reduce_max_sync(0xffffffffu, p)) : 0;
    if (lane == s) nvis_l = v;
  }
  const int b1_l = min(nvis_l, hi);
  const uint32_t active = __ballot_sync(0xffffffffu, lane < m && lo < b1_l);
  cluster_wait_acquire();  // every CTA of the cluster runs: remote tables may be written
  timeline_mark(a, 1);

  for (int s = 0; s < m; ++s) {
    const int r = ra + s;
    const int qa = __shfl_sync(0xffffffffu, qs_l, s);
    const int n = __shfl_sync(0xffffffffu, n_l, s);
    const int rows = n * a.n_kv;
    const int lane_pos = lane < n ? spos[s * kDecRows + lane] : -1;
    float* table = map_to_cluster_rank(tables + (s % kSeqMaxRequests) * kSeqTableFloats,
                                       static_cast<uint32_t>(s % K));
    if ((active >> s) & 1u) {
      const int b1 = __shfl_sync(0xffffffffu, b1_l, s);
      // The next request this warp scores, whose first tiles the last block issues ahead.
      const uint32_t later = active & ~((2u << s) - 1u);
      const bool chain = later != 0;
      const int64_t pg_next = chain ? guarded_page(a, ra + __ffs(later) - 1, lo) : int64_t{-1};
      const int64_t pg_first = s == 0 ? pg0 : guarded_page(a, r, lo);
      const int64_t pg_second =
          lo + 1 < b1 ? (s == 0 ? pg0b : guarded_page(a, r, lo + 1)) : int64_t{-1};
      QueryRaw q;
      {
        const int g = lane >> 2, tig = lane & 3;
        const uint8_t* rows_s = sq + s * kDecRows * kRowBytes;
#pragma unroll
        for (int nt = 0; nt < kDecRows / 8; ++nt) {
          const int row = nt * 8 + g;
          q.lo[nt] = q.hi[nt] = make_uint4(0u, 0u, 0u, 0u);
          if (row < rows) {
            q.lo[nt] = lds16(rows_s + row * kRowBytes + tig * 16);
            q.hi[nt] = lds16(rows_s + row * kRowBytes + 64 + tig * 16);
          }
        }
      }
      switch ((rows + 7) / 8) {
        case 1:
          decode_unit<1, true>(a, smem, r, qa, rows, lo, b1, 1, pg_first, pg_second, q, lane_pos,
                               table, 0, pre, pg_next, chain);
          break;
        case 2:
          decode_unit<2, true>(a, smem, r, qa, rows, lo, b1, 1, pg_first, pg_second, q, lane_pos,
                               table, 0, pre, pg_next, chain);
          break;
        case 3:
          decode_unit<3, true>(a, smem, r, qa, rows, lo, b1, 1, pg_first, pg_second, q, lane_pos,
                               table, 0, pre, pg_next, chain);
          break;
        default:
          decode_unit<4, true>(a, smem, r, qa, rows, lo, b1, 1, pg_first, pg_second, q, lane_pos,
                               table, 0, pre, pg_next, chain);
          break;
      }
      pre = chain;
    } else if (pre && s == 0) {
      cp_async_wait<0>();  // request ra's early tiles are not needed (warp-uniform)
      pre = false;
    }
    const bool last = s + 1 == m;
    if (last) timeline_mark(a, 2);
    // Every block max of request r is in its table (release / acquire at cluster scope).
    cluster_arrive_release();
    cluster_wait_acquire();
    if (last) timeline_mark(a, 3);
    seq_select_rows(a, smem, table, spos + s * kDecRows, qa, rows, K, rank);
  }
  // No CTA leaves while another may still read its tables.
  cluster_arrive_release();
  cluster_wait_acquire();
  timeline_mark(a, 4);
}

// The sequence kernel: clusters of (1, K, 1) CTAs; grid.x = overflow tiles + seq_clusters.
__global__ void __launch_bounds__(kMmaThreads, 1) score_seq_kernel(const KernelArgs a) {
  extern __shared__ __align__(kSmemAlign) uint8_t smem[];
  __shared__ OverflowShared sh;
  pdl_launch_dependents();
  if (static_cast<int>(blockIdx.x) >= a.num_overflow) {
    seq_path(a, smem);
    return;
  }
  pdl_wait();
  for_each_segment(a, [&](int r, int sa, int se) { overflow_segment(a, smem, sh, r, sa, se); });
  __threadfence();
  cluster_arrive_release();
  cluster_wait_acquire();
  finish_overflow_rows(a);
}

}  // namespace m3attn::indexer_kernel
