// The tensor-core indexer scorer (sm_90a).
//
// Why f16 MMAs: mma.sync.m16n8k32 with E4M3 operands is an Ada (sm_89) instruction; on Hopper ptxas
// emulates it by converting to f16 and issuing HMMAs (NVIDIA/cutlass#1986), hoisting converted
// copies of loop-invariant operands (255 registers and spills in a first version). So the kernel
// does the conversion itself, where it is cheapest: cvt.rn.f16x2.e4m3x2 turns two E4M3 bytes into
// two exact f16 values, then mma.sync.m16n8k16 (f16 x f16, fp32 accumulate). Products are exact;
// only the fp32 accumulation rounds, so scores sit within a few fp32 ulps (relative to
// sum |q_d k_d|) of the exact twin. Native FP8 on Hopper needs wgmma (smem operands, ~13-14-bit
// accumulation). Session 18 built and measured a wgmma decode scorer (commits 5bfd6af-e4a8210,
// indexer_kernel_wgmma.cuh, deleted: never faster). One warpgroup per CTA; per 16 KB page 8
// wgmma.m64nNk32 e4m3: A = 64 keys of the page, B = the unit's query rows (N = 8 / 16 / 32),
// both K-major with the 128-byte swizzle written by cp.async; a 5-page ring, one CTA barrier per
// page, each warp folds its 16 keys per column (3 xor-shuffles), and warp 0 combines the 4 warps.
// - Scores: max |gpu - twin| / L1 3.2e-5 - 5.3e-5 on random inputs (about 2^-14.2; the f16 path's
//   bound is 2^-15), exact on integer inputs, NaN propagated; every test passed, racecheck clean.
// - Time, 64 x 8K, back to back, round C (this scorer in the same runs: 23.3 us at draft 3, 21.3
//   at draft 0): draft 3 at the default splits (k3 c24) 24.6-24.7 us, k4 c16 24.4-24.6, k2 c32
//   27.6, single pass in 2-CTA clusters 30.8; draft 0 in 2-CTA clusters 21.8-21.9, k2 c32 21.6.
// - Timeline (64 x 8K draft 3, k3 c24): CTA last scored p50 18.1, max 20.8 us, as this scorer's
//   17.9 / 20.2-20.6: with ~8 instructions per page instead of ~1600, the split's stream ended no
//   earlier. ncu: the largest stalls were the ring's cp.async wait and the page barrier.
// - Not the fix (same-run base in brackets): a 9-page ring (one CTA per SM) 24.7-25.1 us at draft
//   0 (21.5); issuing page i + 1's wgmma before folding page i 25.6 at draft 0 (21.5) and 26.1 at
//   draft 3 (23.5); the first version (A = 64 query rows, warp 0 folding every score) 29.2 at
//   draft 3 (23.3).
// So at 64 x 8K the instruction count is not what sets this scorer's end.
//
// Decode units (a generation request: <= 32 query rows = tokens x heads, e.g. 8 tokens x 4 heads)
// are the hot path: 128 bytes of index-K per context token, read once for all of the request's
// query rows. Each warp owns whole key blocks (pages) of the CTA's chunk and streams them as
// 16-key tiles (2 KB, contiguous in a page) through its own 8-stage cp.async ring in shared memory
// (16-byte copies, 512 contiguous bytes per warp instruction; up to 14 KB in flight per warp, so
// 3 CTAs x 4 warps keep ~168 KB per SM in flight: Little's law at 4.3 TB/s / 132 SMs covers a
// loaded latency of ~5 us; the former 4-stage ring kept 72 KB, ~2 us, about the loaded DRAM
// latency near saturation).
// Ring depth at one CTA per SM (flat decode, 64 x 8K; session 20 rounds B / D, same-round A/Bs,
// back-to-back us, draft 0 / draft 3, the 8-stage ring 21.6-21.7 / 23.2-23.3): rings of 16 tiles
// per warp (30 KB in flight, 120 KB per SM) 24.6-24.9 / 27.2-27.8; of 4 tiles (6 KB) 22.7 /
// 23.9-24.0; 8 warps per SM with 4-tile rings (the bytes in flight of 4 warps with 8) 21.2-21.4
// / 23.2-23.4. Neither more nor fewer bytes in flight per SM, nor more warps at equal bytes, is
// faster (timeline, draft 3: with 16 tiles the warps' last blocks landed 1.1 us later at the
// median, 2.6 us at the last).
// A = 16 keys (converted per tile), B = the request's query rows (n-tiles of 8 rows, 1..4 of
// them, converted once and kept in registers), C = scores [key][row]; the block max stays in
// registers and 3 xor-shuffles finish it at the end of a block. No CTA barrier on this path.
//
// Fused decode (score_fused_kernel, the default above 16K): the flush of a block writes the row
// maxima into a shared table [32 rows][64 blocks] instead of global memory; after one CTA barrier
// the CTA writes the table's rows to the workspace scores in one coalesced burst (row j: the
// split's blocks contiguous) and select_kernel finishes the rows. Splits hold at most 64 blocks
// (1 MB of index-K), so the table costs 8 KB and 3 CTAs still fit per SM (72 KB each). (Until
// session 16 each CTA selected its split's 15 best blocks per row into candidate lists that a
// merge kernel merged: round B, same run, 64 x 32K draft 3 80.7 vs 77.4 us with the tables out,
// 256 x 128K draft 3 1013.5 vs 985.1; round A timeline / ncu: that selection took 4.8 us p50
// after a CTA's last tile, the merge kernel 6.1 us.)
// (A bulk-copy variant, lane 0 issuing one 2 KB cp.async.bulk per tile on a stage mbarrier, never
// beat the cp.async ring in sessions 11-12 and was removed in session 13.)
// Instructions per 16-key tile and warp (cp.async path): session 12 round A measured (ncu, single
// pass, 256 x 8K, draft 3 = 2 n-tiles) 200 per tile, of which only 32 F2FP, 16 HMMA, 4 LDGSTS and
// ~7 LDS are the work; the rest was address math (27 IMAD), shifts feeding the conversions (20
// SHF), per-tile bookkeeping and branches (~60 ISETP / IADD / BRA / BSSY / BSYNC) and a stall on
// each block's page-table entry. With 2-3 warps per scheduler the per-warp instruction stream, not
// DRAM, then bounds a CTA (5.2 cycles per issued instruction, DRAM 65 % busy). Since then: the 8
// tiles of a block are unrolled (stage == tile index in the page, so every shared and global
// offset of the copies is an immediate), both halves of a word convert without shifts, a page
// outside the pool zero-fills instead of branching, and the next pages' entries are loaded a
// block ahead and checked when used.
//
// Single pass (score_fused_single_kernel, IndexerCudaOptions::single_pass): the fused kernel with
// one split per unit (contexts of <= 64 blocks, 8K tokens): a decode unit's CTA holds every block
// max of its rows, so its local selection is the final one and it writes block_ids directly
// (ascending ids from the ranks by ballot prefix counts, then the local block, then -1); an
// overflow tile, after a CTA barrier, selects its non-decode rows from the block scores it wrote
// (finish_row). No second kernel, no second launch or dependency wait.
// Clustered single pass (score_fused_cluster_kernel, IndexerCudaOptions::single_pass_ctas): the
// unit's blocks are cut over a thread-block cluster of 2-8 CTAs (grid.y = cluster.y), each CTA
// writes its block maxima straight into the shared table of the cluster's first CTA (distributed
// shared memory; table column = block id), and after a cluster barrier that CTA selects as the
// single pass does. More CTAs per request without a second kernel: automatic at 0.25-0.75
// requests per SM (session 13 round A, 64 x 8K draft 0: 24.0 us with 2 CTAs per request vs 25.6
// for the two-kernel path and 26.1 for one CTA).
// Two accumulators: even and odd k16 steps of a decode tile accumulate separately (a dependent
// HMMA chain of 4 instead of 8 per tile and n-tile; see decode_compute_tile).
//
// Overflow tiles (prefill chunks, 128 query rows per CTA) reverse the roles: A = query rows (2
// m-tiles = 32 rows per warp, f16 in registers for the whole segment), B = 8 keys from a 3-stage
// ring of whole index pages in shared memory (cp.async, 16 KB per stage), so each page is read
// from global memory once per 128 query rows and converted by each of the 4 warps.
//
// K-dimension permutation: the dot product does not care about the order of the 128 dims as long
// as A and B agree. Lane (g = lane / 4, tig = lane % 4) reads bytes [16 tig, 16 tig + 16) and
// [64 + 16 tig, 80 + 16 tig) of its row: 8 words W0..W7 of 4 E4M3 values; k16-step s takes word Ws
// (bytes 0-1 -> the a0/a1/b0 register, bytes 2-3 -> a2/a3/b1). The same mapping serves keys and
// queries, so each MMA pairs a key byte with the query byte of the same dim.
// Shared-memory swizzle: 16-byte chunk c of row r is stored at chunk c ^ 4 (r & 1), so the 8 lanes
// of a quarter warp (rows g, g + 1, chunks tig) hit 8 different bank groups.
//
// Causal masking: key p of block b counts for a row at position pos iff p <= pos (partial local
// blocks of prefill tokens and of earlier draft tokens); masked scores become -inf before the
// NaN-propagating max, so garbage past the sequence never leaks. The mask is evaluated only for
// blocks that reach past the smallest row position of the unit.
//
// Bytes and bounds (decode): index-K pages (16 KB per 128 tokens, read once) + query rows (<= 4 KB
// per request) + 4 bytes per (row, block) of scores. Memory bound: 8K context x batch 256 is 268 MB
// = 62 us at 4.3 TB/s. Per 16-key tile a lane issues 4 LDS.128, 32 conversions and 8 x n-tiles
// HMMAs; at 4.3 TB/s that is ~45 % of the mma.sync f16 rate at 32 rows and about half of the
// conversion rate, so decode should stay memory bound (to be confirmed on the device).
#pragma once

