// The indexer's CPU twin against an independent brute force written here, plus the contract's
// corner cases: ties, NaN, context lengths around block and top-k boundaries, strided pools.
#include "stages/indexer/indexer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <set>
#include <vector>

#include "core/numeric.h"
#include "m3attn/config.h"
#include "support/batch_builder.h"
#include "support/test_util.h"

namespace m3attn {
namespace {

using testing::BatchOptions;
using testing::build_batch;
using testing::CacheFill;
using testing::HostBatch;
using testing::RequestSpec;
using testing::Rng;

constexpr int32_t kPoison = 0x5a5a5a5a;
constexpr int kGuard = 64;  // int32 guard entries after the output

// Index-Q, an output buffer with a guard tail, and the params over them.
struct IndexerRun {
  Tensor iq;   // e4m3 [T, n_kv, 128]
  Tensor ids;  // i32 [T * n_kv * 16 + kGuard]
  IndexerParams params;

  const int32_t* row(int64_t t, int h) const {
    return ids.ptr<int32_t>() + (t * params.n_kv + h) * kTopK;
  }
};

IndexerRun make_run(const HostBatch& hb, Rng& rng, CacheFill fill = CacheFill::kNormal, int lo = -3,
                    int hi = 3) {
  IndexerRun run;
  const int64_t T = hb.num_tokens();
  run.iq = Tensor(DType::kE4M3, {T, hb.n_kv(), kHeadDim});
  if (fill == CacheFill::kIntegers)
    testing::fill_e4m3_integers(run.iq, rng, lo, hi);
  else if (fill == CacheFill::kZero)
    run.iq.fill_bytes(0);
  else
    testing::fill_e4m3_normal(run.iq, rng);
  run.ids = Tensor(DType::kI32, {T * hb.n_kv() * kTopK + kGuard});
  std::fill(run.ids.ptr<int32_t>(), run.ids.ptr<int32_t>() + run.ids.numel(), kPoison);
  run.params.n_kv = hb.n_kv();
  run.params.top_k = kTopK;
  run.params.index_q = run.iq.view();
  run.params.index_cache = hb.index_cache();
  run.params.batch = hb.batch_view();
  run.params.block_ids =
      TensorView::contiguous(run.ids.data(), DType::kI32, {T, int64_t{hb.n_kv()}, int64_t{kTopK}});
  return run;
}

// Brute force, independent of the twin: every key's score through the builder's own addressing,
// exact in double and rounded once to fp32; NaN-propagating block max.
std::vector<float> brute_block_scores(const HostBatch& hb, const Tensor& iq, int64_t t, int h) {
  const int r = hb.request_of(t);
  const int pos = hb.position_of(t);
  const uint8_t* q = iq.ptr<uint8_t>() + (t * hb.n_kv() + h) * kHeadDim;
  std::vector<float> best(static_cast<size_t>(pos / kPageSize + 1),
                          -std::numeric_limits<float>::infinity());
  std::vector<bool> nan(best.size(), false);
  const std::vector<double>& value = testing::e4m3_values();
  for (int p = 0; p <= pos; ++p) {
    const uint8_t* k = hb.index_row(r, p);
    double s = 0.0;
    for (int d = 0; d < kHeadDim; ++d) s += value[q[d]] * value[k[d]];
    const float f = static_cast<float>(s);
    const size_t b = static_cast<size_t>(p / kPageSize);
    if (std::isnan(f)) nan[b] = true;
    if (f > best[b]) best[b] = f;
  }
  for (size_t b = 0; b < best.size(); ++b)
    if (nan[b]) best[b] = std::numeric_limits<float>::quiet_NaN();
  return best;
}

// Selection by full sort of all blocks: local first, then (score desc, id asc) among non-NaN.
std::vector<int32_t> brute_select(const std::vector<float>& scores) {
  const int n_valid = static_cast<int>(scores.size());
  std::vector<int32_t> chosen;
  if (n_valid <= kTopK) {
    for (int b = 0; b < n_valid; ++b) chosen.push_back(b);
  } else {
    std::vector<int32_t> order;
    for (int b = 0; b + 1 < n_valid; ++b)
      if (!std::isnan(scores[b])) order.push_back(b);
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return scores[a] > scores[b]; });
    chosen.push_back(n_valid - 1);
    for (size_t i = 0; i < order.size() && chosen.size() < static_cast<size_t>(kTopK); ++i)
      chosen.push_back(order[i]);
    std::sort(chosen.begin(), chosen.end());
  }
  chosen.resize(kTopK, -1);
  return chosen;
}

