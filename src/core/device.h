// What this build and machine can run on.
#pragma once

namespace m3attn {

// True when this build has the CUDA backend and at least one CUDA device is visible.
bool cuda_backend_available();

}  // namespace m3attn
