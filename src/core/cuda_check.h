// CUDA error helpers: every runtime call and launch is checked and turned into a Status.
#pragma once

#if defined(M3ATTN_WITH_CUDA)
#include <cuda_runtime_api.h>

#include "m3attn/status.h"

#define M3_CUDA_RETURN_IF_ERROR(expr)                                                              \
  do {                                                                                             \
    cudaError_t m3_err_ = (expr);                                                                  \
    if (m3_err_ != cudaSuccess)                                                                    \
      return ::m3attn::make_status(::m3attn::StatusCode::kCudaError, #expr,                        \
                                   " failed: ", cudaGetErrorName(m3_err_), " (",                   \
                                   cudaGetErrorString(m3_err_), ") at ", __FILE__, ":", __LINE__); \
  } while (0)

// After a kernel launch: reports a bad launch configuration without synchronizing.
#define M3_CUDA_CHECK_LAUNCH() M3_CUDA_RETURN_IF_ERROR(cudaGetLastError())

#endif  // M3ATTN_WITH_CUDA
