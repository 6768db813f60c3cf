// Small-M block-scaled FP8 GEMM: validation and launch (device code in gemm_small_m_kernel.cuh).
#include <cstdint>

#include "core/cuda_check.h"
#include "m3attn/config.h"
#include "stages/projection/gemm_cublaslt.h"
#include "stages/projection/gemm_small_m_kernel.cuh"

namespace m3attn {

namespace {

using gemm_small_m_detail::SmallMArgs;

// Closed dispatch over the row count: M <= 8 uses half of the m16 tile, M <= 16 all of it.
Status launch_small_m(const SmallMArgs& args, int64_t n, cudaStream_t stream) {
  using namespace gemm_small_m_detail;
  const int64_t ctas = n / kRowsPerCta;
  // Few CTAs (small N) split K over more warps so that more bytes are in flight.
  const int warps = ctas < 2 * 132 ? kMaxWarps : 4;
  const dim3 grid(static_cast<unsigned>(ctas)), block(static_cast<unsigned>(32 * warps));
  if (args.m <= 8) {
    gemm_small_m_kernel<false><<<grid, block, 0, stream>>>(args);
  } else if (args.m <= kMaxRows) {
    gemm_small_m_kernel<true><<<grid, block, 0, stream>>>(args);
  } else {
    return unsupported("the small-M GEMM kernel serves M <= ", kMaxRows, ", got M = ", args.m);
  }
  M3_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

}  // namespace

Status run_gemm_small_m_cuda(const GemmParams& p, cudaStream_t stream) {
  M3_RETURN_IF_ERROR(validate_gemm(p));
  for (const TensorView* t : {&p.a, &p.a_scales, &p.b, &p.b_scales, &p.out})
    M3_CHECK_ARG(t->device.type == DeviceType::kCUDA,
                 "run_gemm_small_m_cuda needs CUDA tensors, got one on ", t->device.to_string());
  const int64_t m = p.a.shape[0], n = p.b.shape[0], k = p.a.shape[1];
  if (m > gemm_small_m_detail::kMaxRows)
    return unsupported("run_gemm_small_m_cuda serves M <= ", gemm_small_m_detail::kMaxRows,
                       ", got M = ", m, " (use Fp8BlockGemm)");
  M3_CHECK_ARG(n / gemm_small_m_detail::kRowsPerCta < (int64_t{1} << 31),
               "run_gemm_small_m_cuda: N = ", n, " exceeds the grid limit");
  if (m == 0) return Status::Ok();

  SmallMArgs args;
  args.a = p.a.ptr<const uint8_t>();
  args.lda = p.a.stride[0];
  args.sa = p.a_scales.ptr<const float>();
  args.sa_s0 = p.a_scales.stride[0];
  args.sa_s1 = p.a_scales.stride[1];
  args.b = p.b.ptr<const uint8_t>();
  args.ldb = p.b.stride[0];
  args.sb = p.b_scales.ptr<const float>();
  args.sb_s0 = p.b_scales.stride[0];
  args.sb_s1 = p.b_scales.stride[1];
  args.out = p.out.ptr<uint16_t>();
  args.ldo = p.out.stride[0];
  args.m = static_cast<int>(m);
  args.kblocks = static_cast<int>(k / kQuantBlock);
  return launch_small_m(args, n, stream);
}

}  // namespace m3attn
