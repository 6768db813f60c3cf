// Hopper decode / verify path of the paged FP8 attention (SPEC section 6): one warpgroup per CTA,
// the 4 query tokens of a speculative-verify tile (1 + draft_len tokens of ONE request) x the 16
// query heads of one KV head = the 64 rows of one wgmma tile. attention_kernel.cuh keeps the
// mma.sync kernel (single-token decode, fallback); attention_prefill_wgmma.cuh the 8-token prefill
// kernel. All three write the same outputs and the same split workspace (attention_merge_kernel).
//
// Work decomposition
//   A CTA (128 threads, 2 resident per SM) owns one (tile of <= 4 consecutive query tokens of one
//   request, KV head g, split s). Warp w of the warpgroup is token w: rows 16 w .. 16 w + 15 of
//   every wgmma fragment are its 16 query heads, so masks are per warp (token) and per column
//   (key). The CTA walks the union of its tokens' selected blocks (sparse; ak::sparse_union) or
//   blocks 0 .. max_pos / 128 (dense), loading each distinct block ONCE for all 64 rows; an entry
//   carries the mask of the tokens that see it, and a row attends a key only when its token
//   selected the block and the key is not in its future (the local block's causal mask).
//
// Per block (128 keys), stage = [K tile | V tile] raw E4M3 (32 KB, 1024-aligned, 128-byte swizzle
//   as ak::load_block writes it), 3-stage cp.async ring (2 blocks in flight while one is used):
//   - S = Q K^T: 4 x wgmma m64n128k32 e4m3 (A = the warp's Q fragments in registers, B = the K tile
//     as stored: K-major).
//   - V -> f16 in place: once S is done (barrier), the K half of the stage is free. Each warp
//     converts its 32 keys (cvt.rn.f16x2.e4m3x2, exact): dims 0-63 into the K half, dims 64-127
//     over its own raw V rows (a warp reads its rows into registers before it overwrites them:
//     no other warp touches them), MN-major with the 128-byte swizzle (LBO 16 KB between the two
//     dim halves, SBO 1 KB), the layout of the prefill kernel's f16 tile. No extra shared memory:
//     3 stages = 96 KB per CTA, 2 CTAs per SM, 4 blocks (128 KB) in flight per SM.
//   - Online softmax per row in fp32 (ap::softmax_block: masked scores are -inf, so masked P is
//     exactly +0), P packed to f16 in the accumulator layout (register A operand).
//   - O += P V: 8 x wgmma m64n128k16 f16 (B = the f16 tile, transposed-B flag).
//   The two CTAs of an SM overlap each other's tensor work with softmax / conversion.
//
// NaN in V (exact twin semantics, no leak across rows): a NaN V element at (key p, dim d) must
//   make dim d of every head of every token that sees p NaN, and nothing else; in a shared MMA a
//   row with P = 0 would otherwise get 0 * NaN = NaN. The conversion flags raw NaN bytes (rows the
//   tile sees only; rows past every selecting token's position are zeroed); when a block has one
//   (__syncthreads_or, free: the barrier is needed anyway), the rare path replaces the NaN by 0 in
//   the f16 tile and records (token, dim) for each token that sees the key; the epilogue writes NaN
//   there. NaN in K or Q: the score is NaN only in rows that see the key (masking replaces the
//   score with -inf), so their whole row becomes NaN, as in the twin.
//
// Bytes and bound (verify B256 x 4 tokens, 16 shared blocks): 32 KB per (block, CTA) from HBM;
//   per block 64 x 128 x 128 x 2 x 2 = 4.2 MFLOP (~256 cycles FP8 QK + ~512 cycles f16 PV of the
//   SM's tensor rate), 8 K exp2 (~512 MUFU cycles), 8 K e4m3 pair conversions; at 4.3 TB/s an SM
//   receives a block every ~1 us (~1.8 K cycles). Measured (H200, session 11 round 2): 192 us =
//   65 % of copy (the mma.sync kernel: 404 us). ncu: ~1100 instructions per warp and block
//   (softmax ~370, V conversion and its NaN check ~300, addressing ~250), 2 warps per scheduler
//   issuing 43 % of cycles, the rest waiting on the wgmma (P V, S), barriers and shared-memory
//   latency: latency- and issue-bound, not yet HBM-bound. Tried in round 3 and dropped (slower on
//   the H200): a software-pipelined variant (S(i + 1) and its softmax under P V(i), lazy running
//   maximum), skipping the NaN check in blocks every token sees whole, shift-free conversions
//   (together 3-7 % slower than this version); an L2 prefetch ahead of the ring (4 % slower).
//   Session 12 (round A, H200, isolated / back-to-back us at B256 x 4 @ 8K; variants below):
//   v1 192.4 / 187.0, v3 189.7 / 184.7 (now the automatic choice), v4 191.6 / 186.7, v5 206.7,
//   v2 227.8: 3 CTAs per SM with a 2-stage ring lose (1 block in flight per CTA, spills). Splitting
//   a tile's blocks over more CTAs costs ~7 us per extra CTA generation per slot (splits sweep:
//   B256 x 4 257 us with 2 splits): each CTA start pays the dependent chain query_start -> ids ->
//   page table -> first block under a loaded memory system; hiding it needs CTAs that prepare the
//   next work item while streaming the current one (persistent), not more CTAs.
#pragma once

