// Device code shared by the kernels of the paged FP8 attention (SPEC section 6): the launch
// arguments, PTX wrappers, E4M3 / BF16 conversions, the block quantization of o_proj's input, and
// the per-CTA front end every decode / verify / prefill kernel runs:
//   - find_tile / find_tile_and_load: a CTA owns one (query tile, KV head g, split s); a tile is QT
//     consecutive tokens of ONE request, found by a block-wide scan of query_start (so the grid
//     depends only on host-known T and R), its inputs loaded before the scan confirms the guess;
//   - sparse_union / dense_entries: the union of the tile's selected blocks (sparse) or blocks
//     0 .. max_pos / 128 (dense), each entry with the mask of the tokens that see it; with splits
//     > 1 (flash-decoding) every split CTA derives the same list and takes one contiguous range,
//     writing an unnormalised partial (o, m, l) that attention_merge_kernel combines;
//   - load_block / tma_load_block: raw K and V tiles (16 KB each, contiguous in the cache) into a
//     ring stage with a 16-byte-chunk XOR swizzle (ldmatrix conflict-free; the layout of the
//     128-byte TMA swizzle).
// The kernels: attention_decode_kernel.cuh (1-token tiles on mma.sync, the decode path),
// attention_verify_wgmma.cuh (4-token tiles on wgmma, speculative verify),
// attention_prefill_wgmma.cuh / attention_prefill_ws*.cuh (8-token tiles on wgmma, prefill).
// The 4-warp mma.sync tile kernel (1, 2 or 4 tokens per tile, FP8 mma.sync, each warp a 32-key
// slice of every block and all 128 dims of O) that lived here until session 14 was removed after
// round A: the 8-warp decode kernel was faster at every decode batch (B64 41.2-41.5 vs 43.6-44.9
// us, B256 144-145 vs 153-154, B1 12.1 vs 13.8), and its 2- and 4-token tiles were never the
// automatic choice (the verify kernel runs 2-15 tokens per request).
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
constexpr int kThreads = 128;    // default CTA size of the helpers below (the verify kernel's)
constexpr int kMaxList = 128;    // block entries held in shared memory at once
constexpr int kMaxSplits = 128;  // CTAs per (tile, KV head)
constexpr int kTileBytes = kBlockKeys * kDim;  // one raw E4M3 K or V tile
constexpr int kStageBytes = 2 * kTileBytes;

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
  int pdl;     // launched programmatically (PDL): the front end orders its loads for the overlap
  // AttentionCudaConfig::timeline (benchmarks; null otherwise): kTimelineWords words per CTA of the
  // decode / verify kernel, see timeline_mark.
  uint64_t* timeline;
};

