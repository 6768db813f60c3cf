// Warp-specialised, persistent Hopper prefill kernel of the paged FP8 attention (SPEC section 6),
// AttentionCudaConfig::kernel = 6 .. 9 (9 is the automatic choice for prefill batches). Same math,
// tiles, masks, numerics and split workspace as the wgmma kernel of attention_prefill_wgmma.cuh
// (whose device helpers it reuses); what changes is who waits for what.
//
// Why (ncu of the wgmma kernel, 8K chunk): 1 CTA per SM, 0.54 eligible warps per scheduler, the
// per-block chain load -> QK -> softmax -> P V serialised by one CTA barrier per block, a ~3-5 us
// prologue per CTA (tile scan, candidate list, Q, first loads) exposed 31 times per SM, and a
// last wave of 4 CTAs. Here:
//
// Roles (384 threads, 1 CTA per SM, persistent over work items (tile, KV head, split), heaviest
// tiles first):
//   - warp 0 (scheduler, setmaxnreg 40): for each work item finds the tile (warp scan of
//     query_start), builds the union of the 8 tokens' selected blocks with per-token masks
//     (sparse) or walks blocks 0 .. max_pos / 128 (dense), and for every entry of its split range
//     writes a 64-byte header (per-token key limits, V row limit, tile) into the entry's ring
//     stage and issues two TMA tile loads (K, V: 4D tensor maps over the paged cache, run-time
//     page stride, 128-byte swizzle = the layout wgmma expects) plus, with the item's first
//     entry, the Q tile (3D map: 8 tokens x 16 heads x 128 bytes, zero past T) into one of two Q
//     buffers; all on the stage's full mbarrier (complete_tx). Items without a single entry get
//     their zero output (or empty split partial) written by this warp directly.
//   - warps 1-3 (converters, setmaxnreg 40): raw E4M3 V of each entry -> the f16 MN-major tile of
//     attention_prefill_wgmma.cuh (2 f16 buffers), rows past the entry's V limit zeroed;
//     fence.proxy.async, then the f16 buffer's full mbarrier.
//   - warpgroups 1, 2 (consumers, setmaxnreg 232): 64 rows each (4 tokens x 16 heads). Per entry:
//     S(i+1) = Q K(i+1)^T and O += P(i) V(i) are issued back to back (FP8 wgmma with Q from the
//     shared Q tile, f16 wgmma with P from registers), softmax of i+1 runs while P(i) V(i) is on
//     the tensor cores, and the two warpgroups take turns issuing (named barriers 1, 2:
//     "ping-pong") so one's softmax overlaps the other's MMAs. The stream of entries runs across
//     work items without a drain: S of the next item's first block is issued before the last P V of
//     the current item, whose epilogue (BF16 rows or the split partial) follows its completion.
// Variants (template flags; kernel 6 none, 7 + kLookahead, 8 + kQRegs, 9 + kFastConvert):
// kLookahead: the scheduler prepares the next work item (global loads, union) right after the
// current item's first entry, not after its last; kQRegs: each consumer warp copies its Q
// fragments from the Q tile into registers when an item starts (register-A QK wgmma); kFastConvert:
// the converters take 16-byte items, 4 in flight per thread, zeroing by selects (round-2 ncu of
// kernel 6: the 3 converter warps were ~85 % busy and the consumers waited on the f16 tile for
// 16 % of all samples).
// Barriers: full[s] (1 arrival + TMA bytes), empty[s] (8 consumer warps after S(i) completes +
// 3 converter warps after the conversion), vfull[2] (3 converter warps), vempty[2] (8 consumer
// warps after P V(i) completes), qempty[2] (8 consumer warps after the item's last S).
//
// Shared memory: 3 raw stages x 32 KB + 2 f16 V x 32 KB + 2 Q x 16 KB + 1 KB alignment = 193 KB
// dynamic, 4.4 KB static. Registers: 168 at launch (384 threads), consumers 232 after setmaxnreg
// (no spills), scheduler + converters 40 (ptxas reports 60 B (kernel 6) / 270 B (7-9) of spills:
// compile experiments place all of them in the scheduler warp's item preparation). Needs 16-byte
// aligned pool base and strides (TMA); otherwise, or when the driver refuses a tensor map, the
// launcher runs the cp.async wgmma kernel (kernel 4).
//
// Measured (H200, round 2, attention_bench --prefill, 8K chunk, TFLOP/s on the selected work):
// sparse @ 8K / 64K: kernel 6 359 / 364, 7 364 / 369, 8 370 / 374, kernel 4 347 / 351; dense @ 8K:
// 8 434 vs 401. The mma_work/flop column (1.03 sparse): the MMA work walked exceeds the counted
// work by 3 % (the causal part of each token's local block), tile unions are 16 blocks (14.1 at
// 8K, where early tokens see fewer) for 16 selected per token: the bench's selections share a
// ranking per 64 tokens, so the union costs nothing there.
//
// Expected bound (8K chunk, ~16 blocks per tile): per block and CTA 512 cycles of FP8 QK + 1024 of
// f16 P V on the tensor cores, 16 K exp2 = 1024 MUFU cycles, 48 KB of conversion traffic; with the
// roles overlapped the tensor pipe is the limit (~1.3 PFLOP/s mixed peak), against ~26 % of it
// reached by the wgmma kernel.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <mutex>

