// The block-scaled FP8 GEMM through cuBLASLt (see gemm_cublaslt.h for the contract and layouts).
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

namespace m3attn {

namespace {

Status lt_status(cublasStatus_t st, const char* call, const std::string& context = {}) {
  if (st == CUBLAS_STATUS_SUCCESS) return Status::Ok();
  return make_status(StatusCode::kCudaError, call, " failed: ", cublasLtGetStatusName(st),
                     " (cuBLAS status ", static_cast<int>(st), ": ", cublasLtGetStatusString(st),
                     ")", context.empty() ? "" : " ", context);
}

template <typename T>
Status set_desc(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const T& value,
                const char* what) {
  return lt_status(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)), what);
}

template <typename T>
Status set_layout(cublasLtMatrixLayout_t layout, cublasLtMatrixLayoutAttribute_t attr,
                  const T& value, const char* what) {
  return lt_status(cublasLtMatrixLayoutSetAttribute(layout, attr, &value, sizeof(value)), what);
}

template <typename T>
Status set_pref(cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr,
                const T& value, const char* what) {
  return lt_status(cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value)), what);
}

bool aligned_to(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

constexpr int kAligned = 0;    // operands 256-byte aligned (cuBLASLt's default assumption)
constexpr int kUnaligned = 1;  // operands only 16-byte aligned
constexpr uint32_t kLooseAlignment = 16;
constexpr uintptr_t kStrictAlignment = 256;

struct Bucket {
  int64_t m_lo = 0;  // smallest M of the bucket (a multiple of 4)
  int64_t m_hi = 0;  // largest M of the bucket, the size the heuristic was asked about
  cublasLtMatmulAlgo_t algo[2] = {};
  size_t workspace[2] = {0, 0};
  bool available[2] = {false, false};
  std::string why_not[2];     // the search's failure when an algorithm is missing
  std::string candidates[2];  // what the heuristic offered: "tile/splitK" per candidate, in order
  int chosen[2] = {-1, -1};   // index of the kept candidate
  std::string tuning;         // what the autotuner did for the 256-byte algorithm
};

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

// ---- autotuning helpers --------------------------------------------------------------------

__host__ __device__ inline uint64_t tune_mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// E4M3 values in {-2, -1, 0, 1, 2}: with power-of-two scales every product, 128-block sum and
// cross-block fp32 sum is exact, so every algorithm (and split-K with an fp32 reduction) writes
// the same bf16 bits.
__global__ void tune_fill_e4m3(uint8_t* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const uint32_t h = static_cast<uint32_t>(
        tune_mix64(static_cast<uint64_t>(i) ^ (static_cast<uint64_t>(seed) << 48)) >> 32);
    const uint32_t v = h % 5u;  // codes of -2, -1, 0, 1, 2
    p[i] = static_cast<uint8_t>(v == 0   ? 0xC0u
                                : v == 1 ? 0xB8u
                                : v == 2 ? 0x00u
                                : v == 3 ? 0x38u
                                         : 0x40u);
  }
}

__global__ void tune_fill_f32(float* p, int64_t n, float value) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    p[i] = value;
}

// Order-independent 64-bit fingerprint of n bf16 values (sum of a hash of (index, bits)).
__global__ void tune_hash_bf16(const uint16_t* d, int64_t n, unsigned long long* out) {
  unsigned long long acc = 0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    acc += tune_mix64((static_cast<uint64_t>(i) << 16) | d[i]);
  for (int off = 16; off > 0; off /= 2) acc += __shfl_down_sync(0xffffffffu, acc, off);
  if ((threadIdx.x & 31) == 0) atomicAdd(out, acc);
}

constexpr int kTuneMaxIters = 7;

// Device memory and events of one tuning session (freed by the destructor).
struct TuneScratch {
  int64_t m = 0, ld_x = 0, ld_w = 0, ld_d = 0;
  uint8_t* a = nullptr;
  float* sa = nullptr;
  uint8_t* w = nullptr;
  float* sw = nullptr;
  uint16_t* d = nullptr;
  unsigned long long* hash = nullptr;
  void* flush = nullptr;
  size_t flush_bytes = 0;
  cudaStream_t stream = nullptr;
  cudaEvent_t ev[2 * kTuneMaxIters] = {};
  int events = 0;

