// The producer (SPEC section 3): per token, Gemma RMSNorm + partial NeoX RoPE + one E4M3 rounding
// of the projected heads; compact Q and index-Q out, K/V into the main paged cache and index-K
// into the index cache at slot out_cache_loc[t]. Three modes share one params struct:
//   kFused : packed row [Q | K | V | index-Q | index-K]   (the seed's single producer)
//   kMain  : packed row [Q | K | V]                        (unfused baseline, main producer)
//   kIndex : packed row [index-Q | index-K]                (unfused baseline, index producer)
// Tokens whose slot is < 0 or whose page is >= num_pages write no cache, but their Q / index-Q
// are produced. A position outside [0, max_pos) of the RoPE table is a caller bug that cannot be
// checked on the host without a device sync: such a token writes no cache and its Q / index-Q
// rows are filled with NaN (0x7F) so the error is loud, in both the CPU twin and the kernel.
#pragma once

#include <cstdint>

#include "m3attn/tensor.h"

#if defined(M3ATTN_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace m3attn {

enum class ProducerMode : int { kFused = 0, kMain = 1, kIndex = 2 };
const char* producer_mode_name(ProducerMode mode);

struct ProducerParams {
  ProducerMode mode = ProducerMode::kFused;
  int n_q = 0;   // query heads (kFused, kMain)
  int n_kv = 0;  // KV heads == index-Q heads
  float eps = 1e-6f;
  int64_t num_tokens = 0;  // T

  // Packed BF16 projection rows [T, W] (last stride 1, row stride >= W, 16-byte aligned):
  //   kFused W = (n_q + 3 n_kv + 1) * 128, kMain W = (n_q + 2 n_kv) * 128, kIndex W = (n_kv + 1) *
  //   128
  TensorView packed;
  TensorView positions;  // i32 [T]
  TensorView slots;      // i32 [>= T] out_cache_loc; only the first T are read
  TensorView rope;       // f32 [max_pos, 2, 32] (make_rope_table)
  TensorView q_norm;     // bf16 [128] (kFused, kMain)
  TensorView k_norm;     // bf16 [128] (kFused, kMain)
  TensorView iq_norm;    // bf16 [128] (kFused, kIndex)
  TensorView ik_norm;    // bf16 [128] (kFused, kIndex)

  TensorView q_out;        // e4m3 [T, n_q, 128] contiguous (kFused, kMain)
  TensorView iq_out;       // e4m3 [T, n_kv, 128] contiguous (kFused, kIndex)
  TensorView kv_cache;     // e4m3 [pages, 2, n_kv, 128, 128] strided (kFused, kMain)
  TensorView index_cache;  // e4m3 [pages, 1, 128, 128] strided (kFused, kIndex)
};

// Width W of a packed row for the mode, in columns (see above).
int64_t producer_packed_width(ProducerMode mode, int n_q, int n_kv);

// Every SPEC section 8 rule that applies to the mode; touches nothing.
Status validate_producer(const ProducerParams& p);
// CPU twin (the oracle). Requires CPU views.
Status run_producer_cpu(const ProducerParams& p);
#if defined(M3ATTN_WITH_CUDA)
// CUDA launch: validates, then one kernel; no sync, no allocation (graph-capturable).
Status run_producer_cuda(const ProducerParams& p, cudaStream_t stream);

// Kernel choice of the CUDA producer (all produce identical bytes): kAuto
// picks by batch size (kPerBatch below 2^17 tasks = (token, head) pairs, kTmaPipeline from there);
// kPerBatch is one block per batch of 96 tasks (32 below one wave), kPersistent a grid of about
// SMs x 2 blocks looping over the batches with the next batch's loads in flight, kTmaPipeline a
// persistent warp-specialized grid whose copy warp streams tiles of 64 or 128 tasks into a ring of
// shared-memory stages with bulk copies (TMA) while 8 warps compute.
enum class ProducerCudaKernel : int { kAuto = 0, kPerBatch = 1, kPersistent = 2, kTmaPipeline = 3 };
const char* producer_cuda_kernel_name(ProducerCudaKernel kernel);
struct ProducerCudaOptions {
  ProducerCudaKernel kernel = ProducerCudaKernel::kAuto;
  // Grid of the persistent and bulk-copy kernels (capped at the batch / tile count); 0 = the
  // device's SMs x resident blocks per SM.
  int persistent_blocks = 0;
  // Shared-memory stages of the bulk-copy kernel: 0 = the default (3 with 64-task tiles, 2 with
  // 128-task tiles), else 2..4.
  int tma_stages = 0;
  // Tile order of the bulk-copy kernel: 0 = the default, 1 = interleaved (rounds of one tile per
  // block over consecutive tiles, one moving front, then equal shares of the rest), -1 = each
  // block walks an equal share of the tasks. Same bytes either way.
  int tma_interleave = 0;
  // Task plans in the bulk-copy kernel: 0 = the default, 1 = on (the copy warp precomputes each
  // task's token, head kind, position check and destination row once, a 16-byte plan per task in
  // the stage, so the compute warps skip that work), -1 = off. Same bytes either way.
  int tma_task_plan = 0;
  // Tasks per tile of the bulk-copy kernel: 0 = the default (64 below 2^19 tasks, 128 from there),
  // 128 or 64 (half the bytes per stage, twice the stages in the same shared memory: a shorter
  // pipeline fill, more tiles in flight). Same bytes either way.
  int tma_tile_tasks = 0;
  // Tail blocks of the bulk-copy kernel (against the end-of-kernel imbalance: SMs whose blocks
  // finish early idle while others still work): 0 = the default (on), 1 = on, -1 = off. On: the
  // persistent blocks run full interleaved rounds only, all but the last tma_tail_rounds of them
  // (and the partial last one); the tiles after that go to extra blocks of the same grid that the
  // hardware starts on whichever SM frees a slot first (tma_tail_tiles tiles of tma_tail_tile_tasks
  // tasks each). No atomics, no state across calls. Same bytes either way.
  int tma_tail = 0;
  int tma_tail_rounds = 0;      // 0 = the default (1), else 1..8
  int tma_tail_tiles = 0;       // 0 = the default (1 with 128-task tiles, 2 with 64), else 1..8
  int tma_tail_tile_tasks = 0;  // 0 = the default (64), else 16..tile size
  // Resident blocks per SM the bulk-copy kernel is built for: 0 = the default (4 with task plans,
  // 64-task tiles and 2 or 3 stages, else 3), 3, or 4 (32 compute warps per SM, registers capped
  // at 56; needs task plans and tma_stages 2 or 3, and 64-task tiles to fit 4 blocks in shared
  // memory, else fewer run). Same bytes.
  int tma_blocks_per_sm = 0;
  // Programmatic dependent launch (core/pdl.cuh) of whichever kernel runs: it may start while the
  // preceding kernel of the stream finishes and waits for it (griddepcontrol.wait) before reading
  // `packed` or writing anything; the per-batch kernel stages the norm weights, positions, slots
  // and RoPE rows before that wait. Same bytes either way.
  bool programmatic_launch = false;
};
// The same launch with an explicit kernel choice (benchmarks, tests).
Status run_producer_cuda(const ProducerParams& p, cudaStream_t stream,
                         const ProducerCudaOptions& options);
#endif

}  // namespace m3attn
