// The wgmma decode GEMM: validation, TMA descriptors and launch (device code in
// gemm_wgmma_kernel.cuh, contract in gemm_wgmma.h).
#include <cudaTypedefs.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "core/cuda_check.h"
#include "core/pdl.cuh"
#include "core/tensor_map.h"
#include "m3attn/config.h"
#include "stages/projection/gemm_wgmma.h"
#include "stages/projection/gemm_wgmma_kernel.cuh"
#include "stages/projection/gemm_wgmma_rows_kernel.cuh"
#include "stages/projection/gemm_wgmma_rows_ksplit.h"
#include "stages/projection/gemm_wgmma_rows_ksplit_kernel.cuh"

namespace m3attn {

namespace {

using gemm_wgmma_detail::kBlockK;
using gemm_wgmma_detail::kMaxCtasPerSm;
using gemm_wgmma_detail::kMaxM;
using gemm_wgmma_detail::kTileN;
using gemm_wgmma_detail::WgmmaArgs;

constexpr size_t kCounterAlign = 256;
constexpr int kMaxWaves = 64;        // GemmWgmmaOptions::max_waves limit
constexpr int kMaxClusterSplit = 8;  // GemmWgmmaOptions::cluster_split limit (portable clusters)

int64_t tiles_of(int64_t n) { return n / kTileN; }

// 2D uint8 map over rows x cols (cols K-contiguous, rows `row_bytes` apart), box box_rows x 128,
// 128B swizzle, out-of-bounds rows read as zero.
Status encode_map(CUtensorMap* map, const void* data, int64_t rows, int64_t cols, int64_t row_bytes,
                  int box_rows, CUtensorMapL2promotion promotion, const char* what) {
  return encode_tensor_map_2d(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, data, rows, cols, row_bytes,
                              box_rows, kBlockK, CU_TENSOR_MAP_SWIZZLE_128B, promotion, what);
}

template <int kNw, int kCtasPerSm>
Status launch(const CUtensorMap& wmap, const CUtensorMap& xmap, const WgmmaArgs& args, int grid,
              int waves, const CudaDeviceInfo& info, cudaStream_t stream) {
  constexpr int kStages = gemm_wgmma_detail::stages<kNw, kCtasPerSm>();
  constexpr int kSmem = gemm_wgmma_detail::smem_bytes<kNw, kCtasPerSm>();
  auto* kernel = &gemm_wgmma_detail::gemm_wgmma_kernel<kNw, kStages, kCtasPerSm>;
  // The shared-memory opt-in is per function and device (each device has its own module): set it
  // once per device, then ask how many CTAs fit on one SM (cached per device below 64; devices
  // >= 64 ask at every call). The grid never exceeds one wave of resident CTAs.
  static std::atomic<int> resident_of[64] = {};  // (one table per instantiation)
  int resident = info.device < 64 ? resident_of[info.device].load(std::memory_order_acquire) : 0;
  if (resident == 0) {
    M3_CUDA_RETURN_IF_ERROR(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
    M3_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &resident, kernel, gemm_wgmma_detail::kThreads, kSmem));
    if (resident < 1)
      return make_status(StatusCode::kCudaError, "run_gemm_wgmma_cuda: no CTA of the n = ", kNw,
                         " kernel fits on an SM (", kSmem, " B of dynamic shared memory)");
    if (info.device < 64) resident_of[info.device].store(resident, std::memory_order_release);
  }
  // (The cluster split's grid is one CTA per tile and rank: its CTAs never wait across clusters.)
  const int planned = grid;
  if (args.cluster == 0) grid = std::min(grid, waves * std::min(resident, kCtasPerSm) * info.sms);
  if (args.packed != nullptr && grid != planned)
    return make_status(StatusCode::kCudaError, "run_gemm_wgmma_cuda: packed weights for ", planned,
                       " CTAs, but only ", grid, " fit the device");
  WgmmaArgs a = args;
  // Automatic burst: 2 units with two CTAs per SM (6-stage rings), half the ring with one.
  a.burst = a.burst > 0       ? std::min(a.burst, kStages)
            : kCtasPerSm == 2 ? std::min(2, kStages)
                              : std::max(1, kStages / 2);
  if (a.cluster > 1) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(static_cast<unsigned>(grid));
    cfg.blockDim = dim3(gemm_wgmma_detail::kThreads);
    cfg.dynamicSmemBytes = kSmem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[2];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = static_cast<unsigned>(a.cluster);
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[1].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = a.early_weights != 0 ? 2 : 1;
    M3_CUDA_RETURN_IF_ERROR(cudaLaunchKernelEx(&cfg, kernel, wmap, xmap, a));
  } else {
    M3_CUDA_RETURN_IF_ERROR(launch_pdl(kernel, dim3(static_cast<unsigned>(grid)),
                                       dim3(gemm_wgmma_detail::kThreads), kSmem, stream,
                                       a.early_weights != 0, wmap, xmap, a));
  }
  M3_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

// Closed dispatch over (n = M rounded up to 8, 16, 32, 64) x CTAs per SM.
template <int kCtasPerSm>
Status dispatch_rows(int m, const CUtensorMap& wmap, const CUtensorMap& xmap, const WgmmaArgs& args,
                     int grid, int waves, const CudaDeviceInfo& info, cudaStream_t stream) {
  if (m <= 8) return launch<8, kCtasPerSm>(wmap, xmap, args, grid, waves, info, stream);
  if (m <= 16) return launch<16, kCtasPerSm>(wmap, xmap, args, grid, waves, info, stream);
  if (m <= 32) return launch<32, kCtasPerSm>(wmap, xmap, args, grid, waves, info, stream);
  if (m <= 64) return launch<64, kCtasPerSm>(wmap, xmap, args, grid, waves, info, stream);
  return unsupported("the wgmma GEMM serves M <= ", kMaxM, ", got M = ", m);
}

int box_rows_for(int64_t m) { return m <= 8 ? 8 : m <= 16 ? 16 : m <= 32 ? 32 : 64; }
// The kernel's n (rows of a partial slot) for M rows; 0 for none.
int64_t padded_rows(int64_t m) { return m <= 0 ? 0 : box_rows_for(m); }

// The stream-K grid: at most max_waves x CTAs per SM x SMs, at least min_units_per_cta units each.
int stream_k_grid(int64_t units, const GemmWgmmaOptions& o, int sms) {
  const int64_t ctas = o.ctas_per_sm != 0 ? o.ctas_per_sm : kMaxCtasPerSm;
  const int64_t by_units = (units + o.min_units_per_cta - 1) / o.min_units_per_cta;
  return static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(int64_t{o.max_waves} * ctas * sms, by_units)));
}