#include <cstdint>

#include "stages/attention/attention_kernel.cuh"
#include "stages/attention/attention_prefill_wgmma.cuh"
#include "stages/attention/attention_prefill_ws_common.cuh"

namespace m3attn {
namespace attention_verify {

namespace ak = attention_kernel;
namespace ap = attention_prefill;
using ak::AttnArgs;

constexpr int kThreads = 128;  // one warpgroup
constexpr int kQT = 4;         // query tokens per tile: 4 x 16 heads = 64 wgmma rows
constexpr int kTileBytes = ak::kTileBytes;
constexpr int kStageBytes = 2 * kTileBytes;
// Variants (AttentionCudaConfig::verify_variant; session 12):
//   1  the session-11 kernel: 3-stage ring (96 KB, 2 CTAs per SM, 2 blocks in flight per CTA);
//   2  2-stage ring (64 KB, 3 CTAs per SM: 12 warps instead of 8 to hide latency, 1 block in
//      flight per CTA while it computes);
//   3  as 1, with the V conversion started under the S wgmma (convert_v_high / convert_v_low);
//   4  as 3, and V bytes checked for NaN only in blocks that some present token does not see
//      whole (where every present token sees every key, a NaN V element lands in exactly the
//      rows and dims where the twin puts it: no scrub needed; padding rows are never written);
//   5  as 4 with a 2-stage ring, Q in shared memory (8 KB, the S wgmma reads A from it: 16
//      registers fewer) and 64-entry block lists, so that 3 CTAs fit an SM's registers (168 per
//      thread) and shared memory (3 x ~75.5 KB);
//   6  as 4 with each block's K and V tiles loaded by two TMA copies (thread 0, one mbarrier per
//      stage; the tensor maps of the warp-specialised prefill kernel, 128-byte swizzle = the
//      layout ak::load_block writes) instead of 16 cp.async per thread and block;
//   7  as 5 with the TMA loads of 6;
//   8  as 3 with the wait for P V(i) deferred: S(i + 1) and the early V conversion of block i + 1
//      are issued while P V(i) still runs; the refill of block i's stage (with block i + 3) moves
//      from the top of iteration i + 1 to its second barrier, after which every warp's P V(i) is
//      complete;
//   9  as 8 with the TMA loads of 6.
//   Variants 6, 7, 9 need TMA-addressable pools (16-byte base and strides, maps the driver
//   accepts); elsewhere the launcher runs 4, 5, 8 instead.
constexpr int stages_of(int variant) {
  return variant == 2 || variant == 5 || variant == 7 ? 2 : 3;
}
constexpr bool early_v_of(int variant) { return variant >= 3; }
constexpr bool nan_partial_only_of(int variant) { return variant >= 4 && variant <= 7; }
constexpr bool q_smem_of(int variant) { return variant == 5 || variant == 7; }
constexpr bool tma_of(int variant) { return variant == 6 || variant == 7 || variant == 9; }
constexpr bool defer_pv_of(int variant) { return variant == 8 || variant == 9; }
constexpr int kQTileBytes = kQT * ak::kRows * ak::kDim;  // 64 rows x 128 bytes
constexpr int smem_bytes(int variant) {
  return stages_of(variant) * kStageBytes + (q_smem_of(variant) ? kQTileBytes : 0) +
         1024;  // + slack to align the base to 1 KB
}
constexpr int ctas_per_sm(int variant) { return stages_of(variant) == 2 ? 3 : 2; }
constexpr int list_of(int variant) { return q_smem_of(variant) ? 64 : 128; }
constexpr int kCand = kQT * ak::kTopKIds;
constexpr int kMaxList = 128;  // block entries held in shared memory at once (list_of: <=)
constexpr int kKeysPerWarp = ak::kBlockKeys / 4;
static_assert(kQT * ak::kRows == 64, "a warp is one token's 16 heads");
static_assert(kThreads == ak::kThreads, "ak::load_block copies with ak::kThreads threads");
static_assert(kCand <= kThreads && kCand <= kMaxList, "one candidate per thread");

// Nonzero when one of the 4 bytes of w is an E4M3 NaN (0x7F or 0xFF): (b & 0x7F) + 1 carries into
// bit 7 only for 0x7F, and never into the next byte.
__device__ __forceinline__ uint32_t e4m3x4_nan_bits(uint32_t w) {
  return ((w & 0x7F7F7F7Fu) + 0x01010101u) & 0x80808080u;
}

// One 16-byte raw chunk (16 dims) -> two f16 chunks (8 dims each).
__device__ __forceinline__ void e4m3x16_to_f16(const uint4& raw, uint4& h0, uint4& h1) {
  h0.x = ak::e4m3x2_to_f16x2(raw.x);
  h0.y = ak::e4m3x2_to_f16x2(raw.x >> 16);
  h0.z = ak::e4m3x2_to_f16x2(raw.y);
  h0.w = ak::e4m3x2_to_f16x2(raw.y >> 16);
  h1.x = ak::e4m3x2_to_f16x2(raw.z);
  h1.y = ak::e4m3x2_to_f16x2(raw.z >> 16);
  h1.z = ak::e4m3x2_to_f16x2(raw.w);
  h1.w = ak::e4m3x2_to_f16x2(raw.w >> 16);
}

// Address of the f16 chunk u (dims 64 half + 8 u .. + 7) of key `key` in the converted tile of a
// stage: half 0 over the K tile, half 1 over the V tile.
__device__ __forceinline__ uint8_t* f16_chunk(uint8_t* stage, int half, int key, int u) {
  return stage + half * kTileBytes + key * ak::kDim + ((u ^ (key & 7)) << 4);
}

// This warp's keys [32 warp, 32 warp + 32) of the raw V tile of `stage` -> f16 (see the header);
// keys > vlim become 0. The K half must be free (S done by every warp). Returns nonzero when a
// converted raw byte is NaN. Two passes of 16 keys: a pass reads its rows, then overwrites them.
__device__ __forceinline__ uint32_t convert_v_in_place(uint8_t* stage, int vlim) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint8_t* vraw = stage + kTileBytes;
  uint32_t nan = 0;
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
    uint4 raw[4];
#pragma unroll
    for (int it = 0; it < 4; ++it) {
      const int i = (pass * 4 + it) * 32 + lane;
      const int key = kKeysPerWarp * warp + (i >> 3), c = i & 7;
      raw[it] = make_uint4(0u, 0u, 0u, 0u);
      if (key <= vlim)
        raw[it] = *reinterpret_cast<const uint4*>(vraw + key * ak::kDim + ((c ^ (key & 7)) << 4));
      nan |= e4m3x4_nan_bits(raw[it].x) | e4m3x4_nan_bits(raw[it].y) | e4m3x4_nan_bits(raw[it].z) |
             e4m3x4_nan_bits(raw[it].w);
    }
    __syncwarp();  // every lane read this pass's rows before any lane overwrites them
#pragma unroll
    for (int it = 0; it < 4; ++it) {
      const int i = (pass * 4 + it) * 32 + lane;
      const int key = kKeysPerWarp * warp + (i >> 3), c = i & 7;
      uint4 h0, h1;
      e4m3x16_to_f16(raw[it], h0, h1);
      *reinterpret_cast<uint4*>(f16_chunk(stage, c >> 2, key, 2 * (c & 3))) = h0;
      *reinterpret_cast<uint4*>(f16_chunk(stage, c >> 2, key, 2 * (c & 3) + 1)) = h1;
    }
  }
  return nan;
}

