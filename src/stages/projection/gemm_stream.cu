// The streaming decode GEMM: validation and launch (device code in gemm_stream_kernel.cuh,
// contract in gemm_stream.h).
#include <algorithm>
#include <atomic>
#include <cstdint>

#include "core/cuda_check.h"
#include "m3attn/config.h"
#include "stages/projection/gemm_stream.h"
#include "stages/projection/gemm_stream_kernel.cuh"

namespace m3attn {

namespace {

using gemm_stream_detail::kMaxChunks;
using gemm_stream_detail::kMaxM;
using gemm_stream_detail::kMaxStages;
using gemm_stream_detail::kSlotFloats;
using gemm_stream_detail::kStageBytes;
using gemm_stream_detail::StreamArgs;

constexpr size_t kCounterAlign = 256;
constexpr size_t kSlotBytes = size_t{kSlotFloats} * sizeof(float);
constexpr int kSmemAlignSlack = 1024;  // the kernel rounds the dynamic base up to 1024 bytes
constexpr int kAutoRunBlocks = 8;      // GemmStreamOptions::chunk_blocks = 0

constexpr int kMaxCtasPerSm = 4;           // GemmStreamOptions::ctas_per_sm limit
constexpr int kReservedSmemPerCta = 1024;  // shared memory the system reserves per CTA (sm_90)

struct DeviceInfo {
  int device = -1;
  int sms = 0;
  int major = 0;
  int smem_optin = 0;
  int smem_per_sm = 0;
};

Status device_info(DeviceInfo* info) {
  M3_CUDA_RETURN_IF_ERROR(cudaGetDevice(&info->device));
  M3_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&info->sms, cudaDevAttrMultiProcessorCount, info->device));
  M3_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&info->major, cudaDevAttrComputeCapabilityMajor, info->device));
  M3_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(
      &info->smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, info->device));
  M3_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(
      &info->smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, info->device));
  return Status::Ok();
}

// Dynamic shared memory the kernel may use on this device (opt-in limit minus its static shared
// memory); the opt-in attribute is set to it once per device and kernel.
template <int kW, int kN>
Result<int> dynamic_smem_limit(const DeviceInfo& info) {
  static std::atomic<int> limit_of[64] = {};
  int limit = info.device < 64 ? limit_of[info.device].load(std::memory_order_acquire) : 0;
  if (limit > 0) return limit;
  auto* kernel = &gemm_stream_detail::gemm_stream_kernel<kW, kN>;
  cudaFuncAttributes attr;
  M3_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, kernel));
  limit = info.smem_optin - static_cast<int>(attr.sharedSizeBytes);
  if (limit <= 0)
    return make_status(StatusCode::kCudaError, "run_gemm_stream_cuda: no dynamic shared memory ",
                       "left (opt-in ", info.smem_optin, " B, static ", attr.sharedSizeBytes,
                       " B)");
  M3_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, limit));
  if (info.device < 64) limit_of[info.device].store(limit, std::memory_order_release);
  return limit;
}

