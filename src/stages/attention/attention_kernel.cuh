// Device code of the paged FP8 attention (SPEC section 6): block-sparse (MSA layers) and dense
// causal (layers 0-2), decode/verify, prefill and mixed batches, one kernel template.
//
// Work decomposition
//   A CTA (4 warps) owns one (query tile, KV head g, split s). A query tile is QT in {1, 2, 4}
//   consecutive tokens of ONE request (tiles never straddle requests; the CTA finds its tile with a
//   block-wide scan of query_start, so the grid depends only on host-known T and R). The 16 query
//   heads of group g are the M = 16 rows of the MMAs; warp w serves token w / KS of the tile and
//   the key slice w % KS of every block (KS = 4 / QT: 32, 64 or 128 keys of each 128-key block).
//   All tokens of the tile share every loaded block: the CTA builds the union of the tokens'
//   selected blocks (sparse) or blocks 0 .. max_pos / 128 (dense), each entry with a bitmask of
//   the tokens that see it; a warp skips blocks its token did not select, key slices past its
//   position, and masks keys p > pos inside the local block. With splits > 1 (flash-decoding) the
//   union is cut into `splits` contiguous ranges, one per CTA, and the CTA writes an unnormalised
//   partial (o, m, l) that attention_merge_kernel combines with log-sum-exp weights.
//
// Per block (128 keys of one KV head): K and V tiles (16 KB each, contiguous in the cache) are
//   copied raw with cp.async (16-byte when base and strides allow, else 4-byte) into a ring of
//   stages with a 16-byte-chunk XOR swizzle (ldmatrix conflict-free; the layout of the 128-byte
//   TMA swizzle, which the verify kernel uses). Session 13: TMA loads here were slower (B64 8K
//   45.5 vs 43.6 us, B256 equal) and were removed.
//   S = Q K^T: mma.sync m16n8k32 e4m3, Q fragments in registers for the whole kernel, K fragments
//   by ldmatrix. Online softmax in fp32: row maxima of the raw scores, the log2e-prescale fused
//   into the exponent's fmaf, ex2.approx, and the O rescale skipped when no row maximum of the warp
//   moved (session 13: the warps are issue-latency bound, ~1015 instructions per warp and block
//   at 4.1 cycles each against ~4.5 K cycles between a CTA's blocks, round-A ncu at B64 8K; this
//   softmax is ~10 % fewer instructions: round C, B256 153.2 / 154.2 / 154.3 us at 8K / 32K / 128K
//   vs 155.6 / 156.5 / 156.8 for the session-12 one, B64 equal within noise). O += P V: P rounded
//   to f16 (2^-11 relative; E4M3 P would cost 2^-4), mma.sync m16n8k16 f16 with fp32 accumulation,
//   V converted E4M3 -> f16 in registers by cvt.rn.f16x2.e4m3x2 (exact): ldmatrix.trans of the raw
//   tile yields byte pairs (key k, dims 2i, 2i+1), (key k+1, same dims); prmt splits them into the
//   B fragments of an even-dim and an odd-dim n-tile (o_dim gives the resulting dim order); no f16
//   tile, so 3 stages fit. A warp clears the V keys past its own token's position before the MMA
//   (unwritten slots may hold NaN, and 0 * NaN = NaN), so a NaN in a key that another token of the
//   tile sees never reaches this token's rows. (The f16-tile V path for prefill-like 4-token tiles,
//   v_convert 2, was removed in session 13: the wgmma kernels run every prefill.)
//
// Bytes moved (decode): 32 KB of K/V per (selected block, KV head, tile), read once from HBM;
//   bandwidth-bound; 2 CTAs per SM (96 KB smem each), 2 blocks in flight per CTA. Session 12 (H200,
//   8K, isolated us): B256 155.6 (80 % of copy), B64 44.2 (71 %): one wave of 256 CTAs pays the
//   start chain and the tail once, unhidden.
#pragma once

#include <cuda.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "core/mbarrier.cuh"
#include "core/numeric.h"
#include "core/pdl.cuh"

