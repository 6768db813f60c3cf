// Every validation rule of the indexer is rejected with a clear Status, and a rejected call leaves
// the output buffer untouched.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <string>

#include "cache/cache_view.h"
#include "m3attn/config.h"
#include "stages/indexer/indexer.h"
#include "support/batch_builder.h"
#include "support/rejection.h"
#include "support/test_util.h"

namespace m3attn {
namespace {

using testing::BatchOptions;
using testing::HostBatch;
using testing::Rng;

constexpr int32_t kPoison = 0x3c3c3c3c;

class IndexerValidation : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = testing::fresh_seed();
    Rng rng(seed_);
    BatchOptions o;
    o.n_kv = 2;
    hb_ = testing::build_batch({{300, 5}, {40, 1}}, o, rng);
    ASSERT_FALSE(HasFailure());
    T_ = hb_.num_tokens();
    iq_ = Tensor(DType::kE4M3, {T_ + 1, 2, kHeadDim});  // one spare row for misaligned views
    testing::fill_e4m3_normal(iq_, rng);
    ids_ = Tensor(DType::kI32, {(T_ + 1) * 2 * kTopK});
    good_.n_kv = 2;
    good_.top_k = kTopK;
    good_.index_q = TensorView::contiguous(iq_.data(), DType::kE4M3, {T_, 2, kHeadDim});
    good_.index_cache = hb_.index_cache();
    good_.batch = hb_.batch_view();
    good_.block_ids = TensorView::contiguous(ids_.data(), DType::kI32, {T_, 2, kTopK});
  }

  // Applies `mutate` to a copy of the good params and expects both validate_indexer (when
  // `host_only` is false) and run_indexer_cpu to fail with `code` and a message holding `needle`,
  // with the output buffer untouched.
  void expect_rejected(const std::function<void(IndexerParams&)>& mutate, StatusCode code,
                       const std::string& needle, bool host_only = false) {
    M3_SEED_TRACE(seed_);
    SCOPED_TRACE(needle);
    IndexerParams p = good_;
    mutate(p);
    testing::expect_rejected_untouched(p, validate_indexer, run_indexer_cpu, ids_, kPoison, code,
                                       needle, host_only);
  }

  uint64_t seed_ = 0;
  HostBatch hb_;
  int64_t T_ = 0;
  Tensor iq_, ids_;
  IndexerParams good_;
};

TEST_F(IndexerValidation, GoodParamsPass) {
  ASSERT_TRUE(validate_indexer(good_).ok()) << validate_indexer(good_).to_string();
  const Status st = run_indexer_cpu(good_);
  ASSERT_TRUE(st.ok()) << st.to_string();
}

TEST_F(IndexerValidation, HeadsAndTopK) {
  expect_rejected([](IndexerParams& p) { p.n_kv = 0; }, StatusCode::kInvalidArgument, "n_kv");
  expect_rejected([](IndexerParams& p) { p.n_kv = -2; }, StatusCode::kInvalidArgument, "n_kv");
  // n_kv 1 disagrees with index_q's 2 heads.
  expect_rejected([](IndexerParams& p) { p.n_kv = 1; }, StatusCode::kInvalidArgument, "index_q");
  expect_rejected([](IndexerParams& p) { p.top_k = 8; }, StatusCode::kUnsupported, "top_k 8");
  expect_rejected([](IndexerParams& p) { p.top_k = 32; }, StatusCode::kUnsupported, "top_k 32");
}

TEST_F(IndexerValidation, IndexQ) {
  expect_rejected([](IndexerParams& p) { p.index_q.dtype = DType::kBF16; },
                  StatusCode::kInvalidArgument, "index_q must be e4m3");
  expect_rejected([](IndexerParams& p) { p.index_q.shape[0] += 1; }, StatusCode::kInvalidArgument,
                  "index_q must have shape");
  expect_rejected([](IndexerParams& p) { p.index_q.shape[2] = 64; }, StatusCode::kInvalidArgument,
                  "index_q must have shape");
  expect_rejected(
      [](IndexerParams& p) {
        p.index_q.stride[0] = 4 * kHeadDim;  // rows of a wider tensor
      },
      StatusCode::kInvalidArgument, "index_q must be contiguous");
  expect_rejected(
      [](IndexerParams& p) { p.index_q.data = static_cast<uint8_t*>(p.index_q.data) + 4; },
      StatusCode::kInvalidArgument, "index_q base address must be 16-byte aligned");
}

TEST_F(IndexerValidation, BlockIds) {
  expect_rejected([](IndexerParams& p) { p.block_ids.dtype = DType::kF32; },
                  StatusCode::kInvalidArgument, "block_ids must be i32");
  expect_rejected(
      [](IndexerParams& p) {
        p.block_ids.shape[2] = 8;
        p.block_ids.stride[1] = 8;
        p.block_ids.stride[0] = 16;
      },
      StatusCode::kInvalidArgument, "block_ids must have shape");
  expect_rejected([](IndexerParams& p) { p.block_ids.stride[0] = 64; },
                  StatusCode::kInvalidArgument, "block_ids must be contiguous");
  expect_rejected(
      [](IndexerParams& p) { p.block_ids.data = static_cast<int32_t*>(p.block_ids.data) + 1; },
      StatusCode::kInvalidArgument, "block_ids base address must be 16-byte aligned");
  expect_rejected([](IndexerParams& p) { p.block_ids = TensorView(); },
                  StatusCode::kInvalidArgument, "block_ids");
}

