// Private to the cuBLASLt GEMM (gemm_cublaslt.cu: heuristic choice, check, run) and its autotuner
// (gemm_autotune.cu): cuBLASLt helpers, the per-M-bucket algorithm record, the autotuning scratch
// types and Fp8BlockGemm::Impl. Not part of the library's interface.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "m3attn/status.h"
#include "stages/projection/gemm_cublaslt.h"

namespace m3attn {
namespace gemm_lt {

inline Status lt_status(cublasStatus_t st, const char* call, const std::string& context = {}) {
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

constexpr int kAligned = 0;    // operands 256-byte aligned (cuBLASLt's default assumption)
constexpr int kUnaligned = 1;  // operands only 16-byte aligned

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
  double tuned_us = -1;       // the autotuner's time of the kept cuBLASLt algorithm at m_hi
  unsigned long long tuned_print = 0;  // its output fingerprint on the scratch operands
  bool wgmma = false;  // the autotuner chose the wgmma kernel for this bucket (auto mode)
  GemmWgmmaOptions wgmma_options;  // with wgmma: the options it was timed fastest with
  bool prefill = false;  // the autotuner chose the prefill kernel for this bucket
  GemmPrefillOptions prefill_options;  // with prefill: the options it was timed fastest with
};

constexpr int kTuneMaxIters = 7;

// Buckets from this M on are timed on random operands (TuneScratch::ar / wr; outputs are still
// compared on the integer ones). Why (session 22, round D, fused N 9856, K 6144, M 16384, 500 ms
// idle before each timing): on random operands the GPU runs into its 700 W power cap, and
// cuBLASLt with 1x1 clusters (custom option 4), which the tuner had timed 1.4 % faster than the
// heuristic's 1x2 on its integer operands, ran 1627-1641 us isolated against 1520; 2x1 / 1x1
// clusters read twice the L2 bytes of the 1x2 multicast. On integer operands (little power) the
// two are equal (1369-1371 us).
constexpr int64_t kTuneRandomMinM = 1024;

// Device memory and events of one tuning session (freed by the destructor).
struct TuneScratch {
  int64_t m = 0, ld_x = 0, ld_w = 0, ld_d = 0;
  uint8_t* a = nullptr;
  float* sa = nullptr;
  uint8_t* w = nullptr;
  float* sw = nullptr;
  // Random E4M3 copies of a and w (every finite code), allocated when m >= kTuneRandomMinM: with
  // random_timing set, the timed launches read them (the fingerprint launch always reads a / w).
  uint8_t* ar = nullptr;
  uint8_t* wr = nullptr;
  bool random_timing = false;
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
                    static_cast<void*>(sw), static_cast<void*>(ar), static_cast<void*>(wr),
                    static_cast<void*>(d), static_cast<void*>(hash), flush})
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

// Reads a config attribute of 2 or 4 bytes (-1 when unreadable).
inline int64_t config_value(const cublasLtMatmulAlgo_t& algo,
                            cublasLtMatmulAlgoConfigAttributes_t attr) {
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

inline std::string short_label(const cublasLtMatmulAlgo_t& algo) {
  std::ostringstream os;
  os << "algo " << config_value(algo, CUBLASLT_ALGO_CONFIG_ID) << " tile "
     << config_value(algo, CUBLASLT_ALGO_CONFIG_TILE_ID) << " stages "
     << config_value(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID) << " splitK "
     << config_value(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM) << " red "
     << config_value(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME) << " swz "
     << config_value(algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING) << " cluster "
     << config_value(algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID) << " custom "
     << config_value(algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION);
  return os.str();
}

using TuneClock = std::chrono::steady_clock;

inline std::string prefill_label(const GemmPrefillOptions& o) {
  return "cluster " + std::to_string(o.cluster_m) + "x" + std::to_string(o.cluster_n) + " group " +
         std::to_string(o.group_m);
}

}  // namespace gemm_lt

struct Fp8BlockGemm::Impl {
  int device = 0;
  int64_t max_m = 0;
  int64_t n = 0;
  int64_t k = 0;
  Fp8BlockGemmOptions options;
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;        // options.workspace_bytes, at least 256 bytes
  int64_t wgmma_max_m = 0;          // resolved Fp8BlockGemmOptions::wgmma_max_m (forced)
  int64_t wgmma_auto_max_m = 0;     // auto mode: buckets up to this M may choose wgmma
  void* wgmma_workspace = nullptr;  // run_gemm_wgmma_cuda's, counters zeroed at creation
  size_t wgmma_workspace_bytes = 0;
  void* row_image = nullptr;  // pack_weights_rows: the row split's image of row_weight
  size_t row_image_bytes = 0;
  int row_ctas = 0;  // the CTA count row_image was packed for
  const void* row_weight = nullptr;
  int64_t row_weight_stride = 0;
  // Descriptors live inside the object (initialized in place): run() allocates nothing.
  cublasLtMatmulDescOpaque_t desc_storage = {};
  cublasLtMatrixLayoutOpaque_t w_storage = {};  // cuBLAS A: weights, K x N column-major, op T
  cublasLtMatrixLayoutOpaque_t x_storage = {};  // cuBLAS B: activations, K x M column-major
  cublasLtMatrixLayoutOpaque_t d_storage = {};  // cuBLAS C and D: output, N x M column-major
  std::vector<gemm_lt::Bucket> buckets;