template <int kW, int kN>
Status launch(StreamArgs args, int grid, int max_stages, int ctas_per_sm, const DeviceInfo& info,
              cudaStream_t stream) {
  Result<int> opt_in = dynamic_smem_limit<kW, kN>(info);
  M3_RETURN_IF_ERROR(opt_in.status());
  // With several CTAs per SM each gets its share of the SM's shared memory (static included).
  const int static_bytes = info.smem_optin - opt_in.value();
  const int limit = ctas_per_sm <= 1
                        ? opt_in.value()
                        : std::min(opt_in.value(), info.smem_per_sm / ctas_per_sm -
                                                       kReservedSmemPerCta - static_bytes);
  const int64_t act_bytes = int64_t{args.chunks} * kN * 128;  // [chunks][kN / kW][kW x 128]
  const int64_t fixed = kSmemAlignSlack + act_bytes +
                        int64_t{args.kblocks} * 16 * static_cast<int64_t>(sizeof(float));
  const int64_t fit = (limit - fixed) / kStageBytes;
  const int stages = static_cast<int>(
      std::min<int64_t>({fit, kMaxStages, max_stages > 0 ? max_stages : kMaxStages}));
  if (stages < 2)
    return unsupported("run_gemm_stream_cuda: the activation tiles (", act_bytes,
                       " bytes for M = ", args.m, ", K = ", args.kblocks * 128, ") leave room for ",
                       std::max<int64_t>(fit, 0), " ring stages of ", kStageBytes, " bytes in ",
                       limit, " bytes of shared memory (2 needed)");
  args.stages = stages;
  const size_t smem = static_cast<size_t>(fixed + stages * int64_t{kStageBytes});
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(grid));
  cfg.blockDim = dim3(gemm_stream_detail::kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = args.early_weights ? 1 : 0;
  M3_CUDA_RETURN_IF_ERROR(
      cudaLaunchKernelEx(&cfg, &gemm_stream_detail::gemm_stream_kernel<kW, kN>, args));
  M3_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

// Closed dispatch over (run length W, wgmma N = W x activation rows per tile).
Status dispatch(const StreamArgs& args, int w, int grid, int max_stages, int ctas_per_sm,
                const DeviceInfo& info, cudaStream_t stream) {
  const int m = args.m;
  if (w == 8) {
    if (m <= 2) return launch<8, 16>(args, grid, max_stages, ctas_per_sm, info, stream);
    if (m <= 4) return launch<8, 32>(args, grid, max_stages, ctas_per_sm, info, stream);
    if (m <= 8) return launch<8, 64>(args, grid, max_stages, ctas_per_sm, info, stream);
    if (m <= 16) return launch<8, 128>(args, grid, max_stages, ctas_per_sm, info, stream);
  } else if (w == 16) {
    if (m <= 1) return launch<16, 16>(args, grid, max_stages, ctas_per_sm, info, stream);
    if (m <= 2) return launch<16, 32>(args, grid, max_stages, ctas_per_sm, info, stream);
    if (m <= 4) return launch<16, 64>(args, grid, max_stages, ctas_per_sm, info, stream);
    if (m <= 8) return launch<16, 128>(args, grid, max_stages, ctas_per_sm, info, stream);
  }
  return unsupported("run_gemm_stream_cuda: runs of ", w, " K blocks serve M <= ", w == 16 ? 8 : 16,
                     ", got M = ", m);
}

}  // namespace

size_t gemm_stream_counter_bytes(int64_t n) {
  // One counter per group of 128 / W rows: at most N / 8 (W = 16).
  const size_t bytes = static_cast<size_t>(std::max<int64_t>(n / 8, 1)) * sizeof(unsigned);
  return (bytes + kCounterAlign - 1) / kCounterAlign * kCounterAlign;
}

Result<size_t> gemm_stream_workspace_bytes(int64_t n, int max_grid) {
  M3_CHECK_ARG(n > 0 && n % kQuantBlock == 0, "gemm_stream_workspace_bytes: N = ", n,
               " must be a positive multiple of ", kQuantBlock);
  M3_CHECK_ARG(max_grid >= 0, "gemm_stream_workspace_bytes: max_grid = ", max_grid,
               " must be >= 0");
  int grid = max_grid;
  if (grid == 0) {
    DeviceInfo info;
    M3_RETURN_IF_ERROR(device_info(&info));
    grid = kMaxCtasPerSm * info.sms;
  }
  return gemm_stream_counter_bytes(n) + size_t{2} * static_cast<size_t>(grid) * kSlotBytes;
}

bool gemm_stream_device_supported() {
  DeviceInfo info;
  return device_info(&info).ok() && info.major == 9;
}

