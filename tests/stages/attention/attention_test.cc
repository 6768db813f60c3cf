// The attention twin against an independent fp64 reference written here, and the properties the
// contract promises: sparse == dense when every visible block is selected (bit for bit in the
// twin), the causal mask inside the local block, drafts seeing only earlier drafts, GQA head
// mapping, strided pools, set semantics of block ids, rows independent of batching.
//
// Tolerance: the twin computes in double and rounds once to BF16 (8 significant bits). Against a
// double reference the only error is that rounding, at most half a BF16 step = 2^-8 |x| per
// element, so the relative L2 error is <= 2^-8 as well. The check is sharper still: each element
// must equal the round-to-nearest-even BF16 of the reference, except where the reference lies
// within 1e-9 of a rounding midpoint (there the two double computations may legitimately round
// differently), where one BF16 step is allowed.
#include "stages/attention/attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "core/numeric.h"
#include "m3attn/config.h"
#include "stages/indexer/indexer.h"
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

constexpr uint16_t kPoison = 0xffff;  // a BF16 NaN
constexpr int64_t kGuard = 256;       // BF16 guard elements after the last row
constexpr int64_t kRowPad = 24;       // extra BF16 elements per output row (stride stays 8-aligned)

struct AttnRun {
  int n_q = 0;
  Tensor q;    // e4m3 [T, n_q, 128]
  Tensor ids;  // i32 [T, n_kv, 16]
  Tensor out;  // bf16 [T * row_stride + kGuard]
  int64_t row_stride = 0;
  AttentionParams params;

  uint16_t* out_row(int64_t t) { return out.ptr<uint16_t>() + t * row_stride; }
  const uint16_t* out_row(int64_t t) const { return out.ptr<uint16_t>() + t * row_stride; }
  int32_t* ids_row(int64_t t, int g) { return ids.ptr<int32_t>() + (t * params.n_kv + g) * kTopK; }
  const int32_t* ids_row(int64_t t, int g) const {
    return ids.ptr<int32_t>() + (t * params.n_kv + g) * kTopK;
  }
  void poison() { std::fill(out.ptr<uint16_t>(), out.ptr<uint16_t>() + out.numel(), kPoison); }
};

AttnRun make_run(const HostBatch& hb, int n_q, bool sparse, Rng& rng) {
  AttnRun run;
  const int64_t T = hb.num_tokens();
  const int n_kv = hb.n_kv();
  run.n_q = n_q;
  run.q = Tensor(DType::kE4M3, {T, n_q, kHeadDim});
  testing::fill_e4m3_normal(run.q, rng, 1.5f);
  run.ids = Tensor(DType::kI32, {T, n_kv, kTopK});
  std::fill(run.ids.ptr<int32_t>(), run.ids.ptr<int32_t>() + run.ids.numel(), -1);
  run.row_stride = int64_t{n_q} * kHeadDim + kRowPad;
  run.out = Tensor(DType::kBF16, {T * run.row_stride + kGuard});
  run.poison();
  AttentionParams& p = run.params;
  p.n_q = n_q;
  p.n_kv = n_kv;
  p.sparse = sparse;
  p.q = run.q.view();
  p.kv_cache = hb.kv_cache();
  p.block_ids = run.ids.view();
  p.batch = hb.batch_view();
  p.out = TensorView::strided(run.out.data(), DType::kBF16, {T, int64_t{n_q} * kHeadDim},
                              {run.row_stride, 1});
  return run;
}

// Block ids from the indexer twin over fresh index-Q (what a sparse layer really sees).
void select_with_indexer(const HostBatch& hb, AttnRun& run, Rng& rng) {
  Tensor iq(DType::kE4M3, {hb.num_tokens(), hb.n_kv(), kHeadDim});
  testing::fill_e4m3_normal(iq, rng);
  IndexerParams ip;
  ip.n_kv = hb.n_kv();
  ip.index_q = iq.view();
  ip.index_cache = hb.index_cache();
  ip.batch = hb.batch_view();
  ip.block_ids = run.ids.view();
  const Status st = run_indexer_cpu(ip);
  ASSERT_TRUE(st.ok()) << st.to_string();
}