#include "core/cuda_check.h"
#include "core/mbarrier.cuh"
#include "m3attn/status.h"
#include "stages/attention/attention_kernel.cuh"
#include "stages/attention/attention_prefill_wgmma.cuh"

namespace m3attn {
namespace attention_prefill_ws {

namespace ak = attention_kernel;
namespace ap = attention_prefill;
using ak::AttnArgs;

constexpr int kThreads = 384;  // warpgroup 0: scheduler + converters; 1, 2: consumers
constexpr int kConvWarps = 3;
constexpr int kConsumerWarps = 8;
constexpr int kQT = 8;  // query tokens per tile
constexpr int kStages = 3;
constexpr int kTileBytes = ak::kTileBytes;  // raw K or V: 128 keys x 128 bytes
constexpr int kStageBytes = 2 * kTileBytes;
constexpr int kVhBytes = 2 * kTileBytes;        // f16 V
constexpr int kQBytes = kQT * ak::kRows * 128;  // 8 tokens x 16 heads x 128 bytes
constexpr int kVhOff = kStages * kStageBytes;
constexpr int kQOff = kVhOff + 2 * kVhBytes;
constexpr int kSmemBytes = kQOff + 2 * kQBytes + 1024;
// setmaxnreg moves registers within the CTA's launch allocation (168 per thread: 65536 / 384
// rounded down to a multiple of 8), so 128 x low + 256 x high must not exceed 168 x 384.
constexpr int kLaunchRegs = 168;
constexpr int kLowRegs = 40;
constexpr int kHighRegs = 232;
constexpr int kCand = kQT * ak::kTopKIds;  // 128 candidate ids per tile
static_assert(kSmemBytes + 8192 <= 227 * 1024, "dynamic + static shared memory");
static_assert(kLowRegs * 128 + kHighRegs * 256 <= kLaunchRegs * kThreads, "register budget");
static_assert(kLaunchRegs * kThreads <= 65536, "register file");
static_assert(ap::kQT == kQT, "same tile as the wgmma kernel (shared helpers)");

// Entry flags.
constexpr int kFirst = 1;  // first entry of its work item (Q tile loaded with it)
constexpr int kLast = 2;   // last entry of its work item (epilogue after its P V)
constexpr int kEnd = 4;    // no more entries

// Header of one ring stage, written by the scheduler lane before the stage's full arrival.
struct Entry {
  int info;  // flags | Q buffer << 3 | tokens of the tile << 4 | split << 8 | KV head << 16
  int t0;    // first token of the tile
  int vlim;  // V rows past it are zeroed
  int pad;
  int lim[kQT];  // keys [0, lim] of the block visible to token w (< 0: none)
};
__host__ __device__ constexpr int pack_info(int flags, int qslot, int nt, int split, int g) {
  return flags | qslot << 3 | nt << 4 | split << 8 | g << 16;
}
__device__ __forceinline__ int info_flags(int info) { return info & 7; }
__device__ __forceinline__ int info_qslot(int info) { return (info >> 3) & 1; }
__device__ __forceinline__ int info_nt(int info) { return (info >> 4) & 15; }
__device__ __forceinline__ int info_split(int info) { return (info >> 8) & 255; }
__device__ __forceinline__ int info_g(int info) { return info >> 16; }
static_assert(ak::kMaxSplits <= 256, "split index in 8 bits");

// ---------------------------------------------------------------------------------------------
// PTX wrappers (mbarrier, TMA, named barriers, register reallocation).

using sm90::mbar_arrive;
using sm90::mbar_arrive_expect_tx;
using sm90::mbar_init;
using sm90::mbar_try_wait;
using sm90::mbar_wait;

__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap* map, int c0, int c1,
                                            int c2, int c3, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
      "%3, %4, %5}], [%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, int c0, int c1,
                                            int c2, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
      "%3, %4}], [%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

// Named barriers 1 and 2 over the 256 consumer threads: warpgroup w waits on 1 + w, the other
// warpgroup arrives on it.
__device__ __forceinline__ void turn_wait(int wg) {
  asm volatile("bar.sync %0, 256;\n" ::"r"(1 + wg) : "memory");
}
__device__ __forceinline__ void turn_pass(int wg) {
  asm volatile("bar.arrive %0, 256;\n" ::"r"(2 - wg) : "memory");
}

// ---------------------------------------------------------------------------------------------
// Shared state.

// A work item as the scheduler warp prepared it (two buffers: the current and the next item).
struct Item {
  int t0, nt, g, split, lo, hi;  // tile, KV head, split, entry range [lo, hi) of the list
  int64_t pt_row;                // page-table row offset of the request
  int pos[kQT];                  // positions of the tile's tokens (-1: absent)
  int list_b[kCand], list_page[kCand], list_mask[kCand];  // sparse: the union
};

struct Shared {
  Entry entry[kStages];
  uint64_t full[kStages], empty[kStages], vfull[2], vempty[2], qempty[2];
  // Scheduler warp only.
  int cand_b[kCand], cand_page[kCand];
  Item item[2];
};

__device__ __forceinline__ uint32_t bar_addr(const uint64_t& b) { return ak::smem_u32(&b); }

// ---------------------------------------------------------------------------------------------
// Scheduler warp.

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

// Union of the tile's selected blocks (the wgmma kernel's rules: ids outside [0, pos / 128], past
// the page table or with an invalid page select nothing; repeats count once), as list entries
// (block, page, mask of tokens that selected it). Returns the entry count.
__device__ __forceinline__ int build_sparse_list(const AttnArgs& a, Shared& sh, Item& it,
                                                 int64_t pt_row, int t0, int nt, int g, int mypos) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int k = 0; k < kCand / 32; ++k) {
    const int c = lane + 32 * k, w = c / ak::kTopKIds;
    const int pw = __shfl_sync(0xffffffffu, mypos, w & 7);
    int b = -1, page = -1;
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
    sh.cand_b[c] = b;
    sh.cand_page[c] = page;
  }
  __syncwarp();
  int n = 0;
#pragma unroll
  for (int k = 0; k < kCand / 32; ++k) {
    const int c = lane + 32 * k;
    const int b = sh.cand_b[c];
    bool first = b >= 0;
    int mask = 0;
    if (b >= 0) {
      for (int j = 0; j < kCand; ++j) {
        if (sh.cand_b[j] == b) {
          if (j < c) first = false;
          mask |= 1 << (j / ak::kTopKIds);
        }
      }
    }
    const unsigned bal = __ballot_sync(0xffffffffu, first);
    if (first) {
      const int rank = n + __popc(bal & ((1u << lane) - 1u));
      it.list_b[rank] = b;
      it.list_page[rank] = sh.cand_page[c];
      it.list_mask[rank] = mask;
    }
    n += __popc(bal);
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
__device__ __forceinline__ bool prepare_item(const AttnArgs& a, Shared& sh, Item& it, int w) {
  const int lane = threadIdx.x & 31;
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
    n_total = build_sparse_list(a, sh, it, pt_row, t0, nt, g, mypos);
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

// kLookahead: the next work item is prepared right after the current item's first entry is
// issued (its global loads overlap the ring's 3 entries of work), else after the last.
template <bool kLookahead>
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
      const int qs = static_cast<int>(qi & 1);
      if ((e.flags & kFirst) && qi >= 2) mbar_wait(bar_addr(sh.qempty[qs]), ((qi >> 1) - 1) & 1);
      Entry& h = sh.entry[s];
      h.info = pack_info(e.flags, qs, it.nt, it.split, it.g);
      h.t0 = it.t0;
      h.vlim = e.vlim;
#pragma unroll
      for (int w = 0; w < kQT; ++w)
        h.lim[w] = (e.mask >> w) & 1 ? it.pos[w] - e.b * ak::kBlockKeys : -1;
      const uint32_t full = bar_addr(sh.full[s]);
      const uint32_t stage = base + s * kStageBytes;
      mbar_arrive_expect_tx(full, kStageBytes + ((e.flags & kFirst) ? kQBytes : 0));
      if (e.flags & kFirst)
        tma_load_3d(base + kQOff + qs * kQBytes, qmap, 0, it.g * a.group, it.t0, full);
      tma_load_4d(stage, kmap, 0, 0, it.g, e.page, full);
      tma_load_4d(stage + kTileBytes, vmap, 0, 0, it.g, e.page, full);
    }
    ++j;
  };