std::string row_string(const int32_t* row) {
  std::string s = "[";
  for (int i = 0; i < kTopK; ++i) s += (i ? " " : "") + std::to_string(row[i]);
  return s + "]";
}

// Runs the twin and checks every token and head: the contract's invariants, equality with the
// brute force, verify_block_selection at tolerance 0, and the untouched guard.
void run_and_check(const HostBatch& hb, IndexerRun& run) {
  const Status st = run_indexer_cpu(run.params);
  ASSERT_TRUE(st.ok()) << st.to_string();
  const int64_t T = hb.num_tokens();
  for (int64_t t = 0; t < T; ++t) {
    const int pos = hb.position_of(t);
    const int n_valid = pos / kPageSize + 1;
    for (int h = 0; h < hb.n_kv(); ++h) {
      SCOPED_TRACE(::testing::Message() << "token " << t << " pos " << pos << " head " << h);
      const int32_t* row = run.row(t, h);
      const std::vector<float> scores = brute_block_scores(hb, run.iq, t, h);
      bool any_nan = false;
      for (float s : scores) any_nan |= std::isnan(s);
      int count = 0;
      while (count < kTopK && row[count] >= 0) ++count;
      for (int i = count; i < kTopK; ++i) ASSERT_EQ(row[i], -1) << row_string(row);
      for (int i = 0; i < count; ++i) {
        ASSERT_LT(row[i], n_valid) << row_string(row);
        if (i) {
          ASSERT_GT(row[i], row[i - 1]) << row_string(row);
        }
      }
      ASSERT_TRUE(std::binary_search(row, row + count, n_valid - 1)) << row_string(row);
      if (!any_nan) {
        ASSERT_EQ(count, std::min(kTopK, n_valid)) << row_string(row);
      }
      const std::vector<int32_t> want = brute_select(scores);
      ASSERT_TRUE(std::equal(want.begin(), want.end(), row))
          << "twin " << row_string(row) << " brute force " << row_string(want.data());
      const Status v = verify_block_selection(scores.data(), n_valid, row, 0.0f);
      ASSERT_TRUE(v.ok()) << v.to_string();
    }
  }
  const int32_t* guard = run.ids.ptr<int32_t>() + T * hb.n_kv() * kTopK;
  for (int i = 0; i < kGuard; ++i) ASSERT_EQ(guard[i], kPoison) << "guard entry " << i;
}

TEST(Indexer, MixedBatchMatchesBruteForce) {
  const uint64_t seed = testing::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  // Context chunks (one starting from scratch, some continuing a cached prefix across block and
  // top-k boundaries), then generation requests with drafts.
  std::vector<RequestSpec> reqs = {{0, 200}, {2040, 20}, {4900, 37}, {129, 1}};
  reqs = testing::mixed_requests(reqs, 5, 3, 5000, rng);
  BatchOptions o;
  o.n_kv = 2;
  const HostBatch hb = build_batch(reqs, o, rng);
  ASSERT_FALSE(::testing::Test::HasFailure());
  SCOPED_TRACE(testing::describe_requests(reqs));
  IndexerRun run = make_run(hb, rng);
  const Tensor pool_before = hb.index_pool.clone();
  run_and_check(hb, run);
  EXPECT_EQ(std::memcmp(pool_before.data(), hb.index_pool.data(), hb.index_pool.nbytes()), 0)
      << "the indexer wrote into the index cache";

  // Deterministic: a second run gives the same bytes.
  const Tensor first = run.ids.clone();
  std::fill(run.ids.ptr<int32_t>(), run.ids.ptr<int32_t>() + run.ids.numel(), kPoison);
  ASSERT_TRUE(run_indexer_cpu(run.params).ok());
  EXPECT_EQ(std::memcmp(first.data(), run.ids.data(), first.nbytes()), 0);
}