#include <climits>
#include <type_traits>

#include "core/mbarrier.cuh"
#include "core/ptx.cuh"
#include "stages/indexer/indexer_kernel_common.cuh"
#include "stages/indexer/indexer_kernel_fused.cuh"

namespace m3attn::indexer_kernel {

constexpr int kTileBytes = 16 * kRowBytes;  // 16 keys: 2 KB, contiguous
constexpr int kDecStages = 8;  // per-warp tile ring: 7 tiles (14 KB) in flight per warp
constexpr int kPreStages = 3;  // overflow page ring
constexpr int kMaxI(int x, int y) { return x > y ? x : y; }
// 64 KB (+ 48 static bytes: the launcher opts in); 3 CTAs per SM (registers) use 192 KB.
constexpr int kMmaSmemBytes = kMaxI(kPreStages * kPageBytes, kMmaWarps* kDecStages* kTileBytes);
constexpr int kPreRowsPerWarp = 32;  // 2 m-tiles of query rows
static_assert(kMmaWarps * kDecStages * kTileBytes <= kMmaSmemBytes, "decode ring fits");
static_assert(kPreStages * kPageBytes <= kMmaSmemBytes, "overflow ring fits");
// The issue side runs kDecStages - 1 tiles ahead of the compute side; with at most 8 (one block
// of 16-key tiles) it is never two blocks ahead, which the page bookkeeping relies on.
static_assert(kDecStages - 1 <= kPageSize / 16, "issue at most one block ahead");
static_assert((kDecStages & (kDecStages - 1)) == 0, "ring index by mask");
static_assert(kMmaWarps * kPreRowsPerWarp == kPreRows, "overflow tile = 4 warps x 32 rows");
// Alignment of the dynamic shared memory (the tile rings). The dynamic array starts after the
// kernel's static shared variables (OverflowShared), at the
// declared alignment: with __align__(16) it sat at 48 bytes past a 128-byte boundary, and every
// 16-byte cp.async of a 128-byte index-K row then wrote two 128-byte shared-memory lines. ncu
// (session 11, round 1, every LDGSTS of the decode and overflow paths): 16 shared wavefronts per
// warp instruction instead of 4 and 32 L2 sectors requested instead of 16, i.e. every index-K
// byte requested from L2 twice (the 49 % L2 hit rate, L2 the busiest unit at 79-94 %). The
// attention kernel's identical LDGSTS pattern into an __align__(128) array: the ideal counts.
constexpr int kSmemAlign = 128;
// Fused decode: the shared block-max table [kDecRows][kFusedMaxChunk] f32 after the ring: 72 KB
// in all, 3 CTAs per SM.
constexpr int kFusedSmemBytes = kMmaSmemBytes + kDecRows * kFusedMaxChunk * 4;
// The clustered single pass: + the table's mbarrier (IndexerCudaOptions::cluster_async_maxima),
// right after the table.
constexpr int kClusterSmemBytes = kFusedSmemBytes + 16;

__device__ __forceinline__ uint4 ld_query16(const uint8_t* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}
__device__ __forceinline__ uint4 lds16(const uint8_t* p) {
  return *reinterpret_cast<const uint4*>(p);
}

// Four E4M3 values (w) -> two f16x2 words, exact: lo = bytes 0-1, hi = bytes 2-3. The word is
// split into its 16-bit halves in PTX (mov.b32 {l, h}) so that ptxas can feed the upper half to
// the conversion directly instead of shifting it down first (session 12 round A, ncu: ~16 SHF per
// 16-key tile in the decode loop came from the shifted form).
__device__ __forceinline__ void f16x2_pair(uint32_t w, uint32_t& lo, uint32_t& hi) {
  asm("{\n"
      "  .reg .b16 l, h;\n"
      "  mov.b32 {l, h}, %2;\n"
      "  cvt.rn.f16x2.e4m3x2 %0, l;\n"
      "  cvt.rn.f16x2.e4m3x2 %1, h;\n"
      "}"
      : "=r"(lo), "=r"(hi)
      : "r"(w));
}

__device__ __forceinline__ void hmma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                     uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Word i (0..7) of a lane's row slice held as two 16-byte vectors.
__device__ __forceinline__ uint32_t word_of(const uint4& lo, const uint4& hi, int i) {
  const uint4& v = i < 4 ? lo : hi;
  switch (i & 3) {
    case 0:
      return v.x;
    case 1:
      return v.y;
    case 2:
      return v.z;
    default:
      return v.w;
  }
}

// A row slice of lane tig (see the permutation above), loaded as two 16-byte vectors (bytes
// [16 tig, 16 tig + 16) and [64 + 16 tig, 80 + 16 tig)), as 16 f16x2 words: [2 s] = bytes 0-1 of
// word s, [2 s + 1] = bytes 2-3.
__device__ __forceinline__ void slice_to_f16(const uint4& lo, const uint4& hi,
                                             uint32_t (&out)[16]) {
#pragma unroll
  for (int s = 0; s < 8; ++s) {
    const uint32_t w = word_of(lo, hi, s);
    f16x2_pair(w, out[2 * s], out[2 * s + 1]);
  }
}
__device__ __forceinline__ void row_slice_f16(const uint8_t* row, int tig, uint32_t (&out)[16]) {
  slice_to_f16(ld_query16(row + tig * 16), ld_query16(row + 64 + tig * 16), out);
}

// Byte offset of 16-byte chunk `chunk` of row `row` in a swizzled tile or page.
__device__ __forceinline__ int swizzled(int row, int chunk) {
  return row * kRowBytes + ((chunk ^ ((row & 1) << 2)) << 4);
}

__device__ __forceinline__ void cp_async16(void* smem_dst, const void* gmem_src) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(gmem_src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

using sm90::smem_addr;

// ---------------------------------------------------------------------------------------------
// Decode units.

template <int NT>
struct DecodeState {
  uint32_t q[NT][16];  // B fragments (f16x2): query row nt * 8 + g
  int rpos[NT][2];     // positions of the C columns tig * 2, tig * 2 + 1 of each n-tile
  float run[NT][2];    // running block max of those columns
};

// NT <= 2 (the unrolled tile loop): each n-tile accumulates its even and odd k16 steps in two
// independent accumulators added at the end, so the dependent HMMA chain per tile is 4 long
// instead of 8 (ncu, session 12: ~28 % of the decode warps' stall samples were fixed-latency
// waits; session 13 rounds A-B: single pass at 8K, draft 3, one CTA per request: 64 requests
// 34.9 vs 40.0 us, 128: 46.4 vs 48.9; elsewhere equal or up to 2 % faster, never slower beyond
// the run-to-run spread). NT >= 3 keeps one accumulator (registers).
template <int NT>
__device__ __forceinline__ void decode_compute_tile(DecodeState<NT>& s, const uint8_t* tile,
                                                    int key0, bool mask, int g, int tig) {
  const uint8_t* r0 = tile + g * kRowBytes;  // rows g and g + 8 share the swizzle parity
  const uint8_t* r1 = r0 + 8 * kRowBytes;
  const int sw = (g & 1) << 2;
  const int c_lo = (tig ^ sw) << 4;
  const int c_hi = ((tig + 4) ^ sw) << 4;
  const uint4 lo0 = lds16(r0 + c_lo), hi0 = lds16(r0 + c_hi);
  const uint4 lo1 = lds16(r1 + c_lo), hi1 = lds16(r1 + c_hi);
  constexpr bool kTwo = NT <= 2;
  float c[NT][4], d[kTwo ? NT : 1][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) c[nt][0] = c[nt][1] = c[nt][2] = c[nt][3] = 0.0f;
  if constexpr (kTwo) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) d[nt][0] = d[nt][1] = d[nt][2] = d[nt][3] = 0.0f;
  }
#pragma unroll
  for (int st = 0; st < 8; ++st) {
    const uint32_t w0 = word_of(lo0, hi0, st), w1 = word_of(lo1, hi1, st);
    uint32_t a0, a1, a2, a3;
    f16x2_pair(w0, a0, a2);
    f16x2_pair(w1, a1, a3);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      if (kTwo && (st & 1))
        hmma(d[kTwo ? nt : 0], a0, a1, a2, a3, s.q[nt][2 * st], s.q[nt][2 * st + 1]);
      else
        hmma(c[nt], a0, a1, a2, a3, s.q[nt][2 * st], s.q[nt][2 * st + 1]);
    }
  }
  if constexpr (kTwo) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) c[nt][i] += d[nt][i];
  }
  const int p0 = key0 + g;  // key of C rows g; rows g + 8 hold key p0 + 8
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    if (mask) {
      c[nt][0] = p0 <= s.rpos[nt][0] ? c[nt][0] : neg_inf();
      c[nt][1] = p0 <= s.rpos[nt][1] ? c[nt][1] : neg_inf();
      c[nt][2] = p0 + 8 <= s.rpos[nt][0] ? c[nt][2] : neg_inf();
      c[nt][3] = p0 + 8 <= s.rpos[nt][1] ? c[nt][3] : neg_inf();
    }
    s.run[nt][0] = block_max(s.run[nt][0], block_max(c[nt][0], c[nt][2]));
    s.run[nt][1] = block_max(s.run[nt][1], block_max(c[nt][1], c[nt][3]));
  }
}