  ~TuneScratch() {
    if (stream) cudaStreamSynchronize(stream);
    for (int i = 0; i < events; ++i) cudaEventDestroy(ev[i]);
    for (void* p : {static_cast<void*>(a), static_cast<void*>(sa), static_cast<void*>(w),
                    static_cast<void*>(sw), static_cast<void*>(d), static_cast<void*>(hash), flush})
      if (p) cudaFree(p);
    if (stream) cudaStreamDestroy(stream);
  }
  size_t d_elems() const { return static_cast<size_t>(m * ld_d); }
};

struct Candidate {
  cublasLtMatmulAlgo_t algo = {};
  size_t workspace = 0;
  float waves = 0;
  double us = -1;
  std::string label;
};

// What a cuBLASLt algorithm id can do (cublasLtMatmulAlgoCapGetAttribute).
struct AlgoCaps {
  int id = 0;
  cublasLtMatmulAlgo_t base = {};
  std::vector<uint32_t> tiles, stages;
  int32_t splitk = 0;
  uint32_t reduction_mask = 0;
  uint32_t swizzle = 0;
};

std::vector<uint32_t> cap_list(const cublasLtMatmulAlgo_t& algo,
                               cublasLtMatmulAlgoCapAttributes_t attr) {
  size_t bytes = 0;
  if (cublasLtMatmulAlgoCapGetAttribute(&algo, attr, nullptr, 0, &bytes) != CUBLAS_STATUS_SUCCESS ||
      bytes == 0 || bytes % sizeof(uint32_t) != 0 || bytes > 4096)
    return {};
  std::vector<uint32_t> v(bytes / sizeof(uint32_t));
  size_t written = 0;
  if (cublasLtMatmulAlgoCapGetAttribute(&algo, attr, v.data(), bytes, &written) !=
      CUBLAS_STATUS_SUCCESS)
    return {};
  v.resize(std::min(v.size(), written / sizeof(uint32_t)));
  return v;
}

template <typename T>
bool cap_value(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoCapAttributes_t attr, T* out) {
  size_t written = 0;
  return cublasLtMatmulAlgoCapGetAttribute(&algo, attr, out, sizeof(T), &written) ==
         CUBLAS_STATUS_SUCCESS;
}

template <typename T>
bool set_config(cublasLtMatmulAlgo_t* algo, cublasLtMatmulAlgoConfigAttributes_t attr, T value) {
  return cublasLtMatmulAlgoConfigSetAttribute(algo, attr, &value, sizeof(T)) ==
         CUBLAS_STATUS_SUCCESS;
}

// Reads a config attribute of 2 or 4 bytes (-1 when unreadable).
int64_t config_value(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
  size_t size = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, nullptr, 0, &size) != CUBLAS_STATUS_SUCCESS)
    return -1;
  size_t written = 0;
  if (size == 2) {
    uint16_t v = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, 2, &written) != CUBLAS_STATUS_SUCCESS)
      return -1;
    return v;
  }
  if (size == 4) {
    int32_t v = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, 4, &written) != CUBLAS_STATUS_SUCCESS)
      return -1;
    return v;
  }
  return -1;
}

// The configuration as a comparable tuple of attribute values.
std::vector<int64_t> config_key(const cublasLtMatmulAlgo_t& algo) {
  std::vector<int64_t> key;
  for (auto attr :
       {CUBLASLT_ALGO_CONFIG_ID, CUBLASLT_ALGO_CONFIG_TILE_ID, CUBLASLT_ALGO_CONFIG_STAGES_ID,
        CUBLASLT_ALGO_CONFIG_SPLITK_NUM, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME,
        CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION,
        CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID})
    key.push_back(config_value(algo, attr));
  return key;
}

std::string short_label(const cublasLtMatmulAlgo_t& algo) {
  std::ostringstream os;
  os << "algo " << config_value(algo, CUBLASLT_ALGO_CONFIG_ID) << " tile "
     << config_value(algo, CUBLASLT_ALGO_CONFIG_TILE_ID) << " stages "
     << config_value(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID) << " splitK "
     << config_value(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM) << " red "
     << config_value(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME) << " swz "
     << config_value(algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING) << " cluster "
     << config_value(algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID);
  return os.str();
}

std::string fmt_us(double us) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f", us);
  return buf;
}

using TuneClock = std::chrono::steady_clock;

}  // namespace