namespace m3attn {
namespace attention_kernel {

constexpr int kBlockKeys = 128;  // keys per block (= KV page)
constexpr int kDim = 128;        // head dim
constexpr int kRows = 16;        // MMA rows: the query heads of one group (padded to 16)
constexpr int kTopKIds = 16;     // selected ids per (token, KV head)
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxList = 128;                  // block entries held in shared memory at once
constexpr int kMaxSplits = 128;                // CTAs per (tile, KV head)
constexpr int kTileBytes = kBlockKeys * kDim;  // one raw E4M3 K or V tile
constexpr int kStageBytes = 2 * kTileBytes;
constexpr int kStages = 3;  // ring of raw K/V tiles: 96 KB of dynamic shared memory
constexpr int kSmemBytes = kStages * kStageBytes;
constexpr int kOStride = kDim + 8;  // floats per row of the epilogue buffer (bank spread)
static_assert(kWarps * kRows * kOStride * 4 + 2 * kWarps * kRows * 4 <= kSmemBytes,
              "epilogue buffer must fit in the pipeline's shared memory");

struct AttnArgs {
  const uint8_t* q;  // [T, n_q, 128]
  int64_t q_stride_t;
  const uint8_t* kv;  // cache base
  int64_t page_stride;
  int64_t plane_stride;
  int num_pages;
  const int32_t* block_ids;  // [T, n_kv, 16] (sparse)
  int64_t bid_stride_t;
  int64_t bid_stride_h;
  const int32_t* query_start;  // [R + 1]
  const int32_t* positions;    // [T]
  const int32_t* page_table;   // [R, max_pages]
  int64_t pt_stride;
  int T;
  int R;
  int max_pages;
  int n_kv;
  int group;  // query heads per KV head (<= 16)
  int splits;
  int sparse;
  float scale_log2;  // softmax scale * log2(e)
  uint16_t* out;     // bf16 [T, n_q * 128]
  int64_t out_stride;
  float* ws_o;   // [T, n_kv, splits, 16, 128] (splits > 1)
  float* ws_ml;  // [T, n_kv, splits, 16, 2]
  // o_proj's input written by the kernel's epilogue (or the merge): null when off or when the
  // launcher quantizes `out` with the quantize stage instead (kernels without this epilogue).
  uint8_t* out_q;     // e4m3 [q_rows, n_q * 128] contiguous
  float* out_scales;  // f32 [q_rows, n_q], strides (sc_stride_t, sc_stride_h)
  int64_t sc_stride_t;
  int64_t sc_stride_h;
  int q_rows;  // M_pad >= T
};

// ---------------------------------------------------------------------------------------------
// PTX wrappers.
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most N of this thread's most recent cp.async groups are pending.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t& d0, uint32_t& d1, uint32_t& d2,
                                        uint32_t& d3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(d0), "=r"(d1), "=r"(d2), "=r"(d3)
               : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t addr, uint32_t& d0, uint32_t& d1,
                                              uint32_t& d2, uint32_t& d3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(d0), "=r"(d1), "=r"(d2), "=r"(d3)
               : "r"(addr));
}

// D = A(16x32 e4m3, row) * B(32x8 e4m3, col) + D, fp32 accumulators.
__device__ __forceinline__ void mma_e4m3(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// D = A(16x16 f16, row) * B(16x8 f16, col) + D, fp32 accumulators.
__device__ __forceinline__ void mma_f16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two E4M3 bytes (low byte first) -> two f16 (low half first); exact.
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t two_bytes) {
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two_bytes & 0xffffu), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

// The same for the two bytes in the HIGH half of w: the cvt reads the upper 16 bits directly (a
// shift before the conversion would cost one instruction per register).
__device__ __forceinline__ uint32_t e4m3x2_hi_to_f16x2(uint32_t w) {
  uint32_t d;
  asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, h;\n\t}\n"
      : "=r"(d)
      : "r"(w));
  return d;
}

__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);  // .x (low half) = lo
  return *reinterpret_cast<const uint32_t*>(&h);
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  return static_cast<uint32_t>(float_to_bf16(lo)) |
         (static_cast<uint32_t>(float_to_bf16(hi)) << 16);
}

