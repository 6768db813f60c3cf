// Decode units scored by native FP8 wgmma (IndexerCudaOptions::wgmma_decode, sm_90a), session 18.
//
// Why: the mma.sync scorer (indexer_kernel_mma.cuh) converts every E4M3 key pair to f16
// (cvt.rn.f16x2.e4m3x2) in every warp and issues ~200 instructions per 16-key tile and warp; at
// 16 query rows (draft 3) its per-warp chain, not DRAM, sets the pace (session 17: the scorer alone
// ends at 20.6 us at 64 x 8K draft 3 vs 18.3 us for a paged read of the same bytes). Here the
// tensor cores read the E4M3 bytes themselves: one warpgroup (the CTA's 4 warps) computes, per
// index-K page (one block: 128 keys x 128 dims, 16 KB), D[key][query row] = K Q^T with
// wgmma.m64nNk32.f32.e4m3.e4m3: A = 64 keys of the page (K-major: a key row is 128 contiguous
// bytes), B = the unit's query rows (N = 8 / 16 / 32: the unit's rows rounded up), 4 k32 steps
// per page half, 8 instructions per page. Warp w holds keys 16 w + g and 16 w + g + 8 of each half
// for every query row: the block max of a row is a max over the thread's 4 keys, then over the 8
// lanes with the same column (3 xor-shuffles), then over the 4 warps (a small shared buffer
// combined by warp 0 after the next page's barrier). No conversions, no per-tile address math:
// per page and thread 8 cp.async of 16 bytes, one CTA barrier, 8 wgmma, ~10 instructions per
// column held.
// (Round A, a first version with the roles swapped, A = 64 query rows (zero past the unit's), B
// = 64 keys: every score in warp 0, whose 64 values per thread per page were folded by one
// dependent max chain, while warps 1-3 waited: 64 x 8K draft 3 29.2 us back to back at the
// default splits vs 23.3 for the mma.sync scorer, the single pass in 1-4 CTAs per request 38.5-56.3
// us; and its query rows were loaded behind the prologue's copies, ready to score only at 5.3 us.)
//
// Shared memory (dynamic, rounded up to a 1024-byte boundary at run time: the 128-byte swizzle is
// an address-bit pattern): [Q: 32 rows x 128 B = 4 KB][ring: S pages x 16 KB][table:
// kDecRows x kFusedMaxChunk f32 = 8 KB][warp maxima: 2 x 4 warps x 32 rows f32 = 1 KB]. Both
// operands use the canonical K-major layout with the 128-byte swizzle: row r at r * 128, its
// 16-byte chunk c at chunk c ^ (r & 7), 8-row groups 1024 bytes apart (SBO); the k32 step s
// starts 32 s bytes into the rows (the hardware applies the XOR to the address). The copies write
// that layout directly (cp.async, chunk c of row r to c ^ (r & 7)); a page outside the pool
// zero-fills and scores NaN.
//
// Ring: page i of the CTA's chunk in stage i % S; S - 1 pages in flight (S: WgLayout). Per page:
// wait for its copies (own cp.async groups), fence.proxy.async (the generic-proxy writes become
// visible to the tensor cores' async proxy), CTA barrier (every thread's copies; every warp is done
// with the stage refilled next, whose wgmma it waited for; the previous page's warp maxima are
// written), warp 0 combines the previous page's warp maxima into the block-max table, the page
// i + S - 1 is issued into the stage of page i - 1, then the 8 wgmma, wait, fold.
//
// Numerics: products of E4M3 values are exact; the FP8 tensor cores add each k32 step's 32
// products to the accumulator with reduced precision (about 13-14 bits kept after aligning to the
// largest addend), so a score differs from the exact dot product by more than fp32 rounding: at
// most 4 steps x 2^-12 x L1 = 2^-10 x L1 (L1 = sum_d |q_d| max_p |k_p,d|), the bound the GPU
// tests use for this path (they print the largest observed error / L1: 3.2e-5 - 5.3e-5, about
// 2^-14.2, in round A). Integer-valued inputs of the benchmark and tests (every partial sum below
// 2^11) are exact. NaN inputs propagate to NaN scores.
//
// The rest is the fused decode path's (indexer_kernel_mma.cuh): the block-max table, the single
// pass and its clusters (fused_local_select), the workspace burst of the fused two-kernel path.
#pragma once

#include <climits>

#include "stages/indexer/indexer_kernel_common.cuh"
#include "stages/indexer/indexer_kernel_fused.cuh"
#include "stages/indexer/indexer_kernel_mma.cuh"

