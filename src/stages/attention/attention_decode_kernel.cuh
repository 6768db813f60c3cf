// The decode kernel of the paged FP8 attention (SPEC section 6; AttentionCudaConfig::kernel 1, the
// automatic choice for decode since session 14): one query token per tile on mma.sync, 8 warps
// sharing each block's work with none done twice. It replaced the 4-warp tile kernel (same grid,
// block list, ring, split workspace and numerics; each warp a 32-key slice of every block and all
// 128 dims of O), removed after round A of session 14.
//
// Why (session 13 ncu, B64 8K): the 4-warp kernel was issue-latency bound: ~1015 instructions per
//   warp and block at ~4.1 cycles each with 2 warps per scheduler, and at batch 64 (one wave of
//   256 CTAs) the time is 16 blocks x that per-block latency. Each of its warps owned 32 keys and
//   all 128 dims of O (64 fp32 accumulators per lane, 198 registers), so more warps did not fit.
//
// Work decomposition (CTA = 8 warps, 256 threads, 2 CTAs per SM: 16 warps per SM, <= 128 registers)
//   Per block (128 keys), warp w:
//   - S = Q K^T for keys 16 w .. 16 w + 15 (2 n-tiles of 8 keys) on f16 m16n8k16 MMAs: Q is
//     converted to f16 once (32 registers) and each raw K fragment (ldmatrix of the swizzled raw
//     tile) by cvt.rn.f16x2.e4m3x2 (exact). The k order inside a 16-dim chunk is permuted the same
//     way on both sides (k 2 tig, 2 tig + 1 <- dims 4 tig, 4 tig + 1; k 8 + 2 tig, .. <- dims
//     4 tig + 2, 4 tig + 3), so the 4 raw bytes a lane holds feed one MMA without shuffles; the
//     products of E4M3 values are exact in f16 x f16 -> fp32 (sm_90 runs FP8 mma.sync as exactly
//     this conversion plus f16 MMAs into zero accumulators plus fp32 adds; here the adds are gone).
//   - Online softmax shared by the CTA: the warp's row maxima go to shared memory, every warp
//     reads the 8 maxima of its rows (barrier), so all warps hold the same running max m and the
//     same rescale factors; P = 2^(s * scale log2 e - m) rounded to f16: the accumulators of the
//     two n-tiles are one f16 A fragment of k-step w (keys 16 w ..), stored as one 16-byte word per
//     lane (s_p[w][lane]).
//   - O += P V for dims 16 w .. 16 w + 15 (2 n-tiles: even and odd dims) over all 128 keys (8
//     k-steps; P fragments by 16-byte shared loads, barrier before): V by ldmatrix.trans of the raw
//     tile (keys 2 tig, 2 tig + 1 of 2 dims per register), one prmt + two cvt per register; keys
//     past the token's position are cleared first (unwritten slots may hold NaN, 0 * NaN = NaN).
//   O is 16 rows x 16 dims per warp (2 accumulator sets, even / odd k-steps: 16 registers).
//   Three CTA barriers per block (block landed; maxima; P), each across 8 warps doing equal work.
// Epilogue: the partial row sums l of the 8 warps (each over its 16 keys) are added in shared
//   memory; BF16 out (8 bytes per lane and row) or the unnormalised partial (o, m, l) of a split
//   for attention_merge_kernel; with out_q, o_proj's E4M3 input too (one 1x128 block per row, the
//   quantize stage's numerics; the row's amax over the 8 warps through shared memory).
// Bytes moved: 32 KB per selected block and KV head, read once. Session 14 round A (H200, sparse,
//   isolated us at 8K / 32K / 128K): B64 41.2 / 41.2 / 41.5 (75.1-75.8 % of 4300 GB/s), B256
//   144.3-145.0 (86.1-86.6 %), B1 12.1-12.9 (latency-bound: 16 splits + merge); the 4-warp kernel
//   44.9 / 43.6 / 44.6, 153.2-154.0, 13.8-14.8. ncu (B64 8K, round A): 429 instructions per warp
//   and block, 16 warps per SM, stall samples: waiting for the block's data at the loop top ~24 %,
//   barriers 16 %, short scoreboard 15 %. Round B: the high-byte cvt without a shift and the local
//   mask only in the local block took it to 383 instructions (issue slots 31.6 % busy) at the same
//   time (B64 41.6 / 42.0 / 42.4 us, B256 144.9-145.5): bound by the data (HBM at ~82 % of copy
//   once streaming, plus the per-CTA start chain), not by issue.
#pragma once

