// Batch planning for one step (SPEC section 7): context chunks first, then generation requests of
// 1 + draft_len tokens each. plan_step reserves the pages every request needs (one transaction on
// the CacheManager) and builds the host arrays the stages consume:
//   positions   i32 [T]         continuing from each request's cached length
//   slots       i32 [T]         out_cache_loc: pages[pos / 128] * 128 + pos % 128
//   query_start i32 [R + 1]
//   seq_lens    i32 [R]         cached_len + new tokens
//   page_table  i32 [R, max_pages]  a request's pages, then -1
// The same plan serves every layer of a pool (one page id names one slot in every layer).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cache/batch.h"
#include "cache/page_allocator.h"
#include "m3attn/tensor.h"

namespace m3attn {

struct ContextChunk {
  int64_t request_id = 0;
  int64_t cached_len = 0;  // tokens of this request already in the cache
  int64_t num_tokens = 0;  // prompt tokens of this chunk (>= 1)
};

struct GenerationRequest {
  int64_t request_id = 0;
  int64_t cached_len = 0;  // tokens already in the cache (>= 1: a prompt was prefilled)
};

struct StepDescription {
  std::vector<ContextChunk> context;
  std::vector<GenerationRequest> generation;
  int draft_len = 0;  // each generation request brings 1 + draft_len tokens
};

struct PlanOptions {
  // Requests unknown to the CacheManager are admitted when their cached_len is 0 (a first
  // chunk); otherwise the id must exist. A known request's length must equal its cached_len.
  bool admit_new = true;
  // Page-table columns; 0 = the longest request's page count (must be >= that when set).
  int page_table_width = 0;
};

struct StepPlan {
  int num_context_requests = 0;
  int num_generation_requests = 0;
  int64_t num_context_tokens = 0;
  int64_t num_generation_tokens = 0;
  int draft_len = 0;
  int max_pages = 0;

  std::vector<int64_t> request_ids;  // [R], context requests first
  std::vector<int32_t> positions;    // [T]
  std::vector<int32_t> slots;        // [T]
  std::vector<int32_t> query_start;  // [R + 1]
  std::vector<int32_t> seq_lens;     // [R]
  std::vector<int32_t> page_table;   // [R * max_pages]
  StepReservation reservation;       // what the step took from the CacheManager

  int64_t num_tokens() const { return static_cast<int64_t>(positions.size()); }
  int num_requests() const { return static_cast<int>(request_ids.size()); }
  // Views over the vectors above: valid while this plan is alive and unmodified.
  BatchView batch() const;
  TensorView positions_view() const;
  TensorView slots_view() const;
  std::string summary() const;  // "2 context requests (300 tokens), 4 generation requests x 2"
};

// Validates the description, reserves pages (growing each request to cached_len + new tokens) and
// fills the plan. Rejected or failed calls leave the CacheManager unchanged.
Result<StepPlan> plan_step(CacheManager& cache, const StepDescription& step,
                           const PlanOptions& options = {});

}  // namespace m3attn
