// Programmatic dependent launch (PDL) on sm_90: the pieces every stage kernel of the decode chain
// uses, so that a captured decode step overlaps each kernel's launch and prologue with the tail
// of the kernel before it.
//
// Contract (CUDA programming guide, "programmatic dependent launch"):
// - A kernel launched with cudaLaunchAttributeProgrammaticStreamSerialization may start before
//   the previous kernel in the stream has finished: as soon as every CTA of that kernel has
//   executed griddepcontrol.launch_dependents (pdl_launch_dependents) or exited.
// - griddepcontrol.wait (pdl_wait) blocks the calling thread until the previous grid has
//   completed and its memory operations are visible. A programmatically launched kernel must
//   call it before its first read of anything an earlier kernel wrote and before its first
//   global write (an earlier kernel may still read the buffer), and every such kernel must call
//   it (in at least one thread that outlives its reads), so that its own completion still
//   implies the completion of everything before it: the next kernel's wait relies on that.
// - Both instructions are no-ops when the kernel was launched normally, so kernels call them
//   unconditionally and the launch site decides (launch_pdl's `programmatic`).
// Graph capture records a programmatic edge for such launches; replay keeps the overlap.
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace m3attn {

__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

__device__ __forceinline__ void pdl_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// Launches `kernel` on `stream`, programmatically (PDL) when `programmatic` is true, with a plain
// stream-ordered launch otherwise. Returns the launch's error code (no synchronization).
template <typename... KernelArgs, typename... Args>
cudaError_t launch_pdl(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem_bytes,
                       cudaStream_t stream, bool programmatic, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem_bytes;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = programmatic ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace m3attn
