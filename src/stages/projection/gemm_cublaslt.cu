// The block-scaled FP8 GEMM through cuBLASLt (see gemm_cublaslt.h for the contract and layouts):
// heuristic choice, check and run; the autotuner is in gemm_autotune.cu.
#include <cublasLt.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <utility>
#include <vector>

#include "core/cuda_check.h"
#include "m3attn/config.h"
#include "stages/projection/gemm_cublaslt.h"
#include "stages/projection/gemm_cublaslt_internal.h"

namespace m3attn {

using namespace gemm_lt;  // NOLINT(build/namespaces)

namespace {

bool aligned_to(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

constexpr uint32_t kLooseAlignment = 16;
constexpr uintptr_t kStrictAlignment = 256;

std::string algo_summary(const cublasLtMatmulAlgo_t& algo) {
  // Attributes are 2 or 4 bytes wide: ask for the size, then read that many bytes.
  auto get = [&](cublasLtMatmulAlgoConfigAttributes_t attr) -> int64_t {
    size_t size = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, nullptr, 0, &size) !=
            CUBLAS_STATUS_SUCCESS ||
        (size != 2 && size != 4))
      return -1;
    size_t written = 0;
    if (size == 2) {
      uint16_t v = 0;
      if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, 2, &written) !=
          CUBLAS_STATUS_SUCCESS)
        return -1;
      return v;
    }
    int32_t v = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, 4, &written) != CUBLAS_STATUS_SUCCESS)
      return -1;
    return v;
  };
  std::ostringstream os;
  os << "algo " << get(CUBLASLT_ALGO_CONFIG_ID) << " tile " << get(CUBLASLT_ALGO_CONFIG_TILE_ID)
     << " stages " << get(CUBLASLT_ALGO_CONFIG_STAGES_ID) << " splitK "
     << get(CUBLASLT_ALGO_CONFIG_SPLITK_NUM) << " reduction "
     << get(CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME) << " swizzle "
     << get(CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING) << " cluster "
     << get(CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID);
  return os.str();
}

// "tile/splitK", e.g. "20/1", for the list of heuristic candidates.
std::string algo_tile_split(const cublasLtMatmulAlgo_t& algo) {
  uint32_t tile = 0;
  int32_t split = 0;
  size_t written = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile),
                                           &written) != CUBLAS_STATUS_SUCCESS)
    return "?";
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &split,
                                           sizeof(split), &written) != CUBLAS_STATUS_SUCCESS)
    split = -1;
  return std::to_string(tile) + "/" + std::to_string(split);
}

}  // namespace

TensorView gemm_activation_scales_view(float* data, int64_t m_pad, int64_t k, Device device) {
  return TensorView::strided(data, DType::kF32, {m_pad, k / kQuantBlock}, {1, m_pad}, device);
}

std::string Fp8BlockGemm::Impl::shape_string(int64_t m) const {
  std::ostringstream os;
  os << "(M = " << m << ", N = " << n << ", K = " << k << ")";
  return os.str();
}

// Sets the M-dependent layout sizes and the row strides (elements).
Status Fp8BlockGemm::Impl::set_problem(int64_t m, int64_t ld_x, int64_t ld_w, int64_t ld_d) {
  const uint64_t cols = static_cast<uint64_t>(m);
  M3_RETURN_IF_ERROR(set_layout(x_layout(), CUBLASLT_MATRIX_LAYOUT_COLS, cols,
                                "cublasLtMatrixLayoutSetAttribute(activations, COLS)"));
  M3_RETURN_IF_ERROR(set_layout(d_layout(), CUBLASLT_MATRIX_LAYOUT_COLS, cols,
                                "cublasLtMatrixLayoutSetAttribute(output, COLS)"));
  M3_RETURN_IF_ERROR(set_layout(x_layout(), CUBLASLT_MATRIX_LAYOUT_LD, ld_x,
                                "cublasLtMatrixLayoutSetAttribute(activations, LD)"));
  M3_RETURN_IF_ERROR(set_layout(w_layout(), CUBLASLT_MATRIX_LAYOUT_LD, ld_w,
                                "cublasLtMatrixLayoutSetAttribute(weights, LD)"));
  return set_layout(d_layout(), CUBLASLT_MATRIX_LAYOUT_LD, ld_d,
                    "cublasLtMatrixLayoutSetAttribute(output, LD)");
}

