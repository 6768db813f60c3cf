// Dynamic decode (IndexerCudaOptions::dynamic_decode, session 22): the decode units' work taken
// from one global counter in small items, and the rows finished inside the scorer.
//
// Why: at 64 x 8K every static plan left the stream's end ragged although each warp had the same
// block count (session 21 timelines: CTAs of the flat decode end 16.1-21.4 us, of the 2-CTA single
// pass 16.8-19.0; a warp streams a block in ~1.9 us and its rate varies), and the rows were
// selected only after the last block (a cluster barrier + 0.7 us, or a selection kernel ~2.6 us
// after the scorer's last warp).
//
// Items (dyn_item): request-major. Request r has max_pages stream items (block b: score b for every
// row of r's decode unit; a no-op past the request's visible blocks) and dyn_tasks selection items
// (task j: rows j, j + dyn_tasks, ... of the unit; dyn_tasks is the host's guess of the rows per
// request, so one row each for equal-length batches). Request r's selection items come after the
// stream items of request r + dyn_lag, so that when a warp reaches one, the request's blocks are
// normally scored (dyn_lag requests of the stream lie between); the last dyn_lag requests' selection
// items end the list.
//
// Warps: every decode warp (4 per CTA after the overflow tiles, about one CTA per SM) takes items
// v, v + W, ..., v + (S - 1) W (v its index, W = dyn_warps, S = dyn_static >= 3 static slots; no
// atomic before its first tiles), then S W + c for c = atomicAdd(ctl[0], 1), the grab for a slot
// issued when the slot three before it starts (the atomic and the page-table load each have an
// item's time to return). Each processed item of a slot >= S - 3 grabs exactly once, and the host
// keeps (S - 3) W <= items, so a call makes exactly items - (S - 3) W grabs: the warp whose grab
// returns the last value made the call's last one and resets the counter to zero for the next
// call (no barrier, no exit count). Every item below `items` is processed once; a warp stops at
// its first item >= items (its later items are larger).
//
// Stream items run the decode pipeline of decode_unit across items: the warp's 8-tile ring, 7
// tiles in flight, the next item's tiles issued while the current one computes (an item that is
// not streamed issues zero-fill copies that read nothing). Per item the warp resolves its request:
// query_start, the positions and query rows at the guessed bounds [r T / R, (r + 1) T / R)
// (loaded an item ahead, reloaded when query_start disagrees). The first 8 NT rows are scored from
// the ring; rows beyond (a request with more tokens than the host's guess) and blocks whose tiles
// were not issued (seq_lens said invisible, positions say visible) are scored from global memory
// (decode_block_global; slow but exact, only for batches the guess does not fit).
//
// Block maxima go to the tagged table (KernelArgs::tagged, u64 per (row, block): the score's bits
// and the call's tag E in the high word, one 64-bit relaxed store), so a selection item needs no
// per-block fence or counter: it polls its row until every candidate carries E. E = (calls mod
// (2^23 - 1)) + 1 with calls = ctl[1] (the call count, advanced by the last grabber): in [1, 2^23),
// which no score's bits can be (every score is 0, a multiple of 2^-18, an infinity or NaN: an E4M3
// product is a multiple of 2^-18), so no stale f32 of another path's scores in the same workspace
// bytes can pass for this call's entry, and a stale tagged entry carries an earlier call's tag.
// Every warp reads ctl[1] (acquire) before its first item; the last grab happens only after every
// item below `items` was processed, so after every warp that has items read it.
// Deadlock freedom: a selection item waits only for stream items of lower index; every lower
// index belongs to a warp (static) or was grabbed, and warps process their items in increasing
// order, so the lowest unfinished item never waits. The host launches the grid only where all its
// CTAs can be resident at once (a static item's warp always gets to run).
#pragma once

#include "stages/indexer/indexer.h"
#include "stages/indexer/indexer_kernel_mma.cuh"