// End of block b: the block max of every row goes to the workspace scores (two-kernel path) or,
// fused, to the CTA's shared block-max table sblk[row][b - b0].
// share > 0 (the clustered single pass with more rows than a CTA has warps):
// sblk is this CTA's own table and every value goes to the tables of cluster ranks 0 .. share - 1
// (distributed shared memory), so that every CTA of the cluster can select rows.
// share < 0 (cluster_async_maxima, a CTA of rank > 0): sblk is this CTA's own table, and every
// value goes to the same place in rank 0's by st.async, which completes its bytes on rank 0's
// table mbarrier (right after the table) when they land.
template <int NT, bool kFused>
__device__ __forceinline__ void decode_flush(DecodeState<NT>& s, const KernelArgs& a, int t0,
                                             int rows, int b, bool page_ok, int g, int tig,
                                             float* sblk, int b0, int share) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float v = s.run[nt][e];
      v = warp_block_max_xor(v, 4);
      v = warp_block_max_xor(v, 8);
      v = warp_block_max_xor(v, 16);
      const int j = nt * 8 + tig * 2 + e;
      if (g == 0 && j < rows) {
        if constexpr (kFused) {
          float* dst = sblk + j * kFusedMaxChunk + (b - b0);
          const float val = page_ok ? v : quiet_nan();
          if (share == 0) {
            *dst = val;
          } else if (share < 0) {
            const uint32_t rdst = cluster_smem_addr(dst, 0);
            const uint32_t rbar = cluster_smem_addr(sblk + kDecRows * kFusedMaxChunk, 0);
            asm volatile(
                "st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(
                    rdst),
                "r"(__float_as_uint(val)), "r"(rbar)
                : "memory");
          } else {
#pragma unroll 1
            for (int rk = 0; rk < share; ++rk) *map_to_cluster_rank(dst, rk) = val;
          }
        } else
          a.scores[(int64_t{t0} * a.n_kv + j) * a.max_pages + b] = page_ok ? v : quiet_nan();
      }
      s.run[nt][e] = neg_inf();
    }
  }
}

// One 2 KB tile (tile t of `page`, t < 8) into ring stage t (kDecStages == tiles per page, so a
// tile's stage is its index in the page and every stage index in the unrolled decode loop is a
// constant): 4 x 32 swizzled 16-byte cp.async (committed by the caller). A page outside the pool
// (-1) reads nothing: the cp.async zero-fill the stage (source size 0, the source address the pool
// base); the block scores NaN and its data is never used.
// cp.async chunk lane + 32 c of the tile = row (lane >> 3) + 4 c, 16-byte column lane & 7: its
// swizzled destination is lane_dst + 512 c (rows 4 c apart share the swizzle parity), its source
// lane * 16 + 512 c, so one address pair per lane serves the 4 copies.
static_assert(kDecStages == kPageSize / 16, "stage index == tile index in the page");
__device__ __forceinline__ uint32_t lane_dst_offset(int lane) {
  return static_cast<uint32_t>(swizzled(lane >> 3, lane & 7));
}
// The L2 policy of the index-K tile copies (IndexerCudaOptions::stream_evict_first): evict_first
// for the fraction a.evict_fraction (1 or 0) of them makes the read-once stream the L2's first
// victims, so that the lines every call reads again (page tables, query rows, positions, the
// kernels' code) stay resident across back-to-back calls. The policy is created beside each tile's
// copies (one instruction per 4 copies) from the kernel parameter rather than held in registers
// through the decode loops. ptxas: score_fused_cluster_kernel 168 registers with 4 bytes of spills
// (main: none; none either when its 3-4 n-tile paths are left out, so most likely there).
#define M3_TILE_POLICY "createpolicy.fractional.L2::evict_first.b64 pol, %3;\n"
__device__ __forceinline__ void issue_tile(const KernelArgs& a, uint8_t* ring, int64_t page, int t,
                                           int lane) {
  const uint32_t dst = smem_addr(ring) + t * kTileBytes + lane_dst_offset(lane);
  const uint8_t* src = (page >= 0 ? page_base(a, page) + t * kTileBytes : a.cache) + lane * 16;
  const uint32_t bytes = page >= 0 ? 16u : 0u;
  asm volatile(
      "cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
      "cp.async.cg.shared.global [%0+512], [%1+512], 16, %2;\n"
      "cp.async.cg.shared.global [%0+1024], [%1+1024], 16, %2;\n"
      "cp.async.cg.shared.global [%0+1536], [%1+1536], 16, %2;\n" ::"r"(dst),
      "l"(src), "r"(bytes)
      : "memory");
}
// issue_tile with the L2 policy (the prologue; the unrolled loop of <= 2 n-tiles uses
// issue_tile_at; the rolled loop of 3-4 n-tiles keeps plain copies).
__device__ __forceinline__ void issue_tile_hinted(const KernelArgs& a, uint8_t* ring, int64_t page,
                                                  int t, int lane) {
  const uint32_t dst = smem_addr(ring) + t * kTileBytes + lane_dst_offset(lane);
  const uint8_t* src = (page >= 0 ? page_base(a, page) + t * kTileBytes : a.cache) + lane * 16;
  const uint32_t bytes = page >= 0 ? 16u : 0u;
  asm volatile(
      "{\n .reg .b64 pol;\n" M3_TILE_POLICY
      "cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, pol;\n"
      "cp.async.cg.shared.global.L2::cache_hint [%0+512], [%1+512], 16, %2, pol;\n"
      "cp.async.cg.shared.global.L2::cache_hint [%0+1024], [%1+1024], 16, %2, pol;\n"
      "cp.async.cg.shared.global.L2::cache_hint [%0+1536], [%1+1536], 16, %2, pol;\n}\n" ::"r"(dst),
      "l"(src), "r"(bytes), "f"(a.evict_fraction)
      : "memory");
}

