// Balanced decode scorer (IndexerCudaOptions::balanced, opt-in): the decode units' index-K blocks
// handed out one at a time to every warp of a persistent grid, so that the SMs that stream faster
// take more blocks (session 14 timeline at 64 x 8K draft 0, static shares of one CTA per SM: the
// CTAs doing equal work finished 2-4 us apart, about a quarter of the call).
//
// Work items: item i = block i % max_pages of request i / max_pages (R * max_pages items, host
// known). Warp w of the decode grid (W warps: grid.x - num_overflow CTAs of 4 warps) takes items w,
// w + W and w + 2 W, then grabs one more item per finished item from a counter in the workspace
// (atomicAdd; the value v stands for item 3 W + v) until the items run out. Each item is one 16 KB
// page streamed as 8 tiles through the warp's 8-stage cp.async ring exactly as decode_unit does,
// with the query rows of the item's request (rows = tokens x heads <= 8 NT, NT = 1 or 2 n-tiles
// chosen by the host from T / R; a request's later tokens are left to the overflow tiles through
// KernelArgs::dec_tokens) converted when the item becomes current. The block max of every row goes
// to the workspace scores (the two-kernel layout) and select_kernel picks the 16 ids, so the ids
// are those of the two-kernel path by construction (a block max does not depend on who computed
// it).
//
// Pipeline per warp (items C = computed now, N = its tiles issued during C, F = fetched, T = the
// ticket): when C ends, N becomes current (its query rows converted, its exact visible blocks
// from its positions), F becomes N (page guarded; positions and query rows reloaded when the guess
// was wrong), the ticket taken one item earlier becomes F (its page-table entry, seq_lens,
// query_start and, at the guessed bounds of an equal-length batch (r T / R), its positions and
// query rows loaded), and a new ticket is taken (lane 0 atomicAdd). Every load thus has one item's
// time (about one loaded memory latency) to land. Session 15 round A had the ticket read and F
// loaded in the middle of C, a stall on every item: 64 x 8K draft 0 26.0-30.8 us vs 23.6 for the
// cluster single pass. An item whose block is
// not visible by seq_lens, or whose page is outside the pool, reads nothing (zero-fill copies) and
// computes nothing; its block scores NaN when the exact positions make it visible (contract
// broken), else nothing is written. Items past the end (id >= items) are empty.
//
// Counter: a 32-bit word after the candidate lists in the workspace. It must be 0 when the scorer
// starts: run_indexer_cuda clears it with a memset node before the scorer unless the caller says
// it kept the workspace as the previous call left it (IndexerCudaOptions::counters_preserved);
// select_kernel (after the scorer completed) sets it back to 0 either way.
#pragma once

#include <climits>
#include <type_traits>

#include "stages/indexer/indexer_kernel_common.cuh"
#include "stages/indexer/indexer_kernel_mma.cuh"
#include "stages/indexer/indexer_kernel_select.cuh"

namespace m3attn::indexer_kernel {

// Query slices of one item's rows as loaded (E4M3, see load_query_raw), NT n-tiles.
template <int NT>
struct BalancedRaw {
  uint4 lo[NT], hi[NT];
};

template <int NT>
__device__ __forceinline__ void load_query_nt(const KernelArgs& a, int t0, int rows,
                                              BalancedRaw<NT>& q) {
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, tig = lane & 3;
  const uint8_t* iq0 = a.iq + int64_t{t0} * a.n_kv * kRowBytes;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int row = nt * 8 + g;
    q.lo[nt] = q.hi[nt] = make_uint4(0u, 0u, 0u, 0u);
    if (row < rows) {
      q.lo[nt] = ld_query16(iq0 + row * kRowBytes + tig * 16);
      q.hi[nt] = ld_query16(iq0 + row * kRowBytes + 64 + tig * 16);
    }
  }
}

// An item fetched (loads issued, not yet used): its request r (< 0: none), block b, the raw
// page-table entry, seq_lens[r], query_start[r], [r + 1], and the guessed token range [ga, ga + gn)
// with its positions (lane l < gn) and query rows.
template <int NT>
struct FetchedItem {
  int r, b, raw_page, seq_len, qs0, qs1, ga, gn, pos;
  BalancedRaw<NT> q;
};

// An item resolved (its tiles may be issued): page (-1: read nothing), token range [qa, qa + n),
// positions (lane l < n) and query rows exact.
template <int NT>
struct ReadyItem {
  int r, b, page, qa, n, pos;
  BalancedRaw<NT> q;
};

