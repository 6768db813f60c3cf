#include "core/device.h"

#if defined(M3ATTN_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace m3attn {

bool cuda_backend_available() {
#if defined(M3ATTN_WITH_CUDA)
  int devices = 0;
  return cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0;
#else
  return false;
#endif
}

}  // namespace m3attn