// The packing calls' rules: b a 2D E4M3 CUDA tensor, K-contiguous, 16-byte aligned rows a
// multiple of 16 bytes apart; the packed buffer 16-byte aligned and at least `need` bytes.
Status check_pack_weight(const TensorView& b, const char* who) {
  M3_CHECK_ARG(b.dtype == DType::kE4M3 && b.ndim == 2 && b.device.type == DeviceType::kCUDA, who,
               ": b must be a 2D E4M3 tensor on a CUDA device");
  M3_CHECK_ARG(
      b.stride[1] == 1 && b.stride[0] % 16 == 0 && reinterpret_cast<uintptr_t>(b.data) % 16 == 0,
      who,
      ": b must be K-contiguous, 16-byte aligned, rows a multiple of 16 bytes apart (row stride ",
      b.stride[0], ")");
  return Status::Ok();
}
Status check_pack_buffer(const void* packed, size_t packed_bytes, size_t need, const char* who) {
  M3_CHECK_ARG(
      packed != nullptr && packed_bytes >= need && reinterpret_cast<uintptr_t>(packed) % 16 == 0,
      who, ": the packed buffer holds ", packed_bytes, " bytes, ", need,
      " (16-byte aligned) are needed");
  return Status::Ok();
}

// The call's scales and output in the kernels' argument layout.
void set_scales_out(gemm_wgmma_detail::ScalesOut* s, const GemmParams& p) {
  s->sa = p.a_scales.ptr<const float>();
  s->sa_s0 = p.a_scales.stride[0];
  s->sa_s1 = p.a_scales.stride[1];
  s->sb = p.b_scales.ptr<const float>();
  s->sb_s0 = p.b_scales.stride[0];
  s->sb_s1 = p.b_scales.stride[1];
  s->out = p.out.ptr<uint16_t>();
  s->ldo = p.out.stride[0];
}

// The row split's grid: two CTAs per SM (the K split: one pair of halves per SM), at most one per
// weight row.
int rows_grid(int64_t n, int sms, bool k_split) {
  return static_cast<int>(std::min<int64_t>(k_split ? sms : 2 * sms, n));
}

