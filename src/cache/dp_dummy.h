// The attention-data-parallel dummy generation request (SPEC section 7): a rank with no work runs
// one dummy generation request so that collective steps stay in lock-step. Its pages are taken from
// the target cache and (when there is one) the Eagle3 draft cache, whose geometry differs
// (32-token pages), and are rolled back afterwards.
//
// Convention: the dummy has cached_len 0. It brings 1 + draft_len tokens at positions
// 0 .. draft_len, its sequence length is 1 + draft_len, and each cache reserves exactly
// ceil((1 + draft_len) / tokens_per_page) pages for it (1 target page and 1 draft page for
// draft_len 3). Nothing of the dummy is ever "cached" before the step, so nothing of it survives.
//
// Lifecycle: begin() reserves in the target cache, then in the draft cache; if the draft cache is
// exhausted the target's reservation is rolled back before the error is returned, and an
// exhausted target touches nothing. end() (or the destructor when end() was not called) rolls back
// the draft cache, then the target cache, leaving both exactly as before begin(): request sets,
// other requests' page tables and free-list order. Between begin() and end() the caller must not
// change the dummy request nor grow/truncate/release anything in either cache in a way that
// moves the pages the dummy took (CacheManager::rollback rules); both caches must outlive it.
#pragma once

#include <cstdint>

#include "cache/page_allocator.h"
#include "cache/step_plan.h"
#include "m3attn/status.h"

namespace m3attn {

class DummyGeneration {
 public:
  // The request id reserved for the dummy; real requests must not use it.
  static constexpr int64_t kDefaultRequestId = -1;
  static constexpr int64_t kCachedLen = 0;

  DummyGeneration() = default;  // inactive
  DummyGeneration(DummyGeneration&& other) noexcept;
  DummyGeneration& operator=(DummyGeneration&& other) noexcept;
  DummyGeneration(const DummyGeneration&) = delete;
  DummyGeneration& operator=(const DummyGeneration&) = delete;
  ~DummyGeneration();

  // Admits request_id with 1 + draft_len tokens in target and, when draft is not null, in draft.
  // invalid_argument (nothing touched): draft_len < 0, draft == &target, or the id already exists
  // in either cache. resource_exhausted names the cache ("target" or "draft") that ran out; every
  // page taken by then has been returned.
  static Result<DummyGeneration> begin(CacheManager& target, CacheManager* draft, int draft_len,
                                       int64_t request_id = kDefaultRequestId);

  // Rolls back both caches (draft first). Idempotent: an inactive or ended dummy returns Ok.
  Status end();

  bool active() const { return target_ != nullptr; }
  int64_t request_id() const { return request_id_; }
  int draft_len() const { return draft_len_; }
  int64_t num_tokens() const { return int64_t{1} + draft_len_; }  // = its sequence length
  bool has_draft() const { return draft_ != nullptr; }

  // The step a rank with no work describes: one generation request (cached_len 0, see above).
  // plan_step does not accept it (its generation requests need cached_len >= 1 and it reserves
  // pages itself); use target_plan()/draft_plan(), which read the pages already reserved.
  GenerationRequest request() const { return GenerationRequest{request_id_, kCachedLen}; }

  // Host arrays for the dummy step in one cache's geometry (slots through CacheManager::slot):
  // 1 generation request of 1 + draft_len tokens, positions 0 .. draft_len, seq_len 1 + draft_len,
  // page table = its pages (page_table_width 0: its page count). The plan's reservation is empty:
  // the dummy owns the pages. invalid_argument when inactive or (draft_plan) without a draft.
  Result<StepPlan> target_plan(int page_table_width = 0) const;
  Result<StepPlan> draft_plan(int page_table_width = 0) const;

 private:
  static Result<StepPlan> plan_for(const CacheManager& cache, int64_t id, int draft_len,
                                   int page_table_width);
  void reset();

  CacheManager* target_ = nullptr;
  CacheManager* draft_ = nullptr;
  StepReservation target_res_;
  StepReservation draft_res_;
  int64_t request_id_ = kDefaultRequestId;
  int draft_len_ = 0;
};

}  // namespace m3attn
