// Hopper prefill path of the paged FP8 attention (SPEC section 6): warpgroup MMAs (wgmma) for
// tiles with many query rows (prefill and mixed chunks). attention_decode_kernel.cuh has the
// mma.sync decode kernel, attention_verify_wgmma.cuh the verify kernel; all write the same outputs
// and the same split workspace (attention_merge_kernel combines either).
//
// Work decomposition
//   A CTA (2 warpgroups, 256 threads, 1 per SM) owns one (tile of 8 consecutive query tokens of ONE
//   request, KV head g, split s). Warpgroup w owns tokens 4w .. 4w + 3; its 64 MMA rows are
//   token x 16 query heads of group g, so warp q of the warpgroup (rows 16q .. 16q + 15 of every
//   wgmma fragment) is exactly one token and its 16 heads: masking is per warp (token), per
//   column (key). Tiles, the union of the 8 tokens' selected blocks (sparse) or blocks
//   0 .. max_pos / 128 (dense), each entry with a bitmask of the tokens that see it, the split of
//   the union into contiguous ranges and the (o, m, l) workspace format are those of the mma.sync
//   kernel (16 rows per (token, KV head, split) slot), so the merge kernel is shared.
//
// Per block (128 keys of one KV head), loaded once per CTA:
//   - K and V tiles (16 KB each, contiguous in the cache) are copied raw with cp.async into a
//     3-stage ring, 16-byte chunk c of key k at chunk c ^ (k & 7): exactly the 128-byte swizzle
//     that wgmma expects for a K-major operand with 128-byte rows (tile base 1024-aligned).
//   - S = Q K^T: wgmma m64n128k32 e4m3 x e4m3 -> f32, A = the warpgroup's 64 Q rows (register
//     fragments, loaded once), B = the K tile as stored (token-major with the 128 dims contiguous
//     = K-major); 4 k-steps advance the descriptor by 32 bytes inside the swizzle atom.
//   - Online softmax per row in fp32 registers (log2 domain); keys a token did not select or that
//     lie in its future get -inf.
//   - O += P V: FP8 wgmma requires a K-major B, but V is token-major (MN-major for P V). Option (a)
//     is taken: the raw V tile is converted once per block into an f16 tile (cvt.rn.f16x2.e4m3x2 is
//     exact: E4M3 is a subset of f16) stored MN-major with the 128-byte swizzle ([dims 0-63 |
//     dims 64-127] x 128 keys x 128 bytes, LBO = 16 KB between the two dim halves, SBO = 1 KB
//     between 8-key groups), and wgmma m64n128k16 f16 runs with P as the register A operand
//     (f16, the accumulator fragment of S re-packed, no shared-memory round trip) and the
//     transposed-B flag. P stays f16 (2^-11 relative) instead of E4M3 (2^-4) and no transpose of V
//     is needed; the price is P V at the f16 rate (half the FP8 rate), i.e. two thirds of the
//     tensor time. Option (b) (transpose V in shared memory, P in E4M3) would cost accuracy the
//     twin's 1e-2 row tolerance cannot absorb.
//   - Software pipeline inside each warpgroup: while P(i) V(i) runs on the tensor cores, S(i+1) =
//     Q K(i+1)^T is issued before it and the softmax of block i+1 (exp2 on the MUFU pipe) runs
//     while P(i) V(i) finishes; V(i+1) is converted during the same window into the other of two
//     f16 tiles. One CTA barrier per block (the ring, the f16 tiles).
//   - Rows past the last position any selecting token of the tile sees are zeroed in the f16 V
//     tile (unwritten cache slots may hold NaN, and 0 * NaN = NaN). A NaN in a V row that some
//     tokens of the tile see and others mask is cleared in the f16 tile and recorded (fix_v_nan);
//     the tokens that see it write NaN in that dim, as the twin does.
//
// AttentionCudaConfig::kernel = 4; the automatic plan runs it where the warp-specialised kernel
//   (attention_prefill_ws.cuh) cannot address the pool by TMA. Bookkeeping: each entry's V row
//   limit is precomputed with the list, the O rescale is skipped when no row maximum of the warp
//   moved, warpgroup 0 issues all cp.async copies while warpgroup 1 converts V and alone executes
//   the generic -> async proxy fence (which then never waits behind its own in-flight copies; no
//   proxy fence follows cp.async.wait_group: CUTLASS's cp.async + GMMA mainloops rely on wait +
//   barrier as well), and the Q fragments live in registers (register-A QK wgmma, no Q tile).
//   Session 13 removed its variants 2 and 3 (Q in shared memory, every thread loading and
//   converting: never faster).
//
// Bytes and bound (8K chunk, sparse, ~16 blocks per token): per (block, CTA) 32 KB from L2/HBM
//   and 8.4 MFLOP (128 rows x 128 keys x 128 dims x 2 x 2); shared memory per block ~180 KB
//   (K 32 KB for 2 warpgroups, f16 V 64 KB read, conversion 48 KB, cp.async 32 KB);
//   tensor time ~1.5 K cycles (FP8 QK + f16 PV), exp2 of 16 K scores ~1 K cycles on the MUFU pipe
//   (overlapped with PV by the pipeline). Expected: compute-bound, ~50 % of the mixed FP8/f16 peak.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "core/ptx.cuh"
#include "stages/attention/attention_kernel.cuh"