namespace m3attn::indexer_kernel {

// Words of the workspace's control area (KernelArgs::ctl): word 0 the call count, word 1 the
// classes done in this call; class c's grab counter at word kCtlStride (c + 1) (each on its own
// 256-byte line: the atomics of different classes go to different L2 slices). dyn_classes <=
// kMaxDynClasses.
constexpr int kCtlCalls = 0;
constexpr int kCtlClassesDone = 1;
constexpr int kCtlStride = 64;
constexpr int kMaxDynClasses = 16;
static_assert((kMaxDynClasses + 1) * kCtlStride * 4 == kIndexerControlBytes, "control area");
constexpr uint32_t kTagPeriod = (1u << 23) - 1;

__device__ __forceinline__ uint32_t ld_relaxed_u32(const unsigned* p) {
  uint32_t v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t ld_relaxed_u64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_relaxed_u64(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void st_release_u32(unsigned* p, uint32_t v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// kind 0: stream item (block j of request r), 1: selection item (task j of request r), 2: none.
struct DynItem {
  int kind, r, j;
};

// 32-bit arithmetic (a 64-bit division is a ~70-instruction routine): the host keeps the items
// and the grab values below 2^31.
__device__ __forceinline__ DynItem dyn_item(const KernelArgs& a, int64_t index) {
  if (index < 0 || index >= int64_t{a.num_requests} * (a.max_pages + a.dyn_tasks))
    return {2, 0, 0};
  uint32_t i = static_cast<uint32_t>(index);
  const uint32_t R = a.num_requests, nb = a.max_pages, tp = a.dyn_tasks, L = a.dyn_lag;
  if (i < L * nb) return {0, static_cast<int>(i / nb), static_cast<int>(i % nb)};
  i -= L * nb;
  const uint32_t slot = nb + tp;
  if (i < (R - L) * slot) {
    const uint32_t s = i / slot, o = i - s * slot;
    if (o < nb) return {0, static_cast<int>(L + s), static_cast<int>(o)};
    return {1, static_cast<int>(s), static_cast<int>(o - nb)};
  }
  i -= (R - L) * slot;
  return {1, static_cast<int>(R - L + i / tp), static_cast<int>(i % tp)};
}

// A request's metadata as loaded for an item (before query_start is checked): the raw
// query_start pair, the guessed bounds (ga, gn) of the position / query-row loads, lane l < gn's
// position of token ga + l, and (stream items) the first 8 NT rows' slices at the guess.
template <int NT>
struct DynMeta {
  int qa, qe, ga, gn, p;
  uint4 lo[NT], hi[NT];
};

// Loads of an item's metadata (nothing waits for them here). with_q: the query rows too (stream
// items; after pdl_wait when programmatic).
template <int NT>
__device__ __forceinline__ void dyn_meta_issue(const KernelArgs& a, const DynItem& it, bool with_q,
                                               DynMeta<NT>& m) {
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, tig = lane & 3;
  m.qa = m.qe = m.ga = m.gn = 0;
  m.p = -1;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) m.lo[nt] = m.hi[nt] = make_uint4(0u, 0u, 0u, 0u);
  if (it.kind == 2) return;
  const int r = it.r;
  m.qa = __ldg(a.query_start + r);
  m.qe = __ldg(a.query_start + r + 1);
  if (a.dyn_tok > 0) {  // (no 64-bit division where R divides T)
    m.ga = r * a.dyn_tok;
    m.gn = min(a.dyn_tok, a.dec_tokens);
  } else {
    m.ga = static_cast<int>(int64_t{r} * a.num_tokens / a.num_requests);
    m.gn = min(static_cast<int>(int64_t{r + 1} * a.num_tokens / a.num_requests) - m.ga,
               a.dec_tokens);
  }
  if (lane < m.gn) m.p = __ldg(a.positions + m.ga + lane);
  if (with_q) {
    const uint8_t* iq0 = a.iq + int64_t{m.ga} * a.n_kv * kRowBytes;
    const int rows = m.gn * a.n_kv;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int row = nt * 8 + g;
      if (row < rows) {
        m.lo[nt] = ld_query16(iq0 + row * kRowBytes + tig * 16);
        m.hi[nt] = ld_query16(iq0 + row * kRowBytes + 64 + tig * 16);
      }
    }
  }
}

// An item's request as the item needs it (after its metadata arrived).
template <int NT>
struct DynReq {
  int qa = 0, n = 0, rows = 0;  // the decode unit's first token, tokens (<= dec_tokens), rows
  int p = -1;                   // lane l < n: position of token qa + l
  int nvis = 0;                 // blocks to score (blocks_to_score of the largest position)
  int min_pos = 0;              // smallest position (stream items)
  DecodeState<NT> s;            // rows 0 .. 8 NT - 1 (stream items)
};

// Checks the guess against query_start (reloading at the real bounds when it was wrong) and
// prepares the item's state. stream: the query rows are converted and the columns' positions set.
template <int NT>
__device__ __forceinline__ void dyn_resolve(const KernelArgs& a, DynMeta<NT>& m, bool stream,
                                            DynReq<NT>& q) {
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, tig = lane & 3;
  const int qa = clamp_token(a, m.qa), qe = clamp_token(a, m.qe);
  const int n = max(min(qe - qa, a.dec_tokens), 0);
  if (qa != m.ga || n != m.gn) {  // warp-uniform: the guess was wrong (unequal requests)
    m.p = lane < n ? __ldg(a.positions + qa + lane) : -1;
    if (stream) {
      const uint8_t* iq0 = a.iq + int64_t{qa} * a.n_kv * kRowBytes;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int row = nt * 8 + g;
        m.lo[nt] = m.hi[nt] = make_uint4(0u, 0u, 0u, 0u);
        if (row < n * a.n_kv) {
          m.lo[nt] = ld_query16(iq0 + row * kRowBytes + tig * 16);
          m.hi[nt] = ld_query16(iq0 + row * kRowBytes + 64 + tig * 16);
        }
      }
    }
  }
  q.qa = qa;
  q.n = n;
  q.rows = n * a.n_kv;
  q.p = lane < n ? m.p : -1;
  q.nvis = n > 0 ? blocks_to_score(a, __reduce_max_sync(0xffffffffu, q.p)) : 0;
  if (!stream || q.nvis == 0) return;
  int min_pos = INT_MAX;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    slice_to_f16(m.lo[nt], m.hi[nt], q.s.q[nt]);  // rows >= rows are zero slices
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int j = nt * 8 + tig * 2 + e;  // < 16, so j / n_kv < 32
      const int pos = __shfl_sync(0xffffffffu, q.p, j / a.n_kv);
      q.s.rpos[nt][e] = j < q.rows ? pos : -1;
      if (j < q.rows) min_pos = min(min_pos, pos);
      q.s.run[nt][e] = neg_inf();
    }
  }
  q.min_pos = __reduce_min_sync(0xffffffffu, min_pos);
}

