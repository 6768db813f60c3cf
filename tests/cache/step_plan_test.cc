// plan_step: the host arrays of a mixed step (positions, slots, query_start, seq_lens, page table)
// and the page reservation behind them; rejected or failed plans leave the cache manager as it was.
#include "cache/step_plan.h"

#include <gtest/gtest.h>

#include "m3attn/config.h"
#include "support/test_util.h"

namespace m3attn {
namespace {

using testing::Rng;

TEST(StepPlanTest, MixedStepArrays) {
  const uint64_t seed = testing::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  CacheManager m(64);
  // Known requests: 10 (a prompt with 129 tokens cached) and three generation requests.
  const std::vector<int64_t> gen_ids = {20, 21, 22};
  std::vector<int64_t> gen_cached;
  ASSERT_TRUE(m.add_request(10).ok());
  ASSERT_TRUE(m.reserve(10, 129).ok());
  for (int64_t id : gen_ids) {
    ASSERT_TRUE(m.add_request(id).ok());
    gen_cached.push_back(rng.integer(1, 700));
    ASSERT_TRUE(m.reserve(id, gen_cached.back()).ok());
  }
  const int draft = static_cast<int>(rng.integer(0, 3));
  StepDescription step;
  step.context = {{11, 0, 300}, {10, 129, 200}};  // 11 is new: admitted
  for (size_t i = 0; i < gen_ids.size(); ++i)
    step.generation.push_back({gen_ids[i], gen_cached[i]});
  step.draft_len = draft;
  Result<StepPlan> r = plan_step(m, step);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  const StepPlan& p = r.value();

  EXPECT_EQ(p.num_context_requests, 2);
  EXPECT_EQ(p.num_generation_requests, 3);
  EXPECT_EQ(p.num_context_tokens, 500);
  EXPECT_EQ(p.num_generation_tokens, 3 * (1 + draft));
  EXPECT_EQ(p.num_tokens(), 500 + 3 * (1 + draft));
  EXPECT_EQ(p.request_ids, (std::vector<int64_t>{11, 10, 20, 21, 22}));
  const std::vector<int64_t> cached = {0, 129, gen_cached[0], gen_cached[1], gen_cached[2]};
  const std::vector<int64_t> fresh = {300, 200, 1 + draft, 1 + draft, 1 + draft};
  int64_t max_len = 0;
  for (size_t i = 0; i < 5; ++i) max_len = std::max(max_len, cached[i] + fresh[i]);
  EXPECT_EQ(p.max_pages, (max_len + 127) / 128);
  ASSERT_EQ(p.query_start.size(), 6u);
  EXPECT_EQ(p.query_start[0], 0);
  for (int r_i = 0; r_i < 5; ++r_i) {
    const int64_t id = p.request_ids[static_cast<size_t>(r_i)];
    EXPECT_EQ(p.query_start[r_i + 1] - p.query_start[r_i], fresh[static_cast<size_t>(r_i)]);
    EXPECT_EQ(p.seq_lens[static_cast<size_t>(r_i)], cached[r_i] + fresh[r_i]);
    EXPECT_EQ(m.length(id), cached[r_i] + fresh[r_i]);
    const auto& pages = m.pages(id);
    for (int c = 0; c < p.max_pages; ++c) {
      const int32_t want = c < static_cast<int>(pages.size()) ? pages[static_cast<size_t>(c)] : -1;
      EXPECT_EQ(p.page_table[static_cast<size_t>(r_i * p.max_pages + c)], want);
    }
    for (int32_t t = p.query_start[r_i]; t < p.query_start[r_i + 1]; ++t) {
      const int64_t pos = cached[r_i] + (t - p.query_start[r_i]);
      EXPECT_EQ(p.positions[static_cast<size_t>(t)], pos);
      EXPECT_EQ(p.slots[static_cast<size_t>(t)], m.slot(id, pos).value());
    }
  }
  EXPECT_TRUE(validate_batch_contents(p.batch(), m.num_pages(), "plan").ok());
  EXPECT_EQ(p.positions_view().numel(), p.num_tokens());
  EXPECT_EQ(p.slots_view().numel(), p.num_tokens());
  EXPECT_FALSE(p.summary().empty());

  // Rolling the step back restores the manager.
  ASSERT_TRUE(m.rollback(p.reservation).ok());
  EXPECT_FALSE(m.has_request(11));
  EXPECT_EQ(m.length(10), 129);
  for (size_t i = 0; i < gen_ids.size(); ++i) EXPECT_EQ(m.length(gen_ids[i]), gen_cached[i]);
}

TEST(StepPlanTest, DraftGeometryUsesTheCachesPageSize) {
  // An Eagle3 draft cache has 32-token pages: slots and page-table width follow that size.
  CacheManager m(64, 32);
  ASSERT_TRUE(m.add_request(5).ok());
  ASSERT_TRUE(m.reserve(5, 70).ok());  // 3 pages of 32
  StepDescription step;
  step.context = {{6, 0, 100}};  // new request: 4 pages
  step.generation = {{5, 70}};
  step.draft_len = 2;  // 70..72: still page 2
  Result<StepPlan> r = plan_step(m, step);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  const StepPlan& p = r.value();
  EXPECT_EQ(p.max_pages, 4);
  ASSERT_EQ(p.num_tokens(), 103);
  for (int64_t t = 0; t < p.num_tokens(); ++t) {
    const int64_t id = t < 100 ? 6 : 5;
    const int64_t pos = p.positions[static_cast<size_t>(t)];
    const std::vector<int32_t>& pages = m.pages(id);
    EXPECT_EQ(p.slots[static_cast<size_t>(t)], pages[static_cast<size_t>(pos / 32)] * 32 + pos % 32)
        << "token " << t;
    Result<int32_t> slot = m.slot(id, pos);
    ASSERT_TRUE(slot.ok());
    EXPECT_EQ(p.slots[static_cast<size_t>(t)], slot.value());
  }
}

TEST(StepPlanTest, FixedWidthPageTableAndEmptyStep) {
  CacheManager m(8);
  PlanOptions opt;
  opt.page_table_width = 5;
  Result<StepPlan> r = plan_step(m, StepDescription{{{1, 0, 130}}, {}, 0}, opt);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r.value().max_pages, 5);
  EXPECT_EQ(r.value().page_table, (std::vector<int32_t>{0, 1, -1, -1, -1}));
  Result<StepPlan> empty = plan_step(m, StepDescription{});
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty.value().num_tokens(), 0);
  EXPECT_TRUE(validate_batch_view(empty.value().batch(), "empty").ok());
}