// The cp.async path of issue_tile with every offset an immediate (the decode loop's tiles are
// compile-time placed): tile kT of the page whose lane source address is `src` (page base +
// lane * 16, or the pool base with bytes 0 for a page outside the pool) into stage kT of the ring
// whose lane destination is `dst` (shared address of the ring + lane_dst_offset); L2 policy as
// issue_tile's.
template <int kT>
__device__ __forceinline__ void issue_tile_at(const KernelArgs& a, uint32_t dst,
                                              const uint8_t* src, uint32_t bytes) {
  asm volatile(
      "{\n .reg .b64 pol;\n" M3_TILE_POLICY
      "cp.async.cg.shared.global.L2::cache_hint [%0+%4], [%1+%4], 16, %2, pol;\n"
      "cp.async.cg.shared.global.L2::cache_hint [%0+%5], [%1+%5], 16, %2, pol;\n"
      "cp.async.cg.shared.global.L2::cache_hint [%0+%6], [%1+%6], 16, %2, pol;\n"
      "cp.async.cg.shared.global.L2::cache_hint [%0+%7], [%1+%7], 16, %2, pol;\n}\n" ::"r"(dst),
      "l"(src), "r"(bytes), "f"(a.evict_fraction), "n"(kT * kTileBytes),
      "n"(kT * kTileBytes + 512), "n"(kT * kTileBytes + 1024), "n"(kT * kTileBytes + 1536)
      : "memory");
}
#undef M3_TILE_POLICY

// The start of a warp's tile stream: tiles 0 .. kDecStages - 2, all in the warp's first block
// (page pg_first). Needs only the page-table entry, so decode_path issues it before query_start
// and positions arrive. A prologue whose tiles turn out not to be needed is waited for
// (cp_async_wait<0>: no copy may outlive the CTA).
__device__ __forceinline__ void stream_prologue(const KernelArgs& a, uint8_t* ring,
                                                int64_t pg_first, int lane) {
#pragma unroll
  for (int i = 0; i < kDecStages - 1; ++i) {
    issue_tile_hinted(a, ring, pg_first, i, lane);
    cp_async_commit();
  }
}

// A decode unit's query rows as loaded (E4M3, before the f16 conversion): lane (g, tig) holds the
// slices (see row_slice_f16) of rows nt * 8 + g, zero for rows >= the unit's rows. Loaded by
// decode_path before the unit's positions are reduced (one round trip less before the first MMA).
struct QueryRaw {
  uint4 lo[kDecRows / 8], hi[kDecRows / 8];
};

__device__ __forceinline__ void load_query_raw(const KernelArgs& a, int t0, int rows, QueryRaw& q) {
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, tig = lane & 3;
  const uint8_t* iq0 = a.iq + int64_t{t0} * a.n_kv * kRowBytes;
#pragma unroll
  for (int nt = 0; nt < kDecRows / 8; ++nt) {
    const int row = nt * 8 + g;
    q.lo[nt] = q.hi[nt] = make_uint4(0u, 0u, 0u, 0u);
    if (row < rows) {
      q.lo[nt] = ld_query16(iq0 + row * kRowBytes + tig * 16);
      q.hi[nt] = ld_query16(iq0 + row * kRowBytes + 64 + tig * 16);
    }
  }
}

// Session 23 (64 x 8K draft 3, flat decode), lost and deleted: a pipelined form of this loop for
// flat warps (the shared-memory loads of tile i + 1 before tile i's math, the causal mask decided
// per block so that the unmasked copy of the 8 tiles is branch-free, the ring a whole block
// ahead): 896 instead of 984 warp instructions per block (ncu), but 31 % of the stall samples
// "no instruction" (the fetch of the two unrolled copies no longer hidden behind the waits), and
// 23.7-23.8 us back to back vs 23.3-23.5 (round A, three alternating runs; one accumulator per
// n-tile instead of two: 23.7-23.9); CTA ends 17.6-22.0 us vs 16.2-21.3 (timelines, same round).
// The warp's share of a decode unit: blocks first, first + step, ... < b1 (step 4: a split's
// blocks dealt over the CTA's warps; 1: a flat decode warp's own range) (pg_first / pg_second: the
// guarded pages of the first two, loaded by the caller before the query_start round trip).
// pre_issued: the caller already ran stream_prologue (same ring and pg_first). qraw: the unit's
// query rows (load_query_raw); lane_pos: lane l < rows / n_kv holds the position of token t0 + l.
template <int NT, bool kFused>
__device__ __forceinline__ void decode_unit(const KernelArgs& a, uint8_t* smem, int r, int t0,
                                            int rows, int first, int b1, int step, int64_t pg_first,
                                            int64_t pg_second, const QueryRaw& qraw, int lane_pos,
                                            float* sblk, int b0, bool pre_issued, int share) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2, tig = lane & 3;
  const int nblk = (b1 - first + step - 1) / step;

  // Tile stream: tile i = tile (i % 8) of block first + 4 (i / 8), in ring stage i % 8. The
  // issue side runs kDecStages - 1 = 7 tiles ahead: while the compute side is at tile t of block
  // k it issues tile 7 of block k (t == 0) or tile t - 1 of block k + 1. Pages: pg_k (block k),
  // pg_k1 (block k + 1, -1 past the end: zero-fill copies that are never computed) and the raw
  // page-table entry of block k + 2, loaded a block ahead and checked only when it rotates in
  // (its load latency stays off the tile loop). The first tiles are issued before the query rows
  // are loaded and converted, so that work hides under the index-K latency. The 8 tiles of a
  // block are unrolled: stages, keys and the flush are compile-time placed.
  uint8_t* ring = smem + warp * (kDecStages * kTileBytes);
  const uint32_t ring_dst = smem_addr(ring) + lane_dst_offset(lane);
  const auto raw_page_at = [&](int k) {
    return k < nblk ? __ldg(a.page_table + int64_t{r} * a.pt_stride + first + k * step) : -1;
  };
  const auto guard = [&](int32_t pg) {
    return (pg >= 0 && int64_t{pg} < a.num_pages) ? pg : int32_t{-1};
  };
  int32_t pg_k = static_cast<int32_t>(pg_first);
  int32_t pg_k1 = nblk > 1 ? static_cast<int32_t>(pg_second) : -1;
  int32_t raw_k2 = raw_page_at(2);
  if (!pre_issued) stream_prologue(a, ring, pg_first, lane);

  DecodeState<NT> s;
  int min_pos = INT_MAX;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    slice_to_f16(qraw.lo[nt], qraw.hi[nt], s.q[nt]);  // zero slices (rows >= rows) give zeros
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int j = nt * 8 + tig * 2 + e;  // < kDecRows, so j / n_kv < 32
      const int pos = __shfl_sync(0xffffffffu, lane_pos, j / a.n_kv);
      s.rpos[nt][e] = j < rows ? pos : -1;
      if (j < rows) min_pos = min(min_pos, pos);
      s.run[nt][e] = neg_inf();
    }
  }
  min_pos = __reduce_min_sync(0xffffffffu, min_pos);
  if (a.timeline != nullptr) {  // diagnostics: the warp's first tile landed (word 19)
    cp_async_wait<kDecStages - 2>();
    timeline_stamp(a, 19, 0u);
  }

  for (int k = 0; k < nblk; ++k) {
    const int b = first + k * step;
    const bool mask = b * kPageSize + kPageSize - 1 > min_pos;
    // Lane source addresses of blocks k and k + 1 (zero-fill from the pool base where -1).
    const uint8_t* src_k = (pg_k >= 0 ? page_base(a, pg_k) : a.cache) + lane * 16;
    const uint8_t* src_k1 = (pg_k1 >= 0 ? page_base(a, pg_k1) : a.cache) + lane * 16;
    const uint32_t bytes_k = pg_k >= 0 ? 16u : 0u, bytes_k1 = pg_k1 >= 0 ? 16u : 0u;
    // One tile step; tc is std::integral_constant (NT <= 2: the 8 tiles unrolled, every offset an
    // immediate) or int (NT >= 3: a loop; unrolled, the 3-4 n-tiles' registers spilled).
    const auto tile_step = [&](auto tc) {
      const int t = tc;
      cp_async_wait<kDecStages - 2>();
      __syncwarp();  // tile t landed for every lane; the previous tile's stage is free
      if constexpr (!std::is_same_v<decltype(tc), int>) {
        constexpr int kT = decltype(tc)::value;
        if constexpr (kT == 0)
          issue_tile_at<7>(a, ring_dst, src_k, bytes_k);
        else
          issue_tile_at<kT - 1>(a, ring_dst, src_k1, bytes_k1);
      } else {
        issue_tile(a, ring, t == 0 ? pg_k : pg_k1, t == 0 ? 7 : t - 1, lane);
      }
      cp_async_commit();
      decode_compute_tile<NT>(s, ring + t * kTileBytes, b * kPageSize + t * 16, mask, g, tig);
    };
    if constexpr (NT <= 2) {
      static_for<0, 8>(tile_step);
    } else {
#pragma unroll 1
      for (int t = 0; t < 8; ++t) tile_step(t);
    }
    decode_flush<NT, kFused>(s, a, t0, rows, b, pg_k >= 0, g, tig, sblk, b0, share);
    pg_k = pg_k1;
    pg_k1 = guard(raw_k2);
    raw_k2 = raw_page_at(k + 3);
  }
  cp_async_wait<0>();
}