// The block maxima of rows row0 + (0 .. 8 NT) of the decode unit at token qa (rows rows) into
// the tagged table (lanes g == 0; rows >= rows are not written).
template <int NT>
__device__ __forceinline__ void dyn_flush(const KernelArgs& a, DecodeState<NT>& s, int qa,
                                          int rows, int row0, int b, bool page_ok, uint32_t tag) {
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, tig = lane & 3;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float v = s.run[nt][e];
      v = warp_block_max_xor(v, 4);
      v = warp_block_max_xor(v, 8);
      v = warp_block_max_xor(v, 16);
      const int j = row0 + nt * 8 + tig * 2 + e;
      if (g == 0 && j < rows) {
        const float val = page_ok ? v : quiet_nan();
        st_relaxed_u64(a.tagged + (int64_t{qa} * a.n_kv + j) * a.max_pages + b,
                       (uint64_t{tag} << 32) | __float_as_uint(val));
      }
      s.run[nt][e] = neg_inf();
    }
  }
}

// Block b (page `page`, inside the pool) of the item's request, rows from group g0 on (8 NT rows
// per group), scored from global memory: the rows the ring's pass did not cover (a request with
// more tokens than the guess), or every row when the block's tiles were not issued.
template <int NT>
__device__ __forceinline__ void decode_block_global(const KernelArgs& a, int qa, int rows,
                                                 int lane_pos, int64_t page, int b, int g0,
                                                 uint32_t tag) {
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, tig = lane & 3;
  const uint8_t* base = page_base(a, page);
  const uint8_t* iq0 = a.iq + int64_t{qa} * a.n_kv * kRowBytes;
  for (int row0 = g0 * 8 * NT; row0 < rows; row0 += 8 * NT) {
    DecodeState<NT> s;
    int min_pos = INT_MAX;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int row = row0 + nt * 8 + g;
      uint4 lo = make_uint4(0u, 0u, 0u, 0u), hi = lo;
      if (row < rows) {
        lo = ld_query16(iq0 + row * kRowBytes + tig * 16);
        hi = ld_query16(iq0 + row * kRowBytes + 64 + tig * 16);
      }
      slice_to_f16(lo, hi, s.q[nt]);
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int j = row0 + nt * 8 + tig * 2 + e;  // < 32 (dec_tokens * n_kv <= kDecRows)
        const int pos = __shfl_sync(0xffffffffu, lane_pos, min(j, kDecRows - 1) / a.n_kv);
        s.rpos[nt][e] = j < rows ? pos : -1;
        if (j < rows) min_pos = min(min_pos, pos);
        s.run[nt][e] = neg_inf();
      }
    }
    min_pos = __reduce_min_sync(0xffffffffu, min_pos);
    const bool mask = b * kPageSize + kPageSize - 1 > min_pos;
