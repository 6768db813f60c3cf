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
//   score with -inf), so their whole row becomes NaN, as in the twin. Variant 9 (session 14) runs
//   the tile without the flagging first and repeats it with the flagging only when that first
//   pass's O or l holds a NaN (see kTwoPass in the kernel); variant 8 flags in every block.
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
// A warp owns the 8 kJ keys key0 .. key0 + 8 kJ - 1 (kJ 4: the one-warpgroup kernel, 2: the
// two-warpgroup one). Lane (q = lane / 8, hl = bit 2 of the lane, cl = lane % 4) owns, for
// j < kJ, the chunk 4 + cl (dims 64 + 16 cl ..) of key kh = key0 + 4 (2 j + 1 - hl) + q and the
// chunk cl (dims 16 cl ..) of key kl = key0 + 4 (2 j + hl) + q: every lane holds kJ high and kJ
// low chunks (the low ones stay raw in registers until S is done), and each 8-lane phase of a load
// touches 8 distinct 16-byte bank groups (keys kh of the two lane halves differ by 4 in their
// swizzle).
__device__ __forceinline__ int early_key(int key0, int j, bool high) {
  const int lane = threadIdx.x & 31;
  const int hl = (lane >> 2) & 1;
  return key0 + 4 * (2 * j + (high ? 1 - hl : hl)) + (lane >> 3);
}

