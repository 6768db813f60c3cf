// Warp-specialised, persistent Hopper prefill kernel of the paged FP8 attention (SPEC section 6),
// AttentionCudaConfig::kernel = 15 (the automatic choice for prefill; see Variants). Same
// math, tiles, masks, numerics and split workspace as the wgmma kernel of
// attention_prefill_wgmma.cuh (whose device helpers it reuses); what changes is who waits for what.
//
// Why (ncu of the wgmma kernel, 8K chunk): 1 CTA per SM, 0.54 eligible warps per scheduler, the
// per-block chain load -> QK -> softmax -> P V serialised by one CTA barrier per block, a ~3-5 us
// prologue per CTA (tile scan, candidate list, Q, first loads) exposed 31 times per SM, and a
// last wave of 4 CTAs. Here:
//
// Roles (384 threads, 1 CTA per SM, persistent over work items (tile, KV head, split), heaviest
// tiles first):
//   - warp 0 (scheduler, setmaxnreg 64): for each work item finds the tile (warp scan of
//     query_start), builds the union of the 8 tokens' selected blocks with per-token masks
//     (sparse) or walks blocks 0 .. max_pos / 128 (dense), and for every entry of its split range
//     writes a 64-byte header (per-token key limits, V row limit, tile) into the entry's ring
//     stage and issues two TMA tile loads (K, V: 4D tensor maps over the paged cache, run-time
//     page stride, 128-byte swizzle = the layout wgmma expects) plus, with the item's first
//     entry, the Q tile (3D map: 8 tokens x 16 heads x 128 bytes, zero past T) into the Q
//     buffer; all on the stage's full mbarrier (complete_tx). Items without a single entry get
//     their zero output (or empty split partial) written by this warp directly.
//   - warps 1-3 (converters, setmaxnreg 64): raw E4M3 V of each entry -> the f16 MN-major tile of
//     attention_prefill_wgmma.cuh (2 f16 buffers), rows past the entry's V limit zeroed;
//     fence.proxy.async, then the f16 buffer's full mbarrier.
//   - warpgroups 1, 2 (consumers, setmaxnreg 216): 64 rows each (4 tokens x 16 heads).
//     Per entry: S(i+1) = Q K(i+1)^T and O += P(i) V(i) are issued back to back (FP8 wgmma with Q
//     from registers, f16 wgmma with P from registers), softmax of i+1 runs while P(i) V(i) is on
//     the tensor cores, and the two warpgroups take turns issuing (named barriers 1, 2:
//     "ping-pong") so one's softmax overlaps the other's MMAs. The stream of entries runs across
//     work items without a drain: S of the next item's first block is issued before the last P V of
//     the current item, whose epilogue (BF16 rows or the split partial) follows its completion.
// Files: attention_prefill_ws_common.cuh (constants, ring header, shared state, PTX wrappers),
// attention_prefill_ws_scheduler.cuh (the scheduler warp), this file (converters, consumers, the
// kernel, tensor maps and launch).
// History (session 12, H200, sparse 8K chunk at 8K): the scheduler prepares the next work item
// right after the current item's first entry (its global loads and union overlap the ring), the
// consumers keep Q in registers (register-A QK wgmma), the converters take 16-byte items, 4 in
// flight per thread, zeroing by selects (the 8-byte loop kept them ~85 % busy and the consumers
// waiting on the f16 tile for 16 % of their samples), the scheduler builds each tile's union by
// minimum extraction (~25 instructions per distinct block; an all-pairs compare took ~2.6 K
// dependent instructions per item, longer than the ring lasted) and the ring has 4 stages and one
// Q buffer, released when every consumer warp has its Q fragments (TMA latency was not covered by
// 3 stages). Session 13 removed those steps' kernels 6-10 (never faster than 11).
// Variants: kernel 15 (the only one since session 14) gives 64 registers to the scheduler and
// converter warps, 216 to the consumers; kernel 11 (40 / 232; ptxas: ~200 bytes of spills in the
// 40-register warps) was removed in session 14 after round A (H200, dense 8K chunk at 8K / 64K:
// 15 572.8 / 590.4 TFLOP/s vs 517.3 / 541.2 for 11; sparse 520.7 / 527.2 vs 474.0 / 473.6).
// Session 13, H200, sparse 8K chunk at 8K / 64K: round B 900.3 / 906.0 and
// 1016.9 / 1028.3 us vs 922.2 / 929.3 and 1046.9 / 1058.4 for 11, lowoverlap 2096 / 2121 vs
// 2168 / 2182 us, dense 1-3 % slower; round C 896-902 / 1011-1020 us = 519-523 / 522-527 TFLOP/s
// vs 933-934 / 1062-1064 us for 11, lowoverlap 2093-2104 vs 2180-2182 us, dense 572-574 / 580-582
// vs 559 / 568-586 TFLOP/s (dense: within the run-to-run spread both ways). Session 13 measured
// and removed: 12 (headers broadcast by a warp OR reduction, meant to make the ring stage uniform
// for the compiler: it did not, and the redux latency made it 3 % slower than 11), 13 (12 without
// the ping-pong turns: no faster), 14 (12 with 64 / 216 registers, superseded), 16 / 17 (15 with
// the wgmma issue in one code copy per ring stage and f16 buffer, so that every descriptor is a
// uniform base + constant: ptxas then serialised every wgmma (gsb0 on each, a dummy HGMMA.64x8x16
// inserted), 16 % slower; 17 with conflict-free f16 V stores on top, no different), 18 (15 with a
// quarter of the softmax exponentials by a degree-3 polynomial on the FMA pipe, meant to unload the
// MUFU pipe that paces the exp phase: 5 % slower in round C, 948-950 vs 898-901 us: the ~10 extra
// instructions per exponential cost more issue than the MUFU saved).
// Barriers: full[s] (1 arrival + TMA bytes), empty[s] (8 consumer warps after S(i)
// completes + 3 converter warps after the conversion), vfull[2] (96 converter threads), vempty[2]
// (8 consumer warps after P V(i) completes), qempty (8 consumer warps after the item's first S, Q
// being in registers by then). Where one lane arrives for its warp, only that lane reads the shared
// words the arrival releases (entry headers, NaN records; broadcast by shuffles): racecheck orders
// accesses through an mbarrier only for the arriving thread (round A of session 12: 107 hazards
// between header rewrites and the reads of lanes 1-31 when the ring wraps, although __syncwarp
// orders them).
//
// Shared memory: 4 raw stages x 32 KB + 2 f16 V x 32 KB + 1 Q x 16 KB + 1 KB alignment = 209 KB
// dynamic, ~5 KB static. Registers: 168 at launch (384 threads), consumers 216 after setmaxnreg
// (no spills), scheduler + converters 64 (no spills; at 40, kernel 11, ptxas reported ~180-200
// bytes of spills in the scheduler warp's item preparation). Needs 16-byte
// aligned pool base and strides (TMA); otherwise, or when the driver refuses a tensor map, the
// launcher runs the cp.async wgmma kernel (kernel 4).
//
// Measured (H200, round 2, attention_bench --prefill, 8K chunk, TFLOP/s on the selected work):
// sparse @ 8K / 64K: kernel 6 359 / 364, 7 364 / 369, 8 370 / 374, kernel 4 347 / 351; dense @ 8K:
// 8 434 vs 401. The mma_work/flop column (1.03 sparse): the MMA work walked exceeds the counted
// work by 3 % (the causal part of each token's local block), tile unions are 16 blocks (14.1 at
// 8K, where early tokens see fewer) for 16 selected per token: the bench's selections share a
// ranking per 64 tokens, so the union costs nothing there. Session 12 round A (same bench, before
// the NaN and racecheck changes): kernel 10 sparse 915.0 / 1037.9 us = 511.8 / 513.3 TFLOP/s vs
// kernel 9 998.0 / 1111.6 us = 469.2 / 479.2; dense 599.4 / 615.7 vs 600.3 / 626.4. Session 13
// round A: kernel 11 sparse 923.0 / 1048.6 us = 507.4 / 508.0 TFLOP/s, lowoverlap 2187 us, dense
// 572.7 / 592.4 TFLOP/s. ncu of kernel 12 (per consumer warp and entry, ~3900 cycles): softmax
// ~1390, turn wait + wgmma issue ~630, S wait ~540, full wait + header ~450, epilogue ~310,
// rescale / pack ~210, vfull wait ~170; tensor pipe ~40 % busy.
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
#include <type_traits>