namespace m3attn::indexer_kernel {

// Page ring: 4 pages (64 KB) in flight per CTA; 94 KB of shared memory, two CTAs per SM. (Round
// D: 9 pages in flight with one CTA per SM did not speed the stream: 64 x 8K draft 0 as 2-CTA
// clusters 24.7-25.1 us back to back vs 21.8-21.9 with 4; the per-page chain, not the bytes in
// flight, set the pace.)
constexpr int kWgStages = 5;
constexpr int kWgAlign = 1024;  // the 128-byte swizzle pattern repeats every 1024 bytes
// Dynamic shared memory layout of a wgmma scorer with S ring stages (offsets from the 1024-byte
// aligned base).
template <int S>
struct WgLayout {
  static constexpr int kQOff = 0;  // B tile: kDecRows query rows x 128 bytes (4 KB)
  static constexpr int kRingOff = kQOff + kDecRows * kRowBytes;
  static constexpr int kTableOff = kRingOff + S * kPageBytes;
  static constexpr int kPartOff = kTableOff + kDecRows * kFusedMaxChunk * 4;
  // [page parity][warp][row] f32 warp maxima
  static constexpr int kPgOff = kPartOff + 2 * kMmaWarps * kDecRows * 4;
  // the chunk's guarded pages, int32 [kFusedMaxChunk]; then the alignment slack
  static constexpr int kSmemBytes = kPgOff + kFusedMaxChunk * 4 + kWgAlign;
  static_assert(S * kPageBytes >= kPreStages * kPageBytes, "overflow ring fits");
};
static_assert(kDecRows % 8 == 0 && kDecRows <= 32, "B tile: whole 8-row groups, N <= 32");
// Dynamic shared memory of the wgmma scorers.
constexpr int kWgSmemBytes = WgLayout<kWgStages>::kSmemBytes;

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

// d = (acc ? d : 0) + A B, m64nNk32 (N = 8 / 16 / 32), E4M3 x E4M3 -> f32, both operands from
// shared memory.
template <int N>
struct WgMma;
template <>
struct WgMma<8> {
  __device__ __forceinline__ static void mma(float (&d)[4], uint64_t a, uint64_t b, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, %4, %5, p, 1, "
        "1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "l"(a), "l"(b), "r"(acc));
  }
};
template <>
struct WgMma<16> {
  __device__ __forceinline__ static void mma(float (&d)[8], uint64_t a, uint64_t b, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7}, "
        "%8, %9, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7])
        : "l"(a), "l"(b), "r"(acc));
  }
};
template <>
struct WgMma<32> {
  __device__ __forceinline__ static void mma(float (&d)[16], uint64_t a, uint64_t b, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, "
        "%9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15])
        : "l"(a), "l"(b), "r"(acc));
  }
};