// The 1x128 block quantization of the quantize stage (stages/quantize/quantize_group.cuh, the CPU
// twin's numerics) for epilogues that hold a row their own way: x = the BF16-rounded output values,
// amax = fmaxf over |x| (a NaN never becomes amax), scale = amax > 0 ? amax / 448 : 1 (IEEE
// division), code = e4m3(x / scale) (satfinite, NaN stays NaN).
__device__ __forceinline__ float bf16_lo_f(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi_f(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ float quant_scale(float amax) {
  return amax > 0.0f ? __fdiv_rn(amax, kE4M3Max) : 1.0f;
}
__device__ __forceinline__ uint32_t quant_code(float x, float scale) {
  return float_to_e4m3(__fdiv_rn(x, scale));
}
// Codes of the two BF16 values of w (low half first), as two bytes.
__device__ __forceinline__ uint32_t quant_pair(uint32_t w, float scale) {
  return quant_code(bf16_lo_f(w), scale) | (quant_code(bf16_hi_f(w), scale) << 8);
}
__device__ __forceinline__ float amax_pair(uint32_t w) {
  return fmaxf(fabsf(bf16_lo_f(w)), fabsf(bf16_hi_f(w)));
}

// The quantized rows [T, q_rows) that no token owns: q = 0, scale = 1 (every call: a larger
// earlier step may have left data there). One CTA of `Threads` threads.
template <int Threads>
__device__ __forceinline__ void write_quant_padding(const AttnArgs& a) {
  const int heads = a.n_kv * a.group;
  const int64_t row_words = int64_t{heads} * kDim / 16;
  const int64_t words = (a.q_rows - a.T) * row_words;
  uint4* q = reinterpret_cast<uint4*>(a.out_q + int64_t{a.T} * heads * kDim);
  for (int64_t i = threadIdx.x; i < words; i += Threads) q[i] = make_uint4(0u, 0u, 0u, 0u);
  for (int64_t i = threadIdx.x; i < (a.q_rows - a.T) * heads; i += Threads)
    a.out_scales[(a.T + i / heads) * a.sc_stride_t + (i % heads) * a.sc_stride_h] = 1.0f;
}

// 2^x on the MUFU pipe (ex2.approx.ftz: results below 2^-126 flush to 0, a weight that small cannot
// matter).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Inclusive prefix sum of v over the CTA of `Threads` threads; `total` gets the CTA-wide sum. All
// threads must call; s_warp holds Threads / 32 ints.
template <int Threads = kThreads>
__device__ __forceinline__ int block_inclusive_scan(int v, int* s_warp, int& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int n = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += n;
  }
  if (lane == 31) s_warp[warp] = v;
  __syncthreads();
  int before = 0;
  total = 0;
#pragma unroll
  for (int w = 0; w < Threads / 32; ++w) {
    const int x = s_warp[w];
    if (w < warp) before += x;
    total += x;
  }
  __syncthreads();  // s_warp may be reused
  return v + before;
}

// Tile `tile` of the batch: requests are cut into ceil(n_r / QT) tiles of QT tokens, in request
// order. Writes {request, first token, tokens} to s_tile; false when the tile does not exist
// (the grid is sized for the worst case). A CTA of `Threads` threads.
template <int QT, int Threads = kThreads>
__device__ bool find_tile(const AttnArgs& a, int tile, int* s_warp, int* s_tile) {
  if (threadIdx.x == 0) s_tile[0] = -1;
  __syncthreads();
  int carry = 0;
  for (int base = 0; base < a.R; base += Threads) {
    const int r = base + static_cast<int>(threadIdx.x);
    int lo = 0, hi = 0, cnt = 0;
    if (r < a.R) {
      lo = min(max(a.query_start[r], 0), a.T);
      hi = min(max(a.query_start[r + 1], 0), a.T);
      cnt = hi > lo ? (hi - lo + QT - 1) / QT : 0;
    }
    int total = 0;
    const int incl = block_inclusive_scan<Threads>(cnt, s_warp, total);
    const int excl = incl - cnt;
    if (cnt > 0 && tile >= carry + excl && tile < carry + incl) {
      const int start = lo + (tile - carry - excl) * QT;
      s_tile[0] = r;
      s_tile[1] = start;
      s_tile[2] = min(QT, hi - start);
    }
    carry += total;
    __syncthreads();
    if (s_tile[0] >= 0) break;
  }
  return s_tile[0] >= 0;
}

// The m16n8k32 A fragments of token t's 16 query heads of KV head g (rows grp, grp + 8; k-step kk
// holds bytes 32 kk + 4 tig .. + 3 and 32 kk + 16 + 4 tig .. + 3 of each row); zero when the token
// is absent (present == false) and for heads >= group.
__device__ __forceinline__ void load_q_fragments(const AttnArgs& a, int g, int t, bool present,
                                                 uint32_t (&qa)[4][4]) {
  const int lane = threadIdx.x & 31, grp = lane >> 2, tig = lane & 3;
  const bool r0 = present && grp < a.group, r1 = present && grp + 8 < a.group;
  const uint8_t* q0 = a.q + static_cast<int64_t>(present ? t : 0) * a.q_stride_t +
                      static_cast<int64_t>(g * a.group + grp) * kDim;
  const uint8_t* q1 = q0 + 8 * kDim;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const int off = 32 * kk + 4 * tig;
    qa[kk][0] = r0 ? *reinterpret_cast<const uint32_t*>(q0 + off) : 0u;
    qa[kk][1] = r1 ? *reinterpret_cast<const uint32_t*>(q1 + off) : 0u;
    qa[kk][2] = r0 ? *reinterpret_cast<const uint32_t*>(q0 + off + 16) : 0u;
    qa[kk][3] = r1 ? *reinterpret_cast<const uint32_t*>(q1 + off + 16) : 0u;
  }
}

// What a CTA needs of its tile's tokens [t0, t0 + nt) and KV head g before the block list:
// pos = the position of token tid (tid < QT, -1 past nt); cand_b, cand_pos = id slot tid % 16 of
// token tid / 16 and that token's position (sparse, tid < 16 QT; -1 otherwise).
struct TileInputs {
  int pos, cand_b, cand_pos;
};

// The positions (batch metadata, written before the step's first kernel), then, after
// pdl_wait when kWait (the block ids may come from the previous kernel), the ids.
template <int QT, bool kWait>
__device__ __forceinline__ void load_tile_inputs(const AttnArgs& a, int g, int t0, int nt,
                                                 TileInputs& in) {
  const int tid = threadIdx.x;
  const bool cand = a.sparse && tid < kTopKIds * QT && tid / kTopKIds < nt;
  in.pos = tid < QT && tid < nt ? a.positions[t0 + tid] : -1;
  in.cand_pos = cand ? a.positions[t0 + tid / kTopKIds] : -1;
  if constexpr (kWait) pdl_wait();
  in.cand_b = cand ? a.block_ids[static_cast<int64_t>(t0 + tid / kTopKIds) * a.bid_stride_t +
                                 static_cast<int64_t>(g) * a.bid_stride_h + tid % kTopKIds]
                   : -1;
}

