// Activation quantization: the CUDA launcher (validation shared with the CPU twin).
#include <algorithm>
#include <cstdint>

#include "core/cuda_check.h"
#include "core/pdl.cuh"
#include "stages/quantize/quantize.h"
#include "stages/quantize/quantize_kernel.cuh"

namespace m3attn {

Status run_quantize_cuda(const QuantizeParams& p, cudaStream_t stream, bool programmatic) {
  M3_RETURN_IF_ERROR(validate_quantize(p));
  M3_CHECK_ARG(p.in.device.type == DeviceType::kCUDA && p.out.device.type == DeviceType::kCUDA &&
                   p.scales.device.type == DeviceType::kCUDA,
               "run_quantize_cuda needs CUDA tensors, got input on ", p.in.device.to_string(),
               ", output on ", p.out.device.to_string(), ", scales on ",
               p.scales.device.to_string());

  using namespace quantize_detail;
  QuantizeKernelArgs a;
  a.in = p.in.ptr<const uint16_t>();
  a.in_row_stride = p.in.stride[0];
  a.out = p.out.ptr<uint8_t>();
  a.scales = p.scales.ptr<float>();
  a.s0 = p.scales.stride[0];
  a.s1 = p.scales.stride[1];
  a.rows = p.rows;
  a.m_pad = p.out.shape[0];
  a.kblocks = p.in.shape[1] / 128;
  a.row_fastest = a.s0 < a.s1;  // scale stores of neighbouring groups land side by side
  const int64_t groups = a.m_pad * a.kblocks;
  if (groups == 0) return Status::Ok();  // M_pad == 0: nothing to write, nothing launched

  constexpr int64_t kGroupsPerBlock = kBlockThreads / kThreadsPerGroup;
  // The kernel walks groups with a grid-stride loop, so any grid size is correct; 2^20 blocks
  // (16 M groups) is far past the point where every SM is busy.
  const int64_t blocks =
      std::min<int64_t>((groups + kGroupsPerBlock - 1) / kGroupsPerBlock, int64_t{1} << 20);
  M3_CUDA_RETURN_IF_ERROR(launch_pdl(quantize_rows_kernel, dim3(static_cast<unsigned>(blocks)),
                                     dim3(kBlockThreads), 0, stream, programmatic, a));
  M3_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

}  // namespace m3attn
