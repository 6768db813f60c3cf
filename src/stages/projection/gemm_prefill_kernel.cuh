// Prefill-size block-scaled FP8 GEMM on Hopper (sm_90a), M >= 1024:
//   out bf16 [M, N] = A e4m3 [M, K] (1x128 fp32 scales) x B e4m3 [N, K] (128x128 fp32 scales)^T,
// the math of SPEC section 2 and of run_gemm_cpu: per 128-wide K block an fp32 dot product from
// the tensor cores (wgmma), multiplied by sa[m, kb] * sb[n / 128, kb] and added to an fp32
// accumulator in registers (the promotion keeps the tensor core's reduced-precision accumulation
// to 128 products: "fast accumulation off"), rounded once to bf16.
//
// Why a kernel of our own: cuBLASLt's block-scaled modes reach 1225-1294 TFLOP/s on random
// operands at M 4096-16384 (N 9856, K 6144); the goal is >= 1300.
//
// Shape of the kernel:
//   - persistent: one CTA per SM in clusters of kClM x kClN CTAs, each cluster walking cluster
//     tiles (kClM x kClN output tiles) u = c, c + clusters, ... of a grouped raster order (groups
//     of `group` cluster rows by all cluster columns, row fastest), so a group's A panel stays in
//     L2 while B streams through it once per group;
//   - tile 128 x 128 (N 9856 = 77 x 128; 2464 tiles at M 4096 = 18.7 waves of 132), K block 128;
//   - warp specialisation: warpgroup 0 is the producer (setmaxnreg 56; warp 0 lane 0 issues the
//     TMA copies of A [128 x 128], B [128 x 128] and the 128 activation scales of each K block into
//     a kStages-deep ring with full / empty mbarriers; the warp's lanes prefetch the tile's weight
//     scales, one per K block, and the issuing lane writes the stage's scale into shared memory
//     before the full arrival); warpgroups 1 and 2 are consumers (setmaxnreg 224), 64 rows each;
//   - per K block a consumer issues 4 wgmma m64n128k32 (both operands raw E4M3 from shared memory,
//     128B swizzle) into a temporary fragment, reads its two rows' activation scales and the
//     stage's weight scale while they run, waits, releases the stage and folds the fragment into
//     its fp32 accumulator with one FMA per element; the two warpgroups issue their groups in turns
//     (named barriers), so one folds while the other's wgmmas run;
//   - clusters (variants): CTA (rm, rn) of a kClM x kClN cluster computes output tile (kClM mg +
//     rm, kClN ng + rn); CTAs of one cluster column (same rn) share the B tile, CTAs of one row
//     (same rm) share the A tile: each loads 128 / kClM rows of B and 128 / kClN rows of A and
//     multicasts them to the CTAs sharing them, so the L2 -> shared memory traffic per CTA and K
//     block is 16 / kClN + 16 / kClM KB instead of 32. A stage is free again only when the
//     consumers of every CTA of the cluster released it (every consumer warp arrives on the empty
//     barrier of every CTA of the cluster);
//   - epilogue per warpgroup: bf16 pairs into a 128B-swizzled 64 x 128 shared buffer, one TMA store
//     (clipped at M by the tensor map), which runs while the warpgroup starts its next tile; the
//     buffer is reused only once that store has read it.
// Measured (session 20, projection_bench --shape 9856,6144 --prefill, TFLOP/s from the isolated
// median; integer operands at M 4096 are byte-identical to cuBLASLt's):
//   round A (1x1, both warpgroups issuing freely): 979 against cuBLASLt's 1401;
//   round C: 1x1 1024 against 1432; clusters with release.cluster empty arrivals (one per consumer
//     warp and CTA) 2x1 510, 1x2 482, 2x2 312 (the stage time grew with the remote arrivals);
//     ncu of 1x1: L2 78 % busy, tensor pipe 56 %, 41 % of the warp samples in wgmma.wait_group
//     (the two warpgroups' wgmmas interleaved, finished together, and both folded with the tensor
//     pipe idle);
//   round E (release.cta arrivals; issue in turns or not, same round): 1x2 in turns 1217.6, 2x1 in
//     turns 1169.5 / freely 1009.8, 2x2 (120 CTAs) 1052.2 / 1062.8, 1x1 991.2 / 1042.5, cuBLASLt
//     1421.4; random operands M 4096: 2x1 1093.4 / 966.8, 1x1 870.1 / 993.7 against cuBLASLt's
//     1298.7 / 1243.4; M 16384: 2x1 1137.9 / 1100.9 against 1295.6 / 1140.9 (clocks 1410-1980
//     MHz, power-capped). Free issue and 2x2 were deleted after round E; 1x1 stays (the shape
//     compute-sanitizer's racecheck can launch).
// Requirements (checked by the host): A, B and out 16-byte aligned with 16-byte row strides
// (validate_gemm), activation scales token-major (stride (1, s1), s1 % 4 == 0, 16-byte aligned
// base), any weight-scale strides.
#pragma once

