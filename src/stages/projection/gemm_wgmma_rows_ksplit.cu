// Launch of the row split's K split (device code in gemm_wgmma_rows_ksplit_kernel.cuh; validated
// by run_gemm_wgmma_cuda in gemm_wgmma.cu).
#include <atomic>

#include "core/cuda_check.h"
#include "core/pdl.cuh"
#include "stages/projection/gemm_wgmma_rows_ksplit.h"
#include "stages/projection/gemm_wgmma_rows_ksplit_kernel.cuh"

namespace m3attn::gemm_wgmma_detail {

namespace {

template <int kDiag>
Status launch(const CUtensorMap& xmap, const RowsArgs& args, int pairs, const CudaDeviceInfo& info,
              cudaStream_t stream) {
  auto* kernel = &gemm_rows_ksplit_kernel<kDiag>;
  constexpr int kMaxSmem = rows_ksplit_smem_bytes(kKsMaxLocalKblocks);
  // The shared-memory opt-in once per device (each device has its own module); the grid is one
  // wave of one CTA per SM.
  static std::atomic<int> ready[64] = {};  // (one table per instantiation)
  if (info.device >= 64 || ready[info.device].load(std::memory_order_acquire) == 0) {
    M3_CUDA_RETURN_IF_ERROR(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSmem));
    int resident = 0;
    M3_CUDA_RETURN_IF_ERROR(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, kKsThreads, kMaxSmem));
    if (resident < 1)
      return make_status(StatusCode::kCudaError, "run_gemm_wgmma_cuda (row K split): no CTA fits ",
                         "on an SM (", kMaxSmem, " B of dynamic shared memory)");
    if (info.device < 64) ready[info.device].store(1, std::memory_order_release);
  }
  const int kbl0 = ksplit_local_kblocks(args.kblocks, 0);
  M3_CUDA_RETURN_IF_ERROR(launch_pdl(kernel, dim3(static_cast<unsigned>(pairs)), dim3(kKsThreads),
                                     static_cast<size_t>(rows_ksplit_smem_bytes(kbl0)), stream,
                                     args.early_weights != 0, xmap, args));
  M3_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

}  // namespace

Status launch_rows_ksplit(const CUtensorMap& xmap, const RowsArgs& args, int pairs, int diag,
                          const CudaDeviceInfo& info, cudaStream_t stream) {
  if (diag == 2) return launch<2>(xmap, args, pairs, info, stream);
  if (diag == 3) return launch<3>(xmap, args, pairs, info, stream);
  if (diag == 4) return launch<4>(xmap, args, pairs, info, stream);
  if (diag == 6) return launch<6>(xmap, args, pairs, info, stream);
  if (diag == 7) return launch<7>(xmap, args, pairs, info, stream);
  return launch<0>(xmap, args, pairs, info, stream);
}

}  // namespace m3attn::gemm_wgmma_detail
