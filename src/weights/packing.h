// One attention layer's weights (quantized, TP1) and their five-way tensor-parallel packing
// (SPEC section 2).
//
// Loading reads the HF names `<prefix>layers.N.self_attn.{q_proj,k_proj,v_proj,o_proj,
// index_q_proj,index_k_proj}.weight` and `{q_norm,k_norm,index_q_norm,index_k_norm}.weight`, where
// <prefix> is "model.", "language_model.model.", "model.language_model." or "language_model."
// (the first under which q_proj exists). Each projection is accepted as:
//  - BF16 / F32: quantized at load to 128x128 blocks;
//  - F8_E4M3 with `<name>.weight_scale_inv` f32 [N/128, K/128]: used as is (x = q * scale_inv, the
//    DeepSeek-style FP8 block format);
//  - F8_E4M3 with `<name>.weight_scale`: when it is F8_E8M0 (or U8 holding E8M0 bits) of shape
//    [N, K/32] it is MXFP8 (x = q * 2^(v-127), one scale per 32 consecutive K elements of a row),
//    dequantized and requantized to 128x128 blocks; when it is f32 [N/128, K/128] it is a block
//    scale used as is.
// Norm weights are BF16 or F32 [128] (kept as BF16). Geometry (hidden, n_q, n_kv) comes from the
// tensor shapes; every missing tensor or shape mismatch is an error naming the tensor.
//
// Packing for TP size P, rank r (general geometry n_q, n_kv; M3 is 64 / 4):
//  - Q heads [r*n_q/P, (r+1)*n_q/P);
//  - K, V and index-Q heads: [r*n_kv/P, (r+1)*n_kv/P) when P <= n_kv, else the single head
//    r / (P/n_kv), replicated on P/n_kv ranks;
//  - index-K: the single head, on every rank.
// Each head is 128 rows of W and exactly one row of 128x128 block scales, so the packed matrices
// are copies of slabs of the same quantized weights (bit-identical across fused and unfused paths).
// o_proj [hidden, n_q*128] is row-parallel: each rank takes the columns of its Q heads.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "m3attn/config.h"
#include "m3attn/tensor.h"
#include "weights/quantize_weights.h"
#include "weights/safetensors.h"

namespace m3attn {

struct M3Config;

struct AttentionWeights {
  MsaGeometry geometry;               // TP1
  bool sparse = true;                 // MSA layer (index projections present) vs dense layer
  QuantizedMatrix q;                  // [n_q*128, hidden]
  QuantizedMatrix k;                  // [n_kv*128, hidden]
  QuantizedMatrix v;                  // [n_kv*128, hidden]
  QuantizedMatrix index_q;            // [n_kv*128, hidden] (sparse only)
  QuantizedMatrix index_k;            // [128, hidden]      (sparse only)
  QuantizedMatrix o;                  // [hidden, n_q*128]
  Tensor q_norm, k_norm;              // bf16 [128]
  Tensor index_q_norm, index_k_norm;  // bf16 [128] (sparse only)

  // Geometry is valid and every tensor has the dtype and shape it implies.
  Status validate() const;
};

struct AttentionLoadOptions {
  // When set: theta and eps come from it, the layer's sparse flag must match the tensors, and
  // hidden / head counts must match the shapes.
  const M3Config* config = nullptr;
  // Used when there is no config.
  float rope_theta = 5e6f;
  float eps = 1e-6f;
  // Empty: try the known prefixes in order. Otherwise e.g. "model." (followed by "layers.N.").
  std::string prefix;
};

Result<AttentionWeights> load_attention_weights(const Checkpoint& ckpt, int layer,
                                                const AttentionLoadOptions& options = {});
Result<AttentionWeights> load_attention_weights(const SafetensorsFile& file, int layer,
                                                const AttentionLoadOptions& options = {});

// Random BF16-like weights, quantized: projections ~ N(0, 1/K) (K = input width, so projections of
// O(1) inputs are O(1)), norm weights ~ N(0, 0.1). Deterministic for a seed.
Result<AttentionWeights> random_attention_weights(const MsaGeometry& geometry, uint64_t seed,
                                                  bool sparse = true);

// The tensors of `w` under HF names in the FP8 block format (`.weight` e4m3 and
// `.weight_scale_inv` f32), as views into `w`: write them with write_safetensors.
std::vector<NamedTensor> attention_weight_tensors(const AttentionWeights& w, int layer,
                                                  const std::string& prefix = "model.");

// Heads owned by one rank (half-open ranges into the TP1 heads).
struct RankHeads {
  int q_begin = 0, q_end = 0;    // query heads
  int kv_begin = 0, kv_end = 0;  // K / V / index-Q heads
};
Result<RankHeads> rank_heads(const MsaGeometry& tp1, int tp_size, int tp_rank);
// Per-rank geometry (n_q / P query heads, n_kv / P or 1 KV heads).
Result<MsaGeometry> rank_geometry(const MsaGeometry& tp1, int tp_size);

struct PackedRankWeights {
  MsaGeometry geometry;  // this rank
  int tp_size = 1, tp_rank = 0;
  bool sparse = true;
  QuantizedMatrix fused;  // [Q_r | K_r | V_r | IQ_r | IK]: geometry.packed_width() rows (sparse)
  QuantizedMatrix qkv;    // [Q_r | K_r | V_r]                (unfused GEMM 1)
  QuantizedMatrix index;  // [IQ_r | IK]                      (unfused GEMM 2, sparse)
  QuantizedMatrix o;      // [hidden, n_q_r*128]: this rank's o_proj columns (row-parallel)
  Tensor q_norm, k_norm, index_q_norm, index_k_norm;  // bf16 [128] (index ones: sparse)
  // Shapes of every matrix and norm against `geometry` (what a layer needs before it runs).
  Status validate() const;
};
// Dense layers (w.sparse == false) get empty `fused`, `index` and index norms: use `qkv`.
Result<PackedRankWeights> pack_rank(const AttentionWeights& w, int tp_size, int tp_rank);

}  // namespace m3attn
