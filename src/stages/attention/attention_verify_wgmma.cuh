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
//   Serial variant (the default): S, conversion, softmax, P V in turn; the two CTAs of an SM
//   overlap each other's phases. Pipelined variant (kPipe, AttentionCudaConfig::verify_pipeline =
//   2): S of block i + 1 is issued before P V(i), and the conversion of V(i + 1) and its softmax
//   run while P V(i) is on the tensor cores (Q then sits in an 8 KB shared tile, to stay under 255
//   registers).
//
// NaN in V (exact twin semantics, no leak across rows): a NaN V element at (key p, dim d) must
//   make dim d of every head of every token that sees p NaN, and nothing else; in a shared MMA a
//   row with P = 0 would otherwise get 0 * NaN = NaN. Rows past every selecting token's position
//   are zeroed. When every present token of the tile sees every converted key of a block (the
//   common case), a NaN lands exactly where the twin puts it and nothing is checked; otherwise
//   the conversion flags raw NaN bytes and, when a block has one (__syncthreads_or: the barrier is
//   needed anyway), the rare path replaces the NaN by 0 in the f16 tile and records (token, dim)
//   for each token that sees the key; the epilogue writes NaN there. NaN in K or Q: the score is
//   NaN only in rows that see the key (masking replaces the score with -inf), so their whole row
//   becomes NaN, as in the twin.
//
// Bytes and bound (verify B256 x 4 tokens, 16 shared blocks): 32 KB per (block, CTA) from HBM;
//   per block 64 x 128 x 128 x 2 x 2 = 4.2 MFLOP (~256 cycles FP8 QK + ~512 cycles f16 PV of the
//   SM's tensor rate), 8 K exp2 (~512 MUFU cycles), 8 K e4m3 pair conversions; at 4.3 TB/s an SM
//   receives a block every ~1 us (~1.8 K cycles). Measured (H200, round 2 of session 11, serial
//   variant): 192 us = 65 % of copy (mma.sync kernel 404 us); ncu: ~1100 instructions per warp and
//   block (softmax ~370, conversion and its NaN check ~300, addressing ~250), 2 warps per
//   scheduler issuing 43 % of cycles, the rest waiting on the wgmma (P V, S), barriers and
//   shared-memory latency: latency- and issue-bound, not yet HBM-bound.
#pragma once

#include <cstdint>

#include "stages/attention/attention_kernel.cuh"
#include "stages/attention/attention_prefill_wgmma.cuh"

