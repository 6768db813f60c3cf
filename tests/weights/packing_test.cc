#include "weights/packing.h"

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "support/test_util.h"

namespace m3attn {
namespace {

using testing::fresh_seed;

MsaGeometry geometry(int hidden, int n_q, int n_kv) {
  MsaGeometry g;
  g.hidden = hidden;
  g.n_q = n_q;
  g.n_kv = n_kv;
  return g;
}

// Head `h` (128 rows of w, one row of scales) of `m` equals head `h_ref` of `ref`, byte for byte.
::testing::AssertionResult same_head(const QuantizedMatrix& m, int h, const QuantizedMatrix& ref,
                                     int h_ref) {
  const int64_t k = m.cols();
  if (ref.cols() != k) return ::testing::AssertionFailure() << "column counts differ";
  const int64_t kb = k / 128;
  if (std::memcmp(m.w.ptr<uint8_t>() + int64_t{h} * 128 * k,
                  ref.w.ptr<uint8_t>() + int64_t{h_ref} * 128 * k, 128 * k) != 0)
    return ::testing::AssertionFailure() << "weights of head " << h << " != ref head " << h_ref;
  if (std::memcmp(m.scales.ptr<float>() + h * kb, ref.scales.ptr<float>() + h_ref * kb,
                  kb * sizeof(float)) != 0)
    return ::testing::AssertionFailure() << "scales of head " << h << " != ref head " << h_ref;
  return ::testing::AssertionSuccess();
}

TEST(Packing, RankGeometryMatchesSpecForM3) {
  const int want_heads[] = {77, 39, 20, 12};
  int i = 0;
  for (int p : {1, 2, 4, 8}) {
    SCOPED_TRACE(p);
    auto g = rank_geometry(MsaGeometry::m3(), p);
    ASSERT_TRUE(g.ok()) << g.status().to_string();
    auto spec = MsaGeometry::m3_tp(p);
    ASSERT_TRUE(spec.ok());
    EXPECT_EQ(g.value().n_q, spec.value().n_q);
    EXPECT_EQ(g.value().n_kv, spec.value().n_kv);
    EXPECT_EQ(g.value().packed_heads(), want_heads[i]);
    EXPECT_EQ(g.value().packed_width(), int64_t{want_heads[i]} * 128);
    ++i;
  }
  // SPEC: for P > 4 the KV head of rank r is r / (P / 4).
  for (int r = 0; r < 8; ++r) {
    auto h = rank_heads(MsaGeometry::m3(), 8, r);
    ASSERT_TRUE(h.ok());
    EXPECT_EQ(h.value().q_begin, r * 8);
    EXPECT_EQ(h.value().q_end, r * 8 + 8);
    EXPECT_EQ(h.value().kv_begin, r / 2);
    EXPECT_EQ(h.value().kv_end, r / 2 + 1);
  }
  auto h2 = rank_heads(MsaGeometry::m3(), 2, 1);
  ASSERT_TRUE(h2.ok());
  EXPECT_EQ(h2.value().q_begin, 32);
  EXPECT_EQ(h2.value().kv_begin, 2);
  EXPECT_EQ(h2.value().kv_end, 4);
}

TEST(Packing, RejectsBadParallelism) {
  auto expect = [](Result<RankHeads> r, StatusCode code, const char* needle) {
    ASSERT_FALSE(r.ok()) << needle;
    EXPECT_EQ(r.status().code(), code);
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().to_string();
  };
  const MsaGeometry m3 = MsaGeometry::m3();
  expect(rank_heads(m3, 3, 0), StatusCode::kUnsupported, "tensor-parallel size 3");
  expect(rank_heads(m3, 16, 0), StatusCode::kUnsupported, "tensor-parallel size 16");
  expect(rank_heads(m3, 4, 4), StatusCode::kInvalidArgument, "rank 4 is outside [0, 4)");
  expect(rank_heads(m3, 4, -1), StatusCode::kInvalidArgument, "rank -1 is outside");
  expect(rank_heads(geometry(256, 4, 4), 8, 0), StatusCode::kInvalidArgument,
         "query heads 4 do not split over 8 ranks");
  expect(rank_heads(geometry(256, 6, 3), 2, 0), StatusCode::kInvalidArgument,
         "KV heads 3 do not split over 2 ranks");
  expect(rank_heads(geometry(256, 12, 3), 4, 0), StatusCode::kInvalidArgument,
         "not a multiple of the KV heads 3");
  expect(rank_heads(geometry(200, 8, 2), 2, 0), StatusCode::kInvalidArgument, "hidden size 200");
}

// Packs every rank of a geometry and checks each segment against the TP1 weights, head by head,
// with the head indices computed straight from the SPEC rules.
void check_all_ranks(const AttentionWeights& w, int p) {
  const MsaGeometry& g = w.geometry;
  const int q_per = g.n_q / p;
  const int kv_per = p <= g.n_kv ? g.n_kv / p : 1;
  std::vector<PackedRankWeights> ranks;
  for (int r = 0; r < p; ++r) {
    auto packed = pack_rank(w, p, r);
    ASSERT_TRUE(packed.ok()) << packed.status().to_string();
    ranks.push_back(std::move(packed).value());
  }
  for (int r = 0; r < p; ++r) {
    SCOPED_TRACE(::testing::Message() << "P " << p << " rank " << r);
    const PackedRankWeights& pr = ranks[r];
    EXPECT_EQ(pr.tp_size, p);
    EXPECT_EQ(pr.tp_rank, r);
    EXPECT_EQ(pr.geometry.n_q, q_per);
    EXPECT_EQ(pr.geometry.n_kv, kv_per);
    EXPECT_EQ(pr.geometry.hidden, g.hidden);
    ASSERT_TRUE(pr.fused.validate("fused").ok());
    EXPECT_EQ(pr.fused.rows(), pr.geometry.packed_width());
    EXPECT_EQ(pr.fused.cols(), g.hidden);
    EXPECT_EQ(pr.qkv.rows(), int64_t{q_per + 2 * kv_per} * 128);
    EXPECT_EQ(pr.index.rows(), int64_t{kv_per + 1} * 128);
    EXPECT_EQ(pr.o.rows(), g.hidden);
    EXPECT_EQ(pr.o.cols(), int64_t{q_per} * 128);

    // fused == qkv ++ index, byte for byte (weights and scales).
    const int64_t k = g.hidden;
    EXPECT_EQ(std::memcmp(pr.fused.w.data(), pr.qkv.w.data(), pr.qkv.w.nbytes()), 0);
    EXPECT_EQ(std::memcmp(pr.fused.w.ptr<uint8_t>() + pr.qkv.rows() * k, pr.index.w.data(),
                          pr.index.w.nbytes()),
              0);
    EXPECT_EQ(std::memcmp(pr.fused.scales.data(), pr.qkv.scales.data(), pr.qkv.scales.nbytes()), 0);
    EXPECT_EQ(std::memcmp(pr.fused.scales.ptr<float>() + pr.qkv.scales.numel(),
                          pr.index.scales.data(), pr.index.scales.nbytes()),
              0);

    // Segment by segment against TP1 heads from the SPEC formulas.
    const int kv0 = p <= g.n_kv ? r * g.n_kv / p : r / (p / g.n_kv);
    int row = 0;
    for (int i = 0; i < q_per; ++i) EXPECT_TRUE(same_head(pr.fused, row++, w.q, r * q_per + i));
    for (int i = 0; i < kv_per; ++i) EXPECT_TRUE(same_head(pr.fused, row++, w.k, kv0 + i));
    for (int i = 0; i < kv_per; ++i) EXPECT_TRUE(same_head(pr.fused, row++, w.v, kv0 + i));
    for (int i = 0; i < kv_per; ++i) EXPECT_TRUE(same_head(pr.fused, row++, w.index_q, kv0 + i));
    EXPECT_TRUE(same_head(pr.fused, row++, w.index_k, 0));  // replicated on every rank
    EXPECT_EQ(row, pr.geometry.packed_heads());

    // o_proj columns of this rank's heads.
    const int64_t cols = int64_t{q_per} * 128, full = int64_t{g.n_q} * 128;
    for (int64_t n = 0; n < g.hidden; ++n)
      ASSERT_EQ(std::memcmp(pr.o.w.ptr<uint8_t>() + n * cols,
                            w.o.w.ptr<uint8_t>() + n * full + int64_t{r} * cols, cols),
                0)
          << "o row " << n;
    for (int64_t nb = 0; nb < g.hidden / 128; ++nb)
      for (int j = 0; j < q_per; ++j)
        EXPECT_EQ(pr.o.scales.ptr<float>()[nb * q_per + j],
                  w.o.scales.ptr<float>()[nb * g.n_q + r * q_per + j]);

    // Norm weights are shared by all heads and copied to every rank.
    EXPECT_EQ(std::memcmp(pr.q_norm.data(), w.q_norm.data(), 256), 0);
    EXPECT_EQ(std::memcmp(pr.k_norm.data(), w.k_norm.data(), 256), 0);
    EXPECT_EQ(std::memcmp(pr.index_q_norm.data(), w.index_q_norm.data(), 256), 0);
    EXPECT_EQ(std::memcmp(pr.index_k_norm.data(), w.index_k_norm.data(), 256), 0);
  }
  // Concatenating the ranks' Q slabs reproduces TP1 Q exactly.
  std::vector<uint8_t> q_cat;
  std::vector<float> qs_cat;
  for (const PackedRankWeights& pr : ranks) {
    const auto* b = pr.qkv.w.ptr<uint8_t>();
    q_cat.insert(q_cat.end(), b, b + int64_t{q_per} * 128 * g.hidden);
    const float* s = pr.qkv.scales.ptr<float>();
    qs_cat.insert(qs_cat.end(), s, s + int64_t{q_per} * (g.hidden / 128));
  }
  ASSERT_EQ(static_cast<int64_t>(q_cat.size()), w.q.w.nbytes());
  EXPECT_EQ(std::memcmp(q_cat.data(), w.q.w.data(), q_cat.size()), 0);
  ASSERT_EQ(static_cast<int64_t>(qs_cat.size()), w.q.scales.numel());
  EXPECT_EQ(std::memcmp(qs_cat.data(), w.q.scales.data(), w.q.scales.nbytes()), 0);
}

TEST(Packing, M3HeadCountsWithTinyHidden) {
  // Full M3 head counts, hidden 128 to stay fast: widths 77 / 39 / 20 / 12 heads.
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  MsaGeometry g = MsaGeometry::m3();
  g.hidden = 128;
  auto w = random_attention_weights(g, seed);
  ASSERT_TRUE(w.ok()) << w.status().to_string();
  for (int p : {1, 2, 4, 8}) check_all_ranks(w.value(), p);
  auto p1 = pack_rank(w.value(), 1, 0);
  ASSERT_TRUE(p1.ok());
  EXPECT_EQ(p1.value().fused.rows(), 9856);
}

TEST(Packing, SmallGeometryFollowsTheSameRules) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  // n_kv 2: P = 4 and 8 replicate each KV head on 2 and 4 ranks.
  auto w = random_attention_weights(geometry(256, 8, 2), seed);
  ASSERT_TRUE(w.ok()) << w.status().to_string();
  for (int p : {1, 2, 4, 8}) check_all_ranks(w.value(), p);
  auto w1 = random_attention_weights(geometry(384, 4, 1), seed + 1);
  ASSERT_TRUE(w1.ok());
  for (int p : {1, 2, 4}) check_all_ranks(w1.value(), p);
}

TEST(Packing, DenseLayerPacksQkvOnly) {
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  auto w = random_attention_weights(geometry(256, 8, 2), seed, /*sparse=*/false);
  ASSERT_TRUE(w.ok());
  EXPECT_TRUE(w.value().validate().ok());
  auto p = pack_rank(w.value(), 2, 1);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_FALSE(p.value().sparse);
  EXPECT_EQ(p.value().fused.rows(), 0);
  EXPECT_EQ(p.value().index.rows(), 0);
  EXPECT_EQ(p.value().qkv.rows(), (4 + 2 * 1) * 128);
  EXPECT_TRUE(same_head(p.value().qkv, 0, w.value().q, 4));
  EXPECT_TRUE(same_head(p.value().qkv, 4, w.value().k, 1));
  EXPECT_TRUE(same_head(p.value().qkv, 5, w.value().v, 1));
}

TEST(Packing, RandomWeightsAreDeterministicAndScaled) {
  const MsaGeometry g = geometry(256, 4, 2);
  auto a = random_attention_weights(g, 42);
  auto b = random_attention_weights(g, 42);
  auto c = random_attention_weights(g, 43);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(std::memcmp(a.value().q.w.data(), b.value().q.w.data(), a.value().q.w.nbytes()), 0);
  EXPECT_NE(std::memcmp(a.value().q.w.data(), c.value().q.w.data(), a.value().q.w.nbytes()), 0);
  // Row norms of W ~ 1 (std 1/sqrt(K) over K entries): projections of O(1) inputs are O(1).
  auto deq = dequantize(a.value().q);
  ASSERT_TRUE(deq.ok());
  double sum_sq = 0;
  for (int64_t i = 0; i < deq.value().numel(); ++i)
    sum_sq += double{deq.value().ptr<float>()[i]} * deq.value().ptr<float>()[i];
  const double mean_row_sq = sum_sq / a.value().q.rows();
  EXPECT_GT(mean_row_sq, 0.8);
  EXPECT_LT(mean_row_sq, 1.2);
  EXPECT_FALSE(random_attention_weights(geometry(100, 4, 2), 1).ok());
}

TEST(Packing, ValidateRejectsInconsistentWeights) {
  auto w = random_attention_weights(geometry(256, 4, 2), 7);
  ASSERT_TRUE(w.ok());
  AttentionWeights bad = std::move(w).value();
  bad.geometry.n_kv = 1;
  auto st = bad.validate();
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("k_proj must be [128, 256], got [256, 256]"), std::string::npos)
      << st.to_string();
  EXPECT_FALSE(pack_rank(bad, 1, 0).ok());
  bad.geometry.n_kv = 2;
  bad.q_norm = Tensor(DType::kF32, {128});
  st = bad.validate();
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("q_norm must be bf16 [128]"), std::string::npos) << st.to_string();
}

}  // namespace
}  // namespace m3attn
