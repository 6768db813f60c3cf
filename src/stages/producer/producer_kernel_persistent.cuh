// The persistent producer kernel (ProducerCudaKernel::kPersistent): a grid of SMs x 2 blocks that
// software-pipelines the batches of the per-batch kernel (same per-task code, same bytes).
//
// Measured (kept for the record):
//   persistent (producer_persistent_kernel): SMs x 2 blocks walk the batches with the next
//              batch's packed loads, RoPE rows and the positions two batches ahead in flight
//              during compute. Measured: 43.9 us at T 4096 (64.8%), 158.3 us at 16384 (71.8%):
//              no better. Nsight Compute on both: 116 (persistent) / 64 (per-batch) registers,
//              25% / 50% occupancy, issue slots 54% / 51% busy, IPC 2.4 / 2.3, DRAM 47% / 46% of
//              peak, ALU (integer) the busiest pipe at 35%: neither memory- nor issue-bound, i.e.
//              latency-bound. SM active cycles x IPC / tasks = ~290 warp instructions per 4 tasks
//              (one warp-step): the compute phase is long and, with loads tied to registers, the
//              bytes in flight per SM fall whenever the warps compute.
#pragma once

#include "stages/producer/producer_kernel_batch.cuh"  // load_batch

namespace m3attn::producer_kernel {

// ------------------------------------------------------------------------------------------------
// The persistent kernel: a grid of about (SMs x kPersistentBlocksPerSm) blocks walks the batches
// b = blockIdx.x, + gridDim.x, ... and software-pipelines them. While batch b is computed, the
// block already has in flight: the packed loads of batch b + G (registers), the RoPE rows of
// b + G (cp.async into shared memory, from positions staged one iteration earlier) and the
// positions / slots of b + 2G (cp.async). Per iteration the critical path is
// max(one memory latency, compute) instead of the per-batch kernel's two dependent latencies
// (position -> RoPE row) + compute + launch; each SM keeps ~2 x 24.6 KB of packed reads in
// flight nearly all the time. Shared memory: positions / slots in 3 stages (b, b + G, b + 2G),
// RoPE rows in 2 (b, b + G); one cp.async wait + barrier per iteration orders every reuse (a
// stage is refilled only in the iteration after its last reader, past that barrier).

constexpr int kPersistentTasks = kTasksLarge;  // tasks per group and batch (96 per batch)
constexpr int kPersistentBlocksPerSm = 2;      // ~100 registers per thread fit twice per SM

__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_addr(dst)), "l"(src)
               : "memory");
}
// Copies 16 bytes, or writes 16 zero bytes and reads nothing when `copy` is false.
__device__ __forceinline__ void cp_async16_or_zero(void* dst, const void* src, bool copy) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(copy ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// First task and token of a batch, and its token count.
template <int kU>
__device__ __forceinline__ void batch_tokens(const KernelArgs& a, uint32_t batch, uint32_t& first,
                                             uint32_t& t_first, int& n_tok) {
  first = batch * static_cast<uint32_t>(tasks_per_block(kU));
  const uint32_t last = min(first + tasks_per_block(kU), a.num_tasks) - 1;
  t_first = a.heads.div(first);
  n_tok = static_cast<int>(a.heads.div(last) - t_first) + 1;
}

template <int kU>
__device__ __forceinline__ void stage_pos_slot(const KernelArgs& a, uint32_t batch, int32_t* s_pos,
                                               int32_t* s_slot) {
  uint32_t first, t_first;
  int n_tok;
  batch_tokens<kU>(a, batch, first, t_first, n_tok);
  for (int k = threadIdx.x; k < n_tok; k += kThreads) {
    cp_async4(s_pos + k, a.positions + t_first + k);
    cp_async4(s_slot + k, a.slots + t_first + k);
  }
}

// RoPE rows of the batch's tokens from their staged positions (complete and visible: staged in an
// earlier iteration, before a wait + barrier); zeros for a position outside the table.
template <int kU>
__device__ __forceinline__ void stage_rope(const KernelArgs& a, uint32_t batch,
                                           const int32_t* s_pos,
                                           float4 (*s_rope)[kRopeFloats / 4]) {
  uint32_t first, t_first;
  int n_tok;
  batch_tokens<kU>(a, batch, first, t_first, n_tok);
  for (int e = threadIdx.x; e < n_tok * 16; e += kThreads) {
    const int k = e / 16;
    const int part = e % 16;
    const int32_t pos = s_pos[k];
    const bool ok = static_cast<uint32_t>(pos) < a.max_pos;
    const float* src = a.rope + (ok ? static_cast<int64_t>(pos) * kRopeFloats + part * 4 : 0);
    cp_async16_or_zero(&s_rope[k][part], src, ok);
  }
}

template <ProducerMode kMode>
__global__ void __launch_bounds__(kThreads, kPersistentBlocksPerSm)
    producer_persistent_kernel(const KernelArgs a, uint32_t num_batches) {
  constexpr int kU = kPersistentTasks;
  constexpr int kMaxTok = max_tokens_per_block(kU);
  __shared__ float4 s_norm[kNumNorms][32];
  __shared__ float4 s_rope[2][kMaxTok][kRopeFloats / 4];
  __shared__ int32_t s_pos[3][kMaxTok];
  __shared__ int32_t s_slot[3][kMaxTok];

  // Programmatic dependent launch: no global access before the preceding grid completes.
  pdl_launch_dependents();
  pdl_wait();
  const uint32_t stride = gridDim.x;
  uint32_t b = blockIdx.x;
  if (b >= num_batches) return;  // the launcher never makes such blocks; uniform per block
  const int lane = threadIdx.x & (kLanesPerHead - 1);
  const int group = threadIdx.x / kLanesPerHead;

  // Prologue: positions / slots of b and b + G, the packed loads of b, then b's RoPE rows.
  LaneRaw raw[kU];
  load_batch<kU>(a, b * static_cast<uint32_t>(tasks_per_block(kU)), group, lane, raw);
  stage_pos_slot<kU>(a, b, s_pos[0], s_slot[0]);
  if (b + stride < num_batches) stage_pos_slot<kU>(a, b + stride, s_pos[1], s_slot[1]);
  stage_norms(a, s_norm);
  cp_async_wait_all();
  __syncthreads();
  stage_rope<kU>(a, b, s_pos[0], s_rope[0]);
  cp_async_wait_all();
  __syncthreads();

  int ps = 0;  // positions / slots stage of batch b (of 3)
  int rs = 0;  // RoPE stage of batch b (of 2)
#pragma unroll 1
  for (;;) {
    const uint32_t bn = b + stride;
    const bool has_next = bn < num_batches;
    const int ps1 = ps == 2 ? 0 : ps + 1;
    const int ps2 = ps1 == 2 ? 0 : ps1 + 1;
    LaneRaw next[kU];
    if (has_next) {
      load_batch<kU>(a, bn * static_cast<uint32_t>(tasks_per_block(kU)), group, lane, next);
      stage_rope<kU>(a, bn, s_pos[ps1], s_rope[rs ^ 1]);
      if (bn + stride < num_batches) stage_pos_slot<kU>(a, bn + stride, s_pos[ps2], s_slot[ps2]);
    }

    uint32_t first, t_first;
    int n_tok;
    batch_tokens<kU>(a, b, first, t_first, n_tok);
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const uint32_t task = first + u * kGroupsPerBlock + group;
      process_task<kMode>(a, raw[u], task, task < a.num_tasks, first, t_first, lane, s_norm,
                          s_rope[rs], s_pos[ps], s_slot[ps]);
    }
    if (!has_next) break;
    cp_async_wait_all();
    __syncthreads();
#pragma unroll
    for (int u = 0; u < kU; ++u) raw[u] = next[u];
    b = bn;
    ps = ps1;
    rs ^= 1;
  }
}

// Number of batches (32 kU tasks each) of a call.
constexpr int64_t num_batches(int64_t tasks, int u) {
  return (tasks + tasks_per_block(u) - 1) / tasks_per_block(u);
}

}  // namespace m3attn::producer_kernel
