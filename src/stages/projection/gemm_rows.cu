// The row-split decode GEMM without split-K (gemm_rows_kernel.cuh; GemmWgmmaOptions::row_split):
// validation of its extra rules and the launch. Called by run_gemm_wgmma_cuda after the common
// checks (validate_gemm, devices, M <= 64, sm_90).
#include <algorithm>
#include <atomic>
#include <cstdint>

#include "core/cuda_check.h"
#include "core/pdl.cuh"
#include "stages/projection/gemm_rows.h"
#include "stages/projection/gemm_rows_kernel.cuh"

namespace m3attn {

namespace {

using gemm_rows_detail::RowsArgs;

constexpr int kMaxSmem = 227 * 1024;  // opt-in dynamic shared memory per CTA on sm_90

template <int kNw, int kWg, int kSlots, int kBurst>
Status launch_rows(const RowsArgs& args, int grid, bool programmatic, int device,
                   cudaStream_t stream) {
  auto* kernel = &gemm_rows_detail::gemm_rows_kernel<kNw, kWg, kSlots, kBurst>;
  constexpr int kSmem = gemm_rows_detail::smem_bytes<kNw, kWg>(kSlots);
  static_assert(kSmem + 2 * 8 * kSlots <= kMaxSmem, "the ring fits shared memory");
  // The opt-in is per function and device.
  static std::atomic<bool> opted[64] = {};
  if (device >= 64 || !opted[device].load(std::memory_order_acquire)) {
    M3_CUDA_RETURN_IF_ERROR(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
    if (device < 64) opted[device].store(true, std::memory_order_release);
  }
  M3_CUDA_RETURN_IF_ERROR(launch_pdl(kernel, dim3(static_cast<unsigned>(grid)),
                                     dim3(128 * kWg + 32 * gemm_rows_detail::kProducerWarps),
                                     static_cast<size_t>(kSmem), stream, programmatic, args));
  M3_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

// Variants (ring slots x K blocks per producer burst): 8 x 2, 12 x 2, 8 x 4; at n = 32 the
// second has 10 slots, at n = 64 (24 KB slots) 8 x 2, 6 x 2, 8 x 4.
template <int kNw>
Status dispatch_variant(int variant, const RowsArgs& args, int grid, bool programmatic, int device,
                        cudaStream_t stream) {
  constexpr int kSecond = kNw <= 16 ? 12 : kNw == 32 ? 10 : 6;
  switch (variant) {
    case 1:
      return launch_rows<kNw, 2, 8, 2>(args, grid, programmatic, device, stream);
    case 2:
      return launch_rows<kNw, 2, kSecond, 2>(args, grid, programmatic, device, stream);
    case 3:
      return launch_rows<kNw, 2, 8, 4>(args, grid, programmatic, device, stream);
    default:
      return unsupported("GemmWgmmaOptions::row_split = ", variant, " is not a variant (1-3)");
  }
}

}  // namespace

Status run_gemm_rows_cuda(const GemmParams& p, int sms, int device, cudaStream_t stream,
                          const GemmWgmmaOptions& options) {
  const int64_t m = p.a.shape[0], n = p.b.shape[0], k = p.a.shape[1];
  constexpr int kWg = 2;  // warpgroups per CTA in every variant
  const int64_t kblocks = k / gemm_rows_detail::kBlockK;
  const int grid = sms;
  const int64_t warpgroups = int64_t{grid} * kWg;
  if ((n + warpgroups - 1) / warpgroups > 64)
    return unsupported("GemmWgmmaOptions::row_split: N = ", n, " over ", warpgroups,
                       " warpgroups exceeds 64 rows each");
  if (kblocks >= (int64_t{1} << 24))
    return unsupported("GemmWgmmaOptions::row_split: K = ", k, " is too long");
  const auto addr = [](const TensorView& t) { return reinterpret_cast<uintptr_t>(t.data); };
  if (addr(p.b) % 16 != 0 || p.b.stride[0] % 16 != 0 || addr(p.a) % 16 != 0 ||
      (m > 1 && p.a.stride[0] % 16 != 0))
    return unsupported(
        "GemmWgmmaOptions::row_split needs 16-byte aligned weight and activation rows (weight "
        "row stride ",
        p.b.stride[0], ", activation row stride ", p.a.stride[0], ")");
  if (m == 0) return Status::Ok();
  RowsArgs args;
  args.b = p.b.ptr<const uint8_t>();
  args.ldb = p.b.stride[0];
  args.a = p.a.ptr<const uint8_t>();
  args.lda = m <= 1 ? k : p.a.stride[0];
  args.sa = p.a_scales.ptr<const float>();
  args.sa_s0 = p.a_scales.stride[0];
  args.sa_s1 = p.a_scales.stride[1];
  args.sb = p.b_scales.ptr<const float>();
  args.sb_s0 = p.b_scales.stride[0];
  args.sb_s1 = p.b_scales.stride[1];
  args.out = p.out.ptr<uint16_t>();
  args.ldo = p.out.stride[0];
  args.m = static_cast<int>(m);
  args.n = static_cast<int>(n);
  args.kblocks = static_cast<int>(kblocks);
  args.trigger_dependents = options.trigger_dependents ? 1 : 0;
  args.early_weights = options.programmatic_launch ? 1 : 0;
  const bool programmatic = options.programmatic_launch;
  const int r = options.row_split;
  if (m <= 8) return dispatch_variant<8>(r, args, grid, programmatic, device, stream);
  if (m <= 16) return dispatch_variant<16>(r, args, grid, programmatic, device, stream);
  if (m <= 32) return dispatch_variant<32>(r, args, grid, programmatic, device, stream);
  return dispatch_variant<64>(r, args, grid, programmatic, device, stream);
}

}  // namespace m3attn