Status Fp8BlockGemm::Impl::set_scale_pointers(const void* weight_scales,
                                              const void* activation_scales) {
  M3_RETURN_IF_ERROR(set_desc(desc(), CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, weight_scales,
                              "cublasLtMatmulDescSetAttribute(A_SCALE_POINTER)"));
  return set_desc(desc(), CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, activation_scales,
                  "cublasLtMatmulDescSetAttribute(B_SCALE_POINTER)");
}

Status Fp8BlockGemm::Impl::init_descriptors() {
  M3_RETURN_IF_ERROR(lt_status(cublasLtMatmulDescInit(desc(), CUBLAS_COMPUTE_32F, CUDA_R_32F),
                               "cublasLtMatmulDescInit"));
  const int32_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
  M3_RETURN_IF_ERROR(set_desc(desc(), CUBLASLT_MATMUL_DESC_TRANSA, trans_a,
                              "cublasLtMatmulDescSetAttribute(TRANSA)"));
  M3_RETURN_IF_ERROR(set_desc(desc(), CUBLASLT_MATMUL_DESC_TRANSB, trans_b,
                              "cublasLtMatmulDescSetAttribute(TRANSB)"));
  const int8_t fast_accum = 0;
  M3_RETURN_IF_ERROR(set_desc(desc(), CUBLASLT_MATMUL_DESC_FAST_ACCUM, fast_accum,
                              "cublasLtMatmulDescSetAttribute(FAST_ACCUM)"));
  const int32_t weight_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
  const int32_t activation_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  M3_RETURN_IF_ERROR(set_desc(desc(), CUBLASLT_MATMUL_DESC_A_SCALE_MODE, weight_mode,
                              "cublasLtMatmulDescSetAttribute(A_SCALE_MODE = BLK128x128_32F)"));
  M3_RETURN_IF_ERROR(set_desc(desc(), CUBLASLT_MATMUL_DESC_B_SCALE_MODE, activation_mode,
                              "cublasLtMatmulDescSetAttribute(B_SCALE_MODE = VEC128_32F)"));
  // Placeholder scale pointers for the algorithm search (valid device memory, never read there);
  // run() sets the real ones.
  M3_RETURN_IF_ERROR(set_scale_pointers(workspace, workspace));
  M3_RETURN_IF_ERROR(
      lt_status(cublasLtMatrixLayoutInit(w_layout(), CUDA_R_8F_E4M3, static_cast<uint64_t>(k),
                                         static_cast<uint64_t>(n), k),
                "cublasLtMatrixLayoutInit(weights)"));
  M3_RETURN_IF_ERROR(lt_status(
      cublasLtMatrixLayoutInit(x_layout(), CUDA_R_8F_E4M3, static_cast<uint64_t>(k), 4, k),
      "cublasLtMatrixLayoutInit(activations)"));
  return lt_status(
      cublasLtMatrixLayoutInit(d_layout(), CUDA_R_16BF, static_cast<uint64_t>(n), 4, n),
      "cublasLtMatrixLayoutInit(output)");
}