template <int NT>
__device__ __forceinline__ void fetch_item(const KernelArgs& a, int id, FetchedItem<NT>& f) {
  const int lane = threadIdx.x & 31;
  const bool in = id >= 0 && id < a.items;
  f.r = in ? id / a.max_pages : -1;
  f.b = in ? id % a.max_pages : 0;
  f.raw_page = -1;
  f.seq_len = 0;
  f.qs0 = f.qs1 = f.ga = f.gn = 0;
  f.pos = -1;
  if (f.r < 0) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) f.q.lo[nt] = f.q.hi[nt] = make_uint4(0u, 0u, 0u, 0u);
    return;
  }
  f.raw_page = __ldg(a.page_table + int64_t{f.r} * a.pt_stride + f.b);
  f.seq_len = __ldg(a.seq_lens + f.r);
  f.qs0 = __ldg(a.query_start + f.r);
  f.qs1 = __ldg(a.query_start + f.r + 1);
  f.ga = static_cast<int>(int64_t{f.r} * a.num_tokens / a.num_requests);
  f.gn = a.guess ? min(static_cast<int>(int64_t{f.r + 1} * a.num_tokens / a.num_requests) - f.ga,
                       a.dec_tokens)
                 : 0;
  f.pos = lane < f.gn ? __ldg(a.positions + f.ga + lane) : -1;
  load_query_nt<NT>(a, f.ga, f.gn * a.n_kv, f.q);
}

template <int NT>
__device__ __forceinline__ void resolve_item(const KernelArgs& a, const FetchedItem<NT>& f,
                                             ReadyItem<NT>& n) {
  const int lane = threadIdx.x & 31;
  n.r = f.r;
  n.b = f.b;
  n.page = -1;
  n.qa = clamp_token(a, f.qs0);
  n.n = max(min(clamp_token(a, f.qs1) - n.qa, a.dec_tokens), 0);
  n.pos = f.pos;
  n.q = f.q;
  if (f.r < 0) {
    n.n = 0;
    return;
  }
  if (!(a.guess && n.qa == f.ga && n.n == f.gn)) {
    n.pos = lane < n.n ? __ldg(a.positions + n.qa + lane) : -1;
    load_query_nt<NT>(a, n.qa, n.n * a.n_kv, n.q);
  }
  // seq_lens bounds what is read; the positions decide what is scored (a block beyond seq_lens
  // that the positions make visible scores NaN).
  const bool seq_visible = f.b < min(blocks_to_score(a, f.seq_len - 1), a.max_pages);
  const bool in_pool = f.raw_page >= 0 && int64_t{f.raw_page} < a.num_pages;
  n.page = seq_visible && in_pool ? f.raw_page : -1;
}

// The current item's state for decode_compute_tile / decode_flush: query fragments, row
// positions, the smallest position, rows, the exact visibility of its block.
template <int NT>
__device__ __forceinline__ void make_current(const KernelArgs& a, const ReadyItem<NT>& c,
                                             DecodeState<NT>& s, int& min_pos, int& rows,
                                             bool& visible) {
  const int lane = threadIdx.x & 31;
  const int tig = lane & 3;
  rows = c.n * a.n_kv;  // <= 8 NT
  min_pos = INT_MAX;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    slice_to_f16(c.q.lo[nt], c.q.hi[nt], s.q[nt]);
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int j = nt * 8 + tig * 2 + e;  // < 16, so j / n_kv < 32
      const int pos = __shfl_sync(0xffffffffu, c.pos, j / a.n_kv);
      s.rpos[nt][e] = j < rows ? pos : -1;
      if (j < rows) min_pos = min(min_pos, pos);
      s.run[nt][e] = neg_inf();
    }
  }
  min_pos = __reduce_min_sync(0xffffffffu, min_pos);
  const int nvis = c.n > 0 ? blocks_to_score(a, __reduce_max_sync(0xffffffffu, c.pos)) : 0;
  visible = c.r >= 0 && c.b < nvis;
}