#include <cstdint>

#include "core/pdl.cuh"
#include "stages/attention/attention_kernel.cuh"

namespace m3attn {
namespace attention_decode {

namespace ak = attention_kernel;
using ak::AttnArgs;

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kStages = 3;
constexpr int kSmemBytes = kStages * ak::kStageBytes;  // 96 KB of dynamic shared memory
static_assert(kWarps * 16 == ak::kBlockKeys && kWarps * 16 == ak::kDim, "16 keys / dims a warp");

// f16 A fragments of the token's 16 query heads of KV head g (zero for heads >= group and an absent
// token) from the raw ones of ak::load_q_fragments: qh[c] is 16-dim chunk c with the k order of the
// K fragments (see the design comment).
__device__ __forceinline__ void q_to_f16(const uint32_t (&qa)[4][4], uint32_t (&qh)[8][4]) {
  // qa[kk][0 / 2]: row grp, chunk 2 kk / 2 kk + 1
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    const uint32_t r0 = qa[c >> 1][2 * (c & 1)], r1 = qa[c >> 1][2 * (c & 1) + 1];
    qh[c][0] = ak::e4m3x2_to_f16x2(r0);     // row grp, dims 16 c + 4 tig, + 1
    qh[c][1] = ak::e4m3x2_to_f16x2(r1);     // row grp + 8
    qh[c][2] = ak::e4m3x2_hi_to_f16x2(r0);  // row grp, dims 16 c + 4 tig + 2, + 3
    qh[c][3] = ak::e4m3x2_hi_to_f16x2(r1);
  }
}

// Bytes of the raw V register (key k0: 2 dims, key k0 + 1: the same 2 dims) regrouped as
// (k0, k0 + 1) of the first dim, then of the second: the B fragments of the even / odd n-tile.
__device__ __forceinline__ void v_pairs(uint32_t r, uint32_t& even, uint32_t& odd) {
  const uint32_t x = __byte_perm(r, 0u, 0x3120u);
  even = ak::e4m3x2_to_f16x2(x);
  odd = ak::e4m3x2_hi_to_f16x2(x);
}

// Keep-mask of a raw V register holding keys k0 (low half) and k0 + 1 (high half).
__device__ __forceinline__ uint32_t keep_bits(int k0, int lim) {
  return (k0 <= lim ? 0x0000ffffu : 0u) | (k0 + 1 <= lim ? 0xffff0000u : 0u);
}

// O += P V over the 128 keys of the block for this warp's dims 16 w .. 16 w + 15. kMask: keys past
// lim are cleared in V (the local block).
template <bool kMask>
__device__ __forceinline__ void pv_block(float (&o)[2][2][4], const uint4* s_p, uint32_t v_smem,
                                         int lim) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, tig = lane & 3;
  // ldmatrix.trans lane L addresses key 32 kq + L (matrix L / 8 = keys 8 (L / 8) ..), chunk w.
  const uint32_t vaddr = v_smem + lane * ak::kDim + ((warp ^ (lane & 7)) << 4);
#pragma unroll
  for (int kq = 0; kq < 4; ++kq) {
    uint32_t r[4];
    ak::ldsm_x4_trans(vaddr + kq * 32 * ak::kDim, r[0], r[1], r[2], r[3]);
    if constexpr (kMask) {
#pragma unroll
      for (int m = 0; m < 4; ++m) r[m] &= keep_bits(32 * kq + 8 * m + 2 * tig, lim);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // k-step 2 kq + h: registers 2 h (keys < 8), 2 h + 1
      const int kk = 2 * kq + h;
      const uint4 pv = s_p[kk * 32 + lane];
      const uint32_t pa[4] = {pv.x, pv.y, pv.z, pv.w};
      uint32_t e0, o0, e1, o1;
      v_pairs(r[2 * h], e0, o0);
      v_pairs(r[2 * h + 1], e1, o1);
      ak::mma_f16(o[h][0], pa, e0, e1);
      ak::mma_f16(o[h][1], pa, o0, o1);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Grid: (tiles bound = tokens, n_kv, splits); block: kThreads; dynamic smem kSmemBytes.
// Session 16: Q's f16 conversion comes after the block list instead of before it, so that the load
// of Q and the page-table loads of the union overlap (round A timeline, B64: the conversion waited
// for Q before the union issued its page-table loads, two dependent global round trips; rounds B /
// C: B64 41.1-42.1 vs 41.9-42.9 us, B256 142.9-145.5 vs 144.7-147.9; the same bytes). Lost and
// removed (round C): starting the ring on one block to halve the one-wave grid's initial burst
// (B64 the same, B256 146.4-147.3 vs 145.1-145.5).
// Session 17: kEarly (attention_decode_early_kernel, automatic where TMA can address the pool):
// the verify kernel's early copies (ak::early_copies): warp 0 requests the list's first two blocks
// by TMA (through the prefill kernel's tensor maps; the same swizzled layout as ak::load_block, so
// the stage base is 1024-byte aligned) as soon as their pages are known, before the union is
// complete; the ring waits for them on an mbarrier each and loads the rest by cp.async as before
// (one split, sparse; the same bytes in the same order). Round B (isolated us): B64 41.1-42.1 vs
// 41.2-42.9 without (8K / 32K / 128K), B256 @ 32K 142.6 / 142.7 vs 144.3-145.1; timeline (B64 @
// 32K): exit p50 / max 35.1 / 38.8 vs 36.5 / 39.9 us after the first entry.
// kFirst (kEarly): the blocks requested early (kStages - 1; decode_kernel 11, session 18: 1, the
// automatic choice for one-wave grids). Round F (three alternating runs, isolated us): B64 at 8K /
// 32K / 128K 40.4-41.0 vs 40.5-41.3 with two, B256 @ 32K 141.9-142.3 vs 141.2-141.9 (B256 keeps
// two). As in the verify kernel (its variant 34), a one-wave grid's initial burst of early copies
// queues each CTA's first block behind its second; with one per CTA the first lands sooner.
template <bool kVec16, bool kEarly, int kFirst = kStages - 1>
__device__ __forceinline__ void decode_cta(const AttnArgs& a, const CUtensorMap* kmap,
                                           const CUtensorMap* vmap, uint8_t* smem) {
  __shared__ int s_warp[kWarps];
  __shared__ int s_tile[4];  // request, first token, tokens; [3]: kEarly's early entries
  __shared__ __align__(8) uint64_t s_full[kStages - 1];  // kEarly: entries 0, 1 landed
  __shared__ int s_pos[1];
  __shared__ int s_cand_b[ak::kTopKIds];
  __shared__ int s_cand_page[ak::kTopKIds];
  __shared__ int s_list_b[ak::kMaxList];
  __shared__ int s_list_page[ak::kMaxList];
  __shared__ int s_list_mask[ak::kMaxList];
  __shared__ __align__(16) float s_max[ak::kRows][kWarps];  // raw row maxima of each warp's keys
  __shared__ __align__(16) uint4 s_p[kWarps * 32];          // P fragments, k-step w = warp w
  __shared__ float s_l[kWarps][ak::kRows];
  __shared__ float s_amax[kWarps][ak::kRows];  // out_q: |max| of each warp's 16 dims per row

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int grp = lane >> 2, tig = lane & 3;
  const int g = blockIdx.y, split = blockIdx.z;

  ak::timeline_mark(a, 0);
  ak::TileInputs in;  // (pdl_wait inside, before the ids, Q and the cache are read)
  const bool has_tile =
      ak::find_tile_and_load<1, kThreads>(a, static_cast<int>(blockIdx.x), g, s_warp, s_tile, in);
  if (a.out_q != nullptr && blockIdx.x == 0 && g == 0 && split == 0)
    ak::write_quant_padding<kThreads>(a);
  if (!has_tile) {  // CTA-uniform
    ak::timeline_mark(a, 5);
    return;
  }
  ak::timeline_mark(a, 1);
  const int r = s_tile[0], t0 = s_tile[1];
  if (tid == 0) s_pos[0] = in.pos;
  if (kEarly && tid == 0) {
    s_tile[3] = 0;
#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) sm90::mbar_init(ak::smem_u32(&s_full[st]), 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  uint32_t qa[4][4];  // raw Q fragments; f16 (qh) once the block list is built
  ak::load_q_fragments(a, g, t0, true, qa);
  __syncthreads();  // s_pos (kEarly: s_tile[3], s_full)

  const int64_t pt_row = static_cast<int64_t>(r) * a.pt_stride;
  const int my_pos = s_pos[0];
  int n_total = 0;
  if (a.sparse) {
    auto early = [&](int cb, int cpage) {
      if constexpr (kEarly) {
        if (a.splits == 1)
          ak::early_copies<kFirst>(cb, cpage, kmap, vmap, g, ak::smem_u32(smem), s_full,
                                   &s_tile[3]);
      }
    };
    n_total = ak::sparse_union<1, kThreads>(a, pt_row, in.cand_b, in.cand_pos, s_pos, s_cand_b,
                                            s_cand_page, s_warp, s_list_b, s_list_page, s_list_mask,
                                            nullptr, early);
  } else {
    n_total = my_pos >= 0 ? min((my_pos >> 7) + 1, a.max_pages) : 0;
  }
  __syncthreads();

  pdl_launch_dependents();  // the next kernel may launch (it waits for this grid to complete)
  const int per = (n_total + a.splits - 1) / a.splits;
  const int lo = min(n_total, split * per);
  const int hi = min(n_total, lo + per);
  ak::timeline_mark(a, 2, hi - lo);
  uint32_t qh[8][4];
  q_to_f16(qa, qh);

  float o[2][2][4];
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int n = 0; n < 2; ++n) o[h][n][0] = o[h][n][1] = o[h][n][2] = o[h][n][3] = 0.0f;
  float m0 = -INFINITY, m1 = -INFINITY;  // running row maxima (log2 domain), rows grp, grp + 8
  float l0 = 0.0f, l1 = 0.0f;            // this lane's share of the row sums

  // ldmatrix lane L of the K fragments: key 16 w + 8 j + (L & 7), chunk 4 kp + (L >> 3).
  const uint32_t kaddr0 = (16 * warp + (lane & 7)) * ak::kDim + (((lane >> 3) ^ (lane & 7)) << 4);
  const uint32_t kaddr1 =
      (16 * warp + (lane & 7)) * ak::kDim + (((4 + (lane >> 3)) ^ (lane & 7)) << 4);

  // One block in the stage at k_smem (CTA-uniform lim: keys > lim are in the token's future).
  // QK: S of this warp's 16 keys, masked, its row maxima into s_max (barrier before `softmax`).
  float s[2][4];
  auto qk = [&](uint32_t k_smem, int lim) {
    float s2[2][4];  // second accumulator chain per n-tile
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
      s2[j][0] = s2[j][1] = s2[j][2] = s2[j][3] = 0.0f;
#pragma unroll
      for (int kp = 0; kp < 2; ++kp) {
        uint32_t b[4];
        ak::ldsm_x4(k_smem + (kp ? kaddr1 : kaddr0) + j * 8 * ak::kDim, b[0], b[1], b[2], b[3]);
#pragma unroll
        for (int mm = 0; mm < 4; ++mm)
          ak::mma_f16(mm & 1 ? s2[j] : s[j], qh[4 * kp + mm], ak::e4m3x2_to_f16x2(b[mm]),
                      ak::e4m3x2_hi_to_f16x2(b[mm]));
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] += s2[j][e];
    }
    if (lim < ak::kBlockKeys - 1) {  // CTA-uniform: the local block
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (16 * warp + 8 * j + 2 * tig + (e & 1) > lim) s[j][e] = -INFINITY;
    }
    float mx0 = fmaxf(fmaxf(s[0][0], s[0][1]), fmaxf(s[1][0], s[1][1]));
    float mx1 = fmaxf(fmaxf(s[0][2], s[0][3]), fmaxf(s[1][2], s[1][3]));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    if (tig == 0) {
      s_max[grp][warp] = mx0;
      s_max[grp + 8][warp] = mx1;
    }
  };
  // Softmax: every warp's maxima (after a barrier) -> the CTA's running max, P of this warp's keys
  // into s_p (barrier before `pv`), O rescaled.
  auto softmax = [&]() {
    float mx0, mx1;
    {
      const float4* r0 = reinterpret_cast<const float4*>(s_max[grp]);
      const float4* r1 = reinterpret_cast<const float4*>(s_max[grp + 8]);
      const float4 a0 = r0[0], a1 = r0[1], b0 = r1[0], b1 = r1[1];
      mx0 = fmaxf(fmaxf(fmaxf(a0.x, a0.y), fmaxf(a0.z, a0.w)),
                  fmaxf(fmaxf(a1.x, a1.y), fmaxf(a1.z, a1.w)));
      mx1 = fmaxf(fmaxf(fmaxf(b0.x, b0.y), fmaxf(b0.z, b0.w)),
                  fmaxf(fmaxf(b1.x, b1.y), fmaxf(b1.z, b1.w)));
    }
    // The same m, alpha in every warp (same inputs, same operations).
    const float n0 = fmaxf(m0, mx0 * a.scale_log2), n1 = fmaxf(m1, mx1 * a.scale_log2);
    // A row that has seen only masked keys keeps m = -inf; subtract 0 then (exp2 gives 0).
    const float mu0 = n0 == -INFINITY ? 0.0f : n0, mu1 = n1 == -INFINITY ? 0.0f : n1;
    const float alpha0 = ak::fast_exp2(m0 - mu0), alpha1 = ak::fast_exp2(m1 - mu1);
    m0 = n0;
    m1 = n1;
    float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      s[j][0] = ak::fast_exp2(fmaf(s[j][0], a.scale_log2, -mu0));
      s[j][1] = ak::fast_exp2(fmaf(s[j][1], a.scale_log2, -mu0));
      s[j][2] = ak::fast_exp2(fmaf(s[j][2], a.scale_log2, -mu1));
      s[j][3] = ak::fast_exp2(fmaf(s[j][3], a.scale_log2, -mu1));
      sum0 += s[j][0] + s[j][1];
      sum1 += s[j][2] + s[j][3];
    }
    l0 = l0 * alpha0 + sum0;
    l1 = l1 * alpha1 + sum1;
    s_p[warp * 32 + lane] =
        make_uint4(ak::pack_f16x2(s[0][0], s[0][1]), ak::pack_f16x2(s[0][2], s[0][3]),
                   ak::pack_f16x2(s[1][0], s[1][1]), ak::pack_f16x2(s[1][2], s[1][3]));
    if (!__all_sync(0xffffffffu, alpha0 == 1.0f && alpha1 == 1.0f)) {
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          o[h][n][0] *= alpha0;
          o[h][n][1] *= alpha0;
          o[h][n][2] *= alpha1;
          o[h][n][3] *= alpha1;
        }
    }
  };
  auto pv = [&](uint32_t k_smem, int lim) {
    if (lim < ak::kBlockKeys - 1)
      pv_block<true>(o, s_p, k_smem + ak::kTileBytes, lim);
    else
      pv_block<false>(o, s_p, k_smem + ak::kTileBytes, lim);
  };