// Keeps the accumulators live across the asynchronous wgmma (their reads stay after the wait).
template <int R>
__device__ __forceinline__ void wg_keep(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Page i of the chunk into stage `stage` (shared address): the 1024 16-byte chunks of the page, 8
// per thread (chunk tid + 128 j = row (tid >> 3) + 16 j, column tid & 7, whose swizzled place is
// the same for every j but for the 2048 j offset), zero-fill where the page is outside the pool.
// Committed by the caller.
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

// The unit's query rows (kDecRows x 128 bytes, zero past `rows`) as loaded: thread tid holds
// 16-byte chunks tid and tid + 128 (row c >> 3, column c & 7).
struct WgQuery {
  uint4 v[kDecRows * 8 / kMmaThreads];
};
__device__ __forceinline__ void wg_load_query(const KernelArgs& a, int t0, int rows, WgQuery& q) {
  const uint8_t* iq0 = a.iq + int64_t{t0} * a.n_kv * kRowBytes;
#pragma unroll
  for (int j = 0; j < kDecRows * 8 / kMmaThreads; ++j) {
    const int c = static_cast<int>(threadIdx.x) + kMmaThreads * j;
    q.v[j] = (c >> 3) < rows ? ld_query16(iq0 + (c >> 3) * kRowBytes + (c & 7) * 16)
                             : make_uint4(0u, 0u, 0u, 0u);
  }
}
__device__ __forceinline__ void wg_store_query(uint8_t* qtile, const WgQuery& q) {
#pragma unroll
  for (int j = 0; j < kDecRows * 8 / kMmaThreads; ++j) {
    const int c = static_cast<int>(threadIdx.x) + kMmaThreads * j;
    const int m = c >> 3, col = c & 7;
    *reinterpret_cast<uint4*>(qtile + m * kRowBytes + ((col ^ (m & 7)) << 4)) = q.v[j];
  }
}

// The page loop of a decode unit (split) at N query columns (rows <= N): pages [0, npages) of
// blocks b0 + i; the block maxima go to table[row][b - tb0] (shared memory of this CTA or, in a
// cluster, of rank 0). The first min(npages, S - 1) pages were issued (one commit group
// per stage). Every thread runs every iteration (barriers).
template <int N, int S>
__device__ __forceinline__ void wg_pages(const KernelArgs& a, int r, int b0, int npages, int rows,
                                         int lane_pos, uint32_t s_q, uint32_t s_ring, float* part,
                                         const int* spg, float* table, int tb0) {
  constexpr int kR = N / 2;  // accumulators per half page: N / 8 column groups x 4
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, tig = lane & 3;
  // Positions of the thread's columns 8 j + 2 tig + e (-1 past the rows), the unit's smallest.
  int cpos[N / 8][2];
  int min_pos = INT_MAX;
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int c = 8 * j + 2 * tig + e;
      const int pos = __shfl_sync(0xffffffffu, lane_pos, c / a.n_kv);  // c / n_kv < 32
      cpos[j][e] = c < rows ? pos : -1;
      if (c < rows) min_pos = min(min_pos, pos);
    }
  }
  min_pos = __reduce_min_sync(0xffffffffu, min_pos);
  const int key_w = 16 * warp + g;  // the thread's first key in a page half
  // Warp 0, lanes < rows: the previous page's warp maxima into the table.
  const auto combine = [&](int i) {
    if (tid < rows) {
      const float* pp = part + (i & 1) * kMmaWarps * kDecRows;
      float v = pp[tid];
#pragma unroll
      for (int w = 1; w < kMmaWarps; ++w) v = block_max(v, pp[w * kDecRows + tid]);
      table[tid * kFusedMaxChunk + (b0 + i - tb0)] = spg[i] >= 0 ? v : quiet_nan();
    }
  };
  // The 8 wgmma of page i into acc (asynchronous: one commit group).
  struct Acc {
    float d0[kR], d1[kR];  // page halves: keys 0-63, 64-127
  };
  const auto mma_page = [&](Acc& acc, int i) {
    const uint32_t s_page = s_ring + (i % S) * kPageBytes;
    wg_fence();
#pragma unroll
    for (int k = 0; k < kRowBytes / 32; ++k)
      WgMma<N>::mma(acc.d0, wg_desc(s_page + 32 * k), wg_desc(s_q + 32 * k), k);
#pragma unroll
    for (int k = 0; k < kRowBytes / 32; ++k)
      WgMma<N>::mma(acc.d1, wg_desc(s_page + 64 * kRowBytes + 32 * k), wg_desc(s_q + 32 * k), k);
    wg_commit();
    wg_keep(acc.d0);
    wg_keep(acc.d1);
  };
  // Page i's block maxima per column (waited for) into this warp's slot of part[i & 1]:
  // d[4 j + e] = D[key g][col 8 j + 2 tig + e], d[4 j + 2 + e] = D[key g + 8][...].
  const auto fold = [&](Acc& acc, int i) {
    wg_keep(acc.d0);
    wg_keep(acc.d1);
    const int b = b0 + i;
    const bool mask = b * kPageSize + kPageSize - 1 > min_pos;  // uniform
    const int key0 = b * kPageSize + key_w;
    float* pw = part + (i & 1) * kMmaWarps * kDecRows + warp * kDecRows;
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float v00 = acc.d0[4 * j + e], v01 = acc.d0[4 * j + 2 + e];
        float v10 = acc.d1[4 * j + e], v11 = acc.d1[4 * j + 2 + e];
        if (mask) {
          const int pos = cpos[j][e];
          v00 = key0 <= pos ? v00 : neg_inf();
          v01 = key0 + 8 <= pos ? v01 : neg_inf();
          v10 = key0 + 64 <= pos ? v10 : neg_inf();
          v11 = key0 + 72 <= pos ? v11 : neg_inf();
        }
        float v = block_max(block_max(v00, v01), block_max(v10, v11));
        v = warp_block_max_xor(v, 4);
        v = warp_block_max_xor(v, 8);
        v = warp_block_max_xor(v, 16);
        if (g == 0) pw[8 * j + 2 * tig + e] = v;
      }
    }
  };
  // Software pipelined by one page: step i issues page i + 1's wgmma (into the other accumulator
  // set) before it folds page i, so the tensor cores' latency hides under the fold, the combine
  // and the copies (round C: per page ~0.5 us of one CTA's chain when every step waited for its
  // own wgmma). Copy groups: the prologue committed S - 1 (pages 0 .. S - 2), step i commits page
  // i + S - 1, so page p is group p and "page i + 1 landed" is at most S - 3 groups pending.
  const auto step = [&](int i, Acc& cur, Acc& nxt) {
    const bool more = i + 1 < npages;  // uniform
    if (more) cp_async_wait<S - 3>();  // page i + 1 (this thread's copies)
    fence_proxy_async_smem();
    // Page i + 1 in place (every thread's copies); page i - 1's warp maxima written; the stage of
    // page i - 1 free (its wgmma was waited for before its fold).
    __syncthreads();
    if (i > 0) combine(i - 1);
    {
      const int in = i + S - 1;
      if (in < npages) wg_issue_page(a, s_ring + (in % S) * kPageBytes, spg[in]);
      cp_async_commit();
    }
    if (more) {
      mma_page(nxt, i + 1);
      wg_wait<1>();  // page i's group
    } else {
      wg_wait<0>();
    }
    fold(cur, i);
  };
  Acc acc_a, acc_b;
  if (npages > 0) {
    cp_async_wait<S - 2>();  // page 0
    fence_proxy_async_smem();
    __syncthreads();  // page 0, the query tile and spg in place
    mma_page(acc_a, 0);
  }
  for (int i = 0; i < npages; i += 2) {  // unrolled by 2: the accumulator sets stay in registers
    step(i, acc_a, acc_b);
    if (i + 1 < npages) step(i + 1, acc_b, acc_a);
  }
  __syncthreads();  // the last page's warp maxima
  if (npages > 0) combine(npages - 1);
}

