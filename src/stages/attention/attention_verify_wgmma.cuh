// Hopper decode / verify path of the paged FP8 attention (SPEC section 6): one warpgroup per CTA,
// the 4 query tokens of a speculative-verify tile (1 + draft_len tokens of ONE request) x the 16
// query heads of one KV head = the 64 rows of one wgmma tile. attention_decode_kernel.cuh has the
// mma.sync decode kernel (1-token tiles); attention_prefill_wgmma.cuh the 8-token prefill
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
//   as ak::load_block writes it), 3-stage ring (2 blocks in flight while one is used), loaded by
//   cp.async (16 per thread and block) or, where TMA can address the pool (kTma), by two TMA
//   copies issued by thread 0 (one mbarrier per stage; the tensor maps of the warp-specialised
//   prefill kernel, whose 128-byte swizzle is the layout ak::load_block writes):
//   - S = Q K^T: 4 x wgmma m64n128k32 e4m3 (A = the warp's Q fragments in registers, B = the K tile
//     as stored: K-major).
//   - V -> f16 in place, split around S: while S runs (it reads only the K half) each warp
//     converts dims 64-127 of its 32 keys over its own raw V rows (convert_v_high; the raw dims
//     0-63 stay in registers); once S is done (barrier) dims 0-63 go into the free K half
//     (convert_v_low). Layout MN-major with the 128-byte swizzle (LBO 16 KB between the two dim
//     halves, SBO 1 KB), the prefill kernel's f16 tile. No extra shared memory: 3 stages = 96 KB
//     per CTA, 2 CTAs per SM, 4 blocks (128 KB) in flight per SM.
//   - Online softmax per row in fp32 (ap::softmax_block: masked scores are -inf, so masked P is
//     exactly +0), P packed to f16 in the accumulator layout (register A operand).
//   - O += P V: 8 x wgmma m64n128k16 f16 (B = the f16 tile, transposed-B flag). Its wait is
//     deferred: S(i + 1) and the early V conversion of block i + 1 are issued while P V(i) still
//     runs; the stage of block i is refilled (with block i + 3) after the second barrier of
//     iteration i + 1, when every warp's P V(i) is complete.
//   The two CTAs of an SM overlap each other's tensor work with softmax / conversion.
//
// NaN in V (exact twin semantics, no leak across rows): a NaN V element at (key p, dim d) must
//   make dim d of every head of every token that sees p NaN, and nothing else; in a shared MMA a
//   row with P = 0 would otherwise get 0 * NaN = NaN. The conversion flags raw NaN bytes (rows the
//   tile sees only; rows past every selecting token's position are zeroed); when a block has one
//   (__syncthreads_or, free: the barrier is needed anyway), the rare path replaces the NaN by 0 in
//   the f16 tile and records (token, dim) for each token that sees the key; the epilogue writes NaN
//   there. NaN in K or Q: the score is NaN only in rows that see the key (masking replaces the
//   score with -inf), so their whole row becomes NaN, as in the twin. Variants 21 and 27 (17 in
//   session 16, 13 in session 15, 9 in session 14) run the tile without the flagging first and
//   repeat it with the flagging only when that first pass's O or l holds a NaN (see kTwoPass in
//   the kernel); variant 8 flags in every block.
//
// Bytes and bound (verify B256 x 4 tokens, 16 shared blocks): 32 KB per (block, CTA) from HBM;
//   per block 64 x 128 x 128 x 2 x 2 = 4.2 MFLOP (~256 cycles FP8 QK + ~512 cycles f16 PV of the
//   SM's tensor rate), 8 K exp2 (~512 MUFU cycles), 8 K e4m3 pair conversions; at 4.3 TB/s an SM
//   receives a block every ~1 us (~1.8 K cycles). History (H200, B256 x 4 tokens @ 8K, isolated /
//   back-to-back us): session 11 kernel 192 (65 % of copy; mma.sync 404); session 12 round C: the
//   early V conversion 196.5 / 189.0, + deferred P V wait (variant 8) 188.7 / 179.9, + TMA loads
//   (variant 9) 175.0 / 169.8. Dropped in session 12 (slower; deleted in session 13): a 2-stage
//   ring with 3 CTAs per SM (228 us, also with Q in shared memory: 207), NaN checks only in blocks
//   not seen whole, an L2 prefetch ahead of the ring, a software-pipelined S(i + 1) under P V(i)
//   with a lazy running maximum. Splitting a tile's blocks over more CTAs costs ~7 us per extra
//   CTA generation per slot (B256 x 4: 257 us with 2 splits): each CTA start pays the dependent
//   chain query_start -> ids -> page table -> first block under a loaded memory system. Session 13
//   (round B, 8K, isolated / back-to-back us): a persistent variant (2 CTAs per SM walking the
//   work items; at each item start the CTA built the next item's block list and staged its Q,
//   and the TMA ring ran on across items; commit 926a59e) was no faster: B256 x 4 175.8 / 167.9
//   vs 170.9 / 166.3 (32K: 174.9 vs 171.2), B64 x 4 47.1 vs 47.4 (one item per CTA): the chain
//   then stalls the CTA's own warps instead of a new CTA's, with the same 2 blocks in flight. It
//   was deleted; hiding the chain needs a builder that runs beside the consumers (a producer
//   warp), not one that interrupts them. Round C ncu of variant 9 (B256 x 4 @ 8K, 177 us): ~955
//   instructions per warp and block, issue slots 41 % busy, stall samples: fixed-latency waits 27
//   %, issuing 22 %, short scoreboard (shared memory, MUFU) 12 %, long scoreboard (the stage's TMA
//   mbarrier, global) 12 %, barriers 9 %: the warps are issue-latency bound rather than waiting
//   for HBM, so the next lever is fewer instructions per block (V conversion and its NaN test,
//   softmax) or more warps per SM, not more bytes in flight.
//   Session 15: a two-warpgroup variant (11: each warpgroup half of every block's keys, its own
//   online softmax, 128 registers, 16 warps per SM) was slower (B64 x 4 54.8 vs 48.8 us, B256 x 4
//   196.3 vs 177.9; ncu: 636 instructions per warp and block over 8 warps, 33 % more per block, at
//   the same 42 % issue rate) and was deleted. The lazy running max (13: O is rescaled only when a
//   row max grows by more than 2^8) took B64 x 4 to 47.6-47.7 us and B256 x 4 to 172.8-173.4 (9:
//   48.2-48.4, 175.2-177.5). ncu (round B, B64 x 4): ~790 instructions per warp and block, issue
//   slots 28.5 %, the top stall the wait for the stage's TMA data: at one wave the kernel waits for
//   bytes (the same tiles read by a plain kernel with this ring: 34.0-34.4 us, 91 % of copy).
#pragma once

#include <cstdint>

#include "core/ptx.cuh"
#include "stages/attention/attention_kernel.cuh"
#include "stages/attention/attention_prefill_wgmma.cuh"

