// Scheduler warp of the warp-specialised prefill kernel (attention_prefill_ws.cuh): finds each work
// item's tile, builds the union of its tokens' selected blocks (sparse) or the block range (dense),
// and feeds the ring: per entry a header and the TMA loads of K, V (and Q with an item's first
// entry); items without any block get their zero output here.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "stages/attention/attention_prefill_ws_common.cuh"

namespace m3attn {
namespace attention_prefill_ws {

// ak::find_tile for one warp (8-token tiles): request r, first token t0, tokens nt of `tile`.
__device__ __forceinline__ bool find_tile_warp(const AttnArgs& a, int tile, int& r_out, int& t0,
                                               int& nt) {
  const int lane = threadIdx.x & 31;
  int carry = 0;
  for (int base = 0; base < a.R; base += 32) {
    const int r = base + lane;
    int lo = 0, hi = 0, cnt = 0;
    if (r < a.R) {
      lo = min(max(a.query_start[r], 0), a.T);
      hi = min(max(a.query_start[r + 1], 0), a.T);
      cnt = hi > lo ? (hi - lo + kQT - 1) / kQT : 0;
    }
    int incl = cnt;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int n = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += n;
    }
    const int excl = incl - cnt;
    const bool hit = cnt > 0 && tile >= carry + excl && tile < carry + incl;
    const unsigned bal = __ballot_sync(0xffffffffu, hit);
    if (bal) {
      const int src = __ffs(bal) - 1;
      const int start = lo + (tile - carry - excl) * kQT;
      r_out = base + src;
      t0 = __shfl_sync(0xffffffffu, start, src);
      nt = min(kQT, __shfl_sync(0xffffffffu, hi, src) - t0);
      return true;
    }
    carry += __shfl_sync(0xffffffffu, incl, 31);
  }
  return false;
}

// Candidate c (token c / 16, id c % 16) of the tile with the wgmma kernel's rules: ids outside
// [0, pos / 128], past the page table or with an invalid page select nothing (b = -1). Warp-wide
// (shuffles the token's position from lane c / 16).
__device__ __forceinline__ void load_candidate(const AttnArgs& a, int64_t pt_row, int t0, int nt,
                                               int g, int mypos, int c, int& b, int& page) {
  const int w = c / ak::kTopKIds;
  const int pw = __shfl_sync(0xffffffffu, mypos, w & 7);
  b = -1;
  page = -1;
  if (w < nt) {
    b = a.block_ids[static_cast<int64_t>(t0 + w) * a.bid_stride_t +
                    static_cast<int64_t>(g) * a.bid_stride_h + c % ak::kTopKIds];
    if (b >= 0 && b <= (pw >> 7) && b < a.max_pages) {
      page = a.page_table[pt_row + b];
      if (page < 0 || page >= a.num_pages) b = -1;
    } else {
      b = -1;
    }
  }
}

// Union of the tile's selected blocks (repeats count once) as list entries (block, page, mask of
// the tokens that selected it), by repeated minimum extraction, in ascending block order: each lane
// keeps its 4 candidates in registers (unusable ones as 0xFFFFFFFF); per distinct block one warp
// minimum (redux.sync), one ballot per candidate group (group k = tokens 2k, 2k + 1 in lanes 0-15,
// 16-31) and the hits retired. About 25 instructions per distinct block (session 12: an all-pairs
// compare, 128 x 4 compares per lane, ~2.6 K dependent instructions per work item, kept the
// scheduler warp from issuing entries for longer than the ring lasts). Returns the entry count.
__device__ __forceinline__ int build_sparse_list(const AttnArgs& a, Item& it, int64_t pt_row,
                                                 int t0, int nt, int g, int mypos) {
  const int lane = threadIdx.x & 31;
  uint32_t key[kCand / 32];
  int page[kCand / 32];
#pragma unroll
  for (int k = 0; k < kCand / 32; ++k) {
    int b, pg;
    load_candidate(a, pt_row, t0, nt, g, mypos, lane + 32 * k, b, pg);
    key[k] = b >= 0 ? static_cast<uint32_t>(b) : 0xFFFFFFFFu;
    page[k] = pg;
  }
  static_assert(kCand / 32 == 4 && ak::kTopKIds == 16, "candidate group k = tokens 2k, 2k + 1");
  int n = 0;
  for (;;) {
    const uint32_t mn =
        __reduce_min_sync(0xffffffffu, min(min(key[0], key[1]), min(key[2], key[3])));
    if (mn == 0xFFFFFFFFu) break;
    int mask = 0, pg = 0;
    unsigned any = 0;
#pragma unroll
    for (int k = 0; k < kCand / 32; ++k) {
      const bool hit = key[k] == mn;
      const unsigned bal = __ballot_sync(0xffffffffu, hit);
      mask |= ((bal & 0xFFFFu) != 0 ? 1 : 0) << (2 * k);
      mask |= ((bal >> 16) != 0 ? 1 : 0) << (2 * k + 1);
      any |= bal;
      if (hit) {
        key[k] = 0xFFFFFFFFu;
        pg = page[k];  // every candidate of one block has the same page
      }
    }
    pg = __shfl_sync(0xffffffffu, pg, __ffs(any) - 1);
    if (lane == 0) {
      it.list_b[n] = static_cast<int>(mn);
      it.list_page[n] = pg;
      it.list_mask[n] = mask;
    }
    ++n;
  }
  __syncwarp();
  return n;
}

// Zero output rows (or an empty split partial) of a work item that has no entry.
__device__ __forceinline__ void write_empty_item(const AttnArgs& a, int t0, int nt, int g,
                                                 int split) {
  const int lane = threadIdx.x & 31;
  for (int w = 0; w < nt; ++w) {
    const int64_t t = t0 + w;
    for (int h = 0; h < a.group; ++h) {
      if (a.splits == 1) {
        uint16_t* orow =
            a.out + t * a.out_stride + static_cast<int64_t>(g * a.group + h) * ak::kDim;
        *reinterpret_cast<uint2*>(orow + 4 * lane) = make_uint2(0u, 0u);
      } else {
        const int64_t slot = (t * a.n_kv + g) * a.splits + split;
        float* orow = a.ws_o + (slot * ak::kRows + h) * ak::kDim;
        *reinterpret_cast<float4*>(orow + 4 * lane) = make_float4(0.f, 0.f, 0.f, 0.f);
        if (lane == 0) {
          a.ws_ml[(slot * ak::kRows + h) * 2] = -INFINITY;
          a.ws_ml[(slot * ak::kRows + h) * 2 + 1] = 0.0f;
        }
      }
    }
  }
}

struct Pending {
  int b, page, mask, vlim, flags;
};

// Prepares work item w into `it` (tile, positions, sparse union, split range). False when the
// tile does not exist (the grid bound exceeds the batch's tiles). Warp-uniform.
__device__ __forceinline__ bool prepare_item(const AttnArgs& a, Item& it, int w) {
  const int lane = threadIdx.x & 31;
  // `it` held the item before the previous one: every lane's reads of it (lane 0's header
  // computation in issue(), the lanes' list reads) come before these writes in program order, but
  // racecheck orders the lanes of a warp only through a barrier (session 13 round B: 2 hazard
  // warnings, it.pos written here vs read in issue(), with one persistent CTA and 2 splits).
  __syncwarp();
  const int split = w % a.splits;
  const int tile = w / a.splits / a.n_kv;
  const int g = (w / a.splits) % a.n_kv;
  int r = -1, t0 = 0, nt = 0;
  if (!find_tile_warp(a, tile, r, t0, nt)) return false;
  const int mypos = lane < nt ? a.positions[t0 + lane] : -1;
  if (lane < kQT) it.pos[lane] = mypos;
  const int64_t pt_row = static_cast<int64_t>(r) * a.pt_stride;
  int n_total = 0;
  if (a.sparse) {
    n_total = build_sparse_list(a, it, pt_row, t0, nt, g, mypos);
  } else {
    int maxpos = mypos;
#pragma unroll
    for (int o = 4; o > 0; o >>= 1) maxpos = max(maxpos, __shfl_xor_sync(0xffffffffu, maxpos, o));
    maxpos = __shfl_sync(0xffffffffu, maxpos, 0);
    n_total = maxpos >= 0 ? min((maxpos >> 7) + 1, a.max_pages) : 0;
  }
  const int per = (n_total + a.splits - 1) / a.splits;
  if (lane == 0) {
    it.t0 = t0;
    it.nt = nt;
    it.g = g;
    it.split = split;
    it.lo = min(n_total, split * per);
    it.hi = min(n_total, it.lo + per);
    it.pt_row = pt_row;
  }
  __syncwarp();
  return true;
}

// The next work item is prepared right after the current item's first entry is issued (its
// global loads and union overlap the ring's entries of work).
__device__ __forceinline__ void scheduler_warp(const AttnArgs& a, const CUtensorMap* kmap,
                                               const CUtensorMap* vmap, const CUtensorMap* qmap,
                                               int tiles, Shared& sh, uint32_t base) {
  const int lane = threadIdx.x & 31;
  const int n_work = tiles * a.n_kv * a.splits;
  const int step = static_cast<int>(gridDim.x);
  uint32_t j = 0;   // entries issued (ring position)
  uint32_t qi = 0;  // items that loaded a Q tile

  // Issues entry e of item `it` (lane 0): header, Q (first entry), K and V tiles.
  auto issue = [&](const Pending& e, const Item& it) {
    if (lane == 0) {
      const int s = static_cast<int>(j % kStages);
      const uint32_t k = j / kStages;
      if (k > 0) mbar_wait(bar_addr(sh.empty[s]), (k - 1) & 1);
      // The Q buffer: the previous item's consumers must have copied their Q fragments.
      if ((e.flags & kFirst) && qi > 0) mbar_wait(bar_addr(sh.qempty), (qi - 1) & 1);
      Entry& h = sh.entry[s];
      h.info = pack_info(e.flags, it.nt, it.split, it.g);
      h.t0 = it.t0;
      h.vlim = e.vlim;
      int klo = ak::kBlockKeys - 1;
#pragma unroll
      for (int w = 0; w < kQT; ++w) {
        const int lim = (e.mask >> w) & 1 ? it.pos[w] - e.b * ak::kBlockKeys : -1;
        h.lim[w] = lim;
        if (w < it.nt) klo = min(klo, lim);
      }
      h.klo = klo;
      const uint32_t full = bar_addr(sh.full[s]);
      const uint32_t stage = base + s * kStageBytes;
      mbar_arrive_expect_tx(full, kStageBytes + ((e.flags & kFirst) ? kQBytes : 0));
      if (e.flags & kFirst) tma_load_3d(base + kQOff, qmap, 0, it.g * a.group, it.t0, full);
      tma_load_4d(stage, kmap, 0, 0, it.g, e.page, full);
      tma_load_4d(stage + kTileBytes, vmap, 0, 0, it.g, e.page, full);
    }
    ++j;
  };

  // The first existing item of this CTA (heaviest tiles first: items in descending order).
  int w = n_work - 1 - static_cast<int>(blockIdx.x);
  int cur = 0;
  bool have_item = false;
  for (; w >= 0 && !have_item; w -= step) have_item = prepare_item(a, sh.item[cur], w);
  while (have_item) {
    const Item& it = sh.item[cur];
    // The next existing item, prepared into the other buffer once (`w` already points at it).
    bool next_done = false, have_next = false;
    auto prepare_next = [&]() {
      if (next_done) return;
      for (; w >= 0 && !have_next; w -= step) have_next = prepare_item(a, sh.item[cur ^ 1], w);
      next_done = true;
    };
    // Entries are issued one behind, so that the last one of the item carries kLast.
    Pending pend{};
    bool have = false;
    int issued = 0;
    const int lo = it.lo, hi = it.hi;
    for (int c0 = lo; c0 < hi; c0 += 32) {
      const int e = c0 + lane;
      int b = -1, page = -1, mask = 0;
      if (e < hi) {
        if (a.sparse) {
          b = it.list_b[e];
          page = it.list_page[e];
          mask = it.list_mask[e];
        } else {
          b = e;
          page = a.page_table[it.pt_row + b];
          if (page >= 0 && page < a.num_pages) {
#pragma unroll
            for (int x = 0; x < kQT; ++x)
              if (it.pos[x] >= 0 && (it.pos[x] >> 7) >= b) mask |= 1 << x;
          }
        }
      }
      int vmax = 0;
#pragma unroll
      for (int x = 0; x < kQT; ++x)
        if ((mask >> x) & 1) vmax = max(vmax, it.pos[x]);
      const int vlim = vmax - b * ak::kBlockKeys;
      unsigned bal = __ballot_sync(0xffffffffu, mask != 0);
      while (bal) {
        const int src = __ffs(bal) - 1;
        bal &= bal - 1;
        Pending nx;
        nx.b = __shfl_sync(0xffffffffu, b, src);
        nx.page = __shfl_sync(0xffffffffu, page, src);
        nx.mask = __shfl_sync(0xffffffffu, mask, src);
        nx.vlim = __shfl_sync(0xffffffffu, vlim, src);
        nx.flags = issued == 0 ? kFirst : 0;
        if (have) {
          issue(pend, it);
          prepare_next();
        }
        pend = nx;
        have = true;
        ++issued;
      }
    }
    if (have) {
      pend.flags |= kLast;
      issue(pend, it);
      ++qi;
    } else {
      write_empty_item(a, it.t0, it.nt, it.g, it.split);
    }
    prepare_next();
    cur ^= 1;
    have_item = have_next;
  }
  // End marker: an ordinary ring entry (header after the stage's empty wait, full arrival with a
  // transaction count, one TMA tile into the stage), so that every header write reaches its
  // readers through the same barriers (a plain arrival here was reported by racecheck as a race
  // with the header reads of the previous round of the stage). The tile (page 0 of head 0, zero
  // filled if the pool has no such page) is never read.
  if (lane == 0) {
    const int s = static_cast<int>(j % kStages);
    const uint32_t k = j / kStages;
    if (k > 0) mbar_wait(bar_addr(sh.empty[s]), (k - 1) & 1);
    sh.entry[s].info = kEnd;
    const uint32_t full = bar_addr(sh.full[s]);
    mbar_arrive_expect_tx(full, kTileBytes);
    tma_load_4d(base + s * kStageBytes, kmap, 0, 0, 0, 0, full);
  }
}
}  // namespace attention_prefill_ws
}  // namespace m3attn