// Decode units split their blocks by the host-known max_pages, not by the device-side nvis: CTA y
// owns [y * dec_chunk, (y + 1) * dec_chunk) (dec_chunk a multiple of 4, so every warp of a full
// chunk gets the same number of blocks), clipped to the unit's visible blocks. That makes the
// warp's first page-table entries known before query_start and positions arrive: the dependent
// chain to the first index-K byte is query_start -> positions -> data (the page-table load runs
// beside query_start) instead of query_start -> positions -> page table -> data.
// kSingle (with kFused): one split per unit (b0 == 0); the rows are finished here (kDirect).
// kCluster (with kSingle): the unit's splits are one thread-block cluster of (1, k_splits, 1)
// CTAs (rank == blockIdx.y); each CTA writes its block maxima into the table of rank 0 through
// distributed shared memory (table column = block id: max_pages <= kFusedMaxChunk), and after a
// cluster barrier rank 0 finishes the rows like the one-CTA single pass. Barriers: an arrive at
// the start and its wait before the first remote write (every CTA of the cluster has started),
// then a release / acquire barrier once every block max is written; every thread of the cluster
// passes both, whatever its data.
template <bool kFused, bool kSingle, bool kCluster = false>
__device__ __forceinline__ void decode_path(const KernelArgs& a, uint8_t* smem) {
  static_assert(!kCluster || (kFused && kSingle), "cluster: the single pass only");
  timeline_mark(a, 0);
  if constexpr (kCluster) {
    if (a.async_maxima && blockIdx.y == 0 && threadIdx.x == 0) {
      // cluster_async_maxima: rank 0's table mbarrier (one arrival per thread of rank 0, plus
      // the bytes of the other ranks' st.async), visible to the cluster once its start wait
      // passes.
      sm90::mbar_init(smem_addr(smem + kFusedSmemBytes), kMmaThreads);
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    cluster_arrive_relaxed();
  }
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  int r = static_cast<int>(blockIdx.x) - a.num_overflow;
  int b0 =
      static_cast<int>(min(int64_t{blockIdx.y} * a.dec_chunk, static_cast<int64_t>(a.max_pages)));
  int bend = static_cast<int>(min(int64_t{b0} + a.dec_chunk, int64_t{a.max_pages}));
  int first = b0 + warp, step = kMmaWarps;
  if (!kFused && a.flat_warps > 0) {
    // Flat decode (two-kernel path, IndexerCudaOptions::flat_decode): warp v of the flat_warps
    // decode warps (the CTAs after the overflow tiles, 4 warps each, grid.y 1) serves request r
    // = floor(((v + 1) R - 1) / flat_warps), i.e. request r owns warps [r W / R, (r + 1) W / R)
    // (W = flat_warps >= R: 1 or 2 counts apart), and of its max_pages blocks (host-known, as the
    // splits) the contiguous range [i max_pages / n, (i + 1) max_pages / n) of its n warps (i:
    // the warp's index among them). Every SM then gets the same number of blocks within a few
    // (one CTA per SM, the automatic choice: 28-32 at 64 x 8K, 7-8 per warp, vs 24-36 for 6
    // splits of 12 blocks) and no warp serves two requests.
    // Session 28, lost and deleted: the request's blocks dealt round robin over its warps (warp
    // i of n: blocks i, i + n, ...), after a plain read of the same pages ran 18.2 us back to back
    // dealt round robin over the grid's warps against 22.9 with a contiguous range per warp
    // (indexer_bench --ceiling, round A): 64 x 8K draft 3 22.7-22.8 vs 22.5-22.7 b2b (round C,
    // three alternating runs), 48 x 8K draft 3 18.4 vs 18.5, 64 x 8K draft 1 21.4-21.5 vs 21.5,
    // flat1 with it 24.0-24.1 vs 22.9-23.1. The scorer's order of pages is not what holds it.
    const int v = r * kMmaWarps + warp;
    const int R = a.num_requests, W = a.flat_warps;
    if (a.flat_div32) {
      // The same values in 32-bit unsigned arithmetic (every product < 2^32: checked by the
      // host): five straight-line 32-bit divisions on the path to the first page-table load (in
      // the 64-bit form the compiler tests each division's operands and branches to a 32-bit or
      // a 64-bit sequence: the PTX's div.s64 bypass). Session 24 round D, 64 x 8K draft 3,
      // same-run A/B: 24.9 / 25.1 / 24.9 us isolated, 22.6 / 22.6 / 22.6 back to back vs 25.2 /
      // 25.2 / 25.3, 22.7 / 22.8 / 22.7 with the 64-bit divisions.
      const uint32_t uv = static_cast<uint32_t>(v), uR = static_cast<uint32_t>(R),
                     uW = static_cast<uint32_t>(W), mp = static_cast<uint32_t>(a.max_pages);
      const uint32_t ur = ((uv + 1) * uR - 1) / uW;
      const uint32_t ulo = ur * uW / uR;
      const uint32_t un = (ur + 1) * uW / uR - ulo;
      r = static_cast<int>(ur);
      b0 = static_cast<int>((uv - ulo) * mp / un);
      bend = static_cast<int>((uv - ulo + 1) * mp / un);
    } else {
      r = static_cast<int>((int64_t{v + 1} * R - 1) / W);
      const int lo = static_cast<int>(int64_t{r} * W / R);
      const int n = static_cast<int>(int64_t{r + 1} * W / R) - lo;
      b0 = static_cast<int>(int64_t{v - lo} * a.max_pages / n);
      bend = static_cast<int>(int64_t{v - lo + 1} * a.max_pages / n);
    }
    first = b0;
    step = 1;
  }
  // Columns < max_pages of row r are inside the page table whatever the device data says.
  const int64_t pg_first = first < bend ? guarded_page(a, r, first) : int64_t{-1};
  const int64_t pg_second = first + step < bend ? guarded_page(a, r, first + step) : int64_t{-1};
  // Session 25 (64 x 8K, same-round A/Bs, back to back), lost and deleted: each warp touching
  // every page of its blocks after the first two at its start (their page-table entries loaded
  // with the first two, one lane per block), so that the pages' address translations are fetched
  // in parallel at the start instead of one block at a time: an L2 prefetch of the page's first
  // line 21.3 / 21.2 / 21.2 us vs 21.2 / 21.2 / 21.2 at draft 0, 22.2 / 22.4 vs 22.3 / 22.4 at
  // draft 3 (round B); a load of one word per page (L2 only, into a register read at the warp's
  // end) 21.3 / 21.4 / 21.3 vs 21.2 / 21.2 / 21.2, 22.3 / 22.4 vs 22.3 / 22.4; a bulk (TMA) L2
  // prefetch of the line 21.3 / 21.4 / 21.3, 22.2 / 22.4 (round C); just in time instead, the
  // page two blocks ahead touched at each block's start (its raw entry already loaded), ~2 us
  // before its first copies: L2 prefetch 21.8 / 21.7 / 21.6 vs 21.5 / 21.6 / 21.5, 22.5 / 22.7
  // vs 22.5 / 22.7; bulk prefetch 21.7 / 21.6 / 21.6, 22.6 / 22.8 (round E). The translations
  // do cost: with each page-table copy's pages shuffled inside one 67 MB span (bench --window:
  // the scatter's DRAM pattern with ~34 instead of ~1900 2 MB translations per call) draft 0 ran
  // 20.8 / 20.8 us b2b (round B; scattered 21.2-21.4, contiguous 20.7 in round A, the paged read
  // 17.3 vs 18.1), but no touch ahead of the stream made the stream faster.
  // Everything the start needs is loaded at once, before the early start below (its copies are
  // asm volatile with a memory clobber, so loads after them would wait for the page-table entry):
  // query_start and seq_lens, and (a.guess: one token per request) at the guessed bounds of an
  // equal-length batch (request r's tokens [r T / R, (r + 1) T / R)) the positions and (without
  // programmatic launch) the query rows, checked against query_start when it arrives and reloaded
  // when the guess was wrong. So
  // the query rows and positions arrive with the page-table entries, one round trip before the
  // first tiles, instead of one (positions) and two (query rows) round trips after them, behind
  // every CTA's prologue copies (session 13 ncu at 64 x 8K: ~14 % of the warp stall samples
  // waited for the positions; the ring then drained while the query rows were loaded).
  const int qa = load_query_start(a, r);
  const int qe = load_query_start(a, r + 1);
  const int seq_len = __ldg(a.seq_lens + r);
  const int ga = static_cast<int>(int64_t{r} * a.num_tokens / a.num_requests);
  const int gn = a.guess
                     ? min(static_cast<int>(int64_t{r + 1} * a.num_tokens / a.num_requests) - ga,
                           a.dec_tokens)
                     : 0;                                   // no guess: nothing loaded early
  int p = lane < gn ? __ldg(a.positions + ga + lane) : -1;  // lane l < n: position of token qa + l
  QueryRaw q;
  if (!a.pdl) load_query_raw(a, ga, gn * a.n_kv, q);
  const int n = min(qe - qa, a.dec_tokens);  // <= 32 tokens
  bool guessed = a.guess && qa == ga && n == gn;
  if (a.early && !a.guess) {
    // No guess, early loads (IndexerCudaOptions::early_query_loads): the positions and (without
    // programmatic launch) the query rows at the request's real bounds go out as soon as
    // query_start arrives, before this warp's prologue copies, instead of after them (behind
    // every CTA's first tiles: ready to score 3.7-5.6 us after entry at 64 x 8K draft 3).
    p = lane < n ? __ldg(a.positions + qa + lane) : -1;
    if (!a.pdl) load_query_raw(a, qa, n * a.n_kv, q);
    guessed = true;  // loaded at the right bounds
  }
  timeline_stamp(a, 22, static_cast<uint32_t>(pg_first));  // the first page-table entry is in
  timeline_stamp(a, 23, static_cast<uint32_t>(seq_len));    // seq_lens[r] is in
  bool pre = false;
  {
    // Early start: seq_lens[r] (the request's last position + 1, loaded beside query_start and
    // the page table) bounds the unit's visible blocks, so the first tiles of the warp's first
    // block go out before the positions are reduced. The exact bound from the positions decides
    // what is scored; tiles issued for a block that turns out invisible are waited for and
    // ignored (bounded waste, only when seq_lens disagrees with positions). Programmatic launch:
    // only blocks that end before the request's first new position (seq_lens[r] - its tokens in
    // this step; positions are consecutive inside a request), whose rows no kernel of the step
    // writes, are read before pdl_wait.
    int spec_b1 = min(blocks_to_score(a, seq_len - 1), bend);
    if (a.pdl) spec_b1 = min(spec_b1, max(seq_len - max(qe - qa, 0), 0) / kPageSize);
    if (first < spec_b1) {
      stream_prologue(a, smem + warp * (kDecStages * kTileBytes), pg_first, lane);
      pre = true;
      timeline_stamp(a, 18, 0u);  // the warp's first copies issued
    }
    // IndexerCudaOptions::pdl_prefetch_blocks: lane i asks the L2 for the warp's block i + 1
    // (same bound as the early tiles), so the stream runs while the previous kernel finishes.
    const int pb = first + (lane + 1) * step;
    if (lane < a.pdl_prefetch && pb < spec_b1) {
      const int64_t pg = guarded_page(a, r, pb);
      if (pg >= 0)
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(page_base(a, pg)),
                     "r"(static_cast<uint32_t>(kPageBytes))
                     : "memory");
    }
  }
  if (!guessed) p = lane < n ? __ldg(a.positions + qa + lane) : -1;
  // Programmatic launch: index_q, the step's index-K rows and every global write come after this
  // (a no-op after a normal launch).
  pdl_wait();
  if (a.pdl || !guessed) load_query_raw(a, qa, n * a.n_kv, q);
  int nvis = 0;  // the unit's blocks to score (all splits)
  if (n > 0) nvis = blocks_to_score(a, __reduce_max_sync(0xffffffffu, p));  // <= max_pages
  const int b1 = min(nvis, bend);
  if (pre && first >= b1) cp_async_wait<0>();  // warp-uniform: the prologue is not needed
  timeline_word(a, 20, first < b1 ? static_cast<uint64_t>((b1 - first + step - 1) / step) : 0u);
  const int rows = n * a.n_kv;                 // <= kDecRows
  float* sblk = kFused ? reinterpret_cast<float*>(smem + kMmaSmemBytes) : nullptr;
  // The warp's blocks first, first + 4, ... < b1; block b's maxima go to table[row][b - tb0].
  const auto score = [&](float* table, int tb0, int share) {
    switch ((rows + 7) / 8) {
      case 1:
        decode_unit<1, kFused>(a, smem, r, qa, rows, first, b1, step, pg_first, pg_second, q, p,
                               table, tb0, pre, share);
        break;
      case 2:
        decode_unit<2, kFused>(a, smem, r, qa, rows, first, b1, step, pg_first, pg_second, q, p,
                               table, tb0, pre, share);
        break;
      case 3:
        decode_unit<3, kFused>(a, smem, r, qa, rows, first, b1, step, pg_first, pg_second, q, p,
                               table, tb0, pre, share);
        break;
      default:
        decode_unit<4, kFused>(a, smem, r, qa, rows, first, b1, step, pg_first, pg_second, q, p,
                               table, tb0, pre, share);
        break;
    }
  };
  timeline_mark(a, 1);
  if constexpr (kCluster) {
    // More rows than a CTA has warps (several tokens per request): every CTA's table receives
    // every block max and the cluster's warps share the rows; otherwise rank 0's table alone and
    // its warps select (cluster-uniform: rows comes from query_start). Session 21, 256 x 8K
    // draft 3 (4-CTA clusters) back to back, with rank_lean, against rank 0's warps selecting
    // every row with the former counting: 74.5 vs 75.3 us (round C), 74.7 / 73.6 vs 74.3 / 74.1
    // (round F).
    // Session 23 (64 x 8K draft 0, 2-CTA clusters), lost and deleted: a tail pool, the last 2 / 4
    // / 8 blocks of each CTA's chunk taken by the warps tile by tile from a shared-memory counter
    // (read one tile ahead) instead of dealt statically, the tiles' maxima folded into block
    // maxima before the selection. Same-round b2b: the pool of the whole cluster in rank 0's
    // shared memory (distributed shared memory atomics) 30.1 / 31.4-31.8 / 33.6-34.0 us vs
    // 21.8-21.9 (round B); a pool per CTA (local atomics, its tiles folded after a CTA barrier)
    // 24.5-24.6 / 25.2-25.4 / 26.7-27.0 vs 20.6-20.9 (round C). Timelines (pool 4): the warps
    // did end together (round C: within a CTA 0.00 us apart, a cluster's CTAs 0.1, every CTA
    // between 26.0 and 26.5 us), but each pool tile cost ~1.3 us instead of ~0.23 (the stream
    // 23.8 us vs 14.9), and the final ranking in the pool kernel's own copy of the selection took
    // 2.6 us (round B) vs 0.6-0.7: most likely the instruction fetch of code that runs once per
    // call at the stream's end (the pool loop's unrolled steps, ~1200 instructions; not
    // profiled), the same cost that paces the final count. Also lost (same-round b2b, us): the
    // final selection split over the cluster's two CTAs (both tables receiving every block max,
    // each CTA ranking half of every row's candidates: 0.45 us from the barrier to the ranks
    // instead of 0.62-0.69) 21.1 / 21.3 / 21.1 vs 21.2 / 21.3 / 21.0 (round E; with evict_first
    // 20.9 / 21.2 / 20.9 vs 21.0 / 21.1 / 20.9), with evict_first 20.6 / 20.9 / 20.7 vs 20.6 /
    // 20.8 / 20.6 (round F); a dynamic tail, each CTA's last 4 / 8 / 12 blocks taken by its warps
    // block by block from a shared-memory counter in the same loop (with evict_first and the
    // split, round F): 20.8 / 20.8 / 20.8, 20.7 / 20.9 / 20.8, 20.8 / 20.9 / 20.8 vs 20.6 / 20.9 /
    // 20.7, the warps of a CTA still ending 1.08 us apart at the median (blocks decided two blocks
    // ahead, a block of granularity).
    // Session 28 (round G, same-round b2b, us), lost and deleted: cooperative blocks, the CTA's
    // 4 warps streaming each block of its chunk together (warp w tiles 2 w and 2 w + 1 of every
    // page, a 4-block window per warp, the warps' maxima of a block meeting in shared memory after
    // a CTA barrier; twin-equal ids, memcheck / racecheck clean): the CTA's warps then ended
    // within 0.01 us of each other (against 1.03 at the median), but every CTA later: 64 x 8K
    // 21.9-22.0 vs 20.9-21.2 (CTA last scored p50 17.7 vs 16.8-17.0), 32 x 8K (4-CTA clusters)
    // 15.1 vs 13.5-13.6, 44 x 8K 19.6 vs 17.2-17.3, 8 x 8K 8.5-8.6 vs 7.2; most likely (not
    // profiled) 2 KB pieces of four pages in flight per warp stream slower than 14 KB runs of one.
    // Session 24 (same-round b2b, us), lost and deleted: 4-CTA clusters (8 warps per SM) with
    // 4-tile warp rings (the bytes in flight of 2-CTA clusters with 8-tile rings) 21.7 / 21.7 /
    // 21.8 vs 21.8 / 21.9 / 21.8 (round A; 8-tile rings 22.6-22.8), the scheduler putting 1 to 3
    // CTAs on an SM; capped at 2 per SM by the shared-memory request 28.0-28.3 vs 21.4-21.5 (round
    // C: a second wave, the 4-CTA clusters do not tile the GPCs at 2 per SM); the early start
    // moved before the guessed query-row and position loads 21.4 / 21.3 / 21.4 vs 21.4 / 21.4 /
    // 21.5 (round C; back-to-back timeline: first copies issued 1.22 us after entry instead of
    // 1.80, but the first tile landed 3.81 vs 3.95: 7 tiles per warp from every warp at once queue
    // at DRAM, so the front is not where the time goes); the unstarted blocks of the cluster's
    // unfinished warps prefetched into L2 (cp.async.bulk.prefetch, each decode warp publishing
    // the block it was at in a relaxed shared word, read through distributed shared memory by
    // the non-first CTA's finished warps while a warp of their CTA still streamed) 20.8 / 20.9 /
    // 20.8 / 20.9 vs 20.7 / 20.8 / 20.7 / 20.6 (round H).
    const bool shared = rows > kMmaWarps;
    const bool async = a.async_maxima && !shared;  // cluster-uniform
    cluster_wait_acquire();  // every CTA of the cluster runs: rank 0's table may be written
    // One call site (each is a full copy of the unrolled decode loops).
    if (first < b1)
      score(shared || async ? sblk : map_to_cluster_rank(sblk, 0), 0,
            shared ? static_cast<int>(gridDim.y) : (async && blockIdx.y != 0 ? -1 : 0));
    if (async) {
      // IndexerCudaOptions::cluster_async_maxima: no cluster barrier at the end. The other ranks'
      // maxima complete rank 0's table mbarrier as they land (st.async), so those CTAs are done;
      // rank 0's threads wrote theirs locally and each arrives on it (release: every writer
      // orders its own stores; round E's racecheck reported lanes 1-3's table stores against the
      // readers when only lane 0 of each warp arrived after a __syncwarp), thread 0 announcing
      // the other ranks' bytes: every row's value of every visible block past rank 0's chunk.
      timeline_mark(a, 2);
      if (blockIdx.y != 0) {
        timeline_mark(a, 4);
        return;
      }
      const uint32_t bar = smem_addr(smem + kFusedSmemBytes);
      if (threadIdx.x == 0)
        sm90::mbar_arrive_expect_tx(bar,
                                    static_cast<uint32_t>(rows * 4 * (nvis - min(nvis, bend))));
      else
        sm90::mbar_arrive(bar);
      const auto await = [&] {
        sm90::mbar_wait<true>(bar, 0);  // every block max of [0, nvis) is in the table
        timeline_mark(a, 3);
      };
      select_rows_lean(a, sblk, qa, rows, 0, nvis, p, warp, kMmaWarps, await);
      timeline_mark(a, 4);
      return;
    }
    const uint64_t scored_at = timeline_clock(a);
    cluster_arrive_release();
    timeline_stamp(a, 21, 0u);  // the release arrive returned
    timeline_mark_at(a, 2, scored_at);
    const auto wait = [&] {
      cluster_wait_acquire();  // every block max of [0, nvis) is in the table(s)
      timeline_mark(a, 3);
    };
    if (shared || blockIdx.y == 0) {
      // The rows' metadata (and trivial rows) before the wait, the counting after it.
      const int first_row = (shared ? static_cast<int>(blockIdx.y) * kMmaWarps : 0) + warp;
      const int row_step = (shared ? static_cast<int>(gridDim.y) : 1) * kMmaWarps;
      select_rows_lean(a, sblk, qa, rows, 0, nvis, p, first_row, row_step, wait);
    } else {
      wait();
    }
    timeline_mark(a, 4);
    return;
  }
  if constexpr (kFused) {
    if (b0 >= b1) {  // CTA-uniform: the fused path has a CTA barrier below
      // Single pass: every row is trivial (nothing to score); sblk is not read.
      if constexpr (kSingle) fused_local_select(a, nullptr, qa, rows, b0, b1, p);
      return;
    }
  } else {
    if (first >= b1) return;  // warp-uniform; the two-kernel decode path has no CTA barrier
  }
  if (first < b1) score(sblk, b0, 0);
  timeline_mark(a, 2);
  if constexpr (kFused) {
    __syncthreads();  // every block max of [b0, b1) is in sblk
    timeline_mark(a, 3);
    if constexpr (kSingle) {
      fused_local_select(a, sblk, qa, rows, b0, b1, p);
    } else {
      // The table's rows go to the workspace scores in one coalesced burst (row j: blocks
      // [b0, b1) contiguous); select_kernel finishes the rows.
      const int ncol = b1 - b0;
      for (int i = static_cast<int>(threadIdx.x); i < rows * ncol; i += kMmaThreads) {
        const int j = i / ncol, c = i - j * ncol;
        a.scores[(int64_t{qa} * a.n_kv + j) * a.max_pages + b0 + c] = sblk[j * kFusedMaxChunk + c];
      }
    }
  }
  timeline_mark(a, 4);
}