#pragma unroll 1
    for (int t = 0; t < kPageSize / 16; ++t) {
      const uint8_t* r0 = base + t * kTileBytes + g * kRowBytes;
      const uint8_t* r1 = r0 + 8 * kRowBytes;
      const uint4 lo0 = ld_query16(r0 + tig * 16), hi0 = ld_query16(r0 + 64 + tig * 16);
      const uint4 lo1 = ld_query16(r1 + tig * 16), hi1 = ld_query16(r1 + 64 + tig * 16);
      decode_compute_slices<NT>(s, lo0, hi0, lo1, hi1, b * kPageSize + t * 16, mask, g);
    }
    dyn_flush<NT>(a, s, qa, rows, row0, b, true, tag);
  }
}

// Selection item: rows task, task + dyn_tasks, ... of the decode unit at token qa (rows rows,
// lane l's position lane_pos), each from its tagged row once
// every candidate carries this call's tag (polled), ranked by rank_lean in `srow` (64 floats of
// the warp's ring that no copy targets between items).
__device__ __forceinline__ void dyn_select(const KernelArgs& a, int qa, int rows, int lane_pos,
                                        int task, uint32_t tag, float* srow, uint32_t& polls) {
  const int lane = threadIdx.x & 31;
  for (int j = task; j < rows; j += a.dyn_tasks) {  // warp-uniform
    const int pos = __shfl_sync(0xffffffffu, lane_pos, j / a.n_kv);  // j / n_kv < 32
    int32_t* out = a.block_ids + (int64_t{qa} * a.n_kv + j) * kTopK;
    const int local = trivial_row(a, out, pos, true);
    if (local < 0) continue;
    const int nb = local;  // candidates 0 .. local - 1 (< max_pages <= 64)
    const uint64_t* row = a.tagged + (int64_t{qa} * a.n_kv + j) * a.max_pages;
    uint64_t e0 = lane < nb ? ld_relaxed_u64(row + lane) : 0;
    uint64_t e1 = lane + 32 < nb ? ld_relaxed_u64(row + lane + 32) : 0;
    for (;;) {
      const bool ok0 = lane >= nb || static_cast<uint32_t>(e0 >> 32) == tag;
      const bool ok1 = lane + 32 >= nb || static_cast<uint32_t>(e1 >> 32) == tag;
      if (__all_sync(0xffffffffu, ok0 && ok1)) break;
      ++polls;
      __nanosleep(64);
      if (!ok0) e0 = ld_relaxed_u64(row + lane);
      if (!ok1) e1 = ld_relaxed_u64(row + lane + 32);
    }
    const float s0 = lane < nb ? __uint_as_float(static_cast<uint32_t>(e0)) : quiet_nan();
    const float s1 = lane + 32 < nb ? __uint_as_float(static_cast<uint32_t>(e1)) : quiet_nan();
    int r0 = 0, r1 = 0;
    if (nb > kTopK - 1) {
      srow[lane] = s0;
      srow[lane + 32] = s1;
      __syncwarp();
      rank_lean(srow, s0, s1, r0, r1);
    }
    emit_ranked_row(out, s0, s1, r0, r1, local);
    __syncwarp();  // srow is rewritten by the next row
  }
}