// find_tile, then the tile's inputs (load_tile_inputs). The inputs of the guessed tile [QT tile,
// QT tile + QT) are loaded before the scan of query_start confirms it, and again only when the
// guess was wrong: it holds for single-token tiles of a batch that starts at token 0 (decode) and
// for requests of QT tokens each (verify), which takes one dependent round trip off the chain
// query_start -> ids -> page table -> K/V before the first block arrives. Programmatic launch
// (PDL): every thread passes pdl_wait after loading the guessed positions and before anything a
// previous kernel may have written (ids; then Q and the cache in the caller); no global writes
// before it.
template <int QT, int Threads = kThreads>
__device__ __forceinline__ bool find_tile_and_load(const AttnArgs& a, int tile, int g, int* s_warp,
                                                   int* s_tile, TileInputs& in) {
  const int64_t tg = int64_t{QT} * tile;
  const int t_guess = tg < a.T ? static_cast<int>(tg) : -1;
  const int nt_guess = t_guess >= 0 ? min(QT, a.T - t_guess) : 0;
  if (nt_guess > 0) {
    load_tile_inputs<QT, true>(a, g, t_guess, nt_guess, in);
  } else {
    pdl_wait();
  }
  if (!find_tile<QT, Threads>(a, tile, s_warp, s_tile)) return false;
  if (s_tile[1] != t_guess || s_tile[2] != nt_guess)  // CTA-uniform
    load_tile_inputs<QT, false>(a, g, s_tile[1], s_tile[2], in);
  return true;
}

// The union of a tile's sparse selections (all threads of the CTA of `Threads` threads call it).
// Candidate c = tid < QT * 16 is slot c % 16 of token c / 16 (cand_b its id, cand_pos the token's
// position, -1 for absent tokens); it counts when it selects a visible block (0 <= b <= pos / 128,
// b < max_pages) whose page is inside the pool. The first occurrence of each id becomes an entry
// {b, page, mask of the tokens that selected it} (and, when s_list_vlim is not null, the V row
// limit: the largest position of those tokens minus 128 b); entries keep candidate order, so every
// split CTA derives the same list. Returns the entry count; the lists are complete after the next
// barrier (the caller's).
template <int QT, int Threads = kThreads>
__device__ __forceinline__ int sparse_union(const AttnArgs& a, int64_t pt_row, int cand_b,
                                            int cand_pos, const int* s_pos, int* s_cand_b,
                                            int* s_cand_page, int* s_warp, int* s_list_b,
                                            int* s_list_page, int* s_list_mask, int* s_list_vlim) {
  constexpr int kCand = kTopKIds * QT;
  static_assert(kCand <= Threads && kCand <= kMaxList, "one candidate per thread");
  const int tid = threadIdx.x;
  if (tid < kCand) {
    int b = cand_b, page = -1;
    if (cand_pos >= 0 && b >= 0 && b <= (cand_pos >> 7) && b < a.max_pages) {
      page = a.page_table[pt_row + b];
      if (page < 0 || page >= a.num_pages) b = -1;
    } else {
      b = -1;
    }
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
          mask |= 1 << (j / kTopKIds);
        }
      }
    }
  }
  int n_total = 0;
  const int rank = block_inclusive_scan<Threads>(first ? 1 : 0, s_warp, n_total) - 1;
  if (first) {
    s_list_b[rank] = b;
    s_list_page[rank] = s_cand_page[tid];
    s_list_mask[rank] = mask;
    if (s_list_vlim != nullptr) {
      int vmax = 0;
#pragma unroll
      for (int w = 0; w < QT; ++w)
        if (mask & (1 << w)) vmax = max(vmax, s_pos[w]);
      s_list_vlim[rank] = vmax - b * kBlockKeys;
    }
  }
  return n_total;
}

// Dense entries [c0, c0 + count) of a tile: block b = c0 + i, seen by every token with
// pos / 128 >= b when its page is inside the pool (mask 0 otherwise); s_list_vlim (optional) as in
// sparse_union, -1 for an entry no token sees. Threads of a CTA of `Threads` threads.
template <int QT, int Threads = kThreads>
__device__ __forceinline__ void dense_entries(const AttnArgs& a, int64_t pt_row, int c0, int count,
                                              const int* s_pos, int* s_list_b, int* s_list_page,
                                              int* s_list_mask, int* s_list_vlim) {
  for (int i = threadIdx.x; i < count; i += Threads) {
    const int b = c0 + i;
    const int page = a.page_table[pt_row + b];
    int mask = 0, vmax = 0;
    if (page >= 0 && page < a.num_pages) {
#pragma unroll
      for (int w = 0; w < QT; ++w)
        if (s_pos[w] >= 0 && (s_pos[w] >> 7) >= b) {
          mask |= 1 << w;
          vmax = max(vmax, s_pos[w]);
        }
    }
    s_list_b[i] = b;
    s_list_page[i] = page;
    s_list_mask[i] = mask;
    if (s_list_vlim != nullptr) s_list_vlim[i] = mask ? vmax - b * kBlockKeys : -1;
  }
}