// ---------------------------------------------------------------------------------------------
// Overflow tiles (prefill).

struct OverflowShared {
  int max_pos[kMmaWarps];
  int min_pos[kMmaWarps];
  int page_ok[kPreStages];
};

struct PrefillState {
  uint32_t q[2][2][16];  // A fragments (f16x2): m-tile, row g / g + 8
  int rpos[2][2];        // positions of rows g, g + 8 of each m-tile
};

__device__ __forceinline__ void prefill_compute_page(const PrefillState& s, const KernelArgs& a,
                                                     const uint8_t* page, int b, bool page_ok,
                                                     int min_pos, int row0, int rows, int t0, int g,
                                                     int tig) {
  float run[2][2];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) run[mt][0] = run[mt][1] = neg_inf();
  const int key_base = b * kPageSize;
  const bool mask = key_base + kPageSize - 1 > min_pos;
  const int c_lo = (tig ^ ((g & 1) << 2)) << 4;  // key rows 8 j + g share the parity of g
  const int c_hi = ((tig + 4) ^ ((g & 1) << 2)) << 4;
#pragma unroll 2
  for (int j = 0; j < kPageSize / 8; ++j) {
    const uint8_t* krow = page + (j * 8 + g) * kRowBytes;
    const uint4 lo = lds16(krow + c_lo), hi = lds16(krow + c_hi);
    float c[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
    for (int st = 0; st < 8; ++st) {
      const uint32_t w = word_of(lo, hi, st);
      uint32_t b0, b1;
      f16x2_pair(w, b0, b1);
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
        hmma(c[mt], s.q[mt][0][2 * st], s.q[mt][1][2 * st], s.q[mt][0][2 * st + 1],
             s.q[mt][1][2 * st + 1], b0, b1);
    }
    const int p0 = key_base + j * 8 + tig * 2;  // keys of C columns tig * 2, tig * 2 + 1
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      if (mask) {
        c[mt][0] = p0 <= s.rpos[mt][0] ? c[mt][0] : neg_inf();
        c[mt][1] = p0 + 1 <= s.rpos[mt][0] ? c[mt][1] : neg_inf();
        c[mt][2] = p0 <= s.rpos[mt][1] ? c[mt][2] : neg_inf();
        c[mt][3] = p0 + 1 <= s.rpos[mt][1] ? c[mt][3] : neg_inf();
      }
      run[mt][0] = block_max(run[mt][0], block_max(c[mt][0], c[mt][1]));
      run[mt][1] = block_max(run[mt][1], block_max(c[mt][2], c[mt][3]));
    }
  }
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float v = run[mt][h];
      v = warp_block_max_xor(v, 1);
      v = warp_block_max_xor(v, 2);
      const int row = row0 + mt * 16 + g + 8 * h;
      if (tig == 0 && row < rows)
        a.scores[(int64_t{t0} * a.n_kv + row) * a.max_pages + b] = page_ok ? v : quiet_nan();
    }
  }
}

