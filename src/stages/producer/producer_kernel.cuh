// Device code of the producer (SPEC sections 3-4): kernel templates over the mode.
//
// The kernels, one header each, all on the shared per-task code of producer_kernel_common.cuh:
//   producer_kernel_batch.cuh       per-batch (ProducerCudaKernel::kPerBatch);
//   producer_kernel_persistent.cuh  persistent, register-pipelined (kPersistent);
//   producer_kernel_tma.cuh         bulk-copy (TMA) pipeline (kTmaPipeline), with its task plans
//                                   in producer_kernel_tma_plan.cuh.
// kAuto (the launcher, producer.cu) runs the per-batch kernel below 2^17 (token, head) tasks and
// the bulk-copy kernel from there.
//
// Bytes per token at M3 TP1 (fused): read 9856 * 2 (packed) + 8 (position, slot) + 256 (RoPE row);
// write 64 * 128 (Q) + 4 * 128 (index-Q) + 2 * 4 * 128 (K, V) + 128 (index-K) = 29,832 B. The
// kernel should be bound by HBM bandwidth: ~4.3 TB/s copy gives ~28 us at T = 4096 (~6.9 ns per
// token); 85% of copy is 33.4 us at T 4096 and 134 us at T 16384.
#pragma once

#include "stages/producer/producer_kernel_batch.cuh"       // IWYU pragma: export
#include "stages/producer/producer_kernel_persistent.cuh"  // IWYU pragma: export
#include "stages/producer/producer_kernel_tma.cuh"         // IWYU pragma: export