  // The first existing item of this CTA (heaviest tiles first: items in descending order).
  int w = n_work - 1 - static_cast<int>(blockIdx.x);
  int cur = 0;
  bool have_item = false;
  for (; w >= 0 && !have_item; w -= step) have_item = prepare_item(a, sh, sh.item[cur], w);
  while (have_item) {
    const Item& it = sh.item[cur];
    // The next existing item, prepared into the other buffer once (`w` already points at it).
    bool next_done = false, have_next = false;
    auto prepare_next = [&]() {
      if (next_done) return;
      for (; w >= 0 && !have_next; w -= step) have_next = prepare_item(a, sh, sh.item[cur ^ 1], w);
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
          if (kLookahead) prepare_next();
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
  // End marker.
  if (lane == 0) {
    const int s = static_cast<int>(j % kStages);
    const uint32_t k = j / kStages;
    if (k > 0) mbar_wait(bar_addr(sh.empty[s]), (k - 1) & 1);
    sh.entry[s].info = kEnd;
    mbar_arrive(bar_addr(sh.full[s]));
  }
}

// ---------------------------------------------------------------------------------------------
// Converter warps: raw V of every entry -> f16 buffer v % 2 (layout of ap::convert_v).
//
// kFast: 16-byte raw chunks (16 dims) per item instead of 8, two items per thread in flight
// (both loads issued before the conversions), rows past the V limit zeroed by selects instead of
// a branch. ncu of the plain loop (round 2): the 3 converter warps were busy ~85 % of the time
// and the consumers waited for the f16 tile (16 % of all stall samples): one dependent
// address -> LDS -> F2FP -> STS chain per 8 dims, one warp per scheduler, no overlap.

// One 16-byte raw chunk c16 (dims 16 c16 .. + 15) of `key` -> two swizzled 16-byte f16 chunks.
__device__ __forceinline__ void store_f16_chunk(uint8_t* vh, int key, int c16, const uint4& raw) {
  uint4 lo, hi;
  lo.x = ak::e4m3x2_to_f16x2(raw.x);
  lo.y = ak::e4m3x2_to_f16x2(raw.x >> 16);
  lo.z = ak::e4m3x2_to_f16x2(raw.y);
  lo.w = ak::e4m3x2_to_f16x2(raw.y >> 16);
  hi.x = ak::e4m3x2_to_f16x2(raw.z);
  hi.y = ak::e4m3x2_to_f16x2(raw.z >> 16);
  hi.z = ak::e4m3x2_to_f16x2(raw.w);
  hi.w = ak::e4m3x2_to_f16x2(raw.w >> 16);
  // 8-dim chunks c8 = 2 c16, 2 c16 + 1: dims half c16 / 4, chunk (c8 % 8) ^ (key % 8).
  uint8_t* row = vh + (c16 >> 2) * kTileBytes + key * 128;
  const int c8 = 2 * c16;
  *reinterpret_cast<uint4*>(row + (((c8 & 7) ^ (key & 7)) << 4)) = lo;
  *reinterpret_cast<uint4*>(row + ((((c8 + 1) & 7) ^ (key & 7)) << 4)) = hi;
}

template <bool kFast>
__device__ __forceinline__ void converter_warps(Shared& sh, uint8_t* smem) {
  const int t = static_cast<int>(threadIdx.x) - 32;  // 0 .. 95
  const int lane = threadIdx.x & 31;
  for (uint32_t j = 0;; ++j) {  // entry j fills f16 buffer j % 2 (every entry carries a block)
    const int s = static_cast<int>(j % kStages);
    mbar_wait(bar_addr(sh.full[s]), (j / kStages) & 1);
    const int info = sh.entry[s].info;
    const int vlim = sh.entry[s].vlim;
    if (info_flags(info) & kEnd) return;
    const int vs = static_cast<int>(j & 1);
    if (j >= 2) mbar_wait(bar_addr(sh.vempty[vs]), ((j >> 1) - 1) & 1);
    const uint8_t* vraw = smem + s * kStageBytes + kTileBytes;
    uint8_t* vh = smem + kVhOff + vs * kVhBytes;
    if constexpr (kFast) {
      constexpr int kItems = ak::kBlockKeys * 8;  // 16-byte raw chunks
      constexpr int kN = 32 * kConvWarps;
      constexpr int kU = 4;  // items in flight per thread
#pragma unroll 1
      for (int i0 = t; i0 < kItems; i0 += kU * kN) {
        uint4 r[kU];
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int i = min(i0 + u * kN, kItems - 1);  // past the end: a repeat, not stored
          const int key = i >> 3, c = i & 7;
          r[u] = *reinterpret_cast<const uint4*>(vraw + key * ak::kDim + ((c ^ (key & 7)) << 4));
          if (key > vlim) r[u] = make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int i = i0 + u * kN;
          if (i < kItems) store_f16_chunk(vh, i >> 3, i & 7, r[u]);
        }
      }
    } else {
#pragma unroll 2
      for (int i = t; i < ak::kBlockKeys * 16; i += 32 * kConvWarps) {
        const int key = i >> 4, c8 = i & 15;  // c8: 8 dims
        uint4 h = make_uint4(0u, 0u, 0u, 0u);
        if (key <= vlim) {
          const uint2 raw = *reinterpret_cast<const uint2*>(
              vraw + key * ak::kDim + (((c8 >> 1) ^ (key & 7)) << 4) + (c8 & 1) * 8);
          h.x = ak::e4m3x2_to_f16x2(raw.x);
          h.y = ak::e4m3x2_to_f16x2(raw.x >> 16);
          h.z = ak::e4m3x2_to_f16x2(raw.y);
          h.w = ak::e4m3x2_to_f16x2(raw.y >> 16);
        }
        *reinterpret_cast<uint4*>(vh + (c8 >> 3) * kTileBytes + key * 128 +
                                  (((c8 & 7) ^ (key & 7)) << 4)) = h;
      }
    }
    ap::fence_proxy_async();  // f16 stores -> wgmma (async proxy) reads
    __syncwarp();
    if (lane == 0) {
      mbar_arrive(bar_addr(sh.vfull[vs]));
      mbar_arrive(bar_addr(sh.empty[s]));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Consumer warpgroups.

// Epilogue of one work item for this warp's token (rows grp, grp + 8 = heads grp, grp + 8).
__device__ __forceinline__ void store_item(const AttnArgs& a, const float (&o)[64],
                                           const float (&m)[2], const float (&l)[2], int t0,
                                           int info, int tok) {
  const int lane = threadIdx.x & 31, grp = lane >> 2, tig = lane & 3;
  const int nt = info_nt(info), g = info_g(info), split = info_split(info);
  float lsum[2] = {l[0], l[1]};
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    lsum[e] += __shfl_xor_sync(0xffffffffu, lsum[e], 1);
    lsum[e] += __shfl_xor_sync(0xffffffffu, lsum[e], 2);
  }
  if (tok >= nt) return;
  const int64_t t = t0 + tok;
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int h = grp + 8 * e;
    if (h >= a.group) continue;
    if (a.splits == 1) {
      // A row without keys is +0 exactly (its O may be -0: the first P V of an item overwrites O).
      const bool keys = lsum[e] > 0.0f;
      const float inv = keys ? 1.0f / lsum[e] : 0.0f;
      uint16_t* orow = a.out + t * a.out_stride + static_cast<int64_t>(g * a.group + h) * ak::kDim;
#pragma unroll
      for (int jj = 0; jj < 16; ++jj)
        *reinterpret_cast<uint32_t*>(orow + 8 * jj + 2 * tig) =
            keys ? ak::pack_bf16x2(o[4 * jj + 2 * e] * inv, o[4 * jj + 2 * e + 1] * inv) : 0u;
    } else {
      const int64_t slot = (t * a.n_kv + g) * a.splits + split;
      float* orow = a.ws_o + (slot * ak::kRows + h) * ak::kDim;
#pragma unroll
      for (int jj = 0; jj < 16; ++jj)
        *reinterpret_cast<float2*>(orow + 8 * jj + 2 * tig) =
            make_float2(o[4 * jj + 2 * e], o[4 * jj + 2 * e + 1]);
      if (tig == 0) {
        a.ws_ml[(slot * ak::kRows + h) * 2] = m[e];
        a.ws_ml[(slot * ak::kRows + h) * 2 + 1] = lsum[e];
      }
    }
  }
}

// P = f16(s) as the A fragments of the 8 k-steps of P V (ap::rescale_and_pack without the O
// rescale).
__device__ __forceinline__ void pack_p(const float (&s)[64], uint32_t (&p)[8][4]) {
#pragma unroll
  for (int kk = 0; kk < 8; ++kk)
#pragma unroll
    for (int e = 0; e < 4; ++e) p[kk][e] = ak::pack_f16x2(s[8 * kk + 2 * e], s[8 * kk + 2 * e + 1]);
}

// What a consumer warp keeps of an entry header.
struct Cur {
  int info, t0, lim;
  __device__ __forceinline__ int flags() const { return info_flags(info); }
  __device__ __forceinline__ int qslot() const { return info_qslot(info); }
};

__device__ __forceinline__ Cur read_entry(const Entry& e, int tok) {
  return Cur{e.info, e.t0, e.lim[tok]};
}

// kQRegs: each warp copies its token's Q fragments from the item's Q tile into registers when the
// item starts (register-A QK wgmma: 8 KB less shared-memory traffic per warpgroup and block).
template <bool kQRegs>
__device__ __forceinline__ void consumer_warpgroups(const AttnArgs& a, Shared& sh, uint32_t base,
                                                    const uint8_t* smem) {
  const int ct = static_cast<int>(threadIdx.x) - 128;  // 0 .. 255
  const int wg = ct >> 7;
  const int tok = ct >> 5;  // warp of the consumers = token of the tile
  const int lane = ct & 31;
  float o[64], s[64];
  uint32_t p[8][4];
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, alpha[2] = {1.0f, 1.0f};
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.0f;

  // kQRegs: the m16n8k32 A fragments of this warp's 16 rows (heads grp, grp + 8 of token tok):
  // k-step kk holds bytes 32 kk + 4 tig .. + 3 and 32 kk + 16 + 4 tig .. + 3 of each row.
  uint32_t qa[4][4];
  auto load_q = [&](int qslot) {
    if constexpr (kQRegs) {
      const uint8_t* q = smem + kQOff + qslot * kQBytes;
      const int row0 = tok * ak::kRows + (lane >> 2), tig = lane & 3;
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = row0 + 8 * (e & 1), off = 32 * kk + 16 * (e >> 1) + 4 * tig;
          qa[kk][e] = *reinterpret_cast<const uint32_t*>(
              q + row * 128 + (((off >> 4) ^ (row & 7)) << 4) + (off & 15));
        }
    }
  };
  auto issue_qk = [&](int qslot, int stage) {
    const uint32_t qaddr = base + kQOff + qslot * kQBytes + wg * (kQBytes / 2);
    const uint32_t kaddr = base + stage * kStageBytes;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      if constexpr (kQRegs)
        ap::wgmma_qk_rs(s, qa[kk], ap::smem_desc(kaddr + 32 * kk, 16, 1024), kk > 0 ? 1 : 0);
      else
        ap::wgmma_qk(s, ap::smem_desc(qaddr + 32 * kk, 16, 1024),
                     ap::smem_desc(kaddr + 32 * kk, 16, 1024), kk > 0 ? 1 : 0);
    }
  };
  // O (+)= P V; the first entry of an item overwrites O (the previous item's O was stored).
  auto issue_pv = [&](int vs, int flags) {
    const uint32_t vaddr = base + kVhOff + vs * kVhBytes;
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)
      ap::wgmma_pv(o, p[kk], ap::smem_desc(vaddr + kk * 2048, kTileBytes, 1024),
                   kk > 0 || !(flags & kFirst) ? 1 : 0);
  };

  uint32_t j = 0;  // current entry; its V is in f16 buffer j % 2
  mbar_wait(bar_addr(sh.full[0]), 0);
  Cur cur = read_entry(sh.entry[0], tok);
  if (cur.flags() & kEnd) return;  // no work for this CTA
  if (wg == 1) turn_pass(wg);      // warpgroup 0 issues first

  // Entry 0: S, softmax, P.
  load_q(cur.qslot());
  turn_wait(wg);
  ap::reg_fence(s);
  ap::wgmma_fence();
  issue_qk(cur.qslot(), 0);
  ap::wgmma_commit();
  turn_pass(wg);
  ap::wgmma_wait<0>();
  ap::reg_fence(s);
  __syncwarp();  // every lane has read the header before the stage is released
  if (lane == 0) {
    mbar_arrive(bar_addr(sh.empty[0]));
    if (cur.flags() & kLast) mbar_arrive(bar_addr(sh.qempty[cur.qslot()]));
  }
  ap::softmax_block(s, m, l, alpha, cur.lim, a.scale_log2);
  ap::rescale_and_pack<true>(o, s, alpha, p);

  for (;;) {
    const uint32_t nj = j + 1;
    const int ns = static_cast<int>(nj % kStages);
    mbar_wait(bar_addr(sh.full[ns]), (nj / kStages) & 1);
    const Cur nxt = read_entry(sh.entry[ns], tok);
    if (nxt.flags() & kEnd) break;
    const int vs = static_cast<int>(j & 1);
    if (nxt.flags() & kFirst) load_q(nxt.qslot());
    mbar_wait(bar_addr(sh.vfull[vs]), (j >> 1) & 1);
    // S(next) then P V(cur), in this warpgroup's turn.
    turn_wait(wg);
    ap::reg_fence(o);
    ap::reg_fence(s);
    ap::reg_fence(p);
    ap::wgmma_fence();
    issue_qk(nxt.qslot(), ns);
    ap::wgmma_commit();
    issue_pv(vs, cur.flags());
    ap::wgmma_commit();
    turn_pass(wg);
    ap::wgmma_wait<1>();  // S(next) done; P V(cur) may still run
    ap::reg_fence(s);
    __syncwarp();  // every lane has read the header before the stage is released
    if (lane == 0) {
      mbar_arrive(bar_addr(sh.empty[ns]));
      if (nxt.flags() & kLast) mbar_arrive(bar_addr(sh.qempty[nxt.qslot()]));
    }
    // At an item boundary the next entry starts a fresh softmax; the finished item's m, l are
    // kept for its epilogue.
    const bool boundary = (cur.flags() & kLast) != 0;
    const float m_done[2] = {m[0], m[1]}, l_done[2] = {l[0], l[1]};
    if (boundary) {
      m[0] = m[1] = -INFINITY;
      l[0] = l[1] = 0.0f;
    }
    ap::softmax_block(s, m, l, alpha, nxt.lim, a.scale_log2);
    ap::wgmma_wait<0>();
    ap::reg_fence(o);
    ap::reg_fence(p);
    __syncwarp();
    if (lane == 0) mbar_arrive(bar_addr(sh.vempty[vs]));
    if (boundary) {
      // P first (S dies), then the finished item's rows from O (the next P V overwrites O).
      pack_p(s, p);
      store_item(a, o, m_done, l_done, cur.t0, cur.info, tok);
    } else {
      ap::rescale_and_pack<true>(o, s, alpha, p);
    }
    cur = nxt;
    j = nj;
  }

  // Last entry: P V, epilogue.
  const int vs = static_cast<int>(j & 1);
  mbar_wait(bar_addr(sh.vfull[vs]), (j >> 1) & 1);
  turn_wait(wg);
  ap::reg_fence(o);
  ap::reg_fence(p);
  ap::wgmma_fence();
  issue_pv(vs, cur.flags());
  ap::wgmma_commit();
  if (wg == 0) turn_pass(wg);  // warpgroup 1's last pass would have no matching wait
  ap::wgmma_wait<0>();
  ap::reg_fence(o);
  store_item(a, o, m, l, cur.t0, cur.info, tok);
}