#include <cuda.h>  // CUtensorMap (type only: maps are encoded on the host)
#include <cuda_bf16.h>

#include <cstdint>

#include "core/mbarrier.cuh"
#include "core/ptx.cuh"

namespace m3attn::gemm_prefill_detail {

constexpr int kTileM = 128;
constexpr int kTileN = 128;
constexpr int kBlockK = 128;
constexpr int kThreads = 384;  // producer warpgroup + two consumer warpgroups
constexpr int kStages = 5;
constexpr int kTileBytes = kTileM * kBlockK;       // 16 KB of A or of B per stage
constexpr int kEpiBytes = 64 * kTileN * 2;         // one consumer warpgroup's bf16 tile
constexpr int kAOff = 0;
constexpr int kBOff = kAOff + kStages * kTileBytes;
constexpr int kEpiOff = kBOff + kStages * kTileBytes;
constexpr int kSaOff = kEpiOff + 2 * kEpiBytes;    // [kStages][128] f32 activation scales
constexpr int kSbOff = kSaOff + kStages * kTileM * 4;  // [kStages][4] f32 (one weight scale used)
constexpr int kBarOff = kSbOff + kStages * 16;     // full[kStages], empty[kStages]
constexpr int kSmemBytes = kBarOff + 2 * kStages * 8 + 1024;  // + slack to align to 1024 bytes
static_assert(kSmemBytes <= 227 * 1024, "shared memory");
// setmaxnreg moves registers within the CTA's launch allocation (168 per thread at 384 threads).
constexpr int kLowRegs = 56;
constexpr int kHighRegs = 224;
static_assert(kLowRegs * 128 + kHighRegs * 256 <= 168 * kThreads, "register budget");

struct PrefillArgs {
  const float* sb;  // weight scales (n / 128, kb) at sb[nb * sb_s0 + kb * sb_s1]
  int64_t sb_s0, sb_s1;
  int kblocks;      // K / 128
  int n_tiles;      // N / 128
  int m_groups;     // ceil(M / 128 / kClM): cluster rows
  int n_groups;     // ceil(N / 128 / kClN): cluster columns
  int group;        // raster group, in cluster rows
  int units;        // m_groups * n_groups
};

// ---- PTX helpers ------------------------------------------------------------------------------

using sm90::bulk_commit;
using sm90::bulk_wait_all;
using sm90::bulk_wait_read;
using sm90::fence_proxy_async;
using sm90::map_to_rank;
using sm90::prefetch_tensor_map;
using sm90::smem_addr;
using sm90::smem_desc;
using sm90::tma_load_2d;
using sm90::wgmma_commit;
using sm90::wgmma_fence;
using sm90::wgmma_wait;

// The same box written to the same offset in every CTA of `mask`, completing `bar` (same offset)
// in each of them.
__device__ __forceinline__ void tma_load_2d_multicast(uint32_t dst, const CUtensorMap* map, int x,
                                                      int y, uint32_t bar, uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::"
      "cluster [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar), "h"(mask)
      : "memory");
}

__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, uint32_t src, int x, int y) {
  asm volatile(
      "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(x), "r"(y), "r"(src)
      : "memory");
}


__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// Arrival (default semantics: release at CTA scope) on an mbarrier of any CTA of the cluster
// (a mapa address).
__device__ __forceinline__ void mbar_arrive_remote(uint32_t cluster_addr) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(cluster_addr) : "memory");
}