Status run_gemm_stream_cuda(const GemmParams& p, void* workspace, size_t workspace_bytes,
                            cudaStream_t stream, const GemmStreamOptions& options) {
  M3_RETURN_IF_ERROR(validate_gemm(p));
  for (const TensorView* t : {&p.a, &p.a_scales, &p.b, &p.b_scales, &p.out})
    M3_CHECK_ARG(t->device.type == DeviceType::kCUDA,
                 "run_gemm_stream_cuda needs CUDA tensors, got one on ", t->device.to_string());
  M3_CHECK_ARG(options.chunk_blocks == 0 || options.chunk_blocks == 8 || options.chunk_blocks == 16,
               "GemmStreamOptions::chunk_blocks = ", options.chunk_blocks,
               " must be 0 (automatic), 8 or 16");
  M3_CHECK_ARG(options.grid >= 0, "GemmStreamOptions::grid = ", options.grid, " must be >= 0");
  M3_CHECK_ARG(options.ctas_per_sm >= 1 && options.ctas_per_sm <= kMaxCtasPerSm,
               "GemmStreamOptions::ctas_per_sm = ", options.ctas_per_sm, " must be in [1, ",
               kMaxCtasPerSm, "]");
  M3_CHECK_ARG(options.max_stages >= 0, "GemmStreamOptions::max_stages = ", options.max_stages,
               " must be >= 0");
  const int64_t m = p.a.shape[0], n = p.b.shape[0], k = p.a.shape[1];
  if (m > kMaxM)
    return unsupported("run_gemm_stream_cuda serves M <= ", kMaxM, ", got M = ", m,
                       " (use Fp8BlockGemm)");
  const int w = options.chunk_blocks == 0 ? kAutoRunBlocks : options.chunk_blocks;
  if (w == 16 && m > 8)
    return unsupported("run_gemm_stream_cuda: runs of 16 K blocks serve M <= 8, got M = ", m);
  DeviceInfo info;
  M3_RETURN_IF_ERROR(device_info(&info));
  M3_CHECK_ARG(p.a.device.index == info.device, "run_gemm_stream_cuda: tensors are on ",
               p.a.device.to_string(), " but the current device is ", info.device);
  if (info.major != 9)
    return unsupported("run_gemm_stream_cuda needs an sm_90 device (wgmma, bulk copies); device ",
                       info.device, " has compute capability ", info.major, ".x");
  // validate_gemm guarantees 16-byte aligned A and B with row strides that are multiples of 16
  // bytes, as the bulk copies need (a one-row operand's stride is never used).
  const int64_t lda = m <= 1 ? k : p.a.stride[0];
  const int64_t ldb = n <= 1 ? k : p.b.stride[0];
  const int64_t kblocks = k / kQuantBlock;
  const int64_t chunks = (kblocks + w - 1) / w;
  if (chunks > kMaxChunks)
    return unsupported("run_gemm_stream_cuda: K / 128 = ", kblocks, " in runs of ", w,
                       " blocks gives ", chunks, " chunks (at most ", kMaxChunks, ")");
  const int64_t group_rows = kQuantBlock / w;
  const int64_t units = n / group_rows * chunks;
  M3_CHECK_ARG(units < (int64_t{1} << 31), "run_gemm_stream_cuda: N / ", group_rows,
               " x chunks = ", units, " must be below 2^31");
  if (m == 0) return Status::Ok();

  // The kernels with a 128-column wgmma (M > 8, or M > 4 with runs of 16 blocks) need ~135
  // registers per thread: one CTA per SM.
  const bool wide = w == 8 ? m > 8 : m > 4;
  const int ctas_per_sm = wide ? 1 : options.ctas_per_sm;
  const int grid = static_cast<int>(
      std::min<int64_t>(options.grid > 0 ? options.grid : int64_t{ctas_per_sm} * info.sms, units));
  const size_t counters = gemm_stream_counter_bytes(n);
  const size_t need = counters + size_t{2} * static_cast<size_t>(grid) * kSlotBytes;
  M3_CHECK_ARG(workspace != nullptr && workspace_bytes >= need,
               "run_gemm_stream_cuda: the workspace holds ", workspace_bytes, " bytes, ", need,
               " are needed (N = ", n, ", ", grid,
               " CTAs): size it with gemm_stream_workspace_bytes");
  M3_CHECK_ARG(reinterpret_cast<uintptr_t>(workspace) % kCounterAlign == 0,
               "run_gemm_stream_cuda: the workspace must be ", kCounterAlign, "-byte aligned");

  StreamArgs args;
  args.a = p.a.ptr<const uint8_t>();
  args.lda = lda;
  args.sa = p.a_scales.ptr<const float>();
  args.sa_s0 = p.a_scales.stride[0];
  args.sa_s1 = p.a_scales.stride[1];
  args.b = p.b.ptr<const uint8_t>();
  args.ldb = ldb;
  args.sb = p.b_scales.ptr<const float>();
  args.sb_s0 = p.b_scales.stride[0];
  args.sb_s1 = p.b_scales.stride[1];
  args.out = p.out.ptr<uint16_t>();
  args.ldo = p.out.stride[0];
  args.counters = static_cast<unsigned*>(workspace);
  args.partials = reinterpret_cast<float*>(static_cast<uint8_t*>(workspace) + counters);
  args.m = static_cast<int>(m);
  args.kblocks = static_cast<int>(kblocks);
  args.chunks = static_cast<int>(chunks);
  args.units = static_cast<int>(units);
  args.stages = 0;  // set in launch()
  args.weight_evict_first = options.weight_evict_first ? 1 : 0;
  args.early_weights = options.programmatic_launch ? 1 : 0;
  args.trigger_dependents = options.trigger_dependents ? 1 : 0;
  args.async_copies = options.async_copies ? 1 : 0;
  args.pair_units = options.pair_units ? 1 : 0;
  return dispatch(args, w, grid, options.max_stages, ctas_per_sm, info, stream);
}

}  // namespace m3attn