// Picks the algorithm of one bucket for one alignment class.
Status Fp8BlockGemm::Impl::choose(Bucket& bucket, int variant) {
  cublasLtMatmulPreferenceOpaque_t pref_storage = {};
  cublasLtMatmulPreference_t pref = &pref_storage;
  M3_RETURN_IF_ERROR(lt_status(cublasLtMatmulPreferenceInit(pref), "cublasLtMatmulPreferenceInit"));
  const uint64_t max_ws = options.workspace_bytes;
  M3_RETURN_IF_ERROR(set_pref(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, max_ws,
                              "cublasLtMatmulPreferenceSetAttribute(MAX_WORKSPACE_BYTES)"));
  if (options.deterministic) {
    // Split-K is still allowed when its partial sums are reduced in a separate, ordered pass.
    const uint32_t mask =
        CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE | CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE;
    M3_RETURN_IF_ERROR(set_pref(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, mask,
                                "cublasLtMatmulPreferenceSetAttribute(REDUCTION_SCHEME_MASK)"));
  }
  if (variant == kUnaligned) {
    for (auto attr :
         {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
      M3_RETURN_IF_ERROR(set_pref(pref, attr, kLooseAlignment,
                                  "cublasLtMatmulPreferenceSetAttribute(MIN_ALIGNMENT)"));
  }

  M3_RETURN_IF_ERROR(set_problem(bucket.m_hi, k, k, n));
  std::vector<cublasLtMatmulHeuristicResult_t> results(
      static_cast<size_t>(options.heuristic_candidates));
  int returned = 0;
  M3_RETURN_IF_ERROR(lt_status(
      cublasLtMatmulAlgoGetHeuristic(handle, desc(), w_layout(), x_layout(), d_layout(), d_layout(),
                                     pref, options.heuristic_candidates, results.data(), &returned),
      "cublasLtMatmulAlgoGetHeuristic",
      "for the block-scaled FP8 GEMM " + shape_string(bucket.m_hi) +
          " (weights BLK128x128_32F op T, activations VEC128_32F op N)"));

  std::string first_failure;
  for (int i = 0; i < returned; ++i) {
    const cublasLtMatmulHeuristicResult_t& c = results[static_cast<size_t>(i)];
    if (c.state == CUBLAS_STATUS_SUCCESS) {
      bucket.candidates[variant] += (i ? " " : "") + algo_tile_split(c.algo);
    }
  }
  for (int i = 0; i < returned; ++i) {
    const cublasLtMatmulHeuristicResult_t& r = results[static_cast<size_t>(i)];
    if (r.state != CUBLAS_STATUS_SUCCESS || r.workspaceSize > options.workspace_bytes) continue;
    // The algorithm must also serve the smallest M of the bucket, within the workspace.
    size_t need = r.workspaceSize;
    bool ok = true;
    for (int64_t m : {bucket.m_lo, bucket.m_hi}) {
      M3_RETURN_IF_ERROR(set_problem(m, k, k, n));
      cublasLtMatmulHeuristicResult_t check = {};
      const cublasStatus_t st = cublasLtMatmulAlgoCheck(handle, desc(), w_layout(), x_layout(),
                                                        d_layout(), d_layout(), &r.algo, &check);
      if (st != CUBLAS_STATUS_SUCCESS || check.workspaceSize > options.workspace_bytes) {
        if (first_failure.empty())
          first_failure = lt_status(st, "cublasLtMatmulAlgoCheck", shape_string(m)).to_string();
        ok = false;
        break;
      }
      need = std::max(need, check.workspaceSize);
    }
    if (!ok) continue;
    bucket.algo[variant] = r.algo;
    bucket.workspace[variant] = need;
    bucket.available[variant] = true;
    bucket.chosen[variant] = i;
    return Status::Ok();
  }
  return unsupported(
      "no cuBLASLt algorithm serves the block-scaled FP8 GEMM for M in [", bucket.m_lo, ", ",
      bucket.m_hi, "], N = ", n, ", K = ", k, " with ", variant == kAligned ? "256" : "16",
      "-byte aligned operands and ", options.workspace_bytes, " bytes of workspace (", returned,
      " heuristic candidates", first_failure.empty() ? "" : "; ", first_failure, ")");
}

Fp8BlockGemm::Fp8BlockGemm(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Fp8BlockGemm::~Fp8BlockGemm() = default;

int64_t Fp8BlockGemm::max_m() const { return impl_->max_m; }
int64_t Fp8BlockGemm::n() const { return impl_->n; }
int64_t Fp8BlockGemm::k() const { return impl_->k; }
size_t Fp8BlockGemm::workspace_bytes() const {
  return impl_->options.workspace_bytes + impl_->wgmma_workspace_bytes + impl_->row_image_bytes;
}

Status Fp8BlockGemm::pack_weights_rows(const TensorView& b, cudaStream_t stream) {
  Impl& s = *impl_;
  M3_CHECK_ARG(b.dtype == DType::kE4M3 && b.ndim == 2 && b.shape[0] == s.n && b.shape[1] == s.k,
               "Fp8BlockGemm::pack_weights_rows: b must be E4M3 [", s.n, ", ", s.k, "]");
  M3_CHECK_ARG(b.device.type == DeviceType::kCUDA && b.device.index == s.device,
               "Fp8BlockGemm::pack_weights_rows: b must be on CUDA device ", s.device, ", got ",
               b.device.to_string());
  if (s.options.row_split_max_m <= 0)
    return unsupported("Fp8BlockGemm::pack_weights_rows: row_split_max_m is 0");
  M3_RETURN_IF_ERROR(gemm_wgmma_rows_supported(s.n, s.k));
  Result<size_t> bytes = gemm_wgmma_rows_packed_bytes(s.n, s.k);
  M3_RETURN_IF_ERROR(bytes.status());
  if (s.row_image == nullptr) {
    M3_CUDA_RETURN_IF_ERROR(cudaMalloc(&s.row_image, bytes.value()));
    s.row_image_bytes = bytes.value();
  }
  Result<int> ctas = gemm_wgmma_rows_ctas(s.n);
  M3_RETURN_IF_ERROR(ctas.status());
  s.row_weight = nullptr;  // (unused until the image is written)
  M3_RETURN_IF_ERROR(
      gemm_wgmma_pack_weights_rows(b, ctas.value(), s.row_image, s.row_image_bytes, stream, 1));
  s.row_ctas = ctas.value();
  s.row_weight = b.data;
  s.row_weight_stride = b.stride[0];
  return Status::Ok();
}

Result<std::unique_ptr<Fp8BlockGemm>> Fp8BlockGemm::create(int64_t max_m, int64_t n, int64_t k,
                                                           const Fp8BlockGemmOptions& options) {
  M3_CHECK_ARG(max_m >= 1 && max_m < (int64_t{1} << 31), "Fp8BlockGemm max_m = ", max_m,
               " must be in [1, 2^31)");
  M3_CHECK_ARG(n > 0 && n % kQuantBlock == 0 && n < (int64_t{1} << 31), "Fp8BlockGemm N = ", n,
               " must be a positive multiple of ", kQuantBlock, " below 2^31");
  M3_CHECK_ARG(k > 0 && k % kQuantBlock == 0 && k < (int64_t{1} << 31), "Fp8BlockGemm K = ", k,
               " must be a positive multiple of ", kQuantBlock, " below 2^31");
  M3_CHECK_ARG(options.small_m_max >= 0 && options.small_m_max <= 16,
               "Fp8BlockGemm small_m_max = ", options.small_m_max, " must be in [0, 16]");
  M3_CHECK_ARG(options.wgmma_max_m >= -1 && options.wgmma_max_m <= kGemmWgmmaMaxM,
               "Fp8BlockGemm wgmma_max_m = ", options.wgmma_max_m, " must be in [-1, ",
               kGemmWgmmaMaxM, "]");
  M3_CHECK_ARG(options.wgmma.ctas_per_sm >= 0 && options.wgmma.ctas_per_sm <= 2,
               "Fp8BlockGemm wgmma.ctas_per_sm = ", options.wgmma.ctas_per_sm,
               " must be in [0, 2]");
  M3_CHECK_ARG(options.wgmma.min_units_per_cta >= 1,
               "Fp8BlockGemm wgmma.min_units_per_cta = ", options.wgmma.min_units_per_cta,
               " must be >= 1");
  M3_CHECK_ARG(options.row_split_max_m >= 0 && options.row_split_max_m <= kGemmWgmmaMaxM,
               "Fp8BlockGemm row_split_max_m = ", options.row_split_max_m, " must be in [0, ",
               kGemmWgmmaMaxM, "]");
  M3_CHECK_ARG(options.wgmma_auto_max_m >= -1 && options.wgmma_auto_max_m <= kGemmWgmmaMaxM,
               "Fp8BlockGemm wgmma_auto_max_m = ", options.wgmma_auto_max_m, " must be in [-1, ",
               kGemmWgmmaMaxM, "]");
  M3_CHECK_ARG(options.prefill_min_m >= 0, "Fp8BlockGemm prefill_min_m = ", options.prefill_min_m,
               " must be >= 0");
  {
    const GemmPrefillOptions& o = options.prefill;
    const int shape = 10 * o.cluster_m + o.cluster_n;
    M3_CHECK_ARG(shape == 11 || shape == 21 || shape == 12, "Fp8BlockGemm prefill cluster ",
                 o.cluster_m, " x ", o.cluster_n, ": must be 1 x 1, 2 x 1 or 1 x 2");
    M3_CHECK_ARG(o.group_m >= 1, "Fp8BlockGemm prefill.group_m = ", o.group_m, " must be >= 1");
  }
  int64_t wgmma_max_m = options.wgmma_max_m;
  int64_t wgmma_auto = 0;  // buckets with m_hi <= this: the autotuner may choose the wgmma kernel
  if (wgmma_max_m < 0) {
    const char* env = std::getenv("M3ATTN_GEMM_PATH");
    const bool env_auto = env != nullptr && std::strcmp(env, "auto") == 0;
    if (env == nullptr || *env == '\0' || env_auto) {
      wgmma_max_m = kGemmWgmmaDefaultMaxM;
      wgmma_auto = options.wgmma_auto_max_m >= 0 ? options.wgmma_auto_max_m
                   : env_auto                    ? kGemmWgmmaMaxM
                                                 : kGemmWgmmaAutoMaxM;
      if (!options.autotune) wgmma_auto = 0;
    } else if (std::strcmp(env, "wgmma") == 0) {
      wgmma_max_m = kGemmWgmmaMaxM;
    } else if (std::strcmp(env, "cublaslt") == 0) {
      wgmma_max_m = 0;
    } else {
      return make_status(StatusCode::kInvalidArgument, "M3ATTN_GEMM_PATH = \"", env,
                         "\" must be \"wgmma\", \"cublaslt\" or \"auto\"");
    }
  }
  M3_CHECK_ARG(options.autotune_budget_ms >= 0 && options.autotune_budget_ms <= 600e3,
               "Fp8BlockGemm autotune_budget_ms = ", options.autotune_budget_ms,
               " must be in [0, 600000]");
  M3_CHECK_ARG(options.autotune_max_timed >= 0,
               "Fp8BlockGemm autotune_max_timed = ", options.autotune_max_timed, " must be >= 0");
  M3_CHECK_ARG(options.heuristic_candidates >= 1 && options.heuristic_candidates <= 256,
               "Fp8BlockGemm heuristic_candidates = ", options.heuristic_candidates,
               " must be in [1, 256]");

  auto impl = std::make_unique<Impl>();
  impl->max_m = max_m;
  impl->n = n;
  impl->k = k;
  impl->options = options;
  M3_CUDA_RETURN_IF_ERROR(cudaGetDevice(&impl->device));
  int major = 0, minor = 0;
  M3_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, impl->device));
  M3_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, impl->device));
  if (major != 9)
    return unsupported(
        "Fp8BlockGemm uses cuBLASLt's Hopper block-scaled FP8 modes (sm_90); device ", impl->device,
        " is sm_", major, minor);

  M3_RETURN_IF_ERROR(lt_status(cublasLtCreate(&impl->handle), "cublasLtCreate"));
  M3_CUDA_RETURN_IF_ERROR(
      cudaMalloc(&impl->workspace, std::max<size_t>(options.workspace_bytes, 256)));
  M3_RETURN_IF_ERROR(impl->init_descriptors());
  impl->wgmma_max_m = std::min(wgmma_max_m, gemm_padded_rows(max_m));
  impl->wgmma_auto_max_m = std::min(wgmma_auto, gemm_padded_rows(max_m));
  if (impl->wgmma_max_m > 0 || impl->wgmma_auto_max_m > 0) {
    Result<size_t> bytes =
        gemm_wgmma_workspace_bytes(n, std::max(impl->wgmma_max_m, impl->wgmma_auto_max_m),
                                   options.wgmma.max_waves, options.wgmma.ctas_per_sm);
    M3_RETURN_IF_ERROR(bytes.status());
    impl->wgmma_workspace_bytes = bytes.value();
    M3_CUDA_RETURN_IF_ERROR(cudaMalloc(&impl->wgmma_workspace, impl->wgmma_workspace_bytes));
    M3_CUDA_RETURN_IF_ERROR(cudaMemset(impl->wgmma_workspace, 0, impl->wgmma_workspace_bytes));
  }

  // M buckets: 4, 8, 16, ... and finally round_up(max_m, 4).
  const int64_t m_cap = gemm_padded_rows(max_m);
  int64_t lo = 4;
  for (int64_t hi = 4;; hi *= 2) {
    Bucket b;
    b.m_lo = lo;
    b.m_hi = std::min(hi, m_cap);
    impl->buckets.push_back(b);
    if (b.m_hi == m_cap) break;
    lo = b.m_hi + 4;
  }
  for (Bucket& b : impl->buckets) {
    // The 256-byte algorithm is required; the 16-byte one only serves less aligned operands, and
    // without it such calls are refused with the search's reason.
    M3_RETURN_IF_ERROR(impl->choose(b, kAligned));
    const Status loose = impl->choose(b, kUnaligned);
    if (!loose.ok()) b.why_not[kUnaligned] = loose.to_string();
  }
  if (options.autotune) impl->autotune();
  return std::unique_ptr<Fp8BlockGemm>(new Fp8BlockGemm(std::move(impl)));
}