namespace m3attn {
namespace attention_verify {

namespace ak = attention_kernel;
namespace ap = attention_prefill;
using ak::AttnArgs;

constexpr int kThreads = 128;  // one warpgroup
constexpr int kQT = 4;         // query tokens per tile: 4 x 16 heads = 64 wgmma rows
constexpr int kTileBytes = ak::kTileBytes;
constexpr int kStageBytes = 2 * kTileBytes;
constexpr int kStages = 3;
constexpr int kSmemBytes = kStages * kStageBytes + 1024;  // + slack to align the base to 1 KB
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

// Address of the f16 chunk u (dims 64 half + 8 u .. + 7) of key `key` in the converted tile of a
// stage: half 0 over the K tile, half 1 over the V tile.
__device__ __forceinline__ uint8_t* f16_chunk(uint8_t* stage, int half, int key, int u) {
  return stage + half * kTileBytes + key * ak::kDim + ((u ^ (key & 7)) << 4);
}

// Early V conversion, run while the S wgmma is in flight: the K half is still
// being read, so only dims 64-127 can be written (over the V tile's own raw rows) before S is done.
// Lane (q = lane / 8, hl = bit 2 of the lane, cl = lane % 4) owns, for j = 0 .. 3, the chunk
// 4 + cl (dims 64 + 16 cl ..) of key kh and the chunk cl (dims 16 cl ..) of key kl, where
// kh = 32 warp + 8 j + 4 + q, kl = 32 warp + 8 j + (q ^ 1) for hl = 0 and the other way round for
// hl = 1: every lane holds 4 high and 4 low chunks (the low ones stay raw in registers until S is
// done). In each 8-lane phase the swizzles (key & 7) of the two lane halves differ by 5: bit 2
// keeps the 16-byte loads on 8 distinct bank groups, bit 0 the f16 stores (chunks 2 cl, 2 cl + 1;
// session 15 had keys 4 apart: 2-way store conflicts, 8 wavefronts per STS.128 instead of 4).
__device__ __forceinline__ int early_key(int j, bool high) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int hl = (lane >> 2) & 1, q = lane >> 3;
  return kKeysPerWarp * warp + 8 * j + (high == (hl == 0) ? 4 + q : (q ^ 1));
}

// Reads this warp's raw V rows (keys > vlim read as 0), writes the f16 of dims 64-127 in place,
// keeps the raw dims 0-63 chunks in `lo`. With `check`, returns nonzero when a raw byte read is
// NaN (0 otherwise).
__device__ __forceinline__ uint32_t convert_v_high(uint8_t* stage, int vlim, uint4 (&lo)[4],
                                                   bool check) {
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
    if (check)
      nan |= e4m3x4_nan_bits(hi[j].x) | e4m3x4_nan_bits(hi[j].y) | e4m3x4_nan_bits(hi[j].z) |
             e4m3x4_nan_bits(hi[j].w) | e4m3x4_nan_bits(lo[j].x) | e4m3x4_nan_bits(lo[j].y) |
             e4m3x4_nan_bits(lo[j].z) | e4m3x4_nan_bits(lo[j].w);
  }
  __syncwarp();  // every lane read the warp's rows before any lane overwrites them
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int kh = early_key(j, true);
    uint4 h0, h1;
    ak::e4m3x16_to_f16(hi[j], h0, h1);
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
    ak::e4m3x16_to_f16(lo[j], h0, h1);
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
// Per-warp state of the online softmax: rows grp and grp + 8 of this warp's 16 (the heads grp,
// grp + 8 of token `warp`); dims 8 j + 2 tig (+1) in o[4 j + 2 e] (+1), e = 0 (row grp), 1.
struct Rows {
  float o[64];
  float m[2], l[2], alpha[2];
  __device__ __forceinline__ void reset() {
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.0f;
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.0f;
    alpha[0] = alpha[1] = 1.0f;
  }
};

// One block in the stage at sbuf (shared address saddr), by the whole warpgroup: S = Q K^T, V ->
// f16 in place (dims 64-127 under the S wgmma), online softmax, O += P V (left in flight: the
// caller's next block or wgmma_wait<0> waits for it). after_s() runs once every warp's S and the
// previous block's P V are complete (after a CTA barrier): the caller refills the previous stage
// there. mask: tokens that see the block; vlim: V rows past it are zeroed; lim: this warp's last
// visible key (< 0: none); check: look for NaN in V (the kernel's second pass, see there).
// The proxy fence of the f16 stores comes after the softmax, not right after the stores (session
// 15 ncu: the warps waited there, MEMBAR + FENCE.VIEW.ASYNC, ~8 % of the loop's stall samples).
template <bool kLazy, typename AfterS>
__device__ __forceinline__ void attend_block(Rows& st, float (&s)[64], uint32_t (&p)[8][4],
                                             const uint32_t (&qa)[4][4], uint8_t* sbuf,
                                             uint32_t saddr, int mask, int b, int vlim, int lim,
                                             const int* s_pos, uint32_t (*s_nan)[4],
                                             float scale_log2, bool check, AfterS after_s) {
  // S = Q K^T.
  ap::reg_fence(s);
  ap::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
    ap::wgmma_qk_rs(s, qa[kk], ap::smem_desc(saddr + 32 * kk, 16, 1024), kk > 0 ? 1 : 0);
  ap::wgmma_commit();
  // Dims 64-127 of V while S runs (it reads only the K half), dims 0-63 after.
  uint4 vlo[4];
  const uint32_t nan = convert_v_high(sbuf, vlim, vlo, check);
  ap::wgmma_wait<0>();  // S and the previous block's P V
  ap::reg_fence(s);
  ap::reg_fence(st.o);
  __syncthreads();  // every warp's S and previous P V are done: K half and previous stage free
  after_s();
  convert_v_low(sbuf, vlo);
  ap::softmax_block<kLazy>(s, st.m, st.l, st.alpha, lim, scale_log2);
  ap::rescale_and_pack<true>(st.o, s, st.alpha, p);
  ap::fence_proxy_async();            // f16 stores -> wgmma reads (after the barrier below)
  if (__syncthreads_or(nan != 0u)) {  // f16 tile complete (and a NaN in it: rare)
    scrub_nan_rows(sbuf, vlim, mask, b, s_pos, s_nan);
    ap::fence_proxy_async();
    __syncthreads();
  }
  // O += P V.
  ap::reg_fence(st.o);
  ap::reg_fence(p);
  ap::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 8; ++kk)
    ap::wgmma_pv(st.o, p[kk], ap::smem_desc(saddr + kk * 2048, kTileBytes, 1024));
  ap::wgmma_commit();
}

