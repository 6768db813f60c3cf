// Host helpers shared by the TMA kernels' launchers: the driver's tensor-map encoder (looked up
// through the runtime, so nothing links libcuda) and the current device's SM count and major
// version. CUDA builds only.
#pragma once

#if defined(M3ATTN_WITH_CUDA)
#include <cudaTypedefs.h>

#include <cstdint>

#include "m3attn/status.h"

namespace m3attn {

// cuTensorMapEncodeTiled from the driver, looked up once.
Result<PFN_cuTensorMapEncodeTiled_v12000> tensor_map_encode_fn();

// A 2D map over rows x cols elements of `type` (cols contiguous, rows `row_bytes` apart), box
// box_rows x box_cols, out-of-bounds elements read as zero (and not written by stores). `what`
// names the operand in the error.
Status encode_tensor_map_2d(CUtensorMap* map, CUtensorMapDataType type, const void* data,
                            int64_t rows, int64_t cols, int64_t row_bytes, int box_rows,
                            int box_cols, CUtensorMapSwizzle swizzle,
                            CUtensorMapL2promotion promotion, const char* what);

struct CudaDeviceInfo {
  int device = -1;
  int sms = 0;
  int major = 0;
};

// The current device, its multiprocessor count and compute capability major version.
Status current_device_info(CudaDeviceInfo* info);

}  // namespace m3attn

#endif  // M3ATTN_WITH_CUDA