TensorView gemm_activation_scales_view(float* data, int64_t m_pad, int64_t k, Device device) {
  return TensorView::strided(data, DType::kF32, {m_pad, k / kQuantBlock}, {1, m_pad}, device);
}

struct Fp8BlockGemm::Impl {
  int device = 0;
  int64_t max_m = 0;
  int64_t n = 0;
  int64_t k = 0;
  Fp8BlockGemmOptions options;
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;        // options.workspace_bytes, at least 256 bytes
  int64_t wgmma_max_m = 0;          // resolved Fp8BlockGemmOptions::wgmma_max_m
  void* wgmma_workspace = nullptr;  // run_gemm_wgmma_cuda's, counters zeroed at creation
  size_t wgmma_workspace_bytes = 0;
  // Descriptors live inside the object (initialized in place): run() allocates nothing.
  cublasLtMatmulDescOpaque_t desc_storage = {};
  cublasLtMatrixLayoutOpaque_t w_storage = {};  // cuBLAS A: weights, K x N column-major, op T
  cublasLtMatrixLayoutOpaque_t x_storage = {};  // cuBLAS B: activations, K x M column-major
  cublasLtMatrixLayoutOpaque_t d_storage = {};  // cuBLAS C and D: output, N x M column-major
  std::vector<Bucket> buckets;

  cublasLtMatmulDesc_t desc() { return &desc_storage; }
  cublasLtMatrixLayout_t w_layout() { return &w_storage; }
  cublasLtMatrixLayout_t x_layout() { return &x_storage; }
  cublasLtMatrixLayout_t d_layout() { return &d_storage; }

  ~Impl() {
    if (workspace) cudaFree(workspace);
    if (wgmma_workspace) cudaFree(wgmma_workspace);
    if (handle) cublasLtDestroy(handle);
  }

  std::string shape_string(int64_t m) const {
    std::ostringstream os;
    os << "(M = " << m << ", N = " << n << ", K = " << k << ")";
    return os.str();
  }