namespace m3attn {
namespace attention_prefill {

namespace ak = attention_kernel;
using ak::AttnArgs;

constexpr int kWarpGroups = 2;
constexpr int kThreads = 128 * kWarpGroups;
constexpr int kTokensPerWG = 4;
constexpr int kQT = kWarpGroups * kTokensPerWG;  // query tokens per tile
constexpr int kRowsPerWG = 64;                   // = kTokensPerWG x ak::kRows
constexpr int kStages = 3;
constexpr int kTileBytes = ak::kTileBytes;  // raw E4M3 K or V tile: 128 keys x 128 bytes
constexpr int kStageBytes = 2 * kTileBytes;
constexpr int kVhBytes = 2 * kTileBytes;  // f16 V tile
constexpr int kVhOff = kStages * kStageBytes;
constexpr int kSmemBytes = kVhOff + 2 * kVhBytes + 1024;  // + slack to align the base to 1024 B
constexpr int kCand = kQT * ak::kTopKIds;                 // candidate ids of a tile
constexpr int kMaxList = 128;  // block entries held in shared memory at once
static_assert(kRowsPerWG == kTokensPerWG * ak::kRows, "a warp is one token's 16 heads");
static_assert(kCand <= kThreads && kCand <= kMaxList, "one candidate per thread");
static_assert(kQT <= 8, "token masks are 8 bits");
static_assert(kSmemBytes <= 227 * 1024, "dynamic shared memory");

#define M3_WG_D64_REGS                                                                          \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "  \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "  \
  "%56, %57, %58, %59, %60, %61, %62, %63}"
#define M3_WG_D64_OPS(d)                                                                          \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),    \
      "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),  \
      "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),  \
      "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),  \
      "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),  \
      "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),  \
      "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),  \
      "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// ---------------------------------------------------------------------------------------------
// PTX wrappers.

using sm90::fence_proxy_async;
using sm90::wgmma_commit;
using sm90::wgmma_fence;
using sm90::wgmma_wait;

// Keeps the compiler from moving accesses of accumulator registers across wgmma boundaries.
__device__ __forceinline__ void reg_fence(float (&d)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
__device__ __forceinline__ void reg_fence(uint32_t (&p)[8][4]) {
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(p[i][j])::"memory");
}

// Shared-memory matrix descriptor, 128-byte swizzle (layout type 1), base offset 0 (every swizzle
// atom starts on a 1024-byte boundary). Offsets in bytes.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFFu) >> 4) |
         (static_cast<uint64_t>((lbo & 0x3FFFFu) >> 4) << 16) |
         (static_cast<uint64_t>((sbo & 0x3FFFFu) >> 4) << 32) | (uint64_t{1} << 62);
}

// d (64 x 128 f32) (+)= A (64 x 32 e4m3, registers: the mma.sync m16n8k32 A fragment of this
// warp's 16 rows) x B (32 x 128 e4m3, K-major, smem).
__device__ __forceinline__ void wgmma_qk_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t db,
                                            int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " M3_WG_D64_REGS
      ", {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
      : M3_WG_D64_OPS(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
}

// d (64 x 128 f32) (+)= A (64 x 16 f16, registers) x B (16 x 128 f16, MN-major smem: trans-b 1).
__device__ __forceinline__ void wgmma_pv(float (&d)[64], const uint32_t (&a)[4], uint64_t db,
                                         int accumulate = 1) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " M3_WG_D64_REGS
      ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : M3_WG_D64_OPS(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
}