// Random selections that exercise the set semantics: the local block, a random subset of the
// other visible blocks, in random slots, with -1 gaps, duplicates, other negative ids and ids of
// blocks past the token's own (which must be ignored).
void select_randomly(const HostBatch& hb, AttnRun& run, Rng& rng) {
  for (int64_t t = 0; t < hb.num_tokens(); ++t) {
    const int n_valid = hb.position_of(t) / kPageSize + 1;
    for (int g = 0; g < hb.n_kv(); ++g) {
      std::vector<int32_t> blocks(static_cast<size_t>(n_valid - 1));
      std::iota(blocks.begin(), blocks.end(), 0);
      std::shuffle(blocks.begin(), blocks.end(), rng.engine());
      const int others = static_cast<int>(rng.integer(0, std::min(n_valid - 1, kTopK - 4)));
      std::vector<int32_t> row(blocks.begin(), blocks.begin() + others);
      row.push_back(n_valid - 1);
      if (others > 0) row.push_back(row[0]);                             // duplicate
      row.push_back(n_valid + static_cast<int32_t>(rng.integer(0, 3)));  // a later block
      row.push_back(-7);
      row.resize(kTopK, -1);
      std::shuffle(row.begin(), row.end(), rng.engine());
      std::copy(row.begin(), row.end(), run.ids_row(t, g));
    }
  }
}

// Independent fp64 reference: [T][n_q][128]. Keys are taken straight from the definition: every
// p <= pos whose block appears among the token's ids (any order, ids >= n_valid select nothing).
std::vector<double> reference(const HostBatch& hb, const AttnRun& run, double scale) {
  const std::vector<double>& val = testing::e4m3_values();
  const int64_t T = hb.num_tokens();
  const int n_q = run.n_q, group = n_q / hb.n_kv();
  std::vector<double> out(static_cast<size_t>(T * n_q * kHeadDim), 0.0);
  std::vector<double> logit;
  for (int64_t t = 0; t < T; ++t) {
    const int r = hb.request_of(t), pos = hb.position_of(t);
    for (int j = 0; j < n_q; ++j) {
      const int g = j / group;
      const uint8_t* q = run.q.ptr<uint8_t>() + (t * n_q + j) * kHeadDim;
      std::vector<int> keys;
      for (int p = 0; p <= pos; ++p) {
        bool visible = !run.params.sparse;
        for (int i = 0; i < kTopK && !visible; ++i) visible = run.ids_row(t, g)[i] == p / kPageSize;
        if (visible) keys.push_back(p);
      }
      if (keys.empty()) continue;
      logit.assign(keys.size(), 0.0);
      double m = -INFINITY;
      for (size_t i = 0; i < keys.size(); ++i) {
        const uint8_t* k = hb.kv_row(r, keys[i], 0, g);
        double dot = 0.0;
        for (int d = 0; d < kHeadDim; ++d) dot += val[q[d]] * val[k[d]];
        logit[i] = dot * scale;
        m = std::max(m, logit[i]);
      }
      double denom = 0.0;
      double* o = out.data() + (t * n_q + j) * kHeadDim;
      for (size_t i = 0; i < keys.size(); ++i) {
        const double w = std::exp(logit[i] - m);
        denom += w;
        const uint8_t* v = hb.kv_row(r, keys[i], 1, g);
        for (int d = 0; d < kHeadDim; ++d) o[d] += w * val[v[d]];
      }
      for (int d = 0; d < kHeadDim; ++d) o[d] /= denom;
    }
  }
  return out;
}

// Round to nearest even with 8 significant bits; `near_tie` when x is within 1e-9 (relative to a
// step) of a midpoint.
double round_bf16(double x, bool* near_tie) {
  *near_tie = false;
  if (x == 0.0) return 0.0;
  int e;
  std::frexp(x, &e);
  const double scaled = std::ldexp(x, 8 - e);  // |scaled| in [128, 256)
  const double frac = std::fabs(scaled - std::trunc(scaled));
  *near_tie = std::fabs(frac - 0.5) < 1e-9;
  return std::ldexp(std::nearbyint(scaled), e - 8);
}

