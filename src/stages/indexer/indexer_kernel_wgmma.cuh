// Decode units scored by native FP8 wgmma (IndexerCudaOptions::wgmma_decode, sm_90a), session 18.
//
// Why: the mma.sync scorer (indexer_kernel_mma.cuh) converts every E4M3 key pair to f16
// (cvt.rn.f16x2.e4m3x2) in every warp and issues ~200 instructions per 16-key tile and warp; at
// 16 query rows (draft 3) its per-warp chain, not DRAM, sets the pace (session 17: the scorer alone
// ends at 20.6 us at 64 x 8K draft 3 vs 18.3 us for a paged read of the same bytes). Here the
// tensor cores read the E4M3 bytes themselves: one warpgroup (the CTA's 4 warps) computes, per
// index-K page (one block: 128 keys x 128 dims, 16 KB), D[query row][key] = Q K^T with
// wgmma.m64n64k32.f32.e4m3.e4m3: A = the unit's query rows (M = 64; rows >= the unit's rows are
// zero), B = 64 keys of the page (N = 64, K-major: a key row is 128 contiguous bytes), 4 k32 steps
// per page half, 8 instructions per page. The block max of a query row is a max over the N
// dimension: inside the thread (16 columns per half) and over the 4 lanes of a quad (2
// shuffles); only warps holding real rows (warp 0 up to 16 rows, warps 0-1 up to 32) do it. No
// conversions, no per-tile address math: per page and thread 8 cp.async of 16 bytes, one CTA
// barrier, 8 wgmma, ~80 max / select instructions in warp 0.
//
// Shared memory (dynamic, rounded up to a 1024-byte boundary at run time: the 128-byte swizzle is
// an address-bit pattern): [A: 64 rows x 128 B = 8 KB][ring: kWgStages pages x 16 KB][table:
// kDecRows x kFusedMaxChunk f32 = 8 KB]. Both operands use the canonical K-major layout with the
// 128-byte swizzle: row r at r * 128, its 16-byte chunk c at chunk c ^ (r & 7), 8-row groups 1024
// bytes apart (SBO); the k32 step s starts 32 s bytes into the rows (the hardware applies the XOR
// to the address). The copies write that layout directly (cp.async, chunk c of row r to
// c ^ (r & 7)); a page outside the pool zero-fills and scores NaN.
//
// Ring: page i of the CTA's chunk in stage i % kWgStages; kWgStages - 1 pages in flight. Per page:
// wait for its copies (own cp.async groups), fence.proxy.async (the generic-proxy writes become
// visible to the tensor cores' async proxy), CTA barrier (every thread's copies; every warp is done
// with the stage refilled next, whose wgmma it waited for), issue page i + kWgStages - 1 into the
// stage of page i - 1, then the 8 wgmma in two commit groups (page halves), wait for the first,
// fold it while the second runs, wait, fold, write the row maxima to the block-max table.
//
// Numerics: products of E4M3 values are exact; the FP8 tensor cores add each k32 step's 32
// products to the accumulator with reduced precision (about 13-14 bits kept after aligning to the
// largest addend), so a score differs from the exact dot product by more than fp32 rounding: at
// most 4 steps x 2^-12 x L1 = 2^-10 x L1 (L1 = sum_d |q_d| max_p |k_p,d|), the bound the GPU
// tests use for this path (they print the largest observed error / L1). Integer-valued inputs of
// the benchmark and tests (|v| <= 3 or small integers: every partial sum < 2^13) are exact. NaN
// inputs propagate to NaN scores.
//
// The rest is the fused decode path's (indexer_kernel_mma.cuh): the block-max table, the single
// pass and its clusters (fused_local_select), the workspace burst of the fused two-kernel path.
#pragma once

#include <climits>

#include "stages/indexer/indexer_kernel_common.cuh"
#include "stages/indexer/indexer_kernel_fused.cuh"
#include "stages/indexer/indexer_kernel_mma.cuh"

namespace m3attn::indexer_kernel {

constexpr int kWgStages = 5;               // page ring: 4 pages (64 KB) in flight per CTA
constexpr int kWgAOff = 0;                 // A tile: 64 query rows x 128 bytes
constexpr int kWgABytes = 64 * kRowBytes;  // 8 KB
constexpr int kWgRingOff = kWgAOff + kWgABytes;
constexpr int kWgTableOff = kWgRingOff + kWgStages * kPageBytes;
constexpr int kWgAlign = 1024;  // the 128-byte swizzle pattern repeats every 1024 bytes
// Dynamic shared memory of the wgmma scorers: the layout above plus the alignment slack (97 KB:
// two CTAs per SM).
constexpr int kWgSmemBytes = kWgTableOff + kDecRows * kFusedMaxChunk * 4 + kWgAlign;
static_assert(kDecRows <= 64, "the A tile holds every query row of a unit");
static_assert(kWgStages * kPageBytes >= kPreStages * kPageBytes, "overflow ring fits");

// Shared-memory matrix descriptor of a K-major operand with the 128-byte swizzle: start address
// (16-byte units), LBO 1 (unused for swizzled K-major), SBO 1024 bytes (8-row groups), layout
// type 1 (128B swizzle). The base of the 8-row pattern must be 1024-byte aligned.
__device__ __forceinline__ uint64_t wg_desc(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFFu) >> 4) | (uint64_t{1} << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (uint64_t{1} << 62);
}

