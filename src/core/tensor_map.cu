#include <mutex>

#include "core/cuda_check.h"
#include "core/tensor_map.h"

namespace m3attn {

Result<PFN_cuTensorMapEncodeTiled_v12000> tensor_map_encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static cudaError_t error = cudaSuccess;
  static cudaDriverEntryPointQueryResult query = cudaDriverEntryPointSuccess;
  static std::once_flag once;
  std::call_once(once, [] {
    void* p = nullptr;
    error = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                             &query);
    if (error == cudaSuccess && query == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  });
  if (fn) return fn;
  return make_status(StatusCode::kCudaError,
                     "cudaGetDriverEntryPointByVersion(cuTensorMapEncodeTiled) failed: ",
                     cudaGetErrorString(error), " (query result ", static_cast<int>(query), ")");
}

Status encode_tensor_map_2d(CUtensorMap* map, CUtensorMapDataType type, const void* data,
                            int64_t rows, int64_t cols, int64_t row_bytes, int box_rows,
                            int box_cols, CUtensorMapSwizzle swizzle,
                            CUtensorMapL2promotion promotion, const char* what) {
  Result<PFN_cuTensorMapEncodeTiled_v12000> fn = tensor_map_encode_fn();
  M3_RETURN_IF_ERROR(fn.status());
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(row_bytes)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = fn.value()(map, type, 2, const_cast<void*>(data), dims, strides, box,
                                elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, promotion,
                                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return make_status(StatusCode::kCudaError, "cuTensorMapEncodeTiled(", what,
                       ") failed: CUresult ", static_cast<int>(r), " (rows ", rows, ", cols ", cols,
                       ", row bytes ", row_bytes, ", box ", box_rows, " x ", box_cols, ")");
  return Status::Ok();
}

Status current_device_info(CudaDeviceInfo* info) {
  M3_CUDA_RETURN_IF_ERROR(cudaGetDevice(&info->device));
  M3_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&info->sms, cudaDevAttrMultiProcessorCount, info->device));
  M3_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&info->major, cudaDevAttrComputeCapabilityMajor, info->device));
  return Status::Ok();
}

}  // namespace m3attn