// ---------------------------------------------------------------------------------------------
// The kernel. Grid: min(work items, SMs) persistent CTAs; block kThreads; dynamic smem kSmemBytes.
template <bool kLookahead, bool kQRegs, bool kFastConvert>
__global__ void __launch_bounds__(kThreads, 1)
    attention_prefill_ws_kernel(const __grid_constant__ AttnArgs a,
                                const __grid_constant__ CUtensorMap kmap,
                                const __grid_constant__ CUtensorMap vmap,
                                const __grid_constant__ CUtensorMap qmap, const int tiles) {
  extern __shared__ uint8_t smem_raw[];
  __shared__ Shared sh;
  const uint32_t raw_u32 = ak::smem_u32(smem_raw);
  const uint32_t base = (raw_u32 + 1023u) & ~1023u;
  uint8_t* smem = smem_raw + (base - raw_u32);
  const int warp = threadIdx.x >> 5;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(bar_addr(sh.full[s]), 1);
      mbar_init(bar_addr(sh.empty[s]), kConsumerWarps + kConvWarps);
    }
    for (int i = 0; i < 2; ++i) {
      mbar_init(bar_addr(sh.vfull[i]), kConvWarps);
      mbar_init(bar_addr(sh.vempty[i]), kConsumerWarps);
      mbar_init(bar_addr(sh.qempty[i]), kConsumerWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (warp < 4) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kLowRegs));
    if (warp == 0)
      scheduler_warp<kLookahead>(a, &kmap, &vmap, &qmap, tiles, sh, base);
    else
      converter_warps<kFastConvert>(sh, smem);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kHighRegs));
    consumer_warpgroups<kQRegs>(a, sh, base, smem);
  }
}