namespace m3attn {
namespace attention_verify {

namespace ak = attention_kernel;
namespace ap = attention_prefill;
using ak::AttnArgs;

constexpr int kThreads = 128;  // one warpgroup
constexpr int kQT = 4;         // query tokens per tile: 4 x 16 heads = 64 wgmma rows
constexpr int kStages = 3;
constexpr int kTileBytes = ak::kTileBytes;
constexpr int kStageBytes = 2 * kTileBytes;
constexpr int kQBytes = 64 * ak::kDim;  // the pipelined variant's Q tile (64 rows, swizzled)
// Dynamic shared memory: the ring (+ the Q tile when pipelined) + slack to align the base to 1 KB.
constexpr int smem_bytes(bool pipelined) {
  return kStages * kStageBytes + (pipelined ? kQBytes : 0) + 1024;
}
constexpr int kCand = kQT * ak::kTopKIds;
constexpr int kMaxList = 128;  // block entries held in shared memory at once
constexpr int kKeysPerWarp = ak::kBlockKeys / 4;
static_assert(kQT * ak::kRows == 64, "a warp is one token's 16 heads");
static_assert(kThreads == ak::kThreads, "ak::load_block copies with ak::kThreads threads");
static_assert(kCand <= kThreads && kCand <= kMaxList, "one candidate per thread");

// Nonzero when one of the 4 bytes of w is an E4M3 NaN (0x7F or 0xFF): (b & 0x7F) + 1 carries into
// bit 7 only for 0x7F, and never into the next byte.
__device__ __forceinline__ uint32_t e4m3x4_nan_bits(uint32_t w) {
  return ((w & 0x7F7F7F7Fu) + 0x01010101u) & 0x80808080u;
}

// Four E4M3 bytes (low byte first) -> four f16 in two registers (exact), both halves of w fed to
// cvt.rn.f16x2.e4m3x2 directly (no shift to extract the high half).
__device__ __forceinline__ void e4m3x4_to_f16x4(uint32_t w, uint32_t& lo, uint32_t& hi) {
  asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\n"
      "cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(w));
}

// One 16-byte raw chunk (16 dims) -> two f16 chunks (8 dims each).
__device__ __forceinline__ void e4m3x16_to_f16(const uint4& raw, uint4& h0, uint4& h1) {
  e4m3x4_to_f16x4(raw.x, h0.x, h0.y);
  e4m3x4_to_f16x4(raw.y, h0.z, h0.w);
  e4m3x4_to_f16x4(raw.z, h1.x, h1.y);
  e4m3x4_to_f16x4(raw.w, h1.z, h1.w);
}

// Address of the f16 chunk u (dims 64 half + 8 u .. + 7) of key `key` in the converted tile of a
// stage: half 0 over the K tile, half 1 over the V tile.
__device__ __forceinline__ uint8_t* f16_chunk(uint8_t* stage, int half, int key, int u) {
  return stage + half * kTileBytes + key * ak::kDim + ((u ^ (key & 7)) << 4);
}

// This warp's keys [32 warp, 32 warp + 32) of the raw V tile of `stage` -> f16 (see the header);
// keys > vlim become 0. The K half must be free (S done by every warp). kCheck: returns nonzero
// when a converted raw byte is NaN (0 otherwise). kPasses passes of 32 / kPasses keys: a pass
// reads its rows into registers, then overwrites them (more passes, fewer registers).
template <int kPasses, bool kCheck>
__device__ __forceinline__ uint32_t convert_v_in_place(uint8_t* stage, int vlim) {
  constexpr int kIt = 8 / kPasses;  // 16-byte chunks per lane and pass
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint8_t* vraw = stage + kTileBytes;
  uint32_t nan = 0;
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    uint4 raw[kIt];
#pragma unroll
    for (int it = 0; it < kIt; ++it) {
      const int i = (pass * kIt + it) * 32 + lane;
      const int key = kKeysPerWarp * warp + (i >> 3), c = i & 7;
      raw[it] = make_uint4(0u, 0u, 0u, 0u);
      if (key <= vlim)
        raw[it] = *reinterpret_cast<const uint4*>(vraw + key * ak::kDim + ((c ^ (key & 7)) << 4));
      if constexpr (kCheck)
        nan |= e4m3x4_nan_bits(raw[it].x) | e4m3x4_nan_bits(raw[it].y) |
               e4m3x4_nan_bits(raw[it].z) | e4m3x4_nan_bits(raw[it].w);
    }
    __syncwarp();  // every lane read this pass's rows before any lane overwrites them
#pragma unroll
    for (int it = 0; it < kIt; ++it) {
      const int i = (pass * kIt + it) * 32 + lane;
      const int key = kKeysPerWarp * warp + (i >> 3), c = i & 7;
      uint4 h0, h1;
      e4m3x16_to_f16(raw[it], h0, h1);
      *reinterpret_cast<uint4*>(f16_chunk(stage, c >> 2, key, 2 * (c & 3))) = h0;
      *reinterpret_cast<uint4*>(f16_chunk(stage, c >> 2, key, 2 * (c & 3) + 1)) = h1;
    }
  }
  return nan;
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

// ap::softmax_block with a lazy running maximum (pipelined variant): a row's maximum m moves only
// when the block's maximum exceeds it by more than kLazyLog2, so weights stay <= 2^kLazyLog2 (f16
// P and the fp32 sums have ample room), alpha is 1 and O is not rescaled in most blocks. Exact:
// O and l are accumulated against the same m, and the final division by l cancels it.
constexpr float kLazyLog2 = 8.0f;
__device__ __forceinline__ void softmax_block_lazy(float (&s)[64], float (&m)[2], float (&l)[2],
                                                   float (&alpha)[2], int lim, float scale_log2) {
  const int tig = threadIdx.x & 3;
  if (lim < ak::kBlockKeys - 1) {
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (8 * j + 2 * tig + (e & 1) > lim) s[4 * j + e] = -INFINITY;
  }
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    mx[0] = fmaxf(mx[0], fmaxf(s[4 * j], s[4 * j + 1]));
    mx[1] = fmaxf(mx[1], fmaxf(s[4 * j + 2], s[4 * j + 3]));
  }
  float mu[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], 1));
    mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], 2));
    // -inf > -inf + 8 is false: a row with only masked keys keeps m = -inf (and mu = 0).
    const float mn = mx[e] * scale_log2 > m[e] + kLazyLog2 ? mx[e] * scale_log2 : m[e];
    mu[e] = mn == -INFINITY ? 0.0f : mn;
    alpha[e] = mn == m[e] ? 1.0f : ap::fast_exp2(m[e] - mu[e]);
    m[e] = mn;
  }
  float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    s[4 * j] = ap::fast_exp2(fmaf(s[4 * j], scale_log2, -mu[0]));
    s[4 * j + 1] = ap::fast_exp2(fmaf(s[4 * j + 1], scale_log2, -mu[0]));
    s[4 * j + 2] = ap::fast_exp2(fmaf(s[4 * j + 2], scale_log2, -mu[1]));
    s[4 * j + 3] = ap::fast_exp2(fmaf(s[4 * j + 3], scale_log2, -mu[1]));
    sum0 += s[4 * j] + s[4 * j + 1];
    sum1 += s[4 * j + 2] + s[4 * j + 3];
  }
  l[0] = l[0] * alpha[0] + sum0;
  l[1] = l[1] * alpha[1] + sum1;
}

