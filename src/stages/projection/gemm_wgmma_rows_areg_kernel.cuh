// The row split with the activations in registers (GemmWgmmaOptions::row_areg; session 25,
// opt-in): the math, the CTAs and the packed image of gemm_wgmma_rows_kernel.cuh's token-major
// form (m64n40k32, A = 64 token rows, B = the CTA's 37-38 weight rows from shared memory; the
// same products, folds and bf16-pair stores), but the wgmma A operand comes from REGISTERS that
// each consumer thread loads from global memory (the activations are L2-resident), so the ring
// of shared-memory stages holds weights only.
//
// Why (session 24, "What remains"): the row split's stream phase is slow (pair traces at M 64:
// 15.9 us from its first to its last full stage) and its ring shallow: 3 stages of 2 K blocks, 58
// KB of weights per SM next to 96 KB of activation slots (64 token rows x 128 bytes per K block
// per CTA). The K split, 115 KB of weights per SM, streams in 10.8-11.4 us. Without activation
// slots the same shared memory holds kStages stages of weights (10 KB each: 2 K blocks of at
// most 40 rows).
//
// The A fragment of m64nNk32 with .e4m3 operands (PTX ISA, wgmma register fragments): warp w of
// the warpgroup holds rows 16 w ... 16 w + 15; lane l (g = l / 4, t = l % 4) holds four 32-bit
// registers: bytes 4 t ... 4 t + 3 of the k32 step of row 16 w + g (a0) and of row 16 w + g + 8
// (a1), and bytes 16 + 4 t ... of the same two rows (a2, a3). The weight image's K order is the
// activations' (a k32 step reads the stage's 16-byte K columns 2 k and 2 k + 1), so a thread needs,
// per K block and row, word t of each of the 8 16-byte columns. It loads whole columns instead
// (16-byte loads: lane t of a quad columns t and t + 4 of both its rows, 4 loads per K block, every
// sector used) and a 4 x 4 transpose of 32-bit words across the quad (two shuffle stages) gives
// each lane its words. The loads of K block kb + kAhead are issued as soon as K block kb's wgmmas
// have completed (their registers are free), kAhead / 2 stages of the ring ahead, so that L2's
// latency under the stream's load is hidden; the transposes run before the stage's full-barrier
// wait. (Session 21 lost with activations requested only when a slot freed: +4.6-6.5 us; here
// they are requested kAhead K blocks ahead, as the weights are a ring ahead.) The activation
// scales of the thread's two tokens come with them (two more loads per K block); the weight scales
// of the CTA's two possible 128-row blocks are staged in shared memory once (cp.async), as in the
// row split. Token rows past M load row M - 1 and are not stored: any M in 1 ... 64 runs the same
// code, without the row split's activation boxes past M.
//
// Every CTA reads the whole activation matrix (64 x 6144 bytes at M 64: 104 MB from L2 over the
// grid, as the row split's boxes): the two CTAs of an SM read the same bytes at about the same
// time, so with a shallower ring (kStages) the L1 left beside shared memory can serve the second.
//
// Lost (round A, same round, b2b us, fused M 64, deleted): one 4-byte load per fragment register
// (16 per K block, each warp instruction touching 8 rows x 16 bytes): 52.0-52.1 plain / 51.4-51.5
// chained against the row split's 19.85-19.90 / 18.58-18.62; its ring with those loads and no
// wgmma (diagnostic 2) 39.0 / 38.7 against the ring alone's 17.42 / 14.77 (the row split's ring
// with its activation boxes: 18.04 / 16.76).
//
// kDiag (GemmWgmmaOptions::debug_rows_diag with row_areg; bench diagnostics, results wrong): 1 =
// the ring alone (consumers wait for each stage and release it: no loads, no wgmma, no fold;
// stores kept), 2 = 1 with the activation loads (each K block's registers folded into one
// accumulator, so that the loads stay live).
#pragma once

#include "stages/projection/gemm_wgmma_rows_kernel.cuh"