// Whether a row split over `grid` image CTAs serves N x K: the row split (at most kRowsMax rows per
// CTA, K <= 8192), the K split (at most kKsRowsMax rows per pair, its halves' K blocks staged next
// to its ring) or, `image`, either (what the packed image itself allows).
enum class RowsForm { kRows, kKSplit, kImage };
// align: the image's partition (gemm_wgmma_detail::rows_begin; 4: the K split's aligned one).
Status rows_shape_supported(int64_t n, int64_t k, int64_t grid, RowsForm form, int align = 1) {
  const int64_t max_rows =
      form == RowsForm::kRows ? gemm_wgmma_detail::kRowsMax : gemm_wgmma_detail::kKsRowsMax;
  const char* what = form == RowsForm::kKSplit ? "the row K split" : "the row split";
  const bool aligned =
      n < (int64_t{1} << 31) && grid < (int64_t{1} << 31) &&
      gemm_wgmma_detail::rows_aligned(static_cast<int>(grid), static_cast<int>(n), align);
  if (aligned ? 4 * ((n / 4 + grid - 1) / grid) > max_rows : (n + grid - 1) / grid > max_rows)
    return unsupported(what, " serves N <= ", max_rows, " x ", grid,
                       " (its image CTAs), got N = ", n);
  if (k / kBlockK > gemm_wgmma_detail::kRowsMaxKblocks)
    return unsupported("the row split serves K <= ", gemm_wgmma_detail::kRowsMaxKblocks * kBlockK,
                       ", got K = ", k);
  if (form == RowsForm::kKSplit &&
      gemm_wgmma_detail::ksplit_local_kblocks(static_cast<int>(k / kBlockK), 0) >
          gemm_wgmma_detail::kKsMaxLocalKblocks)
    return unsupported("the row K split stages at most ", gemm_wgmma_detail::kKsMaxLocalKblocks,
                       " K blocks per half (K 6400 or less), got K = ", k);
  return Status::Ok();
}

template <int kNw, int kKpb, int kWg, int kDiag = 0, bool kSlots = true>
Status launch_rows(const CUtensorMap& xmap, const gemm_wgmma_detail::RowsArgs& args, int grid,
                   const CudaDeviceInfo& info, cudaStream_t stream) {
  if constexpr (gemm_wgmma_detail::rows_stages<kNw, kKpb, kWg>() < 2) {
    return unsupported("the row split cannot hold two stages of ", kKpb, " K blocks at n = ", kNw,
                       " (GemmWgmmaOptions::burst)");
  } else {
    auto* kernel = &gemm_wgmma_detail::gemm_rows_kernel<kNw, kKpb, kWg, kDiag, kSlots>;
    constexpr int kThreads = gemm_wgmma_detail::rows_threads<kWg>();
    constexpr int kPerSm = kWg == 1 ? 2 : 1;
    constexpr int kMaxSmem =
        gemm_wgmma_detail::rows_smem_bytes<kNw, kKpb, kWg>(gemm_wgmma_detail::kRowsMaxKblocks);
    // The shared-memory opt-in once per device (each device has its own module); two CTAs must
    // fit on an SM (the grid is one wave of them).
    static std::atomic<int> ready[64] = {};  // (one table per instantiation)
    if (info.device >= 64 || ready[info.device].load(std::memory_order_acquire) == 0) {
      M3_CUDA_RETURN_IF_ERROR(
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSmem));
      int resident = 0;
      M3_CUDA_RETURN_IF_ERROR(
          cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, kThreads, kMaxSmem));
      if (resident < kPerSm)
        return make_status(StatusCode::kCudaError, "run_gemm_wgmma_cuda (row split): only ",
                           resident, " CTAs of the n = ", kNw, " kernel fit on an SM (", kMaxSmem,
                           " B of dynamic shared memory); ", kPerSm, " are needed");
      if (info.device < 64) ready[info.device].store(1, std::memory_order_release);
    }
    const int smem = gemm_wgmma_detail::rows_smem_bytes<kNw, kKpb, kWg>(args.kblocks);
    M3_CUDA_RETURN_IF_ERROR(launch_pdl(kernel, dim3(static_cast<unsigned>(grid / kWg)),
                                       dim3(kThreads), smem, stream, args.early_weights != 0, xmap,
                                       args));
    M3_CUDA_CHECK_LAUNCH();
    return Status::Ok();
  }
}

