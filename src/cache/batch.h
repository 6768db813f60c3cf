// BatchView: how the downstream stages (indexer, attention) see one step's batch. A step holds
// context chunks first, then generation requests of 1 + draft_len tokens (SPEC section 7); both are
// "requests" here: a run of consecutive positions whose K/V/index-K are already in the cache when
// the indexer and attention run (the producer writes them first).
#pragma once

#include <cstdint>

#include "m3attn/tensor.h"

namespace m3attn {

struct BatchView {
  int64_t num_tokens = 0;  // T
  int num_requests = 0;    // R
  int max_pages = 0;       // columns of page_table
  TensorView
      query_start;       // i32 [R + 1]: tokens of request r are [query_start[r], query_start[r+1])
  TensorView positions;  // i32 [T]: absolute positions, consecutive and increasing inside a request
  TensorView seq_lens;   // i32 [R]: tokens in cache for r after this step = last position + 1
  TensorView
      page_table;  // i32 [R, max_pages]: token j of r lives in page table[r][j / 128], row j % 128
};

// Shapes, dtypes and devices of the views (no reads of device memory).
Status validate_batch_view(const BatchView& batch, const char* stage);
// Host-side content checks (CPU views only): query_start monotone, positions consecutive inside
// a request and ending at seq_len - 1, page ids of every visible token in [0, num_pages).
Status validate_batch_contents(const BatchView& batch, int64_t num_pages, const char* stage);

}  // namespace m3attn