namespace m3attn::gemm_wgmma_detail {

constexpr int kAregKpb = 2;  // K blocks per ring stage
constexpr int kAregStageBytes = kAregKpb * kRowBlockBytes;
constexpr int kAregThreads = 128 + 32;  // one consumer warpgroup, one producer warp
// Shared memory: the ring, then the weight scales (2 per K block); two CTAs per SM.
constexpr int kAregSbBytes = 2 * kRowsMaxKblocks * 4;
// The deepest ring that fits (11 stages of 2 K blocks).
constexpr int kAregMaxStages = (rows_smem_per_cta<1>() - 1024 - kAregSbBytes) / kAregStageBytes;
static_assert(kImageStep % kAregKpb == 0, "a stage lies inside one image step");
// (The n40 B tile of a stage's last K column reads up to (40 - rows) x 16 bytes past the CTA's
// rows: inside the stage's slot, which holds kRowsMax rows per K block.)
__host__ __device__ constexpr int rows_areg_smem_bytes(int stages) {
  return 128 + stages * kAregStageBytes + kAregSbBytes;
}

struct RowsAregArgs : RowsArgs {
  const uint8_t* a;  // activations [M, K] E4M3, rows lda bytes apart (16-byte aligned)
  int64_t lda;
};

// m64n40k32, A from registers (the fragment above), B a shared-memory descriptor.
__device__ __forceinline__ void wgmma_n40_areg(float (&d)[20], const uint32_t (&a)[4], uint64_t b,
                                               int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %25, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n40k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, "
      "%9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19}, {%20, %21, %22, %23}, %24, p, 1, "
      "1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));
}

// One K block's operands in a thread's registers: w[2 h + c][v], word v of the 16-byte column t + 4
// c of token row row0 + 8 h as loaded, then (after quad_transpose) word t of column v + 4 c; and
// the activation scales of the two token rows.
struct AregBlock {
  uint32_t w[4][4];
  float s0, s1;
  // The k32 step k's fragment register e (a0 ... a3: row row0 + 8 (e % 2), column 2 k + e / 2).
  __device__ __forceinline__ uint32_t frag(int k, int e) const {
    const int c = 2 * k + e / 2;
    return w[2 * (e % 2) + c / 4][c % 4];
  }
};

// 16-byte global load cached in L2 only (diagnostic 4).
__device__ __forceinline__ uint4 ld_cg_v4(const uint8_t* p) {
  uint4 v;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// 4 x 4 transpose of 32-bit words across the lanes of a quad (t = lane % 4): lane t's w[e] becomes
// lane e's w[t]. Two stages: the 2 x 2 blocks across lanes t ^ 1, then across lanes t ^ 2.
__device__ __forceinline__ void quad_transpose(uint32_t (&w)[4], int t) {
  const bool b0 = (t & 1) != 0, b1 = (t & 2) != 0;
  uint32_t r0 = __shfl_xor_sync(0xffffffffu, b0 ? w[0] : w[1], 1);
  uint32_t r1 = __shfl_xor_sync(0xffffffffu, b0 ? w[2] : w[3], 1);
  if (b0) {
    w[0] = r0;
    w[2] = r1;
  } else {
    w[1] = r0;
    w[3] = r1;
  }
  r0 = __shfl_xor_sync(0xffffffffu, b1 ? w[0] : w[2], 2);
  r1 = __shfl_xor_sync(0xffffffffu, b1 ? w[1] : w[3], 2);
  if (b1) {
    w[0] = r0;
    w[1] = r1;
  } else {
    w[2] = r0;
    w[3] = r1;
  }
}

// kL1Ahead > kAhead (0: off): each K block's activation lines are also prefetched into L1
// (prefetch.global.L1, no register) kL1Ahead K blocks ahead, so that the register loads kAhead
// ahead hit L1 (round C A/B).
template <int kAhead, int kStages, int kDiag = 0, int kL1Ahead = 0>
__global__ void __launch_bounds__(kAregThreads, 2) gemm_rows_areg_kernel(const RowsAregArgs p) {
  // Diagnostics: no wgmma, no fold (1, 2, 3, 4); 3: no ring either (no weight copies, no barrier
  // waits: the activation loads alone); 4: 2 with the 16-byte loads cached in L2 only (ld.cg).
  constexpr bool kRing = kDiag >= 1 && kDiag <= 4;
  constexpr bool kLoads = kDiag != 1;
  constexpr bool kNoRing = kDiag == 3;
  constexpr int kAcc = 20;  // m64n40: fp32 accumulators per thread
  static_assert(kAhead % kAregKpb == 0, "whole stages ahead");
  static_assert(kL1Ahead == 0 || kL1Ahead > kAhead, "L1 prefetch beyond the register loads");
  static_assert(kStages >= 2 && kStages <= kAregMaxStages, "a ring of 2 ... kAregMaxStages");
  constexpr int kUnroll = kAhead / kAregKpb;  // stages per unrolled turn (static register ring)

  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t full_bar[kStages];
  __shared__ __align__(8) uint64_t empty_bar[kStages];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t base = (raw + 127u) & ~127u;
  float* s_sb = reinterpret_cast<float*>(smem_raw + (base - raw) +
                                         static_cast<uint32_t>(kStages * kAregStageBytes));

  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid % 32;
  const int grid = static_cast<int>(gridDim.x), cta = static_cast<int>(blockIdx.x);
  const int kb_count = p.kblocks;
  const int steps = (kb_count + kAregKpb - 1) / kAregKpb;
  const int r_begin = rows_begin(cta, grid, p.n);
  const int rows = rows_begin(cta + 1, grid, p.n) - r_begin;

  if (tid == 128) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(smem_addr(&full_bar[s]), 1);
      mbar_init(smem_addr(&empty_bar[s]), 128);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (p.trigger_dependents) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");

  if (tid >= 128) {
    if (kNoRing) return;
    if (lane == 1 && p.trace != nullptr) {
      // Diagnostics (bench only): the row split's trace words 0-5 (kRowsTraceWords).
      unsigned long long* t = p.trace + int64_t{blockIdx.x} * kRowsTraceWords;
      t[0] = global_ns();
      t[1] = static_cast<unsigned long long>(clock64());
      for (int i = 0; i < steps; ++i) {
        mbar_wait(smem_addr(&full_bar[i % kStages]), (i / kStages) & 1);
        const unsigned long long c = static_cast<unsigned long long>(clock64());
        if (i == 0) t[2] = c;
        if (i == steps / 2) t[3] = c;
        if (i == steps - 1) t[4] = c;
      }
      mbar_wait(smem_addr(&empty_bar[(steps - 1) % kStages]), ((steps - 1) / kStages) & 1);
      t[5] = static_cast<unsigned long long>(clock64());
    }
    // Producer: lane 0 streams the weight stages, one bulk copy each. It reads nothing the
    // preceding grid writes, so a programmatic launch needs no griddepcontrol.wait here: the
    // ring fills as soon as the CTA runs.
    if (lane == 0) {
      const uint64_t policy = evict_first_policy();
      for (int i = 0; i < steps; ++i) {
        const int s = i % kStages;
        if (i >= kStages) mbar_wait(smem_addr(&empty_bar[s]), ((i / kStages) - 1) & 1);
        const int left = kb_count - i * kAregKpb;
        const uint32_t bytes =
            static_cast<uint32_t>((left < kAregKpb ? left : kAregKpb) * rows * 128);
        const uint32_t full = smem_addr(&full_bar[s]);
        mbar_arrive_expect_tx(full, bytes);
        bulk_load_maybe_hint(
            base + static_cast<uint32_t>(s * kAregStageBytes),
            p.image + rows_image_offset(i * kAregKpb, r_begin, rows, p.n, kb_count), bytes, full,
            policy, p.weight_evict_first);
      }
    }
    return;  // (consumers synchronize with bar.sync 1 only)
  }

  // Consumers. The weight scales (constant) by cp.async before griddepcontrol.wait; the
  // activations and their scales (the preceding grid's outputs) after it.
  const int blk0 = r_begin / 128, last_blk = p.n / 128 - 1;
  for (int i = tid; i < kb_count * 2; i += 128) {
    const int kb = i / 2, blk = blk0 + (i % 2) < last_blk ? blk0 + (i % 2) : last_blk;
    cp_async_4(smem_addr(s_sb + i), p.sb + blk * p.sb_s0 + kb * p.sb_s1);
  }
  const int warp = tid / 32;
  // The thread's token rows row0, row0 + 8 (accumulators 4 c + 2 h + e: token row0 + 8 h, the
  // CTA's weight row 8 c + m0 + e) and the bytes 4 t ... of each 16-byte K column it loads.
  const int row0 = 16 * warp + lane / 4;
  const int m0 = 2 * (lane % 4);
  // Token rows past M load row M - 1's bytes (their outputs are never stored; each output token
  // row depends on its own A row only): the loads are unconditional, so that they write the ring's
  // registers directly. (Round C's SASS: with "row < M ? load : 0" ptxas loaded into temporaries
  // and moved them into the ring right away, and each move waited for its load, so nothing was in
  // flight ahead: 41-46 us b2b at M 64.)
  const int r0 = row0 < p.m ? row0 : p.m - 1, r1 = row0 + 8 < p.m ? row0 + 8 : p.m - 1;
  const int t4 = lane % 4;
  // (32-bit offsets from two base pointers: 64 x K bytes and 64 x K / 128 scales fit easily, and
  // the kernel sits at its register cap.)
  const uint8_t* xa = p.a + 16 * t4;
  const int xo0 = static_cast<int>(r0 * p.lda), xo1 = static_cast<int>(r1 * p.lda);
  const int so0 = static_cast<int>(r0 * p.sa_s0), so1 = static_cast<int>(r1 * p.sa_s0);
  const int sa_s1 = static_cast<int>(p.sa_s1);
  auto load_block = [&](AregBlock& r, int kb) {
    if constexpr (kLoads) {
      const int k0 = kb * kBlockK;
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        // (Columns t + 4 c of both rows: 16-byte loads.)
        uint4 v0, v1;
        if constexpr (kDiag == 4) {
          v0 = ld_cg_v4(xa + (xo0 + k0 + 64 * c));
          v1 = ld_cg_v4(xa + (xo1 + k0 + 64 * c));
        } else {
          v0 = *reinterpret_cast<const uint4*>(xa + (xo0 + k0 + 64 * c));
          v1 = *reinterpret_cast<const uint4*>(xa + (xo1 + k0 + 64 * c));
        }
        r.w[c][0] = v0.x;
        r.w[c][1] = v0.y;
        r.w[c][2] = v0.z;
        r.w[c][3] = v0.w;
        r.w[2 + c][0] = v1.x;
        r.w[2 + c][1] = v1.y;
        r.w[2 + c][2] = v1.z;
        r.w[2 + c][3] = v1.w;
      }
      r.s0 = p.sa[so0 + kb * sa_s1];
      r.s1 = p.sa[so1 + kb * sa_s1];
    }
  };

  // (One prefetch per 128-byte line: the quad's lane 0, rows row0 and row0 + 8.)
  auto prefetch_block = [&](int kb) {
    if (kLoads && kL1Ahead > 0 && t4 == 0 && kb < kb_count) {
      asm volatile("prefetch.global.L1 [%0];\n" ::"l"(xa + (xo0 + kb * kBlockK)));
      asm volatile("prefetch.global.L1 [%0];\n" ::"l"(xa + (xo1 + kb * kBlockK)));
    }
  };

  [[maybe_unused]] uint32_t hsel[kAcc / 4][2] = {};
  token_scale_masks(hsel, r_begin + m0, blk0);
  const uint32_t full0 = smem_addr(full_bar), empty0 = smem_addr(empty_bar);
  const uint32_t lbo = static_cast<uint32_t>(rows * 16);  // one 16-byte K column of the chunk

  float acc[kAcc];
#pragma unroll
  for (int j = 0; j < kAcc; ++j) acc[j] = 0.0f;
  float frag[kAregKpb][kAcc];
  AregBlock ring[kAhead];

  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#pragma unroll
  for (int d = 0; d < kAhead; ++d)
    if (d < kb_count) load_block(ring[d], d);
  for (int d = kAhead; d < kL1Ahead; ++d) prefetch_block(d);

  // Stage i's wgmmas (K block q from ring[slot + q]), one commit group per K block (empty groups
  // past the last K block keep the count per stage constant).
  auto issue = [&](int i, int slot) {
    const int s = i % kStages;
    const int left = kb_count - i * kAregKpb;
    if constexpr (kLoads) {
#pragma unroll
      for (int q = 0; q < kAregKpb; ++q)
        if (q < left)
#pragma unroll
          for (int j = 0; j < 4; ++j) quad_transpose(ring[slot + q].w[j], t4);
    }
    if (!kNoRing) mbar_wait(full0 + 8 * s, (i / kStages) & 1);
    const uint32_t weights = base + static_cast<uint32_t>(s * kAregStageBytes);
    wgmma_fence();  // (the A registers were written by loads since the last wgmmas)
#pragma unroll
    for (int q = 0; q < kAregKpb; ++q) {
      if (q < left && !kRing) {
        const uint32_t w_addr = weights + static_cast<uint32_t>(q) * 8 * lbo;
#pragma unroll
        for (int k = 0; k < kBlockK / 32; ++k) {
          const uint32_t a[4] = {ring[slot + q].frag(k, 0), ring[slot + q].frag(k, 1),
                                 ring[slot + q].frag(k, 2), ring[slot + q].frag(k, 3)};
          wgmma_n40_areg(frag[q], a, smem_desc_interleave(w_addr + 2 * k * lbo, lbo), k);
        }
      }
      wgmma_commit();
    }
  };
  // Stage i's K blocks folded in order as each one's group completes (the row split's order: the
  // stage released once its last group completes, before that K block's fold); as soon as K
  // block kb's group is complete its registers take K block kb + kAhead's loads.
  auto fold = [&](int i, int slot) {
    const int left = kb_count - i * kAregKpb;
#pragma unroll
    for (int q = 0; q < kAregKpb; ++q) {
      wgmma_wait_upto<kAregKpb - 1>(kAregKpb - 1 - q);  // K block q's group complete
      if (q == kAregKpb - 1 && !kNoRing) mbar_arrive(empty0 + 8 * (i % kStages));
      const int kb = i * kAregKpb + q;
      AregBlock& r = ring[slot + q];
      if (q < left) {
        const float t0 = r.s0, t1 = r.s1;
        if constexpr (kDiag >= 2 && kDiag <= 4) {
          uint32_t x = 0;
#pragma unroll
          for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) x ^= r.w[j][e];
          acc[0] += __uint_as_float(x & 0x3FFFFFFFu) + t0 + t1;
        } else if constexpr (!kRing) {
          const float sb0 = s_sb[2 * kb], sb1 = s_sb[2 * kb + 1];
          const float p00 = t0 * sb0, p01 = t0 * sb1, p10 = t1 * sb0, p11 = t1 * sb1;
#pragma unroll
          for (int j = 0; j < kAcc; ++j) {
            const uint32_t msk = hsel[j / 4][j % 2];
            const uint32_t lo = __float_as_uint((j / 2) % 2 ? p10 : p00);
            const uint32_t hi = __float_as_uint((j / 2) % 2 ? p11 : p01);
            acc[j] = fmaf(frag[q][j], __uint_as_float((lo & ~msk) | (hi & msk)), acc[j]);
          }
        }
      }
      if (kb + kAhead < kb_count) load_block(r, kb + kAhead);
      prefetch_block(kb + kL1Ahead);
    }
  };

