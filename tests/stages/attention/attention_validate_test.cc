// Every validation rule of the attention stage is rejected with a clear Status, and a rejected
// call leaves the output buffer untouched.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>

#include "m3attn/config.h"
#include "stages/attention/attention.h"
#include "support/batch_builder.h"
#include "support/rejection.h"
#include "support/test_util.h"

namespace m3attn {
namespace {

using testing::BatchOptions;
using testing::HostBatch;
using testing::Rng;

constexpr uint16_t kPoison = 0x7fc1;

class AttentionValidation : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = testing::fresh_seed();
    Rng rng(seed_);
    BatchOptions o;
    o.n_kv = 2;
    hb_ = testing::build_batch({{200, 4}, {7, 2}}, o, rng);
    ASSERT_FALSE(HasFailure());
    T_ = hb_.num_tokens();
    q_ = Tensor(DType::kE4M3, {T_ + 1, 8, kHeadDim});  // a spare row for misaligned views
    testing::fill_e4m3_normal(q_, rng);
    ids_ = Tensor(DType::kI32, {(T_ + 1) * 2 * kTopK});
    std::fill(ids_.ptr<int32_t>(), ids_.ptr<int32_t>() + ids_.numel(), -1);
    for (int64_t t = 0; t < T_; ++t)
      for (int g = 0; g < 2; ++g) ids_.ptr<int32_t>()[(t * 2 + g) * kTopK] = 0;
    out_ = Tensor(DType::kBF16, {(T_ + 1) * 8 * kHeadDim});
    good_.n_q = 8;
    good_.n_kv = 2;
    good_.sparse = true;
    good_.q = TensorView::contiguous(q_.data(), DType::kE4M3, {T_, 8, kHeadDim});
    good_.kv_cache = hb_.kv_cache();
    good_.block_ids = TensorView::contiguous(ids_.data(), DType::kI32, {T_, 2, kTopK});
    good_.batch = hb_.batch_view();
    good_.out = TensorView::contiguous(out_.data(), DType::kBF16, {T_, 8 * kHeadDim});
  }

  // Applies `mutate` to a copy of the good params and expects validate_attention (unless
  // `host_only`) and run_attention_cpu to fail with `code` and a message holding `needle`, with
  // the output buffer untouched.
  void expect_rejected(const std::function<void(AttentionParams&)>& mutate, StatusCode code,
                       const std::string& needle, bool host_only = false) {
    M3_SEED_TRACE(seed_);
    SCOPED_TRACE(needle);
    AttentionParams p = good_;
    mutate(p);
    testing::expect_rejected_untouched(p, validate_attention, run_attention_cpu, out_, kPoison,
                                       code, needle, host_only);
  }

  uint64_t seed_ = 0;
  HostBatch hb_;
  int64_t T_ = 0;
  Tensor q_, ids_, out_;
  AttentionParams good_;
};

TEST_F(AttentionValidation, GoodParamsPass) {
  for (bool sparse : {true, false}) {
    AttentionParams p = good_;
    p.sparse = sparse;
    ASSERT_TRUE(validate_attention(p).ok()) << validate_attention(p).to_string();
    const Status st = run_attention_cpu(p);
    ASSERT_TRUE(st.ok()) << st.to_string();
  }
  // Dense needs no block ids at all.
  AttentionParams p = good_;
  p.sparse = false;
  p.block_ids = TensorView();
  EXPECT_TRUE(validate_attention(p).ok()) << validate_attention(p).to_string();
  EXPECT_TRUE(run_attention_cpu(p).ok());
  // A positive explicit scale is fine.
  p.softmax_scale = 0.125f;
  EXPECT_TRUE(validate_attention(p).ok());
}

TEST_F(AttentionValidation, HeadsAndScale) {
  expect_rejected([](AttentionParams& p) { p.n_q = 0; }, StatusCode::kInvalidArgument, "n_q");
  expect_rejected([](AttentionParams& p) { p.n_kv = 0; }, StatusCode::kInvalidArgument, "n_kv");
  expect_rejected([](AttentionParams& p) { p.n_kv = 3; }, StatusCode::kInvalidArgument,
                  "not a multiple of n_kv 3");
  // n_q 4 disagrees with q's 8 heads.
  expect_rejected([](AttentionParams& p) { p.n_q = 4; }, StatusCode::kInvalidArgument,
                  "attention q must have shape");
  // n_kv 1 disagrees with the cache's 2 heads.
  expect_rejected([](AttentionParams& p) { p.n_kv = 1; }, StatusCode::kInvalidArgument,
                  "KV cache must have shape");
  for (float s :
       {-1.0f, std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()})
    expect_rejected([s](AttentionParams& p) { p.softmax_scale = s; }, StatusCode::kInvalidArgument,
                    "softmax_scale");
}