// K blocks per stage: `kpb` (1, 2 or 4; 0: the default for n); two warpgroups per CTA (one CTA per
// SM, `grid` even; the default K blocks per stage) or one (two CTAs per SM); `diag` (bench
// diagnostics at n = 8 / 32 / 64: one warpgroup, the default K blocks per stage).
template <int kNw>
Status dispatch_rows_kpb(int kpb, bool two_wg, int diag, bool fixed_slots, const CUtensorMap& xmap,
                         const gemm_wgmma_detail::RowsArgs& args, int grid,
                         const CudaDeviceInfo& info, cudaStream_t stream) {
  constexpr int kDefault = gemm_wgmma_detail::rows_default_kpb<kNw>();
  if constexpr (kNw >= 16) {
    if (fixed_slots) return launch_rows<kNw, kDefault, 1, 0, false>(xmap, args, grid, info, stream);
  }
  if constexpr (kNw != 16) {
    if (diag == 1) return launch_rows<kNw, kDefault, 1, 1>(xmap, args, grid, info, stream);
    if (diag == 2) return launch_rows<kNw, kDefault, 1, 2>(xmap, args, grid, info, stream);
    if (diag == 3) return launch_rows<kNw, kDefault, 1, 3>(xmap, args, grid, info, stream);
    if (diag == 4) return launch_rows<kNw, kDefault, 1, 4>(xmap, args, grid, info, stream);
    if (diag == 5) return launch_rows<kNw, kDefault, 1, 5>(xmap, args, grid, info, stream);
    if constexpr (kNw == 64) {
      if (diag == 6) return launch_rows<kNw, kDefault, 1, 6>(xmap, args, grid, info, stream);
    }
  }
  if (two_wg) return launch_rows<kNw, kDefault, 2>(xmap, args, grid, info, stream);
  if (kpb == 0) kpb = kDefault;
  if (kpb == 1) return launch_rows<kNw, 1, 1>(xmap, args, grid, info, stream);
  if (kpb == 2) return launch_rows<kNw, 2, 1>(xmap, args, grid, info, stream);
  return launch_rows<kNw, 4, 1>(xmap, args, grid, info, stream);
}

}  // namespace

Status gemm_wgmma_rows_supported(int64_t n, int64_t k, bool k_split) {
  M3_CHECK_ARG(n > 0 && n % kTileN == 0 && k > 0 && k % kBlockK == 0,
               "gemm_wgmma_rows_supported: N = ", n, " and K = ", k,
               " must be positive multiples of ", kTileN);
  CudaDeviceInfo info;
  M3_RETURN_IF_ERROR(current_device_info(&info));
  if (info.major != 9)
    return unsupported("the row split needs an sm_90 device (wgmma, TMA); device ", info.device,
                       " has compute capability ", info.major, ".x");
  return rows_shape_supported(n, k, rows_grid(n, info.sms, k_split),
                              k_split ? RowsForm::kKSplit : RowsForm::kRows);
}

Result<int> gemm_wgmma_rows_ctas(int64_t n, bool k_split) {
  M3_CHECK_ARG(n > 0, "gemm_wgmma_rows_ctas: N = ", n, " must be positive");
  CudaDeviceInfo info;
  M3_RETURN_IF_ERROR(current_device_info(&info));
  return rows_grid(n, info.sms, k_split);
}

Result<size_t> gemm_wgmma_rows_packed_bytes(int64_t n, int64_t k) {
  M3_CHECK_ARG(n > 0 && n % kTileN == 0 && k > 0 && k % kBlockK == 0,
               "gemm_wgmma_rows_packed_bytes: N = ", n, " and K = ", k,
               " must be positive multiples of ", kTileN);
  return static_cast<size_t>(n * k);
}