// Early V conversion (template kEarlyV), run while the S wgmma is in flight: the K half is still
// being read, so only dims 64-127 can be written (over the V tile's own raw rows) before S is done.
// Lane (q = lane / 8, hl = bit 2 of the lane, cl = lane % 4) owns, for j = 0 .. 3, the chunk
// 4 + cl (dims 64 + 16 cl ..) of key kh = 32 warp + 4 (2 j + 1 - hl) + q and the chunk cl (dims
// 16 cl ..) of key kl = 32 warp + 4 (2 j + hl) + q: every lane holds 4 high and 4 low chunks (the
// low ones stay raw in registers until S is done), and each 8-lane phase of a load touches 8
// distinct 16-byte bank groups (keys kh of the two lane halves differ by 4 in their swizzle).
__device__ __forceinline__ int early_key(int j, bool high) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int hl = (lane >> 2) & 1;
  return kKeysPerWarp * warp + 4 * (2 * j + (high ? 1 - hl : hl)) + (lane >> 3);
}

// Reads this warp's raw V rows (keys > vlim read as 0), writes the f16 of dims 64-127 in place,
// keeps the raw dims 0-63 chunks in `lo`. Returns nonzero when a raw byte read is NaN (kCheckNaN;
// else 0).
template <bool kCheckNaN>
__device__ __forceinline__ uint32_t convert_v_high(uint8_t* stage, int vlim, uint4 (&lo)[4]) {
  const int cl = threadIdx.x & 3;
  const uint8_t* vraw = stage + kTileBytes;
  uint4 hi[4];
  uint32_t nan = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int kh = early_key(j, true), kl = early_key(j, false);
    hi[j] = make_uint4(0u, 0u, 0u, 0u);
    lo[j] = make_uint4(0u, 0u, 0u, 0u);
    if (kh <= vlim)
      hi[j] = *reinterpret_cast<const uint4*>(vraw + kh * ak::kDim + (((4 + cl) ^ (kh & 7)) << 4));
    if (kl <= vlim)
      lo[j] = *reinterpret_cast<const uint4*>(vraw + kl * ak::kDim + ((cl ^ (kl & 7)) << 4));
    if (kCheckNaN)
      nan |= e4m3x4_nan_bits(hi[j].x) | e4m3x4_nan_bits(hi[j].y) | e4m3x4_nan_bits(hi[j].z) |
             e4m3x4_nan_bits(hi[j].w) | e4m3x4_nan_bits(lo[j].x) | e4m3x4_nan_bits(lo[j].y) |
             e4m3x4_nan_bits(lo[j].z) | e4m3x4_nan_bits(lo[j].w);
  }
  __syncwarp();  // every lane read the warp's rows before any lane overwrites them
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int kh = early_key(j, true);
    uint4 h0, h1;
    e4m3x16_to_f16(hi[j], h0, h1);
    *reinterpret_cast<uint4*>(f16_chunk(stage, 1, kh, 2 * cl)) = h0;
    *reinterpret_cast<uint4*>(f16_chunk(stage, 1, kh, 2 * cl + 1)) = h1;
  }
  return nan;
}