// Raw K and V tiles of one (page, KV head) into one pipeline stage ([K tile | V tile]), each
// [128 keys][128 bytes] with 16-byte chunk c of key k stored at chunk (c ^ (k & 7)), so that
// ldmatrix reads of 8 keys x 16 bytes hit 8 distinct bank groups. All `Threads` threads call it.
template <bool kVec16, int Threads = kThreads>
__device__ __forceinline__ void load_block(const AttnArgs& a, int page, int g, uint8_t* stage) {
  static_assert(kTileBytes / 16 % Threads == 0, "whole 16-byte chunks per thread");
  const uint8_t* kt =
      a.kv + static_cast<int64_t>(page) * a.page_stride + static_cast<int64_t>(g) * kTileBytes;
  const uint8_t* vt = kt + a.plane_stride;
  const uint32_t ks = smem_u32(stage);
#pragma unroll
  for (int it = 0; it < kTileBytes / 16 / Threads; ++it) {
    const int i = it * Threads + static_cast<int>(threadIdx.x);
    const int key = i >> 3, c = i & 7;
    const uint32_t kdst = ks + key * kDim + ((c ^ (key & 7)) << 4);
    const uint32_t vdst = kdst + kTileBytes;
    if constexpr (kVec16) {
      cp_async_16(kdst, kt + i * 16);
      cp_async_16(vdst, vt + i * 16);
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        cp_async_4(kdst + 4 * e, kt + i * 16 + 4 * e);
        cp_async_4(vdst + 4 * e, vt + i * 16 + 4 * e);
      }
    }
  }
}

// TMA copy of one box of a 4-d tensor map into shared memory, completing on mbarrier `bar`.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap* map, int c0, int c1,
                                            int c2, int c3, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
      "%3, %4, %5}], [%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}

// The layout of load_block by two TMA copies (K, V maps of [pages][n_kv][128][128] bytes with the
// 128-byte swizzle: chunk c of row k lands at c ^ (k & 7) when `dst` is 1024-byte aligned), issued
// by ONE thread onto mbarrier `bar`, which completes when both tiles landed.
__device__ __forceinline__ void tma_load_block(const CUtensorMap* kmap, const CUtensorMap* vmap,
                                               int page, int g, uint32_t dst, uint32_t bar) {
  sm90::mbar_arrive_expect_tx(bar, kStageBytes);
  tma_load_4d(dst, kmap, 0, 0, g, page, bar);
  tma_load_4d(dst + kTileBytes, vmap, 0, 0, g, page, bar);
}

// Per-warp state of the online softmax: rows grp and grp + 8 of the 16-row tile. The dims held by
// o[n][e] (e: 0, 1 row grp; 2, 3 row grp + 8): see o_dim.
struct WarpState {
  float o[kDim / 8][4];
  float m[2];  // running max (log2 domain)
  float l[2];  // running sum (this thread's columns only; quad-reduced at the end)
};

// Output dim of accumulator o[n][e] for lane group tig: n-tile n = 2 j + parity covers dims
// 16 j + 2 c + parity, c = 2 tig + (e & 1), so o[2j][e], o[2j + 1][e] (e = 0, 1) are the 4
// consecutive dims 16 j + 4 tig .. + 3.
__device__ __forceinline__ int o_dim(int n, int e, int tig) {
  return 16 * (n >> 1) + 4 * tig + 2 * (e & 1) + (n & 1);
}