  cublasLtMatmulDesc_t desc() { return &desc_storage; }
  cublasLtMatrixLayout_t w_layout() { return &w_storage; }
  cublasLtMatrixLayout_t x_layout() { return &x_storage; }
  cublasLtMatrixLayout_t d_layout() { return &d_storage; }

  ~Impl() {
    if (workspace) cudaFree(workspace);
    if (wgmma_workspace) cudaFree(wgmma_workspace);
    if (row_image) cudaFree(row_image);
    if (handle) cublasLtDestroy(handle);
  }

  std::string shape_string(int64_t m) const;

  // Sets the M-dependent layout sizes and the row strides (elements).
  Status set_problem(int64_t m, int64_t ld_x, int64_t ld_w, int64_t ld_d);

  Status set_scale_pointers(const void* weight_scales, const void* activation_scales);

  Status init_descriptors();

  // Picks the algorithm of one bucket for one alignment class.
  Status choose(gemm_lt::Bucket& bucket, int variant);

  // ---- autotuning (gemm_autotune.cu; create() only: allocates, synchronizes) ---------------

  // Scratch operands for M = m with 256-byte row strides; filled with exact integer data.
  Status make_scratch(int64_t m, gemm_lt::TuneScratch* t);

  // cublasLtMatmulAlgoCheck at both ends of the bucket; leaves the layouts at m_hi.
  bool check_bucket(const gemm_lt::Bucket& b, const gemm_lt::TuneScratch& t,
                    const cublasLtMatmulAlgo_t& algo, gemm_lt::Candidate* c);

  // One launch on the scratch operands (layouts at the scratch M, scale pointers set); `timed`:
  // on the random copies when t.random_timing.
  cublasStatus_t launch_scratch(const cublasLtMatmulAlgo_t& algo, const gemm_lt::TuneScratch& t,
                                bool timed = false);

  // Runs the candidate once into a poisoned output and fingerprints it, then times `iters`
  // launches (L2 flushed before each). Returns kCudaError only for a CUDA failure (the tuning
  // stops); a refused launch sets *launched = false.
  // Only the first `rows` output rows are poisoned and fingerprinted (the launch's M).
  Status measure(const cublasLtMatmulAlgo_t& algo, const gemm_lt::TuneScratch& t, int64_t rows,
                 int iters, bool* launched, unsigned long long* fingerprint, double* median_us);

  // Algorithm ids and capabilities for this type combination (once per object).
  std::vector<gemm_lt::AlgoCaps> algo_ids(int first_id);

  // Times alternatives to bucket.algo[kAligned] at m_hi and keeps the fastest (>= 2% faster).
  // Returns kCudaError only for a CUDA failure (the caller stops tuning).
  Status tune_bucket(gemm_lt::Bucket& b, const gemm_lt::TuneScratch& t,
                     const std::vector<gemm_lt::AlgoCaps>& caps,
                     gemm_lt::TuneClock::time_point deadline);

  // Auto mode: times the wgmma kernel at b.m_hi (Fp8BlockGemmOptions::wgmma, and a few other
  // grid / burst shapes when those are the defaults) and chooses it for the bucket when its output
  // equals the cuBLASLt algorithm's and it is at least 2% faster.
  Status tune_wgmma(gemm_lt::Bucket& b, const gemm_lt::TuneScratch& t);

  // Buckets with m_hi >= prefill_min_m: times the prefill kernel (clusters 1x2 and 2x1) at b.m_hi
  // against the kept cuBLASLt algorithm and chooses the faster shape when its output is identical
  // and it is at least 2 % faster.
  Status tune_prefill(gemm_lt::Bucket& b, const gemm_lt::TuneScratch& t);

  // Tunes every bucket with m_hi <= autotune_max_m within the time budget. Never fails: what
  // cannot be tuned keeps the heuristic's choice, with the reason in Bucket::tuning.
  void autotune();
};

}  // namespace m3attn