// Page of a stream item's block (guarded: -1 outside the pool); raw: the page-table entry.
__device__ __forceinline__ int32_t dyn_guard(const KernelArgs& a, int32_t raw) {
  return (raw >= 0 && int64_t{raw} < a.num_pages) ? raw : int32_t{-1};
}
__device__ __forceinline__ int32_t dyn_raw_page(const KernelArgs& a, const DynItem& it) {
  return it.kind == 0 ? __ldg(a.page_table + int64_t{it.r} * a.pt_stride + it.j) : -1;
}
__device__ __forceinline__ int dyn_seq_len(const KernelArgs& a, const DynItem& it) {
  return it.kind == 0 ? __ldg(a.seq_lens + it.r) : 0;
}
// Whether an item's tiles are issued: a stream item whose block seq_lens shows visible, on a page
// inside the pool.
__device__ __forceinline__ bool dyn_issue(const KernelArgs& a, const DynItem& it, int32_t pg,
                                          int seq_len) {
  return it.kind == 0 && pg >= 0 && it.j < blocks_to_score(a, seq_len - 1);
}

template <int NT>
__device__ __forceinline__ void dynamic_decode_warp(const KernelArgs& a, uint8_t* smem) {
  timeline_mark(a, 0);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2, tig = lane & 3;
  // The warp's class: items i = K j + cls (class-local j) and warps w = K u + cls (class-local
  // u) form an independent instance of the scheme with its own counter.
  const int K = a.dyn_classes;
  const int64_t w_all = (int64_t{blockIdx.x} - a.num_overflow) * kMmaWarps + warp;
  const int cls = static_cast<int>(w_all % K);
  const int64_t v = w_all / K;
  const int64_t W = (int64_t{a.dyn_warps} - cls + K - 1) / K;
  const int64_t items =
      (int64_t{a.num_requests} * (a.max_pages + a.dyn_tasks) - cls + K - 1) / K;
  unsigned* const counter = a.ctl + (cls + 1) * kCtlStride;
  // Class-local item j -> its item.
  const auto item_at = [&](int64_t j) { return dyn_item(a, j < items ? j * K + cls : -1); };
  uint8_t* ring = smem + warp * (kDecStages * kTileBytes);
  const uint32_t ring_dst = smem_addr(ring) + lane_dst_offset(lane);
  float* srow = reinterpret_cast<float*>(ring + (kDecStages - 1) * kTileBytes);

  // Slots k (it), k + 1 (it1), k + 2 (it2): slot k < S holds item v + k W, slot k >= S item
  // S W + c (c the grab issued when slot k - 3 started).
  const int64_t S = a.dyn_static;
  const int64_t last_grab = items - (S - 3) * W - 1;
  DynItem it = item_at(v), it1 = item_at(v + W), it2 = item_at(v + 2 * W);
  DynMeta<NT> m0, m1;
  dyn_meta_issue<NT>(a, it, !a.pdl && it.kind == 0, m0);
  dyn_meta_issue<NT>(a, it1, !a.pdl && it1.kind == 0, m1);
  const int32_t raw0 = dyn_raw_page(a, it), raw1 = dyn_raw_page(a, it1);
  int32_t raw2 = dyn_raw_page(a, it2);
  const int sl0 = dyn_seq_len(a, it), sl1 = dyn_seq_len(a, it1);
  int sl2 = dyn_seq_len(a, it2);
  int32_t pg = dyn_guard(a, raw0);
  bool iss = dyn_issue(a, it, pg, sl0);
  // Programmatic launch: only blocks that end before the request's first new position (rows no
  // kernel of this step writes) are read before pdl_wait.
  const bool early =
      iss && (!a.pdl || (it.j + 1) * kPageSize <=
                            sl0 - max(clamp_token(a, m0.qe) - clamp_token(a, m0.qa), 0));
  const auto prologue = [&] {
    const uint8_t* src = (iss ? page_base(a, pg) : a.cache) + lane * 16;
    const uint32_t bytes = iss ? 16u : 0u;
    static_for<0, kDecStages - 1>([&](auto tc) {
      issue_tile_at<decltype(tc)::value>(ring_dst, src, bytes);
      cp_async_commit();
    });
  };
  // This call's tag, read before any grab of this warp: a relaxed load whose value the first
  // item's flush or selection consumes before the warp's first grab is issued (at S = 3 the grab
  // for slot 3 waits for the end of slot 0), and an SM issues a warp's instructions in order.
  // (An acquire load's L1 invalidation, CCTL.IVALL, stalled every warp ~1.9 us at the start:
  // round D ncu.)
  uint32_t calls = a.pdl ? 0u : ld_relaxed_u32(a.ctl + kCtlCalls);
  DynReq<NT> q;
  // Without programmatic launch the first item's request is resolved before the prologue's
  // copies: its metadata would otherwise queue behind every warp's first tiles (round F: ready
  // 7-8 us after entry at two CTAs per SM).
  if (!a.pdl) dyn_resolve<NT>(a, m0, it.kind == 0, q);
  if (early) prologue();
  pdl_wait();
  if (a.pdl) calls = ld_relaxed_u32(a.ctl + kCtlCalls);
  if (!early) prologue();
  if (a.pdl) {  // index_q only after the wait
    dyn_meta_issue<NT>(a, it, it.kind == 0, m0);
    dyn_meta_issue<NT>(a, it1, it1.kind == 0, m1);
    dyn_resolve<NT>(a, m0, it.kind == 0, q);
  }
  const uint32_t tag = calls % kTagPeriod + 1;
  unsigned grab = 0;  // lane 0: the grab for slot k + 3
  int64_t k = 0;      // the current slot
  int32_t pg1 = dyn_guard(a, raw1);
  bool iss1 = dyn_issue(a, it1, pg1, sl1);
  uint32_t polls = 0;  // selection polls that found the row incomplete (timeline word 18)
  bool last = false;   // lane 0: this warp made its class's last grab
  unsigned ticket = 0;  // ... and its class's place among the classes done
  timeline_mark(a, 1);

  while (it.kind != 2) {  // warp-uniform
    const bool stream = it.kind == 0 && it.j < q.nvis;
    const bool ring_pass = stream && iss;
    const bool mask = it.j * kPageSize + kPageSize - 1 > q.min_pos;
    const uint8_t* src_k = (iss ? page_base(a, pg) : a.cache) + lane * 16;
    const uint8_t* src_k1 = (iss1 ? page_base(a, pg1) : a.cache) + lane * 16;
    const uint32_t bytes_k = iss ? 16u : 0u, bytes_k1 = iss1 ? 16u : 0u;
    static_for<0, 8>([&](auto tc) {
      constexpr int kT = decltype(tc)::value;
      cp_async_wait<kDecStages - 2>();
      __syncwarp();  // tile kT landed for every lane; the previous tile's stage is free
      if constexpr (kT == 0)
        issue_tile_at<7>(ring_dst, src_k, bytes_k);
      else
        issue_tile_at<kT - 1>(ring_dst, src_k1, bytes_k1);
      cp_async_commit();
      if (ring_pass)
        decode_compute_tile<NT>(q.s, ring + kT * kTileBytes, it.j * kPageSize + kT * 16, mask, g,
                                tig);
    });
    if (stream) {
      if (pg < 0) {
        // Page outside the pool: the block scores NaN for every row.
        for (int row0 = 0; row0 < q.rows; row0 += 8 * NT)
          dyn_flush<NT>(a, q.s, q.qa, q.rows, row0, it.j, false, tag);
      } else if (ring_pass) {
        dyn_flush<NT>(a, q.s, q.qa, q.rows, 0, it.j, true, tag);
        if (q.rows > 8 * NT) decode_block_global<NT>(a, q.qa, q.rows, q.p, pg, it.j, 1, tag);
      } else {
        decode_block_global<NT>(a, q.qa, q.rows, q.p, pg, it.j, 0, tag);
      }
      timeline_mark(a, 2);
    } else if (it.kind == 1) {
      dyn_select(a, q.qa, q.rows, q.p, it.j, tag, srow, polls);
    }
    // Every processed item of a slot >= S - 3 grabs once (S W <= items, or S == 3), so a call
    // makes exactly items - (S - 3) W grabs: the grab returning the last of them is the call's
    // last, and its warp resets the counter and counts the call (no grab of this call follows).
    const bool grabbed = k + 3 >= S;
    if (S == 3 && k == 0 && lane == 0) grab = atomicAdd(counter, 1u);  // (see the tag's load)
    const unsigned c = __shfl_sync(0xffffffffu, grab, 0);
    if (lane == 0 && grabbed && static_cast<int64_t>(c) == last_grab) {
      // The class's grabs are done: its ticket among the classes (read at the warp's exit).
      last = true;
      ticket = atomicAdd(a.ctl + kCtlClassesDone, 1u);
    }
    // Rotate: k + 1 becomes current (its metadata arrived during this item), k + 2's page and
    // metadata, k + 3 from the grab.
    it = it1;
    pg = pg1;
    iss = iss1;
    dyn_resolve<NT>(a, m1, it.kind == 0, q);
    it1 = it2;
    pg1 = dyn_guard(a, raw2);
    iss1 = dyn_issue(a, it1, pg1, sl2);
    dyn_meta_issue<NT>(a, it1, it1.kind == 0, m1);
    it2 = item_at(grabbed ? S * W + static_cast<int64_t>(c) : v + (k + 3) * W);
    raw2 = dyn_raw_page(a, it2);
    sl2 = dyn_seq_len(a, it2);
    ++k;
    if (lane == 0 && it.kind != 2 && k + 3 >= S) grab = atomicAdd(counter, 1u);
  }
  cp_async_wait<0>();  // no copy may outlive the CTA (zero-fill copies of items past the end)
  if (last) {
    // The class's counter back to zero; the last class done counts the call (release: after
    // the grabs, so no warp of this call reads the new count). At the exit: nothing is in
    // flight that a release would wait for.
    st_release_u32(counter, 0u);
    if (ticket == static_cast<unsigned>(K - 1)) {
      st_release_u32(a.ctl + kCtlClassesDone, 0u);
      st_release_u32(a.ctl + kCtlCalls, calls + 1u);
    }
  }
  timeline_value(a, 18, polls);
  timeline_mark(a, 4);
}

// Dynamic decode's scorer (grid.x = num_overflow + dyn_warps / 4, grid.y 1): overflow tiles as
// the single pass's (block scores, then their rows after a CTA barrier), decode warps as above.
// NT: n-tiles of query rows scored from the ring (8 NT rows; the host's guess of the rows per
// request). Launch bounds of one CTA per SM: without them ptxas held the NT = 1 kernel to 168
// registers and spilled; with them 194 / 212 registers (NT 1 / 2), still two CTAs per SM (the
// host's residency rule).
template <int NT>
__global__ void __launch_bounds__(kMmaThreads, 1) score_dynamic_kernel(const KernelArgs a) {
  extern __shared__ __align__(kSmemAlign) uint8_t smem[];
  __shared__ OverflowShared sh;
  pdl_launch_dependents();
  if (static_cast<int>(blockIdx.x) >= a.num_overflow) {
    dynamic_decode_warp<NT>(a, smem);
    return;
  }
  pdl_wait();
  for_each_segment(a, [&](int r, int sa, int se) { overflow_segment(a, smem, sh, r, sa, se); });
  __syncthreads();  // the tile's block scores are written
  finish_overflow_rows(a);
}

}  // namespace m3attn::indexer_kernel
