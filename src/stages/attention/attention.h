// Attention over the paged E4M3 cache (SPEC section 6). Sparse (MSA layers): for token t and KV head
// g, keys are the tokens p <= pos_t of the blocks in block_ids[t, g, :] (-1 entries skipped).
// Dense (layers 0-2): all p <= pos_t. o_j = softmax(q_j . k_p * scale) v_p with raw E4M3 operands,
// fp32 accumulation, BF16 out [T, n_q * 128]; query head j reads KV head j / (n_q / n_kv).
#pragma once

#include <cstdint>

#include "cache/batch.h"
#include "m3attn/tensor.h"

#if defined(M3ATTN_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace m3attn {

struct AttentionParams {
  int n_q = 0;
  int n_kv = 0;
  bool sparse = true;          // false: dense causal (block_ids unused)
  float softmax_scale = 0.0f;  // 0 means 1 / sqrt(128)
  TensorView q;                // e4m3 [T, n_q, 128] contiguous
  TensorView kv_cache;         // e4m3 [pages, 2, n_kv, 128, 128] strided
  TensorView block_ids;        // i32 [T, n_kv, 16] (sparse)
  BatchView batch;
  TensorView out;              // bf16 [T, n_q * 128], last stride 1
};

Status validate_attention(const AttentionParams& p);
Status run_attention_cpu(const AttentionParams& p);

}  // namespace m3attn
