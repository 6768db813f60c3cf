// CudaMsaLayer: one MiniMax-M3 attention layer (sparse MSA or dense) on the GPU, for one
// tensor-parallel rank, built from the stages' CUDA launchers (same pipeline as MsaLayer):
//
//   hidden bf16 [Tp, hidden] -> run_quantize_cuda (1x128 E4M3, token-major scales, M padded to 4)
//     -> fused:   Fp8BlockGemm over [Q|K|V|iQ|iK]            -> run_producer_cuda(kFused)
//        unfused: Fp8BlockGemm over [Q|K|V] and [iQ|iK]      -> kMain + kIndex producers
//        dense:   Fp8BlockGemm over [Q|K|V]                  -> kMain producer
//     -> run_indexer_cuda (sparse) -> run_attention_cuda -> run_quantize_cuda -> o_proj GEMM
//     -> attn_out bf16 [Tp, hidden] (a layer-owned buffer; rows >= T are padding)
// By default the attention writes o_proj's E4M3 input itself (the output quantize stage then
// launches nothing: set_attention_quantize). Optionally every stage kernel but the cuBLASLt GEMMs
// is launched with programmatic dependent launch (set_programmatic_launch, off by default). Both
// give the same bytes as plain launches and the separate quantize stage.
//
// Three objects:
//   CudaStepMetadata   persistent device copies of one step's metadata (positions, slots,
//                      query_start, seq_lens, page_table) at a declared capacity, refreshed by
//                      upload() from pinned staging with cudaMemcpyAsync. upload() may PAD the
//                      step to a larger shape (Tp tokens, Rp requests): padding tokens get slot -1
//                      and position 0 (no cache write), padding requests are empty (query_start =
//                      T, seq_len 0, page-table row of -1), page-table columns past the step's
//                      width are -1. A CUDA graph captured at one padded shape can therefore be
//                      replayed for any smaller step uploaded at the same shape: no stale slot of
//                      a larger earlier step is ever read.
//   CudaLayerWorkspace activations, stage workspaces and the four Fp8BlockGemm objects sized for
//                      the capacity; shared by all layers of a stack (they run one after another
//                      on one stream).
//   CudaMsaLayer       device copies of one rank's packed weights, its norms and the RoPE table;
//                      plan() builds every stage's params over the metadata, the workspace and
//                      the caller's caches (host only, validates everything, touches nothing on
//                      the device); run() launches the stages: no allocation, no sync, no host
//                      read of device data -> CUDA-graph capturable.
//
// Lifetimes: a plan points into the metadata, the workspace, the layer and the caches given to
// plan(); all must outlive every run (and every graph captured from one).
#pragma once

#if defined(M3ATTN_WITH_CUDA)
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>

#include "cache/batch.h"
#include "cache/step_plan.h"
#include "layer/msa_layer.h"
#include "m3attn/config.h"
#include "m3attn/tensor.h"
#include "stages/attention/attention.h"
#include "stages/indexer/indexer.h"
#include "stages/producer/producer.h"
#include "stages/projection/gemm_cublaslt.h"
#include "stages/projection/projection.h"
#include "stages/quantize/quantize.h"
#include "weights/packing.h"

namespace m3attn {

// An owning device allocation (cudaMalloc, so 256-byte aligned). Move-only.
class CudaBuffer {
 public:
  CudaBuffer() = default;
  static Result<CudaBuffer> create(size_t bytes);
  ~CudaBuffer();
  CudaBuffer(CudaBuffer&& o) noexcept;
  CudaBuffer& operator=(CudaBuffer&& o) noexcept;
  CudaBuffer(const CudaBuffer&) = delete;
  CudaBuffer& operator=(const CudaBuffer&) = delete;
  void* data() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  template <typename T>
  T* ptr() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Upper bounds of one step, fixed at creation. Every buffer is sized from them.
struct CudaLayerCapacity {
  int64_t max_tokens = 0;  // T (or padded Tp) of the largest step
  int max_requests = 0;    // R (or padded Rp) of the largest step
  int max_pages = 0;       // page-table width every plan uses (>= any request's page count)
  Status validate() const;
  // Rows of the GEMM buffers: gemm_padded_rows(max_tokens).
  int64_t padded_rows() const { return gemm_padded_rows(max_tokens); }
};

// The shape the kernels see for one step. 0 = the step's own T / R.
struct CudaStepShape {
  int64_t tokens = 0;
  int requests = 0;
};

class CudaStepMetadata {
 public:
  static Result<std::unique_ptr<CudaStepMetadata>> create(const CudaLayerCapacity& capacity);
  ~CudaStepMetadata();
  CudaStepMetadata(const CudaStepMetadata&) = delete;
  CudaStepMetadata& operator=(const CudaStepMetadata&) = delete;