// Named barrier 1 + wg over the 128 threads of consumer warpgroup wg.
__device__ __forceinline__ void warpgroup_barrier(int wg) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");
}
// Named barrier `id` shared by the two consumer warpgroups: one arrives, the other waits.
__device__ __forceinline__ void named_barrier_sync(int id) {
  asm volatile("bar.sync %0, 256;\n" ::"r"(id) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id) {
  asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory");
}

// wgmma m64n128k32, e4m3 x e4m3 -> f32, both operands from shared memory: d = (scale_d ? d : 0)
// + A B.
#define M3_P8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), \
    "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
__device__ __forceinline__ void wgmma_m64n128k32(float (&d)[64], uint64_t a, uint64_t b,
                                                 int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1;\n}\n"
      : M3_P8(0), M3_P8(8), M3_P8(16), M3_P8(24), M3_P8(32), M3_P8(40), M3_P8(48), M3_P8(56)
      : "l"(a), "l"(b), "r"(scale_d));
}
#undef M3_P8

// Cluster tile (cluster row, cluster column) of unit u in the grouped raster order: groups of
// `group` cluster rows by all cluster columns, row fastest inside a group.
__device__ __forceinline__ void unit_tile(int u, const PrefillArgs& p, int* mg, int* ng) {
  const int per_group = p.group * p.n_groups;
  const int g = u / per_group;
  const int rem = u - g * per_group;
  const int rows = min(p.group, p.m_groups - g * p.group);
  *mg = g * p.group + rem % rows;
  *ng = rem / rows;
}

template <int kClM, int kClN>
__global__ void __launch_bounds__(kThreads, 1)
    gemm_prefill_kernel(const __grid_constant__ CUtensorMap amap,
                        const __grid_constant__ CUtensorMap bmap,
                        const __grid_constant__ CUtensorMap samap,
                        const __grid_constant__ CUtensorMap omap, const PrefillArgs p) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;  // 128B swizzle needs 1024-byte aligned tiles
  uint8_t* smem = smem_raw + (base - raw);
  const uint32_t full0 = base + kBarOff;
  const uint32_t empty0 = full0 + 8 * kStages;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  constexpr int kCluster = kClM * kClN;
  const uint32_t rank = kCluster > 1 ? cluster_rank() : 0;
  const int rm = static_cast<int>(rank) % kClM;  // this CTA's place in the cluster
  const int rn = static_cast<int>(rank) / kClM;

  if (threadIdx.x == 0) {
    prefetch_tensor_map(&amap);
    prefetch_tensor_map(&bmap);
    prefetch_tensor_map(&samap);
    prefetch_tensor_map(&omap);
    for (int s = 0; s < kStages; ++s) {
      sm90::mbar_init(full0 + 8 * s, 1);
      // One arrival per consumer warp of every CTA of the cluster.
      sm90::mbar_init(empty0 + 8 * s, 8 * kCluster);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  if constexpr (kCluster > 1) {
    cluster_sync();
  } else {
    __syncthreads();
  }

  const int clusters = static_cast<int>(gridDim.x) / kCluster;
  const int cid = static_cast<int>(blockIdx.x) / kCluster;

  if (warp < 4) {
    // ---- producer warpgroup -------------------------------------------------------------------
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kLowRegs));
    if (warp == 0) {
      constexpr uint32_t kStageTx = 2 * kTileBytes + kTileM * 4;
      int stage = 0;
      uint32_t phase = 0;
      // Multicast masks: the CTAs of this CTA's cluster row (A) and cluster column (B).
      uint16_t a_mask = 0, b_mask = 0;
      for (int j = 0; j < kClN; ++j) a_mask |= static_cast<uint16_t>(1u << (rm + kClM * j));
      for (int i = 0; i < kClM; ++i) b_mask |= static_cast<uint16_t>(1u << (i + kClM * rn));
      constexpr int kARows = kTileM / kClN;  // rows of the A tile this CTA loads
      constexpr int kBRows = kTileN / kClM;  // rows of the B tile this CTA loads
      // The weight scales of a tile's first 64 K blocks (lane l holds blocks l and 32 + l) are
      // requested one tile ahead, so their latency never stalls the ring at a tile boundary.
      auto tile_scales = [&](int u, int chunk) {
        int mg = 0, ng = 0;
        unit_tile(u, p, &mg, &ng);
        const int nt = min(ng * kClN + rn, p.n_tiles - 1);  // (the last odd column: any valid)
        const int kb = 32 * chunk + lane;
        return kb < p.kblocks ? __ldg(p.sb + nt * p.sb_s0 + kb * p.sb_s1) : 0.0f;
      };
      float next0 = 0.0f, next1 = 0.0f;
      if (cid < p.units) {
        next0 = tile_scales(cid, 0);
        next1 = tile_scales(cid, 1);
      }
      for (int u = cid; u < p.units; u += clusters) {
        int mg = 0, ng = 0;
        unit_tile(u, p, &mg, &ng);
        const int mt = mg * kClM + rm;
        const int nt = ng * kClN + rn;  // (past N / 128 in the last odd cluster column: no scales)
        float sb_reg = next0;
        const float sb_reg1 = next1;
        if (u + clusters < p.units) {
          next0 = tile_scales(u + clusters, 0);
          next1 = tile_scales(u + clusters, 1);
        }
        for (int kb = 0; kb < p.kblocks; ++kb) {
          if ((kb & 31) == 0 && kb > 0) sb_reg = kb == 32 ? sb_reg1 : tile_scales(u, kb / 32);
          const float sbv = __shfl_sync(0xffffffffu, sb_reg, kb & 31);
          sm90::mbar_wait(empty0 + 8 * stage, phase ^ 1u);
          if (lane == 0) {
            const uint32_t full = full0 + 8 * stage;
            reinterpret_cast<float*>(smem + kSbOff)[4 * stage] = sbv;
            sm90::mbar_arrive_expect_tx(full, kStageTx);
            if constexpr (kClN == 1) {
              tma_load_2d(base + kAOff + stage * kTileBytes, &amap, kb * kBlockK, mt * kTileM,
                          full);
            } else {
              tma_load_2d_multicast(base + kAOff + stage * kTileBytes + rn * kARows * kBlockK,
                                    &amap, kb * kBlockK, mt * kTileM + rn * kARows, full, a_mask);
            }
            if constexpr (kClM == 1) {
              tma_load_2d(base + kBOff + stage * kTileBytes, &bmap, kb * kBlockK, nt * kTileN,
                          full);
            } else {
              tma_load_2d_multicast(base + kBOff + stage * kTileBytes + rm * kBRows * kBlockK,
                                    &bmap, kb * kBlockK, nt * kTileN + rm * kBRows, full, b_mask);
            }
            tma_load_2d(base + kSaOff + stage * kTileM * 4, &samap, mt * kTileM, kb, full);
          }
          __syncwarp();
          if (++stage == kStages) {
            stage = 0;
            phase ^= 1u;
          }
        }
      }
    }
  } else {
    // ---- consumer warpgroups ------------------------------------------------------------------
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kHighRegs));
    const int wg = warp / 4 - 1;
    const int tid = static_cast<int>(threadIdx.x) - 128 * (wg + 1);
    const int row = (tid / 32) * 16 + lane / 4;  // fragment rows row and row + 8 of the 64
    const uint32_t epi = base + kEpiOff + wg * kEpiBytes;
    // Empty barriers this warp arrives on: its own CTA's and (cluster) the other CTAs'.
    uint32_t empty_remote[kCluster];