// Raw K and V tiles of (page, KV head g) into one stage [K | V], swizzled as in ak::load_block,
// by the kN threads t = 0 .. kN - 1 of one role (each issues kTileBytes / 16 / kN copies per tile).
template <bool kVec16, int kN>
__device__ __forceinline__ void load_block_by(const AttnArgs& a, int page, int g, uint32_t stage,
                                              int t) {
  const uint8_t* kt =
      a.kv + static_cast<int64_t>(page) * a.page_stride + static_cast<int64_t>(g) * kTileBytes;
  const uint8_t* vt = kt + a.plane_stride;
#pragma unroll
  for (int it = 0; it < kTileBytes / 16 / kN; ++it) {
    const int i = it * kN + t;
    const int key = i >> 3, c = i & 7;
    const uint32_t kdst = stage + key * ak::kDim + ((c ^ (key & 7)) << 4);
    const uint32_t vdst = kdst + kTileBytes;
    if constexpr (kVec16) {
      ak::cp_async_16(kdst, kt + i * 16);
      ak::cp_async_16(vdst, vt + i * 16);
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        ak::cp_async_4(kdst + 4 * e, kt + i * 16 + 4 * e);
        ak::cp_async_4(vdst + 4 * e, vt + i * 16 + 4 * e);
      }
    }
  }
}

// 2^x on the MUFU pipe (flushes results below 2^-126 to 0: a weight that small cannot matter).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Raw V (swizzled rows of 128 bytes) -> f16, MN-major with the 128-byte swizzle: dims
// [64 h, 64 h + 64) of key k at vh + h * 16 KB + k * 128, 16-byte chunk c (8 dims) stored at chunk
// c ^ (k & 7). Keys past vlim become 0.
// By the kN threads t = 0 .. kN - 1 of one role.
template <int kN>
__device__ __forceinline__ void convert_v_by(const uint8_t* vraw, uint8_t* vh, int vlim, int t) {
#pragma unroll 4
  for (int it = 0; it < ak::kBlockKeys * 16 / kN; ++it) {
    const int i = it * kN + t;
    const int key = i >> 4, c8 = i & 15;
    uint4 h = make_uint4(0u, 0u, 0u, 0u);
    if (key <= vlim) {
      const uint2 raw = *reinterpret_cast<const uint2*>(
          vraw + key * ak::kDim + (((c8 >> 1) ^ (key & 7)) << 4) + (c8 & 1) * 8);
      h = ak::e4m3x8_to_f16(raw.x, raw.y);
    }
    *reinterpret_cast<uint4*>(vh + (c8 >> 3) * (kTileBytes) + key * 128 +
                              (((c8 & 7) ^ (key & 7)) << 4)) = h;
  }
}

// NaN in V where some present token of the tile misses keys of the block (keys klo + 1 .. kmax;
// P = 0 there in a shared MMA row, and 0 * NaN = NaN would leak into that row): after convert_v_by,
// the same kN threads revisit their own chunks of those keys; a NaN byte (low 7 bits set)
// becomes 0 in the f16 tile and the smallest such key of its dim is recorded with the entry's
// number gen: key_rec[d] = gen << 8 | (255 - key), gen_rec = gen (atomicMax: numbers grow). A token
// sees the NaN of dim d iff that key <= its lim (its visible keys are a prefix of the block).
template <int kN>
__device__ __forceinline__ void fix_v_nan(const uint8_t* vraw, uint8_t* vh, int klo, int kmax,
                                          int t, uint32_t gen, uint32_t* key_rec,
                                          uint32_t* gen_rec) {
  if (klo >= kmax) return;
#pragma unroll 1
  for (int i = t; i < ak::kBlockKeys * 16; i += kN) {
    const int key = i >> 4, c8 = i & 15;
    if (key <= klo || key > kmax) continue;
    uint32_t w[2];
    const uint2 raw = *reinterpret_cast<const uint2*>(
        vraw + key * ak::kDim + (((c8 >> 1) ^ (key & 7)) << 4) + (c8 & 1) * 8);
    w[0] = raw.x;
    w[1] = raw.y;
    bool any = false;
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      uint32_t bits = ((w[q] & 0x7F7F7F7Fu) + 0x01010101u) & 0x80808080u;
      while (bits != 0u) {
        const int byte = (__ffs(bits) - 1) >> 3;
        bits &= bits - 1u;
        w[q] &= ~(0xFFu << (8 * byte));
        atomicMax(&key_rec[8 * c8 + 4 * q + byte], gen << 8 | static_cast<uint32_t>(255 - key));
        atomicMax(gen_rec, gen);
        any = true;
      }
    }
    if (any) {
      *reinterpret_cast<uint4*>(vh + (c8 >> 3) * (kTileBytes) + key * 128 +
                                (((c8 & 7) ^ (key & 7)) << 4)) = ak::e4m3x8_to_f16(w[0], w[1]);
    }
  }
}