// The dims 0-63 chunks kept by convert_v_high -> f16 into the K half (free: S done by every warp).
__device__ __forceinline__ void convert_v_low(uint8_t* stage, const uint4 (&lo)[4]) {
  const int cl = threadIdx.x & 3;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int kl = early_key(j, false);
    uint4 h0, h1;
    e4m3x16_to_f16(lo[j], h0, h1);
    *reinterpret_cast<uint4*>(f16_chunk(stage, 0, kl, 2 * cl)) = h0;
    *reinterpret_cast<uint4*>(f16_chunk(stage, 0, kl, 2 * cl + 1)) = h1;
  }
}

// The rare path of a block with a NaN V byte: this warp's keys of the f16 tile, NaN -> 0, and for
// each token w of `mask` that sees the key (key <= pos_w - 128 b) the bit of (w, dim) in s_nan.
__device__ __noinline__ void scrub_nan_rows(uint8_t* stage, int vlim, int mask, int b,
                                            const int* s_pos, uint32_t (*s_nan)[4]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int it = 0; it < 8; ++it) {
    const int i = it * 32 + lane;
    const int key = kKeysPerWarp * warp + (i >> 3), c = i & 7;
    if (key > vlim) continue;
    for (int e = 0; e < 2; ++e) {
      uint16_t* h = reinterpret_cast<uint16_t*>(f16_chunk(stage, c >> 2, key, 2 * (c & 3) + e));
      for (int j = 0; j < 8; ++j) {
        if ((h[j] & 0x7fffu) <= 0x7c00u) continue;  // not NaN
        h[j] = 0;
        const int dim = 16 * c + 8 * e + j;
        for (int w = 0; w < kQT; ++w)
          if (((mask >> w) & 1) && key <= s_pos[w] - b * ak::kBlockKeys)
            atomicOr(&s_nan[w][dim >> 5], 1u << (dim & 31));
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The decode / verify kernel. Grid: (tiles bound x n_kv, 1, splits); block: kThreads; dynamic smem
// smem_bytes(kVariant).
template <bool kVec16, int kVariant>
__global__ void __launch_bounds__(kThreads, ctas_per_sm(kVariant))
    attention_verify_kernel(const __grid_constant__ AttnArgs a,
                            const __grid_constant__ CUtensorMap kmap,
                            const __grid_constant__ CUtensorMap vmap) {
  static_assert(kVariant >= 1 && kVariant <= 9, "variants 1 .. 9");
  constexpr bool kTma = tma_of(kVariant);
  constexpr bool kDeferPV = defer_pv_of(kVariant);
  static_assert(!kTma || kVec16, "TMA needs 16-byte aligned pools");
  constexpr int kStages = stages_of(kVariant);
  constexpr bool kEarlyV = early_v_of(kVariant);
  constexpr bool kNaNPartialOnly = nan_partial_only_of(kVariant);
  constexpr bool kQSmem = q_smem_of(kVariant);
  constexpr int kList = list_of(kVariant);  // block entries held at once
  static_assert(kCand <= kList, "a sparse union fits the list");
  extern __shared__ uint8_t smem_raw[];
  __shared__ int s_warp[kThreads / 32];
  __shared__ int s_tile[3];
  __shared__ int s_pos[kQT];
  __shared__ int s_cand_b[kCand];
  __shared__ int s_cand_page[kCand];
  __shared__ int s_list_b[kList];
  __shared__ int s_list_page[kList];
  __shared__ int s_list_mask[kList];
  __shared__ int s_list_vlim[kList];
  __shared__ uint32_t s_nan[kQT][4];  // (token, dim) bits of NaN V elements the token sees
  __shared__ __align__(8) uint64_t s_full[kStages];  // kTma: K and V of the stage landed

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int grp = lane >> 2, tig = lane & 3;
  const int tok = warp;
  // Tile-major grid: the KV heads of a tile are neighbours, and the CTAs past the last real tile
  // (the grid is sized for the worst token distribution) come last, where they fill the tail.
  const int tile = static_cast<int>(blockIdx.x) / a.n_kv;
  const int g = static_cast<int>(blockIdx.x) % a.n_kv, split = blockIdx.z;

  const uint32_t raw_u32 = ak::smem_u32(smem_raw);
  const uint32_t base = (raw_u32 + 1023u) & ~1023u;
  uint8_t* smem = smem_raw + (base - raw_u32);

  ak::TileInputs in;
  if (!ak::find_tile_and_load<kQT, kThreads>(a, tile, g, s_warp, s_tile, in))
    return;  // CTA-uniform
  const int r = s_tile[0], t0 = s_tile[1], nt = s_tile[2];
  const int cand_b = in.cand_b, cand_pos = in.cand_pos;
  // Q: the A fragments of this warp's token (register-A QK wgmma: warp w = rows 16 w ..).
  uint32_t qa[4][4];
  const uint32_t q_addr = base + kStages * kStageBytes;  // kQSmem: the Q tile (1 KB aligned)
  if constexpr (kQSmem) {
    // Row 16 w + h = head h of token w, 128 bytes, 128-byte swizzle (the K tile's layout, K-major
    // A operand); rows of absent tokens or heads >= group are zero.
    uint8_t* qs = smem + kStages * kStageBytes;
#pragma unroll
    for (int it = 0; it < kQTileBytes / 16 / kThreads; ++it) {
      const int i = it * kThreads + tid;
      const int row = i >> 3, c = i & 7;
      const int w = row >> 4, h = row & 15;
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (w < nt && h < a.group)
        v = *reinterpret_cast<const uint4*>(a.q + static_cast<int64_t>(t0 + w) * a.q_stride_t +
                                            static_cast<int64_t>(g * a.group + h) * ak::kDim +
                                            c * 16);
      *reinterpret_cast<uint4*>(qs + row * ak::kDim + ((c ^ (row & 7)) << 4)) = v;
    }
    ap::fence_proxy_async();  // generic Q stores -> wgmma reads (after the barrier below)
  } else {
    ak::load_q_fragments(a, g, t0 + tok, tok < nt, qa);
  }
  if (tid < kQT) s_pos[tid] = in.pos;
  if (tid < kQT * 4) s_nan[tid >> 2][tid & 3] = 0u;
  if (kTma && tid == 0) {
#pragma unroll
    for (int st = 0; st < kStages; ++st) sm90::mbar_init(ak::smem_u32(&s_full[st]), 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();           // s_pos, s_nan, s_full
  uint32_t full_parity = 0;  // kTma: bit st = parity of the next completion of stage st
  // Block j of the current list into stage st: cp.async by every thread (one commit group per
  // block, empty ones included), or two TMA copies issued by thread 0 (kTma).
  auto load = [&](int j, int count, const int* lmask, const int* lpage, int st) {
    if constexpr (kTma) {
      if (tid == 0 && j < count && lmask[j]) {
        const uint32_t bar = ak::smem_u32(&s_full[st]);
        const uint32_t dst = base + st * kStageBytes;
        sm90::mbar_arrive_expect_tx(bar, kStageBytes);
        attention_prefill_ws::tma_load_4d(dst, &kmap, 0, 0, g, lpage[j], bar);
        attention_prefill_ws::tma_load_4d(dst + kTileBytes, &vmap, 0, 0, g, lpage[j], bar);
      }
    } else {
      if (j < count && lmask[j]) ak::load_block<kVec16>(a, lpage[j], g, smem + st * kStageBytes);
      ak::cp_async_commit();
    }
  };

  const int64_t pt_row = static_cast<int64_t>(r) * a.pt_stride;
  int n_total = 0;
  if (a.sparse) {
    n_total =
        ak::sparse_union<kQT, kThreads>(a, pt_row, cand_b, cand_pos, s_pos, s_cand_b, s_cand_page,
                                        s_warp, s_list_b, s_list_page, s_list_mask, s_list_vlim);
  } else {
    int maxpos = -1;
#pragma unroll
    for (int w = 0; w < kQT; ++w) maxpos = max(maxpos, s_pos[w]);
    n_total = maxpos >= 0 ? min((maxpos >> 7) + 1, a.max_pages) : 0;
  }
  __syncthreads();

  const int per = (n_total + a.splits - 1) / a.splits;
  const int lo = min(n_total, split * per);
  const int hi = min(n_total, lo + per);

  float o[64];
  float s[64];
  uint32_t p[8][4];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, alpha[2] = {1.0f, 1.0f};
  const int my_pos = s_pos[tok];
  // kNaNPartialOnly: the present tokens' mask and their smallest position.
  const int all_mask = (1 << nt) - 1;
  int min_pos = s_pos[0];
#pragma unroll
  for (int w = 1; w < kQT; ++w)
    if (w < nt) min_pos = min(min_pos, s_pos[w]);

  for (int c0 = lo; c0 < hi; c0 += kList) {
    const int count = min(hi - c0, kList);
    int off = c0;
    if (!a.sparse) {
      __syncthreads();  // the previous chunk's entries are no longer read
      ak::dense_entries<kQT, kThreads>(a, pt_row, c0, count, s_pos, s_list_b, s_list_page,
                                       s_list_mask, s_list_vlim);
      __syncthreads();
      off = 0;
    }
    const int* lmask = s_list_mask + off;
    const int* lb = s_list_b + off;
    const int* lpage = s_list_page + off;
    const int* lvlim = s_list_vlim + off;

    // Ring: blocks 0 .. kStages-2 in flight before the loop; iteration i waits for block i (one
    // commit group per block, empty ones included; kTma: the stage's mbarrier, loaded entries
    // only), then refills the stage of block i - 1 (free: every warp finished P V(i - 1) and
    // fenced its generic f16 stores before the barrier) with block i + kStages - 1. An entry no
    // token sees is not loaded: its stage holds stale bytes, every row masks its keys and its V
    // rows are zeroed (vlim -1).
#pragma unroll
    for (int j = 0; j < kStages - 1; ++j) load(j, count, lmask, lpage, j);
    for (int j = kStages - 1; j < min(count, kStages - 1 + a.prefetch); ++j)
      if (lmask[j]) ak::prefetch_block_l2<kVec16>(a, lpage[j], g);
    int stage = 0;
    for (int i = 0; i < count; ++i) {
      if constexpr (kTma) {
        if (lmask[i]) {  // loaded (CTA-uniform): wait for its TMA bytes
          sm90::mbar_wait(ak::smem_u32(&s_full[stage]), (full_parity >> stage) & 1u);
          full_parity ^= 1u << stage;
        }
      } else {
        ak::cp_async_wait<kStages - 2>();
      }
      // Block i landed for every thread; the stage of block i - 1 is free (kDeferPV: after the
      // second barrier below).
      __syncthreads();
      // Block i + kStages - 1 into the stage of block i - 1 (cur: the stage of block i).
      auto refill = [&](int cur) {
        const int j = i + kStages - 1;
        const int sj = cur == 0 ? kStages - 1 : cur - 1;
        load(j, count, lmask, lpage, sj);
        const int jp = j + a.prefetch;
        if (a.prefetch > 0 && jp < count && lmask[jp])
          ak::prefetch_block_l2<kVec16>(a, lpage[jp], g);
      };
      if constexpr (!kDeferPV) refill(stage);
      uint8_t* sbuf = smem + stage * kStageBytes;
      const uint32_t saddr = base + stage * kStageBytes;
      stage = stage + 1 == kStages ? 0 : stage + 1;
      const int mask = lmask[i];
      const int b = lb[i];
      const int vlim = mask ? lvlim[i] : -1;
      const int lim = (mask >> tok) & 1 ? my_pos - b * ak::kBlockKeys : -1;

      // S = Q K^T.
      ap::reg_fence(s);
      ap::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        if constexpr (kQSmem)
          ap::wgmma_qk(s, ap::smem_desc(q_addr + 32 * kk, 16, 1024),
                       ap::smem_desc(saddr + 32 * kk, 16, 1024), kk > 0 ? 1 : 0);
        else
          ap::wgmma_qk_rs(s, qa[kk], ap::smem_desc(saddr + 32 * kk, 16, 1024), kk > 0 ? 1 : 0);
      ap::wgmma_commit();
      uint32_t nan = 0;
      if constexpr (kEarlyV) {
        // Dims 64-127 of V while S runs (it reads only the K half), dims 0-63 after.
        uint4 vlo[4];
        const bool whole = kNaNPartialOnly && mask == all_mask &&
                           min_pos - b * ak::kBlockKeys >= ak::kBlockKeys - 1;
        nan =
            whole ? convert_v_high<false>(sbuf, vlim, vlo) : convert_v_high<true>(sbuf, vlim, vlo);
        ap::wgmma_wait<0>();  // S(i) (and kDeferPV: P V(i - 1))
        ap::reg_fence(s);
        if constexpr (kDeferPV) ap::reg_fence(o);
        __syncthreads();  // every warp's S is done: the K half is free (kDeferPV: P V(i - 1) too)
        if constexpr (kDeferPV) refill(stage == 0 ? kStages - 1 : stage - 1);
        convert_v_low(sbuf, vlo);
      } else {
        ap::wgmma_wait<0>();
        ap::reg_fence(s);
        __syncthreads();  // every warp's S is done: the K half is free
        nan = convert_v_in_place(sbuf, vlim);
      }
      ap::fence_proxy_async();  // f16 stores -> wgmma reads (after the barrier below)
      ap::softmax_block(s, m, l, alpha, lim, a.scale_log2);
      ap::rescale_and_pack<true>(o, s, alpha, p);
      if (__syncthreads_or(nan != 0u)) {  // f16 tile complete (and a NaN in it: rare)
        scrub_nan_rows(sbuf, vlim, mask, b, s_pos, s_nan);
        ap::fence_proxy_async();
        __syncthreads();
      }

      // O += P V.
      ap::reg_fence(o);
      ap::reg_fence(p);
      ap::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 8; ++kk)
        ap::wgmma_pv(o, p[kk], ap::smem_desc(saddr + kk * 2048, kTileBytes, 1024));
      ap::wgmma_commit();
      if constexpr (!kDeferPV) {
        ap::wgmma_wait<0>();
        ap::reg_fence(o);
      }
    }
    if constexpr (kDeferPV) {
      ap::wgmma_wait<0>();  // the last P V
      ap::reg_fence(o);
    }
    ak::cp_async_wait<0>();
    __syncthreads();  // stages and entries are free for the next chunk; s_nan complete
  }

  // Epilogue: rows grp and grp + 8 of this warp = heads grp, grp + 8 of token `tok`; dims
  // 8 j + 2 tig (+1) in o[4 j + 2 e] (+1).
  float lsum[2] = {l[0], l[1]};
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    lsum[e] += __shfl_xor_sync(0xffffffffu, lsum[e], 1);
    lsum[e] += __shfl_xor_sync(0xffffffffu, lsum[e], 2);
  }
  if (tok >= nt) return;
  uint32_t nan_dims[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) nan_dims[k] = s_nan[tok][k];
  const bool any_nan = (nan_dims[0] | nan_dims[1] | nan_dims[2] | nan_dims[3]) != 0u;
  if (any_nan) {
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        const int dim = 8 * j + 2 * tig + (x & 1);
        if ((nan_dims[dim >> 5] >> (dim & 31)) & 1u) o[4 * j + x] = __int_as_float(0x7fffffff);
      }
  }
  const int64_t t = t0 + tok;
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int h = grp + 8 * e;
    if (h >= a.group) continue;
    if (a.splits == 1) {
      const float inv = lsum[e] > 0.0f ? 1.0f / lsum[e] : 0.0f;
      uint16_t* orow = a.out + t * a.out_stride + static_cast<int64_t>(g * a.group + h) * ak::kDim;
#pragma unroll
      for (int j = 0; j < 16; ++j)
        *reinterpret_cast<uint32_t*>(orow + 8 * j + 2 * tig) =
            ak::pack_bf16x2(o[4 * j + 2 * e] * inv, o[4 * j + 2 * e + 1] * inv);
    } else {
      const int64_t slot = (t * a.n_kv + g) * a.splits + split;
      float* orow = a.ws_o + (slot * ak::kRows + h) * ak::kDim;
#pragma unroll
      for (int j = 0; j < 16; ++j)
        *reinterpret_cast<float2*>(orow + 8 * j + 2 * tig) =
            make_float2(o[4 * j + 2 * e], o[4 * j + 2 * e + 1]);
      if (tig == 0) {
        a.ws_ml[(slot * ak::kRows + h) * 2] = m[e];
        a.ws_ml[(slot * ak::kRows + h) * 2 + 1] = lsum[e];
      }
    }
  }
}

}  // namespace attention_verify
}  // namespace m3attn