__device__ __forceinline__ void overflow_segment(const KernelArgs& a, uint8_t* ring,
                                                 OverflowShared& sh, int r, int sa, int se) {
  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, tig = lane & 3;

  // Largest and smallest position of the segment (<= kPreRows tokens).
  int mx = -1, mn = INT_MAX;
  for (int t = sa + tid; t < se; t += kMmaThreads) {
    const int p = __ldg(a.positions + t);
    mx = max(mx, p);
    mn = min(mn, p);
  }
  mx = __reduce_max_sync(0xffffffffu, mx);
  mn = __reduce_min_sync(0xffffffffu, mn);
  if (lane == 0) {
    sh.max_pos[warp] = mx;
    sh.min_pos[warp] = mn;
  }
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kMmaWarps; ++w) {
    mx = max(mx, sh.max_pos[w]);
    mn = min(mn, sh.min_pos[w]);
  }
  __syncthreads();  // sh is reused by the next segment
  const int nvis = blocks_to_score(a, mx);
  int b0 = 0, b1 = 0;
  if (nvis == 0 || !split_range(a, nvis, b0, b1)) return;

  const int rows = (se - sa) * a.n_kv;  // <= kPreRows
  const int row0 = warp * kPreRowsPerWarp;
  const bool active = row0 < rows;
  PrefillState s;
  const uint8_t* iq0 = a.iq + int64_t{sa} * a.n_kv * kRowBytes;
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + mt * 16 + g + 8 * h;
      if (row < rows) {
        row_slice_f16(iq0 + row * kRowBytes, tig, s.q[mt][h]);
      } else {
#pragma unroll
        for (int i = 0; i < 16; ++i) s.q[mt][h][i] = 0u;
      }
      s.rpos[mt][h] = row < rows ? __ldg(a.positions + sa + row / a.n_kv) : -1;
    }
  }

  const int npages = b1 - b0;
  auto issue = [&](int i) {
    if (i < npages) {
      const int64_t page = guarded_page(a, r, b0 + i);
      uint8_t* dst = ring + (i % kPreStages) * kPageBytes;
      if (page >= 0) {
        const uint8_t* src = page_base(a, page);
#pragma unroll
        for (int c = 0; c < kPageBytes / 16 / kMmaThreads; ++c) {
          const int chunk = tid + c * kMmaThreads;  // row chunk / 8, 16-byte chunk chunk % 8
          cp_async16(dst + swizzled(chunk >> 3, chunk & 7), src + chunk * 16);
        }
      }
      if (tid == 0) sh.page_ok[i % kPreStages] = page >= 0 ? 1 : 0;
    }
    cp_async_commit();  // possibly empty: keeps the group count uniform
  };