Status Fp8BlockGemm::check(const GemmParams& p) const {
  M3_RETURN_IF_ERROR(validate_gemm(p));
  const Impl& s = *impl_;
  int current = -1;
  M3_CUDA_RETURN_IF_ERROR(cudaGetDevice(&current));
  M3_CHECK_ARG(current == s.device, "Fp8BlockGemm was created on device ", s.device,
               " but the current device is ", current);
  for (const TensorView* t : {&p.a, &p.a_scales, &p.b, &p.b_scales, &p.out})
    M3_CHECK_ARG(t->device == Device::cuda(s.device),
                 "Fp8BlockGemm needs tensors on cuda:", s.device, ", got one on ",
                 t->device.to_string());

  const int64_t m = p.a.shape[0], k = p.a.shape[1], n = p.b.shape[0];
  M3_CHECK_ARG(n == s.n && k == s.k, "Fp8BlockGemm was created for N = ", s.n, ", K = ", s.k,
               " but got N = ", n, ", K = ", k);
  M3_CHECK_ARG(m <= gemm_padded_rows(s.max_m), "Fp8BlockGemm M = ", m, " exceeds max_m = ", s.max_m,
               " (padded to ", gemm_padded_rows(s.max_m), ") given at creation");
  if (m == 0) return Status::Ok();  // nothing to compute: the scale layouts do not matter
  if (m % 4 != 0)
    return unsupported(
        "Fp8BlockGemm needs M % 4 == 0 (cuBLASLt 1x128 activation scaling), got M = ", m,
        ": quantize into ", gemm_padded_rows(m), " rows (padding rows q = 0, scale = 1)");

  const int64_t kb = k / kQuantBlock;
  // Activation scales token-major: (m, kb) at m + kb * M.
  M3_CHECK_ARG((m <= 1 || p.a_scales.stride[0] == 1) && (kb <= 1 || p.a_scales.stride[1] == m),
               "Fp8BlockGemm A scales must have strides (1, M) = (1, ", m,
               ") (cuBLASLt VEC128_32F layout, see gemm_activation_scales_view), got (",
               p.a_scales.stride[0], ", ", p.a_scales.stride[1], ")");
  // Weight scales row-major [N / 128, K / 128], rows round_up(K / 128, 4) apart.
  const int64_t kb_row = gemm_weight_scales_row_stride(k);
  M3_CHECK_ARG((n / kQuantBlock <= 1 || p.b_scales.stride[0] == kb_row) &&
                   (kb <= 1 || p.b_scales.stride[1] == 1),
               "Fp8BlockGemm B scales must have strides (round_up(K / 128, 4), 1) = (", kb_row,
               ", 1) (cuBLASLt BLK128x128_32F layout), got (", p.b_scales.stride[0], ", ",
               p.b_scales.stride[1], ")");
  M3_RETURN_IF_ERROR(check_alignment(p.a_scales, 16, "Fp8BlockGemm A scales"));
  M3_RETURN_IF_ERROR(check_alignment(p.b_scales, 16, "Fp8BlockGemm B scales"));
  return Status::Ok();
}