// Diagnostics (AttentionCudaConfig::timeline; benchmarks only): thread 0 of a CTA (linear index
// x + X (y + Y z) of its grid) records %globaltimer (ns) in word `slot` of its kTimelineWords
// words: 0 entry, 1 tile found and its inputs loaded, 2 block list built, 3 first block landed, 4
// last block attended (before the epilogue), 5 exit (also for a CTA without a tile: then words 1-4
// stay 0); word 6 = the blocks the CTA walks, word 7 = its SM id + 1 (written at entry). Words
// 8-11 stamp the sparse verify front (session 21; 0 where a kernel does not record them): 8 the
// tile's block ids arrived (thread 0's), 9 the union's ranks known (the warp front), 10 the page of
// the list's first entry known, 11 its early copy issued (timeline_mark_dep / timeline_mark_any);
// 12 / 13 the epilogue of the bulk-copied rows: rows staged in shared memory and fenced, thread
// 0's copy issued; 14 / 15 that epilogue's entry (NaN dims read) and its staging stores issued.
constexpr int kTimelineWords = 16;
__device__ __forceinline__ uint64_t* timeline_words(const AttnArgs& a) {
  const int64_t cta =
      blockIdx.x + int64_t{gridDim.x} * (blockIdx.y + int64_t{gridDim.y} * blockIdx.z);
  return a.timeline + cta * kTimelineWords;
}
__device__ __forceinline__ void timeline_mark(const AttnArgs& a, int slot, int value = 0) {
  if (a.timeline == nullptr || threadIdx.x != 0) return;
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  uint64_t* w = timeline_words(a);
  w[slot] = t;
  if (slot == 0) {
    uint32_t sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    w[7] = uint64_t{sm} + 1;
  }
  if (slot == 2) w[6] = static_cast<uint64_t>(value);
}
// Thread 0 records `slot` once `dep` is in its registers (the asm reads it: a pending load of dep
// is waited for first).
__device__ __forceinline__ void timeline_mark_dep(const AttnArgs& a, int slot, int dep) {
  if (a.timeline == nullptr || threadIdx.x != 0) return;
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) : "r"(dep));
  timeline_words(a)[slot] = t;
}
// The calling thread (any) records `slot`, after `dep` is in its registers.
__device__ __forceinline__ void timeline_mark_any(const AttnArgs& a, int slot, int dep) {
  if (a.timeline == nullptr) return;
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) : "r"(dep));
  timeline_words(a)[slot] = t;
}
// %globaltimer when the timeline is on (0 otherwise), for a mark recorded later (timeline_put).
__device__ __forceinline__ uint64_t timeline_now(const AttnArgs& a) {
  uint64_t t = 0;
  if (a.timeline != nullptr) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void timeline_put(const AttnArgs& a, int slot, uint64_t t) {
  if (a.timeline == nullptr || threadIdx.x != 0) return;
  timeline_words(a)[slot] = t;
}

// ---------------------------------------------------------------------------------------------
// PTX wrappers.
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}