__device__ __forceinline__ void wg_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wg_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Makes this thread's completed generic-proxy writes to shared memory (st.shared, cp.async)
// visible to the async proxy (wgmma operand reads) after the following barrier.
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// d = (acc ? d : 0) + A B, m64n64k32, E4M3 x E4M3 -> f32, both operands from shared memory.
__device__ __forceinline__ void wg_mma_n64(float (&d)[32], uint64_t a, uint64_t b, int acc) {
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
      : "l"(a), "l"(b), "r"(acc));
}

// The 4 k32 steps of one page half (64 keys) into d: A rows from a_addr, keys from b_addr.
__device__ __forceinline__ void wg_half(float (&d)[32], uint32_t a_addr, uint32_t b_addr) {
#pragma unroll
  for (int k = 0; k < kRowBytes / 32; ++k)
    wg_mma_n64(d, wg_desc(a_addr + 32 * k), wg_desc(b_addr + 32 * k), k);
}

// Keeps the accumulators live across the asynchronous wgmma (the compiler must not move their
// reads before the wait).
__device__ __forceinline__ void wg_keep(float (&d)[32]) {
#pragma unroll
  for (int i = 0; i < 32; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Page i of the chunk (block b) into stage `stage` (shared address): the 1024 16-byte chunks of
// the page, 8 per thread (chunk tid + 128 j = row (tid >> 3) + 16 j, column tid & 7, whose
// swizzled place is the same for every j but for the 2048 j offset), zero-fill where the page is
// outside the pool. Committed by the caller.
__device__ __forceinline__ void wg_issue_page(const KernelArgs& a, uint32_t stage, int64_t page) {
  const int tid = static_cast<int>(threadIdx.x);
  const int row = tid >> 3, col = tid & 7;
  const uint32_t dst = stage + row * kRowBytes + ((col ^ (row & 7)) << 4);
  const uint8_t* src = (page >= 0 ? page_base(a, page) : a.cache) + tid * 16;
  const uint32_t bytes = page >= 0 ? 16u : 0u;
  asm volatile(
      "cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
      "cp.async.cg.shared.global [%0+2048], [%1+2048], 16, %2;\n"
      "cp.async.cg.shared.global [%0+4096], [%1+4096], 16, %2;\n"
      "cp.async.cg.shared.global [%0+6144], [%1+6144], 16, %2;\n"
      "cp.async.cg.shared.global [%0+8192], [%1+8192], 16, %2;\n"
      "cp.async.cg.shared.global [%0+10240], [%1+10240], 16, %2;\n"
      "cp.async.cg.shared.global [%0+12288], [%1+12288], 16, %2;\n"
      "cp.async.cg.shared.global [%0+14336], [%1+14336], 16, %2;\n" ::"r"(dst),
      "l"(src), "r"(bytes)
      : "memory");
}

// Folds one page half's accumulators into the running maxima of the thread's two rows (g and
// g + 8 of its warp's 16): d[4 j + e] = D[g][8 j + 2 tig + e], d[4 j + 2 + e] = D[g + 8][...].
// Keys past a row's position become -inf first (mask: the block reaches past the unit's smallest
// position).
__device__ __forceinline__ void wg_fold(const float (&d)[32], float& run0, float& run1, int key0,
                                        int pos0, int pos1, bool mask, int tig) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float v0 = d[4 * j + e], v1 = d[4 * j + 2 + e];
      if (mask) {
        const int key = key0 + 8 * j + 2 * tig + e;
        v0 = key <= pos0 ? v0 : neg_inf();
        v1 = key <= pos1 ? v1 : neg_inf();
      }
      run0 = block_max(run0, v0);
      run1 = block_max(run1, v1);
    }
  }
}

