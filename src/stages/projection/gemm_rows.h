// Internal: the row-split decode GEMM behind GemmWgmmaOptions::row_split
// (gemm_rows_kernel.cuh). run_gemm_wgmma_cuda calls it after the common checks.
#pragma once

#if defined(M3ATTN_WITH_CUDA)
#include <cuda_runtime_api.h>

#include "m3attn/status.h"
#include "stages/projection/gemm_wgmma.h"
#include "stages/projection/projection.h"

namespace m3attn {

// M <= 64; N / (2 x sms) <= 64 rows per warpgroup; 16-byte aligned weight and activation rows.
// No workspace. Returns unsupported(...) outside those rules (nothing launched).
Status run_gemm_rows_cuda(const GemmParams& p, int sms, int device, cudaStream_t stream,
                          const GemmWgmmaOptions& options);

}  // namespace m3attn

#endif  // M3ATTN_WITH_CUDA
