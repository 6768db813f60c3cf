// Launch of the row split's K split (device code in gemm_wgmma_rows_ksplit_kernel.cuh; validated
// by run_gemm_wgmma_cuda in gemm_wgmma.cu).
#include <atomic>

#include "core/cuda_check.h"
#include "stages/projection/gemm_wgmma_rows_ksplit.h"
#include "stages/projection/gemm_wgmma_rows_ksplit_kernel.cuh"

namespace m3attn::gemm_wgmma_detail {

namespace {

template <int kNw, bool kCl, bool kByCols, int kDiag>
Status launch(const CUtensorMap& xmap, const RowsArgs& args, int pairs, const CudaDeviceInfo& info,
              cudaStream_t stream) {
  auto* kernel = &gemm_rows_ksplit_kernel<kNw, kCl, kByCols, kDiag>;
  constexpr int kThreads = rows_ksplit_threads<kCl>();
  constexpr int kPerSm = kCl ? 2 : 1;
  constexpr int kMaxSmem = rows_ksplit_smem_bytes(kCl, kKsMaxLocalKblocks);
  // The shared-memory opt-in once per device (each device has its own module); the grid is one
  // wave of kPerSm CTAs per SM.
  static std::atomic<int> ready[64] = {};  // (one table per instantiation)
  if (info.device >= 64 || ready[info.device].load(std::memory_order_acquire) == 0) {
    M3_CUDA_RETURN_IF_ERROR(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSmem));
    int resident = 0;
    M3_CUDA_RETURN_IF_ERROR(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, kThreads, kMaxSmem));
    if (resident < kPerSm)
      return make_status(StatusCode::kCudaError, "run_gemm_wgmma_cuda (row K split): only ",
                         resident, " CTAs of the n = ", kNw, " kernel fit on an SM (", kMaxSmem,
                         " B of dynamic shared memory); ", kPerSm, " are needed");
    if (info.device < 64) ready[info.device].store(1, std::memory_order_release);
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(kCl ? 2 * pairs : pairs));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes =
      static_cast<size_t>(rows_ksplit_smem_bytes(kCl, ksplit_local_kblocks(args.kblocks, 0)));
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  int na = 0;
  if (kCl) {
    attr[na].id = cudaLaunchAttributeClusterDimension;
    attr[na].val.clusterDim.x = 2;
    attr[na].val.clusterDim.y = 1;
    attr[na].val.clusterDim.z = 1;
    ++na;
  }
  if (args.early_weights != 0) {
    attr[na].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[na].val.programmaticStreamSerializationAllowed = 1;
    ++na;
  }
  cfg.attrs = attr;
  cfg.numAttrs = static_cast<unsigned>(na);
  M3_CUDA_RETURN_IF_ERROR(cudaLaunchKernelEx(&cfg, kernel, xmap, args));
  M3_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

template <bool kCl, bool kByCols>
Status dispatch(const CUtensorMap& xmap, const RowsArgs& args, int pairs, int diag,
                const CudaDeviceInfo& info, cudaStream_t stream) {
  if (args.m <= 32) return launch<32, kCl, kByCols, 0>(xmap, args, pairs, info, stream);
  if (diag == 3) return launch<64, kCl, kByCols, 3>(xmap, args, pairs, info, stream);
  if (diag == 4) return launch<64, kCl, kByCols, 4>(xmap, args, pairs, info, stream);
  if (diag == 6) return launch<64, kCl, kByCols, 6>(xmap, args, pairs, info, stream);
  return launch<64, kCl, kByCols, 0>(xmap, args, pairs, info, stream);
}

}  // namespace

Status launch_rows_ksplit(const CUtensorMap& xmap, const RowsArgs& args, int pairs, bool one_cta,
                          bool by_tokens, int diag, const CudaDeviceInfo& info,
                          cudaStream_t stream) {
  if (one_cta && by_tokens) return dispatch<false, false>(xmap, args, pairs, diag, info, stream);
  if (one_cta) return dispatch<false, true>(xmap, args, pairs, diag, info, stream);
  if (by_tokens) return dispatch<true, false>(xmap, args, pairs, diag, info, stream);
  return dispatch<true, true>(xmap, args, pairs, diag, info, stream);
}

}  // namespace m3attn::gemm_wgmma_detail
