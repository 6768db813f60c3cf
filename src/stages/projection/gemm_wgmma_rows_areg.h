// The row split with the activations in registers (gemm_wgmma_rows_areg_kernel.cuh): its launcher,
// compiled in its own translation unit (gemm_wgmma_rows_areg.cu) beside gemm_wgmma.cu, which
// validates the call.
#pragma once

#if defined(M3ATTN_WITH_CUDA)
#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/tensor_map.h"
#include "m3attn/status.h"

namespace m3attn::gemm_wgmma_detail {

struct RowsArgs;

// Launches it over `grid` image CTAs (two CTAs per SM; the row split's image) for M = args.m rows,
// 1 ... 64, activations `a` (E4M3 [M, K], rows `lda` bytes apart, 16-byte aligned), a ring of
// `stages` stages (3, 6, or anything else: the deepest, 11), form `form`
// (GemmWgmmaOptions::row_areg_form). diag: 0, or the bench diagnostics 1 / 2 (results wrong). The
// caller has validated the shape (rows per CTA, K).
Status launch_rows_areg(const RowsArgs& args, const void* a, int64_t lda, int grid, int stages,
                        int form, int diag, const CudaDeviceInfo& info, cudaStream_t stream);

}  // namespace m3attn::gemm_wgmma_detail

#endif  // M3ATTN_WITH_CUDA
