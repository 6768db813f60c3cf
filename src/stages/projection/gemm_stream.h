// The streaming decode GEMM (gemm_stream_kernel.cuh): the math of run_gemm_cpu (SPEC section 2)
// for M <= 16, every weight row read in contiguous runs of 1 or 2 KB (1D bulk copies) by one CTA
// per SM, FP8 wgmma on the runs as they land (a run of W K blocks is W rows of a 64-row wgmma
// tile; the block dot products sit on a "diagonal" of the result), stream-K split with a
// deterministic in-kernel reduction.
// Contract (besides validate_gemm):
//   - every tensor on the current CUDA device, an sm_90 device;
//   - 1 <= M <= 16 (M <= 8 with runs of 16 K blocks; M == 0 launches nothing); any scale strides
//     validate_gemm accepts;
//   - the activations (M x K bytes, M rounded up to the kernel's tile) fit in shared memory next
//     to a ring of at least two 16 KB stages (K <= ~12K at M 16); otherwise kUnsupported;
//   - a workspace of at least gemm_stream_workspace_bytes(N) bytes, 256-byte aligned, whose first
//     gemm_stream_counter_bytes(N) bytes are zero before the first call (cudaMemset once): every
//     launch leaves them zero again. One workspace serves one stream at a time.
// Deterministic (results depend on the launch shape only, never on timing), allocates nothing,
// never synchronizes, CUDA-graph capturable.
#pragma once

#if defined(M3ATTN_WITH_CUDA)
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "m3attn/status.h"
#include "stages/projection/projection.h"

namespace m3attn {

struct GemmStreamOptions {
  // K blocks per weight-row run (one bulk copy, one 16 KB stage = 128 / this rows x this): 8
  // (1 KB runs, M <= 16) or 16 (2 KB runs, M <= 8: twice the wasted tensor work); 0 = automatic
  // (8).
  int chunk_blocks = 0;
  // CTAs (0: ctas_per_sm per SM, at most the number of units). At most the grid the workspace
  // was sized for.
  int grid = 0;
  // CTAs sharing an SM (1 .. 4): each gets 1 / ctas_per_sm of the SM's shared memory (fewer
  // stages); more producer warps per SM. (M > 8, or M > 4 with runs of 16 blocks, runs one per
  // SM: registers.)
  int ctas_per_sm = 1;
  // Ring depth limit (0: as many stages as shared memory holds, at most 16).
  int max_stages = 0;
  // Load the weights with an L2 evict-first policy (they are read once).
  bool weight_evict_first = true;
  // Programmatic dependent launch: the first ring of weights is requested before
  // griddepcontrol.wait; activations, scales and every write come after it. The preceding kernel
  // must not write the weights.
  bool programmatic_launch = false;
  // Every CTA executes griddepcontrol.launch_dependents at its start, so a kernel launched next
  // with programmatic dependent launch (which waits before touching what this GEMM writes, as
  // this kernel does with programmatic_launch) may start on the SMs this grid's first finishers
  // leave. No effect on plain launches that follow.
  bool trigger_dependents = false;
  // Weights copied by 16-byte cp.async from every producer lane instead of one 1D bulk copy per
  // row run (session 13, round B: bulk copies delivered ~1.8 TB/s; variant under test).
  bool async_copies = false;
  // The consumers issue the wgmmas of two units before one wait where registers allow (M <= 8,
  // or M <= 4 with runs of 16 blocks), overlapping two units' tensor latency and fold (session 13,
  // round C: the consumers' per-unit latency, not DRAM, bounded the kernel: 3 CTAs per SM were
  // 21 % faster than one at M 1).
  bool pair_units = true;
};

constexpr int64_t kGemmStreamMaxM = 16;

// Bytes of the arrival counters at the start of the workspace (zero between calls).
size_t gemm_stream_counter_bytes(int64_t n);
// Workspace bytes for N columns with grids up to max_grid CTAs (0: four per SM of the current
// device, the most GemmStreamOptions::ctas_per_sm asks for).
Result<size_t> gemm_stream_workspace_bytes(int64_t n, int max_grid = 0);

// Whether the current device can run the kernel (sm_90: bulk copies, wgmma).
bool gemm_stream_device_supported();

Status run_gemm_stream_cuda(const GemmParams& p, void* workspace, size_t workspace_bytes,
                            cudaStream_t stream, const GemmStreamOptions& options = {});

}  // namespace m3attn

#endif  // M3ATTN_WITH_CUDA