namespace {

// The row split over `image` (packed for `ctas` CTAs) with the object's wgmma options otherwise.
Status run_rows(const Fp8BlockGemmOptions& options, const GemmParams& p, const void* image,
                int ctas, const void* ks_image, int ks_ctas, int ks_align, bool programmatic,
                cudaStream_t stream) {
  GemmWgmmaOptions o = options.wgmma;
  o.row_packed_weights = image;
  o.row_packed_ctas = ctas;
  o.burst = 0;
  o.cluster_split = 0;
  o.packed_weights = nullptr;
  o.programmatic_launch = o.programmatic_launch || programmatic;
  o.trigger_dependents = o.trigger_dependents || programmatic;
  if (ks_image != nullptr && options.row_k_split_min_m > 0 &&
      p.a.shape[0] >= options.row_k_split_min_m) {
    // The K split over its own image; where it cannot serve the call (unsupported: checked before
    // any launch, nothing ran) the row split below.
    GemmWgmmaOptions ks = o;
    ks.row_packed_weights = ks_image;
    ks.row_packed_ctas = ks_ctas;
    ks.row_k_split = true;
    ks.row_k_split_align = ks_align;
    const Status st = run_gemm_wgmma_cuda(p, nullptr, 0, stream, ks);
    if (st.code() != StatusCode::kUnsupported) return st;
  }
  return run_gemm_wgmma_cuda(p, nullptr, 0, stream, o);  // (the row split needs no workspace)
}

}  // namespace

