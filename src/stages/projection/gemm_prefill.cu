// The prefill GEMM: validation, TMA descriptors and launch (device code in
// gemm_prefill_kernel.cuh, contract in gemm_prefill.h).
#include <cudaTypedefs.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "core/cuda_check.h"
#include "core/tensor_map.h"
#include "stages/projection/gemm_prefill.h"
#include "stages/projection/gemm_prefill_kernel.cuh"

namespace m3attn {

namespace {

namespace gp = gemm_prefill_detail;

// 2D map over rows x cols (cols contiguous, rows `row_bytes` apart), box box_rows x box_cols;
// out-of-bounds elements read as zero and are not written by stores.
Status encode_map(CUtensorMap* map, CUtensorMapDataType type, const void* data, int64_t rows,
                  int64_t cols, int64_t row_bytes, int box_rows, int box_cols,
                  CUtensorMapSwizzle swizzle, const char* what) {
  return encode_tensor_map_2d(map, type, data, rows, cols, row_bytes, box_rows, box_cols, swizzle,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, what);
}

// The kernel's launch configuration: `grid` CTAs in clusters of `cluster` along x, the kernel's
// block and dynamic shared memory, on `stream`; `attr` holds the cluster attribute it points to.
cudaLaunchConfig_t cluster_config(int grid, int cluster, cudaStream_t stream,
                                  cudaLaunchAttribute* attr) {
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = static_cast<unsigned>(cluster);
  attr->val.clusterDim.y = 1;
  attr->val.clusterDim.z = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(grid));
  cfg.blockDim = dim3(gp::kThreads);
  cfg.dynamicSmemBytes = gp::kSmemBytes;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cfg;
}

template <int kClM, int kClN>
Status resident_clusters(const CudaDeviceInfo& info, int* resident_out) {
  constexpr int kCluster = kClM * kClN;
  auto* kernel = &gp::gemm_prefill_kernel<kClM, kClN>;
  // Clusters resident at once (one CTA per SM; a GPC may leave SMs unused): the persistent grid
  // never exceeds one wave. Asked once per device (the shared-memory opt-in is per device too).
  static std::atomic<int> resident_of[64] = {};  // (one table per instantiation)
  int resident = info.device < 64 ? resident_of[info.device].load(std::memory_order_acquire) : 0;
  if (resident == 0) {
    M3_CUDA_RETURN_IF_ERROR(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, gp::kSmemBytes));
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg =
        cluster_config(info.sms / kCluster * kCluster, kCluster, nullptr, &attr);
    M3_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveClusters(&resident, kernel, &cfg));
    if (resident < 1)
      return make_status(StatusCode::kCudaError, "run_gemm_prefill_cuda: no cluster of ", kCluster,
                         " CTAs fits (", gp::kSmemBytes, " B of dynamic shared memory)");
    if (info.device < 64) resident_of[info.device].store(resident, std::memory_order_release);
  }
  *resident_out = resident;
  return Status::Ok();
}

template <int kClM, int kClN>
Status launch(const CUtensorMap& amap, const CUtensorMap& bmap, const CUtensorMap& samap,
              const CUtensorMap& omap, const gp::PrefillArgs& args, const CudaDeviceInfo& info,
              cudaStream_t stream) {
  constexpr int kCluster = kClM * kClN;
  int resident = 0;
  M3_RETURN_IF_ERROR((resident_clusters<kClM, kClN>(info, &resident)));
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg =
      cluster_config(std::min(resident, args.units) * kCluster, kCluster, stream, &attr);
  M3_CUDA_RETURN_IF_ERROR(cudaLaunchKernelEx(&cfg, &gp::gemm_prefill_kernel<kClM, kClN>, amap, bmap,
                                             samap, omap, args));
  return Status::Ok();
}

Status check_options(const GemmPrefillOptions& o) {
  const int shape = 10 * o.cluster_m + o.cluster_n;
  M3_CHECK_ARG(shape == 11 || shape == 21 || shape == 12, "GemmPrefillOptions cluster ",
               o.cluster_m, " x ", o.cluster_n, ": must be 1 x 1, 2 x 1 or 1 x 2");
  M3_CHECK_ARG(o.group_m >= 1, "GemmPrefillOptions::group_m = ", o.group_m, " must be >= 1");
  return Status::Ok();
}

}  // namespace

Result<int> gemm_prefill_max_ctas(const GemmPrefillOptions& options) {
  M3_RETURN_IF_ERROR(check_options(options));
  CudaDeviceInfo info;
  M3_RETURN_IF_ERROR(current_device_info(&info));
  if (info.major != 9)
    return unsupported("run_gemm_prefill_cuda needs an sm_90 device (wgmma, TMA)");
  int resident = 0;
  const int cm = options.cluster_m, cn = options.cluster_n;
  if (cm == 1 && cn == 1) M3_RETURN_IF_ERROR((resident_clusters<1, 1>(info, &resident)));
  if (cm == 2 && cn == 1) M3_RETURN_IF_ERROR((resident_clusters<2, 1>(info, &resident)));
  if (cm == 1 && cn == 2) M3_RETURN_IF_ERROR((resident_clusters<1, 2>(info, &resident)));
  return resident * cm * cn;
}