  // Host checks first (nothing is written when one fails): the plan's batch contents against a
  // pool of num_pages pages (validate_batch_contents), every slot against the page table, every
  // position < max_position (the RoPE table), T <= Tp <= capacity, R <= Rp <= capacity,
  // plan width <= capacity width. Then fills the pinned staging (after waiting for the previous
  // upload's copies: the only host wait) and enqueues the copies on `stream`.
  Status upload(const StepPlan& step, int64_t num_pages, int64_t max_position,
                const CudaStepShape& shape, cudaStream_t stream);

  const CudaLayerCapacity& capacity() const { return capacity_; }
  int64_t tokens() const { return tokens_; }            // Tp of the last upload
  int requests() const { return requests_; }            // Rp of the last upload
  int64_t real_tokens() const { return real_tokens_; }  // T of the last upload
  int real_requests() const { return real_requests_; }
  int64_t num_pages() const { return num_pages_; }
  // Device views at the last upload's padded shape (page-table width = capacity width).
  BatchView batch() const;
  TensorView positions() const;  // i32 [Tp]
  TensorView slots() const;      // i32 [Tp]

 private:
  CudaStepMetadata() = default;
  CudaLayerCapacity capacity_;
  CudaBuffer device_;           // positions | slots | query_start | seq_lens | page_table
  int32_t* staging_ = nullptr;  // pinned mirror of device_
  cudaEvent_t copied_ = nullptr;
  bool pending_ = false;
  int64_t tokens_ = 0, real_tokens_ = 0, num_pages_ = 0;
  int requests_ = 0, real_requests_ = 0;
  int64_t off_pos_ = 0, off_slots_ = 0, off_qs_ = 0, off_lens_ = 0, off_table_ = 0;  // int32s
};

struct CudaLayerWorkspaceOptions {
  // Forwarded to every Fp8BlockGemm (run_gemm_small_m_cuda for M <= small_m_max; 0 = cuBLASLt).
  int gemm_small_m_max = 0;
};

// Activations and workspaces of one step at capacity, for one geometry (all layers of a stack).
class CudaLayerWorkspace {
 public:
  static Result<std::shared_ptr<CudaLayerWorkspace>> create(
      const MsaGeometry& geometry, const CudaLayerCapacity& capacity,
      const CudaLayerWorkspaceOptions& options = {});
  const MsaGeometry& geometry() const { return geometry_; }
  const CudaLayerCapacity& capacity() const { return capacity_; }
  size_t device_bytes() const;  // everything allocated (GEMM workspaces included)
  // Fp8BlockGemm::describe() of the four GEMM objects (one block per object, named).
  std::string describe_gemms() const;

 private:
  friend class CudaMsaLayer;
  CudaLayerWorkspace() = default;
  MsaGeometry geometry_;
  CudaLayerCapacity capacity_;
  CudaBuffer x_q_, x_s_, packed_, packed_index_, q_, index_q_, block_ids_, core_, core_q_, core_s_,
      out_, indexer_ws_, attention_ws_;
  size_t indexer_ws_bytes_ = 0, attention_ws_bytes_ = 0;
  std::unique_ptr<Fp8BlockGemm> gemm_fused_, gemm_qkv_, gemm_index_, gemm_o_;
};

// The caches one layer reads and writes (device views of a pool, e.g. PoolLayout::kv_cache_view
// over a device base).
struct CudaLayerCaches {
  TensorView kv_cache;     // e4m3 [pages, 2, n_kv, 128, 128]
  TensorView index_cache;  // e4m3 [pages, 1, 128, 128] (sparse layers)
};

class CudaMsaLayer {
 public:
  // Uploads the rank's weights and the RoPE table (host f32 [max_pos, 2, 32]); `workspace` null
  // creates a private one for `capacity` (otherwise the workspace's geometry and capacity are
  // used and `capacity` is ignored). Uses the current CUDA device.
  static Result<std::unique_ptr<CudaMsaLayer>> create(
      const PackedRankWeights& weights, const TensorView& rope, const CudaLayerCapacity& capacity,
      const MsaLayerOptions& options = {}, std::shared_ptr<CudaLayerWorkspace> workspace = nullptr);
  ~CudaMsaLayer();
  CudaMsaLayer(const CudaMsaLayer&) = delete;
  CudaMsaLayer& operator=(const CudaMsaLayer&) = delete;