// Every element against the reference (see the file comment), guards and row gaps untouched.
void expect_matches(const AttnRun& run, const std::vector<double>& ref) {
  const int64_t T = run.params.batch.num_tokens;
  const int64_t width = int64_t{run.n_q} * kHeadDim;
  double err2 = 0.0, ref2 = 0.0;
  int64_t bad = 0;
  for (int64_t t = 0; t < T; ++t) {
    const uint16_t* row = run.out_row(t);
    for (int64_t i = 0; i < width; ++i) {
      const double want = ref[t * width + i];
      const double got = bf16_to_float(row[i]);
      bool near_tie = false;
      const double rounded = round_bf16(want, &near_tie);
      err2 += (got - want) * (got - want);
      ref2 += want * want;
      const bool ok =
          near_tie ? std::fabs(got - want) <= std::ldexp(std::fabs(want), -7) : got == rounded;
      if (!ok && bad++ < 5)
        ADD_FAILURE() << "token " << t << " element " << i << ": got " << got << " want " << want
                      << " (bf16 " << rounded << ")";
    }
    for (int64_t i = width; i < run.row_stride; ++i)
      ASSERT_EQ(row[i], kPoison) << "row gap written, token " << t << " column " << i;
  }
  EXPECT_EQ(bad, 0) << "elements off the rounded reference";
  const uint16_t* guard = run.out.ptr<uint16_t>() + T * run.row_stride;
  for (int64_t i = 0; i < kGuard; ++i) ASSERT_EQ(guard[i], kPoison) << "guard " << i;
  const double rel_l2 = ref2 > 0.0 ? std::sqrt(err2 / ref2) : std::sqrt(err2);
  EXPECT_LE(rel_l2, std::ldexp(1.0, -8)) << "relative L2 error above BF16 rounding";
  ::testing::Test::RecordProperty("rel_l2", std::to_string(rel_l2));
}

void run_ok(AttnRun& run) {
  run.poison();
  const Status st = run_attention_cpu(run.params);
  ASSERT_TRUE(st.ok()) << st.to_string();
}

bool rows_equal(const AttnRun& a, int64_t ta, const AttnRun& b, int64_t tb) {
  return std::memcmp(a.out_row(ta), b.out_row(tb), static_cast<size_t>(a.n_q) * kHeadDim * 2) == 0;
}

TEST(Attention, DenseMixedBatchMatchesFp64Reference) {
  const uint64_t seed = testing::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const std::vector<RequestSpec> reqs =
      testing::mixed_requests({{0, 150}, {1500, 12}, {4700, 5}}, 4, 3, 5000, rng);
  SCOPED_TRACE(testing::describe_requests(reqs));
  BatchOptions o;
  o.n_kv = 2;
  const HostBatch hb = build_batch(reqs, o, rng);
  ASSERT_FALSE(::testing::Test::HasFailure());
  AttnRun run = make_run(hb, 8, /*sparse=*/false, rng);
  const Tensor pool_before = hb.kv_pool.clone();
  run_ok(run);
  expect_matches(run, reference(hb, run, 1.0 / std::sqrt(128.0)));
  EXPECT_EQ(std::memcmp(pool_before.data(), hb.kv_pool.data(), hb.kv_pool.nbytes()), 0)
      << "attention wrote into the KV cache";
}

TEST(Attention, SparseRandomSelectionsMatchFp64Reference) {
  const uint64_t seed = testing::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const std::vector<RequestSpec> reqs =
      testing::mixed_requests({{2100, 20}, {0, 300}, {3900, 3}}, 3, 1, 5000, rng);
  SCOPED_TRACE(testing::describe_requests(reqs));
  BatchOptions o;
  o.n_kv = 2;
  const HostBatch hb = build_batch(reqs, o, rng);
  ASSERT_FALSE(::testing::Test::HasFailure());
  AttnRun run = make_run(hb, 8, /*sparse=*/true, rng);
  select_randomly(hb, run, rng);
  run_ok(run);
  expect_matches(run, reference(hb, run, 1.0 / std::sqrt(128.0)));

  // Selections written from the indexer (ascending, -1 padded) give the same agreement.
  select_with_indexer(hb, run, rng);
  run_ok(run);
  expect_matches(run, reference(hb, run, 1.0 / std::sqrt(128.0)));
}

