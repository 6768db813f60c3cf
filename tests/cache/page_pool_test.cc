// PagePool layout, PageAllocator free list and CacheManager page tables: no tile overlaps, 64-bit
// offsets, rejected configs, churn without leaks, and step reservations that roll back completely.
#include "cache/page_pool.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <vector>

#include "cache/cache_view.h"
#include "cache/page_allocator.h"
#include "m3attn/config.h"
#include "support/test_util.h"

namespace m3attn {
namespace {

using testing::Rng;
constexpr int64_t kTile = int64_t{kPageSize} * kHeadDim;

// ---- PagePool / PoolLayout ----

TEST(PagePoolTest, TilesOfEveryLayerCoverDisjointBytes) {
  for (bool with_index : {true, false}) {
    for (int64_t extra : {int64_t{0}, int64_t{12}, int64_t{4096}}) {
      PagePoolConfig cfg;
      cfg.num_pages = 3;
      cfg.num_layers = 3;
      cfg.n_kv = 2;
      cfg.with_index = with_index;
      cfg.plane_stride = extra == 0 ? 0 : 2 * kTile + extra;
      SCOPED_TRACE(::testing::Message() << "with_index " << with_index << " extra " << extra);
      Result<PagePool> pool = PagePool::create(cfg);
      ASSERT_TRUE(pool.ok()) << pool.status().to_string();
      const PoolLayout& l = pool.value().layout();
      const int64_t plane = 2 * kTile;
      const int64_t ps = extra == 0 ? plane : plane + extra;
      EXPECT_EQ(l.plane_stride(), ps);
      EXPECT_EQ(l.layer_bytes(), ps + plane + (with_index ? kTile : 0));
      EXPECT_EQ(l.page_stride(), 3 * l.layer_bytes());
      EXPECT_EQ(pool.value().bytes(), 3 * l.page_stride());

      // Each byte of the pool belongs to at most one (layer, page, plane, head, row) row.
      std::vector<int> owner(static_cast<size_t>(pool.value().bytes()), 0);
      const uint8_t* base = pool.value().data();
      auto mark = [&](const uint8_t* row) {
        const int64_t off = row - base;
        ASSERT_GE(off, 0);
        ASSERT_LE(off + kHeadDim, pool.value().bytes());
        for (int d = 0; d < kHeadDim; ++d) owner[static_cast<size_t>(off + d)]++;
      };
      for (int layer = 0; layer < 3; ++layer) {
        Result<TensorView> kv = pool.value().kv_cache(layer);
        ASSERT_TRUE(kv.ok()) << kv.status().to_string();
        ASSERT_TRUE(validate_kv_cache(kv.value(), 2, "kv").ok());
        for (int64_t p = 0; p < 3; ++p)
          for (int plane_i = 0; plane_i < 2; ++plane_i)
            for (int h = 0; h < 2; ++h)
              for (int row = 0; row < kPageSize; ++row)
                mark(kv.value().ptr<uint8_t>() + kv_cache_offset(kv.value(), p, plane_i, h, row));
        Result<TensorView> ic = pool.value().index_cache(layer);
        ASSERT_EQ(ic.ok(), with_index);
        if (!with_index) continue;
        ASSERT_TRUE(validate_index_cache(ic.value(), "index").ok());
        for (int64_t p = 0; p < 3; ++p)
          for (int row = 0; row < kPageSize; ++row)
            mark(ic.value().ptr<uint8_t>() + index_cache_offset(ic.value(), p, row));
      }
      int64_t owned = 0;
      for (int c : owner) {
        ASSERT_LE(c, 1) << "two cache rows share a byte";
        owned += c;
      }
      // Everything but the plane gaps is owned, and the last byte is the last layer's last row.
      EXPECT_EQ(owned, pool.value().bytes() - 9 * (ps - plane));
      EXPECT_EQ(owner.back(), 1);
    }
  }
}

TEST(PagePoolTest, OffsetsAre64Bit) {
  // An M3-sized pool: 60 layers interleaved, 2^20 pages: offsets far past 2^31 (layout only).
  PagePoolConfig cfg;
  cfg.num_pages = int64_t{1} << 20;
  cfg.num_layers = 60;
  cfg.n_kv = 4;
  Result<PoolLayout> l = PoolLayout::create(cfg);
  ASSERT_TRUE(l.ok()) << l.status().to_string();
  const int64_t layer_bytes = 4 * kTile * 2 + kTile;
  EXPECT_EQ(l.value().page_stride(), 60 * layer_bytes);
  uint8_t* fake_base = nullptr;
  TensorView kv = l.value().kv_cache_view(fake_base, 59);
  TensorView ic = l.value().index_cache_view(fake_base, 59);
  const int64_t page = (int64_t{1} << 20) - 1;
  const int64_t want_kv =
      59 * layer_bytes + page * 60 * layer_bytes + 1 * 4 * kTile + 3 * kTile + 127 * kHeadDim;
  EXPECT_EQ(reinterpret_cast<intptr_t>(kv.ptr<uint8_t>()) + kv_cache_offset(kv, page, 1, 3, 127),
            want_kv);
  EXPECT_GT(want_kv, int64_t{1} << 31);
  const int64_t want_ic = 59 * layer_bytes + 8 * kTile + page * 60 * layer_bytes + 5 * kHeadDim;
  EXPECT_EQ(reinterpret_cast<intptr_t>(ic.ptr<uint8_t>()) + index_cache_offset(ic, page, 5),
            want_ic);
}

TEST(PagePoolTest, RejectsBadConfigs) {
  auto bad = [](PagePoolConfig c, const char* what) {
    Result<PagePool> p = PagePool::create(c);
    EXPECT_FALSE(p.ok()) << what;
    EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument) << what;
    EXPECT_FALSE(p.status().message().empty());
  };
  PagePoolConfig good;
  good.num_pages = 2;
  good.n_kv = 2;
  ASSERT_TRUE(PagePool::create(good).ok());
  PagePoolConfig c = good;
  c.num_pages = 0;
  bad(c, "zero pages");
  c = good;
  c.num_pages = (int64_t{1} << 24) + 1;
  bad(c, "page ids beyond int32 slots");
  c = good;
  c.n_kv = 0;
  bad(c, "zero heads");
  c = good;
  c.num_layers = 0;
  bad(c, "zero layers");
  c = good;
  c.plane_stride = 2 * kTile - 4;
  bad(c, "plane stride below one plane");
  c = good;
  c.plane_stride = 2 * kTile + 2;
  bad(c, "plane stride not a multiple of 4");