// Epilogue of one (tile, KV head g, split): this warp's rows of token t0 + warp (nothing when the
// token is absent), NaN in the dims of nan_dims (V NaNs the token sees), normalised BF16 out
// (splits == 1) or the unnormalised partial and (m, l) in the workspace. P V must be complete.
// Session 16: the same bytes with fewer instructions (round A: the epilogue took 1.9 us per CTA,
// ~1100 instructions per warp, vs 0.8 us in the decode kernel): the NaN-dim selects only in a warp
// that has a NaN dim, BF16 pairs by one cvt.rn.bf16x2.f32 (round to nearest even like
// float_to_bf16; the NaNs here are the canonical 0x7fffffff of GPU arithmetic, which both turn
// into 0x7fff), the row amax only with out_q.
// The epilogue's per-warp pieces (write_rows, write_rows_bulk): the NaN-dim masks (nan_dims: 4
// words, one bit per dim) copied into nd, true where any lane of the warp has one; a row's value
// summed, and its BF16 pairs' largest magnitude taken, over the lane quad that holds the row.
__device__ __forceinline__ bool load_nan_dims(const uint32_t* nan_dims, uint32_t (&nd)[4]) {
#pragma unroll
  for (int k = 0; k < 4; ++k) nd[k] = nan_dims[k];
  return __any_sync(0xffffffffu, (nd[0] | nd[1] | nd[2] | nd[3]) != 0u);
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
__device__ __forceinline__ float quad_amax(const uint32_t (&wv)[16]) {
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < 16; ++j) amax = fmaxf(amax, ak::amax_pair(wv[j]));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  return fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
}
__device__ __forceinline__ void write_rows(const AttnArgs& a, const Rows& st,
                                           const uint32_t* nan_dims, int t0, int nt, int g,
                                           int split) {
  const int lane = threadIdx.x & 31, tok = threadIdx.x >> 5;
  const int grp = lane >> 2, tig = lane & 3;
  uint32_t nd[4];
  const bool any_nan = load_nan_dims(nan_dims, nd);
  const int64_t t = t0 + tok;
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const float lsum = quad_sum(st.l[e]);
    const float inv = a.splits == 1 && lsum > 0.0f ? 1.0f / lsum : 1.0f;
    float v[32];
    if (any_nan) {
#pragma unroll
      for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int x = 0; x < 2; ++x) {
          const int dim = 8 * j + 2 * tig + x;
          const bool is_nan = (nd[dim >> 5] >> (dim & 31)) & 1u;
          v[2 * j + x] = is_nan ? __int_as_float(0x7fffffff) : st.o[4 * j + 2 * e + x] * inv;
        }
    } else {
#pragma unroll
      for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int x = 0; x < 2; ++x) v[2 * j + x] = st.o[4 * j + 2 * e + x] * inv;
    }
    const int h = grp + 8 * e;
    if (a.splits == 1) {
      uint32_t wv[16];  // BF16 pairs of dims 8 j + 2 tig, + 1
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const __nv_bfloat162 b2 = __floats2bfloat162_rn(v[2 * j], v[2 * j + 1]);
        wv[j] = *reinterpret_cast<const uint32_t*>(&b2);
      }
      // o_proj's E4M3 input (CTA-uniform branch): the row's 128 dims are this lane quad's.
      const float amax = a.out_q != nullptr ? quad_amax(wv) : 0.0f;
      if (tok >= nt || h >= a.group) continue;
      const int64_t col = static_cast<int64_t>(g * a.group + h) * ak::kDim;
      uint16_t* orow = a.out + t * a.out_stride + col;
#pragma unroll
      for (int j = 0; j < 16; ++j) *reinterpret_cast<uint32_t*>(orow + 8 * j + 2 * tig) = wv[j];
      if (a.out_q != nullptr) {
        const float sc = ak::quant_scale(amax), rcp = ak::quant_rcp(sc);
        uint8_t* qrow = a.out_q + t * (int64_t{a.n_kv} * a.group * ak::kDim) + col;
#pragma unroll
        for (int j = 0; j < 16; ++j)
          *reinterpret_cast<uint16_t*>(qrow + 8 * j + 2 * tig) =
              static_cast<uint16_t>(ak::quant_pair(wv[j], sc, rcp));
        if (tig == 0) a.out_scales[t * a.sc_stride_t + (g * a.group + h) * a.sc_stride_h] = sc;
      }
    } else {
      if (tok >= nt || h >= a.group) continue;
      const int64_t slot = (t * a.n_kv + g) * a.splits + split;
      float* orow = a.ws_o + (slot * ak::kRows + h) * ak::kDim;
#pragma unroll
      for (int j = 0; j < 16; ++j)
        *reinterpret_cast<float2*>(orow + 8 * j + 2 * tig) = make_float2(v[2 * j], v[2 * j + 1]);
      if (tig == 0) {
        a.ws_ml[(slot * ak::kRows + h) * 2] = st.m[e];
        a.ws_ml[(slot * ak::kRows + h) * 2 + 1] = lsum;
      }
    }
  }
}

// kBulkOut (session 20: per-row copies; session 21: one copy per warp): write_rows' BF16 rows (and,
// with out_q, o_proj's E4M3 rows) through shared memory and out by the TMA engine instead of 4-byte
// (2-byte) global stores per lane. Why (ncu of 42, session 20 round B, B64 x 4 @ 32K): the
// epilogue's samples were the exit's drain (49 of 257) and a long-scoreboard wait on the first
// instruction that reuses a store's data register (34): the stores queue in the SM's load / store
// path behind the neighbour CTA's cp.async refills. Session 20 (one 256-byte copy per row, lanes
// h < group, variants 52 / 53, removed in session 21): B64 x 4 41.4-42.1 vs 42.2-42.8 us for 42
// (round D), 41.6-42.0 (mean 41.77) vs 42.0-42.6 (42.24) (round E); B256 x 4 @ 32K 157.5-158.1 vs
// 160.7-160.8 (D), 158.7-159.9 vs 160.5-161.6 (E). Session 21: each warp (token) stages its 16 rows
// kRowPitch bytes apart (256 + 16: the 8 rows x 4 lanes of each 4-byte store hit 32 distinct
// banks) in the ring (free after the loop), repacks them contiguously (8 16-byte loads and stores
// per lane, conflict-free), fences them for the async proxy, and lane 0 writes them with ONE bulk
// copy of group x 256 bytes (the group's heads of a token are contiguous in `out`). Why (round D,
// 60 at B64 x 4 @ 32K, stamps and a source-level ncu): the epilogue took 1.70 us p50 per CTA (the
// plain read's 0.16); a warp's 16 per-row copies become ptxas' loop over the lanes' distinct
// addresses (R2UR, UBLKCP, BRA.U.ANY: 16 serial rounds, 0.67 us from the rows fenced to thread 0's
// copy issued), and the staging took 0.64 us, its samples mostly "no instruction" (code fetched
// cold), so the NaN dims' selects are a separate loop and the common path one straight run of
// code. Round F: the epilogue 1.34 us p50 (63) vs 1.70 (60); B64 x 4 tie (41.0-41.7 vs 41.1-41.5
// us), with out_q 44.5-45.8 vs 45.7-46.7 (60: per-lane stores); B256 x 4 (64 vs 53) tie in rounds
// F / G (157.6-162.0 vs 157.7-163.0). Lost in round D: 62 (60 with the rows staged by 8
// stmatrix.x4 per warp instead of 32 st.shared.b32 per lane: the staging's time is not its store
// count). With out_q the E4M3 rows go the same way (staged at kQPitch, repacked, one group x
// 128-byte copy per warp; session 20's per-row form, 19db3dd on s20-att, was never run); the
// scales stay plain stores. Only where it applies (CTA-uniform): one split, 16-byte aligned
// out / out_q rows; elsewhere write_rows.
constexpr int kRowPitch = 2 * ak::kDim + 16;
__device__ __forceinline__ bool bulk_out_ok(const AttnArgs& a) {
  return a.splits == 1 &&
         ((reinterpret_cast<uintptr_t>(a.out) | static_cast<uintptr_t>(a.out_stride) * 2 |
           reinterpret_cast<uintptr_t>(a.out_q)) &
          15) == 0;
}
constexpr int kQPitch = ak::kDim + 16;  // (8 rows x 4 lanes of 2-byte stores: distinct banks)
constexpr int kPackOffset = ak::kRows * kRowPitch * kQT;  // the packed rows, after the staged
constexpr int kQStageOffset = kPackOffset + kQT * ak::kRows * 2 * ak::kDim;
constexpr int kQPackOffset = kQStageOffset + kQT * ak::kRows * kQPitch;
static_assert(kQPackOffset + kQT * ak::kRows * ak::kDim <= kStages * kStageBytes,
              "the row buffers fit the ring");