TEST(Attention, SoftmaxScaleIsApplied) {
  const uint64_t seed = testing::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  BatchOptions o;
  o.n_kv = 1;
  const HostBatch hb = build_batch({{700, 9}, {3000, 2}}, o, rng);
  ASSERT_FALSE(::testing::Test::HasFailure());
  AttnRun run = make_run(hb, 4, /*sparse=*/true, rng);
  select_with_indexer(hb, run, rng);
  run.params.softmax_scale = 0.3f;
  run_ok(run);
  expect_matches(run, reference(hb, run, double{0.3f}));
  // Scale 0 is the default 1/sqrt(128), not a zero scale.
  const Tensor scaled = run.out.clone();
  run.params.softmax_scale = 0.0f;
  run_ok(run);
  expect_matches(run, reference(hb, run, 1.0 / std::sqrt(128.0)));
  EXPECT_NE(std::memcmp(scaled.data(), run.out.data(), scaled.nbytes()), 0);
}

// Generation requests with 1 + draft_len tokens after a context chunk: every draft is a query of
// its own position, and draft i sees drafts <= i only.
class AttentionDrafts : public ::testing::TestWithParam<int> {};

TEST_P(AttentionDrafts, MixedStepWithDraftsMatchesReference) {
  const int draft_len = GetParam();
  const uint64_t seed = testing::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const std::vector<RequestSpec> reqs =
      testing::mixed_requests({{1800, 33}}, 5, draft_len, 4800, rng);
  SCOPED_TRACE(testing::describe_requests(reqs));
  BatchOptions o;
  o.n_kv = 1;
  HostBatch hb = build_batch(reqs, o, rng);
  ASSERT_FALSE(::testing::Test::HasFailure());
  AttnRun run = make_run(hb, 4, /*sparse=*/true, rng);
  select_with_indexer(hb, run, rng);
  run_ok(run);
  expect_matches(run, reference(hb, run, 1.0 / std::sqrt(128.0)));
  if (draft_len == 0) return;

  // Overwrite the K/V of every generation request's last draft: only that token's row changes.
  const Tensor before = run.out.clone();
  std::vector<char> last(static_cast<size_t>(hb.num_tokens()), 0);
  for (int r = 1; r < hb.num_requests(); ++r) {
    const int pos = hb.seq_len(r) - 1;
    uint8_t* k = hb.kv_row(r, pos, 0, 0);
    uint8_t* v = hb.kv_row(r, pos, 1, 0);
    for (int d = 0; d < kHeadDim; ++d) {
      k[d] = float_to_e4m3(run.q.ptr<uint8_t>()[d] & 0x80 ? -8.0f : 8.0f);
      v[d] = float_to_e4m3(100.0f);
    }
    last[static_cast<size_t>(hb.query_start.ptr<int32_t>()[r + 1] - 1)] = 1;
  }
  run_ok(run);
  const size_t row_bytes = size_t{4} * kHeadDim * 2;
  for (int64_t t = 0; t < hb.num_tokens(); ++t) {
    const bool same =
        std::memcmp(before.ptr<uint16_t>() + t * run.row_stride, run.out_row(t), row_bytes) == 0;
    EXPECT_EQ(same, !last[static_cast<size_t>(t)]) << "token " << t;
  }
  expect_matches(run, reference(hb, run, 1.0 / std::sqrt(128.0)));
}

INSTANTIATE_TEST_SUITE_P(DraftLengths, AttentionDrafts, ::testing::Values(0, 1, 3, 7));