// Per-row online softmax of one block's raw scores s (accumulator fragment: s[4 j + e] is row
// grp (e < 2) or grp + 8 (e >= 2), key 8 j + 2 tig + (e & 1)). Keys > lim are masked. Scores
// become p = 2^(s * scale_log2 - new max) (one FFMA + EX2 each; the max is taken on raw scores,
// the scale being > 0); m (log2 domain) and l are updated; alpha = 2^(old max - new max) must
// still be applied to O. kLazy (the verify kernel's variant 13): the running max moves only when a
// block's max exceeds it by more than kLazyMax (log2 domain), so p <= 2^kLazyMax (exact in f16's
// range; the final O / l does not depend on m) and O is rescaled far less often.
constexpr float kLazyMax = 8.0f;
template <bool kLazy = false>
__device__ __forceinline__ void softmax_block(float (&s)[64], float (&m)[2], float (&l)[2],
                                              float (&alpha)[2], int lim, float scale_log2) {
  const int tig = threadIdx.x & 3;
  if (lim < ak::kBlockKeys - 1) {
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (8 * j + 2 * tig + (e & 1) > lim) s[4 * j + e] = -INFINITY;
  }
  float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    mx0 = fmaxf(mx0, fmaxf(s[4 * j], s[4 * j + 1]));
    mx1 = fmaxf(mx1, fmaxf(s[4 * j + 2], s[4 * j + 3]));
  }
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
  const float c0 = mx0 * scale_log2, c1 = mx1 * scale_log2;
  const float m0 = kLazy ? (c0 > m[0] + kLazyMax ? c0 : m[0]) : fmaxf(m[0], c0);
  const float m1 = kLazy ? (c1 > m[1] + kLazyMax ? c1 : m[1]) : fmaxf(m[1], c1);
  // A row that has seen only masked keys keeps m = -inf; subtract 0 then so exp2 gives 0, not NaN.
  const float mu0 = m0 == -INFINITY ? 0.0f : m0;
  const float mu1 = m1 == -INFINITY ? 0.0f : m1;
  alpha[0] = fast_exp2(m[0] - mu0);
  alpha[1] = fast_exp2(m[1] - mu1);
  m[0] = m0;
  m[1] = m1;
  float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    s[4 * j] = fast_exp2(fmaf(s[4 * j], scale_log2, -mu0));
    s[4 * j + 1] = fast_exp2(fmaf(s[4 * j + 1], scale_log2, -mu0));
    s[4 * j + 2] = fast_exp2(fmaf(s[4 * j + 2], scale_log2, -mu1));
    s[4 * j + 3] = fast_exp2(fmaf(s[4 * j + 3], scale_log2, -mu1));
    sum0 += s[4 * j] + s[4 * j + 1];
    sum1 += s[4 * j + 2] + s[4 * j + 3];
  }
  l[0] = l[0] * alpha[0] + sum0;
  l[1] = l[1] * alpha[1] + sum1;
}

// O *= alpha (rows grp, grp + 8), then P = f16(s) as the A fragments of the 8 k-steps of 16 keys.
// kSkipUnit: the rescale is skipped when every alpha of the warp is 1 (the running maxima did not
// move, the common case after the first blocks).
template <bool kSkipUnit = false>
__device__ __forceinline__ void rescale_and_pack(float (&o)[64], const float (&s)[64],
                                                 const float (&alpha)[2], uint32_t (&p)[8][4]) {
  const bool unit = kSkipUnit && __all_sync(0xffffffffu, alpha[0] == 1.0f && alpha[1] == 1.0f);
  if (!unit) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      o[4 * j] *= alpha[0];
      o[4 * j + 1] *= alpha[0];
      o[4 * j + 2] *= alpha[1];
      o[4 * j + 3] *= alpha[1];
    }
  }
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
    p[kk][0] = ak::pack_f16x2(s[8 * kk], s[8 * kk + 1]);
    p[kk][1] = ak::pack_f16x2(s[8 * kk + 2], s[8 * kk + 3]);
    p[kk][2] = ak::pack_f16x2(s[8 * kk + 4], s[8 * kk + 5]);
    p[kk][3] = ak::pack_f16x2(s[8 * kk + 6], s[8 * kk + 7]);
  }
}