TEST_F(AttentionValidation, Query) {
  expect_rejected([](AttentionParams& p) { p.q.dtype = DType::kBF16; },
                  StatusCode::kInvalidArgument, "attention q must be e4m3");
  expect_rejected([](AttentionParams& p) { p.q.shape[0] -= 1; }, StatusCode::kInvalidArgument,
                  "attention q must have shape");
  expect_rejected([](AttentionParams& p) { p.q.shape[2] = 64; }, StatusCode::kInvalidArgument,
                  "attention q must have shape");
  expect_rejected([](AttentionParams& p) { p.q.stride[0] = 16 * kHeadDim; },
                  StatusCode::kInvalidArgument, "attention q must be contiguous");
  expect_rejected([](AttentionParams& p) { p.q.data = static_cast<uint8_t*>(p.q.data) + 8; },
                  StatusCode::kInvalidArgument, "q base address must be 16-byte aligned");
}

TEST_F(AttentionValidation, KvCache) {
  const int64_t tile = int64_t{kPageSize} * kHeadDim;
  expect_rejected([](AttentionParams& p) { p.kv_cache.dtype = DType::kBF16; },
                  StatusCode::kInvalidArgument, "KV cache must be e4m3");
  expect_rejected([](AttentionParams& p) { p.kv_cache.shape[3] = 64; },
                  StatusCode::kInvalidArgument, "page size must be 128");
  expect_rejected([](AttentionParams& p) { p.kv_cache.shape[1] = 1; }, StatusCode::kInvalidArgument,
                  "KV cache must have shape");
  expect_rejected([tile](AttentionParams& p) { p.kv_cache.stride[0] = 4 * tile + 2; },
                  StatusCode::kInvalidArgument, "is not a positive multiple of 4");
  expect_rejected([tile](AttentionParams& p) { p.kv_cache.stride[1] = 2 * tile - 4; },
                  StatusCode::kInvalidArgument, "smaller than one plane");
  expect_rejected([tile](AttentionParams& p) { p.kv_cache.stride[0] = 3 * tile; },
                  StatusCode::kInvalidArgument, "overlaps the next page");
  expect_rejected([](AttentionParams& p) { p.kv_cache.stride[3] = 256; },
                  StatusCode::kInvalidArgument, "inner strides");
  expect_rejected(
      [](AttentionParams& p) { p.kv_cache.data = static_cast<uint8_t*>(p.kv_cache.data) + 1; },
      StatusCode::kInvalidArgument, "4-byte aligned");
}

TEST_F(AttentionValidation, BlockIds) {
  expect_rejected([](AttentionParams& p) { p.block_ids.dtype = DType::kF32; },
                  StatusCode::kInvalidArgument, "block_ids must be i32");
  expect_rejected(
      [](AttentionParams& p) {
        p.block_ids.shape[2] = 8;
        p.block_ids.stride[1] = 8;
        p.block_ids.stride[0] = 16;
      },
      StatusCode::kInvalidArgument, "block_ids must have shape");
  expect_rejected([](AttentionParams& p) { p.block_ids.stride[1] = 32; },
                  StatusCode::kInvalidArgument, "block_ids must be contiguous");
  expect_rejected(
      [](AttentionParams& p) { p.block_ids.data = static_cast<int32_t*>(p.block_ids.data) + 2; },
      StatusCode::kInvalidArgument, "block_ids base address must be 16-byte aligned");
  expect_rejected([](AttentionParams& p) { p.block_ids = TensorView(); },
                  StatusCode::kInvalidArgument, "block_ids");
}

TEST_F(AttentionValidation, Output) {
  expect_rejected([](AttentionParams& p) { p.out.dtype = DType::kF32; },
                  StatusCode::kInvalidArgument, "attention out must be bf16");
  expect_rejected([](AttentionParams& p) { p.out.shape[1] = 4 * kHeadDim; },
                  StatusCode::kInvalidArgument, "attention out must have shape");
  expect_rejected([](AttentionParams& p) { p.out.stride[1] = 2; }, StatusCode::kInvalidArgument,
                  "last stride must be 1");
  expect_rejected([](AttentionParams& p) { p.out.stride[0] = 8 * kHeadDim - 8; },
                  StatusCode::kInvalidArgument, "smaller than the row width");
  expect_rejected([](AttentionParams& p) { p.out.stride[0] = 8 * kHeadDim + 4; },
                  StatusCode::kInvalidArgument, "not a multiple of 8");
  expect_rejected([](AttentionParams& p) { p.out.data = static_cast<uint16_t*>(p.out.data) + 4; },
                  StatusCode::kInvalidArgument, "out base address must be 16-byte aligned");
}

TEST_F(AttentionValidation, BatchViews) {
  expect_rejected([](AttentionParams& p) { p.batch.seq_lens.dtype = DType::kF32; },
                  StatusCode::kInvalidArgument, "seq_lens must be i32");
  expect_rejected([](AttentionParams& p) { p.batch.positions.shape[0] = 3; },
                  StatusCode::kInvalidArgument, "positions must have shape");
  expect_rejected([](AttentionParams& p) { p.batch.num_requests = -1; },
                  StatusCode::kInvalidArgument, "negative");
  expect_rejected(
      [](AttentionParams& p) {
        p.batch.num_tokens = int64_t{1} << 31;
        p.batch.positions.shape[0] = int64_t{1} << 31;
      },
      StatusCode::kInvalidArgument, "exceeds the int32 range");
}