// Reads this warp's raw V rows (keys > vlim read as 0), writes the f16 of dims 64-127 in place,
// keeps the raw dims 0-63 chunks in `lo`. With `check`, returns nonzero when a raw byte read is
// NaN (0 otherwise).
template <int kJ>
__device__ __forceinline__ uint32_t convert_v_high(uint8_t* stage, int key0, int vlim,
                                                   uint4 (&lo)[kJ], bool check) {
  const int cl = threadIdx.x & 3;
  const uint8_t* vraw = stage + kTileBytes;
  uint4 hi[kJ];
  uint32_t nan = 0;
#pragma unroll
  for (int j = 0; j < kJ; ++j) {
    const int kh = early_key(key0, j, true), kl = early_key(key0, j, false);
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
  for (int j = 0; j < kJ; ++j) {
    const int kh = early_key(key0, j, true);
    uint4 h0, h1;
    ak::e4m3x16_to_f16(hi[j], h0, h1);
    *reinterpret_cast<uint4*>(f16_chunk(stage, 1, kh, 2 * cl)) = h0;
    *reinterpret_cast<uint4*>(f16_chunk(stage, 1, kh, 2 * cl + 1)) = h1;
  }
  return nan;
}

// The dims 0-63 chunks kept by convert_v_high -> f16 into the K half (free: S done by every warp
// that reads these keys).
template <int kJ>
__device__ __forceinline__ void convert_v_low(uint8_t* stage, int key0, const uint4 (&lo)[kJ]) {
  const int cl = threadIdx.x & 3;
#pragma unroll
  for (int j = 0; j < kJ; ++j) {
    const int kl = early_key(key0, j, false);
    uint4 h0, h1;
    ak::e4m3x16_to_f16(lo[j], h0, h1);
    *reinterpret_cast<uint4*>(f16_chunk(stage, 0, kl, 2 * cl)) = h0;
    *reinterpret_cast<uint4*>(f16_chunk(stage, 0, kl, 2 * cl + 1)) = h1;
  }
}

// The rare path of a block with a NaN V byte: this warp's `keys` keys from key0 of the f16 tile,
// NaN -> 0, and for each token w of `mask` that sees the key (key <= pos_w - 128 b) the bit of
// (w, dim) in s_nan.
__device__ __noinline__ void scrub_nan_rows(uint8_t* stage, int key0, int keys, int vlim, int mask,
                                            int b, const int* s_pos, uint32_t (*s_nan)[4]) {
  const int lane = threadIdx.x & 31;
  for (int it = 0; it < keys / 4; ++it) {
    const int i = it * 32 + lane;
    const int key = key0 + (i >> 3), c = i & 7;
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
template <typename AfterS>
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
  const int key0 = kKeysPerWarp * (threadIdx.x >> 5);
  uint4 vlo[4];
  const uint32_t nan = convert_v_high(sbuf, key0, vlim, vlo, check);
  ap::wgmma_wait<0>();  // S and the previous block's P V
  ap::reg_fence(s);
  ap::reg_fence(st.o);
  __syncthreads();  // every warp's S and previous P V are done: K half and previous stage free
  after_s();
  convert_v_low(sbuf, key0, vlo);
  ap::fence_proxy_async();  // f16 stores -> wgmma reads (after the barrier below)
  ap::softmax_block(s, st.m, st.l, st.alpha, lim, scale_log2);
  ap::rescale_and_pack<true>(st.o, s, st.alpha, p);
  if (__syncthreads_or(nan != 0u)) {  // f16 tile complete (and a NaN in it: rare)
    scrub_nan_rows(sbuf, key0, kKeysPerWarp, vlim, mask, b, s_pos, s_nan);
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

// Epilogue of one (tile, KV head g, split): this warp's rows of token t0 + warp % 4 (nothing when
// the token is absent; only rows grp + 8 kOnlyE when kOnlyE >= 0), NaN in the dims of nan_dims
// (V NaNs the token sees), normalised BF16 out (splits == 1) or the unnormalised partial and
// (m, l) in the workspace. P V must be complete.
template <int kOnlyE = -1>
__device__ __forceinline__ void write_rows(const AttnArgs& a, const Rows& st,
                                           const uint32_t* nan_dims, int t0, int nt, int g,
                                           int split) {
  const int lane = threadIdx.x & 31, tok = (threadIdx.x >> 5) & 3;
  const int grp = lane >> 2, tig = lane & 3;
  uint32_t nd[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) nd[k] = nan_dims[k];
  const int64_t t = t0 + tok;
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    if (kOnlyE >= 0 && e != kOnlyE) continue;
    float lsum = st.l[e];
    lsum += __shfl_xor_sync(0xffffffffu, lsum, 1);
    lsum += __shfl_xor_sync(0xffffffffu, lsum, 2);
    const float inv = a.splits == 1 && lsum > 0.0f ? 1.0f / lsum : 1.0f;
    float v[32];
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
      for (int x = 0; x < 2; ++x) {
        const int dim = 8 * j + 2 * tig + x;
        const bool is_nan = (nd[dim >> 5] >> (dim & 31)) & 1u;
        v[2 * j + x] = is_nan ? __int_as_float(0x7fffffff) : st.o[4 * j + 2 * e + x] * inv;
      }
    const int h = grp + 8 * e;
    if (a.splits == 1) {
      uint32_t wv[16];  // BF16 pairs of dims 8 j + 2 tig, + 1
      float amax = 0.0f;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        wv[j] = ak::pack_bf16x2(v[2 * j], v[2 * j + 1]);
        amax = fmaxf(amax, ak::amax_pair(wv[j]));
      }
      // o_proj's E4M3 input (CTA-uniform branch): the row's 128 dims are this lane quad's.
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
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

__device__ __forceinline__ void init_full_barriers(uint64_t* s_full) {
  if (threadIdx.x == 0) {
#pragma unroll
    for (int st = 0; st < kStages; ++st) sm90::mbar_init(ak::smem_u32(&s_full[st]), 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
}

// ---------------------------------------------------------------------------------------------
// The decode / verify kernel (variants 8, 9). Grid: (tiles bound x n_kv, 1, splits); block:
// kThreads; dynamic smem kSmemBytes. kTma: K and V tiles by TMA (kmap, vmap), else cp.async;
// kTwoPass: the V NaN test only in a second pass when the first one's O holds a NaN (below).
template <bool kVec16, bool kTma, bool kTwoPass = false>
__global__ void __launch_bounds__(kThreads, 2)
    attention_verify_kernel(const __grid_constant__ AttnArgs a,
                            const __grid_constant__ CUtensorMap kmap,
                            const __grid_constant__ CUtensorMap vmap) {
  static_assert(!kTma || kVec16, "TMA needs 16-byte aligned pools");
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
  __shared__ __align__(8) uint64_t s_full[kStages];  // kTma: K and V of the stage landed

  const int tid = threadIdx.x, tok = tid >> 5;
  // Tile-major grid: the KV heads of a tile are neighbours, and the CTAs past the last real tile
  // (the grid is sized for the worst token distribution) come last, where they fill the tail.
  const int tile = static_cast<int>(blockIdx.x) / a.n_kv;
  const int g = static_cast<int>(blockIdx.x) % a.n_kv, split = blockIdx.z;

  const uint32_t raw_u32 = ak::smem_u32(smem_raw);
  const uint32_t base = (raw_u32 + 1023u) & ~1023u;
  uint8_t* smem = smem_raw + (base - raw_u32);

  ak::TileInputs in;
  const bool has_tile = ak::find_tile_and_load<kQT, kThreads>(a, tile, g, s_warp, s_tile, in);
  if (a.out_q != nullptr && blockIdx.x == 0 && split == 0) ak::write_quant_padding<kThreads>(a);
  if (!has_tile) return;  // CTA-uniform
  const int r = s_tile[0], t0 = s_tile[1], nt = s_tile[2];
  // Q: the A fragments of this warp's token (register-A QK wgmma: warp w = rows 16 w ..).
  uint32_t qa[4][4];
  ak::load_q_fragments(a, g, t0 + tok, tok < nt, qa);
  if (tid < kQT) s_pos[tid] = in.pos;
  if (tid < kQT * 4) s_nan[tid >> 2][tid & 3] = 0u;
  if (kTma) init_full_barriers(s_full);
  __syncthreads();           // s_pos, s_nan, s_full
  uint32_t full_parity = 0;  // kTma: bit st = parity of the next completion of stage st
  // Block j of the current list into stage st: cp.async by every thread (one commit group per
  // block, empty ones included), or two TMA copies issued by thread 0 (kTma).
  auto load = [&](int j, int count, const int* lmask, const int* lpage, int st) {
    if constexpr (kTma) {
      if (tid == 0 && j < count && lmask[j])
        ak::tma_load_block(&kmap, &vmap, lpage[j], g, base + st * kStageBytes,
                           ak::smem_u32(&s_full[st]));
    } else {
      if (j < count && lmask[j]) ak::load_block<kVec16>(a, lpage[j], g, smem + st * kStageBytes);
      ak::cp_async_commit();
    }
  };

  const int64_t pt_row = static_cast<int64_t>(r) * a.pt_stride;
  int n_total = 0;
  if (a.sparse) {
    n_total = ak::sparse_union<kQT, kThreads>(a, pt_row, in.cand_b, in.cand_pos, s_pos, s_cand_b,
                                              s_cand_page, s_warp, s_list_b, s_list_page,
                                              s_list_mask, s_list_vlim);
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

  Rows st;
  float s[64];
  uint32_t p[8][4];
  const int my_pos = s_pos[tok];

  // kTwoPass (variant 9): two passes at most. Pass 0 skips the per-block test for NaN in V (~100
  // instructions per warp and block): a NaN V element in a row some token sees (rows past every
  // token's position are zeroed) makes O NaN in that dim for EVERY row of the tile (0 * NaN in the
  // shared MMA), so a NaN-free O after pass 0 proves that no such element existed and pass 0's
  // result is exact. Otherwise (a V NaN, or a NaN from K / Q, which makes whole rows NaN) the tile
  // runs again with the test and the exact per-token NaN bookkeeping (pass 1, the session-13 path).
#pragma unroll 1
  for (int pass = kTwoPass ? 0 : 1;; ++pass) {
    const bool check = pass > 0;
    st.reset();
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

      // Ring: blocks 0 .. kStages-2 in flight before the loop; iteration i waits for block i (one
      // commit group per block, empty ones included; kTma: the stage's mbarrier, loaded entries
      // only), then, after the barrier in attend_block (every warp's P V(i - 1) complete, its
      // generic f16 stores fenced), refills the stage of block i - 1 with block i + kStages - 1. An
      // entry no token sees is not loaded: its stage holds stale bytes, every row masks its keys
      // and its V rows are zeroed (vlim -1).
#pragma unroll
      for (int j = 0; j < kStages - 1; ++j) load(j, count, lmask, lpage, j);
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
        __syncthreads();  // block i landed for every thread
        const int cur = stage;
        const int prev = stage == 0 ? kStages - 1 : stage - 1;  // the stage of block i - 1
        stage = stage + 1 == kStages ? 0 : stage + 1;
        const int mask = lmask[i];
        const int b = lb[i];
        attend_block(st, s, p, qa, smem + cur * kStageBytes, base + cur * kStageBytes, mask, b,
                     mask ? lvlim[i] : -1, (mask >> tok) & 1 ? my_pos - b * ak::kBlockKeys : -1,
                     s_pos, s_nan, a.scale_log2, check,
                     [&] { load(i + kStages - 1, count, lmask, lpage, prev); });
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
  write_rows(a, st, s_nan[tok], t0, nt, g, split);
}

// ---------------------------------------------------------------------------------------------
// Variant 11 (session 15): two warpgroups per CTA, each owning one half of every block's keys.
//   Why: variant 9 is issue-latency bound (session 13 ncu: ~955 instructions per warp and block,
//   41 % issue slots, fixed-latency waits 27 %) with one warpgroup per CTA and 246 registers, i.e.
//   8 warps per SM (2 per scheduler). Here warpgroup h (threads 128 h ..) owns keys 64 h .. 64 h +
//   63 of every block: S = Q K_h^T (4 x wgmma m64n64k32 e4m3, A = the Q tile in shared memory,
//   B = K rows 64 h ..), its own online softmax over those keys (32 scores per lane), V -> f16 of
//   its keys only (each warp 16 keys: the layout and the in-place trick of variant 9 restricted to
//   the warpgroup's rows, which no other warpgroup reads), O += P V_h (4 x wgmma m64n128k16, O all
//   128 dims: 64 registers). The two warpgroups are two independent online softmaxes over
//   disjoint keys of the same blocks, combined once in the epilogue (as the split merge does);
//   each then finalises one row of every lane pair (rows grp: warpgroup 0, grp + 8: 1), which
//   halves the epilogue per lane (out_q: 32 quantisations instead of 64). <= 128 registers: 16
//   warps per SM (2 CTAs of 256 threads), each with about half the instructions per block.
//   Shared memory: the 3-stage TMA ring (96 KB) + the Q tile (8 KB, K-major, 128-byte swizzle).
//   Per block: the stage's mbarrier (each thread waits), S, early V conversion, one CTA barrier
//   (every S and the previous P V done: thread 0 refills the previous stage), late V conversion,
//   softmax, one warpgroup barrier (its f16 rows complete; with the NaN test a bar.red.or), P V.
//   P V(i) is waited for before S(i + 1) is issued (P dead: registers).
//   NaN in V: the test and scrub of variant 9's second pass, in every block, per warpgroup.
constexpr int kThreads2 = 256;
constexpr int kQBytes = kQT * ak::kRows * ak::kDim;  // the Q tile: 64 rows x 128 bytes
constexpr int kSmemBytes2 = kStages * kStageBytes + kQBytes + 1024;
constexpr int kHalf = ak::kBlockKeys / 2;  // keys per warpgroup and block

// d (64 x 64 f32) (+)= A (64 x 32 e4m3, smem, K-major) x B (32 x 64 e4m3, K-major, smem).
__device__ __forceinline__ void wgmma_qk_ss_n64(float (&d)[32], uint64_t da, uint64_t db,
                                                int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, "
      "%9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, "
      "%27, %28, %29, %30, %31}, %32, %33, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db), "r"(accumulate));
}

// Named barrier of warpgroup h (ids 1, 2; 0 is __syncthreads), and its OR-reduction.
__device__ __forceinline__ void wg_sync(int h) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(1 + h) : "memory");
}
__device__ __forceinline__ bool wg_sync_or(int h, bool v) {
  uint32_t r;
  asm volatile(
      "{\n.reg .pred p, q;\nsetp.ne.u32 p, %1, 0;\nbar.red.or.pred q, %2, 128, p;\n"
      "selp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(r)
      : "r"(v ? 1u : 0u), "r"(1 + h)
      : "memory");
  return r != 0u;
}

// The 64 Q rows (row 16 w + h: head h of token t0 + w; zero for absent tokens and h >= group) into
// the Q tile, chunk c of row r at chunk c ^ (r & 7) (the layout of a K tile), by all threads.
__device__ __forceinline__ void load_q_tile(const AttnArgs& a, int g, int t0, int nt, uint8_t* qs) {
  const int r = threadIdx.x >> 2, part = threadIdx.x & 3;  // 32 bytes: chunks 2 part, + 1
  const int w = r >> 4, h = r & 15;
  uint32_t v[8];
  const bool present = w < nt && h < a.group;
  const uint8_t* src = a.q + static_cast<int64_t>(present ? t0 + w : 0) * a.q_stride_t +
                       static_cast<int64_t>(g * a.group + h) * ak::kDim + 32 * part;
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] = present ? reinterpret_cast<const uint32_t*>(src)[k] : 0u;
#pragma unroll
  for (int c = 0; c < 2; ++c)
    *reinterpret_cast<uint4*>(qs + r * ak::kDim + (((2 * part + c) ^ (r & 7)) << 4)) =
        make_uint4(v[4 * c], v[4 * c + 1], v[4 * c + 2], v[4 * c + 3]);
}

// Combines this lane's state with the other warpgroup's (same lane, same rows and dims, disjoint
// keys) for rows grp + 8 kE, kE = this warpgroup: the other's O of those rows and its (m, l) come
// through shared memory (xo: [2][8][128] float4, xml: [2][128] float2), ours go the other way.
template <int kE>
__device__ __forceinline__ void merge_halves(Rows& st, float4* xo, float2* xml) {
  constexpr int e = kE, f = 1 - kE;
  const int wt = threadIdx.x & 127;
#pragma unroll
  for (int j = 0; j < 8; ++j)  // rows grp + 8 f: o[8 j + 2 f], + 1 (dims 16 j + 2 tig ..), o[8 j +
                               // 4 + 2 f], + 1 (dims 16 j + 8 + 2 tig ..)
    xo[(e * 8 + j) * 128 + wt] = make_float4(st.o[8 * j + 2 * f], st.o[8 * j + 2 * f + 1],
                                             st.o[8 * j + 4 + 2 * f], st.o[8 * j + 5 + 2 * f]);
  xml[e * 128 + wt] = make_float2(st.m[f], st.l[f]);
  __syncthreads();
  const float2 ml = xml[f * 128 + wt];
  const float mx = fmaxf(st.m[e], ml.x);
  const float mu = mx == -INFINITY ? 0.0f : mx;
  const float fa = ak::fast_exp2(st.m[e] - mu), fb = ak::fast_exp2(ml.x - mu);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float4 x = xo[(f * 8 + j) * 128 + wt];
    st.o[8 * j + 2 * e] = st.o[8 * j + 2 * e] * fa + x.x * fb;
    st.o[8 * j + 2 * e + 1] = st.o[8 * j + 2 * e + 1] * fa + x.y * fb;
    st.o[8 * j + 4 + 2 * e] = st.o[8 * j + 4 + 2 * e] * fa + x.z * fb;
    st.o[8 * j + 5 + 2 * e] = st.o[8 * j + 5 + 2 * e] * fa + x.w * fb;
  }
  st.m[e] = mx;
  st.l[e] = st.l[e] * fa + ml.y * fb;
}

// Grid: (tiles bound x n_kv, 1, splits); block: kThreads2; dynamic smem kSmemBytes2. TMA loads
// only (the launcher runs variant 8 where TMA cannot address the pool).
__global__ void __launch_bounds__(kThreads2, 2)
    attention_verify2_kernel(const __grid_constant__ AttnArgs a,
                             const __grid_constant__ CUtensorMap kmap,
                             const __grid_constant__ CUtensorMap vmap) {
  extern __shared__ uint8_t smem_raw[];
  __shared__ int s_warp[kThreads2 / 32];
  __shared__ int s_tile[3];
  __shared__ int s_pos[kQT];
  __shared__ int s_cand_b[kCand];
  __shared__ int s_cand_page[kCand];
  __shared__ int s_list_b[kMaxList];
  __shared__ int s_list_page[kMaxList];
  __shared__ int s_list_mask[kMaxList];
  __shared__ int s_list_vlim[kMaxList];
  __shared__ uint32_t s_nan[kQT][4];  // (token, dim) bits of NaN V elements the token sees
  __shared__ __align__(8) uint64_t s_full[kStages];

  const int tid = threadIdx.x, h = tid >> 7, tok = (tid >> 5) & 3;
  const int tile = static_cast<int>(blockIdx.x) / a.n_kv;
  const int g = static_cast<int>(blockIdx.x) % a.n_kv, split = blockIdx.z;
  const int key0 = kHalf * h + 16 * tok;  // this warp's 16 keys of the V conversion

  const uint32_t raw_u32 = ak::smem_u32(smem_raw);
  const uint32_t base = (raw_u32 + 1023u) & ~1023u;
  uint8_t* smem = smem_raw + (base - raw_u32);
  const uint32_t qbase = base + kStages * kStageBytes;

  ak::TileInputs in;
  const bool has_tile = ak::find_tile_and_load<kQT, kThreads2>(a, tile, g, s_warp, s_tile, in);
  if (a.out_q != nullptr && blockIdx.x == 0 && split == 0) ak::write_quant_padding<kThreads2>(a);
  if (!has_tile) return;  // CTA-uniform
  const int r = s_tile[0], t0 = s_tile[1], nt = s_tile[2];
  load_q_tile(a, g, t0, nt, smem + kStages * kStageBytes);
  ap::fence_proxy_async();  // Q tile stores -> wgmma reads (after the barriers below)
  if (tid < kQT) s_pos[tid] = in.pos;
  if (tid < kQT * 4) s_nan[tid >> 2][tid & 3] = 0u;
  init_full_barriers(s_full);
  __syncthreads();  // s_pos, s_nan, s_full, the Q tile
  uint32_t full_parity = 0;
  auto load = [&](int j, int count, const int* lmask, const int* lpage, int st) {
    if (tid == 0 && j < count && lmask[j])
      ak::tma_load_block(&kmap, &vmap, lpage[j], g, base + st * kStageBytes,
                         ak::smem_u32(&s_full[st]));
  };

  const int64_t pt_row = static_cast<int64_t>(r) * a.pt_stride;
  int n_total = 0;
  if (a.sparse) {
    n_total = ak::sparse_union<kQT, kThreads2>(a, pt_row, in.cand_b, in.cand_pos, s_pos, s_cand_b,
                                               s_cand_page, s_warp, s_list_b, s_list_page,
                                               s_list_mask, s_list_vlim);
  } else {
    int maxpos = -1;
#pragma unroll
    for (int w = 0; w < kQT; ++w) maxpos = max(maxpos, s_pos[w]);
    n_total = maxpos >= 0 ? min((maxpos >> 7) + 1, a.max_pages) : 0;
  }
  __syncthreads();
  pdl_launch_dependents();

  const int per = (n_total + a.splits - 1) / a.splits;
  const int lo = min(n_total, split * per);
  const int hi = min(n_total, lo + per);

  Rows st;
  float s[32];
  uint32_t p[4][4];
  const int my_pos = s_pos[tok];

  // One pass with the V NaN test in every block (~30 instructions per warp and block here). The
  // two passes of variant 9 (the test only in a second pass when the first left a NaN) spill at
  // 128 registers: 36-116 bytes with the pass loop or two instantiations of it; none with one.
  {
    st.reset();
    for (int c0 = lo; c0 < hi; c0 += kMaxList) {
      const int count = min(hi - c0, kMaxList);
      int off = c0;
      if (!a.sparse) {
        __syncthreads();  // the previous chunk's entries are no longer read
        ak::dense_entries<kQT, kThreads2>(a, pt_row, c0, count, s_pos, s_list_b, s_list_page,
                                          s_list_mask, s_list_vlim);
        __syncthreads();
        off = 0;
      }
      const int* lmask = s_list_mask + off;
      const int* lb = s_list_b + off;
      const int* lpage = s_list_page + off;
      const int* lvlim = s_list_vlim + off;
#pragma unroll
      for (int j = 0; j < kStages - 1; ++j) load(j, count, lmask, lpage, j);
      int stage = 0;
      for (int i = 0; i < count; ++i) {
        const int mask = lmask[i];
        if (mask) {  // loaded (CTA-uniform): wait for its TMA bytes
          sm90::mbar_wait(ak::smem_u32(&s_full[stage]), (full_parity >> stage) & 1u);
          full_parity ^= 1u << stage;
        }
        const int cur = stage;
        const int prev = stage == 0 ? kStages - 1 : stage - 1;
        stage = stage + 1 == kStages ? 0 : stage + 1;
        uint8_t* sbuf = smem + cur * kStageBytes;
        const uint32_t saddr = base + cur * kStageBytes;
        const int b = lb[i];
        const int vlim = mask ? lvlim[i] : -1;
        // This warp's last visible key of the block, relative to the warpgroup's first key.
        const int lim = ((mask >> tok) & 1 ? my_pos - b * ak::kBlockKeys : -1) - kHalf * h;
        // Dims 64-127 of V (in place, the warp's own rows), then S = Q K_h^T (P V of the previous
        // block complete: waited for below); dims 0-63 go into the K rows once S is done.
        uint4 vlo[2];
        const uint32_t nan = convert_v_high(sbuf, key0, vlim, vlo, true);
        ap::reg_fence(s);
        ap::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          wgmma_qk_ss_n64(s, ap::smem_desc(qbase + 32 * kk, 16, 1024),
                          ap::smem_desc(saddr + kHalf * h * ak::kDim + 32 * kk, 16, 1024),
                          kk > 0 ? 1 : 0);
        ap::wgmma_commit();
        ap::wgmma_wait<0>();
        ap::reg_fence(s);
        __syncthreads();  // every S(i) and P V(i - 1) done: the previous stage is free
        load(i + kStages - 1, count, lmask, lpage, prev);
        convert_v_low(sbuf, key0, vlo);
        ap::fence_proxy_async();  // f16 stores -> wgmma reads (after the barrier below)
        ap::softmax_block(s, st.m, st.l, st.alpha, lim, a.scale_log2);
        ap::rescale_and_pack<true>(st.o, s, st.alpha, p);
        if (wg_sync_or(h, nan != 0u)) {  // the warpgroup's f16 rows complete (a NaN: rare)
          scrub_nan_rows(sbuf, key0, 16, vlim, mask, b, s_pos, s_nan);
          ap::fence_proxy_async();
          wg_sync(h);
        }
        // O += P V_h.
        ap::reg_fence(st.o);
        ap::reg_fence(p);
        ap::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          ap::wgmma_pv(st.o, p[kk],
                       ap::smem_desc(saddr + (kHalf * h + 16 * kk) * ak::kDim, kTileBytes, 1024));
        ap::wgmma_commit();
        ap::wgmma_wait<0>();
        ap::reg_fence(st.o);
      }
      __syncthreads();  // stages and entries are free for the next chunk; s_nan complete
    }
  }
  // The stages are free (every TMA copy waited for, every wgmma complete, barrier above).
  float4* xo = reinterpret_cast<float4*>(smem);
  float2* xml = reinterpret_cast<float2*>(smem + 2 * 8 * 128 * sizeof(float4));
  if (h == 0) {
    merge_halves<0>(st, xo, xml);
    write_rows<0>(a, st, s_nan[tok], t0, nt, g, split);
  } else {
    merge_halves<1>(st, xo, xml);
    write_rows<1>(a, st, s_nan[tok], t0, nt, g, split);
  }
}

}  // namespace attention_verify
}  // namespace m3attn