TEST(Indexer, SingleHeadGenerationOnly) {
  const uint64_t seed = testing::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const std::vector<RequestSpec> reqs = testing::mixed_requests({}, 6, 7, 4200, rng);
  BatchOptions o;
  o.n_kv = 1;
  o.stddev = 2.0f;
  const HostBatch hb = build_batch(reqs, o, rng);
  ASSERT_FALSE(::testing::Test::HasFailure());
  SCOPED_TRACE(testing::describe_requests(reqs));
  IndexerRun run = make_run(hb, rng);
  run_and_check(hb, run);
}

// Context lengths around the block size and the top-k boundary (16 blocks = 2048 tokens): the
// last few tokens of each, and whole prefills of the short ones.
TEST(Indexer, ContextLengthsAroundBoundaries) {
  const uint64_t seed = testing::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  std::vector<RequestSpec> reqs;
  for (int len : {1, 127, 128, 129}) reqs.push_back({0, len});
  for (int len : {2047, 2048, 2049, 2177, 2176}) reqs.push_back({len - 3, 3});
  reqs.push_back({2040, 10});  // crosses 2048: n_valid 16 -> 17 inside the chunk
  BatchOptions o;
  o.n_kv = 2;
  const HostBatch hb = build_batch(reqs, o, rng);
  ASSERT_FALSE(::testing::Test::HasFailure());
  IndexerRun run = make_run(hb, rng);
  run_and_check(hb, run);
  // Spot checks of the exact rows: position 0 selects {0}; position 2048 (17 blocks) drops one.
  EXPECT_EQ(run.row(0, 0)[0], 0);
  EXPECT_EQ(run.row(0, 0)[1], -1);
  for (int64_t t = 0; t < hb.num_tokens(); ++t) {
    const int pos = hb.position_of(t);
    const int32_t* row = run.row(t, 1);
    if (pos < 2048) {
      for (int i = 0; i < kTopK; ++i) EXPECT_EQ(row[i], i <= pos / kPageSize ? i : -1) << pos;
    } else {
      EXPECT_EQ(row[kTopK - 1], pos / kPageSize) << pos;  // full row, local block last
    }
  }
}

// Integer-valued inputs make every score an exact small integer, so there are many exact ties;
// the twin's block scores must equal the brute force's exactly.
TEST(Indexer, IntegerInputsAreExactWithManyTies) {
  const uint64_t seed = testing::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const std::vector<RequestSpec> reqs = {{3000, 5}, {4500, 2}, {2100, 1}, {0, 60}};
  BatchOptions o;
  o.n_kv = 2;
  o.fill = CacheFill::kIntegers;
  o.int_lo = -1;
  o.int_hi = 1;
  const HostBatch hb = build_batch(reqs, o, rng);
  ASSERT_FALSE(::testing::Test::HasFailure());
  IndexerRun run = make_run(hb, rng, CacheFill::kIntegers, -1, 1);
  run_and_check(hb, run);

  const int max_blocks = 4507 / kPageSize + 1;
  Tensor scores(DType::kF32, {hb.num_tokens(), 2, max_blocks});
  const Status st = indexer_block_scores_cpu(run.params, scores.view());
  ASSERT_TRUE(st.ok()) << st.to_string();
  int tied_rows = 0;
  for (int64_t t = 0; t < hb.num_tokens(); ++t)
    for (int h = 0; h < 2; ++h) {
      const std::vector<float> want = brute_block_scores(hb, run.iq, t, h);
      const float* got = scores.ptr<float>() + (t * 2 + h) * max_blocks;
      for (size_t b = 0; b < want.size(); ++b) {
        ASSERT_EQ(got[b], want[b]) << "token " << t << " head " << h << " block " << b;
        ASSERT_EQ(got[b], std::round(got[b])) << "integer inputs must give integer scores";
      }
      for (size_t b = want.size(); b < static_cast<size_t>(max_blocks); ++b)
        ASSERT_EQ(got[b], -std::numeric_limits<float>::infinity());
      std::set<float> distinct(want.begin(), want.end());
      tied_rows += distinct.size() < want.size() ? 1 : 0;
    }
  EXPECT_GT(tied_rows, 0) << "the test meant to exercise ties but drew none";
}