Status Fp8BlockGemm::run_row_split(const GemmParams& p, const GemmRowImage& image,
                                   bool programmatic, cudaStream_t stream) {
  const Impl& s = *impl_;
  const int64_t m = p.a.shape[0];
  if (image.data == nullptr || m > s.options.row_split_max_m || m > kGemmWgmmaMaxM)
    return run(p, stream);
  M3_RETURN_IF_ERROR(check(p));
  if (m == 0) return Status::Ok();
  return run_rows(s.options, p, image.data, image.ctas, image.ks_data, image.ks_ctas,
                  image.ks_row_align, programmatic, stream);
}

Status Fp8BlockGemm::run(const GemmParams& p, cudaStream_t stream) {
  M3_RETURN_IF_ERROR(check(p));
  Impl& s = *impl_;
  const int64_t m = p.a.shape[0];
  if (m == 0) return Status::Ok();
  if (s.row_weight != nullptr && p.b.data == s.row_weight && p.b.stride[0] == s.row_weight_stride &&
      m <= s.options.row_split_max_m && m <= kGemmWgmmaMaxM)
    return run_rows(s.options, p, s.row_image, s.row_ctas, nullptr, 0, 1, false, stream);
  if (m <= s.wgmma_max_m)
    return run_gemm_wgmma_cuda(p, s.wgmma_workspace, s.wgmma_workspace_bytes, stream,
                               s.options.wgmma);
  if (m <= s.options.small_m_max) return run_gemm_small_m_cuda(p, stream);

  const Bucket* bucket = &s.buckets.back();
  for (const Bucket& b : s.buckets) {
    if (m <= b.m_hi) {
      bucket = &b;
      break;
    }
  }
  if (bucket->wgmma)  // the autotuner's choice (auto mode); m <= wgmma_auto_max_m
    return run_gemm_wgmma_cuda(p, s.wgmma_workspace, s.wgmma_workspace_bytes, stream,
                               bucket->wgmma_options);
  if (s.options.prefill_min_m > 0 && m >= s.options.prefill_min_m && s.options.force_prefill)
    return run_gemm_prefill_cuda(p, stream, s.options.prefill);
  if (bucket->prefill)  // the autotuner's choice; m_hi >= prefill_min_m
    return run_gemm_prefill_cuda(p, stream, bucket->prefill_options);
  const bool aligned = aligned_to(p.a.data, kStrictAlignment) &&
                       aligned_to(p.b.data, kStrictAlignment) &&
                       aligned_to(p.out.data, kStrictAlignment) &&
                       p.a.stride[0] % static_cast<int64_t>(kStrictAlignment) == 0 &&
                       p.b.stride[0] % static_cast<int64_t>(kStrictAlignment) == 0 &&
                       (p.out.stride[0] * 2) % static_cast<int64_t>(kStrictAlignment) == 0;
  const int variant = aligned ? kAligned : kUnaligned;
  if (!bucket->available[variant])
    return unsupported(
        "Fp8BlockGemm: A, B or out is not 256-byte aligned (pointers and row strides) ",
        "and cuBLASLt offered no 16-byte algorithm for M = ", m, ": ", bucket->why_not[variant]);

  M3_RETURN_IF_ERROR(s.set_problem(m, p.a.stride[0], p.b.stride[0], p.out.stride[0]));
  M3_RETURN_IF_ERROR(s.set_scale_pointers(p.b_scales.data, p.a_scales.data));
  const float alpha = 1.0f, beta = 0.0f;
  const cublasStatus_t st =
      cublasLtMatmul(s.handle, s.desc(), &alpha, p.b.data, s.w_layout(), p.a.data, s.x_layout(),
                     &beta, p.out.data, s.d_layout(), p.out.data, s.d_layout(),
                     &bucket->algo[variant], s.workspace, s.options.workspace_bytes, stream);
  if (st == CUBLAS_STATUS_SUCCESS) return Status::Ok();  // (no message built on the hot path)
  return lt_status(st, "cublasLtMatmul", "for the block-scaled FP8 GEMM " + s.shape_string(m));
}

