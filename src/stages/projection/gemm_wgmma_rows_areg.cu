// Launch of the row split with the activations in registers (device code in
// gemm_wgmma_rows_areg_kernel.cuh; validated by run_gemm_wgmma_cuda in gemm_wgmma.cu).
#include <atomic>

#include "core/cuda_check.h"
#include "core/pdl.cuh"
#include "stages/projection/gemm_wgmma_rows_areg.h"
#include "stages/projection/gemm_wgmma_rows_areg_kernel.cuh"

namespace m3attn::gemm_wgmma_detail {

namespace {

// Forms (GemmWgmmaOptions::row_areg_form, round C A/B): K blocks of activations a consumer thread
// holds in registers ahead of their wgmmas (4: 168 registers, the cap for two CTAs of 160
// threads per SM; 6 spilled) and K blocks prefetched into L1 ahead (0: none).
template <int kForm>
constexpr int kAregAhead = kForm == 1 ? 2 : 4;
template <int kForm>
constexpr int kAregL1Ahead = kForm == 2   ? 8
                             : kForm == 3 ? 12
                                          : 0;

template <int kStages, int kDiag, int kForm>
Status launch(const RowsAregArgs& args, int grid, const CudaDeviceInfo& info, cudaStream_t stream) {
  auto* kernel = &gemm_rows_areg_kernel<kAregAhead<kForm>, kStages, kDiag, kAregL1Ahead<kForm>>;
  constexpr int kSmem = rows_areg_smem_bytes(kStages);
  // The shared-memory opt-in once per device (each device has its own module); two CTAs must fit
  // on an SM (the grid is one wave of them). The carveout asks for no more shared memory than two
  // CTAs need (each also holds 1 KB the system reserves), so that the rest stays L1 (the
  // activations the SM's two CTAs both read).
  static std::atomic<int> ready[64] = {};  // (one table per instantiation)
  if (info.device >= 64 || ready[info.device].load(std::memory_order_acquire) == 0) {
    M3_CUDA_RETURN_IF_ERROR(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
    constexpr int kPerSm = 2 * (kSmem + 1024);
    constexpr int kMaxPerSm = 228 * 1024;
    M3_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel,
                                                 cudaFuncAttributePreferredSharedMemoryCarveout,
                                                 (kPerSm * 100 + kMaxPerSm - 1) / kMaxPerSm));
    int resident = 0;
    M3_CUDA_RETURN_IF_ERROR(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, kAregThreads, kSmem));
    if (resident < 2)
      return make_status(StatusCode::kCudaError, "run_gemm_wgmma_cuda (row split, A in ",
                         "registers): only ", resident, " CTAs fit on an SM (", kSmem,
                         " B of dynamic shared memory); 2 are needed");
    if (info.device < 64) ready[info.device].store(1, std::memory_order_release);
  }
  M3_CUDA_RETURN_IF_ERROR(launch_pdl(kernel, dim3(static_cast<unsigned>(grid)), dim3(kAregThreads),
                                     static_cast<size_t>(kSmem), stream, args.early_weights != 0,
                                     args));
  M3_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

template <int kStages, int kDiag>
Status launch_form(const RowsAregArgs& args, int grid, int form, const CudaDeviceInfo& info,
                   cudaStream_t stream) {
  if (form == 1) return launch<kStages, kDiag, 1>(args, grid, info, stream);
  if (form == 2) return launch<kStages, kDiag, 2>(args, grid, info, stream);
  if (form == 3) return launch<kStages, kDiag, 3>(args, grid, info, stream);
  return launch<kStages, kDiag, 0>(args, grid, info, stream);
}

template <int kStages>
Status launch_diag(const RowsAregArgs& args, int grid, int diag, int form,
                   const CudaDeviceInfo& info, cudaStream_t stream) {
  if (diag == 1) return launch<kStages, 1, 0>(args, grid, info, stream);
  if (diag == 2) return launch_form<kStages, 2>(args, grid, form, info, stream);
  if (diag == 3) return launch<kStages, 3, 0>(args, grid, info, stream);
  if (diag == 4) return launch<kStages, 4, 0>(args, grid, info, stream);
  return launch_form<kStages, 0>(args, grid, form, info, stream);
}

}  // namespace

Status launch_rows_areg(const RowsArgs& args, const void* a, int64_t lda, int grid, int stages,
                        int form, int diag, const CudaDeviceInfo& info, cudaStream_t stream) {
  RowsAregArgs ra;
  static_cast<RowsArgs&>(ra) = args;
  ra.a = static_cast<const uint8_t*>(a);
  ra.lda = lda;
  if (stages == 3) return launch_diag<3>(ra, grid, diag, form, info, stream);
  if (stages == 6) return launch_diag<6>(ra, grid, diag, form, info, stream);
  return launch_diag<kAregMaxStages>(ra, grid, diag, form, info, stream);
}

}  // namespace m3attn::gemm_wgmma_detail