  for (int c0 = lo; c0 < hi; c0 += ak::kMaxList) {
    const int count = min(hi - c0, ak::kMaxList);
    // Dense: the barriers around the chunk's entries also order the previous chunk's stages.
    const ak::ChunkEntries ce = ak::chunk_entries<1, kThreads>(
        a, pt_row, c0, count, s_pos, s_list_b, s_list_page, s_list_mask, nullptr);
    auto load = [&](int j, int st) {
      if (j < count && ce.mask[j])
        ak::load_block<kVec16, kThreads>(a, ce.page[j], g, smem + st * ak::kStageBytes);
      ak::cp_async_commit();
    };
    // kStages-stage ring, blocks 0 .. kStages - 2 in flight before the loop, one commit group per
    // block (empty ones included). An entry with mask 0 (a dense page outside the pool:
    // CTA-uniform) is neither loaded nor attended.
    const int skip = kEarly && c0 == lo ? s_tile[3] : 0;  // entries the union copied by TMA
#pragma unroll
    for (int j = 0; j < kStages - 1; ++j) {
      if (j < skip)
        ak::cp_async_commit();  // (an empty group keeps the count)
      else
        load(j, j);
    }
    int stage = 0;
    // Three barriers per block: block i landed (and block i - 1 consumed: refill), maxima, P.
    // (Session 14 round B: two barriers, the refill after QK, was no faster: B64 41.3 / 41.4 / 41.4
    // vs 41.6 / 42.0 / 42.4 us, B256 147.3-147.9 vs 144.9-145.5, B1 12.8 vs 12.0.)
    for (int i = 0; i < count; ++i) {
      ak::cp_async_wait<kStages - 2>();
      if (kEarly && i < skip) {  // its TMA bytes (one phase per kernel)
        while (!sm90::mbar_try_wait(ak::smem_u32(&s_full[i]), 0u)) {
        }
      }
      if (i == 0) ak::timeline_mark(a, 3);
      __syncthreads();  // block i landed for every thread; block i - 1 (V, s_p) fully consumed
      load(i + kStages - 1, stage == 0 ? kStages - 1 : stage - 1);
      const uint32_t k_smem = ak::smem_u32(smem + stage * ak::kStageBytes);
      stage = stage + 1 == kStages ? 0 : stage + 1;
      if (!ce.mask[i]) continue;  // CTA-uniform: a dense page outside the pool
      const int lim = my_pos - ce.b[i] * ak::kBlockKeys;  // keys > lim: future
      qk(k_smem, lim);
      __syncthreads();  // every warp's maxima
      softmax();
      __syncthreads();  // every warp's P (s_max may be rewritten after the next block's barrier)
      pv(k_smem, lim);
    }
  }
  ak::cp_async_wait<0>();  // no copy may still target shared memory when the CTA exits
  ak::timeline_mark(a, 4);

