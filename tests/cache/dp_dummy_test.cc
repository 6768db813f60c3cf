// DP dummy generation lifecycle (SPEC section 7): dummy pages in the target and the 32-token draft
// cache, rolled back to the exact previous state on end(), on destruction, and on a failed begin.
#include "cache/dp_dummy.h"

#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include "cache/page_allocator.h"
#include "cache/step_plan.h"
#include "m3attn/config.h"
#include "support/test_util.h"

namespace m3attn {
namespace {

constexpr int kDraftPage = 32;  // Eagle3 draft cache geometry

// a and b hold the same requests, lengths, page tables, used pages and free-list order.
void expect_same(const CacheManager& a, const CacheManager& b, const std::string& what) {
  SCOPED_TRACE(what);
  ASSERT_EQ(a.tokens_per_page(), b.tokens_per_page());
  ASSERT_EQ(a.num_pages(), b.num_pages());
  EXPECT_EQ(a.num_free_pages(), b.num_free_pages());
  ASSERT_EQ(a.request_ids(), b.request_ids());
  for (int64_t id : a.request_ids()) {
    EXPECT_EQ(a.length(id), b.length(id)) << "request " << id;
    EXPECT_EQ(a.pages(id), b.pages(id)) << "request " << id;
  }
  for (int32_t p = 0; p < a.num_pages(); ++p)
    EXPECT_EQ(a.allocator().in_use(p), b.allocator().in_use(p)) << "page " << p;
  // Free-list order: draining every free page from copies hands them out in the same order.
  CacheManager ca = a, cb = b;
  const int64_t probe = 1'000'000'007;
  const int64_t tokens = a.num_free_pages() * a.tokens_per_page();
  ASSERT_TRUE(ca.reserve_step({{probe, tokens}}, true).ok());
  ASSERT_TRUE(cb.reserve_step({{probe, tokens}}, true).ok());
  EXPECT_EQ(ca.pages(probe), cb.pages(probe)) << "free-list order differs";
}

// Every page is free or in exactly one table; tables match lengths in the manager's geometry.
void expect_consistent(const CacheManager& m) {
  std::set<int32_t> owned;
  for (int64_t id : m.request_ids()) {
    EXPECT_EQ(static_cast<int64_t>(m.pages(id).size()), m.pages_needed(m.length(id))) << id;
    for (int32_t p : m.pages(id)) {
      EXPECT_TRUE(m.allocator().in_use(p)) << "page " << p;
      EXPECT_TRUE(owned.insert(p).second) << "page " << p << " is in two tables";
    }
  }
  EXPECT_EQ(static_cast<int64_t>(owned.size()) + m.num_free_pages(), m.num_pages()) << "leak";
}

// Some live requests with interleaved pages, so that the free list is not in id order.
void populate(CacheManager& m, int64_t first_id, int64_t unit) {
  ASSERT_TRUE(m.reserve_step({{first_id, 2 * unit + 1}, {first_id + 1, unit}}, true).ok());
  ASSERT_TRUE(m.reserve_step({{first_id, 3 * unit + 5}, {first_id + 2, 1}}, true).ok());
  ASSERT_TRUE(m.release(first_id + 1).ok());
}

TEST(CacheManagerGeometryTest, DefaultIs128AndDraftGeometryIs32) {
  CacheManager t(8);
  EXPECT_EQ(t.tokens_per_page(), kPageSize);
  EXPECT_EQ(CacheManager::pages_for(129), 2);
  EXPECT_EQ(t.pages_needed(129), 2);
  CacheManager d(8, kDraftPage);
  EXPECT_EQ(d.tokens_per_page(), 32);
  EXPECT_EQ(d.pages_needed(4), 1);
  EXPECT_EQ(d.pages_needed(32), 1);
  EXPECT_EQ(d.pages_needed(33), 2);
  EXPECT_EQ(d.pages_needed(129), 5);
  EXPECT_EQ(CacheManager::pages_for(33, 32), 2);
  ASSERT_TRUE(d.reserve_step({{4, 40}, {5, 33}}, true).ok());  // 4: pages 0, 1; 5: pages 2, 3
  EXPECT_EQ(d.pages(4), (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(d.pages(5), (std::vector<int32_t>{2, 3}));
  EXPECT_EQ(d.slot(4, 0).value(), 0);
  EXPECT_EQ(d.slot(4, 31).value(), 31);
  EXPECT_EQ(d.slot(4, 32).value(), 32);
  EXPECT_EQ(d.slot(5, 32).value(), 3 * 32);
  EXPECT_EQ(d.slot(5, 64).status().code(), StatusCode::kOutOfRange);
  ASSERT_TRUE(d.truncate(4, 32).ok());
  EXPECT_EQ(d.pages(4).size(), 1u);
  expect_consistent(d);

  EXPECT_TRUE(CacheManager::make(8, 32).ok());
  EXPECT_EQ(CacheManager::make(8, 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(CacheManager::make(-1).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(CacheManager::make((int64_t{1} << 26) + 1, 32).status().code(),
            StatusCode::kInvalidArgument)
      << "2^26 + 1 pages of 32 tokens overflow the int32 slot range";
  EXPECT_TRUE(CacheManager::make(int64_t{1} << 26, 32).ok());
}

TEST(DummyGenerationTest, BeginEndLeavesBothCachesAsBefore) {
  for (int draft_len : {0, 3, 31, 32, 200}) {
    SCOPED_TRACE("draft_len " + std::to_string(draft_len));
    CacheManager target(40), draft(80, kDraftPage);
    populate(target, 10, kPageSize);
    populate(draft, 10, kDraftPage);
    const CacheManager t0 = target, d0 = draft;
    {
      Result<DummyGeneration> r = DummyGeneration::begin(target, &draft, draft_len);
      ASSERT_TRUE(r.ok()) << r.status().to_string();
      DummyGeneration& g = r.value();
      EXPECT_TRUE(g.active());
      EXPECT_TRUE(g.has_draft());
      const int64_t n = 1 + draft_len;
      EXPECT_EQ(g.num_tokens(), n);
      EXPECT_EQ(target.length(g.request_id()), n);
      EXPECT_EQ(draft.length(g.request_id()), n);
      EXPECT_EQ(static_cast<int64_t>(target.pages(g.request_id()).size()), (n + 127) / 128);
      EXPECT_EQ(static_cast<int64_t>(draft.pages(g.request_id()).size()), (n + 31) / 32);
      EXPECT_EQ(t0.num_free_pages() - target.num_free_pages(), (n + 127) / 128);
      EXPECT_EQ(d0.num_free_pages() - draft.num_free_pages(), (n + 31) / 32);
      for (int64_t id : t0.request_ids()) EXPECT_EQ(target.pages(id), t0.pages(id)) << id;
      for (int64_t id : d0.request_ids()) EXPECT_EQ(draft.pages(id), d0.pages(id)) << id;
      expect_consistent(target);
      expect_consistent(draft);
      ASSERT_TRUE(g.end().ok());
      EXPECT_FALSE(g.active());
      expect_same(target, t0, "target after end");
      expect_same(draft, d0, "draft after end");
      ASSERT_TRUE(g.end().ok()) << "end() is idempotent";
    }  // destructor after end(): no second rollback
    expect_same(target, t0, "target after destruction");
    expect_same(draft, d0, "draft after destruction");
  }
}

TEST(DummyGenerationTest, DraftGeometryPageCounts) {
  // draft_len 3 -> 4 tokens -> 1 target page, 1 draft page; 31 -> 32 -> 1; 32 -> 33 -> 2 draft
  // pages.
  const int lens[] = {3, 31, 32, 127, 128};
  const int64_t target_pages[] = {1, 1, 1, 1, 2};
  const int64_t draft_pages[] = {1, 1, 2, 4, 5};
  for (int i = 0; i < 5; ++i) {
    CacheManager target(4), draft(8, kDraftPage);
    Result<DummyGeneration> r = DummyGeneration::begin(target, &draft, lens[i]);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_EQ(4 - target.num_free_pages(), target_pages[i]) << "draft_len " << lens[i];
    EXPECT_EQ(8 - draft.num_free_pages(), draft_pages[i]) << "draft_len " << lens[i];
  }
}

TEST(DummyGenerationTest, DraftExhaustionRollsBackTheTarget) {
  CacheManager target(10), draft(6, kDraftPage);
  populate(target, 1, kPageSize);
  populate(draft, 1, kDraftPage);  // draft: 6 of 6 pages minus the live ones
  const CacheManager t0 = target, d0 = draft;
  const int draft_len = static_cast<int>(d0.num_free_pages()) * kDraftPage;  // one page too many
  Result<DummyGeneration> r = DummyGeneration::begin(target, &draft, draft_len);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(r.status().message().find("draft cache"), std::string::npos) << r.status().message();
  EXPECT_FALSE(target.has_request(DummyGeneration::kDefaultRequestId));
  EXPECT_FALSE(draft.has_request(DummyGeneration::kDefaultRequestId));
  expect_same(target, t0, "target");
  expect_same(draft, d0, "draft");
  // The same size fits with one more draft page free: the failure was exactly at the boundary.
  CacheManager roomy(draft.num_pages() + 1, kDraftPage);
  ASSERT_TRUE(DummyGeneration::begin(target, &roomy, draft_len).ok());
  expect_same(target, t0, "target after the temporary dummy");
}

TEST(DummyGenerationTest, TargetExhaustionTouchesNothing) {
  CacheManager target(7), draft(16, kDraftPage);
  populate(target, 1, kPageSize);
  populate(draft, 1, kDraftPage);
  const CacheManager t0 = target, d0 = draft;
  const int draft_len = static_cast<int>(t0.num_free_pages()) * kPageSize;  // one page too many
  Result<DummyGeneration> r = DummyGeneration::begin(target, &draft, draft_len);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(r.status().message().find("target cache"), std::string::npos) << r.status().message();
  expect_same(target, t0, "target");
  expect_same(draft, d0, "draft");
}

TEST(DummyGenerationTest, RejectedCallsTouchNothing) {
  CacheManager target(8), draft(8, kDraftPage);
  populate(target, 1, kPageSize);
  populate(draft, 1, kDraftPage);
  const CacheManager t0 = target, d0 = draft;
  EXPECT_EQ(DummyGeneration::begin(target, &draft, -1).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(DummyGeneration::begin(target, &target, 1).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(DummyGeneration::begin(target, &draft, 1, /*request_id=*/1).status().code(),
            StatusCode::kInvalidArgument)
      << "the id is a live request";
  ASSERT_TRUE(draft.add_request(-5).ok());
  const CacheManager d1 = draft;
  EXPECT_EQ(DummyGeneration::begin(target, &draft, 1, -5).status().code(),
            StatusCode::kInvalidArgument)
      << "the id exists in the draft cache only";
  expect_same(target, t0, "target");
  expect_same(draft, d1, "draft");
  DummyGeneration idle;
  EXPECT_FALSE(idle.active());
  EXPECT_TRUE(idle.end().ok());
  EXPECT_FALSE(idle.target_plan().ok());
}

TEST(DummyGenerationTest, DestructionWithoutEndRollsBack) {
  CacheManager target(12), draft(24, kDraftPage);
  populate(target, 3, kPageSize);
  populate(draft, 3, kDraftPage);
  const CacheManager t0 = target, d0 = draft;
  {
    Result<DummyGeneration> r = DummyGeneration::begin(target, &draft, 40);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    DummyGeneration moved = std::move(r.value());  // ownership moves; only one rollback happens
    EXPECT_FALSE(r.value().active());
    EXPECT_TRUE(moved.active());
    EXPECT_NE(target.num_free_pages(), t0.num_free_pages());
  }
  expect_same(target, t0, "target");
  expect_same(draft, d0, "draft");
  {  // without a draft cache
    Result<DummyGeneration> r = DummyGeneration::begin(target, nullptr, 2);
    ASSERT_TRUE(r.ok());
    EXPECT_FALSE(r.value().has_draft());
    EXPECT_FALSE(r.value().draft_plan().ok());
  }
  expect_same(target, t0, "target, no draft");
  expect_same(draft, d0, "draft untouched without a draft pointer");
}

TEST(DummyGenerationTest, ChurnLeaksNoPage) {
  const uint64_t seed = testing::fresh_seed();
  M3_SEED_TRACE(seed);
  testing::Rng rng(seed);
  CacheManager target(24), draft(48, kDraftPage);
  int64_t next_id = 0;
  int dummies = 0, failed = 0;
  for (int step = 0; step < 600; ++step) {
    const int op = static_cast<int>(rng.integer(0, 5));
    const std::vector<int64_t> ids = target.request_ids();
    if (op <= 1 || ids.empty()) {  // admit into both caches (draft in its own geometry)
      const int64_t id = next_id++;
      const int64_t len = rng.integer(1, 500);
      if (target.reserve_step({{id, len}}, true).ok() &&
          !draft.reserve_step({{id, len}}, true).ok()) {
        ASSERT_TRUE(target.release(id).ok());
      }
    } else if (op == 2) {
      const int64_t id = ids[static_cast<size_t>(rng.integer(0, int64_t(ids.size()) - 1))];
      ASSERT_TRUE(target.release(id).ok());
      if (draft.has_request(id)) {
        ASSERT_TRUE(draft.release(id).ok());
      }
    } else {  // a rank with no work this step: dummy, end, or let the destructor end it
      const CacheManager t0 = target, d0 = draft;
      const int draft_len = static_cast<int>(rng.integer(0, 300));
      {
        Result<DummyGeneration> r = DummyGeneration::begin(target, &draft, draft_len);
        if (r.ok()) {
          ++dummies;
          if (rng.integer(0, 1) == 0) {
            ASSERT_TRUE(r.value().end().ok());
          }
        } else {
          ASSERT_EQ(r.status().code(), StatusCode::kResourceExhausted) << r.status().to_string();
          ++failed;
        }
      }  // an un-ended dummy is rolled back by its destructor here
      expect_same(target, t0, "target after dummy step " + std::to_string(step));
      expect_same(draft, d0, "draft after dummy step " + std::to_string(step));
    }
    expect_consistent(target);
    expect_consistent(draft);
    if (::testing::Test::HasFailure()) return;
  }
  EXPECT_GT(dummies, 0);
  EXPECT_GT(failed, 0) << "the churn never exhausted a cache: make the pools smaller";
  for (int64_t id : target.request_ids()) ASSERT_TRUE(target.release(id).ok());
  for (int64_t id : draft.request_ids()) ASSERT_TRUE(draft.release(id).ok());
  EXPECT_EQ(target.num_free_pages(), target.num_pages());
  EXPECT_EQ(draft.num_free_pages(), draft.num_pages());
}

TEST(DummyGenerationTest, PlanMatchesARealPlanStep) {
  for (int draft_len : {0, 3, 130}) {
    SCOPED_TRACE("draft_len " + std::to_string(draft_len));
    CacheManager target(16), draft(32, kDraftPage);
    populate(target, 1, kPageSize);
    populate(draft, 1, kDraftPage);
    CacheManager twin = target;  // plan_step over the same state gets the same free pages
    Result<DummyGeneration> r = DummyGeneration::begin(target, &draft, draft_len);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    const DummyGeneration& g = r.value();
    Result<StepPlan> tp = g.target_plan();
    ASSERT_TRUE(tp.ok()) << tp.status().to_string();
    const StepPlan& p = tp.value();
    EXPECT_EQ(p.num_generation_requests, 1);
    EXPECT_EQ(p.num_context_requests, 0);
    EXPECT_EQ(p.num_generation_tokens, 1 + draft_len);
    EXPECT_EQ(p.draft_len, draft_len);
    EXPECT_TRUE(p.reservation.entries.empty()) << "the dummy owns its pages";

    // A real plan_step of the same tokens (a first chunk of 1 + draft_len tokens at cached 0)
    // places them identically: same positions, slots, lengths and page table.
    StepDescription desc;
    desc.context.push_back({g.request_id(), 0, 1 + draft_len});
    Result<StepPlan> real = plan_step(twin, desc);
    ASSERT_TRUE(real.ok()) << real.status().to_string();
    EXPECT_EQ(p.positions, real.value().positions);
    EXPECT_EQ(p.slots, real.value().slots);
    EXPECT_EQ(p.query_start, real.value().query_start);
    EXPECT_EQ(p.seq_lens, real.value().seq_lens);
    EXPECT_EQ(p.max_pages, real.value().max_pages);
    EXPECT_EQ(p.page_table, real.value().page_table);
    // A real step for live requests still plans while the dummy holds its pages.
    StepDescription live;
    live.generation.push_back({1, target.length(1)});
    live.draft_len = draft_len;
    Result<StepPlan> lp = plan_step(target, live);
    ASSERT_TRUE(lp.ok()) << lp.status().to_string();
    ASSERT_TRUE(target.rollback(lp.value().reservation).ok());

    // The draft plan uses the draft geometry: slot = page * 32 + row.
    Result<StepPlan> dp = g.draft_plan(/*page_table_width=*/8);
    ASSERT_TRUE(dp.ok()) << dp.status().to_string();
    const std::vector<int32_t>& dpages = draft.pages(g.request_id());
    ASSERT_EQ(dp.value().slots.size(), static_cast<size_t>(1 + draft_len));
    for (int j = 0; j <= draft_len; ++j)
      EXPECT_EQ(dp.value().slots[static_cast<size_t>(j)],
                dpages[static_cast<size_t>(j / 32)] * 32 + j % 32)
          << j;
    EXPECT_EQ(dp.value().max_pages, 8);
    EXPECT_EQ(dp.value().page_table.size(), 8u);
    EXPECT_EQ(dp.value().page_table[dpages.size()], -1);
    if (dpages.size() > 1) {
      EXPECT_FALSE(g.draft_plan(/*page_table_width=*/1).ok());
    }
  }
}

}  // namespace
}  // namespace m3attn