int64_t Fp8BlockGemm::wgmma_max_m() const { return impl_->wgmma_max_m; }
int64_t Fp8BlockGemm::wgmma_auto_max_m() const { return impl_->wgmma_auto_max_m; }

std::string Fp8BlockGemm::algorithm_for(int64_t m) const {
  const Impl& s = *impl_;
  if (m >= 1 && m <= s.wgmma_max_m) return "wgmma kernel (run_gemm_wgmma_cuda)";
  if (m >= 1 && m <= s.options.small_m_max) return "small-M kernel (run_gemm_small_m_cuda)";
  const Bucket* bucket = &s.buckets.back();
  for (const Bucket& b : s.buckets) {
    if (m <= b.m_hi) {
      bucket = &b;
      break;
    }
  }
  if (s.options.prefill_min_m > 0 && m >= s.options.prefill_min_m && s.options.force_prefill)
    return "prefill kernel (run_gemm_prefill_cuda, forced: " +
           prefill_label(s.options.prefill) + ")";
  if (bucket->prefill)
    return "prefill kernel (run_gemm_prefill_cuda, autotuned: " +
           prefill_label(bucket->prefill_options) + ")";
  if (bucket->wgmma)
    return "wgmma kernel (run_gemm_wgmma_cuda, autotuned: min units per CTA " +
           std::to_string(bucket->wgmma_options.min_units_per_cta) + ", L2 promotion " +
           std::to_string(bucket->wgmma_options.weight_l2_promotion) + ", waves " +
           std::to_string(bucket->wgmma_options.max_waves) + ", cluster split " +
           std::to_string(bucket->wgmma_options.cluster_split) + ")";
  return short_label(bucket->algo[kAligned]) +
         (bucket->chosen[kAligned] == -2 ? " (autotuned)" : " (heuristic)");
}