  const MsaGeometry& geometry() const { return geometry_; }
  bool sparse() const { return sparse_; }
  bool fused() const { return sparse_ && options_.fuse_qkv_index_projection; }
  // Switches the projection + producer path; takes effect at the next run (plans hold both).
  void set_fused(bool fused) { options_.fuse_qkv_index_projection = fused; }
  // With this on, run() (and run_front, run_stages) launch nothing for the input quantize stage:
  // the caller writes input_quantize()'s outputs itself before each run (e.g. the stack's fused
  // residual + RMSNorm + quantize kernel, run_residual_rmsnorm_quantize_cuda). Off by default.
  void set_external_input_quantize(bool on) { external_input_quantize_ = on; }
  // The planned input quantization (rows Tp of `hidden` -> the workspace's E4M3 rows and scales
  // the projection reads; rows 0 when the plan has no tokens).
  const QuantizeParams& input_quantize() const { return quantize_in_; }
  // The decode row split (session 20, opt-in): this layer's own row-split images of its fused
  // projection weight (sparse layers) and of o_proj (gemm_wgmma_pack_weights_rows), through which
  // the workspace's shared GEMM objects run every step with M <= their row_split_max_m (fused 64,
  // o_proj 32: session 24)
  // (Fp8BlockGemm::run_row_split; the unfused path is unchanged). The cost: the images hold the
  // weights' bytes again, N K per weight (M3 TP1: 60.55 MB fused + 50.33 MB o_proj = 110.9 MB per
  // layer; row_split_bytes()). With the projection's / o_proj's bit in programmatic_stages those
  // GEMMs launch with programmatic dependent launch (each requests its first weights while the
  // kernel before it finishes) and let the next kernel launch early. The first enable allocates
  // and packs the images (on the legacy stream, then a device sync); later calls only switch;
  // unsupported (nothing changes) where the row split cannot serve a weight. Takes effect at the
  // next run (and is baked into a graph captured from it). Results equal the cuBLASLt path's up to
  // fp32 summation order.
  Status set_row_split(bool on);
  bool row_split() const { return row_split_; }
  size_t row_split_bytes() const { return row_fused_.bytes() + row_o_.bytes(); }
  // Programmatic dependent launch (core/pdl.cuh) of every stage kernel that supports it (the
  // quantize stages, the producers, the indexer, the attention, and the projection GEMMs when the
  // row split runs them; cuBLASLt launches normally): each may start while the kernel before it
  // finishes and waits for it before touching its outputs (griddepcontrol.wait), so the outputs are
  // identical either way. Off by default: session 14 measured it (decode 8K, with the
  // attention-quantized o_proj input) slower for the fused step at batch 64 / 128 (117.9-118.1 vs
  // 115.1-115.4 us, 174.8 vs 172.5; equal at 256) and faster only for the unfused one (its index
  // producer overlaps its main producer; 126.0 vs 127.0-127.5 us at 64); an early-resident indexer
  // grid runs ~3 us slower at <= 8K. Takes effect at the next run (and is baked into a graph
  // captured from it).
  void set_programmatic_launch(bool on) { programmatic_stages_ = on ? kAllStages : 0u; }
  bool programmatic_launch() const { return programmatic_stages_ != 0; }
  // The same per stage: bit (1 << LayerStage) set = that stage's kernels launch programmatically
  // (stages without such kernels ignore their bit). E.g. only the stages both projection paths
  // share (indexer, attention, output quantize) for an A/B of what PDL does to each path.
  void set_programmatic_stages(uint32_t mask) { programmatic_stages_ = mask & kAllStages; }
  uint32_t programmatic_stages() const { return programmatic_stages_; }
  static constexpr uint32_t stage_bit(LayerStage s) { return 1u << static_cast<int>(s); }
  // IndexerCudaOptions::pdl_prefetch_blocks of the indexer stage (used when that stage launches
  // programmatically: index-K blocks asked of the L2 while the producer runs; 0 automatic, -1
  // none). Takes effect at the next run.
  void set_indexer_pdl_prefetch(int blocks) { indexer_pdl_prefetch_ = blocks; }
  static constexpr uint32_t kAllStages = (1u << kNumLayerStages) - 1;
  // The attention writes o_proj's E4M3 input and 1x128 scales itself (AttentionParams::out_q /
  // out_scales: byte-identical to the output quantize stage on its bf16 output, which it still
  // writes) and the output quantize stage launches nothing. On by default since session 14 (round
  // B, decode 64 x 8K: 1.4-2.1 us off both paths; fused into the decode kernel's epilogue); takes
  // effect at the next run (plans hold both forms).
  void set_attention_quantize(bool on) { attention_quantize_ = on; }
  bool attention_quantize() const { return attention_quantize_; }
  int64_t max_position() const { return max_position_; }
  const std::shared_ptr<CudaLayerWorkspace>& workspace() const { return workspace_; }