TEST_F(IndexerValidation, IndexCache) {
  expect_rejected([](IndexerParams& p) { p.index_cache.dtype = DType::kBF16; },
                  StatusCode::kInvalidArgument, "index cache must be e4m3");
  expect_rejected([](IndexerParams& p) { p.index_cache.shape[2] = 64; },
                  StatusCode::kInvalidArgument, "page size must be 128");
  expect_rejected([](IndexerParams& p) { p.index_cache.stride[0] = 16384 + 2; },
                  StatusCode::kInvalidArgument,
                  "page stride 16386 is not a positive multiple of 4");
  expect_rejected([](IndexerParams& p) { p.index_cache.stride[0] = 16000; },
                  StatusCode::kInvalidArgument, "overlap");
  expect_rejected([](IndexerParams& p) { p.index_cache.stride[2] = 256; },
                  StatusCode::kInvalidArgument, "inner strides");
  expect_rejected(
      [](IndexerParams& p) { p.index_cache.data = static_cast<uint8_t*>(p.index_cache.data) + 2; },
      StatusCode::kInvalidArgument, "4-byte aligned");
}

TEST_F(IndexerValidation, BatchViews) {
  expect_rejected([](IndexerParams& p) { p.batch.positions.dtype = DType::kF32; },
                  StatusCode::kInvalidArgument, "positions must be i32");
  expect_rejected([](IndexerParams& p) { p.batch.query_start.shape[0] = 2; },
                  StatusCode::kInvalidArgument, "query_start must have shape");
  expect_rejected([](IndexerParams& p) { p.batch.page_table.stride[1] = 2; },
                  StatusCode::kInvalidArgument, "page_table rows must be contiguous");
  expect_rejected([](IndexerParams& p) { p.batch.num_tokens = -1; }, StatusCode::kInvalidArgument,
                  "negative");
  expect_rejected(
      [](IndexerParams& p) {
        p.batch.num_tokens = int64_t{1} << 31;
        p.batch.positions.shape[0] = int64_t{1} << 31;
      },
      StatusCode::kInvalidArgument, "exceeds the int32 range");
}

TEST_F(IndexerValidation, OneDevice) {
  expect_rejected([](IndexerParams& p) { p.index_q.device = Device::cuda(0); },
                  StatusCode::kInvalidArgument, "one device");
  expect_rejected([](IndexerParams& p) { p.batch.page_table.device = Device::cuda(0); },
                  StatusCode::kInvalidArgument, "one device");
  // All on a device: valid for the launcher, but the CPU twin needs host views.
  IndexerParams p = good_;
  for (TensorView* t : {&p.index_q, &p.index_cache, &p.block_ids, &p.batch.query_start,
                        &p.batch.positions, &p.batch.seq_lens, &p.batch.page_table})
    t->device = Device::cuda(0);
  EXPECT_TRUE(validate_indexer(p).ok()) << validate_indexer(p).to_string();
  expect_rejected(
      [](IndexerParams& q) {
        for (TensorView* t : {&q.index_q, &q.index_cache, &q.block_ids, &q.batch.query_start,
                              &q.batch.positions, &q.batch.seq_lens, &q.batch.page_table})
          t->device = Device::cuda(0);
      },
      StatusCode::kInvalidArgument, "host views", /*host_only=*/true);
}

// Contents are checked by the twin only (the launcher cannot read device memory).
TEST_F(IndexerValidation, BatchContents) {
  const int64_t pages = hb_.num_pages();
  int32_t* table = hb_.page_table.ptr<int32_t>();
  const int32_t saved = table[1];
  table[1] = static_cast<int32_t>(pages);  // request 0 uses pages 0..2
  EXPECT_TRUE(validate_indexer(good_).ok());
  expect_rejected([](IndexerParams&) {}, StatusCode::kInvalidArgument, "outside the pool",
                  /*host_only=*/true);
  table[1] = -1;
  expect_rejected([](IndexerParams&) {}, StatusCode::kInvalidArgument, "outside the pool",
                  /*host_only=*/true);
  table[1] = saved;
  int32_t* pos = hb_.positions.ptr<int32_t>();
  pos[2] += 1;
  expect_rejected([](IndexerParams&) {}, StatusCode::kInvalidArgument, "expected 302",
                  /*host_only=*/true);
  pos[2] -= 1;
  hb_.query_start.ptr<int32_t>()[1] = 7;  // not monotone / not matching seq_lens
  expect_rejected([](IndexerParams&) {}, StatusCode::kInvalidArgument, "request",
                  /*host_only=*/true);
}

}  // namespace
}  // namespace m3attn
