#include "cache/dp_dummy.h"

#include <algorithm>
#include <utility>
#include <vector>

namespace m3attn {

DummyGeneration::DummyGeneration(DummyGeneration&& other) noexcept
    : target_(other.target_),
      draft_(other.draft_),
      target_res_(std::move(other.target_res_)),
      draft_res_(std::move(other.draft_res_)),
      request_id_(other.request_id_),
      draft_len_(other.draft_len_) {
  other.reset();
}

DummyGeneration& DummyGeneration::operator=(DummyGeneration&& other) noexcept {
  if (this != &other) {
    Status s = end();  // a live dummy being overwritten is rolled back first
    (void)s;
    target_ = other.target_;
    draft_ = other.draft_;
    target_res_ = std::move(other.target_res_);
    draft_res_ = std::move(other.draft_res_);
    request_id_ = other.request_id_;
    draft_len_ = other.draft_len_;
    other.reset();
  }
  return *this;
}

DummyGeneration::~DummyGeneration() {
  Status s = end();
  (void)s;  // nothing to report to from a destructor; end() only fails on misuse
}

void DummyGeneration::reset() {
  target_ = nullptr;
  draft_ = nullptr;
  target_res_ = StepReservation{};
  draft_res_ = StepReservation{};
}

Result<DummyGeneration> DummyGeneration::begin(CacheManager& target, CacheManager* draft,
                                               int draft_len, int64_t request_id) {
  // Validation first: a rejected call touches neither cache.
  M3_CHECK_ARG(draft_len >= 0, "dummy generation: draft length must be >= 0, got ", draft_len);
  M3_CHECK_ARG(draft != &target, "dummy generation: the draft cache must not be the target cache");
  M3_CHECK_ARG(!target.has_request(request_id), "dummy generation: request ", request_id,
               " already exists in the target cache");
  M3_CHECK_ARG(draft == nullptr || !draft->has_request(request_id), "dummy generation: request ",
               request_id, " already exists in the draft cache");
  const int64_t tokens = int64_t{1} + draft_len;

  Result<StepReservation> t = target.reserve_step({{request_id, tokens}}, /*admit_new=*/true);
  if (!t.ok()) {
    if (t.status().code() != StatusCode::kResourceExhausted) return t.status();
    return resource_exhausted("dummy generation: target cache (", target.tokens_per_page(),
                              "-token pages) cannot hold ", tokens, " tokens (",
                              target.pages_needed(tokens), " pages): ", t.status().message());
  }
  DummyGeneration d;
  d.target_ = &target;
  d.target_res_ = std::move(t.value());
  d.request_id_ = request_id;
  d.draft_len_ = draft_len;
  if (draft != nullptr) {
    Result<StepReservation> r = draft->reserve_step({{request_id, tokens}}, /*admit_new=*/true);
    if (!r.ok()) {
      Status undo = d.end();  // returns the target's pages
      if (!undo.ok()) return undo;
      if (r.status().code() != StatusCode::kResourceExhausted) return r.status();
      return resource_exhausted("dummy generation: draft cache (", draft->tokens_per_page(),
                                "-token pages) cannot hold ", tokens, " tokens (",
                                draft->pages_needed(tokens), " pages): ", r.status().message(),
                                "; the target cache's pages were rolled back too");
    }
    d.draft_ = draft;
    d.draft_res_ = std::move(r.value());
  }
  return Result<DummyGeneration>(std::move(d));
}

Status DummyGeneration::end() {
  if (!active()) return Status::Ok();
  Status first = Status::Ok();
  if (draft_ != nullptr) first = draft_->rollback(draft_res_);
  Status second = target_->rollback(target_res_);
  reset();
  M3_RETURN_IF_ERROR(first);
  return second;
}

Result<StepPlan> DummyGeneration::plan_for(const CacheManager& cache, int64_t id, int draft_len,
                                           int page_table_width) {
  const int64_t n = int64_t{1} + draft_len;
  const std::vector<int32_t>& pages = cache.pages(id);
  const int64_t need = static_cast<int64_t>(pages.size());
  M3_CHECK_ARG(page_table_width >= 0, "page table width must be >= 0, got ", page_table_width);
  M3_CHECK_ARG(page_table_width == 0 || page_table_width >= need, "page table width ",
               page_table_width, " is smaller than the dummy's ", need, " pages");
  StepPlan plan;
  plan.num_context_requests = 0;
  plan.num_generation_requests = 1;
  plan.num_context_tokens = 0;
  plan.num_generation_tokens = n;
  plan.draft_len = draft_len;
  plan.max_pages = page_table_width > 0 ? page_table_width : static_cast<int>(need);
  plan.request_ids = {id};
  for (int64_t j = kCachedLen; j < kCachedLen + n; ++j) {
    Result<int32_t> s = cache.slot(id, j);
    M3_RETURN_IF_ERROR(s.status());
    plan.positions.push_back(static_cast<int32_t>(j));
    plan.slots.push_back(s.value());
  }
  plan.query_start = {0, static_cast<int32_t>(n)};
  plan.seq_lens = {static_cast<int32_t>(kCachedLen + n)};
  plan.page_table.assign(static_cast<size_t>(plan.max_pages), -1);
  std::copy(pages.begin(), pages.end(), plan.page_table.begin());
  return plan;
}

Result<StepPlan> DummyGeneration::target_plan(int page_table_width) const {
  M3_CHECK_ARG(active(), "dummy generation is not active");
  return plan_for(*target_, request_id_, draft_len_, page_table_width);
}

Result<StepPlan> DummyGeneration::draft_plan(int page_table_width) const {
  M3_CHECK_ARG(active(), "dummy generation is not active");
  M3_CHECK_ARG(draft_ != nullptr, "dummy generation has no draft cache");
  return plan_for(*draft_, request_id_, draft_len_, page_table_width);
}

}  // namespace m3attn