  // Epilogue: lane (grp, tig) of warp w holds rows grp, grp + 8, dims 16 w + 4 tig .. + 3 (even
  // n-tile: + 0, + 2; odd: + 1, + 3). One barrier exchanges the warps' row sums l and, for out_q,
  // their row maxima of |o|: the BF16 output is bf16(o * inv) with inv = 1 / L > 0 (or 0), and
  // x -> bf16(fl(x * inv)) is monotone and odd, so the row's amax of the BF16 outputs (what the
  // quantize stage takes) is bf16(fl(max |o| * inv)) exactly; NaNs are skipped by fmaxf in both.
  float v[2][4];
  float vmax[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    v[e][0] = o[0][0][2 * e] + o[1][0][2 * e];
    v[e][1] = o[0][1][2 * e] + o[1][1][2 * e];
    v[e][2] = o[0][0][2 * e + 1] + o[1][0][2 * e + 1];
    v[e][3] = o[0][1][2 * e + 1] + o[1][1][2 * e + 1];
    vmax[e] = fmaxf(fmaxf(fabsf(v[e][0]), fabsf(v[e][1])), fmaxf(fabsf(v[e][2]), fabsf(v[e][3])));
  }
  float lsum[2] = {l0, l1};
#pragma unroll
  for (int e = 0; e < 2; ++e) {
#pragma unroll
    for (int x = 1; x <= 2; x <<= 1) {
      lsum[e] += __shfl_xor_sync(0xffffffffu, lsum[e], x);
      vmax[e] = fmaxf(vmax[e], __shfl_xor_sync(0xffffffffu, vmax[e], x));
    }
    if (tig == 0) {
      s_l[warp][grp + 8 * e] = lsum[e];
      s_amax[warp][grp + 8 * e] = vmax[e];
    }
  }
  __syncthreads();
  float L[2] = {0.0f, 0.0f}, A[2] = {0.0f, 0.0f};
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      L[e] += s_l[w][grp + 8 * e];
      A[e] = fmaxf(A[e], s_amax[w][grp + 8 * e]);
    }
  }
  const float M[2] = {m0, m1};
  const int64_t t = t0;
  const int dim = 16 * warp + 4 * tig;
  const int64_t head0 = static_cast<int64_t>(g) * a.group;
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int h = grp + 8 * e;
    if (h >= a.group) continue;
    const int64_t col = (head0 + h) * ak::kDim + dim;
    if (a.splits == 1) {
      const float inv = L[e] > 0.0f ? 1.0f / L[e] : 0.0f;
      const uint2 w = make_uint2(ak::pack_bf16x2(v[e][0] * inv, v[e][1] * inv),
                                 ak::pack_bf16x2(v[e][2] * inv, v[e][3] * inv));
      *reinterpret_cast<uint2*>(a.out + t * a.out_stride + col) = w;
      if (a.out_q != nullptr) {  // o_proj's E4M3 input: one 1x128 block per row
        const float sc = ak::quant_scale(ak::bf16_lo_f(float_to_bf16(A[e] * inv)));
        const float rcp = ak::quant_rcp(sc);
        *reinterpret_cast<uint32_t*>(a.out_q + t * (int64_t{a.n_kv} * a.group * ak::kDim) + col) =
            ak::quant_pair(w.x, sc, rcp) | (ak::quant_pair(w.y, sc, rcp) << 16);
        if (warp == 0 && tig == 0)
          a.out_scales[t * a.sc_stride_t + (head0 + h) * a.sc_stride_h] = sc;
      }
    } else {
      const int64_t slot = (t * a.n_kv + g) * a.splits + split;
      *reinterpret_cast<float4*>(a.ws_o + (slot * ak::kRows + h) * ak::kDim + dim) =
          make_float4(v[e][0], v[e][1], v[e][2], v[e][3]);
      if (warp == 0 && tig == 0) {
        a.ws_ml[(slot * ak::kRows + h) * 2] = M[e];
        a.ws_ml[(slot * ak::kRows + h) * 2 + 1] = L[e];
      }
    }
  }
  ak::timeline_mark(a, 5);
}

template <bool kVec16>
__global__ void __launch_bounds__(kThreads, 2) attention_decode_kernel(const AttnArgs a) {
  extern __shared__ __align__(128) uint8_t smem[];
  decode_cta<kVec16, false>(a, nullptr, nullptr, smem);
}

// kEarly (needs 16-byte aligned pools for TMA); dynamic smem kSmemBytes + 1024 (1 KB alignment).
template <int kFirst = kStages - 1>
__global__ void __launch_bounds__(kThreads, 2)
    attention_decode_early_kernel(const __grid_constant__ AttnArgs a,
                                  const __grid_constant__ CUtensorMap kmap,
                                  const __grid_constant__ CUtensorMap vmap) {
  extern __shared__ __align__(128) uint8_t smem_raw[];
  const uint32_t raw = ak::smem_u32(smem_raw);
  decode_cta<true, true, kFirst>(a, &kmap, &vmap, smem_raw + (((raw + 1023u) & ~1023u) - raw));
}

}  // namespace attention_decode
}  // namespace m3attn