// With <= 16 visible blocks the indexer selects every block, and sparse equals dense bit for bit;
// beyond 16 the sparse rows really differ (the property is not vacuous).
TEST(Attention, SparseEqualsDenseWithAtMost16VisibleBlocks) {
  const uint64_t seed = testing::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const std::vector<RequestSpec> reqs =
      testing::mixed_requests({{0, 1}, {0, 127}, {0, 129}, {2040, 8}, {2030, 30}}, 4, 7, 2040, rng);
  SCOPED_TRACE(testing::describe_requests(reqs));
  BatchOptions o;
  o.n_kv = 2;
  const HostBatch hb = build_batch(reqs, o, rng);
  ASSERT_FALSE(::testing::Test::HasFailure());
  AttnRun dense = make_run(hb, 8, /*sparse=*/false, rng);
  run_ok(dense);
  AttnRun sparse = make_run(hb, 8, /*sparse=*/true, rng);
  std::memcpy(sparse.q.data(), dense.q.data(), dense.q.nbytes());
  select_with_indexer(hb, sparse, rng);
  run_ok(sparse);
  int beyond = 0;
  for (int64_t t = 0; t < hb.num_tokens(); ++t) {
    const int n_valid = hb.position_of(t) / kPageSize + 1;
    if (n_valid <= kTopK) {
      EXPECT_TRUE(rows_equal(dense, t, sparse, t)) << "token " << t << " pos " << hb.position_of(t);
    } else {
      ++beyond;
      EXPECT_FALSE(rows_equal(dense, t, sparse, t)) << "token " << t << " dropped a block";
    }
  }
  EXPECT_GT(beyond, 0);
  expect_matches(dense, reference(hb, dense, 1.0 / std::sqrt(128.0)));

  // Every visible block listed explicitly, shuffled, with gaps and duplicates: still dense.
  for (int64_t t = 0; t < hb.num_tokens(); ++t) {
    const int n_valid = std::min(hb.position_of(t) / kPageSize + 1, kTopK);
    for (int g = 0; g < 2; ++g) {
      int32_t* row = sparse.ids_row(t, g);
      std::vector<int32_t> ids(static_cast<size_t>(n_valid));
      std::iota(ids.begin(), ids.end(), 0);
      ids.resize(kTopK, -1);
      if (n_valid < kTopK) ids[kTopK - 1] = 0;  // a duplicate
      std::shuffle(ids.begin(), ids.end(), rng.engine());
      std::copy(ids.begin(), ids.end(), row);
    }
  }
  run_ok(sparse);
  for (int64_t t = 0; t < hb.num_tokens(); ++t)
    if (hb.position_of(t) / kPageSize + 1 <= kTopK) {
      EXPECT_TRUE(rows_equal(dense, t, sparse, t)) << "token " << t;
    }
}

// A prefill chunk inside one block: token t ignores every later token of its chunk.
TEST(Attention, CausalMaskInsideTheLocalBlock) {
  const uint64_t seed = testing::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  BatchOptions o;
  o.n_kv = 2;
  for (bool sparse : {false, true}) {
    SCOPED_TRACE(sparse ? "sparse" : "dense");
    HostBatch hb = build_batch({{130, 100}}, o, rng);  // positions 130 .. 229, all in block 1
    ASSERT_FALSE(::testing::Test::HasFailure());
    AttnRun run = make_run(hb, 8, sparse, rng);
    select_with_indexer(hb, run, rng);
    run_ok(run);
    expect_matches(run, reference(hb, run, 1.0 / std::sqrt(128.0)));
    const Tensor before = run.out.clone();
    // Make positions 200 .. 229 dominate any softmax that (wrongly) sees them.
    for (int pos = 200; pos < 230; ++pos)
      for (int g = 0; g < 2; ++g)
        for (int d = 0; d < kHeadDim; ++d) {
          const uint8_t q = run.q.ptr<uint8_t>()[((pos - 130) * 8 + 4 * g) * kHeadDim + d];
          hb.kv_row(0, pos, 0, g)[d] = float_to_e4m3(q & 0x80 ? -16.0f : 16.0f);
          hb.kv_row(0, pos, 1, g)[d] = float_to_e4m3(-300.0f);
        }
    run_ok(run);
    for (int64_t t = 0; t < hb.num_tokens(); ++t) {
      const bool same = std::memcmp(before.ptr<uint16_t>() + t * run.row_stride, run.out_row(t),
                                    size_t{8} * kHeadDim * 2) == 0;
      EXPECT_EQ(same, hb.position_of(t) < 200) << "token at position " << hb.position_of(t);
    }
    expect_matches(run, reference(hb, run, 1.0 / std::sqrt(128.0)));
  }
}