// ---------------------------------------------------------------------------------------------
// The prefill kernel. Grid: (tiles bound, n_kv, splits); block: kThreads; dynamic smem kSmemBytes.
template <bool kVec16>
__global__ void __launch_bounds__(kThreads, 1) attention_prefill_kernel(const AttnArgs a) {
  extern __shared__ uint8_t smem_raw[];
  __shared__ int s_warp[kThreads / 32];
  __shared__ int s_tile[3];
  __shared__ int s_pos[kQT];
  __shared__ int s_cand_b[kCand];
  __shared__ int s_cand_page[kCand];
  __shared__ int s_list_b[kMaxList];
  __shared__ int s_list_page[kMaxList];
  __shared__ int s_list_mask[kMaxList];
  __shared__ int s_list_vlim[kMaxList];  // V row limit of the entry
  __shared__ uint32_t s_vnan_gen[2];     // V NaN records per f16 tile (fix_v_nan)
  __shared__ uint32_t s_vnan_key[2][ak::kDim];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int grp = lane >> 2, tig = lane & 3;
  const int wg = warp >> 2;  // warpgroup
  const int tok = warp;      // token of the tile (= wg * 4 + warp % 4)
  const int g = blockIdx.y, split = blockIdx.z;

  // 1024-aligned base (the swizzle atoms and descriptors assume it).
  const uint32_t raw_u32 = ak::smem_u32(smem_raw);
  const uint32_t base = (raw_u32 + 1023u) & ~1023u;
  uint8_t* smem = smem_raw + (base - raw_u32);

  if (!ak::find_tile<kQT, kThreads>(a, static_cast<int>(blockIdx.x), s_warp, s_tile))
    return;  // CTA-uniform
  const int r = s_tile[0], t0 = s_tile[1], nt = s_tile[2];
  if (tid < kQT) s_pos[tid] = tid < nt ? a.positions[t0 + tid] : -1;
  for (int i = tid; i < 2 * ak::kDim; i += kThreads) (&s_vnan_key[0][0])[i] = 0u;
  if (tid < 2) s_vnan_gen[tid] = 0u;
  int cand_b = -1, cand_pos = -1;
  if (a.sparse && tid < kCand && tid / ak::kTopKIds < nt) {
    const int w = tid / ak::kTopKIds;
    cand_pos = a.positions[t0 + w];
    cand_b = a.block_ids[static_cast<int64_t>(t0 + w) * a.bid_stride_t +
                         static_cast<int64_t>(g) * a.bid_stride_h + tid % ak::kTopKIds];
  }
  // The Q rows of this warp's token as register A fragments (rows grp, grp + 8 = heads; k-step kk
  // holds bytes 32 kk + 4 tig .. + 3 and 32 kk + 16 + 4 tig .. + 3 of each row; zero for an absent
  // token or heads >= group).
  uint32_t qa[4][4];
  {
    const bool tk = tok < nt;
    const bool r0 = tk && grp < a.group, r1 = tk && grp + 8 < a.group;
    const uint8_t* q0 = a.q + static_cast<int64_t>(t0 + (tk ? tok : 0)) * a.q_stride_t +
                        static_cast<int64_t>(g * a.group + grp) * ak::kDim;
    const uint8_t* q1 = q0 + 8 * ak::kDim;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const int off = 32 * kk + 4 * tig;
      qa[kk][0] = r0 ? *reinterpret_cast<const uint32_t*>(q0 + off) : 0u;
      qa[kk][1] = r1 ? *reinterpret_cast<const uint32_t*>(q1 + off) : 0u;
      qa[kk][2] = r0 ? *reinterpret_cast<const uint32_t*>(q0 + off + 16) : 0u;
      qa[kk][3] = r1 ? *reinterpret_cast<const uint32_t*>(q1 + off + 16) : 0u;
    }
  }
  __syncthreads();  // s_pos

  const int64_t pt_row = static_cast<int64_t>(r) * a.pt_stride;
  int n_total = 0;
  if (a.sparse) {
    if (tid < kCand) {
      int b = cand_b;
      const int page = ak::candidate_page(a, pt_row, cand_pos, b);
      s_cand_b[tid] = b;
      s_cand_page[tid] = page;
    }
    __syncthreads();
    bool first = false;
    int b = -1, mask = 0;
    if (tid < kCand) {
      b = s_cand_b[tid];
      if (b >= 0) {
        first = true;
        for (int j = 0; j < kCand; ++j) {
          if (s_cand_b[j] == b) {
            if (j < tid) first = false;
            mask |= 1 << (j / ak::kTopKIds);
          }
        }
      }
    }
    const int rank = ak::block_inclusive_scan<kThreads>(first ? 1 : 0, s_warp, n_total) - 1;
    if (first) {
      s_list_b[rank] = b;
      s_list_page[rank] = s_cand_page[tid];
      s_list_mask[rank] = mask;
      int vmax = 0;
#pragma unroll
      for (int w = 0; w < kQT; ++w)
        if (mask & (1 << w)) vmax = max(vmax, s_pos[w]);
      s_list_vlim[rank] = vmax - b * ak::kBlockKeys;
    }
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
  // V NaN: dims of this thread's output values (o[4 jj + x], o[4 jj + 2 + x]: dim 8 jj + 2 tig + x,
  // bit 2 jj + x) that a recorded NaN reaches; entries are numbered from 1 across chunks.
  uint32_t nan_dims = 0u;
  uint32_t gen0 = 1u;

  for (int c0 = lo; c0 < hi; c0 += kMaxList) {
    const int count = min(hi - c0, kMaxList);
    const ak::ChunkEntries ce = ak::chunk_entries<kQT, kThreads>(
        a, pt_row, c0, count, s_pos, s_list_b, s_list_page, s_list_mask, s_list_vlim);
    const int* lmask = ce.mask;
    const int* lb = ce.b;
    const int* lpage = ce.page;
    const int* lvlim = ce.vlim;

    // Keys of entry i this thread's token sees: [0, lim] (lim < 0: none).
    auto lim_of = [&](int i) {
      return (lmask[i] >> tok) & 1 ? my_pos - lb[i] * ak::kBlockKeys : -1;
    };
    auto issue_qk = [&](int i) {
      const uint32_t kaddr = base + (i % kStages) * kStageBytes;
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        wgmma_qk_rs(s, qa[kk], smem_desc(kaddr + 32 * kk, 16, 1024), kk > 0 ? 1 : 0);
    };
    auto issue_pv = [&](int i) {
      const uint32_t vaddr = base + kVhOff + (i & 1) * kVhBytes;
#pragma unroll
      for (int kk = 0; kk < 8; ++kk)
        wgmma_pv(o, p[kk], smem_desc(vaddr + kk * 2048, kTileBytes, 1024));
    };

    // Loads and V conversions in two roles: warpgroup 0 issues every cp.async, warpgroup 1
    // converts V and alone needs the generic -> async proxy fence for its f16 stores, so that fence
    // never waits behind in-flight copies of its own; cp.async data reach wgmma after
    // cp.async.wait_group and the barrier, as in CUTLASS's cp.async + GMMA mainloops.
    auto load = [&](int j, int stage) {
      if (wg == 0) load_block_by<kVec16, 128>(a, lpage[j], g, base + stage * kStageBytes, tid);
    };
    // Keys of entry i that some present token misses start after klo_of(i).
    auto klo_of = [&](int i) {
      int klo = ak::kBlockKeys - 1;
#pragma unroll
      for (int w = 0; w < kQT; ++w)
        if (s_pos[w] >= 0)
          klo = min(klo, (lmask[i] >> w) & 1 ? s_pos[w] - lb[i] * ak::kBlockKeys : -1);
      return klo;
    };
    auto convert = [&](int i) {
      const uint8_t* vraw = smem + (i % kStages) * kStageBytes + kTileBytes;
      uint8_t* vh = smem + kVhOff + (i & 1) * kVhBytes;
      // Largest position of a token of the tile that sees entry i (its V rows past it are zeroed).
      const int vlim = lmask[i] ? lvlim[i] : -1;
      const int kmax = min(vlim, ak::kBlockKeys - 1);
      if (wg == 1) {
        convert_v_by<128>(vraw, vh, vlim, tid - 128);
        fix_v_nan<128>(vraw, vh, klo_of(i), kmax, tid - 128, gen0 + i, s_vnan_key[i & 1],
                       &s_vnan_gen[i & 1]);
        fence_proxy_async();
      }
    };
    // The NaN records of entry i (converted before the barrier that precedes P V(i), rewritten
    // only after the next one) for this thread's token.
    auto add_nan_dims = [&](int i) {
      const uint32_t gen = gen0 + i;
      if (s_vnan_gen[i & 1] != gen) return;
      const int lim = lim_of(i);
#pragma unroll 1
      for (int jj = 0; jj < 16; ++jj)
        for (int x = 0; x < 2; ++x) {
          const uint32_t v = s_vnan_key[i & 1][8 * jj + 2 * tig + x];
          if ((v >> 8) == gen && 255 - static_cast<int>(v & 255u) <= lim)
            nan_dims |= 1u << (2 * jj + x);
        }
    };

    // Prologue: blocks 0 .. kStages-1 in flight (one commit group each, empty ones included);
    // block 0: S, V -> f16 tile 0, softmax, P. Every wgmma is issued unconditionally (branches
    // around wgmma serialise the pipeline): a warpgroup whose tokens did not select a block gets
    // all-masked rows (P = 0), and an entry no token sees (dense, invalid page) gets a zero f16 V
    // tile (its stage may hold anything).
#pragma unroll
    for (int j = 0; j < kStages; ++j) {
      if (j < count && lmask[j]) load(j, j);
      ak::cp_async_commit();
    }
    ak::cp_async_wait<kStages - 1>();
    __syncthreads();  // block 0 landed for every thread
    reg_fence(s);
    wgmma_fence();
    issue_qk(0);
    wgmma_commit();
    convert(0);
    wgmma_wait<0>();
    reg_fence(s);
    softmax_block(s, m, l, alpha, lim_of(0), a.scale_log2);
    rescale_and_pack(o, s, alpha, p);

    for (int i = 0; i < count; ++i) {
      // Block i + 1 landed; f16 V(i) complete; every warpgroup is done with S(i) and P V(i - 1),
      // so the stage of block i and the f16 tile of i - 1 are free.
      ak::cp_async_wait<kStages - 2>();
      __syncthreads();
      {
        const int j = i + kStages;
        if (j < count && lmask[j]) load(j, i % kStages);
        ak::cp_async_commit();
      }
      // S(i + 1) first, then P V(i). In the last iteration S of block i is recomputed and
      // discarded: its softmax runs with every key masked, which leaves m, l and O unchanged.
      const bool has_next = i + 1 < count;
      const int nx = has_next ? i + 1 : i;
      reg_fence(o);
      reg_fence(s);
      reg_fence(p);
      wgmma_fence();
      issue_qk(nx);
      wgmma_commit();
      issue_pv(i);
      wgmma_commit();
      add_nan_dims(i);
      if (has_next) convert(nx);
      wgmma_wait<1>();  // S(i + 1) done, P V(i) may still run
      reg_fence(s);
      softmax_block(s, m, l, alpha, has_next ? lim_of(nx) : -1, a.scale_log2);
      wgmma_wait<0>();
      reg_fence(o);
      reg_fence(p);
      rescale_and_pack<true>(o, s, alpha, p);
    }
    ak::cp_async_wait<0>();
    __syncthreads();  // stages, f16 tiles and entries are free for the next chunk
    gen0 += static_cast<uint32_t>(count);
  }
  if (nan_dims != 0u) {
#pragma unroll
    for (int jj = 0; jj < 16; ++jj)
#pragma unroll
      for (int x = 0; x < 2; ++x)
        if ((nan_dims >> (2 * jj + x)) & 1u) {
          o[4 * jj + x] = __int_as_float(0x7fffffff);
          o[4 * jj + 2 + x] = __int_as_float(0x7fffffff);
        }
  }

  // Epilogue: rows grp and grp + 8 of this warp = heads grp, grp + 8 of token `tok`.
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

}  // namespace attention_prefill
}  // namespace m3attn