TEST_F(AttentionValidation, OneDevice) {
  expect_rejected([](AttentionParams& p) { p.out.device = Device::cuda(0); },
                  StatusCode::kInvalidArgument, "one device");
  expect_rejected([](AttentionParams& p) { p.batch.seq_lens.device = Device::cuda(1); },
                  StatusCode::kInvalidArgument, "one device");
  // Dense ignores block_ids, wherever they are.
  AttentionParams dense = good_;
  dense.sparse = false;
  dense.block_ids.device = Device::cuda(0);
  EXPECT_TRUE(validate_attention(dense).ok()) << validate_attention(dense).to_string();
  auto all_cuda = [](AttentionParams& q) {
    for (TensorView* t : {&q.q, &q.kv_cache, &q.block_ids, &q.out, &q.batch.query_start,
                          &q.batch.positions, &q.batch.seq_lens, &q.batch.page_table})
      t->device = Device::cuda(0);
  };
  AttentionParams p = good_;
  all_cuda(p);
  EXPECT_TRUE(validate_attention(p).ok()) << validate_attention(p).to_string();
  expect_rejected(all_cuda, StatusCode::kInvalidArgument, "host views", /*host_only=*/true);
}

// Contents are checked by the twin only (the launcher cannot read device memory).
TEST_F(AttentionValidation, BatchContents) {
  int32_t* table = hb_.page_table.ptr<int32_t>();
  const int32_t saved = table[0];
  table[0] = static_cast<int32_t>(hb_.num_pages()) + 5;
  EXPECT_TRUE(validate_attention(good_).ok());
  expect_rejected([](AttentionParams&) {}, StatusCode::kInvalidArgument, "outside the pool",
                  /*host_only=*/true);
  table[0] = saved;
  hb_.seq_lens.ptr<int32_t>()[1] = 1;  // 2 query tokens but seq_len 1
  expect_rejected([](AttentionParams&) {}, StatusCode::kInvalidArgument, "seq_len 1",
                  /*host_only=*/true);
}

// o_proj's E4M3 input (out_q / out_scales): both or neither, then the quantize stage's rules; the
// twin's out_q / out_scales are run_quantize_cpu of its own out (padding rows q = 0, scale 1).
TEST_F(AttentionValidation, QuantizedOutput) {
  const int64_t m_pad = (T_ + 3) / 4 * 4 + 4;
  Tensor q8(DType::kE4M3, {m_pad, 8 * kHeadDim});
  Tensor sc(DType::kF32, {m_pad * 8});
  auto with_q = [&](AttentionParams& p) {
    p.out_q = q8.view();
    p.out_scales = TensorView::strided(sc.data(), DType::kF32, {m_pad, 8}, {1, m_pad});
  };
  expect_rejected([&](AttentionParams& p) { p.out_q = q8.view(); }, StatusCode::kInvalidArgument,
                  "both or neither");
  expect_rejected(
      [&](AttentionParams& p) {
        with_q(p);
        p.out_q = TensorView::contiguous(q8.data(), DType::kE4M3, {T_ - 1, 8 * kHeadDim});
      },
      StatusCode::kInvalidArgument, "quantize output");
  expect_rejected(
      [&](AttentionParams& p) {
        with_q(p);
        p.out_q.dtype = DType::kBF16;
      },
      StatusCode::kInvalidArgument, "quantize output");

  M3_SEED_TRACE(seed_);
  AttentionParams p = good_;
  with_q(p);
  std::fill(q8.ptr<uint8_t>(), q8.ptr<uint8_t>() + q8.numel(), uint8_t{0x5A});
  std::fill(sc.ptr<float>(), sc.ptr<float>() + sc.numel(), -3.0f);
  ASSERT_TRUE(run_attention_cpu(p).ok()) << run_attention_cpu(p).to_string();
  Tensor rq(DType::kE4M3, {m_pad, 8 * kHeadDim});
  Tensor rs(DType::kF32, {m_pad * 8});
  QuantizeParams qp;
  qp.rows = T_;
  qp.in = p.out;
  qp.out = rq.view();
  qp.scales = TensorView::strided(rs.data(), DType::kF32, {m_pad, 8}, {1, m_pad});
  ASSERT_TRUE(run_quantize_cpu(qp).ok());
  EXPECT_EQ(std::memcmp(q8.data(), rq.data(), static_cast<size_t>(q8.nbytes())), 0);
  EXPECT_EQ(std::memcmp(sc.data(), rs.data(), static_cast<size_t>(sc.nbytes())), 0);
  for (int64_t r = T_; r < m_pad; ++r) {
    EXPECT_EQ(q8.ptr<uint8_t>()[r * 8 * kHeadDim], 0) << "padding row " << r;
    EXPECT_EQ(sc.ptr<float>()[r], 1.0f) << "padding row " << r;
  }
}

}  // namespace
}  // namespace m3attn