TEST(StepPlanTest, RejectedAndFailedPlansChangeNothing) {
  CacheManager m(6);
  ASSERT_TRUE(m.add_request(1).ok());
  ASSERT_TRUE(m.reserve(1, 200).ok());
  auto expect_unchanged = [&](const StepDescription& s, StatusCode code, const char* what,
                              PlanOptions opt = {}) {
    const int64_t free_before = m.num_free_pages();
    const std::vector<int64_t> ids = m.request_ids();
    Result<StepPlan> r = plan_step(m, s, opt);
    EXPECT_FALSE(r.ok()) << what;
    EXPECT_EQ(r.status().code(), code) << what << ": " << r.status().to_string();
    EXPECT_EQ(m.num_free_pages(), free_before) << what;
    EXPECT_EQ(m.request_ids(), ids) << what;
    EXPECT_EQ(m.length(1), 200) << what;
  };
  const auto kInvalid = StatusCode::kInvalidArgument;
  expect_unchanged({{{1, 100, 10}}, {}, 0}, kInvalid, "cached length mismatch");
  expect_unchanged({{{2, 5, 10}}, {}, 0}, kInvalid, "new request with cached tokens");
  expect_unchanged({{{2, 0, 0}}, {}, 0}, kInvalid, "empty chunk");
  expect_unchanged({{}, {{1, 200}}, -1}, kInvalid, "negative draft");
  expect_unchanged({{{2, 0, 10}}, {{2, 0}}, 0}, kInvalid, "generation without a prompt");
  expect_unchanged({{{2, 0, 10}, {2, 0, 10}}, {}, 0}, kInvalid, "duplicate request");
  PlanOptions no_admit;
  no_admit.admit_new = false;
  expect_unchanged({{{2, 0, 10}}, {}, 0}, kInvalid, "unknown request", no_admit);
  PlanOptions narrow;
  narrow.page_table_width = 1;
  expect_unchanged({{}, {{1, 200}}, 0}, kInvalid, "page table too narrow", narrow);
  // 4 pages free: request 3 takes 3, request 1 then needs 2 more (200 + 201 tokens): exhausted.
  expect_unchanged({{{3, 0, 300}}, {{1, 200}}, 200}, StatusCode::kResourceExhausted,
                   "out of pages");
}

}  // namespace
}  // namespace m3attn
