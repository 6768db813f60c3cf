#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cache/batch.h"
#include "m3attn/config.h"
#include "support/rejection.h"

namespace m3attn {
namespace {

// Host tensors behind one BatchView. Requests are (cached tokens before the step, new tokens).
struct Batch {
  std::vector<int32_t> query_start, positions, seq_lens, page_table;
  int max_pages = 0;
  int64_t num_pages = 0;

  Batch(const std::vector<std::pair<int, int>>& requests, int max_pages_, int64_t pool_pages)
      : max_pages(max_pages_), num_pages(pool_pages) {
    query_start.push_back(0);
    int page = 0;
    for (const auto& [cached, fresh] : requests) {
      for (int i = 0; i < fresh; ++i) positions.push_back(cached + i);
      query_start.push_back(query_start.back() + fresh);
      seq_lens.push_back(cached + fresh);
      for (int j = 0; j < max_pages; ++j)
        page_table.push_back(j < (cached + fresh + kPageSize - 1) / kPageSize
                                 ? static_cast<int32_t>(page++ % pool_pages)
                                 : -1);
    }
  }
  BatchView view() {
    BatchView b;
    b.num_requests = static_cast<int>(seq_lens.size());
    b.num_tokens = static_cast<int64_t>(positions.size());
    b.max_pages = max_pages;
    b.query_start = TensorView::contiguous(query_start.data(), DType::kI32, {b.num_requests + 1});
    b.positions = TensorView::contiguous(positions.data(), DType::kI32, {b.num_tokens});
    b.seq_lens = TensorView::contiguous(seq_lens.data(), DType::kI32, {b.num_requests});
    b.page_table =
        TensorView::contiguous(page_table.data(), DType::kI32, {b.num_requests, max_pages});
    return b;
  }
  int32_t& table(int r, int j) { return page_table[static_cast<size_t>(r) * max_pages + j]; }
};

// Context chunks first (one fresh prompt, one continuing after 300 cached tokens), then two
// generation requests of 1 + draft_len = 3 tokens.
Batch mixed_batch() { return Batch({{0, 129}, {300, 200}, {1000, 3}, {127, 3}}, 12, 64); }

using testing::rejects;

TEST(BatchView, ValidMixedBatch) {
  Batch b = mixed_batch();
  const BatchView v = b.view();
  EXPECT_EQ(v.num_tokens, 129 + 200 + 3 + 3);
  EXPECT_TRUE(validate_batch_view(v, "indexer").ok());
  const Status s = validate_batch_contents(v, b.num_pages, "indexer");
  EXPECT_TRUE(s.ok()) << s.to_string();
}

TEST(BatchView, EmptyBatchIsValid) {
  Batch b({}, 4, 8);
  const BatchView v = b.view();
  EXPECT_EQ(v.num_requests, 0);
  EXPECT_EQ(v.num_tokens, 0);
  EXPECT_TRUE(validate_batch_contents(v, 8, "attention").ok());
}

TEST(BatchView, TokensWithoutARequestAreRejected) {
  Batch b({}, 4, 8);
  b.positions = {0, 1};  // two tokens, no request owns them
  BatchView v = b.view();
  EXPECT_TRUE(validate_batch_view(v, "attention").ok());
  EXPECT_TRUE(rejects(validate_batch_contents(v, 8, "attention"), "no request owns them"));
}

TEST(BatchView, ShapeDtypeAndDeviceRules) {
  Batch b = mixed_batch();
  const BatchView good = b.view();
  BatchView v = good;
  v.num_tokens = -1;
  EXPECT_TRUE(rejects(validate_batch_view(v, "attn"), "attn: token count -1 is negative"));
  v = good;
  v.num_requests = -2;
  EXPECT_TRUE(rejects(validate_batch_view(v, "attn"), "attn: request count -2 is negative"));
  v = good;
  v.max_pages = -1;
  EXPECT_TRUE(rejects(validate_batch_view(v, "attn"), "max pages -1 is negative"));
  v = good;
  v.positions.dtype = DType::kF32;
  EXPECT_TRUE(rejects(validate_batch_view(v, "attn"), "positions must be i32, got f32"));
  v = good;
  v.query_start.dtype = DType::kBF16;
  EXPECT_TRUE(rejects(validate_batch_view(v, "attn"), "query_start must be i32"));
  v = good;
  v.seq_lens.dtype = DType::kE4M3;
  EXPECT_TRUE(rejects(validate_batch_view(v, "attn"), "seq_lens must be i32"));
  v = good;
  v.page_table.dtype = DType::kF32;
  EXPECT_TRUE(rejects(validate_batch_view(v, "attn"), "page_table must be i32"));
  v = good;
  v.num_tokens += 1;
  EXPECT_TRUE(
      rejects(validate_batch_view(v, "attn"), "positions must have shape [336], got [335]"));
  v = good;
  v.num_requests = 3;
  EXPECT_TRUE(rejects(validate_batch_view(v, "attn"), "query_start must have shape [4], got [5]"));
  v = good;
  v.max_pages = 11;
  EXPECT_TRUE(
      rejects(validate_batch_view(v, "attn"), "page_table must have shape [4, 11], got [4, 12]"));
  v = good;
  v.positions = TensorView::strided(b.positions.data(), DType::kI32, {v.num_tokens}, {2});
  EXPECT_TRUE(rejects(validate_batch_view(v, "attn"), "positions must be contiguous"));
  v = good;
  v.seq_lens = TensorView::strided(b.seq_lens.data(), DType::kI32, {4}, {-1});
  EXPECT_TRUE(rejects(validate_batch_view(v, "attn"), "seq_lens must be contiguous"));
  v = good;
  v.page_table = TensorView::strided(b.page_table.data(), DType::kI32, {4, 12}, {1, 4});
  EXPECT_TRUE(rejects(validate_batch_view(v, "attn"), "page_table rows must be contiguous"));
  // A padded page table (row stride > max_pages) is fine.
  v = good;
  v.page_table = TensorView::strided(b.page_table.data(), DType::kI32, {4, 6}, {12, 1});
  v.max_pages = 6;
  EXPECT_TRUE(validate_batch_view(v, "attn").ok());
  v = good;
  v.seq_lens.device = Device::cuda(0);
  EXPECT_TRUE(rejects(validate_batch_view(v, "attn"), "attn: all tensors must be on one device"));
}

TEST(BatchView, ContentRules) {
  const int64_t pool = 64;
  {
    Batch b = mixed_batch();
    b.query_start[0] = 1;
    EXPECT_TRUE(rejects(validate_batch_contents(b.view(), pool, "ix"),
                        "ix: query_start[0] must be 0, got 1"));
  }
  {
    Batch b = mixed_batch();
    b.query_start[4] = 334;
    EXPECT_TRUE(rejects(validate_batch_contents(b.view(), pool, "ix"),
                        "query_start[R] = 334 must equal the token count 335"));
  }
  {
    Batch b = mixed_batch();
    b.query_start[2] = 100;  // request 1 would end before it starts
    EXPECT_TRUE(rejects(validate_batch_contents(b.view(), pool, "ix"),
                        "query_start is not monotone at request 1"));
  }
  {
    Batch b = mixed_batch();
    b.seq_lens[2] = 2;  // 3 query tokens but only 2 in cache
    EXPECT_TRUE(rejects(validate_batch_contents(b.view(), pool, "ix"),
                        "request 2 has 3 query tokens but seq_len 2"));
  }
  {
    Batch b = mixed_batch();
    b.seq_lens[1] = 12 * 128 + 1;  // more than the page table can hold
    EXPECT_TRUE(rejects(validate_batch_contents(b.view(), pool, "ix"),
                        "request 1 seq_len 1537 exceeds its page table (12 pages)"));
  }
  {
    Batch b = mixed_batch();
    b.positions[129 + 7] += 1;  // a gap inside request 1
    EXPECT_TRUE(rejects(validate_batch_contents(b.view(), pool, "ix"),
                        "request 1 token 7 has position 308, expected 307"));
  }
  {
    Batch b = mixed_batch();
    b.seq_lens[3] = 131;  // positions 127..129 must end at seq_len - 1 = 130
    EXPECT_TRUE(rejects(validate_batch_contents(b.view(), pool, "ix"),
                        "request 3 token 0 has position 127, expected 128"));
  }
  {
    Batch b = mixed_batch();
    b.table(1, 3) = static_cast<int32_t>(pool);  // a visible page outside the pool
    EXPECT_TRUE(rejects(validate_batch_contents(b.view(), pool, "ix"),
                        "request 1 page_table[3] = 64 is outside the pool of 64 pages"));
  }
  {
    Batch b = mixed_batch();
    b.table(0, 1) = -1;  // request 0 has 129 tokens: page 1 is visible
    EXPECT_TRUE(
        rejects(validate_batch_contents(b.view(), pool, "ix"), "request 0 page_table[1] = -1"));
  }
  {
    // Entries past the visible pages are not read: anything goes there.
    Batch b = mixed_batch();
    b.table(0, 2) = 999999;
    b.table(3, 11) = -7;
    EXPECT_TRUE(validate_batch_contents(b.view(), pool, "ix").ok());
  }
  {
    Batch b = mixed_batch();
    BatchView v = b.view();
    for (TensorView* t : {&v.query_start, &v.positions, &v.seq_lens, &v.page_table})
      t->device = Device::cuda(0);
    EXPECT_TRUE(validate_batch_view(v, "ix").ok());
    EXPECT_TRUE(rejects(validate_batch_contents(v, pool, "ix"),
                        "batch contents can only be checked on host views"));
  }
}

}  // namespace
}  // namespace m3attn
