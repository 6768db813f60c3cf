// MsaLayer: one MiniMax-M3 attention layer (sparse MSA or dense) on the CPU backend, for one
// tensor-parallel rank, built from the stages' CPU twins (SPEC sections 2-6):
//
//   hidden bf16 [T, hidden]
//     -> quantize (1x128 E4M3 + fp32 scales)
//     -> fused:   one GEMM over [Q|K|V|iQ|iK]      -> kFused producer
//        unfused: GEMM over [Q|K|V], GEMM over [iQ|iK] -> kMain producer + kIndex producer
//        dense:   GEMM over [Q|K|V]                  -> kMain producer
//        (producers write K/V and index-K into the paged caches at each token's slot)
//     -> indexer (sparse: top-16 block ids per token and KV head)
//     -> attention (sparse over the selected blocks, or dense causal) -> attn core bf16 [T,
//     n_q*128]
//     -> quantize -> GEMM over this rank's o_proj columns -> attn_out bf16 [T, hidden]
//
// Plan / run split: plan() validates everything (shapes, dtypes, the batch against the pool, slots
// against the page table, positions against the RoPE table) and sizes the workspaces once per
// batch; run() may be repeated and only executes the stages. A rejected plan writes nothing.
//
// Lifetimes: a LayerPlan points into the StepPlan, the LayerIO tensors, the layer's weights and
// the RoPE table; all must outlive it. An MsaLayer owns its weights but not the RoPE table.
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "cache/step_plan.h"
#include "m3attn/config.h"
#include "m3attn/tensor.h"
#include "stages/attention/attention.h"
#include "stages/indexer/indexer.h"
#include "stages/producer/producer.h"
#include "stages/projection/projection.h"
#include "stages/quantize/quantize.h"
#include "weights/packing.h"

namespace m3attn {

struct MsaLayerOptions {
  // Sparse layers: one GEMM over the packed [Q|K|V|iQ|iK] weights and the fused producer (true), or
  // the baseline's two GEMMs and two producers (false). Dense layers always use [Q|K|V].
  bool fuse_qkv_index_projection = true;
};

// The tensors one step of the layer reads and writes (CPU views).
struct LayerIO {
  TensorView hidden;       // bf16 [T, hidden], last stride 1
  TensorView kv_cache;     // e4m3 [pages, 2, n_kv, 128, 128] (PagePool::kv_cache)
  TensorView index_cache;  // e4m3 [pages, 1, 128, 128] (sparse layers; PagePool::index_cache)
  TensorView attn_out;     // bf16 [T, hidden], last stride 1 (this rank's o_proj partial)
};

enum class LayerStage : int {
  kQuantize = 0,  // hidden -> E4M3
  kProjection,    // the fused GEMM or the unfused pair
  kProducer,      // norm + RoPE + E4M3 + cache writes (one or two producers)
  kIndexer,       // sparse layers only
  kAttention,
  kOutQuantize,    // attn core -> E4M3
  kOutProjection,  // o_proj GEMM
  kCount
};
constexpr int kNumLayerStages = static_cast<int>(LayerStage::kCount);
const char* layer_stage_name(LayerStage stage);  // "quantize", "projection", ...

struct LayerTimes {
  std::array<double, kNumLayerStages> seconds{};  // wall time per stage of the last run
  double total() const;
};

// Intermediates of one run, as the stages produced them (copies).
struct LayerTrace {
  Tensor q;          // e4m3 [T, n_q, 128]
  Tensor k;          // e4m3 [T, n_kv, 128]   read back from the cache at each token's slot
  Tensor v;          // e4m3 [T, n_kv, 128]   read back from the cache
  Tensor index_q;    // e4m3 [T, n_kv, 128]   (sparse)
  Tensor index_k;    // e4m3 [T, 128]         read back from the index cache (sparse)
  Tensor block_ids;  // i32 [T, n_kv, 16]     (sparse)
  Tensor attn_core;  // bf16 [T, n_q * 128]   attention output before o_proj
  LayerTimes times;
};

class MsaLayer;

// Workspaces and stage parameters for one batch. Move-only.
class LayerPlan {
 public:
  LayerPlan() = default;
  LayerPlan(LayerPlan&&) noexcept = default;
  LayerPlan& operator=(LayerPlan&&) noexcept = default;

  int64_t num_tokens() const { return tokens_; }
  int64_t workspace_bytes() const;

 private:
  friend class MsaLayer;
  int64_t tokens_ = 0;
  bool sparse_ = true;
  bool fused_ = true;
  int n_q_ = 0, n_kv_ = 0;
  // Workspaces.
  Tensor x_q_, x_s_;              // quantized hidden, scales
  Tensor packed_, packed_index_;  // projection outputs (packed_index_: unfused sparse only)
  Tensor q_, index_q_, block_ids_, core_, core_q_, core_s_;
  // Stage parameters, built once.
  QuantizeParams quantize_in_, quantize_core_;
  GemmParams gemm_main_, gemm_index_, gemm_o_;
  ProducerParams producer_main_, producer_index_;
  IndexerParams indexer_;
  AttentionParams attention_;
  // For the trace.
  TensorView slots_, kv_cache_, index_cache_;
};

class MsaLayer {
 public:
  MsaLayer() = default;
  MsaLayer(MsaLayer&&) noexcept = default;
  MsaLayer& operator=(MsaLayer&&) noexcept = default;

  // Takes ownership of the rank's packed weights; `rope` is f32 [max_pos, 2, 32] (make_rope_table
  // with the geometry's theta) and must outlive the layer.
  static Result<MsaLayer> create(PackedRankWeights weights, const TensorView& rope,
                                 const MsaLayerOptions& options = {});

  const MsaGeometry& geometry() const { return weights_.geometry; }
  bool sparse() const { return weights_.sparse; }
  bool fused() const { return sparse() && options_.fuse_qkv_index_projection; }
  const PackedRankWeights& weights() const { return weights_; }
  const MsaLayerOptions& options() const { return options_; }
  int64_t max_position() const { return rope_.shape[0]; }

  Result<LayerPlan> plan(const StepPlan& step, const LayerIO& io) const;
  // Executes a plan of this layer. `trace` (optional) receives the intermediates and timings;
  // `times` (optional) the timings alone.
  Status run(const LayerPlan& plan, LayerTrace* trace = nullptr, LayerTimes* times = nullptr) const;
  // plan + run.
  Status step(const StepPlan& step, const LayerIO& io, LayerTrace* trace = nullptr,
              LayerTimes* times = nullptr) const;

 private:
  PackedRankWeights weights_;
  TensorView rope_;
  MsaLayerOptions options_;
};

}  // namespace m3attn
