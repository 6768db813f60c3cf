// The indexer (SPEC section 5): raw fp32 dot products of index-Q with every visible index-K, max per
// 128-token block, forced local block, top-16 block ids per (token, KV head): ascending ids then -1,
// exact ties to the smaller id, NaN scores never chosen (the forced local block still is).
#pragma once

#include <cstdint>

#include "cache/batch.h"
#include "m3attn/tensor.h"

#if defined(M3ATTN_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace m3attn {

struct IndexerParams {
  int n_kv = 0;            // index heads == KV heads
  int top_k = 16;          // must equal kTopK (the compiled value)
  TensorView index_q;      // e4m3 [T, n_kv, 128] contiguous
  TensorView index_cache;  // e4m3 [pages, 1, 128, 128] strided
  BatchView batch;
  TensorView block_ids;    // i32 [T, n_kv, top_k] contiguous (output)
};

Status validate_indexer(const IndexerParams& p);
Status run_indexer_cpu(const IndexerParams& p);

}  // namespace m3attn