// Page stride x3 and a plane stride off the default, same logical content: bit-identical.
TEST(Attention, StridedPoolsAreBitIdentical) {
  const uint64_t seed = testing::fresh_seed();
  M3_SEED_TRACE(seed);
  const std::vector<RequestSpec> reqs = {{2300, 12}, {10, 20}, {3333, 4}, {900, 1}};
  BatchOptions o;
  o.n_kv = 2;
  Rng rng_a(seed), rng_b(seed);
  const HostBatch a = build_batch(reqs, o, rng_a);
  const int64_t tile = int64_t{kPageSize} * kHeadDim;
  o.kv_plane_stride = 2 * tile + 4100;
  o.kv_page_stride = 3 * (4 * tile);
  const HostBatch b = build_batch(reqs, o, rng_b);
  ASSERT_FALSE(::testing::Test::HasFailure());
  ASSERT_EQ(b.kv_page_stride(), 3 * a.kv_page_stride());
  for (bool sparse : {false, true}) {
    SCOPED_TRACE(sparse ? "sparse" : "dense");
    AttnRun ra = make_run(a, 8, sparse, rng_a);
    AttnRun rb = make_run(b, 8, sparse, rng_b);
    ASSERT_EQ(std::memcmp(ra.q.data(), rb.q.data(), ra.q.nbytes()), 0);
    select_randomly(a, ra, rng_a);
    select_randomly(b, rb, rng_b);
    ASSERT_EQ(std::memcmp(ra.ids.data(), rb.ids.data(), ra.ids.nbytes()), 0);
    run_ok(ra);
    run_ok(rb);
    EXPECT_EQ(std::memcmp(ra.out.data(), rb.out.data(), ra.out.nbytes()), 0);
    expect_matches(rb, reference(b, rb, 1.0 / std::sqrt(128.0)));
  }
}

// Query head j reads KV head j / (n_q / n_kv): constant V per KV head makes it visible exactly.
TEST(Attention, GqaHeadMapping) {
  const uint64_t seed = testing::fresh_seed();
  M3_SEED_TRACE(seed);
  for (int n_kv : {1, 2}) {
    Rng rng(seed + static_cast<uint64_t>(n_kv));
    BatchOptions o;
    o.n_kv = n_kv;
    HostBatch hb = build_batch({{2500, 3}, {0, 17}}, o, rng);
    ASSERT_FALSE(::testing::Test::HasFailure());
    for (int r = 0; r < 2; ++r)
      for (int pos = 0; pos < hb.seq_len(r); ++pos)
        for (int g = 0; g < n_kv; ++g)
          std::fill(hb.kv_row(r, pos, 1, g), hb.kv_row(r, pos, 1, g) + kHeadDim,
                    float_to_e4m3(g == 0 ? 1.0f : -2.0f));
    const int n_q = 4 * n_kv;
    AttnRun run = make_run(hb, n_q, /*sparse=*/true, rng);
    select_with_indexer(hb, run, rng);
    run_ok(run);
    for (int64_t t = 0; t < hb.num_tokens(); ++t)
      for (int j = 0; j < n_q; ++j)
        for (int d = 0; d < kHeadDim; ++d)
          ASSERT_EQ(bf16_to_float(run.out_row(t)[j * kHeadDim + d]), j / 4 == 0 ? 1.0f : -2.0f)
              << "token " << t << " head " << j;
  }
}