// A decode unit (or a split of one) by wgmma: blocks [b0, min(b1, bend)) of request r, the whole
// CTA. Barriers: every thread runs the same loop (everything that decides it is uniform).
template <bool kSingle, bool kCluster>
__device__ __forceinline__ void decode_path_wgmma(const KernelArgs& a, uint8_t* smem_raw) {
  timeline_mark(a, 0);
  if constexpr (kCluster) cluster_arrive_relaxed();
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g = lane >> 2, tig = lane & 3;
  // The 1024-byte aligned layout (the same offset in every CTA: the table's cluster address too).
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t pad = ((raw + kWgAlign - 1) & ~uint32_t{kWgAlign - 1}) - raw;
  uint8_t* smem = smem_raw + pad;
  const uint32_t s_a = raw + pad + kWgAOff;
  const uint32_t s_ring = raw + pad + kWgRingOff;
  float* sblk = reinterpret_cast<float*>(smem + kWgTableOff);

  const int r = static_cast<int>(blockIdx.x) - a.num_overflow;
  const int b0 =
      static_cast<int>(min(int64_t{blockIdx.y} * a.dec_chunk, static_cast<int64_t>(a.max_pages)));
  const int bend = static_cast<int>(min(int64_t{b0} + a.dec_chunk, int64_t{a.max_pages}));
  const int qa = load_query_start(a, r);
  const int qe = load_query_start(a, r + 1);
  const int seq_len = __ldg(a.seq_lens + r);
  const int n = max(min(qe - qa, a.dec_tokens), 0);  // <= 32 tokens
  const int p = lane < n ? __ldg(a.positions + qa + lane) : -1;
  // Early start (as decode_path): seq_lens bounds the blocks whose copies go out before the
  // positions arrive; with programmatic launch only blocks that end before the request's first
  // new position, whose rows no kernel of the step writes.
  int spec = min(blocks_to_score(a, seq_len - 1), bend);
  if (a.pdl) spec = min(spec, max(seq_len - max(qe - qa, 0), 0) / kPageSize);
  const int nspec = max(spec - b0, 0);
#pragma unroll
  for (int i = 0; i < kWgStages - 1; ++i) {
    if (i < nspec) wg_issue_page(a, s_ring + i * kPageBytes, guarded_page(a, r, b0 + i));
    cp_async_commit();  // possibly empty: uniform group counts
  }
  pdl_wait();  // programmatic launch: index_q, this step's index-K rows and writes after this
  const int rows = n * a.n_kv;  // <= kDecRows
  {
    // The A tile: query row m (token qa + m / n_kv, head m % n_kv) swizzled, zero rows >= rows.
    const uint8_t* iq0 = a.iq + int64_t{qa} * a.n_kv * kRowBytes;
#pragma unroll
    for (int j = 0; j < 64 * 8 / kMmaThreads; ++j) {
      const int c = tid + kMmaThreads * j;
      const int m = c >> 3, col = c & 7;
      const uint4 v =
          m < rows ? ld_query16(iq0 + m * kRowBytes + col * 16) : make_uint4(0, 0, 0, 0);
      *reinterpret_cast<uint4*>(smem + kWgAOff + m * kRowBytes + ((col ^ (m & 7)) << 4)) = v;
    }
  }
  int nvis = 0;  // the unit's blocks to score (all splits)
  if (n > 0) nvis = blocks_to_score(a, __reduce_max_sync(0xffffffffu, p));
  const int b1 = min(nvis, bend);
  const int npages = max(b1 - b0, 0);
  if (npages > nspec && nspec < kWgStages - 1) {
    // Pages the prologue did not issue (seq_lens below the positions, or programmatic launch):
    // issued now, and every copy waited for, so that the ring's group counting holds.
    for (int i = nspec; i < min(npages, kWgStages - 1); ++i)
      wg_issue_page(a, s_ring + i * kPageBytes, guarded_page(a, r, b0 + i));
    cp_async_commit();
    cp_async_wait<0>();
  }
  // Row positions of the thread's rows (warp w: rows 16 w + g, 16 w + g + 8) and the unit's
  // smallest position (the mask bound).
  const int m0 = 16 * warp + g, m1 = m0 + 8;
  const int q0 = __shfl_sync(0xffffffffu, p, min(m0 / a.n_kv, 31));
  const int q1 = __shfl_sync(0xffffffffu, p, min(m1 / a.n_kv, 31));
  const int pos0 = m0 < rows ? q0 : -1, pos1 = m1 < rows ? q1 : -1;
  const int min_pos = __reduce_min_sync(0xffffffffu, lane < n ? p : INT_MAX);
  const bool has_rows = 16 * warp < rows;  // warp-uniform
  timeline_mark(a, 1);

  float* table = sblk;
  int tb0 = b0;
  if constexpr (kCluster) {
    cluster_wait_acquire();  // every CTA of the cluster runs: rank 0's table may be written
    table = map_to_cluster_rank(sblk, 0);
    tb0 = 0;
  }
  for (int i = 0; i < npages; ++i) {
    cp_async_wait<kWgStages - 2>();
    fence_proxy_async_smem();
    __syncthreads();  // page i in place (every thread's copies); stage (i - 1) % S is free
    {
      const int in = i + kWgStages - 1;
      if (in < npages)
        wg_issue_page(a, s_ring + (in % kWgStages) * kPageBytes, guarded_page(a, r, b0 + in));
      cp_async_commit();
    }
    const int b = b0 + i;
    const uint32_t s_page = s_ring + (i % kWgStages) * kPageBytes;
    float d0[32], d1[32];
    wg_fence();
    wg_half(d0, s_a, s_page);
    wg_commit();
    wg_half(d1, s_a, s_page + 64 * kRowBytes);
    wg_commit();
    if (has_rows) {
      const bool mask = b * kPageSize + kPageSize - 1 > min_pos;
      float run0 = neg_inf(), run1 = neg_inf();
      wg_wait<1>();
      wg_keep(d0);
      wg_fold(d0, run0, run1, b * kPageSize, pos0, pos1, mask, tig);
      wg_wait<0>();
      wg_keep(d1);
      wg_fold(d1, run0, run1, b * kPageSize + 64, pos0, pos1, mask, tig);
      run0 = warp_block_max_xor(run0, 1);
      run0 = warp_block_max_xor(run0, 2);
      run1 = warp_block_max_xor(run1, 1);
      run1 = warp_block_max_xor(run1, 2);
      const bool page_ok = guarded_page(a, r, b) >= 0;
      if (tig == 0 && m0 < rows)
        table[m0 * kFusedMaxChunk + (b - tb0)] = page_ok ? run0 : quiet_nan();
      if (tig == 0 && m1 < rows)
        table[m1 * kFusedMaxChunk + (b - tb0)] = page_ok ? run1 : quiet_nan();
    } else {
      wg_wait<0>();
      wg_keep(d0);
      wg_keep(d1);
    }
  }
  cp_async_wait<0>();  // copies past b1 (a prologue the positions did not need)
  timeline_mark(a, 2);
  if constexpr (kCluster) {
    cluster_arrive_release();
    cluster_wait_acquire();  // every block max of [0, nvis) is in rank 0's table
    timeline_mark(a, 3);
    if (blockIdx.y == 0) fused_local_select(a, sblk, qa, rows, 0, nvis, p);
    timeline_mark(a, 4);
    return;
  }
  __syncthreads();  // every block max of [b0, b1) is in sblk
  timeline_mark(a, 3);
  if constexpr (kSingle) {
    if (npages > 0)
      fused_local_select(a, sblk, qa, rows, b0, b1, p);
    else
      fused_local_select(a, nullptr, qa, rows, b0, b1, p);  // every row trivial
  } else {
    const int ncol = npages;
    for (int i = tid; i < rows * ncol; i += kMmaThreads) {
      const int j = i / ncol, c = i - j * ncol;
      a.scores[(int64_t{qa} * a.n_kv + j) * a.max_pages + b0 + c] = sblk[j * kFusedMaxChunk + c];
    }
  }
  timeline_mark(a, 4);
}

