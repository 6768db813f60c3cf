#include "engine/scheduler.h"

#include <algorithm>
#include <utility>

namespace m3attn {

Status Workload::validate() const {
  M3_CHECK_ARG(input_len >= 1, "input length must be >= 1, got ", input_len);
  M3_CHECK_ARG(output_len >= 1, "output length must be >= 1, got ", output_len);
  M3_CHECK_ARG(concurrency >= 1, "concurrency must be >= 1, got ", concurrency);
  M3_CHECK_ARG(num_requests >= 1, "request count must be >= 1, got ", num_requests);
  M3_CHECK_ARG(draft_len >= 0 && draft_len <= 64, "draft length must be in [0, 64], got ",
               draft_len);
  M3_CHECK_ARG(input_len + output_len + draft_len < (int64_t{1} << 30), "input ", input_len,
               " + output ", output_len, " + draft ", draft_len, " tokens is too long");
  return Status::Ok();
}

int64_t Workload::pages_per_request() const {
  return CacheManager::pages_for(input_len + output_len + draft_len);
}

const char* step_phase_name(StepPhase phase) {
  switch (phase) {
    case StepPhase::kPrefill:
      return "prefill";
    case StepPhase::kMixed:
      return "mixed";
    case StepPhase::kDecode:
      return "decode";
  }
  return "?";
}

Result<Scheduler> Scheduler::create(const Workload& workload, const SchedulerOptions& options) {
  M3_RETURN_IF_ERROR(workload.validate());
  M3_CHECK_ARG(options.max_tokens_per_step >= 1 + workload.draft_len, "max tokens per step ",
               options.max_tokens_per_step, " cannot hold one generation request of 1 + draft ",
               workload.draft_len, " tokens");
  M3_CHECK_ARG(options.num_pages >= 0, "page count must be >= 0, got ", options.num_pages);
  Scheduler s;
  s.workload_ = workload;
  s.options_ = options;
  const int64_t ppr = workload.pages_per_request();
  if (s.options_.num_pages == 0) s.options_.num_pages = int64_t{workload.concurrency} * ppr;
  M3_CHECK_ARG(s.options_.num_pages >= ppr, "a pool of ", s.options_.num_pages,
               " pages cannot hold one request of ", ppr, " pages (input ", workload.input_len,
               " + output ", workload.output_len, " + draft ", workload.draft_len, " tokens)");
  M3_CHECK_ARG(s.options_.num_pages < (int64_t{1} << 24), "a pool of ", s.options_.num_pages,
               " pages is too large (slots must fit int32)");
  M3_CHECK_ARG(options.page_table_width == 0 || options.page_table_width >= ppr,
               "page table width ", options.page_table_width, " is below the ", ppr,
               " pages of one request");
  if (s.options_.page_table_width == 0) s.options_.page_table_width = static_cast<int>(ppr);
  s.cache_ = CacheManager(s.options_.num_pages);
  s.requests_.resize(static_cast<size_t>(workload.num_requests));
  for (int i = 0; i < workload.num_requests; ++i) s.requests_[static_cast<size_t>(i)].id = i;
  return s;
}

Result<StepPlan> Scheduler::next_step() {
  if (step_open_) return internal_error("next_step called before finish_step of the last step");
  if (done()) return internal_error("next_step called after every request finished");
  const int64_t ppr = workload_.pages_per_request();
  // 1. Admission.
  while (static_cast<int>(active_.size()) < workload_.concurrency &&
         next_waiting_ < workload_.num_requests && committed_pages_ + ppr <= options_.num_pages) {
    RequestRecord& r = requests_[static_cast<size_t>(next_waiting_)];
    r.admit_us = clock_us_;
    active_.push_back(r.id);
    committed_pages_ += ppr;
    ++next_waiting_;
  }
  // 2. Budget: generation first, then prompt chunks.
  int64_t budget = options_.max_tokens_per_step;
  const int64_t gen_tokens = 1 + workload_.draft_len;
  StepDescription desc;
  desc.draft_len = workload_.draft_len;
  for (int64_t id : active_) {
    const RequestRecord& r = requests_[static_cast<size_t>(id)];
    if (r.prefilled < workload_.input_len || budget < gen_tokens) continue;
    desc.generation.push_back({id, cache_.length(id)});
    budget -= gen_tokens;
  }
  for (int64_t id : active_) {
    const RequestRecord& r = requests_[static_cast<size_t>(id)];
    const int64_t left = workload_.input_len - r.prefilled;
    if (left == 0 || budget == 0) continue;
    const int64_t n = std::min(left, budget);
    desc.context.push_back({id, r.prefilled, n});
    budget -= n;
  }
  if (desc.context.empty() && desc.generation.empty())
    return internal_error("scheduler stalled: ", active_.size(), " requests in flight, ",
                          workload_.num_requests - next_waiting_, " waiting, ",
                          cache_.num_free_pages(), " free pages");
  PlanOptions po;
  po.admit_new = true;
  po.page_table_width = options_.page_table_width;
  Result<StepPlan> plan = plan_step(cache_, desc, po);
  if (plan.ok()) step_open_ = true;
  return plan;
}

Status Scheduler::finish_step(const StepPlan& plan, double step_us) {
  if (!step_open_) return internal_error("finish_step without a planned step");
  M3_CHECK_ARG(step_us >= 0, "step time must be >= 0, got ", step_us);
  step_open_ = false;
  clock_us_ += step_us;
  StepRecord rec;
  rec.context_requests = plan.num_context_requests;
  rec.generation_requests = plan.num_generation_requests;
  rec.context_tokens = plan.num_context_tokens;
  rec.generation_tokens = plan.num_generation_tokens;
  rec.phase = rec.generation_requests == 0 ? StepPhase::kPrefill
              : rec.context_requests == 0  ? StepPhase::kDecode
                                           : StepPhase::kMixed;
  rec.pages_used = cache_.allocator().num_used();
  rec.step_us = step_us;
  rec.end_us = clock_us_;
  std::vector<int64_t> done_ids;
  for (int i = 0; i < plan.num_requests(); ++i) {
    const int64_t id = plan.request_ids[static_cast<size_t>(i)];
    RequestRecord& r = requests_[static_cast<size_t>(id)];
    const int64_t n =
        plan.query_start[static_cast<size_t>(i) + 1] - plan.query_start[static_cast<size_t>(i)];
    int64_t produced = 0;
    if (i < plan.num_context_requests) {
      r.prefilled += n;
      ++r.prefill_chunks;
      if (r.prefilled == workload_.input_len) {
        produced = 1;
        r.first_token_us = clock_us_;
      }
    } else {
      produced = std::min<int64_t>(n, workload_.output_len - r.generated);
    }
    r.generated += produced;
    rec.output_tokens += produced;
    if (produced > 0 && r.generated == workload_.output_len) {
      r.finish_us = clock_us_;
      done_ids.push_back(id);
    }
  }
  for (int64_t id : done_ids) {
    M3_RETURN_IF_ERROR(cache_.release(id));
    active_.erase(std::find(active_.begin(), active_.end(), id));
    committed_pages_ -= workload_.pages_per_request();
    ++finished_;
  }
  steps_.push_back(rec);
  return Status::Ok();
}

}  // namespace m3attn