// A (token, KV head) whose ids select nothing (no local block: a broken indexer) gets zeros;
// other heads are unaffected.
TEST(Attention, NoKeysGivesZeros) {
  const uint64_t seed = testing::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  BatchOptions o;
  o.n_kv = 2;
  const HostBatch hb = build_batch({{1000, 2}, {5, 1}}, o, rng);
  ASSERT_FALSE(::testing::Test::HasFailure());
  AttnRun run = make_run(hb, 8, /*sparse=*/true, rng);
  select_with_indexer(hb, run, rng);
  std::fill(run.ids_row(0, 1), run.ids_row(0, 1) + kTopK, -1);
  std::fill(run.ids_row(2, 0), run.ids_row(2, 0) + kTopK, 1);  // only a block past position 5
  run_ok(run);
  for (int j = 4; j < 8; ++j)
    for (int d = 0; d < kHeadDim; ++d) ASSERT_EQ(run.out_row(0)[j * kHeadDim + d], 0);
  for (int j = 0; j < 4; ++j)
    for (int d = 0; d < kHeadDim; ++d) ASSERT_EQ(run.out_row(2)[j * kHeadDim + d], 0);
  expect_matches(run, reference(hb, run, 1.0 / std::sqrt(128.0)));
}

// A token's row depends only on its own query and request: each request run alone reproduces
// the batched rows bit for bit.
TEST(Attention, RowsDoNotDependOnBatching) {
  const uint64_t seed = testing::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  const std::vector<RequestSpec> reqs =
      testing::mixed_requests({{400, 30}, {2600, 6}}, 3, 2, 3000, rng);
  BatchOptions o;
  o.n_kv = 2;
  HostBatch hb = build_batch(reqs, o, rng);
  ASSERT_FALSE(::testing::Test::HasFailure());
  AttnRun run = make_run(hb, 8, /*sparse=*/true, rng);
  select_with_indexer(hb, run, rng);
  run_ok(run);
  const int32_t* qs = hb.query_start.ptr<int32_t>();
  for (int r = 0; r < hb.num_requests(); ++r) {
    const int64_t t0 = qs[r], n = qs[r + 1] - qs[r];
    int32_t one_qs[2] = {0, static_cast<int32_t>(n)};
    Tensor out(DType::kBF16, {n, 8 * kHeadDim});
    out.fill_bytes(0xff);
    AttentionParams p = run.params;
    p.batch.num_tokens = n;
    p.batch.num_requests = 1;
    p.batch.query_start = TensorView::contiguous(one_qs, DType::kI32, {2});
    p.batch.positions = TensorView::contiguous(hb.positions.ptr<int32_t>() + t0, DType::kI32, {n});
    p.batch.seq_lens =
        TensorView::contiguous(hb.seq_lens.ptr<int32_t>() + r, DType::kI32, {int64_t{1}});
    p.batch.page_table =
        TensorView::contiguous(hb.page_table.ptr<int32_t>() + int64_t{r} * hb.max_pages(),
                               DType::kI32, {int64_t{1}, int64_t{hb.max_pages()}});
    p.q = TensorView::contiguous(run.q.ptr<uint8_t>() + t0 * 8 * kHeadDim, DType::kE4M3,
                                 {n, 8, kHeadDim});
    p.block_ids =
        TensorView::contiguous(run.ids.ptr<int32_t>() + t0 * 2 * kTopK, DType::kI32, {n, 2, kTopK});
    p.out = out.view();
    const Status st = run_attention_cpu(p);
    ASSERT_TRUE(st.ok()) << st.to_string();
    for (int64_t i = 0; i < n; ++i)
      EXPECT_EQ(std::memcmp(out.ptr<uint16_t>() + i * 8 * kHeadDim, run.out_row(t0 + i),
                            size_t{8} * kHeadDim * 2),
                0)
          << "request " << r << " token " << i;
  }
}

TEST(Attention, EmptyBatchIsANoOp) {
  Rng rng(3);
  BatchOptions o;
  o.n_kv = 2;
  const HostBatch hb = build_batch({}, o, rng);
  ASSERT_FALSE(::testing::Test::HasFailure());
  AttnRun run = make_run(hb, 8, /*sparse=*/true, rng);
  run_ok(run);
  for (int64_t i = 0; i < kGuard; ++i) EXPECT_EQ(run.out.ptr<uint16_t>()[i], kPoison);
}

}  // namespace
}  // namespace m3attn