// A decode unit (or a split of one) by wgmma: blocks [b0, min(b1, bend)) of request r, the whole
// CTA. Barriers: every thread runs the same code (everything that decides it is uniform).
template <bool kSingle, bool kCluster, int S>
__device__ __forceinline__ void decode_path_wgmma(const KernelArgs& a, uint8_t* smem_raw) {
  timeline_mark(a, 0);
  if constexpr (kCluster) cluster_arrive_relaxed();
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  // The 1024-byte aligned layout (the same offset in every CTA: the table's cluster address too).
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t pad = ((raw + kWgAlign - 1) & ~uint32_t{kWgAlign - 1}) - raw;
  uint8_t* smem = smem_raw + pad;
  using L = WgLayout<S>;
  const uint32_t s_q = raw + pad + L::kQOff;
  const uint32_t s_ring = raw + pad + L::kRingOff;
  float* sblk = reinterpret_cast<float*>(smem + L::kTableOff);
  float* part = reinterpret_cast<float*>(smem + L::kPartOff);

  const int r = static_cast<int>(blockIdx.x) - a.num_overflow;
  const int b0 =
      static_cast<int>(min(int64_t{blockIdx.y} * a.dec_chunk, static_cast<int64_t>(a.max_pages)));
  const int bend = static_cast<int>(min(int64_t{b0} + a.dec_chunk, int64_t{a.max_pages}));
  // The positions and (without programmatic launch) the query rows go out first, at the guessed
  // bounds of an equal-length batch (request r's tokens [r T / R, (r + 1) T / R), as decode_path's
  // guess), beside query_start, the page-table entries and seq_lens, so that they neither wait
  // for query_start nor queue behind the prologue's copies (round A: ready to score at 5.3 us
  // after the copies; round B, loaded once query_start arrived: 3.7-4.8 us, ncu's largest stall
  // the positions); reloaded at the real bounds when the guess was wrong (same result).
  const int ga = static_cast<int>(int64_t{r} * a.num_tokens / a.num_requests);
  const int gn =
      min(static_cast<int>(int64_t{r + 1} * a.num_tokens / a.num_requests) - ga, a.dec_tokens);
  int p = lane < gn ? __ldg(a.positions + ga + lane) : -1;
  WgQuery q;
  if (!a.pdl) wg_load_query(a, ga, gn * a.n_kv, q);
  const int qa = load_query_start(a, r);
  const int qe = load_query_start(a, r + 1);
  const int seq_len = __ldg(a.seq_lens + r);
  // The chunk's pages (bend - b0 <= kFusedMaxChunk: the plan's chunks) for the ring's copies and
  // the NaN of pages outside the pool (ncu, round B: ~6 % of the stall samples on the entry
  // loaded right before its page's copies); read after the page loop's first barrier.
  int* spg = reinterpret_cast<int*>(smem + L::kPgOff);
  if (tid < bend - b0) spg[tid] = static_cast<int>(guarded_page(a, r, b0 + tid));
  const int n = max(min(qe - qa, a.dec_tokens), 0);  // <= 32 tokens
  const int rows = n * a.n_kv;                       // <= kDecRows
  if (qa != ga || n != gn) {                         // uniform: the guess was wrong
    p = lane < n ? __ldg(a.positions + qa + lane) : -1;
    if (!a.pdl) wg_load_query(a, qa, rows, q);
  }
  // Early start (as decode_path): seq_lens bounds the blocks whose copies go out before the
  // positions are reduced; with programmatic launch only blocks that end before the request's
  // first new position, whose rows no kernel of the step writes.
  int spec = min(blocks_to_score(a, seq_len - 1), bend);
  if (a.pdl) spec = min(spec, max(seq_len - max(qe - qa, 0), 0) / kPageSize);
  const int nspec = max(spec - b0, 0);
#pragma unroll
  for (int i = 0; i < S - 1; ++i) {
    if (i < nspec) wg_issue_page(a, s_ring + i * kPageBytes, guarded_page(a, r, b0 + i));
    cp_async_commit();  // possibly empty: uniform group counts
  }
  pdl_wait();  // programmatic launch: index_q, this step's index-K rows and writes after this
  if (a.pdl) wg_load_query(a, qa, rows, q);
  wg_store_query(smem + L::kQOff, q);  // made visible to the wgmma by the loop's fence + barrier
  int nvis = 0;                        // the unit's blocks to score (all splits)
  if (n > 0) nvis = blocks_to_score(a, __reduce_max_sync(0xffffffffu, p));
  const int b1 = min(nvis, bend);
  const int npages = max(b1 - b0, 0);
  if (npages > nspec && nspec < S - 1) {
    // Pages the prologue did not issue (seq_lens below the positions, or programmatic launch):
    // issued now, and every copy waited for, so that the ring's group counting holds.
    for (int i = nspec; i < min(npages, S - 1); ++i)
      wg_issue_page(a, s_ring + i * kPageBytes, guarded_page(a, r, b0 + i));
    cp_async_commit();
    cp_async_wait<0>();
  }
  timeline_mark(a, 1);

  float* table = sblk;
  int tb0 = b0;
  if constexpr (kCluster) {
    cluster_wait_acquire();  // every CTA of the cluster runs: rank 0's table may be written
    table = map_to_cluster_rank(sblk, 0);
    tb0 = 0;
  }
  if (rows <= 8)
    wg_pages<8, S>(a, r, b0, npages, rows, p, s_q, s_ring, part, spg, table, tb0);
  else if (rows <= 16)
    wg_pages<16, S>(a, r, b0, npages, rows, p, s_q, s_ring, part, spg, table, tb0);
  else
    wg_pages<32, S>(a, r, b0, npages, rows, p, s_q, s_ring, part, spg, table, tb0);
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
    fused_local_select(a, npages > 0 ? sblk : nullptr, qa, rows, b0, b1, p);
  } else {
    for (int i = tid; i < rows * npages; i += kMmaThreads) {
      const int j = i / npages, c = i - j * npages;
      a.scores[(int64_t{qa} * a.n_kv + j) * a.max_pages + b0 + c] = sblk[j * kFusedMaxChunk + c];
    }
  }
  timeline_mark(a, 4);
}