// Constructed equal block maxima: ties go to the smaller id.
TEST(Indexer, ExactTiesGoToTheSmallerId) {
  const uint64_t seed = testing::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const int pos = 30 * kPageSize - 1;  // 30 visible blocks, local block 29
  BatchOptions o;
  o.n_kv = 1;
  o.fill = CacheFill::kZero;
  HostBatch hb = build_batch({{pos, 1}}, o, rng);
  ASSERT_FALSE(::testing::Test::HasFailure());
  IndexerRun run = make_run(hb, rng, CacheFill::kZero);
  run.iq.ptr<uint8_t>()[0] = float_to_e4m3(1.0f);  // score = ik[p][0]

  // Every block's maximum is 2 (at a random row), except a few higher ones; negative values
  // elsewhere so the maximum is where we put it.
  auto set_block = [&](int b, float top) {
    for (int i = 0; i < kPageSize; ++i)
      hb.index_row(0, b * kPageSize + i)[0] = float_to_e4m3(-1.0f);
    hb.index_row(0, b * kPageSize + static_cast<int>(rng.integer(0, kPageSize - 1)))[0] =
        float_to_e4m3(top);
  };
  for (int b = 0; b < 30; ++b) set_block(b, 2.0f);
  set_block(11, 4.0f);
  for (int b : {5, 7, 20}) set_block(b, 3.0f);
  run_and_check(hb, run);
  const std::vector<int32_t> want = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 20, 29};
  EXPECT_TRUE(std::equal(want.begin(), want.end(), run.row(0, 0))) << row_string(run.row(0, 0));

  // All blocks equal (all-zero keys): the local block and the 15 smallest ids.
  for (int p = 0; p <= pos; ++p) hb.index_row(0, p)[0] = 0;
  std::fill(run.ids.ptr<int32_t>(), run.ids.ptr<int32_t>() + run.ids.numel(), kPoison);
  run_and_check(hb, run);
  for (int i = 0; i < kTopK; ++i) EXPECT_EQ(run.row(0, 0)[i], i == 15 ? 29 : i);
}

// NaN in the index cache (E4M3 0x7F) makes its block's score NaN: never chosen, except the
// forced local block; NaN index-Q leaves only the local block; with <= 16 visible blocks every
// block is selected regardless.
TEST(Indexer, NaNBlocksAreNeverChosenButTheLocalBlockIs) {
  const uint64_t seed = testing::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const std::vector<RequestSpec> reqs = {{3000, 2}, {1500, 1}, {3500, 1}};
  BatchOptions o;
  o.n_kv = 2;
  HostBatch hb = build_batch(reqs, o, rng);
  ASSERT_FALSE(::testing::Test::HasFailure());
  IndexerRun run = make_run(hb, rng);
  run_and_check(hb, run);

  // Poison one key in five blocks the clean run chose for token 0 head 0, and one in the local
  // block of request 0.
  std::vector<int> poisoned;
  for (int i = 0; i < kTopK && poisoned.size() < 5; ++i)
    if (run.row(0, 0)[i] != 3000 / kPageSize) poisoned.push_back(run.row(0, 0)[i]);
  for (int b : poisoned)
    hb.index_row(0, b * kPageSize + static_cast<int>(rng.integer(0, kPageSize - 1)))[7] = 0x7f;
  hb.index_row(0, 3000 / kPageSize * kPageSize + 3)[0] = 0xff;  // -NaN in the local block
  // Request 1 has 12 visible blocks: a NaN block there is still selected.
  hb.index_row(1, 5 * kPageSize + 9)[100] = 0x7f;
  // Request 2: every block but the local one poisoned -> only the local block.
  for (int b = 0; b < 3500 / kPageSize; ++b) hb.index_row(2, b * kPageSize + 64)[1] = 0x7f;
  // Token 1 (request 0), head 1: NaN index-Q -> every score NaN -> only the local block.
  run.iq.ptr<uint8_t>()[(1 * 2 + 1) * kHeadDim + 17] = 0x7f;

  std::fill(run.ids.ptr<int32_t>(), run.ids.ptr<int32_t>() + run.ids.numel(), kPoison);
  run_and_check(hb, run);
  const int32_t* row = run.row(0, 0);
  for (int b : poisoned) EXPECT_FALSE(std::binary_search(row, row + kTopK, b)) << b;
  EXPECT_EQ(row[kTopK - 1], 3000 / kPageSize) << row_string(row);  // full row, local kept
  EXPECT_EQ(run.row(1, 1)[0], 3001 / kPageSize);
  EXPECT_EQ(run.row(1, 1)[1], -1);
  for (int i = 0; i < kTopK; ++i) EXPECT_EQ(run.row(2, 0)[i], i < 12 ? i : -1);
  EXPECT_EQ(run.row(3, 0)[0], 3500 / kPageSize);
  EXPECT_EQ(run.row(3, 0)[1], -1);
}

