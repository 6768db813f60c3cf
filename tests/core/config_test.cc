#include "m3attn/config.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>

namespace m3attn {
namespace {

TEST(MsaGeometry, M3Defaults) {
  const MsaGeometry g = MsaGeometry::m3();
  EXPECT_TRUE(g.validate().ok());
  EXPECT_EQ(g.hidden, 6144);
  EXPECT_EQ(g.n_q, 64);
  EXPECT_EQ(g.n_kv, 4);
  EXPECT_EQ(g.n_idx(), 4);
  EXPECT_EQ(g.group_size(), 16);
  EXPECT_FLOAT_EQ(g.rope_theta, 5e6f);
  EXPECT_FLOAT_EQ(g.eps, 1e-6f);
  // [Q | K | V | index-Q | index-K] = 64 + 4 + 4 + 4 + 1 heads.
  EXPECT_EQ(g.packed_heads(), 77);
  EXPECT_EQ(g.packed_width(), 9856);
  EXPECT_EQ(g.q_col(), 0);
  EXPECT_EQ(g.k_col(), 64 * 128);
  EXPECT_EQ(g.v_col(), 68 * 128);
  EXPECT_EQ(g.iq_col(), 72 * 128);
  EXPECT_EQ(g.ik_col(), 76 * 128);
  EXPECT_EQ(g.ik_col() + 128, g.packed_width());
  EXPECT_NE(g.to_string().find("packed width 9856"), std::string::npos) << g.to_string();
  EXPECT_EQ(kHeadDim, 128);
  EXPECT_EQ(kRotaryDim, 64);
  EXPECT_EQ(kRotaryHalf, 32);
  EXPECT_EQ(kPageSize, 128);
  EXPECT_EQ(kTopK, 16);
}

TEST(MsaGeometry, TensorParallelRanksPerSpec) {
  struct Want {
    int p, n_q, n_kv, heads;
  };
  for (const Want& w :
       {Want{1, 64, 4, 77}, Want{2, 32, 2, 39}, Want{4, 16, 1, 20}, Want{8, 8, 1, 12}}) {
    SCOPED_TRACE(w.p);
    auto g = MsaGeometry::m3_tp(w.p);
    ASSERT_TRUE(g.ok()) << g.status().to_string();
    EXPECT_EQ(g.value().n_q, w.n_q);
    EXPECT_EQ(g.value().n_kv, w.n_kv);
    EXPECT_EQ(g.value().packed_heads(), w.heads);
    EXPECT_EQ(g.value().packed_width(), int64_t{w.heads} * 128);
    EXPECT_EQ(g.value().hidden, 6144);
    EXPECT_TRUE(g.value().validate().ok());
  }
  for (int p : {0, -1, 3, 6, 16, 64}) {
    auto g = MsaGeometry::m3_tp(p);
    EXPECT_FALSE(g.ok()) << p;
    EXPECT_EQ(g.status().code(), StatusCode::kUnsupported);
    EXPECT_NE(g.status().message().find("tensor-parallel size " + std::to_string(p)),
              std::string::npos);
  }
}

TEST(MsaGeometry, ValidateRejectsEachRule) {
  struct Case {
    const char* what;
    void (*mutate)(MsaGeometry&);
    const char* needle;
  };
  const float nan = std::numeric_limits<float>::quiet_NaN();
  static float s_nan;
  s_nan = nan;
  const Case cases[] = {
      {"hidden 0", [](MsaGeometry& g) { g.hidden = 0; }, "hidden size 0"},
      {"hidden 100", [](MsaGeometry& g) { g.hidden = 100; },
       "hidden size 100 must be a positive multiple of 128"},
      {"hidden -128", [](MsaGeometry& g) { g.hidden = -128; }, "hidden size -128"},
      {"n_q 0", [](MsaGeometry& g) { g.n_q = 0; }, "query head count must be > 0, got 0"},
      {"n_kv 0", [](MsaGeometry& g) { g.n_kv = 0; }, "KV head count must be > 0, got 0"},
      {"n_kv -1", [](MsaGeometry& g) { g.n_kv = -1; }, "KV head count must be > 0, got -1"},
      {"group", [](MsaGeometry& g) { g.n_kv = 3; },
       "query heads 64 must be a multiple of KV heads 3"},
      {"eps 0", [](MsaGeometry& g) { g.eps = 0; }, "eps must be finite and > 0"},
      {"eps < 0", [](MsaGeometry& g) { g.eps = -1e-6f; }, "eps must be finite and > 0"},
      {"eps nan", [](MsaGeometry& g) { g.eps = s_nan; }, "eps must be finite and > 0"},
      {"eps inf", [](MsaGeometry& g) { g.eps = INFINITY; }, "eps must be finite and > 0"},
      {"theta 0", [](MsaGeometry& g) { g.rope_theta = 0; }, "rope theta must be finite and > 0"},
      {"theta nan", [](MsaGeometry& g) { g.rope_theta = s_nan; }, "rope theta must be finite"},
      {"theta inf", [](MsaGeometry& g) { g.rope_theta = INFINITY; }, "rope theta must be finite"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    MsaGeometry g;
    c.mutate(g);
    const Status s = g.validate();
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find(c.needle), std::string::npos) << s.to_string();
  }
  // Small geometries used by the CPU tests are valid.
  MsaGeometry small;
  small.hidden = 256;
  small.n_q = 8;
  small.n_kv = 2;
  EXPECT_TRUE(small.validate().ok());
  EXPECT_EQ(small.packed_width(), (8 + 2 + 2 + 2 + 1) * 128);
}

}  // namespace
}  // namespace m3attn