  // Builds every stage's params for the metadata's current shape, the input rows `hidden` (bf16
  // [Tp, hidden] on this device, last stride 1; rows >= T may hold anything) and the caches.
  // Validates with the stages' own rules (and Fp8BlockGemm::check); launches nothing. Replaces
  // the previous plan. Re-plan after every upload whose shape differs.
  Status plan(const CudaStepMetadata& meta, const TensorView& hidden,
              const CudaLayerCaches& caches);
  // Launches the planned stages on `stream`. No allocation, no sync: capturable.
  Status run(cudaStream_t stream);
  // run() in two halves, for callers that capture one and launch the other eagerly: the front
  // (quantize, projection, producers: per-token work whose launches depend only on the planned
  // token count) and the back (indexer, attention, output quantize, o_proj).
  Status run_front(cudaStream_t stream);
  Status run_back(cudaStream_t stream);
  // The planned stages [first, last) only (benchmarks: the graph of a prefix of the step, or of
  // one stage, in the state the earlier stages left). Same rules as run().
  Status run_stages(LayerStage first, LayerStage last, cudaStream_t stream);
  // The same launches with CUDA events between stages, then a sync; stage times into *times.
  Status run_timed(cudaStream_t stream, LayerTimes* times);

  // Device views of the last plan (valid until the workspace is reused by another layer's run).
  TensorView attn_out() const;   // bf16 [Tp, hidden]
  TensorView q() const;          // e4m3 [Tp, n_q, 128]
  TensorView index_q() const;    // e4m3 [Tp, n_kv, 128] (sparse)
  TensorView block_ids() const;  // i32 [Tp, n_kv, 16] (sparse)
  TensorView attn_core() const;  // bf16 [Tp, n_q * 128]

  // Copies the first T (real) rows of the intermediates and the K / V / index-K rows at each
  // token's slot back to the host (allocates, synchronizes: tests and tools only). attn_out is
  // returned through `attn_out` when not null (bf16 [T, hidden]).
  Status download_trace(LayerTrace* trace, Tensor* attn_out, cudaStream_t stream) const;

 private:
  CudaMsaLayer() = default;
  // One stage's launches (fused or unfused per fused()); launch() runs [first, last), recording
  // marks[s] before stage s and marks[last] after the last one when marks is not null.
  Status launch_stage(LayerStage stage, cudaStream_t stream);
  Status launch(LayerStage first, LayerStage last, cudaStream_t stream, cudaEvent_t* marks);

  MsaGeometry geometry_;
  bool sparse_ = true;
  MsaLayerOptions options_;
  bool external_input_quantize_ = false;
  uint32_t programmatic_stages_ = 0;
  int indexer_pdl_prefetch_ = 0;
  bool attention_quantize_ = true;
  int64_t max_position_ = 0;
  std::shared_ptr<CudaLayerWorkspace> workspace_;
  // Device weights: e4m3 matrices and f32 scales (scales rows padded to
  // gemm_weight_scales_row_stride), bf16 norms, f32 RoPE.
  CudaBuffer w_fused_, s_fused_, w_qkv_, s_qkv_, w_index_, s_index_, w_o_, s_o_;
  CudaBuffer norms_;  // q, k, iq, ik: bf16 [4, 128]
  // set_row_split: the images of w_fused_ (sparse) and w_o_ and the CTA counts they were packed
  // for.
  bool row_split_ = false;
  CudaBuffer row_fused_, row_o_;
  int row_ctas_fused_ = 0, row_ctas_o_ = 0;
  CudaBuffer rope_;
  TensorView wv_fused_, sv_fused_, wv_qkv_, sv_qkv_, wv_index_, sv_index_, wv_o_, sv_o_;
  TensorView rope_view_;

  // The plan.
  bool planned_ = false;
  int64_t tokens_ = 0;       // Tp
  int64_t real_tokens_ = 0;  // T
  TensorView slots_;         // device i32 [Tp]
  CudaLayerCaches caches_;
  QuantizeParams quantize_in_, quantize_core_;
  GemmParams gemm_fused_, gemm_qkv_, gemm_index_, gemm_o_;
  ProducerParams producer_fused_, producer_main_, producer_index_;
  IndexerParams indexer_;
  TensorView indexer_ws_;
  AttentionParams attention_;
  AttentionParams attention_quantized_;  // attention_ plus out_q / out_scales (o_proj's input)
  TensorView out_view_;
};

}  // namespace m3attn

#endif  // M3ATTN_WITH_CUDA