// Blocks past the token's own are never visible, however high their scores (a chunk's later
// tokens own them).
TEST(Indexer, LaterBlocksOfAChunkAreInvisibleToEarlierTokens) {
  const uint64_t seed = testing::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  BatchOptions o;
  o.n_kv = 1;
  HostBatch hb = build_batch({{2100, 300}}, o, rng);  // positions 2100 .. 2399, blocks 16 .. 18
  ASSERT_FALSE(::testing::Test::HasFailure());
  IndexerRun run = make_run(hb, rng, CacheFill::kZero);
  for (int d = 0; d < kHeadDim; ++d) run.iq.ptr<uint8_t>()[d] = float_to_e4m3(1.0f);
  for (int64_t t = 1; t < hb.num_tokens(); ++t)
    std::memcpy(run.iq.ptr<uint8_t>() + t * kHeadDim, run.iq.ptr<uint8_t>(), kHeadDim);
  for (int p = 17 * kPageSize; p < 2400; ++p)
    for (int d = 0; d < kHeadDim; ++d) hb.index_row(0, p)[d] = float_to_e4m3(448.0f);
  run_and_check(hb, run);
  for (int64_t t = 0; t < hb.num_tokens(); ++t) {
    const int pos = hb.position_of(t);
    const int32_t* row = run.row(t, 0);
    if (pos < 17 * kPageSize) {
      EXPECT_FALSE(std::binary_search(row, row + kTopK, 17)) << pos;
    }
    if (pos >= 18 * kPageSize) {
      EXPECT_TRUE(std::binary_search(row, row + kTopK, 17)) << pos;
    }
  }
}

// Strided pools (index page stride x3) with the same logical content give the same ids.
TEST(Indexer, StridedIndexPoolGivesTheSameIds) {
  const uint64_t seed = testing::fresh_seed();
  M3_SEED_TRACE(seed);
  const std::vector<RequestSpec> reqs = {{2500, 4}, {300, 2}, {4000, 1}};
  BatchOptions o;
  o.n_kv = 2;
  Rng rng_a(seed), rng_b(seed);
  const HostBatch a = build_batch(reqs, o, rng_a);
  o.index_page_stride = 3 * kPageSize * kHeadDim + 36;
  const HostBatch b = build_batch(reqs, o, rng_b);
  ASSERT_FALSE(::testing::Test::HasFailure());
  IndexerRun ra = make_run(a, rng_a);
  IndexerRun rb = make_run(b, rng_b);
  ASSERT_EQ(std::memcmp(ra.iq.data(), rb.iq.data(), ra.iq.nbytes()), 0);
  run_and_check(a, ra);
  run_and_check(b, rb);
  EXPECT_EQ(std::memcmp(ra.ids.data(), rb.ids.data(), ra.ids.nbytes()), 0);
}

