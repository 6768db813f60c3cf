#include "cache/step_plan.h"

#include <algorithm>
#include <sstream>

#include "m3attn/config.h"

namespace m3attn {

namespace {
// Positions are int32 and query_start too: keep the batch and every sequence below 2^31 tokens.
constexpr int64_t kMaxTokens = (int64_t{1} << 31) - 1;
}  // namespace

BatchView StepPlan::batch() const {
  BatchView b;
  b.num_tokens = num_tokens();
  b.num_requests = num_requests();
  b.max_pages = max_pages;
  auto* qs = const_cast<int32_t*>(query_start.data());
  auto* pos = const_cast<int32_t*>(positions.data());
  auto* len = const_cast<int32_t*>(seq_lens.data());
  auto* table = const_cast<int32_t*>(page_table.data());
  b.query_start = TensorView::contiguous(qs, DType::kI32, {int64_t{b.num_requests} + 1});
  b.positions = TensorView::contiguous(pos, DType::kI32, {b.num_tokens});
  b.seq_lens = TensorView::contiguous(len, DType::kI32, {int64_t{b.num_requests}});
  b.page_table =
      TensorView::contiguous(table, DType::kI32, {int64_t{b.num_requests}, int64_t{max_pages}});
  return b;
}

TensorView StepPlan::positions_view() const {
  return TensorView::contiguous(const_cast<int32_t*>(positions.data()), DType::kI32,
                                {num_tokens()});
}

TensorView StepPlan::slots_view() const {
  return TensorView::contiguous(const_cast<int32_t*>(slots.data()), DType::kI32, {num_tokens()});
}

std::string StepPlan::summary() const {
  std::ostringstream os;
  os << num_context_requests << " context request" << (num_context_requests == 1 ? "" : "s") << " ("
     << num_context_tokens << " tokens), " << num_generation_requests << " generation request"
     << (num_generation_requests == 1 ? "" : "s") << " x " << (1 + draft_len) << " tokens (draft "
     << draft_len << "), " << num_tokens() << " tokens, page table " << num_requests() << " x "
     << max_pages;
  return os.str();
}

Result<StepPlan> plan_step(CacheManager& cache, const StepDescription& step,
                           const PlanOptions& options) {
  M3_CHECK_ARG(step.draft_len >= 0, "draft length must be >= 0, got ", step.draft_len);
  M3_CHECK_ARG(options.page_table_width >= 0, "page table width must be >= 0, got ",
               options.page_table_width);

  // Every request as (id, cached_len, new tokens), context first.
  struct Item {
    int64_t id, cached, n;
  };
  std::vector<Item> items;
  for (const ContextChunk& c : step.context) {
    M3_CHECK_ARG(c.num_tokens >= 1, "context chunk of request ", c.request_id,
                 " must bring at least one token, got ", c.num_tokens);
    items.push_back({c.request_id, c.cached_len, c.num_tokens});
  }
  for (const GenerationRequest& g : step.generation) {
    M3_CHECK_ARG(g.cached_len >= 1, "generation request ", g.request_id,
                 " needs a prefilled prompt (cached length >= 1), got ", g.cached_len);
    items.push_back({g.request_id, g.cached_len, int64_t{1} + step.draft_len});
  }
  int64_t total = 0;
  int64_t max_len = 0;
  std::vector<std::pair<int64_t, int64_t>> grow_to;
  for (const Item& it : items) {
    M3_CHECK_ARG(it.cached >= 0 && it.cached <= kMaxTokens - it.n, "request ", it.id,
                 ": cached length ", it.cached, " + ", it.n, " new tokens is outside [0, 2^31)");
    const int64_t have = cache.length(it.id);
    if (have < 0) {
      M3_CHECK_ARG(options.admit_new, "request ", it.id, " is not known to the cache manager");
      M3_CHECK_ARG(it.cached == 0, "request ", it.id, " is new but claims ", it.cached,
                   " cached tokens");
    } else {
      M3_CHECK_ARG(have == it.cached, "request ", it.id, " has ", have,
                   " tokens in the cache but the step says ", it.cached);
    }
    total += it.n;
    M3_CHECK_ARG(total <= kMaxTokens, "step of ", total, " tokens exceeds 2^31 - 1");
    max_len = std::max(max_len, it.cached + it.n);
    grow_to.emplace_back(it.id, it.cached + it.n);
  }
  const int64_t need_cols = cache.pages_needed(max_len);  // in this cache's page size
  M3_CHECK_ARG(options.page_table_width == 0 || options.page_table_width >= need_cols,
               "page table width ", options.page_table_width, " is smaller than the ", need_cols,
               " pages the longest request needs");

  // The only mutation; it validates duplicates and rolls itself back on failure.
  Result<StepReservation> res = cache.reserve_step(grow_to, options.admit_new);
  M3_RETURN_IF_ERROR(res.status());

  StepPlan plan;
  plan.reservation = std::move(res.value());
  plan.num_context_requests = static_cast<int>(step.context.size());
  plan.num_generation_requests = static_cast<int>(step.generation.size());
  plan.draft_len = step.draft_len;
  plan.max_pages =
      options.page_table_width > 0 ? options.page_table_width : static_cast<int>(need_cols);
  const size_t R = items.size();
  plan.request_ids.reserve(R);
  plan.positions.reserve(static_cast<size_t>(total));
  plan.slots.reserve(static_cast<size_t>(total));
  plan.query_start.push_back(0);
  plan.page_table.assign(R * static_cast<size_t>(plan.max_pages), -1);
  for (size_t r = 0; r < R; ++r) {
    const Item& it = items[r];
    const std::vector<int32_t>& pages = cache.pages(it.id);
    plan.request_ids.push_back(it.id);
    for (int64_t j = it.cached; j < it.cached + it.n; ++j) {
      plan.positions.push_back(static_cast<int32_t>(j));
      const int64_t page_size = cache.tokens_per_page();
      plan.slots.push_back(static_cast<int32_t>(
          int64_t{pages[static_cast<size_t>(j / page_size)]} * page_size + j % page_size));
    }
    plan.query_start.push_back(static_cast<int32_t>(plan.positions.size()));
    plan.seq_lens.push_back(static_cast<int32_t>(it.cached + it.n));
    std::copy(pages.begin(), pages.end(),
              plan.page_table.begin() + static_cast<std::ptrdiff_t>(r * plan.max_pages));
    if (r < step.context.size()) {
      plan.num_context_tokens += it.n;
    } else {
      plan.num_generation_tokens += it.n;
    }
  }
  return plan;
}

}  // namespace m3attn