Status gemm_wgmma_pack_weights_rows(const TensorView& b, int ctas, void* packed,
                                    size_t packed_bytes, cudaStream_t stream, int row_align) {
  M3_RETURN_IF_ERROR(check_pack_weight(b, "gemm_wgmma_pack_weights_rows"));
  const int64_t n = b.shape[0], k = b.shape[1];
  Result<size_t> need = gemm_wgmma_rows_packed_bytes(n, k);
  M3_RETURN_IF_ERROR(need.status());
  M3_CHECK_ARG(n < (int64_t{1} << 31) && k < (int64_t{1} << 31),
               "gemm_wgmma_pack_weights_rows: N = ", n, " and K = ", k, " must be below 2^31");
  M3_CHECK_ARG(ctas >= 1 && ctas <= n, "gemm_wgmma_pack_weights_rows: ctas = ", ctas,
               " must be in [1, N = ", n, "]");
  M3_CHECK_ARG(row_align == 1 || row_align == 4,
               "gemm_wgmma_pack_weights_rows: row_align = ", row_align, " must be 1 or 4");
  M3_RETURN_IF_ERROR(rows_shape_supported(n, k, ctas, RowsForm::kImage, row_align));
  M3_RETURN_IF_ERROR(
      check_pack_buffer(packed, packed_bytes, need.value(), "gemm_wgmma_pack_weights_rows"));
  gemm_wgmma_detail::pack_weights_rows_kernel<<<1024, 256, 0, stream>>>(
      static_cast<const uint8_t*>(b.data), b.stride[0], static_cast<int>(n),
      static_cast<int>(k / kBlockK), ctas, row_align, static_cast<uint8_t*>(packed));
  M3_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

size_t gemm_wgmma_counter_bytes(int64_t n) {
  const size_t bytes = static_cast<size_t>(std::max<int64_t>(tiles_of(n), 1)) * sizeof(unsigned);
  return (bytes + kCounterAlign - 1) / kCounterAlign * kCounterAlign;
}

Result<size_t> gemm_wgmma_workspace_bytes(int64_t n, int64_t max_m, int max_waves,
                                          int ctas_per_sm) {
  M3_CHECK_ARG(n > 0 && n % kTileN == 0, "gemm_wgmma_workspace_bytes: N = ", n,
               " must be a positive multiple of ", kTileN);
  M3_CHECK_ARG(max_m >= 0 && max_m <= kMaxM, "gemm_wgmma_workspace_bytes: max_m = ", max_m,
               " must be in [0, ", kMaxM, "]");
  M3_CHECK_ARG(max_waves >= 1 && max_waves <= kMaxWaves,
               "gemm_wgmma_workspace_bytes: max_waves = ", max_waves, " must be in [1, ", kMaxWaves,
               "]");
  M3_CHECK_ARG(ctas_per_sm >= 0 && ctas_per_sm <= kMaxCtasPerSm,
               "gemm_wgmma_workspace_bytes: ctas_per_sm = ", ctas_per_sm, " must be in [0, ",
               kMaxCtasPerSm, "]");
  CudaDeviceInfo info;
  M3_RETURN_IF_ERROR(current_device_info(&info));
  // Two partial slots of [n][128] fp32 per CTA (n = M rounded up to 8, 16, 32 or 64: the slots are
  // fragment-major); the grid is at most ctas_per_sm x SMs (automatic: two).
  const size_t per_sm = ctas_per_sm == 0 ? kMaxCtasPerSm : static_cast<size_t>(ctas_per_sm);
  const size_t slot_rows = size_t{2} * per_sm * static_cast<size_t>(padded_rows(max_m));
  return gemm_wgmma_counter_bytes(n) + slot_rows * static_cast<size_t>(max_waves) *
                                           static_cast<size_t>(info.sms) * kTileN * sizeof(float);
}

Result<size_t> gemm_wgmma_packed_bytes(int64_t n, int64_t k, const GemmWgmmaOptions& options) {
  M3_CHECK_ARG(n > 0 && n % kTileN == 0 && k > 0 && k % kBlockK == 0,
               "gemm_wgmma_packed_bytes: N = ", n, " and K = ", k,
               " must be positive multiples of ", kTileN);
  M3_CHECK_ARG(options.min_units_per_cta >= 1 && options.max_waves >= 1 &&
                   options.ctas_per_sm >= 0 && options.ctas_per_sm <= kMaxCtasPerSm,
               "gemm_wgmma_packed_bytes: bad grid options");
  CudaDeviceInfo info;
  M3_RETURN_IF_ERROR(current_device_info(&info));
  const int64_t units = tiles_of(n) * (k / kBlockK);
  const int64_t grid = stream_k_grid(units, options, info.sms);
  // Positions v grid + c for v below the largest per-CTA count (CTAs with fewer units leave holes).
  return static_cast<size_t>((units + grid - 1) / grid * grid) * kTileN * kBlockK;
}

Status gemm_wgmma_pack_weights(const TensorView& b, void* packed, size_t packed_bytes,
                               const GemmWgmmaOptions& options, cudaStream_t stream) {
  M3_RETURN_IF_ERROR(check_pack_weight(b, "gemm_wgmma_pack_weights"));
  const int64_t n = b.shape[0], k = b.shape[1];
  Result<size_t> need = gemm_wgmma_packed_bytes(n, k, options);
  M3_RETURN_IF_ERROR(need.status());
  M3_RETURN_IF_ERROR(
      check_pack_buffer(packed, packed_bytes, need.value(), "gemm_wgmma_pack_weights"));
  CudaDeviceInfo info;
  M3_RETURN_IF_ERROR(current_device_info(&info));
  const int64_t units = tiles_of(n) * (k / kBlockK);
  const int grid = stream_k_grid(units, options, info.sms);
  gemm_wgmma_detail::pack_weights_kernel<<<1024, 256, 0, stream>>>(
      static_cast<const uint8_t*>(b.data), b.stride[0], static_cast<int>(k / kBlockK),
      static_cast<int>(units), grid, static_cast<uint8_t*>(packed));
  M3_CUDA_CHECK_LAUNCH();
  return Status::Ok();
}

int gemm_wgmma_trace_words() { return gemm_wgmma_detail::kTraceWords; }

bool gemm_wgmma_device_supported() {
  CudaDeviceInfo info;
  return current_device_info(&info).ok() && info.major == 9;
}

Status run_gemm_wgmma_cuda(const GemmParams& p, void* workspace, size_t workspace_bytes,
                           cudaStream_t stream, const GemmWgmmaOptions& options) {
  M3_RETURN_IF_ERROR(validate_gemm(p));
  for (const TensorView* t : {&p.a, &p.a_scales, &p.b, &p.b_scales, &p.out})
    M3_CHECK_ARG(t->device.type == DeviceType::kCUDA,
                 "run_gemm_wgmma_cuda needs CUDA tensors, got one on ", t->device.to_string());
  M3_CHECK_ARG(options.ctas_per_sm >= 0 && options.ctas_per_sm <= kMaxCtasPerSm,
               "GemmWgmmaOptions::ctas_per_sm = ", options.ctas_per_sm, " must be in [0, ",
               kMaxCtasPerSm, "]");
  M3_CHECK_ARG(options.burst >= 0, "GemmWgmmaOptions::burst = ", options.burst, " must be >= 0");
  M3_CHECK_ARG(options.weight_l2_promotion == 0 || options.weight_l2_promotion == 64 ||
                   options.weight_l2_promotion == 128 || options.weight_l2_promotion == 256,
               "GemmWgmmaOptions::weight_l2_promotion = ", options.weight_l2_promotion,
               " must be 0, 64, 128 or 256");
  M3_CHECK_ARG(options.min_units_per_cta >= 1,
               "GemmWgmmaOptions::min_units_per_cta = ", options.min_units_per_cta,
               " must be >= 1");
  M3_CHECK_ARG(options.cluster_split >= 0 && options.cluster_split <= kMaxClusterSplit,
               "GemmWgmmaOptions::cluster_split = ", options.cluster_split, " must be in [0, ",
               kMaxClusterSplit, "]");
  M3_CHECK_ARG(options.max_waves >= 1 && options.max_waves <= kMaxWaves,
               "GemmWgmmaOptions::max_waves = ", options.max_waves, " must be in [1, ", kMaxWaves,
               "]");
  const int64_t m = p.a.shape[0], n = p.b.shape[0], k = p.a.shape[1];
  if (m > kMaxM)
    return unsupported("run_gemm_wgmma_cuda serves M <= ", kMaxM, ", got M = ", m,
                       " (use Fp8BlockGemm)");
  CudaDeviceInfo info;
  M3_RETURN_IF_ERROR(current_device_info(&info));
  M3_CHECK_ARG(p.a.device.index == info.device, "run_gemm_wgmma_cuda: tensors are on ",
               p.a.device.to_string(), " but the current device is ", info.device);
  if (info.major != 9)
    return unsupported("run_gemm_wgmma_cuda needs an sm_90 device (wgmma, TMA); device ",
                       info.device, " has compute capability ", info.major, ".x");
  const int64_t kblocks = k / kBlockK, tiles = tiles_of(n);
  const int64_t units = tiles * kblocks;
  M3_CHECK_ARG(n < (int64_t{1} << 31) && k < (int64_t{1} << 31) && units < (int64_t{1} << 31),
               "run_gemm_wgmma_cuda: N = ", n, ", K = ", k, " and N / 128 x K / 128 = ", units,
               " must be below 2^31 (TMA coordinates and unit indices are 32-bit)");
  if (m == 0) return Status::Ok();

  // The row split (variant): its own kernel, no workspace (it may be null).
  if (options.row_packed_weights != nullptr) {
    M3_CHECK_ARG(options.cluster_split == 0 && options.packed_weights == nullptr,
                 "GemmWgmmaOptions::row_packed_weights excludes cluster_split (",
                 options.cluster_split, ") and packed_weights");
    M3_CHECK_ARG(reinterpret_cast<uintptr_t>(options.row_packed_weights) % 16 == 0,
                 "GemmWgmmaOptions::row_packed_weights must be 16-byte aligned");
    const int rgrid = options.row_packed_ctas;
    M3_CHECK_ARG(rgrid >= 1 && rgrid <= n, "GemmWgmmaOptions::row_packed_ctas = ", rgrid,
                 " must be the image's CTA count, in [1, N = ", n, "]");
    // (row_k_split_align: the K split's partition only; the row split's is always the plain one.)
    const int row_align = options.row_k_split ? options.row_k_split_align : 1;
    M3_CHECK_ARG(row_align == 1 || row_align == 4, "GemmWgmmaOptions::row_k_split_align = ",
                 row_align, " must be 1 or 4");
    M3_RETURN_IF_ERROR(rows_shape_supported(
        n, k, rgrid, options.row_k_split ? RowsForm::kKSplit : RowsForm::kRows, row_align));
    const int kpb = options.burst;
    M3_CHECK_ARG(kpb == 0 || kpb == 1 || kpb == 2 || kpb == 4, "GemmWgmmaOptions::burst = ", kpb,
                 " must be 0, 1, 2 or 4 with row_packed_weights (K blocks per ring stage)");
    // ctas_per_sm = 1: one CTA of two consumer warpgroups per SM (the same image; one ring and one
    // set of activation boxes per SM).
    const bool two_wg = options.ctas_per_sm == 1 && rgrid % 2 == 0;
    const int diag = !two_wg && kpb == 0 ? options.debug_rows_diag : 0;
    M3_CHECK_ARG(options.row_early_stages >= 0,
                 "GemmWgmmaOptions::row_early_stages = ", options.row_early_stages,
                 " must be >= 0");
    // The K split (its own K blocks per stage; activation boxes of 64 token rows; M > 32).
    M3_CHECK_ARG(!options.row_k_split || kpb == 0 || kpb == 2, "GemmWgmmaOptions::burst = ", kpb,
                 " must be 0 or 2 with row_k_split");
    if (options.row_k_split && m <= 32)
      return unsupported("the row K split serves M 33 ... 64 (slower than the row split below: ",
                         "session 23), got M = ", m);
    M3_CHECK_ARG(!options.row_k_split || options.debug_rows_diag == 0 ||
                     options.debug_rows_diag == 2 || options.debug_rows_diag == 3 ||
                     options.debug_rows_diag == 4 || options.debug_rows_diag == 6 ||
                     options.debug_rows_diag == 7,
                 "GemmWgmmaOptions::debug_rows_diag = ", options.debug_rows_diag,
                 ": the row K split has diagnostics 2, 3, 4, 6 and 7");
    // (Activation slots of n >= 16 token rows load two boxes of n / 2 for M < n: SlotTokens in
    // gemm_wgmma_rows_kernel.cuh; the K split's slots have 64 rows.)
    const int slot = options.row_k_split ? 64 : box_rows_for(m);
    const int box = slot >= 16 && m < slot && !options.row_one_box ? slot / 2 : slot;
    CUtensorMap xmap;
    M3_RETURN_IF_ERROR(encode_map(&xmap, p.a.data, m, k, m <= 1 ? k : p.a.stride[0], box,
                                  CU_TENSOR_MAP_L2_PROMOTION_L2_256B, "activations"));
    gemm_wgmma_detail::RowsArgs ra;
    ra.image = static_cast<const uint8_t*>(options.row_packed_weights);
    set_scales_out(&ra, p);
    ra.n = static_cast<int>(n);
    ra.m = static_cast<int>(m);
    ra.kblocks = static_cast<int>(kblocks);
    ra.weight_evict_first = options.weight_evict_first ? 1 : 0;
    // (Early weights with programmatic launch: row_early_stages stages, or the kernel's default.)
    ra.early_weights = !options.programmatic_launch   ? 0
                       : options.row_early_stages > 0 ? options.row_early_stages
                                                      : -1;
    ra.trigger_dependents = options.trigger_dependents ? 1 : 0;
    ra.one_box = options.row_one_box ? 1 : 0;
    ra.trace = options.debug_trace;
    ra.row_align = row_align;
    if (options.row_k_split)
      return gemm_wgmma_detail::launch_rows_ksplit(xmap, ra, rgrid, options.debug_rows_diag, info,
                                                   stream);
    // Where one activation box serves (M = 16 / 32 / 64, or row_one_box), the default
    // configuration runs the kernel compiled without the two-box slot code (session 24 round L,
    // same round, b2b us plain / chained, 3 runs: M 32 17.28-17.38 / 16.33-16.44 against
    // 17.89-17.97 / 16.55-16.61; M 16 17.38-17.43 / 15.42-15.48 against 17.53-17.56 / 15.61-15.62;
    // M 64 19.70-19.78 / 18.46-18.51 against 19.86-19.87 / 18.54-18.58).
    const bool fixed =
        !two_wg && kpb == 0 && diag == 0 && (m == box_rows_for(m) || options.row_one_box);
    if (m <= 8)
      return dispatch_rows_kpb<8>(kpb, two_wg, diag, false, xmap, ra, rgrid, info, stream);
    if (m <= 16) return dispatch_rows_kpb<16>(kpb, two_wg, 0, fixed, xmap, ra, rgrid, info, stream);
    if (m <= 32)
      return dispatch_rows_kpb<32>(kpb, two_wg, diag, fixed, xmap, ra, rgrid, info, stream);
    return dispatch_rows_kpb<64>(kpb, two_wg, diag, fixed, xmap, ra, rgrid, info, stream);
  }

  // Automatic: two CTAs per SM at every M (session 15, round B, fused N 9856: M 32 23.65 vs 27.07
  // us with one, M 64 26.88 vs 30.37, once the split-K partials became fragment-major; before,
  // one CTA per SM was chosen above M 16).
  const int ctas_per_sm = options.ctas_per_sm != 0 ? options.ctas_per_sm : kMaxCtasPerSm;
  M3_CHECK_ARG(options.cluster_split <= kblocks,
               "GemmWgmmaOptions::cluster_split = ", options.cluster_split,
               " must not exceed K / 128 = ", kblocks);
  const int cluster_split = options.cluster_split;
  M3_CHECK_ARG(options.packed_weights == nullptr || cluster_split == 0,
               "GemmWgmmaOptions::packed_weights serves the stream-K split only (cluster_split = ",
               cluster_split, ")");
  M3_CHECK_ARG(reinterpret_cast<uintptr_t>(options.packed_weights) % 16 == 0,
               "GemmWgmmaOptions::packed_weights must be 16-byte aligned");
  const int64_t grid_cluster = tiles * cluster_split;
  M3_CHECK_ARG(grid_cluster < (int64_t{1} << 31),
               "run_gemm_wgmma_cuda: N / 128 x cluster_split = ", grid_cluster,
               " CTAs must be below 2^31");
  const int grid =
      cluster_split > 0 ? static_cast<int>(grid_cluster) : stream_k_grid(units, options, info.sms);
  const size_t counters = gemm_wgmma_counter_bytes(n);
  // Partial slots: two per CTA (stream-K), none (cluster split).
  const size_t slots = cluster_split > 0 ? 0 : size_t{2} * static_cast<size_t>(grid);
  const size_t need =
      counters + slots * static_cast<size_t>(padded_rows(m)) * kTileN * sizeof(float);
  M3_CHECK_ARG(workspace != nullptr && workspace_bytes >= need,
               "run_gemm_wgmma_cuda: the workspace holds ", workspace_bytes, " bytes, ", need,
               " are needed (N = ", n, ", M = ", m, ", ", grid,
               " CTAs): size it with gemm_wgmma_workspace_bytes");
  M3_CHECK_ARG(reinterpret_cast<uintptr_t>(workspace) % kCounterAlign == 0,
               "run_gemm_wgmma_cuda: the workspace must be ", kCounterAlign, "-byte aligned");

  // TMA: rows of one-row operands have no stride; any multiple of 16 bytes does.
  CUtensorMap wmap, xmap;
  const CUtensorMapL2promotion promotion =
      options.weight_l2_promotion == 0     ? CU_TENSOR_MAP_L2_PROMOTION_NONE
      : options.weight_l2_promotion == 64  ? CU_TENSOR_MAP_L2_PROMOTION_L2_64B
      : options.weight_l2_promotion == 128 ? CU_TENSOR_MAP_L2_PROMOTION_L2_128B
                                           : CU_TENSOR_MAP_L2_PROMOTION_L2_256B;
  M3_RETURN_IF_ERROR(
      encode_map(&wmap, p.b.data, n, k, p.b.stride[0], kTileN, promotion, "weights"));
  M3_RETURN_IF_ERROR(encode_map(&xmap, p.a.data, m, k, m <= 1 ? k : p.a.stride[0], box_rows_for(m),
                                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, "activations"));

  WgmmaArgs args;
  set_scales_out(&args, p);
  args.counters = static_cast<unsigned*>(workspace);
  args.partials = reinterpret_cast<float*>(static_cast<uint8_t*>(workspace) + counters);
  args.m = static_cast<int>(m);
  args.weight_evict_first = options.weight_evict_first ? 1 : 0;
  args.early_weights = options.programmatic_launch ? 1 : 0;
  args.trigger_dependents = options.trigger_dependents ? 1 : 0;
  // (The owner fixup waits for other CTAs of the grid: only with every CTA resident at once.)
  args.owner_fixup = options.owner_fixup && options.max_waves == 1 && cluster_split == 0 ? 1 : 0;
  args.cluster = cluster_split;
  args.burst = options.burst;  // resolved per ring depth in launch()
  args.trace = options.debug_trace;
  args.kblocks = static_cast<int>(kblocks);
  args.units = static_cast<int>(units);
  args.packed = static_cast<const uint8_t*>(options.packed_weights);
  if (ctas_per_sm == 1)
    return dispatch_rows<1>(args.m, wmap, xmap, args, grid, options.max_waves, info, stream);
  return dispatch_rows<2>(args.m, wmap, xmap, args, grid, options.max_waves, info, stream);
}

}  // namespace m3attn