  Result<PagePool> p = PagePool::create(good);
  EXPECT_FALSE(p.value().kv_cache(1).ok());
  EXPECT_FALSE(p.value().kv_cache(-1).ok());
  good.with_index = false;
  Result<PagePool> q = PagePool::create(good);
  EXPECT_TRUE(q.value().kv_cache(0).ok());
  EXPECT_FALSE(q.value().index_cache(0).ok());
}

TEST(PagePoolTest, CloneCopiesBytes) {
  PagePoolConfig cfg;
  cfg.num_pages = 2;
  cfg.n_kv = 1;
  Result<PagePool> p = PagePool::create(cfg);
  ASSERT_TRUE(p.ok());
  for (int64_t i = 0; i < p.value().bytes(); ++i) p.value().data()[i] = static_cast<uint8_t>(i * 7);
  PagePool c = p.value().clone();
  ASSERT_EQ(c.bytes(), p.value().bytes());
  EXPECT_NE(c.data(), p.value().data());
  EXPECT_TRUE(std::equal(c.data(), c.data() + c.bytes(), p.value().data()));
}

// ---- PageAllocator ----

TEST(PageAllocatorTest, HandsOutLowIdsAndRejectsBadFrees) {
  PageAllocator a(5);
  std::vector<int32_t> pages;
  ASSERT_TRUE(a.allocate(3, &pages).ok());
  EXPECT_EQ(pages, (std::vector<int32_t>{0, 1, 2}));
  Status s = a.allocate(3, &pages);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(pages.size(), 3u) << "a failed allocation must append nothing";
  EXPECT_EQ(a.num_free(), 2);
  EXPECT_EQ(a.free({1, 7}).code(), StatusCode::kInvalidArgument);  // out of range
  EXPECT_EQ(a.free({1, 3}).code(), StatusCode::kInvalidArgument);  // 3 is not allocated
  EXPECT_EQ(a.free({1, 1}).code(), StatusCode::kInvalidArgument);  // twice
  EXPECT_EQ(a.num_free(), 2) << "a rejected free must free nothing";
  EXPECT_TRUE(a.in_use(1));
  ASSERT_TRUE(a.free({1}).ok());
  EXPECT_FALSE(a.in_use(1));
  std::vector<int32_t> more;
  ASSERT_TRUE(a.allocate(1, &more).ok());
  EXPECT_EQ(more, (std::vector<int32_t>{1})) << "the last freed page is handed out first";
}

// ---- CacheManager ----

// Every page is either free or in exactly one request's table; tables match lengths.
void expect_consistent(const CacheManager& m) {
  std::set<int32_t> owned;
  for (int64_t id : m.request_ids()) {
    const auto& pages = m.pages(id);
    EXPECT_EQ(static_cast<int64_t>(pages.size()), CacheManager::pages_for(m.length(id)))
        << "request " << id;
    for (int32_t p : pages) {
      EXPECT_TRUE(m.allocator().in_use(p)) << "page " << p;
      EXPECT_TRUE(owned.insert(p).second) << "page " << p << " is in two tables";
    }
  }
  EXPECT_EQ(static_cast<int64_t>(owned.size()) + m.num_free_pages(), m.num_pages())
      << "a page leaked";
}

TEST(CacheManagerTest, SlotMappingFollowsThePageTable) {
  CacheManager m(8);
  ASSERT_TRUE(m.add_request(5).ok());
  ASSERT_TRUE(m.add_request(9).ok());
  ASSERT_TRUE(m.reserve(5, 100).ok());
  ASSERT_TRUE(m.reserve(9, 129).ok());
  ASSERT_TRUE(m.reserve(5, 300).ok());  // interleaved growth: request 5's pages are 0, 3, 4
  EXPECT_EQ(m.pages(5), (std::vector<int32_t>{0, 3, 4}));
  EXPECT_EQ(m.pages(9), (std::vector<int32_t>{1, 2}));
  for (int64_t j : {0, 1, 127, 128, 255, 256, 299, 383}) {
    Result<int32_t> s = m.slot(5, j);
    ASSERT_TRUE(s.ok());
    EXPECT_EQ(s.value(), m.pages(5)[static_cast<size_t>(j / 128)] * 128 + j % 128);
  }
  EXPECT_EQ(m.slot(5, 384).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(m.slot(5, -1).status().code(), StatusCode::kOutOfRange);
  EXPECT_FALSE(m.slot(6, 0).ok());
  EXPECT_FALSE(m.add_request(5).ok());
  EXPECT_FALSE(m.reserve(5, 10).ok()) << "reserve never shrinks";
  ASSERT_TRUE(m.truncate(5, 129).ok());
  EXPECT_EQ(m.pages(5), (std::vector<int32_t>{0, 3}));
  EXPECT_EQ(m.length(5), 129);
  EXPECT_FALSE(m.truncate(5, 130).ok());
  expect_consistent(m);
  ASSERT_TRUE(m.release(5).ok());
  EXPECT_FALSE(m.release(5).ok());
  EXPECT_EQ(m.num_free_pages(), 6);
  expect_consistent(m);
}

TEST(CacheManagerTest, ChurnLeaksNoPage) {
  const uint64_t seed = testing::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  CacheManager m(40);
  int64_t next_id = 0;
  int exhausted = 0, admitted = 0, finished = 0;
  for (int step = 0; step < 2000; ++step) {
    const int op = static_cast<int>(rng.integer(0, 9));
    std::vector<int64_t> ids = m.request_ids();
    if (op <= 1 || ids.empty()) {  // admit with a prompt
      const int64_t id = next_id++;
      const int64_t len = rng.integer(1, 700);
      Result<StepReservation> r = m.reserve_step({{id, len}}, true);
      if (r.ok()) {
        ++admitted;
      } else {
        ASSERT_EQ(r.status().code(), StatusCode::kResourceExhausted) << r.status().to_string();
        EXPECT_FALSE(m.has_request(id)) << "a failed admission must forget the request";
        ++exhausted;
      }
    } else if (op <= 6) {  // a step growing a few requests at once
      std::vector<std::pair<int64_t, int64_t>> grow;
      for (int64_t id : ids)
        if (rng.integer(0, 2) == 0) grow.emplace_back(id, m.length(id) + rng.integer(1, 200));
      Result<StepReservation> r = m.reserve_step(grow, false);
      if (!r.ok()) {
        ASSERT_EQ(r.status().code(), StatusCode::kResourceExhausted) << r.status().to_string();
        ++exhausted;
      } else if (rng.integer(0, 4) == 0) {
        ASSERT_TRUE(m.rollback(r.value()).ok());  // e.g. a DP dummy step
      }
    } else if (op == 7) {  // rejected drafts
      const int64_t id = ids[static_cast<size_t>(rng.integer(0, int64_t(ids.size()) - 1))];
      ASSERT_TRUE(m.truncate(id, rng.integer(0, m.length(id))).ok());
    } else {  // finish
      const int64_t id = ids[static_cast<size_t>(rng.integer(0, int64_t(ids.size()) - 1))];
      ASSERT_TRUE(m.release(id).ok());
      ++finished;
    }
    expect_consistent(m);
    if (::testing::Test::HasFailure()) return;
  }
  EXPECT_GT(exhausted, 0) << "the churn never hit exhaustion: make the pool smaller";
  EXPECT_GT(admitted, 0);
  EXPECT_GT(finished, 0);
  for (int64_t id : m.request_ids()) ASSERT_TRUE(m.release(id).ok());
  EXPECT_EQ(m.num_free_pages(), m.num_pages());
}

TEST(CacheManagerTest, FailedStepRollsBackEveryPageItTook) {
  CacheManager m(10);
  for (int64_t id : {1, 2, 3}) ASSERT_TRUE(m.add_request(id).ok());
  ASSERT_TRUE(m.reserve(1, 130).ok());  // 2 pages
  ASSERT_TRUE(m.reserve(2, 1).ok());    // 1 page
  const CacheManager before = m;
  // Request 1 takes 2 more pages, request 4 (new) 3, request 2 one, then request 3 needs 5: only 1
  // is left when it asks, so the step fails after taking 6 pages.
  Result<StepReservation> r =
      m.reserve_step({{1, 500}, {4, 300}, {2, 200}, {3, 640}}, /*admit_new=*/true);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(r.status().message().find("rolled back"), std::string::npos) << r.status().message();
  EXPECT_EQ(m.num_free_pages(), before.num_free_pages());
  EXPECT_EQ(m.request_ids(), before.request_ids()) << "the admitted request must be forgotten";
  for (int64_t id : before.request_ids()) {
    EXPECT_EQ(m.length(id), before.length(id)) << id;
    EXPECT_EQ(m.pages(id), before.pages(id)) << id;
  }
  // The free list is restored in order: the next allocation matches the untouched copy.
  CacheManager twin = before;
  ASSERT_TRUE(m.reserve(3, 7 * 128).ok());
  ASSERT_TRUE(twin.reserve(3, 7 * 128).ok());
  EXPECT_EQ(m.pages(3), twin.pages(3));
  expect_consistent(m);

  // Invalid steps change nothing either.
  const CacheManager snap = m;
  EXPECT_EQ(m.reserve_step({{1, 200}, {1, 300}}, true).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(m.reserve_step({{1, 100}}, true).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(m.reserve_step({{77, 100}}, false).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(m.num_free_pages(), snap.num_free_pages());
  EXPECT_EQ(m.request_ids(), snap.request_ids());
}

TEST(CacheManagerTest, SuccessfulStepRollsBackOnRequest) {
  CacheManager m(16);
  ASSERT_TRUE(m.add_request(1).ok());
  ASSERT_TRUE(m.reserve(1, 200).ok());
  const CacheManager before = m;
  Result<StepReservation> r = m.reserve_step({{1, 260}, {-1, 1}}, true);  // -1: a dummy request
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r.value().pages_taken, 2);
  EXPECT_TRUE(m.has_request(-1));
  ASSERT_TRUE(m.rollback(r.value()).ok());
  EXPECT_FALSE(m.has_request(-1));
  EXPECT_EQ(m.length(1), 200);
  EXPECT_EQ(m.pages(1), before.pages(1));
  EXPECT_EQ(m.num_free_pages(), before.num_free_pages());
  expect_consistent(m);
}

}  // namespace
}  // namespace m3attn
