// Kernels between the layers of the CUDA LayerStack (see residual_norm.h). Both are memory bound
// and tiny next to a layer (decode: 256 rows x 6144 bf16 = 3 MB per pass).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "core/cuda_check.h"
#include "core/numeric.h"
#include "core/pdl.cuh"
#include "engine/residual_norm.h"
#include "engine/synthetic_input.h"
#include "stages/quantize/quantize_group.cuh"

namespace m3attn {

namespace {

constexpr int kThreads = 256;

__global__ void synthetic_embed_kernel(uint64_t seed, const int64_t* __restrict__ token_request,
                                       const int32_t* __restrict__ positions, int hidden,
                                       uint16_t* __restrict__ h) {
  const int64_t t = blockIdx.x;
  const int64_t req = token_request[t];
  const int64_t pos = positions[t];
  uint16_t* row = h + t * hidden;
  for (int c = threadIdx.x; c < hidden; c += blockDim.x)
    row[c] = synthetic_hidden_bf16(seed, req, pos, c);
}

// Row t: h = bf16(h + a) where a != null; returns this thread's fp32 sum of squares of the row's
// (new) values over its channels c = threadIdx.x + k * blockDim.x.
__device__ __forceinline__ float residual_add_sum_squares(uint16_t* __restrict__ hrow,
                                                          const uint16_t* __restrict__ arow,
                                                          int hidden) {
  float ss = 0.0f;
  for (int c = threadIdx.x; c < hidden; c += blockDim.x) {
    float v = bf16_to_float(hrow[c]);
    if (arow != nullptr) {
      const uint16_t nb = float_to_bf16(v + bf16_to_float(arow[c]));
      hrow[c] = nb;
      v = bf16_to_float(nb);
    }
    ss = fmaf(v, v, ss);
  }
  return ss;
}

// 1 / sqrt(mean + eps) of the CTA's partial sums of squares, reduced in a fixed order (warp tree,
// then the warps in turn). Every thread of the CTA must call it (one barrier).
__device__ __forceinline__ float cta_inv_rms(float ss, float* s_part, int hidden, float eps) {
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if ((threadIdx.x & 31) == 0) s_part[threadIdx.x >> 5] = ss;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < kThreads / 32; ++w) total += s_part[w];
  return 1.0f / sqrtf(total / static_cast<float>(hidden) + eps);
}

__global__ void residual_rmsnorm_kernel(uint16_t* __restrict__ h, const uint16_t* __restrict__ a,
                                        uint16_t* __restrict__ x, int hidden, float eps) {
  pdl_launch_dependents();  // programmatic dependent launch: no global access before the wait
  pdl_wait();
  __shared__ float s_part[kThreads / 32];
  const int64_t t = blockIdx.x;
  uint16_t* hrow = h + t * hidden;
  const float ss = residual_add_sum_squares(hrow, a != nullptr ? a + t * hidden : nullptr, hidden);
  if (x == nullptr) return;  // uniform across the CTA: no barrier below is skipped by a subset
  const float inv = cta_inv_rms(ss, s_part, hidden, eps);
  // Each thread re-reads only the channels it wrote itself: no barrier needed for h.
  for (int c = threadIdx.x; c < hidden; c += blockDim.x)
    x[t * hidden + c] = float_to_bf16(bf16_to_float(hrow[c]) * inv);
}

// residual_rmsnorm_kernel's add and sum of squares (same thread-to-channel map and reduction
// order, so the same inv_rms), then x = bf16(h * inv_rms) quantized per 128 channels by half-warps
// (quantize_kernel.cuh's group math). Rows [rows, m_pad): q = 0, scale = 1. One CTA per row.
__global__ void __launch_bounds__(kThreads)
    residual_rmsnorm_quantize_kernel(uint16_t* __restrict__ h, const uint16_t* __restrict__ a,
                                     int hidden, int64_t rows, float eps, uint8_t* __restrict__ q,
                                     float* __restrict__ scales, int64_t s0, int64_t s1) {
  using namespace quantize_detail;
  pdl_launch_dependents();  // programmatic dependent launch: no global access before the wait
  pdl_wait();
  __shared__ float s_part[kThreads / 32];
  const int64_t t = blockIdx.x;
  const int groups = hidden / 128;
  const int sub = static_cast<int>(threadIdx.x) % kThreadsPerGroup;
  const int first_group = static_cast<int>(threadIdx.x) / kThreadsPerGroup;
  constexpr int kGroupsPerPass = kThreads / kThreadsPerGroup;
  uint8_t* qrow = q + t * hidden;
  if (t >= rows) {  // padding row of the GEMM: contributes nothing
    for (int g = first_group; g < groups; g += kGroupsPerPass) {
      *reinterpret_cast<uint2*>(qrow + g * 128 + sub * 8) = make_uint2(0u, 0u);
      if (sub == 0) scales[t * s0 + g * s1] = 1.0f;
    }
    return;
  }
  uint16_t* hrow = h + t * hidden;
  const float ss = residual_add_sum_squares(hrow, a != nullptr ? a + t * hidden : nullptr, hidden);
  // The barrier inside also makes every thread's h stores visible to the whole CTA.
  const float inv = cta_inv_rms(ss, s_part, hidden, eps);
  // A group's 16 lanes share first_group, so each half-warp walks its groups together.
  const unsigned half_mask = half_warp_mask();
  for (int g = first_group; g < groups; g += kGroupsPerPass) {
    float x[8];
    // A plain load: h was written by this kernel (no read-only cache path).
    unpack_bf16x8(*reinterpret_cast<const uint4*>(hrow + g * 128 + sub * 8), x);
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = bf16_to_float(float_to_bf16(x[i] * inv));
    float scale;
    *reinterpret_cast<uint2*>(qrow + g * 128 + sub * 8) = quantize_group8(x, half_mask, &scale);
    if (sub == 0) scales[t * s0 + g * s1] = scale;
  }
}

Status check_rows(int64_t rows, int hidden, const char* what) {
  M3_CHECK_ARG(rows >= 0 && rows < (int64_t{1} << 31), what, ": rows ", rows, " outside [0, 2^31)");
  M3_CHECK_ARG(hidden > 0, what, ": hidden ", hidden, " must be > 0");
  return Status::Ok();
}

}  // namespace