Status gemm_prefill_supported(const GemmParams& p) {
  const TensorView& s = p.a_scales;
  const int64_t m = p.a.shape[0], kb = p.a.shape[1] / 128;
  if (!(s.stride[0] == 1 || m <= 1) || !(s.stride[1] % 4 == 0 || kb <= 1))
    return unsupported("run_gemm_prefill_cuda needs token-major activation scales (strides (1, s1)",
                       " with s1 % 4 == 0), got strides (", s.stride[0], ", ", s.stride[1], ")");
  if (reinterpret_cast<uintptr_t>(s.data) % 16 != 0)
    return unsupported("run_gemm_prefill_cuda needs 16-byte aligned activation scales");
  CudaDeviceInfo info;
  M3_RETURN_IF_ERROR(current_device_info(&info));
  if (info.major != 9)
    return unsupported("run_gemm_prefill_cuda needs an sm_90 device (wgmma, TMA); device ",
                       info.device, " has compute capability ", info.major, ".x");
  return Status::Ok();
}

Status run_gemm_prefill_cuda(const GemmParams& p, cudaStream_t stream,
                             const GemmPrefillOptions& options) {
  M3_RETURN_IF_ERROR(validate_gemm(p));
  for (const TensorView* t : {&p.a, &p.a_scales, &p.b, &p.b_scales, &p.out})
    M3_CHECK_ARG(t->device.type == DeviceType::kCUDA,
                 "run_gemm_prefill_cuda needs CUDA tensors, got one on ", t->device.to_string());
  M3_RETURN_IF_ERROR(check_options(options));
  M3_RETURN_IF_ERROR(gemm_prefill_supported(p));
  CudaDeviceInfo info;
  M3_RETURN_IF_ERROR(current_device_info(&info));
  M3_CHECK_ARG(p.a.device.index == info.device, "run_gemm_prefill_cuda: tensors are on ",
               p.a.device.to_string(), " but the current device is ", info.device);
  const int64_t m = p.a.shape[0], n = p.b.shape[0], k = p.a.shape[1];
  M3_CHECK_ARG(n < (int64_t{1} << 31) && k < (int64_t{1} << 31), "run_gemm_prefill_cuda: N = ", n,
               " and K = ", k, " must be below 2^31 (TMA coordinates are 32-bit)");
  if (m == 0) return Status::Ok();
  const int cm = options.cluster_m, cn = options.cluster_n;
  const int64_t m_tiles = (m + gp::kTileM - 1) / gp::kTileM;
  const int64_t m_groups = (m_tiles + cm - 1) / cm;
  const int64_t n_tiles = n / gp::kTileN;
  const int64_t n_groups = (n_tiles + cn - 1) / cn;
  M3_CHECK_ARG(m_groups * n_groups < (int64_t{1} << 31),
               "run_gemm_prefill_cuda: ", m_groups * n_groups, " cluster tiles must be below 2^31");

  CUtensorMap amap, bmap, samap, omap;
  M3_RETURN_IF_ERROR(encode_map(&amap, CU_TENSOR_MAP_DATA_TYPE_UINT8, p.a.data, m, k, p.a.stride[0],
                                gp::kTileM / cn, gp::kBlockK, CU_TENSOR_MAP_SWIZZLE_128B, "A"));
  M3_RETURN_IF_ERROR(encode_map(&bmap, CU_TENSOR_MAP_DATA_TYPE_UINT8, p.b.data, n, k, p.b.stride[0],
                                gp::kTileN / cm, gp::kBlockK, CU_TENSOR_MAP_SWIZZLE_128B, "B"));
  // Activation scales as a [K / 128, M] f32 matrix (rows s1 floats apart); box 1 x 128.
  const int64_t kb = k / gp::kBlockK;
  const int64_t sa_row = kb > 1 ? p.a_scales.stride[1] * 4 : 16 * ((m * 4 + 15) / 16);
  M3_RETURN_IF_ERROR(encode_map(&samap, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, p.a_scales.data, kb, m,
                                sa_row, 1, gp::kTileM, CU_TENSOR_MAP_SWIZZLE_NONE, "A scales"));
  // Output: bf16 boxes of 64 rows x 64 columns (128 bytes, the 128B swizzle's row).
  M3_RETURN_IF_ERROR(encode_map(&omap, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, p.out.data, m, n,
                                p.out.stride[0] * 2, 64, 64, CU_TENSOR_MAP_SWIZZLE_128B, "out"));

  gp::PrefillArgs args;
  args.sb = p.b_scales.ptr<const float>();
  args.sb_s0 = p.b_scales.stride[0];
  args.sb_s1 = p.b_scales.stride[1];
  args.kblocks = static_cast<int>(kb);
  args.n_tiles = static_cast<int>(n_tiles);
  args.m_groups = static_cast<int>(m_groups);
  args.n_groups = static_cast<int>(n_groups);
  args.group = std::max(1, (options.group_m + cm - 1) / cm);
  args.units = static_cast<int>(m_groups * n_groups);
  if (cm == 2) return launch<2, 1>(amap, bmap, samap, omap, args, info, stream);
  if (cn == 2) return launch<1, 2>(amap, bmap, samap, omap, args, info, stream);
  return launch<1, 1>(amap, bmap, samap, omap, args, info, stream);
}

}  // namespace m3attn