template <bool kSingle, bool kCluster>
__device__ __forceinline__ void score_wgmma_body(const KernelArgs& a, uint8_t* smem,
                                                 OverflowShared& sh) {
  pdl_launch_dependents();
  if (static_cast<int>(blockIdx.x) >= a.num_overflow) {
    decode_path_wgmma<kSingle, kCluster>(a, smem);
    return;
  }
  pdl_wait();
  for_each_segment(a, [&](int r, int sa, int se) { overflow_segment(a, smem, sh, r, sa, se); });
  if constexpr (kSingle) {
    if constexpr (kCluster) {
      __threadfence();
      cluster_arrive_release();
      cluster_wait_acquire();
    } else {
      __syncthreads();
    }
    finish_overflow_rows(a);
  }
}

// Fused decode by wgmma: block maxima to the workspace at the CTA's end, then the selection kernel.
// Dynamic shared memory: kWgSmemBytes.
__global__ void __launch_bounds__(kMmaThreads) score_wgmma_fused_kernel(const KernelArgs a) {
  extern __shared__ __align__(kSmemAlign) uint8_t smem[];
  __shared__ OverflowShared sh;
  score_wgmma_body<false, false>(a, smem, sh);
}

// Single pass by wgmma (grid.y == 1): decode units write their rows of block_ids.
__global__ void __launch_bounds__(kMmaThreads) score_wgmma_single_kernel(const KernelArgs a) {
  extern __shared__ __align__(kSmemAlign) uint8_t smem[];
  __shared__ OverflowShared sh;
  score_wgmma_body<true, false>(a, smem, sh);
}

// Clustered single pass by wgmma: clusters of (1, k_splits, 1) CTAs, rank 0 selects.
__global__ void __launch_bounds__(kMmaThreads) score_wgmma_cluster_kernel(const KernelArgs a) {
  extern __shared__ __align__(kSmemAlign) uint8_t smem[];
  __shared__ OverflowShared sh;
  score_wgmma_body<true, true>(a, smem, sh);
}

}  // namespace m3attn::indexer_kernel