template <bool kSingle, bool kCluster, int S>
__device__ __forceinline__ void score_wgmma_body(const KernelArgs& a, uint8_t* smem,
                                                 OverflowShared& sh) {
  pdl_launch_dependents();
  if (static_cast<int>(blockIdx.x) >= a.num_overflow) {
    decode_path_wgmma<kSingle, kCluster, S>(a, smem);
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
  score_wgmma_body<false, false, kWgStages>(a, smem, sh);
}

// Single pass by wgmma (grid.y == 1): decode units write their rows of block_ids.
__global__ void __launch_bounds__(kMmaThreads) score_wgmma_single_kernel(const KernelArgs a) {
  extern __shared__ __align__(kSmemAlign) uint8_t smem[];
  __shared__ OverflowShared sh;
  score_wgmma_body<true, false, kWgStages>(a, smem, sh);
}

// Clustered single pass by wgmma: clusters of (1, k_splits, 1) CTAs, rank 0 selects.
__global__ void __launch_bounds__(kMmaThreads) score_wgmma_cluster_kernel(const KernelArgs a) {
  extern __shared__ __align__(kSmemAlign) uint8_t smem[];
  __shared__ OverflowShared sh;
  score_wgmma_body<true, true, kWgStages>(a, smem, sh);
}

}  // namespace m3attn::indexer_kernel
