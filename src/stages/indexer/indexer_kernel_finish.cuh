// Flat decode that selects in its own grid (IndexerCudaOptions::select_barrier): the flat
// scorer's CTAs, launched as a cooperative grid (all resident at once), meet at a grid barrier
// once every block score is in the workspace, then every warp of the grid selects rows (one warp
// per row, strict counts: gt_counts / take_by_counts). No selection kernel, so no dependency
// release between the two grids: session 23's timelines (64 x 8K draft 3) put the selection
// kernel's release 0.73-0.78 us after the scorer's last warp, and its rows 2.8 us after it.
//
// The barrier word is the caller's (zeroed once, used by one call at a time). Each CTA adds 1,
// CTA 0 adds 2^31 - (CTAs - 1): the adds of one barrier sum to 2^31, so the word's top bit flips
// when the last CTA arrives and its low 31 bits return to zero, ready for the next call without a
// reset. A CTA waits until the top bit differs from the value its own add returned. (The low bits
// must be zero before a barrier: with garbage there the top bit could flip early, hence the
// zero-once contract; the word is never a part of the workspace, whose content is arbitrary.)
// Polling: one thread per CTA, relaxed loads with a sleep proportional to the CTAs still
// expected (a CTA that ends early polls rarely while the stream still runs, the last ones poll
// every ~0.1 us), then one fence for the acquire.
#pragma once

#include "stages/indexer/indexer_kernel_mma.cuh"
#include "stages/indexer/indexer_kernel_select.cuh"

namespace m3attn::indexer_kernel {

__device__ __forceinline__ uint32_t ld_relaxed_gpu(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Every CTA of the (cooperative) grid, every thread: returns once every CTA has arrived, with the
// block scores that any CTA wrote before its arrival visible to this CTA's threads.
__device__ __forceinline__ void finish_barrier(uint32_t* word) {
  __syncthreads();  // the CTA's score stores precede thread 0's release
  if (threadIdx.x == 0) {
    const uint32_t n = gridDim.x;
    const uint32_t add = blockIdx.x == 0 ? 0x80000000u - (n - 1) : 1u;
    __threadfence();
    const uint32_t old = atomicAdd(word, add);
    for (;;) {
      const uint32_t w = ld_relaxed_gpu(word);
      if ((w ^ old) & 0x80000000u) break;
      // CTAs still expected: low bits k (CTA 0 not in: n - k), or 2^31 - k (CTA 0 in).
      const uint32_t k = w & 0x7fffffffu;
      const uint32_t left = k < 0x40000000u ? n - min(k, n) : 0x80000000u - k;
      __nanosleep(min(64u + 16u * left, 2048u));
    }
    __threadfence();  // acquire: the other CTAs' scores, released before their adds
  }
  __syncthreads();
}

// Rows row0, row0 + step, ... of the call (every row has at most 63 candidates: max_pages <=
// kCountRow), one warp each; srow: the warp's 64 floats of shared memory. As select_row, with the
// scores read from L2 (other SMs wrote them in this grid: never through this SM's L1) and ranked
// by strict counts.
__device__ __forceinline__ void finish_rows(const KernelArgs& a, int64_t row0, int64_t step,
                                            int first_pos, float* srow) {
  const int lane = threadIdx.x & 31;
  const int64_t rows = int64_t{a.num_tokens} * a.n_kv;
  int pos = first_pos;
  for (int64_t row = row0; row < rows; row += step) {
    if (row != row0) pos = __ldg(a.positions + row / a.n_kv);
    int32_t* out = a.block_ids + row * kTopK;
    const int local = trivial_row(a, out, pos, true);
    if (local < 0) continue;  // warp-uniform
    const float* scores = a.scores + row * a.max_pages;
    const float s0 = lane < local ? __ldcg(scores + lane) : quiet_nan();
    const float s1 = lane + 32 < local ? __ldcg(scores + lane + 32) : quiet_nan();
    srow[lane] = s0;
    srow[lane + 32] = s1;
    __syncwarp();
    float c0 = 0.0f, c1 = 0.0f;
    gt_counts<0, kCountRow>(srow, s0, s1, c0, c1);
    bool t0 = false, t1 = false;
    take_by_counts(s0, s1, static_cast<int>(c0), static_cast<int>(c1), t0, t1);
    emit_taken_row(out, t0, t1, local);
    __syncwarp();  // srow is reused by the warp's next row
  }
}

// The flat scorer (score_mma_kernel's body: overflow tiles, then the flat decode warps), the grid
// barrier, then the selection of every row by the grid's warps. Launched cooperatively, not
// programmatically (a.pdl 0); dynamic shared memory kMmaSmemBytes (the decode rings, free after
// the barrier, hold the warps' row copies).
__global__ void __launch_bounds__(kMmaThreads) score_flat_finish_kernel(const KernelArgs a,
                                                                        uint32_t* barrier) {
  extern __shared__ __align__(kSmemAlign) uint8_t smem[];
  __shared__ OverflowShared sh;
  score_mma_body<false>(a, smem, sh);
  const int warp = threadIdx.x >> 5;
  const int64_t row0 = int64_t{blockIdx.x} * kMmaWarps + warp;
  // The first row's position (an input: no kernel of the step writes it) before the barrier.
  const int first_pos = row0 < int64_t{a.num_tokens} * a.n_kv
                            ? __ldg(a.positions + row0 / a.n_kv)
                            : -1;
  finish_barrier(barrier);
  timeline_mark(a, 3);
  finish_rows(a, row0, int64_t{gridDim.x} * kMmaWarps, first_pos,
              reinterpret_cast<float*>(smem) + warp * kCountRow);
  timeline_mark(a, 4);
}

}  // namespace m3attn::indexer_kernel