#pragma unroll
    for (int r = 0; r < kCluster; ++r) empty_remote[r] = kCluster > 1 ? map_to_rank(empty0, r) : 0;
    const float* sa_smem = reinterpret_cast<const float*>(smem + kSaOff);
    const float* sb_smem = reinterpret_cast<const float*>(smem + kSbOff);
    int stage = 0;  // ring position of the next stage to issue
    uint32_t phase = 0;
    int rel = 0;  // ring position of the next stage to release
    // Waits for the next stage, issues its 4 wgmmas into t (one commit group) and reads the two
    // rows' scale products of its K block into s0 / s1 while they run.
    // The warpgroups take turns, each group issued only after the other warpgroup's
    // previous one (named barriers 3: "warpgroup 0 issued", 4: "warpgroup 1 issued"), so the
    // tensor cores run one warpgroup's group while the other folds. Without the order both
    // issue as soon as the stage lands, their wgmmas interleave and finish together, and both
    // fold with the tensor pipe idle (round C, ncu: tensor pipe 56 % busy, 41 % of the warp
    // samples waiting for wgmma completion).
    auto issue = [&](float (&t)[64], float& s0, float& s1, bool first) {
      sm90::mbar_wait(full0 + 8 * stage, phase);
      const uint32_t a_addr = base + kAOff + stage * kTileBytes + wg * 64 * kBlockK;
      const uint32_t b_addr = base + kBOff + stage * kTileBytes;
      if (wg == 1) {
        named_barrier_sync(3);
      } else if (!first) {
        named_barrier_sync(4);
      }
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < 4; ++k)
        wgmma_m64n128k32(t, smem_desc(a_addr + 32 * k), smem_desc(b_addr + 32 * k), k);
      wgmma_commit();
      named_barrier_arrive(wg == 0 ? 3 : 4);
      const float sbv = sb_smem[4 * stage];
      s0 = sa_smem[stage * kTileM + wg * 64 + row] * sbv;
      s1 = sa_smem[stage * kTileM + wg * 64 + row + 8] * sbv;
      if (++stage == kStages) {
        stage = 0;
        phase ^= 1u;
      }
    };
    // Releases the oldest issued stage (its wgmmas done, its scales read) to every producer that
    // writes into this CTA. Plain release.cta arrivals, also on the other CTAs' barriers: they
    // publish no data, they only say the stage's reads are over (round C: release.cluster
    // arrivals, one per warp and CTA of the cluster, made every stage 2-3x longer).
    auto release = [&]() {
      __syncwarp();
      if (lane == 0) {
        if constexpr (kCluster == 1) {
          sm90::mbar_arrive(empty0 + 8 * rel);
        } else {
#pragma unroll
          for (int r = 0; r < kCluster; ++r) mbar_arrive_remote(empty_remote[r] + 8 * rel);
        }
      }
      if (++rel == kStages) rel = 0;
    };
    auto fold = [&](float (&acc)[64], const float (&t)[64], float s0, float s1) {
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        acc[4 * j + 0] = fmaf(t[4 * j + 0], s0, acc[4 * j + 0]);
        acc[4 * j + 1] = fmaf(t[4 * j + 1], s0, acc[4 * j + 1]);
        acc[4 * j + 2] = fmaf(t[4 * j + 2], s1, acc[4 * j + 2]);
        acc[4 * j + 3] = fmaf(t[4 * j + 3], s1, acc[4 * j + 3]);
      }
    };
    float acc[64];
    float t[64];
    bool first = true;  // warpgroup 0's first wgmma group waits for nobody
    for (int u = cid; u < p.units; u += clusters) {
      int mg = 0, ng = 0;
      unit_tile(u, p, &mg, &ng);
      const int mt = mg * kClM + rm;
      const int nt = ng * kClN + rn;
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
      for (int kb = 0; kb < p.kblocks; ++kb) {
        float s0, s1;
        issue(t, s0, s1, first);
        first = false;
        wgmma_wait<0>();
        release();
        fold(acc, t, s0, s1);
      }
      // Epilogue: the previous tile's store must have read the buffer before it is rewritten.
      if (tid == 0) bulk_wait_read();
      warpgroup_barrier(wg);
      {
        // Columns 8 j + 2 (lane % 4) + {0, 1} of rows `row` and `row + 8`, as two 64-column boxes
        // of 64 rows x 128 bytes whose 16-byte chunks are permuted by the row's r % 8 = lane / 4.
        // (The base goes through an opaque move so that the 16 chunk addresses are formed here,
        // not hoisted out of the tile loop, where they would hold registers across the K loop.)
        uint32_t tbase;
        asm volatile("mov.u32 %0, %1;\n" : "=r"(tbase) : "r"(epi + row * 128 + 4 * (lane % 4)));
        const int q = lane / 4;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const uint32_t addr = tbase + (j / 8) * (64 * 128) + (((j & 7) ^ q) << 4);
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const __nv_bfloat162 v =
                __floats2bfloat162_rn(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr + h * 8 * 128),
                         "r"(*reinterpret_cast<const uint32_t*>(&v))
                         : "memory");
          }
        }
      }
      fence_proxy_async();  // st.shared -> TMA store
      warpgroup_barrier(wg);
      if (tid == 0) {
        const int y = mt * kTileM + wg * 64;
        tma_store_2d(&omap, epi, nt * kTileN, y);
        tma_store_2d(&omap, epi + 64 * 128, nt * kTileN + 64, y);
        bulk_commit();
      }
    }
    // Warpgroup 1's last "issued" arrival is matched here, so no barrier is left half-complete
    // at exit.
    if (wg == 0 && !first) named_barrier_sync(4);
    if (tid == 0) bulk_wait_all();
  }
  // No CTA of a cluster may exit while another can still write its shared memory or arrive on
  // its barriers.
  if constexpr (kCluster > 1) cluster_sync();
}

}  // namespace m3attn::gemm_prefill_detail