// ---------------------------------------------------------------------------------------------
// The decode / verify kernel. Grid: (tiles bound x n_kv, 1, splits); block: kThreads; dynamic smem
// smem_bytes(kPipe).
template <bool kVec16, bool kPipe>
__global__ void __launch_bounds__(kThreads, 2) attention_verify_kernel(const AttnArgs a) {
  extern __shared__ uint8_t smem_raw[];
  __shared__ int s_warp[kThreads / 32];
  __shared__ int s_tile[3];
  __shared__ int s_pos[kQT];
  __shared__ int s_cand_b[kCand];
  __shared__ int s_cand_page[kCand];
  __shared__ int s_list_b[kMaxList];
  __shared__ int s_list_page[kMaxList];
  __shared__ int s_list_mask[kMaxList];
  __shared__ int s_list_vlim[kMaxList];
  __shared__ uint32_t s_nan[kQT][4];  // (token, dim) bits of NaN V elements the token sees

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
  // Q: serial, the A fragments of this warp's token in registers (register-A QK wgmma: warp w =
  // rows 16 w ..); pipelined, a 64-row K-major tile after the ring (row 16 w + head, 16-byte chunk
  // c at c ^ (row & 7)), read by the QK wgmma from shared memory, to free 16 registers.
  uint32_t qa[4][4];
  const uint32_t q_tile = base + kStages * kStageBytes;
  if constexpr (kPipe) {
    uint8_t* qs = smem + kStages * kStageBytes;
#pragma unroll
    for (int it = 0; it < 64 * 8 / kThreads; ++it) {
      const int i = it * kThreads + tid;
      const int row = i >> 3, c = i & 7, w = row >> 4, h = row & 15;
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (w < nt && h < a.group)
        v = *reinterpret_cast<const uint4*>(a.q + static_cast<int64_t>(t0 + w) * a.q_stride_t +
                                            static_cast<int64_t>(g * a.group + h) * ak::kDim +
                                            c * 16);
      *reinterpret_cast<uint4*>(qs + row * ak::kDim + ((c ^ (row & 7)) << 4)) = v;
    }
    ap::fence_proxy_async();  // generic stores -> wgmma reads (after the barrier below)
  } else {
    ak::load_q_fragments(a, g, t0 + tok, tok < nt, qa);
  }
  if (tid < kQT) s_pos[tid] = in.pos;
  if (tid < kQT * 4) s_nan[tid >> 2][tid & 3] = 0u;
  __syncthreads();  // s_pos, s_nan

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

  for (int c0 = lo; c0 < hi; c0 += kMaxList) {
    const int count = min(hi - c0, kMaxList);
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

    // Block j of the chunk goes to stage j % kStages, one commit group per block (empty ones
    // included, so the counting is uniform); with_prefetch also asks L2 for block j + prefetch.
    // An entry no token sees is not loaded: its stage holds stale bytes, every row masks its keys
    // and its V rows are zeroed (vlim -1).
    auto issue_load = [&](int j, bool with_prefetch) {
      if (j < count && lmask[j])
        ak::load_block<kVec16>(a, lpage[j], g, smem + (j % kStages) * kStageBytes);
      ak::cp_async_commit();
      const int jp = j + a.prefetch;
      if (with_prefetch && a.prefetch > 0 && jp < count && lmask[jp])
        ak::prefetch_block_l2(a, lpage[jp], g);
    };
    auto stage_addr = [&](int i) { return base + (i % kStages) * kStageBytes; };
    auto stage_ptr = [&](int i) { return smem + (i % kStages) * kStageBytes; };
    auto issue_qk = [&](int i) {  // S = Q K(i)^T
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        if constexpr (kPipe)
          ap::wgmma_qk(s, ap::smem_desc(q_tile + 32 * kk, 16, 1024),
                       ap::smem_desc(stage_addr(i) + 32 * kk, 16, 1024), kk > 0 ? 1 : 0);
        else
          ap::wgmma_qk_rs(s, qa[kk], ap::smem_desc(stage_addr(i) + 32 * kk, 16, 1024),
                          kk > 0 ? 1 : 0);
    };
    auto issue_pv = [&](int i) {  // O += P V(i)
#pragma unroll
      for (int kk = 0; kk < 8; ++kk)
        ap::wgmma_pv(o, p[kk], ap::smem_desc(stage_addr(i) + kk * 2048, kTileBytes, 1024));
    };
    // Once every warp's S(i) is done (K half free): V(i) -> f16 in place, then the softmax of S(i)
    // (m, l, alpha; the weights stay in s). Returns nonzero when V(i) holds a NaN byte.
    // A NaN V byte can only reach a row that must not see it when some present token of the tile
    // misses a key <= vlim: a token outside the entry's mask, or one whose position stops before
    // vlim. Otherwise every present token sees every converted key, and a NaN reaches exactly the
    // (token, dim) cells the twin makes NaN: no check needed (the common case).
    const int present = (1 << nt) - 1;
    auto convert_softmax = [&](int i) {
      const int mask = lmask[i];
      const int vlim = mask ? lvlim[i] : -1;
      int lmin = ak::kBlockKeys - 1;
#pragma unroll
      for (int w = 0; w < kQT; ++w)
        if ((mask >> w) & 1) lmin = min(lmin, s_pos[w] - lb[i] * ak::kBlockKeys);
      const bool check = mask != 0 && (mask != present || lmin < min(vlim, ak::kBlockKeys - 1));
      constexpr int kPasses = kPipe ? 4 : 2;
      const uint32_t nan = check ? convert_v_in_place<kPasses, true>(stage_ptr(i), vlim)
                                 : convert_v_in_place<kPasses, false>(stage_ptr(i), vlim);
      ap::fence_proxy_async();  // f16 stores -> wgmma reads (after the next barrier)
      const int lim = (mask >> tok) & 1 ? my_pos - lb[i] * ak::kBlockKeys : -1;
      if constexpr (kPipe)
        softmax_block_lazy(s, m, l, alpha, lim, a.scale_log2);
      else
        ap::softmax_block(s, m, l, alpha, lim, a.scale_log2);
      return nan;
    };
    // Barrier after convert_softmax(i) (every warp's f16 V(i) visible), with the rare NaN path.
    auto f16_barrier = [&](int i, uint32_t nan) {
      if (__syncthreads_or(nan != 0u)) {
        scrub_nan_rows(stage_ptr(i), lmask[i] ? lvlim[i] : -1, lmask[i], lb[i], s_pos, s_nan);
        ap::fence_proxy_async();
        __syncthreads();
      }
    };

#pragma unroll
    for (int j = 0; j < kStages - 1; ++j) issue_load(j, false);
    for (int j = kStages - 1; j < min(count, kStages - 1 + a.prefetch); ++j)
      if (lmask[j]) ak::prefetch_block_l2(a, lpage[j], g);

    if constexpr (!kPipe) {
      // Serial: iteration i waits for block i, refills the stage of block i - 1 (every warp
      // finished P V(i - 1) before the barrier) with block i + kStages - 1, then S, V -> f16,
      // softmax, P V. The two CTAs of an SM overlap each other's phases.
      for (int i = 0; i < count; ++i) {
        ak::cp_async_wait<kStages - 2>();
        __syncthreads();  // block i landed for every thread; stage of block i - 1 free
        issue_load(i + kStages - 1, true);
        ap::reg_fence(s);
        ap::wgmma_fence();
        issue_qk(i);
        ap::wgmma_commit();
        ap::wgmma_wait<0>();
        ap::reg_fence(s);
        __syncthreads();  // every warp's S is done: the K half is free
        const uint32_t nan = convert_softmax(i);
        ap::rescale_and_pack<true>(o, s, alpha, p);
        f16_barrier(i, nan);
        ap::reg_fence(o);
        ap::reg_fence(p);
        ap::wgmma_fence();
        issue_pv(i);
        ap::wgmma_commit();
        ap::wgmma_wait<0>();
        ap::reg_fence(o);
      }
    } else {
      // Software-pipelined: S(i + 1) is issued before P V(i), and V(i + 1) -> f16 plus the softmax
      // of S(i + 1) run while P V(i) is on the tensor cores; the stage of block i is refilled
      // with block i + kStages once every warp's P V(i) is done.
      ak::cp_async_wait<kStages - 2>();
      __syncthreads();  // block 0 landed
      issue_load(kStages - 1, true);
      ap::reg_fence(s);
      ap::wgmma_fence();
      issue_qk(0);
      ap::wgmma_commit();
      ap::wgmma_wait<0>();
      ap::reg_fence(s);
      __syncthreads();
      {
        const uint32_t nan = convert_softmax(0);
        ap::rescale_and_pack<true>(o, s, alpha, p);
        f16_barrier(0, nan);
      }
      for (int i = 0; i < count; ++i) {
        const bool has_next = i + 1 < count;
        ak::cp_async_wait<kStages - 2>();
        __syncthreads();  // block i + 1 landed for every thread
        ap::reg_fence(o);
        ap::reg_fence(s);
        ap::reg_fence(p);
        ap::wgmma_fence();
        // Every wgmma is issued unconditionally (a branch around wgmma serialises them): in the
        // last iteration S is recomputed over the stage of block i and discarded.
        issue_qk(has_next ? i + 1 : i);
        ap::wgmma_commit();
        issue_pv(i);
        ap::wgmma_commit();
        ap::wgmma_wait<1>();  // S(i + 1) done; P V(i) may still run
        ap::reg_fence(s);
        uint32_t nan = 0;
        if (has_next) {
          __syncthreads();  // every warp's S(i + 1) is done: its K half is free
          nan = convert_softmax(i + 1);
        }
        ap::wgmma_wait<0>();
        ap::reg_fence(o);
        ap::reg_fence(p);
        if (has_next) {
          ap::rescale_and_pack<true>(o, s, alpha, p);
          f16_barrier(i + 1, nan);  // also: every warp's P V(i) is done
        } else {
          __syncthreads();
        }
        issue_load(i + kStages, true);  // into the stage of block i
      }
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