// ---------------------------------------------------------------------------------------------
// Host side.

// cuTensorMapEncodeTiled from the driver (no libcuda link), looked up once; nullptr if missing.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                         &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
    else
      (void)cudaGetLastError();
  });
  return fn;
}

// K, V maps: [pages][n_kv][128 tokens][128 bytes] at the K / V plane (box: one 128 x 128 tile);
// Q map: [T][n_q][128 bytes] (box: 8 tokens x 16 heads). 128-byte swizzle, zero fill. False when
// the driver refuses (e.g. strides that TMA cannot express).
inline bool encode_maps(const AttnArgs& a, CUtensorMap* kmap, CUtensorMap* vmap,
                        CUtensorMap* qmap) {
  PFN_cuTensorMapEncodeTiled_v12000 enc = tensor_map_encoder();
  if (!enc) return false;
  const cuuint32_t ones[4] = {1, 1, 1, 1};
  const cuuint64_t kv_dims[4] = {128, 128, static_cast<cuuint64_t>(a.n_kv),
                                 static_cast<cuuint64_t>(a.num_pages)};
  const cuuint64_t kv_strides[3] = {128, static_cast<cuuint64_t>(kTileBytes),
                                    static_cast<cuuint64_t>(a.page_stride)};
  const cuuint32_t kv_box[4] = {128, 128, 1, 1};
  const cuuint64_t q_dims[3] = {128, static_cast<cuuint64_t>(a.n_kv) * a.group,
                                static_cast<cuuint64_t>(a.T)};
  const cuuint64_t q_strides[2] = {128, static_cast<cuuint64_t>(a.q_stride_t)};
  const cuuint32_t q_box[3] = {128, ak::kRows, kQT};
  auto map = [&](CUtensorMap* m, const void* ptr, cuuint32_t rank, const cuuint64_t* dims,
                 const cuuint64_t* strides, const cuuint32_t* box) {
    return enc(m, CU_TENSOR_MAP_DATA_TYPE_UINT8, rank, const_cast<void*>(ptr), dims, strides, box,
               ones, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
               CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
  };
  return map(kmap, a.kv, 4, kv_dims, kv_strides, kv_box) &&
         map(vmap, a.kv + a.plane_stride, 4, kv_dims, kv_strides, kv_box) &&
         map(qmap, a.q, 3, q_dims, q_strides, q_box);
}

// Launches the kernel on min(work items, max_ctas) CTAs. *launched = false (nothing launched, OK
// status) when the tensor maps cannot be built: the caller then runs another kernel.
inline Status launch(const AttnArgs& a, int64_t tiles, int max_ctas, bool lookahead, bool q_regs,
                     bool fast_convert, cudaStream_t stream, bool* launched) {
  *launched = false;
  if (tiles <= 0) return Status::Ok();
  const int64_t work = tiles * a.n_kv * a.splits;
  if (work > (int64_t{1} << 30)) return Status::Ok();
  CUtensorMap kmap, vmap, qmap;
  if (!encode_maps(a, &kmap, &vmap, &qmap)) return Status::Ok();
  // The compiled combinations: kernels 6 (none), 7 (lookahead), 8 (+ Q in registers), 9 (+ the
  // fast V conversion).
  auto kernel = !lookahead      ? attention_prefill_ws_kernel<false, false, false>
                : !q_regs       ? attention_prefill_ws_kernel<true, false, false>
                : !fast_convert ? attention_prefill_ws_kernel<true, true, false>
                                : attention_prefill_ws_kernel<true, true, true>;
  M3_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  const int grid = static_cast<int>(std::min<int64_t>(work, std::max(1, max_ctas)));
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(a, kmap, vmap, qmap, static_cast<int>(tiles));
  M3_CUDA_CHECK_LAUNCH();
  *launched = true;
  return Status::Ok();
}

}  // namespace attention_prefill_ws
}  // namespace m3attn