#include "core/cuda_check.h"
#include "core/tensor_map.h"
#include "m3attn/status.h"
#include "stages/attention/attention_prefill_ws_common.cuh"
#include "stages/attention/attention_prefill_ws_scheduler.cuh"

namespace m3attn {
namespace attention_prefill_ws {

// ---------------------------------------------------------------------------------------------
// Converter warps: raw V of every entry -> f16 buffer v % 2 (layout of ap::convert_v_by), in
// 16-byte raw chunks (16 dims), 4 per thread in flight (all loads issued before the conversions),
// rows past the V limit zeroed by selects (session 12: a plain 8-byte loop kept the 3 converter
// warps ~85 % busy and the consumers waiting for the f16 tile for 16 % of their samples).

// One 16-byte raw chunk c16 (dims 16 c16 .. + 15) of `key` -> two swizzled 16-byte f16 chunks.
__device__ __forceinline__ void store_f16_chunk(uint8_t* vh, int key, int c16, const uint4& raw) {
  uint4 lo, hi;
  ak::e4m3x16_to_f16(raw, lo, hi);
  // 8-dim chunks c8 = 2 c16, 2 c16 + 1: dims half c16 / 4, chunk (c8 % 8) ^ (key % 8).
  uint8_t* row = vh + (c16 >> 2) * kTileBytes + key * 128;
  const int c8 = 2 * c16;
  *reinterpret_cast<uint4*>(row + (((c8 & 7) ^ (key & 7)) << 4)) = lo;
  *reinterpret_cast<uint4*>(row + ((((c8 + 1) & 7) ^ (key & 7)) << 4)) = hi;
}

// NaN in V (the twin's semantics: a NaN V element at (key p, dim d) makes dim d of every head of
// every token that sees p NaN, and nothing else). Rows past the V limit are zeroed; in the shared
// P V wgmma a row whose token masks a key (P = 0) would still get 0 * NaN = NaN from it. So where
// some present token of the tile misses keys of the entry (keys klo + 1 .. vlim: the local block,
// blocks that not every token selected; klo from the header), the converters test the raw bytes
// in the conversion loop (~10 integer operations per 16-byte chunk; session 12 round B: a second
// pass over the keys made the MSA layer's prefill attention, whose tiles mostly have such blocks,
// 80 % slower) and, only when one was found, revisit their chunks: a NaN byte becomes 0
// in the f16 tile and the smallest such key of its dim is recorded with the entry's number
// (Shared::vnan_key, vnan_gen of the f16 buffer). A token's visible keys are a prefix 0 .. lim of
// the block, so it sees a recorded NaN of dim d iff that key <= lim: each consumer warp checks
// this per entry (one shared word unless the entry has a record) and its epilogue writes NaN in
// those dims. Elsewhere every present row sees the key and the NaN flows through the MMA as in
// the twin.
//
// NaN bytes (low 7 bits all set) of a 16-byte raw chunk: bit 7 of each such byte (0: none).
__device__ __forceinline__ uint32_t nan_bytes16(const uint4& r) {
  const uint32_t m = 0x7F7F7F7Fu, one = 0x01010101u;
  return (((r.x & m) + one) | ((r.y & m) + one) | ((r.z & m) + one) | ((r.w & m) + one)) &
         0x80808080u;
}

// One raw 4-byte word w (dims d0 .. d0 + 3 of `key`): NaN bytes cleared and recorded for entry
// gen - 1 (key_rec[d] = gen << 8 | (255 - key), gen_rec = gen, by atomicMax: numbers grow).
// Returns whether it had one.
__device__ __forceinline__ bool clear_nan_word(uint32_t& w, int key, int d0, uint32_t gen,
                                               uint32_t* key_rec, uint32_t* gen_rec) {
  uint32_t t = ((w & 0x7F7F7F7Fu) + 0x01010101u) & 0x80808080u;
  const bool any = t != 0u;
  while (t != 0u) {
    const int byte = (__ffs(t) - 1) >> 3;
    t &= t - 1u;
    w &= ~(0xFFu << (8 * byte));
    atomicMax(&key_rec[d0 + byte], gen << 8 | static_cast<uint32_t>(255 - key));
    atomicMax(gen_rec, gen);
  }
  return any;
}

__device__ __forceinline__ void converter_warps(Shared& sh, uint8_t* smem) {
  const int t = static_cast<int>(threadIdx.x) - 32;  // 0 .. 95
  const int lane = threadIdx.x & 31;
  for (uint32_t j = 0;; ++j) {  // entry j fills f16 buffer j % 2 (every entry carries a block)
    const int s = static_cast<int>(j % kStages);
    mbar_wait(bar_addr(sh.full[s]), (j / kStages) & 1);
    // The header is read by lane 0 alone, which also releases the stage (racecheck orders
    // accesses by the arriving thread only), and broadcast. Keys klo + 1 .. kmax are missed by
    // some present token (NaN test there).
    int info = 0, vlim = 0, klo = 0;
    if (lane == 0) {
      const Entry& e = sh.entry[s];
      info = ld_lane0(e.info);
      vlim = ld_lane0(e.vlim);
      klo = ld_lane0(e.klo);
    }
    info = __shfl_sync(0xffffffffu, info, 0);
    if (info_flags(info) & kEnd) return;
    vlim = __shfl_sync(0xffffffffu, vlim, 0);
    klo = __shfl_sync(0xffffffffu, klo, 0);
    const int kmax = min(vlim, ak::kBlockKeys - 1);
    const bool check = klo < kmax;
    const uint32_t gen = j + 1;
    const int vs = static_cast<int>(j & 1);
    uint32_t* key_rec = sh.vnan_key[vs];
    uint32_t* gen_rec = &sh.vnan_gen[vs];
    bool wrote = false;  // this thread recorded a NaN (it then arrives on vfull itself)
    uint32_t hit = 0u;   // a NaN byte in one of this thread's chunks (check only)
    if (j >= 2) mbar_wait(bar_addr(sh.vempty[vs]), ((j >> 1) - 1) & 1);
    const uint8_t* vraw = smem + s * kStageBytes + kTileBytes;
    uint8_t* vh = smem + kVhOff + vs * kVhBytes;
    {
      constexpr int kItems = ak::kBlockKeys * 8;  // 16-byte raw chunks
      constexpr int kN = 32 * kConvWarps;
      constexpr int kU = 4;  // items in flight per thread
      // Two copies of the loop, so that entries without a NaN test (every present token sees
      // every key) pay nothing for it (round C: one loop with a run-time test cost ~8 % on every
      // bench case).
      auto convert_all = [&](auto test) {
        constexpr bool kTest = decltype(test)::value;
#pragma unroll 1
        for (int i0 = t; i0 < kItems; i0 += kU * kN) {
          uint4 r[kU];
#pragma unroll
          for (int u = 0; u < kU; ++u) {
            const int i = min(i0 + u * kN, kItems - 1);  // past the end: a repeat, not stored
            const int key = i >> 3, c = i & 7;
            r[u] = *reinterpret_cast<const uint4*>(vraw + key * ak::kDim + ((c ^ (key & 7)) << 4));
            if (key > vlim) r[u] = make_uint4(0u, 0u, 0u, 0u);
            if constexpr (kTest) hit |= nan_bytes16(r[u]);
          }
#pragma unroll
          for (int u = 0; u < kU; ++u) {
            const int i = i0 + u * kN;
            if (i < kItems) store_f16_chunk(vh, i >> 3, i & 7, r[u]);
          }
        }
      };
      if (check)
        convert_all(std::true_type{});
      else
        convert_all(std::false_type{});
      // Rare: this thread's chunks had a NaN byte. It revisits them (it wrote their f16 chunks: no
      // barrier), clears and records the NaN bytes (a NaN of a key every present token sees may be
      // handled so too: its record marks the dim of every present token, as the MMA would).
      if (hit != 0u) {
#pragma unroll 1
        for (int i = t; i < kItems; i += kN) {
          const int key = i >> 3, c = i & 7;
          if (key > vlim) continue;
          uint4 w = *reinterpret_cast<const uint4*>(vraw + key * ak::kDim + ((c ^ (key & 7)) << 4));
          if (nan_bytes16(w) == 0u) continue;
          clear_nan_word(w.x, key, 16 * c, gen, key_rec, gen_rec);
          clear_nan_word(w.y, key, 16 * c + 4, gen, key_rec, gen_rec);
          clear_nan_word(w.z, key, 16 * c + 8, gen, key_rec, gen_rec);
          clear_nan_word(w.w, key, 16 * c + 12, gen, key_rec, gen_rec);
          store_f16_chunk(vh, key, c, w);
          wrote = true;
        }
      }
    }
    ap::fence_proxy_async();  // f16 stores -> wgmma (async proxy) reads
    // vfull counts 32 arrivals per converter warp: a lane that recorded a NaN arrives itself (its
    // records are read by consumer lane 0: racecheck orders them through the writer's own
    // arrival), lane 0 for the rest of the warp after __syncwarp (the f16 stores are read by the
    // wgmma, which racecheck does not track).
    const unsigned self = __ballot_sync(0xffffffffu, wrote) & ~1u;
    if (wrote && lane != 0) mbar_arrive(bar_addr(sh.vfull[vs]));
    __syncwarp();  // every lane has read the raw V tile and stored its f16 chunks
    if (lane == 0) {
      mbar_arrive_count(bar_addr(sh.vfull[vs]), 32u - __popc(self));
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
      // A row without keys is +0 exactly (its O may be -0: the first P V of an item overwrites O);
      // l is 0 only there. A NaN l (a NaN K or Q element the row sees) keeps the row NaN, as in
      // the twin (session 14: `l > 0` wrote +0 for it at splits 1; round B's test with one split
      // and 3 persistent CTAs found it).
      const bool keys = lsum[e] != 0.0f;
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

// NaN dims that this warp's token sees in entry gen - 1 (f16 buffer vs, visible keys 0 .. lim),
// ORed into bits (dim d: bit d % 32 of word d / 32; the same in every lane). Lane 0 alone reads the
// records (it releases the buffer: racecheck orders accesses by the arriving thread only).
__device__ __forceinline__ void add_nan_dims(const Shared& sh, int vs, uint32_t gen, int lim,
                                             uint32_t (&bits)[4]) {
  const int lane = threadIdx.x & 31;
  uint32_t g = 0u;
  if (lane == 0) g = ld_lane0(sh.vnan_gen[vs]);
  g = __shfl_sync(0xffffffffu, g, 0);
  if (g != gen) return;  // no record for this entry: the common case
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    uint32_t w = 0u;
    if (lane == 0) {
#pragma unroll 1
      for (int b = 0; b < 32; ++b) {
        const uint32_t v = ld_lane0(sh.vnan_key[vs][32 * q + b]);
        if ((v >> 8) == gen && 255 - static_cast<int>(v & 255u) <= lim) w |= 1u << b;
      }
    }
    bits[q] |= __shfl_sync(0xffffffffu, w, 0);
  }
}

// NaN in the dims of this warp's token that a V NaN reaches (rows grp, grp + 8; dims
// 8 jj + 2 tig + x).
__device__ __forceinline__ void apply_nan_dims(float (&o)[64], const uint32_t (&bits)[4]) {
  if ((bits[0] | bits[1] | bits[2] | bits[3]) == 0u) return;
  const int tig = threadIdx.x & 3;
#pragma unroll
  for (int jj = 0; jj < 16; ++jj)
#pragma unroll
    for (int x = 0; x < 2; ++x)
      if ((bits[jj >> 2] >> (8 * (jj & 3) + 2 * tig + x)) & 1u) {
        o[4 * jj + x] = __int_as_float(0x7fffffff);
        o[4 * jj + 2 + x] = __int_as_float(0x7fffffff);
      }
}

// What a consumer warp keeps of an entry header.
struct Cur {
  int info, t0, lim;
  __device__ __forceinline__ int flags() const { return info_flags(info); }
};

// Lane 0 alone reads the header (it releases the stage: racecheck orders accesses by the
// arriving thread only) and broadcasts it.
__device__ __forceinline__ Cur read_entry(const Entry& e, int tok) {
  int info = 0, t0 = 0, lim = 0;
  if ((threadIdx.x & 31) == 0) {
    info = ld_lane0(e.info);
    t0 = ld_lane0(e.t0);
    lim = ld_lane0(e.lim[tok]);
  }
  return Cur{__shfl_sync(0xffffffffu, info, 0), __shfl_sync(0xffffffffu, t0, 0),
             __shfl_sync(0xffffffffu, lim, 0)};
}

// Each warp copies its token's Q fragments from the item's Q tile into registers when the item
// starts (register-A QK wgmma); the one Q buffer is released after the item's first S.
__device__ __forceinline__ void consumer_warpgroups(const AttnArgs& a, Shared& sh, uint32_t base,
                                                    const uint8_t* smem) {
  const int ct = static_cast<int>(threadIdx.x) - 128;  // 0 .. 255
  const int wg = ct >> 7;
  const int tok = ct >> 5;  // warp of the consumers = token of the tile
  const int lane = ct & 31;
  float o[64], s[64];
  uint32_t p[8][4];
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, alpha[2] = {1.0f, 1.0f};
  uint32_t nan_bits[4] = {0u, 0u, 0u, 0u};  // dims a V NaN reaches in the current item
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.0f;

  // The m16n8k32 A fragments of this warp's 16 rows (heads grp, grp + 8 of token tok): k-step kk
  // holds bytes 32 kk + 4 tig .. + 3 and 32 kk + 16 + 4 tig .. + 3 of each row.
  uint32_t qa[4][4];
  auto load_q = [&] {
    const uint8_t* q = smem + kQOff;
    const int row0 = tok * ak::kRows + (lane >> 2), tig = lane & 3;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = row0 + 8 * (e & 1), off = 32 * kk + 16 * (e >> 1) + 4 * tig;
        qa[kk][e] = *reinterpret_cast<const uint32_t*>(
            q + row * 128 + (((off >> 4) ^ (row & 7)) << 4) + (off & 15));
      }
  };
  auto issue_qk = [&](int stage) {
    const uint32_t kaddr = base + stage * kStageBytes;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      ap::wgmma_qk_rs(s, qa[kk], ap::smem_desc(kaddr + 32 * kk, 16, 1024), kk > 0 ? 1 : 0);
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
  load_q();
  turn_wait(wg);
  ap::reg_fence(s);
  ap::wgmma_fence();
  issue_qk(0);
  ap::wgmma_commit();
  turn_pass(wg);
  ap::wgmma_wait<0>();
  ap::reg_fence(s);
  __syncwarp();  // every lane has read the header before the stage is released
  if (lane == 0) {
    mbar_arrive(bar_addr(sh.empty[0]));
    if (cur.flags() & kFirst) mbar_arrive(bar_addr(sh.qempty));
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
    if (nxt.flags() & kFirst) load_q();
    mbar_wait(bar_addr(sh.vfull[vs]), (j >> 1) & 1);
    // S(next) then P V(cur), in this warpgroup's turn.
    turn_wait(wg);
    ap::reg_fence(o);
    ap::reg_fence(s);
    ap::reg_fence(p);
    ap::wgmma_fence();
    issue_qk(ns);
    ap::wgmma_commit();
    issue_pv(vs, cur.flags());
    ap::wgmma_commit();
    turn_pass(wg);
    if (cur.flags() & kFirst) nan_bits[0] = nan_bits[1] = nan_bits[2] = nan_bits[3] = 0u;
    add_nan_dims(sh, vs, j + 1, cur.lim, nan_bits);
    ap::wgmma_wait<1>();  // S(next) done; P V(cur) may still run
    ap::reg_fence(s);
    __syncwarp();  // every lane has read the header before the stage is released
    if (lane == 0) {
      mbar_arrive(bar_addr(sh.empty[ns]));
      if (nxt.flags() & kFirst) mbar_arrive(bar_addr(sh.qempty));
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
      apply_nan_dims(o, nan_bits);
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
  if (cur.flags() & kFirst) nan_bits[0] = nan_bits[1] = nan_bits[2] = nan_bits[3] = 0u;
  add_nan_dims(sh, vs, j + 1, cur.lim, nan_bits);
  ap::wgmma_wait<0>();
  ap::reg_fence(o);
  apply_nan_dims(o, nan_bits);
  store_item(a, o, m, l, cur.t0, cur.info, tok);
}

// ---------------------------------------------------------------------------------------------
// The kernel. Grid: min(work items, SMs) persistent CTAs; block kThreads; dynamic smem kSmemBytes.
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
      mbar_init(bar_addr(sh.vfull[i]), 32 * kConvWarps);
      mbar_init(bar_addr(sh.vempty[i]), kConsumerWarps);
    }
    mbar_init(bar_addr(sh.qempty), kConsumerWarps);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  for (int i = threadIdx.x; i < 2 * ak::kDim; i += kThreads) (&sh.vnan_key[0][0])[i] = 0u;
  if (threadIdx.x < 2) sh.vnan_gen[threadIdx.x] = 0u;
  __syncthreads();

  if (warp < 4) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kLowRegs));
    if (warp == 0)
      scheduler_warp(a, &kmap, &vmap, &qmap, tiles, sh, base);
    else
      converter_warps(sh, smem);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kHighRegs));
    consumer_warpgroups(a, sh, base, smem);
  }
}

// ---------------------------------------------------------------------------------------------
// Host side.

// cuTensorMapEncodeTiled from the driver (core/tensor_map.h); nullptr if missing.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  Result<PFN_cuTensorMapEncodeTiled_v12000> fn = tensor_map_encode_fn();
  if (fn.ok()) return fn.value();
  (void)cudaGetLastError();
  return nullptr;
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
inline Status launch(const AttnArgs& a, int64_t tiles, int max_ctas, cudaStream_t stream,
                     bool* launched) {
  *launched = false;
  if (tiles <= 0) return Status::Ok();
  const int64_t work = tiles * a.n_kv * a.splits;
  if (work > (int64_t{1} << 30)) return Status::Ok();
  CUtensorMap kmap, vmap, qmap;
  if (!encode_maps(a, &kmap, &vmap, &qmap)) return Status::Ok();
  auto kernel = attention_prefill_ws_kernel;
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