  asm volatile("cp.async.wait_all;\n" ::: "memory");  // this thread's weight-scale copies
  rows_consumer_barrier<128>();                       // everyone's
  for (int i0 = 0; i0 < steps; i0 += kUnroll) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (i0 + u < steps) {
        issue(i0 + u, u * kAregKpb);
        fold(i0 + u, u * kAregKpb);
      }
    }
  }

  // Epilogue (no wgmma in flight any more): the row split's token-major bf16 pairs. A quad holds
  // the CTA's weight rows 8 c + 2 q + {0, 1} of tokens row0 and row0 + 8; where a token's outputs
  // start on an odd element, each lane pairs its odd column with the next lane's even one.
  const int q = lane % 4, next = (lane & ~3) | ((q + 1) & 3);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    uint16_t v0[kAcc / 4 + 1], v1[kAcc / 4], nb[kAcc / 4 + 1];
#pragma unroll
    for (int c = 0; c < kAcc / 4; ++c) {
      v0[c] = float_to_bf16(acc[4 * c + 2 * h]);
      v1[c] = float_to_bf16(acc[4 * c + 2 * h + 1]);
    }
    v0[kAcc / 4] = 0;
#pragma unroll
    for (int c = 0; c <= kAcc / 4; ++c)
      nb[c] = static_cast<uint16_t>(__shfl_sync(0xffffffffu, v0[c], next));
    const int m = row0 + 8 * h;
    uint16_t* dst = p.out + m * p.ldo + r_begin;
    const bool odd = ((reinterpret_cast<uintptr_t>(dst) >> 1) & 1u) != 0;
    if (m < p.m) {
      if (odd && q == 0 && rows > 0) store_out(dst, v0[0]);
#pragma unroll
      for (int c = 0; c < kAcc / 4; ++c) {
        const int col = 8 * c + 2 * q + (odd ? 1 : 0);
        const uint16_t lo = odd ? v1[c] : v0[c];
        const uint16_t hi = odd ? (q < 3 ? nb[c] : nb[c + 1]) : v1[c];
        store_out_clipped(dst, col, lo, hi, rows);
      }
    }
  }
  if (p.trace != nullptr && tid == 0) {  // (no wgmma in flight any more)
    unsigned long long* t = p.trace + int64_t{blockIdx.x} * kRowsTraceWords;
    t[6] = static_cast<unsigned long long>(clock64());
    t[7] = global_ns();
  }
}

}  // namespace m3attn::gemm_wgmma_detail