// One chunk of NK keys [key0, key0 + NK) (key0 a multiple of 8, so the swizzle of key k is lane & 7
// wherever a lane addresses key k with k & 7 = lane & 7) of the block in shared memory: S = Q K^T,
// online softmax, O += P V. Keys with index > lim are masked when need_mask (and their V bytes are
// zeroed: the slots may be unwritten). v_smem is the raw V tile.
template <int NK>
__device__ __forceinline__ void attend_chunk(WarpState& st, const uint32_t (&qa)[4][4],
                                             uint32_t k_smem, uint32_t v_smem, int key0,
                                             bool need_mask, int lim, float scale_log2) {
  const int lane = threadIdx.x & 31;
  const int tig = lane & 3;
  float s[NK / 8][4];
#pragma unroll
  for (int j = 0; j < NK / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;

    // S = Q K^T. ldmatrix lane L addresses key (n0 + (L & 7)), 16-byte chunk (4 kp + (L >> 3)):
    // register m is the B fragment (bytes 4 tig .. 4 tig + 3 of chunk 4 kp + m) of key n0 + grp.
#pragma unroll
  for (int j = 0; j < NK / 8; ++j) {
    const int key = key0 + 8 * j + (lane & 7);
#pragma unroll
    for (int kp = 0; kp < 2; ++kp) {
      const int chunk = 4 * kp + (lane >> 3);
      uint32_t b0, b1, b2, b3;
      ldsm_x4(k_smem + key * kDim + ((chunk ^ (lane & 7)) << 4), b0, b1, b2, b3);  // key & 7
      mma_e4m3(s[j], qa[2 * kp], b0, b1);
      mma_e4m3(s[j], qa[2 * kp + 1], b2, b3);
    }
  }

  // Mask, row max (rows grp: elements 0, 1; grp + 8: elements 2, 3) of the raw scores; the scale to
  // the log2 domain follows on the maxima and inside the exponent's fmaf.
  float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
  for (int j = 0; j < NK / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (need_mask && key0 + 8 * j + 2 * tig + (e & 1) > lim) s[j][e] = -INFINITY;
    }
    mx0 = fmaxf(mx0, fmaxf(s[j][0], s[j][1]));
    mx1 = fmaxf(mx1, fmaxf(s[j][2], s[j][3]));
  }
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
  mx0 *= scale_log2;
  mx1 *= scale_log2;
  const float m0 = fmaxf(st.m[0], mx0), m1 = fmaxf(st.m[1], mx1);
  // A row that has seen only masked keys keeps m = -inf; subtract 0 then so exp2 gives 0, not NaN.
  const float mu0 = m0 == -INFINITY ? 0.0f : m0;
  const float mu1 = m1 == -INFINITY ? 0.0f : m1;
  const float alpha0 = fast_exp2(st.m[0] - mu0), alpha1 = fast_exp2(st.m[1] - mu1);
  st.m[0] = m0;
  st.m[1] = m1;
  float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
  for (int j = 0; j < NK / 8; ++j) {
    s[j][0] = fast_exp2(fmaf(s[j][0], scale_log2, -mu0));
    s[j][1] = fast_exp2(fmaf(s[j][1], scale_log2, -mu0));
    s[j][2] = fast_exp2(fmaf(s[j][2], scale_log2, -mu1));
    s[j][3] = fast_exp2(fmaf(s[j][3], scale_log2, -mu1));
    sum0 += s[j][0] + s[j][1];
    sum1 += s[j][2] + s[j][3];
  }
  st.l[0] = st.l[0] * alpha0 + sum0;
  st.l[1] = st.l[1] * alpha1 + sum1;
  // No rescale when no row maximum of the warp moved (every alpha is exactly 1).
  if (!__all_sync(0xffffffffu, alpha0 == 1.0f && alpha1 == 1.0f)) {
#pragma unroll
    for (int n = 0; n < kDim / 8; ++n) {
      st.o[n][0] *= alpha0;
      st.o[n][1] *= alpha0;
      st.o[n][2] *= alpha1;
      st.o[n][3] *= alpha1;
    }
  }

  // O += P V. The S accumulators of n-tiles 2 kk, 2 kk + 1 are the f16 A fragment of keys
  // [16 kk, 16 kk + 16). ldmatrix.trans lane L addresses key 16 kk + 8 ((L >> 3) & 1) + (L & 7)
  // and 16-byte chunk 2 q + (L >> 4), so registers 0, 1 hold keys (2 tig, 2 tig + 1) and
  // (2 tig + 8, 2 tig + 9) of chunk 2 q, registers 2, 3 the same keys of chunk 2 q + 1.
#pragma unroll
  for (int kk = 0; kk < NK / 16; ++kk) {
    uint32_t pa[4];
    pa[0] = pack_f16x2(s[2 * kk][0], s[2 * kk][1]);
    pa[1] = pack_f16x2(s[2 * kk][2], s[2 * kk][3]);
    pa[2] = pack_f16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    pa[3] = pack_f16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    const int kb = key0 + 16 * kk;
    const int key = kb + (((lane >> 3) & 1) << 3) + (lane & 7);
    // The V fragments give this thread keys (k0, k0 + 1) in its registers 0 and 2 and keys
    // (k0 + 8, k0 + 9) in registers 1 and 3 (k0 = kb + 2 tig; low 16 bits the first key). Keys
    // past lim are cleared before the MMA: P is 0 there, and 0 * NaN would leak a NaN of another
    // token's visible key (or of an unwritten slot) into this token's rows.
    uint32_t keep_lo = 0xffffffffu, keep_hi = 0xffffffffu;  // keys < 8 / >= 8 of the k-step
    if (need_mask) {
      const int k0 = kb + 2 * tig;
      keep_lo = (k0 <= lim ? 0x0000ffffu : 0u) | (k0 + 1 <= lim ? 0xffff0000u : 0u);
      keep_hi = (k0 + 8 <= lim ? 0x0000ffffu : 0u) | (k0 + 9 <= lim ? 0xffff0000u : 0u);
    }
    // Raw E4M3 chunks of 16 dims: a register holds the byte pairs (key k, dims 2 grp, 2 grp + 1)
    // and (key k + 1, same dims), k = kb + 2 tig (+ 8). Bytes 0, 2 are the B fragment of dim
    // 2 grp, bytes 1, 3 that of dim 2 grp + 1: two n-tiles of even / odd dims per register pair.
#pragma unroll
    for (int q = 0; q < kDim / 32; ++q) {
      const int chunk = 2 * q + (lane >> 4);
      uint32_t r0, r1, r2, r3;
      ldsm_x4_trans(v_smem + key * kDim + ((chunk ^ (lane & 7)) << 4), r0, r1, r2, r3);
      r0 &= keep_lo;
      r1 &= keep_hi;
      r2 &= keep_lo;
      r3 &= keep_hi;
      mma_f16(st.o[4 * q + 0], pa, e4m3x2_to_f16x2(__byte_perm(r0, 0u, 0x0020u)),
              e4m3x2_to_f16x2(__byte_perm(r1, 0u, 0x0020u)));
      mma_f16(st.o[4 * q + 1], pa, e4m3x2_to_f16x2(__byte_perm(r0, 0u, 0x0031u)),
              e4m3x2_to_f16x2(__byte_perm(r1, 0u, 0x0031u)));
      mma_f16(st.o[4 * q + 2], pa, e4m3x2_to_f16x2(__byte_perm(r2, 0u, 0x0020u)),
              e4m3x2_to_f16x2(__byte_perm(r3, 0u, 0x0020u)));
      mma_f16(st.o[4 * q + 3], pa, e4m3x2_to_f16x2(__byte_perm(r2, 0u, 0x0031u)),
              e4m3x2_to_f16x2(__byte_perm(r3, 0u, 0x0031u)));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The attention kernel. Grid: (tiles bound, n_kv, splits); block: kThreads; dynamic smem
// kSmemBytes.
template <int QT, bool kVec16>
__global__ void __launch_bounds__(kThreads, 2) attention_tile_kernel(const AttnArgs a) {
  constexpr int KS = kWarps / QT;          // warps per token (key slices)
  constexpr int kSlice = kBlockKeys / KS;  // keys of a block per warp
  constexpr int kChunk = kSlice < 64 ? kSlice : 64;
  constexpr int kCand = kTopKIds * QT;  // candidate ids of a tile
  constexpr int kSt = kStages;
  static_assert(kWarps % QT == 0 && kCand <= kThreads && kCand <= kMaxList, "tile shape");

  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ int s_warp[kWarps];
  __shared__ int s_tile[3];
  __shared__ int s_pos[QT];
  __shared__ int s_cand_b[kCand];
  __shared__ int s_cand_page[kCand];
  __shared__ int s_list_b[kMaxList];
  __shared__ int s_list_page[kMaxList];
  __shared__ int s_list_mask[kMaxList];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int grp = lane >> 2, tig = lane & 3;
  const int g = blockIdx.y, split = blockIdx.z;

  TileInputs in;
  if (!find_tile_and_load<QT>(a, static_cast<int>(blockIdx.x), g, s_warp, s_tile, in))
    return;  // CTA-uniform
  const int r = s_tile[0], t0 = s_tile[1], nt = s_tile[2];
  const int cand_b = in.cand_b, cand_pos = in.cand_pos;
  if (tid < QT) s_pos[tid] = in.pos;
  // Q fragments of this warp's token (off the critical path: first used by the first block).
  const int tw = warp / KS, ksl = warp % KS;
  uint32_t qa[4][4];
  load_q_fragments(a, g, t0 + tw, tw < nt, qa);
  __syncthreads();  // s_pos

  const int64_t pt_row = static_cast<int64_t>(r) * a.pt_stride;
  int n_total = 0;
  if (a.sparse) {
    n_total = sparse_union<QT>(a, pt_row, cand_b, cand_pos, s_pos, s_cand_b, s_cand_page, s_warp,
                               s_list_b, s_list_page, s_list_mask, nullptr);
  } else {
    int maxpos = -1;
#pragma unroll
    for (int w = 0; w < QT; ++w) maxpos = max(maxpos, s_pos[w]);
    n_total = maxpos >= 0 ? min((maxpos >> 7) + 1, a.max_pages) : 0;
  }
  __syncthreads();

  pdl_launch_dependents();  // the next kernel may launch (it waits for this grid to complete)
  // This CTA's share of the entries.
  const int per = (n_total + a.splits - 1) / a.splits;
  const int lo = min(n_total, split * per);
  const int hi = min(n_total, lo + per);

  WarpState st;
#pragma unroll
  for (int n = 0; n < kDim / 8; ++n) st.o[n][0] = st.o[n][1] = st.o[n][2] = st.o[n][3] = 0.0f;
  st.m[0] = st.m[1] = -INFINITY;
  st.l[0] = st.l[1] = 0.0f;

  const int my_pos = tw < nt ? s_pos[tw] : -1;

  for (int c0 = lo; c0 < hi; c0 += kMaxList) {
    const int count = min(hi - c0, kMaxList);
    int off = c0;
    if (!a.sparse) {
      // Dense entries [c0, c0 + count): block b = c0 + i, seen by every token with pos / 128 >= b.
      __syncthreads();  // the previous chunk's entries and stages are no longer read
      dense_entries<QT>(a, pt_row, c0, count, s_pos, s_list_b, s_list_page, s_list_mask, nullptr);
      __syncthreads();
      off = 0;
    }

    // kSt-stage ring: blocks 0 .. kSt-2 in flight before the loop; iteration i waits for block i
    // (one commit group per block, empty groups included, so the counting is uniform), then
    // refills the stage that block i - 1 used with block i + kSt - 1. Entries no token sees are
    // not loaded.
    auto load = [&](int j, int st) {
      if (j < count && s_list_mask[off + j])
        load_block<kVec16>(a, s_list_page[off + j], g, smem + st * kStageBytes);
      cp_async_commit();
    };
#pragma unroll
    for (int j = 0; j < kSt - 1; ++j) load(j, j);
    int stage = 0;
    for (int i = 0; i < count; ++i) {
      cp_async_wait<kSt - 2>();
      __syncthreads();  // block i landed for every thread; block i - 1 fully consumed
      load(i + kSt - 1, stage == 0 ? kSt - 1 : stage - 1);  // (i + kSt - 1) mod kSt
      const int mask = s_list_mask[off + i];
      const int b = s_list_b[off + i];
      uint8_t* sbuf = smem + stage * kStageBytes;
      stage = stage + 1 == kSt ? 0 : stage + 1;
      if (mask & (1 << tw)) {
        const int lim = my_pos - b * kBlockKeys;  // keys > lim are in this token's future
        const uint32_t k_smem = smem_u32(sbuf);
        const uint32_t v_smem = k_smem + kTileBytes;
#pragma unroll
        for (int c = 0; c < kSlice / kChunk; ++c) {
          const int key0 = ksl * kSlice + c * kChunk;
          if (key0 <= lim)
            attend_chunk<kChunk>(st, qa, k_smem, v_smem, key0, key0 + kChunk - 1 > lim, lim,
                                 a.scale_log2);
        }
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // all warps are done with the pipeline buffers

  // Epilogue: each warp parks (o, m, l) of its 16 rows; the KS warps of a token are combined.
  float* s_o = reinterpret_cast<float*>(smem);
  float* s_m = s_o + kWarps * kRows * kOStride;
  float* s_l = s_m + kWarps * kRows;
  {
    float l0 = st.l[0], l1 = st.l[1];
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    float* ow = s_o + warp * kRows * kOStride;
#pragma unroll
    for (int n = 0; n < kDim / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e)
        ow[(grp + (e >> 1) * 8) * kOStride + o_dim(n, e, tig)] = st.o[n][e];
    }
    if (tig == 0) {
      s_m[warp * kRows + grp] = st.m[0];
      s_m[warp * kRows + grp + 8] = st.m[1];
      s_l[warp * kRows + grp] = l0;
      s_l[warp * kRows + grp + 8] = l1;
    }
  }
  __syncthreads();

  const int items = QT * a.group * (kDim / 2);
  for (int item = tid; item < items; item += kThreads) {
    const int w = item / (a.group * (kDim / 2));
    const int rem = item - w * (a.group * (kDim / 2));
    const int h = rem / (kDim / 2), dp = rem % (kDim / 2);
    if (w >= nt) continue;
    float M = -INFINITY;
#pragma unroll
    for (int k = 0; k < KS; ++k) M = fmaxf(M, s_m[(w * KS + k) * kRows + h]);
    float L = 0.0f, ox = 0.0f, oy = 0.0f;
    if (M != -INFINITY) {
#pragma unroll
      for (int k = 0; k < KS; ++k) {
        const int wk = w * KS + k;
        const float wgt = exp2f(s_m[wk * kRows + h] - M);
        const float2 v =
            *reinterpret_cast<const float2*>(s_o + (wk * kRows + h) * kOStride + 2 * dp);
        L += wgt * s_l[wk * kRows + h];
        ox += wgt * v.x;
        oy += wgt * v.y;
      }
    }
    const int64_t t = t0 + w;
    if (a.splits == 1) {
      const float inv = L > 0.0f ? 1.0f / L : 0.0f;
      *reinterpret_cast<uint32_t*>(a.out + t * a.out_stride + (g * a.group + h) * kDim + 2 * dp) =
          pack_bf16x2(ox * inv, oy * inv);
    } else {
      const int64_t slot = (t * a.n_kv + g) * a.splits + split;
      *reinterpret_cast<float2*>(a.ws_o + (slot * kRows + h) * kDim + 2 * dp) = make_float2(ox, oy);
      if (dp == 0) {
        a.ws_ml[(slot * kRows + h) * 2] = M;
        a.ws_ml[(slot * kRows + h) * 2 + 1] = L;
      }
    }
  }
}

}  // namespace attention_kernel
}  // namespace m3attn