Status run_synthetic_embed_cuda(uint64_t seed, const int64_t* token_request,
                                const int32_t* positions, int64_t rows, int hidden, uint16_t* h,
                                cudaStream_t stream) {
  M3_RETURN_IF_ERROR(check_rows(rows, hidden, "synthetic embed"));
  if (rows == 0) return Status::Ok();
  M3_CHECK_ARG(token_request && positions && h, "synthetic embed: null pointer");
  synthetic_embed_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
      seed, token_request, positions, hidden, h);
  M3_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

Status run_residual_rmsnorm_cuda(uint16_t* h, const uint16_t* a, uint16_t* x, int64_t rows,
                                 int hidden, float eps, cudaStream_t stream, bool programmatic) {
  M3_RETURN_IF_ERROR(check_rows(rows, hidden, "residual rmsnorm"));
  M3_CHECK_ARG(std::isfinite(eps) && eps > 0, "residual rmsnorm: eps ", eps, " must be > 0");
  if (rows == 0) return Status::Ok();
  M3_CHECK_ARG(h != nullptr, "residual rmsnorm: null h");
  M3_CUDA_RETURN_IF_ERROR(launch_pdl(residual_rmsnorm_kernel, dim3(static_cast<unsigned>(rows)),
                                     dim3(kThreads), 0, stream, programmatic, h, a, x, hidden,
                                     eps));
  M3_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

Status run_residual_rmsnorm_quantize_cuda(uint16_t* h, const uint16_t* a, const QuantizeParams& q,
                                          float eps, cudaStream_t stream, bool programmatic) {
  M3_RETURN_IF_ERROR(validate_quantize(q));
  M3_CHECK_ARG(std::isfinite(eps) && eps > 0, "residual rmsnorm quantize: eps ", eps,
               " must be > 0");
  M3_CHECK_ARG(q.out.device.type == DeviceType::kCUDA && q.scales.device.type == DeviceType::kCUDA,
               "residual rmsnorm quantize needs CUDA outputs, got ", q.out.device.to_string(),
               " and ", q.scales.device.to_string());
  const int64_t hidden = q.in.shape[1];
  M3_RETURN_IF_ERROR(check_rows(q.rows, static_cast<int>(hidden), "residual rmsnorm quantize"));
  if (q.rows == 0) return Status::Ok();
  M3_CHECK_ARG(h != nullptr, "residual rmsnorm quantize: null h");
  M3_CHECK_ARG(reinterpret_cast<uintptr_t>(h) % 16 == 0,
               "residual rmsnorm quantize: h must be 16-byte aligned (16-byte loads)");
  const int64_t m_pad = q.out.shape[0];
  M3_CUDA_RETURN_IF_ERROR(launch_pdl(
      residual_rmsnorm_quantize_kernel, dim3(static_cast<unsigned>(m_pad)), dim3(kThreads), 0,
      stream, programmatic, h, a, static_cast<int>(hidden), q.rows, eps, q.out.ptr<uint8_t>(),
      q.scales.ptr<float>(), q.scales.stride[0], q.scales.stride[1]));
  M3_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

}  // namespace m3attn
