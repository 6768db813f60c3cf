// The serving engine's scheduler: continuous batching with chunked prefill over a paged KV pool.
//
// Workload: `num_requests` identical requests (input_len prompt tokens, output_len generated
// tokens), at most `concurrency` in flight, all waiting at time 0 (a closed loop: a finished
// request's place goes to the next waiting one).
//
// Each step (SPEC section 7):
//  1. Admission, in request order, while fewer than `concurrency` requests are in flight and the
//     pool can hold the whole life of one more request (pages_per_request pages: prompt, output and
//     one step of drafts). Pages are committed at admission, so a running request never runs out
//     of pages; running out of pages only means not admitting (no preemption is ever needed).
//  2. Token budget `max_tokens_per_step`: generation requests are served first (1 + draft_len
//     tokens each, in admission order) so that decoding never starves, then the remaining budget
//     goes to prompt chunks of the prefilling requests in admission order (a request's prompt is
//     split over as many steps as it takes).
//  3. The batch holds the context chunks first, then the generation requests; plan_step reserves
//     the pages on the CacheManager.
// After the step ran, finish_step advances the simulated clock by the step's time and accounts the
// tokens: a request whose last prompt chunk ran produces its first token at the end of that step;
// each generation step produces 1 + draft_len tokens (there is no sampler: every draft is counted
// as accepted, capped at output_len), and the request finishes at output_len tokens, releasing its
// pages. The cache grows by exactly the tokens each step brings.
//
// The schedule depends only on the workload and the options, never on step times, so fused and
// unfused runs process identical step sequences.
#pragma once

#include <cstdint>
#include <vector>

#include "cache/page_allocator.h"
#include "cache/step_plan.h"
#include "m3attn/status.h"

namespace m3attn {

struct Workload {
  int64_t input_len = 0;   // prompt tokens per request (>= 1)
  int64_t output_len = 0;  // generated tokens per request (>= 1; the first comes from prefill)
  int concurrency = 1;     // requests in flight at most (>= 1)
  int num_requests = 1;    // requests in the run (>= 1)
  int draft_len = 0;       // speculative draft tokens per generation step (>= 0)
  uint64_t seed = 1;       // weights and synthetic inputs

  Status validate() const;
  // Pages one request holds at most: ceil((input_len + output_len + draft_len) / 128).
  int64_t pages_per_request() const;
  // Positions reach input_len + output_len + draft_len - 2 at most; RoPE table size to cover it.
  int64_t max_position() const { return input_len + output_len + draft_len; }
};

struct SchedulerOptions {
  int64_t max_tokens_per_step = 8192;  // >= 1 + draft_len
  int64_t num_pages = 0;               // pool pages; 0 = concurrency * pages_per_request
  int page_table_width = 0;            // plan page-table columns; 0 = pages_per_request
};

enum class StepPhase { kPrefill, kMixed, kDecode };  // context only, both, generation only
const char* step_phase_name(StepPhase phase);        // "prefill", "mixed", "decode"

struct StepRecord {
  StepPhase phase = StepPhase::kPrefill;
  int context_requests = 0;
  int generation_requests = 0;
  int64_t context_tokens = 0;
  int64_t generation_tokens = 0;
  int64_t output_tokens = 0;  // tokens "produced" by the step (first tokens + accepted drafts)
  int64_t pages_used = 0;     // after the step's reservation
  double step_us = 0;
  double end_us = 0;  // simulated clock at the end of the step
};

struct RequestRecord {
  int64_t id = 0;
  int64_t prefilled = 0;       // prompt tokens in the cache
  int64_t generated = 0;       // output tokens produced
  int prefill_chunks = 0;      // steps that carried a chunk of its prompt
  double admit_us = -1;        // simulated clock when admitted (-1: still waiting)
  double first_token_us = -1;  // end of the step that ran its last prompt chunk
  double finish_us = -1;       // end of the step that produced its last token
  bool admitted() const { return admit_us >= 0; }
  bool finished() const { return finish_us >= 0; }
};

class Scheduler {
 public:
  static Result<Scheduler> create(const Workload& workload, const SchedulerOptions& options);

  const Workload& workload() const { return workload_; }
  const SchedulerOptions& options() const { return options_; }  // num_pages resolved
  bool done() const { return finished_ == workload_.num_requests; }

  // Admits requests and plans the next step (pages reserved). Call finish_step before the next
  // call. internal error when nothing can run although requests remain (cannot happen for a
  // validated workload; reported rather than looping).
  Result<StepPlan> next_step();
  // Accounts a step planned by next_step that ran in step_us (simulated time).
  Status finish_step(const StepPlan& plan, double step_us);

  const std::vector<RequestRecord>& requests() const { return requests_; }
  const std::vector<StepRecord>& steps() const { return steps_; }
  const CacheManager& cache() const { return cache_; }
  // For attention-DP's dummy generation request (cache/dp_dummy.h) between steps: whatever is
  // taken from it must be rolled back before the next next_step().
  CacheManager& mutable_cache() { return cache_; }
  double clock_us() const { return clock_us_; }
  int in_flight() const { return static_cast<int>(active_.size()); }
  int64_t committed_pages() const { return committed_pages_; }
  int finished() const { return finished_; }
  int max_requests_per_step() const { return workload_.concurrency; }

 private:
  Workload workload_;
  SchedulerOptions options_;
  CacheManager cache_;
  std::vector<RequestRecord> requests_;
  std::vector<int64_t> active_;  // admitted, unfinished request ids in admission order
  std::vector<StepRecord> steps_;
  int64_t next_waiting_ = 0;
  int64_t committed_pages_ = 0;
  int finished_ = 0;
  double clock_us_ = 0;
  bool step_open_ = false;
};

}  // namespace m3attn
