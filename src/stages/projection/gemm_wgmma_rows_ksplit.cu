// Launch of the row split's K split (device code in gemm_wgmma_rows_ksplit_kernel.cuh; validated
// by run_gemm_wgmma_cuda in gemm_wgmma.cu).
#include <atomic>

#include "core/cuda_check.h"
#include "core/pdl.cuh"
#include "stages/projection/gemm_wgmma_rows_ksplit.h"
#include "stages/projection/gemm_wgmma_rows_ksplit_kernel.cuh"

namespace m3attn::gemm_wgmma_detail {

namespace {

template <int kDiag, int kForm>
Status launch(const CUtensorMap& xmap, const RowsArgs& args, int pairs, const CudaDeviceInfo& info,
              cudaStream_t stream) {
  auto* kernel = &gemm_rows_ksplit_kernel<kDiag, kForm>;
  using F = KsForm<kForm>;
  constexpr int kMaxSmem = rows_ksplit_smem_bytes<kForm>(F::kMaxLocalKblocks);
  // The shared-memory opt-in once per device (each device has its own module); the grid is one
  // wave of one CTA per SM. The compact form must fit twice on an SM (a chained call's CTA next
  // to this call's): the largest shared-memory carveout, then checked.
  static std::atomic<int> ready[64] = {};  // (one table per instantiation)
  if (info.device >= 64 || ready[info.device].load(std::memory_order_acquire) == 0) {
    M3_CUDA_RETURN_IF_ERROR(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSmem));
    if (F::kCompact)
      M3_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
          kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared));
    int resident = 0;
    M3_CUDA_RETURN_IF_ERROR(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, kKsThreads, kMaxSmem));
    if (resident < F::kCtasPerSm)
      return make_status(StatusCode::kCudaError, "run_gemm_wgmma_cuda (row K split",
                         F::kCompact ? ", compact" : "", "): ", resident, " CTAs fit on an SM (",
                         kMaxSmem, " B of dynamic shared memory); ", F::kCtasPerSm, " are needed");
    if (info.device < 64) ready[info.device].store(1, std::memory_order_release);
  }
  const int kbl0 = ksplit_local_kblocks(args.kblocks, 0);
  M3_CUDA_RETURN_IF_ERROR(launch_pdl(kernel, dim3(static_cast<unsigned>(pairs)), dim3(kKsThreads),
                                     static_cast<size_t>(rows_ksplit_smem_bytes<kForm>(kbl0)),
                                     stream, args.early_weights != 0, xmap, args));
  M3_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

template <int kForm>
Status dispatch(const CUtensorMap& xmap, const RowsArgs& args, int pairs, int diag,
                const CudaDeviceInfo& info, cudaStream_t stream) {
  if (diag == 2) return launch<2, kForm>(xmap, args, pairs, info, stream);
  if (diag == 3) return launch<3, kForm>(xmap, args, pairs, info, stream);
  if (diag == 4) return launch<4, kForm>(xmap, args, pairs, info, stream);
  if (diag == 6) return launch<6, kForm>(xmap, args, pairs, info, stream);
  if (diag == 7) return launch<7, kForm>(xmap, args, pairs, info, stream);
  return launch<0, kForm>(xmap, args, pairs, info, stream);
}

}  // namespace

Status launch_rows_ksplit(const CUtensorMap& xmap, const RowsArgs& args, int pairs, int diag,
                          int compact_slots, const CudaDeviceInfo& info, cudaStream_t stream) {
  if (compact_slots == 3) return dispatch<3>(xmap, args, pairs, diag, info, stream);
  if (compact_slots == 4) return dispatch<4>(xmap, args, pairs, diag, info, stream);
  return dispatch<0>(xmap, args, pairs, diag, info, stream);
}

}  // namespace m3attn::gemm_wgmma_detail