// Rows [0, 16) of `bytes` bytes each, staged `pitch` apart at src -> contiguous at dst (the warp).
template <int kBytes, int kPitch>
__device__ __forceinline__ void pack_rows(uint8_t* dst, const uint8_t* src) {
  constexpr int kChunks = kBytes / 16;  // per row
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int k = 0; k < ak::kRows * kChunks / 32; ++k) {
    const int i = 32 * k + lane, rr = i / kChunks, c = i % kChunks;
    *reinterpret_cast<uint4*>(dst + rr * kBytes + 16 * c) =
        *reinterpret_cast<const uint4*>(src + rr * kPitch + 16 * c);
  }
}
__device__ __forceinline__ void write_rows_bulk(const AttnArgs& a, const Rows& st,
                                                const uint32_t* nan_dims, int t0, int nt, int g,
                                                uint8_t* stage) {
  const int lane = threadIdx.x & 31, tok = threadIdx.x >> 5;
  const int grp = lane >> 2, tig = lane & 3;
  uint32_t nd[4];
  const bool any_nan = load_nan_dims(nan_dims, nd);
  ak::timeline_mark_dep(a, 14, any_nan);
  uint8_t* rows = stage + tok * ak::kRows * kRowPitch;
  uint8_t* qrows = stage + kQStageOffset + tok * ak::kRows * kQPitch;  // (with out_q)
  const int64_t t = t0 + tok;
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const float lsum = quad_sum(st.l[e]);
    const float inv = lsum > 0.0f ? 1.0f / lsum : 1.0f;
    const int h = grp + 8 * e;
    uint8_t* r = rows + h * kRowPitch + 4 * tig;
    uint32_t wv[16];  // BF16 pairs of dims 8 j + 2 tig, + 1
    if (!any_nan) {   // (warp-uniform) the common path without the NaN selects
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const __nv_bfloat162 b2 =
            __floats2bfloat162_rn(st.o[4 * j + 2 * e] * inv, st.o[4 * j + 2 * e + 1] * inv);
        wv[j] = *reinterpret_cast<const uint32_t*>(&b2);
        *reinterpret_cast<uint32_t*>(r + 16 * j) = wv[j];
      }
    } else {
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        float v0 = st.o[4 * j + 2 * e] * inv, v1 = st.o[4 * j + 2 * e + 1] * inv;
        const int dim = 8 * j + 2 * tig;
        if ((nd[dim >> 5] >> (dim & 31)) & 1u) v0 = __int_as_float(0x7fffffff);
        if ((nd[(dim + 1) >> 5] >> ((dim + 1) & 31)) & 1u) v1 = __int_as_float(0x7fffffff);
        const __nv_bfloat162 b2 = __floats2bfloat162_rn(v0, v1);
        wv[j] = *reinterpret_cast<const uint32_t*>(&b2);
        *reinterpret_cast<uint32_t*>(r + 16 * j) = wv[j];
      }
    }
    if (a.out_q != nullptr) {  // (CTA-uniform) the row's 128 dims are this quad's
      const float sc = ak::quant_scale(quad_amax(wv)), rcp = ak::quant_rcp(sc);
#pragma unroll
      for (int j = 0; j < 16; ++j)
        *reinterpret_cast<uint16_t*>(qrows + h * kQPitch + 8 * j + 2 * tig) =
            static_cast<uint16_t>(ak::quant_pair(wv[j], sc, rcp));
      if (tig == 0 && tok < nt && h < a.group)
        a.out_scales[t * a.sc_stride_t + (g * a.group + h) * a.sc_stride_h] = sc;
    }
  }
  ak::timeline_mark(a, 15);
  __syncwarp();  // the warp's rows are staged
  uint8_t* packed = stage + kPackOffset + tok * ak::kRows * 2 * ak::kDim;
  uint8_t* qpacked = stage + kQPackOffset + tok * ak::kRows * ak::kDim;
  pack_rows<2 * ak::kDim, kRowPitch>(packed, rows);
  if (a.out_q != nullptr) pack_rows<ak::kDim, kQPitch>(qpacked, qrows);
  ap::fence_proxy_async();  // this thread's st.shared -> the bulk copies' reads
  __syncwarp();
  ak::timeline_mark(a, 12);
  if (tok < nt && lane == 0) {
    const int64_t col = static_cast<int64_t>(g * a.group) * ak::kDim;
    sm90::bulk_store(a.out + t * a.out_stride + col, ak::smem_u32(packed),
                     a.group * 2 * ak::kDim);
    if (a.out_q != nullptr)
      sm90::bulk_store(a.out_q + t * (int64_t{a.n_kv} * a.group * ak::kDim) + col,
                       ak::smem_u32(qpacked), a.group * ak::kDim);
    sm90::bulk_commit();
    ak::timeline_mark(a, 13);
    sm90::bulk_wait_read();
  }
}