  // Sets the M-dependent layout sizes and the row strides (elements).
  Status set_problem(int64_t m, int64_t ld_x, int64_t ld_w, int64_t ld_d) {
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

  Status set_scale_pointers(const void* weight_scales, const void* activation_scales) {
    M3_RETURN_IF_ERROR(set_desc(desc(), CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, weight_scales,
                                "cublasLtMatmulDescSetAttribute(A_SCALE_POINTER)"));
    return set_desc(desc(), CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, activation_scales,
                    "cublasLtMatmulDescSetAttribute(B_SCALE_POINTER)");
  }

  Status init_descriptors() {
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
  Status choose(Bucket& bucket, int variant) {
    cublasLtMatmulPreferenceOpaque_t pref_storage = {};
    cublasLtMatmulPreference_t pref = &pref_storage;
    M3_RETURN_IF_ERROR(
        lt_status(cublasLtMatmulPreferenceInit(pref), "cublasLtMatmulPreferenceInit"));
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
    M3_RETURN_IF_ERROR(
        lt_status(cublasLtMatmulAlgoGetHeuristic(handle, desc(), w_layout(), x_layout(), d_layout(),
                                                 d_layout(), pref, options.heuristic_candidates,
                                                 results.data(), &returned),
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

  // ---- autotuning (create() only: allocates, synchronizes) ------------------------------------

  // Scratch operands for M = m with 256-byte row strides; filled with exact integer data.
  Status make_scratch(int64_t m, TuneScratch* t) {
    t->m = m;
    t->ld_x = (k + 255) / 256 * 256;
    t->ld_w = t->ld_x;
    t->ld_d = (n + 127) / 128 * 128;
    const int64_t kb = k / kQuantBlock, kb_row = gemm_weight_scales_row_stride(k);
    auto alloc = [](void** p, size_t bytes, const char* what) -> Status {
      const cudaError_t e = cudaMalloc(p, std::max<size_t>(bytes, 256));
      if (e != cudaSuccess) {
        cudaGetLastError();  // an allocation failure is not sticky: clear it
        *p = nullptr;
        return make_status(StatusCode::kCudaError, "autotune scratch cudaMalloc(", what, ", ",
                           bytes, " B) failed: ", cudaGetErrorString(e));
      }
      return Status::Ok();
    };
    M3_RETURN_IF_ERROR(
        alloc(reinterpret_cast<void**>(&t->a), static_cast<size_t>(m * t->ld_x), "activations"));
    M3_RETURN_IF_ERROR(alloc(reinterpret_cast<void**>(&t->sa), static_cast<size_t>(m * kb) * 4,
                             "activation scales"));
    M3_RETURN_IF_ERROR(
        alloc(reinterpret_cast<void**>(&t->w), static_cast<size_t>(n * t->ld_w), "weights"));
    M3_RETURN_IF_ERROR(alloc(reinterpret_cast<void**>(&t->sw),
                             static_cast<size_t>(n / kQuantBlock * kb_row) * 4, "weight scales"));
    M3_RETURN_IF_ERROR(alloc(reinterpret_cast<void**>(&t->d), t->d_elems() * 2, "output"));
    M3_RETURN_IF_ERROR(alloc(reinterpret_cast<void**>(&t->hash), 8, "fingerprint"));
    int l2 = 0;
    if (cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device) == cudaSuccess && l2 > 0) {
      t->flush_bytes = 2 * static_cast<size_t>(l2);
      if (!alloc(&t->flush, t->flush_bytes, "L2 flush").ok()) t->flush_bytes = 0;  // no flush
    }
    M3_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&t->stream, cudaStreamNonBlocking));
    for (int i = 0; i < 2 * kTuneMaxIters; ++i) {
      M3_CUDA_RETURN_IF_ERROR(cudaEventCreate(&t->ev[i]));
      t->events = i + 1;
    }
    tune_fill_e4m3<<<1024, 256, 0, t->stream>>>(t->a, m * t->ld_x, 1);
    tune_fill_e4m3<<<1024, 256, 0, t->stream>>>(t->w, n * t->ld_w, 2);
    tune_fill_f32<<<256, 256, 0, t->stream>>>(t->sa, m * kb, 1.0f / 64);
    tune_fill_f32<<<256, 256, 0, t->stream>>>(t->sw, n / kQuantBlock * kb_row, 1.0f / 32);
    M3_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    M3_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(t->stream));
    return Status::Ok();
  }

  // cublasLtMatmulAlgoCheck at both ends of the bucket; leaves the layouts at m_hi.
  bool check_bucket(const Bucket& b, const TuneScratch& t, const cublasLtMatmulAlgo_t& algo,
                    Candidate* c) {
    bool ok = true;
    for (int64_t m : {b.m_lo, b.m_hi}) {
      if (!set_problem(m, t.ld_x, t.ld_w, t.ld_d).ok()) return false;
      cublasLtMatmulHeuristicResult_t r = {};
      if (cublasLtMatmulAlgoCheck(handle, desc(), w_layout(), x_layout(), d_layout(), d_layout(),
                                  &algo, &r) != CUBLAS_STATUS_SUCCESS ||
          r.workspaceSize > options.workspace_bytes) {
        ok = false;
        break;
      }
      c->workspace = std::max(c->workspace, r.workspaceSize);
      if (m == b.m_hi) c->waves = r.wavesCount;
    }
    if (!set_problem(b.m_hi, t.ld_x, t.ld_w, t.ld_d).ok()) return false;
    if (ok) c->algo = algo;
    return ok;
  }

  // One launch on the scratch operands (layouts at the scratch M, scale pointers set).
  cublasStatus_t launch_scratch(const cublasLtMatmulAlgo_t& algo, const TuneScratch& t) {
    const float alpha = 1.0f, beta = 0.0f;
    return cublasLtMatmul(handle, desc(), &alpha, t.w, w_layout(), t.a, x_layout(), &beta, t.d,
                          d_layout(), t.d, d_layout(), &algo, workspace, options.workspace_bytes,
                          t.stream);
  }

  // Runs the candidate once into a poisoned output and fingerprints it, then times `iters`
  // launches (L2 flushed before each). Returns kCudaError only for a CUDA failure (the tuning
  // stops); a refused launch sets *launched = false.
  // Only the first `rows` output rows are poisoned and fingerprinted (the launch's M).
  Status measure(const cublasLtMatmulAlgo_t& algo, const TuneScratch& t, int64_t rows, int iters,
                 bool* launched, unsigned long long* fingerprint, double* median_us) {
    const size_t elems = static_cast<size_t>(std::min(rows, t.m) * t.ld_d);
    *launched = false;
    M3_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(t.d, 0xFF, elems * 2, t.stream));
    M3_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(t.hash, 0, 8, t.stream));
    if (launch_scratch(algo, t) != CUBLAS_STATUS_SUCCESS) {
      cudaGetLastError();
      return cudaStreamSynchronize(t.stream) == cudaSuccess
                 ? Status::Ok()
                 : make_status(StatusCode::kCudaError,
                               "autotune: stream failed after a refused launch");
    }
    tune_hash_bf16<<<512, 256, 0, t.stream>>>(t.d, static_cast<int64_t>(elems), t.hash);
    M3_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    unsigned long long h = 0;
    M3_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(&h, t.hash, 8, cudaMemcpyDeviceToHost, t.stream));
    M3_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(t.stream));
    *fingerprint = h;
    iters = std::max(1, std::min(iters, kTuneMaxIters));
    for (int i = 0; i < iters; ++i) {
      if (t.flush_bytes)
        M3_CUDA_RETURN_IF_ERROR(
            cudaMemsetAsync(t.flush, i & 1 ? 0x5A : 0xA5, t.flush_bytes, t.stream));
      M3_CUDA_RETURN_IF_ERROR(cudaEventRecord(t.ev[2 * i], t.stream));
      if (launch_scratch(algo, t) != CUBLAS_STATUS_SUCCESS) {
        cudaGetLastError();
        M3_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(t.stream));
        return Status::Ok();  // not launched
      }
      M3_CUDA_RETURN_IF_ERROR(cudaEventRecord(t.ev[2 * i + 1], t.stream));
    }
    M3_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(t.stream));
    std::vector<double> us;
    for (int i = 0; i < iters; ++i) {
      float ms = 0;
      M3_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, t.ev[2 * i], t.ev[2 * i + 1]));
      us.push_back(1e3 * ms);
    }
    std::sort(us.begin(), us.end());
    *median_us = us[us.size() / 2];
    *launched = true;
    return Status::Ok();
  }

  // Algorithm ids and capabilities for this type combination (once per object).
  std::vector<AlgoCaps> algo_ids(int first_id) {
    std::vector<int> ids(256);
    int count = 0;
    if (cublasLtMatmulAlgoGetIds(
            handle, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, CUDA_R_16BF,
            CUDA_R_16BF, static_cast<int>(ids.size()), ids.data(), &count) != CUBLAS_STATUS_SUCCESS)
      count = 0;
    ids.resize(static_cast<size_t>(std::max(count, 0)));
    // The heuristic's id first, then the others in the library's order.
    ids.erase(std::remove(ids.begin(), ids.end(), first_id), ids.end());
    ids.insert(ids.begin(), first_id);
    std::vector<AlgoCaps> out;
    for (int id : ids) {
      if (out.size() >= 16) break;
      AlgoCaps c;
      c.id = id;
      if (cublasLtMatmulAlgoInit(handle, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_8F_E4M3,
                                 CUDA_R_8F_E4M3, CUDA_R_16BF, CUDA_R_16BF, id,
                                 &c.base) != CUBLAS_STATUS_SUCCESS)
        continue;
      c.tiles = cap_list(c.base, CUBLASLT_ALGO_CAP_TILE_IDS);
      c.stages = cap_list(c.base, CUBLASLT_ALGO_CAP_STAGES_IDS);
      if (!cap_value(c.base, CUBLASLT_ALGO_CAP_SPLITK_SUPPORT, &c.splitk)) c.splitk = 0;
      if (!cap_value(c.base, CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK, &c.reduction_mask))
        c.reduction_mask = 0;
      if (!cap_value(c.base, CUBLASLT_ALGO_CAP_CTA_SWIZZLING_SUPPORT, &c.swizzle)) c.swizzle = 0;
      if (c.tiles.empty()) c.tiles.push_back(CUBLASLT_MATMUL_TILE_UNDEFINED);
      if (c.stages.empty()) c.stages.push_back(CUBLASLT_MATMUL_STAGES_UNDEFINED);
      out.push_back(std::move(c));
    }
    return out;
  }

  // Times alternatives to bucket.algo[kAligned] at m_hi and keeps the fastest (>= 2% faster).
  // Returns kCudaError only for a CUDA failure (the caller stops tuning).
  Status tune_bucket(Bucket& b, const TuneScratch& t, const std::vector<AlgoCaps>& caps,
                     TuneClock::time_point deadline) {
    const auto t0 = TuneClock::now();
    const auto phase_a_end = t0 + (deadline - t0) * 7 / 10;
    const int iters = b.m_hi <= 1024 ? 5 : 3;
    int checks = 0, timed = 0, refused = 0, differ = 0;
    std::vector<std::vector<int64_t>> seen;
    std::vector<Candidate> results;

    Candidate ref;
    if (!check_bucket(b, t, b.algo[kAligned], &ref)) {
      b.tuning =
          "not tuned: the heuristic's algorithm fails cublasLtMatmulAlgoCheck with "
          "256-byte row strides";
      return Status::Ok();
    }
    M3_RETURN_IF_ERROR(set_scale_pointers(t.sw, t.sa));
    bool launched = false;
    unsigned long long ref_print = 0;
    M3_RETURN_IF_ERROR(measure(ref.algo, t, b.m_hi, iters, &launched, &ref_print, &ref.us));
    if (!launched) {
      b.tuning = "not tuned: the heuristic's algorithm did not launch on the scratch operands";
      return Status::Ok();
    }
    ref.label = short_label(ref.algo);
    seen.push_back(config_key(ref.algo));

    // Times one configured algorithm unless already seen; false when the time is up.
    auto consider = [&](const cublasLtMatmulAlgo_t& algo, TuneClock::time_point until,
                        Status* error) -> bool {
      if (TuneClock::now() >= until || timed >= options.autotune_max_timed) return false;
      std::vector<int64_t> key = config_key(algo);
      if (std::find(seen.begin(), seen.end(), key) != seen.end()) return true;
      seen.push_back(std::move(key));
      Candidate c;
      ++checks;
      if (!check_bucket(b, t, algo, &c)) return true;
      // Deterministic fp32 reductions only (split-K partial sums in fp32, out of place).
      const int64_t split = config_value(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM);
      const int64_t red = config_value(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME);
      if (split > 1 && red != CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE) return true;
      unsigned long long print = 0;
      bool ok = false;
      ++timed;
      (void)(*error = measure(c.algo, t, b.m_hi, iters, &ok, &print, &c.us));
      if (!error->ok()) return false;
      if (!ok) {
        ++refused;
        return true;
      }
      if (print != ref_print) {
        ++differ;
        return true;
      }
      c.label = short_label(c.algo);
      results.push_back(std::move(c));
      return true;
    };
    Status error = Status::Ok();

    // (1) The heuristic's other candidates.
    {
      cublasLtMatmulPreferenceOpaque_t pref_storage = {};
      cublasLtMatmulPreference_t pref = &pref_storage;
      const uint64_t max_ws = options.workspace_bytes;
      const uint32_t mask = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
      std::vector<cublasLtMatmulHeuristicResult_t> hr(32);
      int returned = 0;
      if (cublasLtMatmulPreferenceInit(pref) == CUBLAS_STATUS_SUCCESS &&
          set_pref(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, max_ws, "pref").ok() &&
          set_pref(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, mask, "pref").ok() &&
          cublasLtMatmulAlgoGetHeuristic(handle, desc(), w_layout(), x_layout(), d_layout(),
                                         d_layout(), pref, static_cast<int>(hr.size()), hr.data(),
                                         &returned) == CUBLAS_STATUS_SUCCESS) {
        for (int i = 0; i < returned; ++i) {
          if (hr[static_cast<size_t>(i)].state != CUBLAS_STATUS_SUCCESS) continue;
          if (!consider(hr[static_cast<size_t>(i)].algo, phase_a_end, &error)) break;
        }
      }
      M3_RETURN_IF_ERROR(error);
    }

    // (2) Explicit shapes: every tile of every id, with the first stages id that passes, under a
    // few cluster shapes; ordered by how well they fill the last wave, then timed.
    std::vector<Candidate> shapes;
    const uint16_t clusters[] = {CUBLASLT_CLUSTER_SHAPE_AUTO,  CUBLASLT_CLUSTER_SHAPE_1x1x1,
                                 CUBLASLT_CLUSTER_SHAPE_2x1x1, CUBLASLT_CLUSTER_SHAPE_1x2x1,
                                 CUBLASLT_CLUSTER_SHAPE_2x2x1, CUBLASLT_CLUSTER_SHAPE_4x1x1,
                                 CUBLASLT_CLUSTER_SHAPE_1x4x1};
    const int64_t ref_stages = config_value(ref.algo, CUBLASLT_ALGO_CONFIG_STAGES_ID);
    bool out_of_time = false;
    for (const AlgoCaps& c : caps) {
      for (uint32_t tile : c.tiles) {
        if (checks > 4000 || TuneClock::now() >= phase_a_end) {
          out_of_time = true;
          break;
        }
        // Stages: the heuristic's first (when this id lists it), then the listed ones; the
        // first that passes with the automatic cluster shape serves the other cluster shapes.
        std::vector<uint32_t> stages;
        if (ref_stages >= 0 && std::find(c.stages.begin(), c.stages.end(),
                                         static_cast<uint32_t>(ref_stages)) != c.stages.end())
          stages.push_back(static_cast<uint32_t>(ref_stages));
        for (uint32_t st : c.stages)
          if (stages.empty() || st != stages.front()) stages.push_back(st);
        int64_t found = -1;
        for (uint16_t cluster : clusters) {
          for (uint32_t st : stages) {
            if (found >= 0 && st != static_cast<uint32_t>(found)) continue;
            cublasLtMatmulAlgo_t algo = c.base;
            if (!set_config(&algo, CUBLASLT_ALGO_CONFIG_TILE_ID, tile) ||
                !set_config(&algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, st) ||
                !set_config(&algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, cluster))
              continue;
            Candidate cand;
            ++checks;
            if (check_bucket(b, t, algo, &cand)) {
              shapes.push_back(cand);
              found = st;
              break;
            }
          }
          if (found < 0) break;  // no stages id passes for this tile: next tile
        }
      }
      if (out_of_time) break;
    }
    auto fill = [](float waves) {
      if (!(waves > 0)) return 0.0;
      return static_cast<double>(waves) / std::ceil(static_cast<double>(waves));
    };
    std::stable_sort(shapes.begin(), shapes.end(), [&](const Candidate& x, const Candidate& y) {
      return fill(x.waves) > fill(y.waves);
    });
    for (const Candidate& c : shapes) {
      if (!consider(c.algo, phase_a_end, &error)) break;
    }
    M3_RETURN_IF_ERROR(error);

    // (3) Split-K (fp32 out-of-place reduction) and CTA swizzle on the three fastest so far.
    std::vector<Candidate> top = results;
    top.push_back(ref);
    std::stable_sort(top.begin(), top.end(),
                     [](const Candidate& x, const Candidate& y) { return x.us < y.us; });
    if (top.size() > 3) top.resize(3);
    for (const Candidate& base : top) {
      const int id = static_cast<int>(config_value(base.algo, CUBLASLT_ALGO_CONFIG_ID));
      const AlgoCaps* cap = nullptr;
      for (const AlgoCaps& c : caps)
        if (c.id == id) cap = &c;
      if (!cap) continue;
      const bool can_split =
          cap->splitk != 0 && (cap->reduction_mask & CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE) != 0;
      for (int32_t split : {1, 2, 3, 4, 6, 8}) {
        if (split > 1 && !can_split) break;
        for (uint32_t swizzle : {0u, 1u}) {
          if (swizzle && !cap->swizzle) continue;
          cublasLtMatmulAlgo_t algo = base.algo;
          const uint32_t red = split > 1
                                   ? static_cast<uint32_t>(CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE)
                                   : static_cast<uint32_t>(CUBLASLT_REDUCTION_SCHEME_NONE);
          if (!set_config(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, split) ||
              !set_config(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, red) ||
              !set_config(&algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, swizzle))
            continue;
          if (!consider(algo, deadline, &error)) break;
        }
        M3_RETURN_IF_ERROR(error);
      }
    }

    // Choice: the fastest verified candidate if it beats the heuristic's by at least 2%.
    const Candidate* best = nullptr;
    for (const Candidate& c : results)
      if (!best || c.us < best->us) best = &c;
    const bool replace = best && best->us < 0.98 * ref.us;
    std::ostringstream os;
    os << "tuned at M = " << b.m_hi << ": heuristic " << fmt_us(ref.us) << " us; ";
    if (replace) {
      os << "chose " << best->label << " " << fmt_us(best->us) << " us";
      b.algo[kAligned] = best->algo;
      b.workspace[kAligned] = best->workspace;
      b.chosen[kAligned] = -2;  // -2: the autotuner's choice
    } else {
      os << "kept it"
         << (best ? " (best other " + best->label + " " + fmt_us(best->us) + " us)"
                  : std::string());
    }
    os << "; " << checks << " checked, " << timed << " timed, " << refused << " refused at launch, "
       << differ << " with a different output, "
       << std::chrono::duration_cast<std::chrono::milliseconds>(TuneClock::now() - t0).count()
       << " ms" << (out_of_time ? " (enumeration cut by time)" : "");
    b.tuning = os.str();
    return Status::Ok();
  }

  // Tunes every bucket with m_hi <= autotune_max_m within the time budget. Never fails: what
  // cannot be tuned keeps the heuristic's choice, with the reason in Bucket::tuning.
  void autotune() {
    const auto start = TuneClock::now();
    const auto deadline =
        start + std::chrono::microseconds(static_cast<int64_t>(options.autotune_budget_ms * 1e3));
    int64_t m_tune = 0;
    for (const Bucket& b : buckets)
      if (b.m_hi <= options.autotune_max_m) m_tune = std::max(m_tune, b.m_hi);
    for (Bucket& b : buckets)
      if (b.m_hi > options.autotune_max_m)
        b.tuning = "not tuned: M above autotune_max_m = " + std::to_string(options.autotune_max_m);
    if (m_tune == 0) return;
    std::string failure;
    {
      TuneScratch t;
      Status st = make_scratch(m_tune, &t);
      if (st.ok()) {
        const std::vector<AlgoCaps> caps = algo_ids(static_cast<int>(
            config_value(buckets.front().algo[kAligned], CUBLASLT_ALGO_CONFIG_ID)));
        int remaining = 0;
        for (const Bucket& b : buckets) remaining += b.m_hi <= options.autotune_max_m;
        for (Bucket& b : buckets) {
          if (b.m_hi > options.autotune_max_m) continue;
          const auto now = TuneClock::now();
          if (now >= deadline) {
            b.tuning = "not tuned: autotune_budget_ms spent";
            --remaining;
            continue;
          }
          const auto slice = (deadline - now) / std::max(remaining, 1);
          (void)(st = tune_bucket(b, t, caps, now + slice));
          --remaining;
          if (!st.ok()) break;
        }
      }
      if (!st.ok()) failure = st.to_string();
    }
    // The scratch descriptors state does not matter: run() sets sizes, strides and scale
    // pointers on every call. Put the placeholders back for tidiness.
    (void)set_scale_pointers(workspace, workspace);
    if (!failure.empty()) {
      cudaGetLastError();
      for (Bucket& b : buckets)
        if (b.tuning.empty()) b.tuning = "not tuned: " + failure;
    }
  }
};

