// Launch of the row split's K split (device code in gemm_wgmma_rows_ksplit_kernel.cuh; validated
// by run_gemm_wgmma_cuda in gemm_wgmma.cu).
#include <atomic>

#include "core/cuda_check.h"
#include "core/pdl.cuh"
#include "stages/projection/gemm_wgmma_rows_ksplit.h"
#include "stages/projection/gemm_wgmma_rows_ksplit_kernel.cuh"

namespace m3attn::gemm_wgmma_detail {

namespace {

template <int kNw, int kKpb, bool kOneBar, int kDiag>
Status launch(const CUtensorMap& xmap, const RowsArgs& args, int pairs, const CudaDeviceInfo& info,
              cudaStream_t stream) {
  auto* kernel = &gemm_rows_ksplit_kernel<kNw, kKpb, kOneBar, kDiag>;
  constexpr int kMaxLocal = ks_max_local_kblocks<kKpb>();
  constexpr int kMaxSmem = rows_ksplit_smem_bytes<kKpb>(kMaxLocal);
  const int kbl0 = ksplit_local_kblocks(args.kblocks, 0);
  if (kbl0 > kMaxLocal)
    return unsupported("the row K split with ", kKpb, " K blocks per stage stages at most ",
                       kMaxLocal, " K blocks per half, got K = ", int64_t{args.kblocks} * kBlockK);
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
      return make_status(StatusCode::kCudaError, "run_gemm_wgmma_cuda (row K split): no CTA of ",
                         "the n = ", kNw, " kernel fits on an SM (", kMaxSmem,
                         " B of dynamic shared memory)");
    if (info.device < 64) ready[info.device].store(1, std::memory_order_release);
  }
  M3_CUDA_RETURN_IF_ERROR(launch_pdl(kernel, dim3(static_cast<unsigned>(pairs)), dim3(kKsThreads),
                                     static_cast<size_t>(rows_ksplit_smem_bytes<kKpb>(kbl0)),
                                     stream, args.early_weights != 0, xmap, args));
  M3_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

template <int kKpb, bool kOneBar>
Status dispatch(const CUtensorMap& xmap, const RowsArgs& args, int pairs, int diag,
                const CudaDeviceInfo& info, cudaStream_t stream) {
  if (args.m <= 32) return launch<32, kKpb, kOneBar, 0>(xmap, args, pairs, info, stream);
  if (diag == 3) return launch<64, kKpb, kOneBar, 3>(xmap, args, pairs, info, stream);
  if (diag == 4) return launch<64, kKpb, kOneBar, 4>(xmap, args, pairs, info, stream);
  if (diag == 6) return launch<64, kKpb, kOneBar, 6>(xmap, args, pairs, info, stream);
  if (diag == 7) return launch<64, kKpb, kOneBar, 7>(xmap, args, pairs, info, stream);
  return launch<64, kKpb, kOneBar, 0>(xmap, args, pairs, info, stream);
}

}  // namespace

Status launch_rows_ksplit(const CUtensorMap& xmap, const RowsArgs& args, int pairs, int kpb,
                          bool one_barrier, int diag, const CudaDeviceInfo& info,
                          cudaStream_t stream) {
  if (one_barrier) return dispatch<2, true>(xmap, args, pairs, diag, info, stream);
  if (kpb == 1) return dispatch<1, false>(xmap, args, pairs, diag, info, stream);
  return dispatch<2, false>(xmap, args, pairs, diag, info, stream);
}

}  // namespace m3attn::gemm_wgmma_detail