#pragma unroll
  for (int i = 0; i < kPreStages - 1; ++i) issue(i);
  for (int i = 0; i < npages; ++i) {
    cp_async_wait<kPreStages - 2>();
    __syncthreads();  // page i landed for every thread; stage (i - 1) % kPreStages is free
    issue(i + kPreStages - 1);
    if (active)
      prefill_compute_page(s, a, ring + (i % kPreStages) * kPageBytes, b0 + i,
                           sh.page_ok[i % kPreStages] != 0, mn, row0, rows, sa, g, tig);
  }
  cp_async_wait<0>();
  __syncthreads();  // the ring and page_ok are reused by the next segment
}

template <bool kFused, bool kSingle = false, bool kCluster = false>
__device__ __forceinline__ void score_mma_body(const KernelArgs& a, uint8_t* smem,
                                               OverflowShared& sh) {
  // The dependent grid (the select kernel, or the next stage after a single pass) may be
  // scheduled once every CTA has started; it waits for this grid's completion before reading.
  pdl_launch_dependents();
  if (static_cast<int>(blockIdx.x) >= a.num_overflow) {
    decode_path<kFused, kSingle, kCluster>(a, smem);
    return;
  }
  pdl_wait();  // programmatic launch: before reading index_q / index-K or writing anything
  // A cluster holds the k_splits CTAs of one grid.x index: all overflow tiles or all decode units.
  for_each_segment(a, [&](int r, int sa, int se) { overflow_segment(a, smem, sh, r, sa, se); });
  if constexpr (kSingle) {
    // The tile's block scores (global memory; with a cluster, every split's) are written and
    // visible.
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

// Two-kernel path: every block score goes to the workspace; select_kernel picks.
__global__ void __launch_bounds__(kMmaThreads) score_mma_kernel(const KernelArgs a) {
  extern __shared__ __align__(kSmemAlign) uint8_t smem[];
  __shared__ OverflowShared sh;
  score_mma_body<false>(a, smem, sh);
}

// Fused decode: decode units keep their block maxima in shared memory and write them to the
// workspace scores at the CTA's end, overflow tiles write block scores; select_kernel finishes.
// Dynamic shared memory: kFusedSmemBytes.
__global__ void __launch_bounds__(kMmaThreads) score_fused_kernel(const KernelArgs a) {
  extern __shared__ __align__(kSmemAlign) uint8_t smem[];
  __shared__ OverflowShared sh;
  score_mma_body<true>(a, smem, sh);
}

// Single pass (IndexerCudaOptions::single_pass, grid.y == 1): decode units write their rows of
// block_ids, overflow tiles select their rows from their own block scores; no selection kernel.
__global__ void __launch_bounds__(kMmaThreads) score_fused_single_kernel(const KernelArgs a) {
  extern __shared__ __align__(kSmemAlign) uint8_t smem[];
  __shared__ OverflowShared sh;
  score_mma_body<true, true>(a, smem, sh);
}

// Clustered single pass (IndexerCudaOptions::single_pass_ctas > 1): launched in clusters of
// (1, k_splits, 1) CTAs, k_splits <= 8; each decode unit's splits write their block maxima into
// the table of the cluster's first CTA (distributed shared memory), which finishes the rows; an
// overflow tile's splits write block scores, then finish its rows together after a cluster
// barrier. No selection kernel.
__global__ void __launch_bounds__(kMmaThreads) score_fused_cluster_kernel(const KernelArgs a) {
  extern __shared__ __align__(kSmemAlign) uint8_t smem[];
  __shared__ OverflowShared sh;
  score_mma_body<true, true, true>(a, smem, sh);
}

}  // namespace m3attn::indexer_kernel