TEST(Indexer, EmptyBatchIsANoOp) {
  Rng rng(1);
  BatchOptions o;
  o.n_kv = 2;
  const HostBatch hb = build_batch({}, o, rng);
  ASSERT_FALSE(::testing::Test::HasFailure());
  IndexerRun run = make_run(hb, rng);
  const Status st = run_indexer_cpu(run.params);
  ASSERT_TRUE(st.ok()) << st.to_string();
  for (int i = 0; i < kGuard; ++i) EXPECT_EQ(run.ids.ptr<int32_t>()[i], kPoison);
}

// select_blocks_ref and verify_block_selection on hand-made score rows.
TEST(IndexerSelection, SelectAndVerifyOnHandMadeRows) {
  std::vector<float> s(20);
  for (int b = 0; b < 20; ++b) s[b] = static_cast<float>(b % 7);
  s[3] = std::numeric_limits<float>::quiet_NaN();
  s[18] = 0.0f;  // score 0 at 0, 7, 14, 18: one of them makes the cut
  int32_t ids[kTopK];
  select_blocks_ref(s.data(), 20, ids);
  // Local 19; 14 others score >= 1, and the tie at 0 between 0, 7, 14, 18 goes to 0.
  const std::vector<int32_t> want = {0, 1, 2, 4, 5, 6, 8, 9, 10, 11, 12, 13, 15, 16, 17, 19};
  EXPECT_TRUE(std::equal(want.begin(), want.end(), ids)) << row_string(ids);
  EXPECT_TRUE(verify_block_selection(s.data(), 20, ids, 0.0f).ok());

  auto expect_bad = [&](std::vector<int32_t> row, float tol, const char* needle) {
    row.resize(kTopK, -1);
    const Status st = verify_block_selection(s.data(), 20, row.data(), tol);
    EXPECT_FALSE(st.ok()) << needle;
    EXPECT_NE(st.message().find(needle), std::string::npos) << st.message();
  };
  // Tie broken toward the larger id (14 instead of 0, both score 0).
  expect_bad({1, 2, 4, 5, 6, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 19}, 0.0f, "smaller id");
  // ... which a tolerance accepts.
  std::vector<int32_t> swapped = {1, 2, 4, 5, 6, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 19};
  EXPECT_TRUE(verify_block_selection(s.data(), 20, swapped.data(), 0.5f).ok());
  expect_bad({0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13, 15, 16, 19}, 0.0f, "NaN");
  expect_bad({0, 1, 2, 4, 5, 6, 8, 9, 10, 11, 12, 13, 15, 16, 17, 18}, 0.0f, "local block");
  expect_bad({1, 0, 2, 4, 5, 6, 8, 9, 10, 11, 12, 13, 15, 16, 17, 19}, 0.0f, "ascend");
  expect_bad({0, 1, 2, 4, 5, 6, 8, 9, 10, 11, 12, 13, 15, 16, 19}, 0.0f, "expected 16");
  expect_bad({0, 1, 2, 4, 5, 6, 8, 9, 10, 11, 12, 13, 15, 16, 17, 20}, 0.0f, "outside");
  std::vector<int32_t> hole = want;
  hole[3] = -1;
  expect_bad(hole, 0.0f, "padding");
  // Low score chosen over a higher one beyond the tolerance.
  expect_bad({0, 1, 2, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 15, 16, 19}, 0.5f, "over block");

  // n_valid <= 16: everything, NaN or not.
  select_blocks_ref(s.data(), 5, ids);
  for (int i = 0; i < kTopK; ++i) EXPECT_EQ(ids[i], i < 5 ? i : -1);
  EXPECT_TRUE(verify_block_selection(s.data(), 5, ids, 0.0f).ok());
  ids[3] = -1;
  ids[4] = -1;
  EXPECT_FALSE(verify_block_selection(s.data(), 5, ids, 0.0f).ok());
}

}  // namespace
}  // namespace m3attn
