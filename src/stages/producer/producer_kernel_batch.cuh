// The per-batch producer kernel (ProducerCudaKernel::kPerBatch, the default below 2^17 tasks): one
// block per batch of 32 kU tasks (group g takes tasks base + u * 32 + g), then exit.
//
// kU (tasks per group) is 3 for large batches (96 B of loads in flight per thread, 64 registers,
// 4 blocks of 256 threads per SM: ~96 KB in flight per SM) and 1 below one full wave of blocks,
// where more and shorter blocks cut the latency of decode-sized calls.
//
// Measured (kept for the record):
//   per-batch  (producer_kernel): one block per batch, load -> position -> RoPE row -> barrier ->
//              compute -> store -> exit. Measured on the H200 at T 4096: 43.5 us (65% of copy).
//              Model: steady state 9.9 ns/token (70%: 165.0 - 43.5 us over 12,288 tokens) plus
//              ~3 us fixed, so the loss is per-SM concurrency, not the tail. Each block's life is
//              two dependent memory latencies (position, then RoPE row) + compute, and its 24.6 KB
//              of packed reads are in flight only during the first latency.
#pragma once

#include "core/pdl.cuh"
#include "stages/producer/producer_kernel_common.cuh"

namespace m3attn::producer_kernel {

// Below one full wave of 1-task blocks (132 SMs x 4 blocks x 32 tasks, about 220 tokens at M3
// TP1) 3-task groups would leave SMs idle, so 1-task groups trade nothing for a shorter critical
// path per block. Both variants compute identical bytes; only the grid differs.
constexpr int64_t kAssumedSms = 132;  // H200; only tunes the choice, never correctness
constexpr int64_t kSmallBatchTasks = kAssumedSms * 4 * tasks_per_block(kTasksSmall);
inline bool use_small_variant(int64_t tasks) { return tasks < kSmallBatchTasks; }

// Issues the packed loads of the kU tasks this thread's group owns in the batch starting at
// `first` (tasks first + u * 32 + group); tasks past the end read nothing and stay zero.
template <int kU>
__device__ __forceinline__ void load_batch(const KernelArgs& a, uint32_t first, int group, int lane,
                                           LaneRaw (&raw)[kU]) {
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const uint32_t task = first + u * kGroupsPerBlock + group;
    raw[u].a = raw[u].b = make_uint2(0, 0);
    raw[u].c = make_uint4(0, 0, 0, 0);
    if (task < a.num_tasks) {
      uint32_t t, h;
      a.heads.divmod(task, t, h);
      const uint16_t* head =
          a.packed + static_cast<int64_t>(t) * a.packed_stride + static_cast<int64_t>(h) * 128;
      raw[u].a = __ldcs(reinterpret_cast<const uint2*>(head + 4 * lane));
      raw[u].b = __ldcs(reinterpret_cast<const uint2*>(head + 32 + 4 * lane));
      raw[u].c = __ldcs(reinterpret_cast<const uint4*>(head + 64 + 8 * lane));
    }
  }
}

// ------------------------------------------------------------------------------------------------
// The per-batch kernel: one block = one batch of 32 kU tasks, then exit.

template <ProducerMode kMode, int kU>
__global__ void __launch_bounds__(kThreads, 4) producer_kernel(const KernelArgs a) {
  constexpr int kTasksPerBlock = tasks_per_block(kU);
  constexpr int kMaxTokensPerBlock = max_tokens_per_block(kU);
  __shared__ float4 s_norm[kNumNorms][32];  // (1 + w) as fp32, 128 per tensor
  __shared__ float4 s_rope[kMaxTokensPerBlock][kRopeFloats / 4];
  __shared__ int32_t s_pos[kMaxTokensPerBlock];
  __shared__ int32_t s_slot[kMaxTokensPerBlock];

  const int lane = threadIdx.x & (kLanesPerHead - 1);
  const int group = threadIdx.x / kLanesPerHead;
  const uint32_t block_first = blockIdx.x * static_cast<uint32_t>(kTasksPerBlock);
  const uint32_t block_last = min(block_first + kTasksPerBlock, a.num_tasks) - 1;
  const uint32_t t_first = a.heads.div(block_first);
  const uint32_t t_last = a.heads.div(block_last);

  // Phase 2: norm weights, positions, slots and RoPE rows into shared memory (nothing a preceding
  // kernel of the step writes: the metadata is uploaded by copies before the step).
  const auto stage_block_meta = [&] {
    stage_norms(a, s_norm);
    const int n_tok = static_cast<int>(t_last - t_first) + 1;
    for (int e = threadIdx.x; e < n_tok * 16; e += kThreads) {
      const int k = e / 16;
      const int part = e % 16;
      const uint32_t t = t_first + k;
      const int32_t pos = __ldg(a.positions + t);
      if (part == 0) {
        s_pos[k] = pos;
        s_slot[k] = __ldg(a.slots + t);
      }
      float4 r = make_float4(0.f, 0.f, 0.f, 0.f);
      if (static_cast<uint32_t>(pos) < a.max_pos)
        r = __ldg(
            reinterpret_cast<const float4*>(a.rope + static_cast<int64_t>(pos) * kRopeFloats) +
            part);
      s_rope[k][part] = r;
    }
  };

  // Phase 1: issue the packed loads (the preceding GEMM's output). Under a programmatic launch
  // phase 2 runs first, overlapping the preceding kernel's tail, and the packed loads wait for
  // it (pdl_wait: before any read of its output and before any global store of this kernel).
  pdl_launch_dependents();
  LaneRaw raw[kU];
  if (a.programmatic) {
    stage_block_meta();
    pdl_wait();
    load_batch<kU>(a, block_first, group, lane, raw);
  } else {
    load_batch<kU>(a, block_first, group, lane, raw);
    stage_block_meta();
  }
  __syncthreads();

  // ---- phase 3: norm, RoPE, E4M3, store ----
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const uint32_t task = block_first + u * kGroupsPerBlock + group;
    process_task<kMode>(a, raw[u], task, task < a.num_tasks, block_first, t_first, lane, s_norm,
                        s_rope, s_pos, s_slot);
  }
}

}  // namespace m3attn::producer_kernel