template <int NT>
__device__ __forceinline__ void balanced_decode(const KernelArgs& a, uint8_t* smem) {
  timeline_mark(a, 0);
  pdl_wait();  // programmatic launch: nothing is read or written before the previous grid ends
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2, tig = lane & 3;
  const int warps = (static_cast<int>(gridDim.x) - a.num_overflow) * kMmaWarps;
  const int w = (static_cast<int>(blockIdx.x) - a.num_overflow) * kMmaWarps + warp;
  uint8_t* ring = smem + warp * (kDecStages * kTileBytes);
  const uint32_t ring_dst = smem_addr(ring) + lane_dst_offset(lane);

  // The first three items are static (w, w + W, w + 2 W): no counter round trip before the first
  // bytes; ticket v of the counter stands for item 3 W + v.
  FetchedItem<NT> f;
  ReadyItem<NT> cur, nxt;
  {
    FetchedItem<NT> f0, f1;
    fetch_item<NT>(a, w, f0);
    fetch_item<NT>(a, w + warps, f1);
    fetch_item<NT>(a, w + 2 * warps, f);
    resolve_item<NT>(a, f0, cur);
    const uint8_t* src = (cur.page >= 0 ? page_base(a, cur.page) : a.cache) + lane * 16;
    const uint32_t bytes = cur.page >= 0 ? 16u : 0u;
    static_for<0, kDecStages - 1>([&](auto tc) {
      issue_tile_at<decltype(tc)::value>(ring_dst, src, bytes);
      cp_async_commit();
    });
    resolve_item<NT>(a, f1, nxt);
  }
  bool more = f.r >= 0;  // ids grow: once one is past the end, so are all later ones
  uint32_t ticket = 0;
  if (more && lane == 0) ticket = atomicAdd(a.counter, 1u);

  DecodeState<NT> s;
  int min_pos = INT_MAX, rows = 0;
  bool visible = false;
  make_current<NT>(a, cur, s, min_pos, rows, visible);
  timeline_mark(a, 1);

  // Each step of the pipeline has a whole item's time (about one loaded memory latency) to land:
  // the ticket taken when C became current is read when C ends, F's loads issued then are used
  // when F becomes N one item later, N's exact rows (a wrong guess) when N becomes C.
  while (cur.r >= 0) {
    const int b = cur.b;
    const bool compute = cur.page >= 0;
    const bool mask = b * kPageSize + kPageSize - 1 > min_pos;
    const uint8_t* src_c = (cur.page >= 0 ? page_base(a, cur.page) : a.cache) + lane * 16;
    const uint8_t* src_n = (nxt.page >= 0 ? page_base(a, nxt.page) : a.cache) + lane * 16;
    const uint32_t bytes_c = cur.page >= 0 ? 16u : 0u, bytes_n = nxt.page >= 0 ? 16u : 0u;
    static_for<0, 8>([&](auto tc) {
      constexpr int kT = decltype(tc)::value;
      cp_async_wait<kDecStages - 2>();
      __syncwarp();  // tile kT landed for every lane; the previous tile's stage is free
      if constexpr (kT == 0)
        issue_tile_at<7>(ring_dst, src_c, bytes_c);
      else
        issue_tile_at<kT - 1>(ring_dst, src_n, bytes_n);
      cp_async_commit();
      if (compute)
        decode_compute_tile<NT>(s, ring + kT * kTileBytes, b * kPageSize + kT * 16, mask, g, tig);
    });
    if (visible) {
      decode_flush<NT, false>(s, a, cur.qa, rows, b, compute, g, tig, nullptr, 0);
    } else {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) s.run[nt][0] = s.run[nt][1] = neg_inf();
    }
    cur = nxt;
    resolve_item<NT>(a, f, nxt);
    const int id =
        more ? 3 * warps + static_cast<int>(__shfl_sync(0xffffffffu, ticket, 0)) : a.items;
    fetch_item<NT>(a, id, f);
    more = more && f.r >= 0;
    if (more && lane == 0) ticket = atomicAdd(a.counter, 1u);
    make_current<NT>(a, cur, s, min_pos, rows, visible);
  }
  cp_async_wait<0>();
  timeline_mark(a, 2);
  timeline_mark(a, 3);
  timeline_mark(a, 4);
}

// The balanced scorer: overflow tiles (x < num_overflow) as score_mma_kernel (grid.y == 1), the
// other CTAs run balanced_decode. Dynamic shared memory: kMmaSmemBytes.
template <int NT>
__global__ void __launch_bounds__(kMmaThreads) score_balanced_kernel(const KernelArgs a) {
  extern __shared__ __align__(kSmemAlign) uint8_t smem[];
  __shared__ OverflowShared sh;
  pdl_launch_dependents();
  if (static_cast<int>(blockIdx.x) >= a.num_overflow) {
    balanced_decode<NT>(a, smem);
    return;
  }
  pdl_wait();
  for_each_segment(a, [&](int r, int sa, int se) { overflow_segment(a, smem, sh, r, sa, se); });
}

}  // namespace m3attn::indexer_kernel