std::string Fp8BlockGemm::describe() const {
  const Impl& s = *impl_;
  std::ostringstream os;
  os << "Fp8BlockGemm N = " << s.n << ", K = " << s.k << ", max_m = " << s.max_m << ", workspace "
     << s.options.workspace_bytes << " B"
     << (s.options.deterministic ? ", deterministic reductions" : ", any reduction")
     << ", small-M kernel for M <= " << s.options.small_m_max
     << ", wgmma kernel for M <= " << s.wgmma_max_m
     << " (autotuned candidate for M <= " << s.wgmma_auto_max_m << ")"
     << (s.options.autotune ? ", autotuned" : ", heuristic only")
     << (s.row_weight != nullptr
             ? ", row split for M <= " + std::to_string(s.options.row_split_max_m) +
                   " on the packed weight"
             : std::string())
     << "\n";
  for (const Bucket& b : s.buckets) {
    os << "  M in [" << b.m_lo << ", " << b.m_hi << "]: aligned " << algo_summary(b.algo[kAligned])
       << " ws " << b.workspace[kAligned] << " ("
       << (b.chosen[kAligned] == -2 ? std::string("autotuned")
                                    : "candidate " + std::to_string(b.chosen[kAligned]))
       << "; heuristic offered [" << b.candidates[kAligned] << "]); 16B ";
    if (b.available[kUnaligned]) {
      os << algo_summary(b.algo[kUnaligned]) << " ws " << b.workspace[kUnaligned];
    } else {
      os << "none";
    }
    os << "\n";
    if (b.wgmma) os << "    -> wgmma kernel (autotuned)\n";
    if (b.prefill)
      os << "    -> prefill kernel, " << prefill_label(b.prefill_options) << " (autotuned)\n";
    if (!b.tuning.empty()) os << "    " << b.tuning << "\n";
  }
  return os.str();
}

}  // namespace m3attn
