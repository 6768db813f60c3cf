// LayerStack: the attention part of an M3-shaped model, as the serving engine drives it. A stack is
// `num_dense` dense causal layers (M3 layers 0-2) followed by `num_sparse` MSA layers, with the
// residual add and RMSNorm between them (the MoE blocks are outside this project):
//     h_0 = token_embedding(request, position);  for each layer l: h += attn_l(rmsnorm(h))
// Token inputs are generated deterministically from (seed, request id, position) by
// `synthetic_hidden_value` (engine/synthetic_input.h) so that every backend sees the same numbers
// without host copies of activations.
// Backends: CPU (the twins; small geometries) and CUDA (graph-captured decode).
//
// The math between layers, shared by every backend (the residual stream is stored in bf16):
//   h_0[t, c] = synthetic_hidden_bf16(seed, request_id(t), position(t), c)
//   x[t, c]   = bf16(float(h[t, c]) * rsqrt(sum_c' float(h[t, c'])^2 / hidden + eps))
//               (plain RMSNorm with unit weight, fp32 math, eps = geometry.eps: the model's own
//                norm weights belong to the decoder blocks this project does not load)
//   a         = attn_l(x)                           bf16 [T, hidden] (MsaLayer's attn_out)
//   h[t, c]   = bf16(float(h[t, c]) + float(a[t, c]))
// last_hidden() is h after the last layer. Layer l (0-based) uses random weights
// random_attention_weights(geometry, layer_seed(seed, l), sparse = l >= num_dense).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "cache/step_plan.h"
#include "engine/synthetic_input.h"
#include "m3attn/config.h"
#include "m3attn/tensor.h"

namespace m3attn {

class Communicator;  // dist/communicator.h

struct LayerStackConfig {
  MsaGeometry geometry;             // the model's (TP1) geometry
  int num_dense = 3;                // dense causal layers first
  int num_sparse = 4;               // then MSA layers
  int64_t num_pages = 0;            // KV pool pages (shared page ids across layers)
  int64_t max_tokens_per_step = 0;  // capacity: T of the largest step
  int max_requests_per_step = 0;    // capacity: R of the largest step
  int max_pages_per_request = 0;    // capacity: page-table width
  int max_position = 0;             // RoPE table size
  bool fuse_qkv_index_projection = true;
  // CUDA: steps that are not replayed whole (prefill / mixed) run each layer's front (quantize,
  // projection, producers) as a CUDA graph captured at the step's exact token count and the
  // downstream stages eagerly. Graphs are kept for the last kMaxFrontGraphShapes token counts.
  bool capture_mixed_front = true;
  // CUDA: the residual add + RMSNorm before each layer also quantizes its output for the layer's
  // projection (run_residual_rmsnorm_quantize_cuda: byte-identical to the separate RMSNorm and
  // quantize kernels, one kernel per layer less; proven on the GPU in session 13 round B); false
  // runs them separately.
  bool fuse_input_quantize = true;
  // CUDA: programmatic dependent launch of the layers' stage kernels and of the residual-norm
  // kernels (CudaMsaLayer::set_programmatic_launch; same bytes), and the attention writing
  // o_proj's quantized input itself (CudaMsaLayer::set_attention_quantize; same bytes). The
  // layer's defaults: attention_quantize on, programmatic launch off (session 14: it helped only
  // the unfused path).
  bool programmatic_launch = false;
  bool attention_quantize = true;
  uint64_t seed = 0;  // weights and synthetic inputs
  // Attention tensor parallelism (CUDA backend only): this process is rank tp_rank of tp_size.
  // `geometry` stays the TP1 (model) geometry; each layer holds pack_rank(weights, tp_size,
  // tp_rank), the pool holds this rank's KV heads, and after each layer's o_proj the bf16 partial
  // [T, hidden] is summed over the ranks in place through tp_comm (inside decode graphs too).
  // Every rank must run the same steps.
  int tp_size = 1;
  int tp_rank = 0;
  Communicator* tp_comm = nullptr;  // required when tp_size > 1; must outlive the stack
  int num_layers() const { return num_dense + num_sparse; }
  Status validate() const;  // geometry, layer counts, capacities, tensor-parallel fields
};

struct StackStepStats {
  double step_us = 0;         // wall time of the whole step (device time on CUDA)
  bool graph_replay = false;  // CUDA: the step ran as a captured graph
};

class LayerStack {
 public:
  virtual ~LayerStack() = default;
  virtual const char* backend() const = 0;  // "cpu" or "cuda"
  virtual const LayerStackConfig& config() const = 0;
  // Switch fused / unfused projection+producer (the downstream stages are the same).
  virtual void set_fused(bool fused) = 0;
  // Runs every layer for the plan's tokens (their K/V/index-K are written into the pool).
  virtual Status step(const StepPlan& plan, StackStepStats* stats) = 0;
  // Final hidden states of the last step, bf16 [T, hidden] copied to the host (tests, checksums).
  virtual Result<Tensor> last_hidden() const = 0;
};

// Seed of layer l's random weights.
inline uint64_t layer_seed(uint64_t seed, int layer) {
  return seed * 1000003ull + 7919ull * static_cast<uint64_t>(layer + 1);
}

Result<std::unique_ptr<LayerStack>> create_cpu_layer_stack(const LayerStackConfig& config);
#if defined(M3ATTN_WITH_CUDA)
Result<std::unique_ptr<LayerStack>> create_cuda_layer_stack(const LayerStackConfig& config);
#endif

}  // namespace m3attn
