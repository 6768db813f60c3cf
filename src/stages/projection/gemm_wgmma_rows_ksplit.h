// The row split's K split (gemm_wgmma_rows_ksplit_kernel.cuh): its launcher, compiled in its own
// translation unit (gemm_wgmma_rows_ksplit.cu) beside gemm_wgmma.cu, which validates the call.
#pragma once

#if defined(M3ATTN_WITH_CUDA)
#include <cuda.h>
#include <cuda_runtime_api.h>

#include "core/tensor_map.h"
#include "m3attn/status.h"

namespace m3attn::gemm_wgmma_detail {

struct RowsArgs;

// Launches the K split over `pairs` image CTAs (one CTA of two halves each, one per SM) for M =
// args.m rows, 33 ... 64 (the activation map's box: 64 token rows). diag: 0, or the bench
// diagnostics 2 / 3 / 4 / 6 / 7 (results wrong). The caller has validated the shape (M, rows per
// pair, local K blocks).
Status launch_rows_ksplit(const CUtensorMap& xmap, const RowsArgs& args, int pairs, int diag,
                          const CudaDeviceInfo& info, cudaStream_t stream);

}  // namespace m3attn::gemm_wgmma_detail

#endif  // M3ATTN_WITH_CUDA