Fp8BlockGemm::Fp8BlockGemm(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Fp8BlockGemm::~Fp8BlockGemm() = default;

int64_t Fp8BlockGemm::max_m() const { return impl_->max_m; }
int64_t Fp8BlockGemm::n() const { return impl_->n; }
int64_t Fp8BlockGemm::k() const { return impl_->k; }
size_t Fp8BlockGemm::workspace_bytes() const { return impl_->options.workspace_bytes; }

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
  int64_t wgmma_max_m = options.wgmma_max_m;
  if (wgmma_max_m < 0) {
    const char* env = std::getenv("M3ATTN_GEMM_PATH");
    if (env == nullptr || *env == '\0') {
      wgmma_max_m = kGemmWgmmaDefaultMaxM;
    } else if (std::strcmp(env, "wgmma") == 0) {
      wgmma_max_m = kGemmWgmmaMaxM;
    } else if (std::strcmp(env, "cublaslt") == 0) {
      wgmma_max_m = 0;
    } else {
      return make_status(StatusCode::kInvalidArgument, "M3ATTN_GEMM_PATH = \"", env,
                         "\" must be \"wgmma\" or \"cublaslt\"");
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
  if (impl->wgmma_max_m > 0) {
    Result<size_t> bytes = gemm_wgmma_workspace_bytes(n, impl->wgmma_max_m);
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

Status Fp8BlockGemm::run(const GemmParams& p, cudaStream_t stream) {
  M3_RETURN_IF_ERROR(check(p));
  Impl& s = *impl_;
  const int64_t m = p.a.shape[0];
  if (m == 0) return Status::Ok();
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
     << (s.options.autotune ? ", autotuned" : ", heuristic only") << "\n";
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
    if (!b.tuning.empty()) os << "    " << b.tuning << "\n";
  }
  return os.str();
}

}  // namespace m3attn