__device__ __forceinline__ void init_full_barriers(uint64_t* s_full) {
  if (threadIdx.x == 0) {
#pragma unroll
    for (int st = 0; st < kStages; ++st) sm90::mbar_init(ak::smem_u32(&s_full[st]), 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
}

// ---------------------------------------------------------------------------------------------
// kPageEarly (variant 60, session 21): the guessed tile's page-table reads issued as soon as its
// ids land, before the tile scan, and the first block's copy right after the scan. Why (session 21
// round B timeline, 52 at B64 x 4 @ 32K, p50 us after the first entry): the scan was done at
// 1.76, the ids were read after it and a barrier, the first page landed at 2.24 and the early copy
// went out at 2.59 (early_copies' __match_any_sync and ballot after the page), the plain read's
// copies at 1.22. Here every thread loads the guessed tile's ids and positions and request tid's
// query_start bounds at entry; each candidate reads its entry of request `tile`'s page-table row
// (guessed_page; the guess of a batch of 4-token requests) as soon as its id lands; then the scan
// (bounds already loaded); when it confirms request, first token and count, warp 0's lowest lane
// whose candidate counts copies list entry 0 (early_copy_first) and sparse_union uses the pages
// read (candidate_page_known); otherwise 52's front. Same list, same bytes, same order.
// Lost in round B (same-run A/B, B64 x 4 isolated us at 8K / 32K / 128K, three runs): 58, the
// union built by warp 0 alone (the 64 candidates two per lane, token masks by six
// __match_any_sync over the token pairs, ranks by ballots, the scan after it, then the early
// copy): 42.1-43.7 vs 41.8-42.9 for 52; timeline @ 32K: ids 1.60, ranked 1.98 (six match_any:
// ~0.4 us), scan done 2.46, copy 2.91 (52: 2.59), list 3.30 (52: 3.78), first block landed 5.31
// (5.44), per block 2.30 (2.32). 59 (58 with the request's page-table row copied into shared
// memory at entry) was built and removed unmeasured. Round C: 60 41.5-42.2 us (mean 41.66) vs 52
// 41.6-43.5 (42.24); timeline @ 32K: ids 1.60, first page 1.95, copy 2.21 (52: 2.59), first block
// landed 4.51 (4.77). Lost in round D: 61 (60 with request `tile`'s page-table row copied into
// shared memory by the candidate threads at entry, so the page reads are shared-memory reads):
// its row copies went out ahead of the ids (ids 1.92 vs 1.63, copy 2.59 vs 2.27); 41.3-42.8 vs
// 41.3-43.0 for 60.

// List entry 0 (the lowest lane of warp 0 whose candidate counts: always a first occurrence) by
// TMA into stage 0, as early_copies<1> without its __match_any_sync; returns the count (0 or 1;
// warp 0, 0 elsewhere). cb: this thread's candidate id, -1 when it does not count. kHint: with the
// L2 cache policy `policy` (kEvictFirst).
template <bool kHint>
__device__ __forceinline__ int early_copy_first(int cb, int cpage, const CUtensorMap* kmap,
                                                const CUtensorMap* vmap, int g, uint32_t base,
                                                uint64_t* s_full, uint64_t policy) {
  if ((threadIdx.x >> 5) != 0) return 0;  // warp-uniform
  const int lane = threadIdx.x & 31;
  const uint32_t ok = __ballot_sync(0xffffffffu, cb >= 0);
  if (ok != 0u && lane == __ffs(ok) - 1)
    ak::tma_load_block<kHint>(kmap, vmap, cpage, g, base, ak::smem_u32(&s_full[0]), policy);
  return ok != 0u ? 1 : 0;
}

// ---------------------------------------------------------------------------------------------
// The decode / verify kernel (variants 8, 27, 69, 70). Grid: (tiles bound x n_kv, 1,
// splits); block: kThreads; dynamic smem kSmemBytes. kTma: K and V tiles by TMA (kmap, vmap), else
// cp.async; kTwoPass: the V NaN test only in a second pass when the first one's O holds a NaN
// (below). kTma: the stage's mbarrier is polled without sm90::mbar_wait's clock64 timeout and trap
// (session 15: with the trap in the loop ptxas injected a wait for the previous block's P V wgmma
// there, C7517; without it the time was the same, round B: variant 12). kLazy (variants 13 / 17,
// automatic since session 15): the lazy running max of ap::softmax_block. Removed in session 15:
// variant 14 (round C: 13 with the previous stage refilled right after the first barrier, P V(i -
// 1) waited for at the top, and the output rows staged in shared memory for 16-byte stores: B64 x 4
// 49.7-49.9 vs 47.4-47.7 us, B256 x 4 181.5-183.4 vs 174.7-176.2) and variant 15 (round D: 13 with
// the staged output rows alone: with out_q B64 x 4 50.6-50.8 vs 50.8-51.3 us, within the spread).
// Session 16: variant 17 (automatic then) is 13 with conflict-free f16 V stores, the proxy fence
// after the softmax and a shorter epilogue (write_rows), the same bytes; 8 has them too. Round B /
// C: B256 x 4 164.6-167.5 vs 173.0-175.6 us for 13, B64 x 4 46.2-47.9 vs 47.8-48.2. Lost and
// removed (rounds B / C, same-round A/Bs against 17): a speculative row max (18: the block's max
// only when the partial sums outgrow the stale one; B256 -0.3 %, B64 +0.3 %, a wash), the ring
// started on one block (19: B256 167.8-169.8 vs 165.8-167.5), o_proj's codes converted in pairs
// (20: with out_q B64 x 4 51.1-51.7 vs 49.9-50.2), each CTA's first blocks prefetched into L2
// (slower everywhere). Session 17: variant 21 (automatic for grids of more than one wave) is 17
// with the early copies (kEarly = kTma; one split, sparse): the page-table row of the guessed
// request (= tile) is prefetched into L2 at entry, and warp 0 (candidates 0-31, which hold the
// list's first entries) issues the TMA copies of entries 0 and 1 as soon as their pages are known,
// before the union is complete (ak::early_copies); the same bytes in the same order. Rounds A / B
// (sparse draft 3, isolated us): B64 x 4 45.3-46.6 vs 46.4-47.5 for 17, B256 x 4 @ 32K 160.4-161.3
// vs 164.4-165.3. Lost and removed: 22 (S waited for at once, the refill before the V conversion:
// B64 x 4 45.9-46.9), 23 (each refill at the top of the iteration, before the block wait: 3 blocks
// in flight while waiting, S no longer under the previous P V; 46.1-47.2), 24 / 25 (an L2 prefetch
// of the next block over the last 4 / all blocks: round B 47.0-47.4 / 53.2-53.9, B256 x 4 168.2 /
// 184.0). 27 (session 17; automatic for one-wave grids, see make_plan): 21's loop on cp.async loads
// with the early copies by TMA (kEarly without kTma: entries 0, 1 wait on their mbarrier, the rest
// on cp.async groups, as in the decode kernel). Round C2: B64 x 4 44.3-44.8 vs 45.4-46.3 us for 21,
// B256 x 4 162.2 / 162.3 vs 160.3 / 160.8; without the early copies (26, removed) 44.6-46.0 and
// 165.6 / 165.7.
// Session 18: kFirst, the blocks the early copies request (kStages - 1 = 2 until then). 34
// (automatic for one-wave grids) is 27 with kFirst = 1: the list's first block alone is requested
// as soon as its page is known, the second by cp.async with the ring after the union. Round D
// (sparse B64 x 4, isolated us at 8K / 32K / 128K, three alternating runs): 42.2-43.1 vs 42.9-44.8
// for 27 (round F: 41.8-42.5 vs 43.3-44.7); timeline @ 32K: the first block landed p50 / max 4.9 /
// 6.3 vs 6.6 / 9.5 us after the first entry (the one-wave grid's initial burst of 2 x 256 early
// blocks queued each CTA's first block behind its second), exit max 41.6 vs 42.8 us. Lost and
// removed in session 18 (same-round A/Bs against 27 or 21): three early copies (31: the first block
// landed 1.4 us later, B64 x 4 45.4-46.8 vs 43.4-44.0 us); 21 with one early copy (36: B256 x 4
// 161.6-162.5 vs 160.2-160.8); the K / V tensor maps prefetched at entry (33: no difference); a
// "lean" block (28 / 29: the row sums l by 8 mma.sync of P x ones instead of 64 FADDs per lane,
// wgmma descriptors from precomputed halves, the V conversion without row predicates: ~15 % fewer
// instructions per warp and block, the same time; ncu: the mma.sync waited for the tensor pipe,
// which the other CTA's wgmmas held, about as long as the FADDs had taken); P from
// ex2.approx.f16x2 (30: sm_90 has no packed EX2, ptxas emits two MUFU.EX2.F16 and a PRMT); the
// warp-specialised prefill kernel on verify batches (kernel 15: 80 us, its 8-token tiles run a
// second, empty consumer warpgroup). Diagnostics (round C, B64 x 4 @ 32K, isolated): this kernel's
// front and ring without the block's work 38.3 us (the plain read of the same tiles 34.0), the work
// without loads 36.8 us (1.70 us per block), both 43.4 us (2.1 us per block): per block, neither
// the bytes (1.87 us) nor the work (1.70) alone sets the pace, their chain does; the front costs
// ~4 us more than the read's.
// Session 19: kQEarly (42, automatic for one-wave grids since session 19; 34, removed after the
// A/Bs below, is 42 without it): 34 with this warp's Q
// fragments loaded at entry for the guessed tile [4 tile, 4 tile + 4) (the guess of
// find_tile_and_load's inputs; plain launches, where Q is complete), before the tile scan, and
// loaded again after it only when the guess was wrong; 34 loaded them after the scan, where its
// 16 uncoalesced 4-byte loads per thread queued ahead of the union's page-table reads and the
// first copy. Same bytes, same order. Same-round A/Bs (sparse B64 x 4, isolated us, three
// alternating runs at 8K / 32K / 128K): round E 42.2-43.6 vs 43.2-44.4 for 34, round G
// 42.3-42.9 (mean 42.57) vs 43.9-44.4 (mean 44.14); timeline @ 32K (42 round G, 34 round E): list
// at 3.58 vs 4.26 us, first block landed p50 4.67 vs 5.28, last exit 41.7 vs 43.7; per block
// unchanged (2.18-2.23 us). Lost in session 19 (same-round A/Bs; built for rounds A-G and removed):
// 37 (34 with the first copy issued by thread 0 right after the tile scan: its page-table read then
// sat in front of the union, list built 1.4 us later; B64 x 4 43.7-44.6 vs 43.4-44.8, b2b +0.7 us),
// 38 (37 with the request's page-table row copied into shared memory at entry: 43.8-44.3 vs
// 43.6-44.4), 39 / 40 (34 / 38 with the epilogue staged in shared memory for 16-byte stores: the
// epilogue took 2.2-2.4 us per CTA instead of 1.25; 44.0-45.1 / 43.6-44.3), 41 (38 + kQEarly:
// mean 42.84 vs 42.57 for 42, round G), 43 / 44 (41 / 42 with the Q loads after the guessed ids:
// 42.96 / 42.72), 45 (43 with the pass-0 NaN probe as 8 partial sums: 42.86). A refill issued
// before S is complete (wgmma_wait<1> for the previous P V, then <0>) was not built: ptxas
// serialises the wgmma pipeline with any wait_group 1 in this loop (C7514).
// Session 20: kBulkOut (write_rows_bulk). 52 (42 + kBulkOut) is automatic for one-wave grids and 53
// (21 + kBulkOut) for more waves; 42 and 21 were removed after rounds D / E (numbers at
// write_rows_bulk). Lost and removed (same-round A/Bs, B64 x 4 isolated us at 8K / 32K / 128K): a
// ring of 13 8-KB quarters (one K or V key half each; 104 KB, one quarter more in flight than the
// 3 stages; S as two m64n64k32 per k-step, per-half P V descriptors): on cp.async loads (50, 51
// with kBulkOut) 45.3-47.2 vs 42.2-42.8 for 42 (round D; 2.26 us per block vs 2.14), on TMA loads
// with an mbarrier per slot (54, 55) 46.4-47.7 vs 41.6-42.0 for 52 (round E): the deeper ring
// made every block slower; 56 (52 with the stage ring by TMA, 21's loop with one early copy)
// 43.2-44.8; 57 (52 with the pass-0 NaN probe summed as a tree) 41.6-42.2, mean 41.82 vs 41.77.
template <bool kVec16, bool kTma, bool kTwoPass = false, bool kLazy = false, bool kEarly = kTma,
          int kFirst = kStages - 1, bool kQEarly = false, bool kBulkOut = false,
          bool kPageEarly = false, bool kEvictFirst = false, int kRowPages = 0>
__global__ void __launch_bounds__(kThreads, 2)
    attention_verify_kernel(const __grid_constant__ AttnArgs a,
                            const __grid_constant__ CUtensorMap kmap,
                            const __grid_constant__ CUtensorMap vmap) {
  static_assert(!kTma || kVec16, "TMA needs 16-byte aligned pools");
  static_assert(kFirst >= 1 && kFirst <= kStages - 1, "the early copies fill pre-loop stages");
  static_assert(kVec16 || !kEarly, "the early copies are TMA copies");
  static_assert(!kPageEarly || (kEarly && kFirst == 1), "kPageEarly issues one early copy");
  static_assert(!kEvictFirst || kVec16, "kEvictFirst: 16-byte cp.async or TMA copies");
  static_assert(kRowPages == 0 || (kPageEarly && kQEarly && kCand == 64 && kRowPages % 4 == 0),
                "kRowPages: kPageEarly's page reads from shared memory, warps 0-1 the candidates");
  extern __shared__ uint8_t smem_raw[];
  __shared__ int s_warp[kThreads / 32];
  __shared__ int s_tile[4];  // request, first token, tokens; [3]: kEarly's early entries
  __shared__ int s_pos[kQT];
  __shared__ int s_cand_b[kCand];
  __shared__ int s_cand_page[kCand];
  __shared__ int s_list_b[kMaxList];
  __shared__ int s_list_page[kMaxList];
  __shared__ int s_list_mask[kMaxList];
  __shared__ int s_list_vlim[kMaxList];
  __shared__ uint32_t s_nan[kQT][4];  // (token, dim) bits of NaN V elements the token sees
  __shared__ __align__(8) uint64_t s_full[kStages];  // kTma: K and V of the stage landed
  __shared__ uint64_t s_first;  // AttentionCudaConfig::timeline: when the first block landed
  __shared__ __align__(16) int s_row[kRowPages > 0 ? 2 * kRowPages : 1];  // kRowPages: 2 copies

  const int tid = threadIdx.x, tok = tid >> 5;
  // Tile-major grid: the KV heads of a tile are neighbours, and the CTAs past the last real tile
  // (the grid is sized for the worst token distribution) come last, where they fill the tail.
  const int tile = static_cast<int>(blockIdx.x) / a.n_kv;
  const int g = static_cast<int>(blockIdx.x) % a.n_kv, split = blockIdx.z;

  const uint32_t raw_u32 = ak::smem_u32(smem_raw);
  const uint32_t base = (raw_u32 + 1023u) & ~1023u;
  uint8_t* smem = smem_raw + (base - raw_u32);

  ak::timeline_mark(a, 0);
  if (kEarly && a.sparse) ak::prefetch_page_row<kThreads>(a, tile);
  // kEvictFirst (69, 70): the K / V copies with the L2 evict-first policy (evict_first_policy).
  const uint64_t policy = kEvictFirst ? ak::evict_first_policy() : 0;
  // kPageEarly (CTA-uniform; see early_copy_first): the guessed tile's inputs and request tid's
  // bounds at entry.
  const int64_t t_guess = int64_t{kQT} * tile;
  const bool page_early =
      kPageEarly && a.sparse && !a.pdl && a.splits == 1 && tile < a.R && t_guess < a.T;
  const int pe_t0 = page_early ? static_cast<int>(t_guess) : -1;
  const int pe_nt = page_early ? min(kQT, a.T - pe_t0) : 0;
  ak::TileInputs in;
  ak::TileBounds pe_bounds{0, 0};
  // kRowPages (70): each candidate warp (0, 1) copies the first row_held entries of request
  // `tile`'s page-table row into its own half of s_row (cp.async; where the row is 16-byte
  // aligned), so its page reads are shared-memory reads once its ids land, with no cross-warp
  // barrier; and Q is loaded only after that (warps 2-3: once a position they load landed), so the
  // grid's 2 MB of Q no longer queue in DRAM ahead of the ids and rows. Round H (B64 x 4, same-run,
  // 3 runs x 8K / 32K / 128K): 40.8-41.4 us (mean 41.21) vs 67 41.1-41.8 (41.44); ids 1.38 vs 1.60
  // us, first block landed 4.42 vs 4.54 (@ 32K). (61, the rows without the late Q, and 66, the late
  // Q without the rows, did not pay; 66's named barrier also drew racecheck hazards.)
  const int32_t* pe_row = a.page_table + static_cast<int64_t>(tile) * a.pt_stride;
  const int row_held =
      kRowPages > 0 && page_early && (reinterpret_cast<uintptr_t>(pe_row) & 15) == 0
          ? min(a.max_pages, kRowPages)
          : 0;  // (CTA-uniform)
  int* my_row = s_row + (tok & 1) * kRowPages;
  int q_dep = 0;  // kRowPages, warps 2-3: a position of the tile, read before Q
  if (page_early) {
    init_full_barriers(s_full);
    ak::load_tile_inputs<kQT, true>(a, g, pe_t0, pe_nt, in);  // (pdl_wait: a no-op here)
    pe_bounds = ak::request_bounds(a, tid);
    if (row_held > 0 && tid < kCand) {
      const uint32_t dst = ak::smem_u32(my_row);
      const int lane = tid & 31;
      for (int c = lane; c < row_held / 4; c += 32) ak::cp_async_16(dst + 16 * c, pe_row + 4 * c);
      for (int e = (row_held & ~3) + lane; e < row_held; e += 32)
        ak::cp_async_4(dst + 4 * e, pe_row + e);
      ak::cp_async_commit();
    } else if (row_held > 0) {
      q_dep = a.positions[pe_t0];
    }
  }
  // kQEarly: this warp's Q fragments of the guessed tile (its token 4 tile + tok; plain launches).
  uint32_t qe[4][4];
  int q_t0 = -1, q_nt = 0;  // the guessed tile whose Q is in qe
  const auto load_q_early = [&] {
    if constexpr (kQEarly) {
      const int64_t tg = int64_t{kQT} * tile;
      if (!a.pdl && tg < a.T) {
        q_t0 = static_cast<int>(tg);
        q_nt = min(kQT, a.T - q_t0);
        ak::load_q_fragments(a, g, q_t0 + tok, tok < q_nt, qe);
      }
    }
  };
  // (with row_held, below: after the ids and rows)
  if (row_held == 0) load_q_early();
  bool has_tile = false, pages_known = false;  // pages_known: spec_page is the right entry
  int spec_page = -1;
  int early_count = 0;  // pages_known: list entries early_copy_first requested (warp 0)
  if (page_early) {
    if (row_held > 0) {  // (CTA-uniform)
      if (tid < kCand) {
        ak::cp_async_wait<0>();  // this warp's row copy
        __syncwarp();
        const int b = in.cand_b, pos = in.cand_pos;
        if (pos >= 0 && b >= 0 && b <= (pos >> 7) && b < a.max_pages)  // (as guessed_page)
          spec_page = b < row_held ? my_row[b] : pe_row[b];
        load_q_early();               // (after the ids, which the branch above read)
      } else if (q_dep != INT_MIN) {  // (waits for q_dep; never false for a valid position)
        load_q_early();
      }
    } else {
      spec_page = ak::guessed_page(a, tile, in.cand_pos, in.cand_b);
    }
    ak::timeline_mark_dep(a, 8, in.cand_b);
    has_tile = ak::find_tile<kQT, kThreads>(a, tile, s_warp, s_tile, &pe_bounds);
    const bool inputs_held = has_tile && s_tile[1] == pe_t0 && s_tile[2] == pe_nt;
    pages_known = inputs_held && s_tile[0] == tile;  // (CTA-uniform)
    if (pages_known) {
      int cb = in.cand_b;
      const int cpage = ak::candidate_page_known(a, in.cand_pos, cb, spec_page);
      ak::timeline_mark_dep(a, 10, cpage);
      early_count = early_copy_first<kEvictFirst>(cb, cpage, &kmap, &vmap, g, base, s_full, policy);
      ak::timeline_mark(a, 11);
    } else if (has_tile && !inputs_held) {
      ak::load_tile_inputs<kQT, false>(a, g, s_tile[1], s_tile[2], in);
    }
  } else {
    has_tile = ak::find_tile_and_load<kQT, kThreads>(a, tile, g, s_warp, s_tile, in);
  }
  if (a.out_q != nullptr && blockIdx.x == 0 && split == 0) ak::write_quant_padding<kThreads>(a);
  if (!has_tile) {  // CTA-uniform
    ak::timeline_mark(a, 5);
    return;
  }
  ak::timeline_mark(a, 1);
  const int r = s_tile[0], t0 = s_tile[1], nt = s_tile[2];
  // Q: the A fragments of this warp's token (register-A QK wgmma: warp w = rows 16 w ..).
  uint32_t qa[4][4];
  if (kQEarly && q_t0 == t0 && q_nt == nt) {  // CTA-uniform: the guess held
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int x = 0; x < 4; ++x) qa[kk][x] = qe[kk][x];
  } else {
    ak::load_q_fragments(a, g, t0 + tok, tok < nt, qa);
  }
  if (tid < kQT) s_pos[tid] = in.pos;
  if (tid < kQT * 4) s_nan[tid >> 2][tid & 3] = 0u;
  // kEarly: list entries 0 .. s_tile[3] - 1 are already requested. (Session 17 round A: a
  // separate __shared__ int written here raced, per racecheck, with the reads of s_tile just
  // above; session 21 round D: s_tile[3] written by warp 0 right after the scan raced with the
  // other warps' reads of s_tile there.)
  if (tid == 0) s_tile[3] = early_count;
  if ((kTma || kEarly) && !page_early) init_full_barriers(s_full);
  __syncthreads();           // s_pos, s_nan, s_full
  uint32_t full_parity = 0;  // kTma: bit st = parity of the next completion of stage st
  // Block j of the current list into stage st: cp.async by every thread (one commit group per
  // block, empty ones included), or two TMA copies issued by thread 0 (kTma).
  auto load = [&](int j, int count, const int* lmask, const int* lpage, int st) {
    if constexpr (kTma) {
      if (tid == 0 && j < count && lmask[j])
        ak::tma_load_block<kEvictFirst>(&kmap, &vmap, lpage[j], g, base + st * kStageBytes,
                                        ak::smem_u32(&s_full[st]), policy);
    } else {
      if (j < count && lmask[j])
        ak::load_block<kVec16, kThreads, kEvictFirst>(a, lpage[j], g, smem + st * kStageBytes,
                                                      policy);
      ak::cp_async_commit();
    }
  };

  const int64_t pt_row = static_cast<int64_t>(r) * a.pt_stride;
  int n_total = 0;
  if (a.sparse) {
    // kEarly: entry k of the list is the k-th first occurrence in candidate order; candidates
    // 0-31 (warp 0) come first, so the first occurrences among them are the list's first entries.
    // Warp 0 copies entries 0 .. kFirst - 1 into their stages as soon as their pages are known
    // (splits == 1: the CTA walks the list from entry 0; the loop below skips their loads).
    auto early = [&](int cb, int cpage) {
      if constexpr (kEarly) {
        if (a.splits == 1 && !pages_known) {  // (pages_known: early_copy_first above)
          ak::timeline_mark_dep(a, 10, cpage);
          ak::early_copies<kFirst, kEvictFirst>(cb, cpage, &kmap, &vmap, g, base, s_full,
                                                &s_tile[3], policy);
          ak::timeline_mark(a, 11);
        }
      }
    };
    if (!page_early) ak::timeline_mark_dep(a, 8, in.cand_b);
    n_total = ak::sparse_union<kQT, kThreads>(
        a, pt_row, in.cand_b, in.cand_pos, s_pos, s_cand_b, s_cand_page, s_warp, s_list_b,
        s_list_page, s_list_mask, s_list_vlim, early, pages_known, spec_page);
  } else {
    int maxpos = -1;
#pragma unroll
    for (int w = 0; w < kQT; ++w) maxpos = max(maxpos, s_pos[w]);
    n_total = maxpos >= 0 ? min((maxpos >> 7) + 1, a.max_pages) : 0;
  }
  __syncthreads();
  pdl_launch_dependents();  // the next kernel may launch (it waits for this grid to complete)

  const int per = (n_total + a.splits - 1) / a.splits;
  const int lo = min(n_total, split * per);
  const int hi = min(n_total, lo + per);
  ak::timeline_mark(a, 2, hi - lo);

  Rows st;
  float s[64];
  uint32_t p[8][4];
  const int my_pos = s_pos[tok];

  // kTwoPass (variants 21, 27): two passes at most. Pass 0 skips the per-block test for NaN in V
  // (~100 instructions per warp and block): a NaN V element in a row some token sees (rows past
  // every token's position are zeroed) makes O NaN in that dim for EVERY row of the tile (0 * NaN
  // in the shared MMA), so a NaN-free O after pass 0 proves that no such element existed and pass
  // 0's result is exact. Otherwise (a V NaN, or a NaN from K / Q, which makes whole rows NaN) the
  // tile runs again with the test and the exact per-token NaN bookkeeping (pass 1, the session-13
  // path).
#pragma unroll 1
  for (int pass = kTwoPass ? 0 : 1;; ++pass) {
    const bool check = pass > 0;
    st.reset();
    for (int c0 = lo; c0 < hi; c0 += kMaxList) {
      const int count = min(hi - c0, kMaxList);
      const ak::ChunkEntries ce = ak::chunk_entries<kQT, kThreads>(
          a, pt_row, c0, count, s_pos, s_list_b, s_list_page, s_list_mask, s_list_vlim);
      const int* lmask = ce.mask;
      const int* lb = ce.b;
      const int* lpage = ce.page;
      const int* lvlim = ce.vlim;

      // Ring: blocks 0 .. kStages-2 in flight before the loop; iteration i waits for block i (one
      // commit group per block, empty ones included; kTma: the stage's mbarrier, loaded entries
      // only), then, after the barrier in attend_block (every warp's P V(i - 1) complete, its
      // generic f16 stores fenced), refills the stage of block i - 1 with block i + kStages - 1. An
      // entry no token sees is not loaded: its stage holds stale bytes, every row masks its keys
      // and its V rows are zeroed (vlim -1).
      // (kEarly: the first pass's first entries were requested by the union)
      const int skip = pass == (kTwoPass ? 0 : 1) && c0 == lo ? s_tile[3] : 0;
#pragma unroll
      for (int j = 0; j < kStages - 1; ++j) {
        if (j >= skip)
          load(j, count, lmask, lpage, j);
        else if (!kTma)
          ak::cp_async_commit();  // (an empty group keeps the count)
      }
      int stage = 0;
      for (int i = 0; i < count; ++i) {
        if constexpr (kTma) {
          if (lmask[i]) {  // loaded (CTA-uniform): wait for its TMA bytes
            const uint32_t bar = ak::smem_u32(&s_full[stage]), par = (full_parity >> stage) & 1u;
            while (!sm90::mbar_try_wait(bar, par)) {
            }
            full_parity ^= 1u << stage;
          }
        } else {
          ak::cp_async_wait<kStages - 2>();
          if (kEarly && i < skip) {  // an early TMA copy (one phase per kernel)
            while (!sm90::mbar_try_wait(ak::smem_u32(&s_full[i]), 0u)) {
            }
          }
        }
        // (the timeline's first-block mark; 0 when the timeline is off)
        if (i == 0 && tid == 0) s_first = ak::timeline_now(a);
        __syncthreads();  // block i landed for every thread
        const int cur = stage;
        const int prev = stage == 0 ? kStages - 1 : stage - 1;  // the stage of block i - 1
        stage = stage + 1 == kStages ? 0 : stage + 1;
        const int mask = lmask[i];
        const int b = lb[i];
        attend_block<kLazy>(
            st, s, p, qa, smem + cur * kStageBytes, base + cur * kStageBytes, mask, b,
            mask ? lvlim[i] : -1, (mask >> tok) & 1 ? my_pos - b * ak::kBlockKeys : -1, s_pos,
            s_nan, a.scale_log2, check, [&] { load(i + kStages - 1, count, lmask, lpage, prev); });
      }
      ap::wgmma_wait<0>();  // the last P V
      ap::reg_fence(st.o);
      ak::cp_async_wait<0>();
      __syncthreads();  // stages and entries are free for the next chunk; s_nan complete
    }
    if (check) break;
    float probe = st.l[0] + st.l[1];  // O and l are finite unless a NaN took part
#pragma unroll
    for (int k = 0; k < 64; ++k) probe += st.o[k];
    // (the lane-0 broadcast tells ptxas the exit is warp-uniform: no wgmma serialisation)
    if (!__shfl_sync(0xffffffffu, __syncthreads_or(probe != probe), 0)) break;
  }
  ak::timeline_mark(a, 4);
  ak::timeline_put(a, 3, s_first);
  if (kBulkOut && bulk_out_ok(a))  // (CTA-uniform)
    write_rows_bulk(a, st, s_nan[tok], t0, nt, g, smem);
  else
    write_rows(a, st, s_nan[tok], t0, nt, g, split);
  ak::timeline_mark(a, 5);
}

}  // namespace attention_verify
}  // namespace m3attn