// The page-table row of request r into L2 (one 128-byte line per thread, the first Threads * 32
// pages; nothing when r is not a request): issued at a CTA's entry for the request its tile most
// likely belongs to, so that the page reads of sparse_union, which wait for the ids and the tile,
// hit L2 instead of HBM. Batch metadata: safe before pdl_wait.
template <int Threads = kThreads>
__device__ __forceinline__ void prefetch_page_row(const AttnArgs& a, int r) {
  const int64_t i = int64_t{32} * threadIdx.x;
  if (r >= 0 && r < a.R && i < a.max_pages)
    prefetch_l2(a.page_table + static_cast<int64_t>(r) * a.pt_stride + i);
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

// Eight E4M3 bytes (w0 then w1, low byte first) -> one 16-byte chunk of eight f16 values.
__device__ __forceinline__ uint4 e4m3x8_to_f16(uint32_t w0, uint32_t w1) {
  return make_uint4(e4m3x2_to_f16x2(w0), e4m3x2_hi_to_f16x2(w0), e4m3x2_to_f16x2(w1),
                    e4m3x2_hi_to_f16x2(w1));
}

// One 16-byte raw chunk (16 dims) -> two f16 chunks (8 dims each).
__device__ __forceinline__ void e4m3x16_to_f16(const uint4& raw, uint4& h0, uint4& h1) {
  h0 = e4m3x8_to_f16(raw.x, raw.y);
  h1 = e4m3x8_to_f16(raw.z, raw.w);
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
// quant_code gets the same code without an IEEE division in nearly every case (session 15; the
// verify epilogue had 64 divisions per lane): with rcp = fl(1 / scale), q = fl(x rcp) is within
// 2.5 units in the last place of fl(x / scale) (two roundings of 2^-24 relative each, and the
// division's half unit), so both round to the same E4M3 code unless an E4M3 rounding midpoint lies
// that close: in E4M3's normal range (|q| >= 2^-6) the midpoints are exactly the fp32 values whose
// 20 low mantissa bits are 0x80000 (3 mantissa bits kept; the midpoint below a power of two has
// the same pattern). Values within 8 units of such a pattern, below 2^-6 (E4M3 subnormals, zero)
// or not finite take the IEEE division: the codes are those of the quantize stage bit for bit.
__device__ __forceinline__ float bf16_lo_f(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi_f(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ float quant_scale(float amax) {
  return amax > 0.0f ? __fdiv_rn(amax, kE4M3Max) : 1.0f;
}
__device__ __forceinline__ float quant_rcp(float scale) { return __frcp_rn(scale); }
__device__ __forceinline__ uint32_t quant_code(float x, float scale, float rcp) {
  const float q = __fmul_rn(x, rcp);
  const uint32_t u = __float_as_uint(q) & 0x7fffffffu;
  if (u < 0x3c800000u || u >= 0x7f800000u || (u & 0xfffffu) - 0x7fff8u <= 16u)
    return float_to_e4m3(__fdiv_rn(x, scale));
  return float_to_e4m3(q);
}
// Codes of the two BF16 values of w (low half first), as two bytes; rcp = quant_rcp(scale).
__device__ __forceinline__ uint32_t quant_pair(uint32_t w, float scale, float rcp) {
  return quant_code(bf16_lo_f(w), scale, rcp) | (quant_code(bf16_hi_f(w), scale, rcp) << 8);
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
// first (optional): request_bounds(a, threadIdx.x), loaded by the caller ahead of time (the first
// Threads requests' bounds; the rest are loaded here).
struct TileBounds {
  int lo, hi;
};
__device__ __forceinline__ TileBounds request_bounds(const AttnArgs& a, int r) {
  if (r >= a.R) return {0, 0};
  return {min(max(a.query_start[r], 0), a.T), min(max(a.query_start[r + 1], 0), a.T)};
}
template <int QT, int Threads = kThreads>
__device__ bool find_tile(const AttnArgs& a, int tile, int* s_warp, int* s_tile,
                          const TileBounds* first = nullptr) {
  if (threadIdx.x == 0) s_tile[0] = -1;
  __syncthreads();
  int carry = 0;
  for (int base = 0; base < a.R; base += Threads) {
    const int r = base + static_cast<int>(threadIdx.x);
    const TileBounds tb = base == 0 && first != nullptr ? *first : request_bounds(a, r);
    const int lo = tb.lo, hi = tb.hi;
    const int cnt = hi > lo ? (hi - lo + QT - 1) / QT : 0;
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
// query_start -> ids -> page table -> K/V before the first block arrives. Every thread passes
// pdl_wait before anything a previous kernel may have written (ids; then Q and the cache in the
// caller) and before any global write: after the guessed positions in a plain launch (the wait is
// a no-op there), and after the whole scan of query_start and the tile's positions (batch
// metadata) in a programmatic one (a.pdl), where that part overlaps the previous kernel's tail.
template <int QT, int Threads = kThreads>
__device__ __forceinline__ bool find_tile_and_load(const AttnArgs& a, int tile, int g, int* s_warp,
                                                   int* s_tile, TileInputs& in) {
  if (a.pdl) {
    const bool found = find_tile<QT, Threads>(a, tile, s_warp, s_tile);  // CTA-uniform
    if (found)
      load_tile_inputs<QT, true>(a, g, s_tile[1], s_tile[2], in);
    else
      pdl_wait();
    return found;
  }
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

// The page of candidate block b of a token at position pos, or -1, with b set to -1, when the
// candidate does not count: no token (pos < 0), an id outside 0 <= b <= pos / 128, b >= max_pages,
// or a page-table entry outside the pool.
__device__ __forceinline__ int candidate_page(const AttnArgs& a, int64_t pt_row, int pos, int& b) {
  int page = -1;
  if (pos >= 0 && b >= 0 && b <= (pos >> 7) && b < a.max_pages) {
    page = a.page_table[pt_row + b];
    if (page < 0 || page >= a.num_pages) b = -1;
  } else {
    b = -1;
  }
  return page;
}
// The same with the page-table entry already read (`page`, from guessed_page's read of the right
// row; -1 when that read was skipped, which happens exactly when b does not count here either).
__device__ __forceinline__ int candidate_page_known(const AttnArgs& a, int pos, int& b, int page) {
  if (pos >= 0 && b >= 0 && b <= (pos >> 7) && b < a.max_pages) {
    if (page < 0 || page >= a.num_pages) b = -1;
    return page;
  }
  b = -1;
  return -1;
}
// candidate_page's read of the page-table entry of block b in request r's row, issued before the
// tile scan confirms r (the verify kernel's guessed request), not waited for here: -1 without a
// read where b cannot count.
__device__ __forceinline__ int guessed_page(const AttnArgs& a, int r, int pos, int b) {
  if (pos >= 0 && b >= 0 && b <= (pos >> 7) && b < a.max_pages)
    return a.page_table[static_cast<int64_t>(r) * a.pt_stride + b];
  return -1;
}

// The union of a tile's sparse selections (all threads of the CTA of `Threads` threads call it).
// Candidate c = tid < QT * 16 is slot c % 16 of token c / 16 (cand_b its id, cand_pos the token's
// position, -1 for absent tokens); it counts when it selects a visible block (0 <= b <= pos / 128,
// b < max_pages) whose page is inside the pool. The first occurrence of each id becomes an entry
// {b, page, mask of the tokens that selected it} (and, when s_list_vlim is not null, the V row
// limit: the largest position of those tokens minus 128 b); entries keep candidate order, so every
// split CTA derives the same list. Returns the entry count; the lists are complete after the next
// barrier (the caller's). `early(b, page)` runs in every thread as soon as its candidate's page is
// known, before any barrier (b = -1 for a candidate that does not count and for threads without
// one): the verify kernel issues its first copies there (entry k of the list is the k-th
// candidate, in candidate order, whose id occurs first). page_known: known_page is this thread's
// page-table entry, already read (candidate_page_known; the caller has confirmed the row).
struct NoEarly {
  __device__ __forceinline__ void operator()(int, int) const {}
};
template <int QT, int Threads = kThreads, typename Early = NoEarly>
__device__ __forceinline__ int sparse_union(const AttnArgs& a, int64_t pt_row, int cand_b,
                                            int cand_pos, const int* s_pos, int* s_cand_b,
                                            int* s_cand_page, int* s_warp, int* s_list_b,
                                            int* s_list_page, int* s_list_mask, int* s_list_vlim,
                                            Early early = {}, bool page_known = false,
                                            int known_page = -1) {
  constexpr int kCand = kTopKIds * QT;
  static_assert(kCand <= Threads && kCand <= kMaxList, "one candidate per thread");
  const int tid = threadIdx.x;
  {
    int b = -1, page = -1;
    if (tid < kCand) {
      b = cand_b;
      page = page_known ? candidate_page_known(a, cand_pos, b, known_page)
                        : candidate_page(a, pt_row, cand_pos, b);
      s_cand_b[tid] = b;
      s_cand_page[tid] = page;
    }
    early(b, page);
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

// The entries of chunk [c0, c0 + count) of a tile's list: sparse lists are complete in shared
// memory (the chunk starts at c0); dense chunks are built here (dense_entries, at offset 0),
// between two CTA barriers (the previous chunk's entries are no longer read); s_list_vlim may be
// null. All `Threads` threads call it.
struct ChunkEntries {
  const int *mask, *b, *page, *vlim;
};
template <int QT, int Threads = kThreads>
__device__ __forceinline__ ChunkEntries chunk_entries(const AttnArgs& a, int64_t pt_row, int c0,
                                                      int count, const int* s_pos, int* s_list_b,
                                                      int* s_list_page, int* s_list_mask,
                                                      int* s_list_vlim) {
  int off = c0;
  if (!a.sparse) {
    __syncthreads();
    dense_entries<QT, Threads>(a, pt_row, c0, count, s_pos, s_list_b, s_list_page, s_list_mask,
                               s_list_vlim);
    __syncthreads();
    off = 0;
  }
  return {s_list_mask + off, s_list_b + off, s_list_page + off,
          s_list_vlim != nullptr ? s_list_vlim + off : nullptr};
}

// An L2 policy for data read once (the selected K / V tiles of a decode / verify call: each
// (page, KV head) tile is read by one CTA once): evict first, so the call's stream of ~134 MB (B64
// x 4) does not push the kernel's code, page table, ids and Q out of L2 ahead of their next use
// (the verify kernel's epilogue runs code no warp has fetched since the grid started).
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(p));
  return p;
}
__device__ __forceinline__ void cp_async_16_hint(uint32_t dst, const void* src, uint64_t policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n" ::"r"(dst),
               "l"(src), "l"(policy)
               : "memory");
}

// Raw K and V tiles of one (page, KV head) into one pipeline stage ([K tile | V tile]), each
// [128 keys][128 bytes] with 16-byte chunk c of key k stored at chunk (c ^ (k & 7)), so that
// ldmatrix reads of 8 keys x 16 bytes hit 8 distinct bank groups. All `Threads` threads call it.
// kHint (16-byte copies only): with the L2 cache policy `policy` (evict_first_policy).
template <bool kVec16, int Threads = kThreads, bool kHint = false>
__device__ __forceinline__ void load_block(const AttnArgs& a, int page, int g, uint8_t* stage,
                                           uint64_t policy = 0) {
  static_assert(!kHint || kVec16, "cache hints on the 16-byte copies");
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
    if constexpr (kHint) {
      cp_async_16_hint(kdst, kt + i * 16, policy);
      cp_async_16_hint(vdst, vt + i * 16, policy);
    } else if constexpr (kVec16) {
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

// tma_load_4d with an L2 cache policy (evict_first_policy).
__device__ __forceinline__ void tma_load_4d_hint(uint32_t dst, const CUtensorMap* map, int c0,
                                                 int c1, int c2, int c3, uint32_t bar,
                                                 uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint "
      "[%0], [%1, {%2, %3, %4, %5}], [%6], %7;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar),
      "l"(policy)
      : "memory");
}

// The layout of load_block by two TMA copies (K, V maps of [pages][n_kv][128][128] bytes with the
// 128-byte swizzle: chunk c of row k lands at c ^ (k & 7) when `dst` is 1024-byte aligned), issued
// by ONE thread onto mbarrier `bar`, which completes when both tiles landed. kHint: with the L2
// cache policy `policy`.
template <bool kHint = false>
__device__ __forceinline__ void tma_load_block(const CUtensorMap* kmap, const CUtensorMap* vmap,
                                               int page, int g, uint32_t dst, uint32_t bar,
                                               uint64_t policy = 0) {
  sm90::mbar_arrive_expect_tx(bar, kStageBytes);
  if constexpr (kHint) {
    tma_load_4d_hint(dst, kmap, 0, 0, g, page, bar, policy);
    tma_load_4d_hint(dst + kTileBytes, vmap, 0, 0, g, page, bar, policy);
  } else {
    tma_load_4d(dst, kmap, 0, 0, g, page, bar);
    tma_load_4d(dst + kTileBytes, vmap, 0, 0, g, page, bar);
  }
}

// The early copies of the verify and decode kernels (kEarly), run by every thread inside
// sparse_union's early hook (cb = its candidate's block id or -1, cpage its page): candidates 0-31
// (warp 0) come first in candidate order, so the k-th first occurrence among them is entry k of the
// list. Warp 0 copies entries 0 .. Max - 1 by TMA into the stages at base + k * kStageBytes
// (mbarrier s_full[k]) and lane 0 writes how many it copied to *s_count; the other warps return.
// kHint: the copies with the L2 cache policy `policy` (evict_first_policy).
template <int Max, bool kHint = false>
__device__ __forceinline__ void early_copies(int cb, int cpage, const CUtensorMap* kmap,
                                             const CUtensorMap* vmap, int g, uint32_t base,
                                             uint64_t* s_full, int* s_count, uint64_t policy = 0) {
  if ((threadIdx.x >> 5) != 0) return;  // warp-uniform
  const int lane = threadIdx.x & 31;
  const uint32_t same = __match_any_sync(0xffffffffu, cb >= 0 ? cb : -1 - lane);
  const bool first = cb >= 0 && __ffs(same) - 1 == lane;
  const uint32_t firsts = __ballot_sync(0xffffffffu, first);
  const int rank = __popc(firsts & ((1u << lane) - 1u));
  if (first && rank < Max)
    tma_load_block<kHint>(kmap, vmap, cpage, g, base + rank * kStageBytes, smem_u32(&s_full[rank]),
                          policy);
  if (lane == 0) *s_count = min(__popc(firsts), Max);
}

}  // namespace attention_kernel
}  // namespace m3attn
