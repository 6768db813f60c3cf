// Tensor parallelism simulated on ONE GPU (no NCCL): for P in {1, 2, 4, 8} the P rank layers
// (CudaMsaLayer over pack_rank weights: rank geometries n_q 64/32/16/8 with n_kv 4/2/1/1, the
// KV heads replicated at P = 8) run the same prefill, mixed and decode-with-drafts steps as the
// TP1 layer; their partials summed (fp32, one rounding) stay within the bound of
// src/dist/tp_check.h, and P = 1 is bit-identical to TP1. This is the GPU kernels' evidence for
// the TP4 / TP8 geometries that no machine here can run over NCCL.
#include <gtest/gtest.h>

#include <iostream>

#include "dist/tp_check.h"
#include "support/cuda_test_util.h"
#include "support/test_util.h"

namespace m3attn {
namespace {

using namespace m3attn::testing;  // NOLINT(build/namespaces)

void check_simulated(const MsaGeometry& g, bool sparse, bool fused, const std::vector<int>& sizes,
                     uint64_t seed) {
  TpCheckOptions o;
  o.geometry = g;
  o.sparse = sparse;
  o.fused = fused;
  o.seed = seed;
  o.prompt1 = 130;  // off the 128-token page
  o.prompt2 = 21;
  o.chunk = 9;
  o.draft_len = 2;
  std::vector<TpCheckReport> reps;
  const Status s = run_tp_check_simulated(o, sizes, 0, &reps);
  ASSERT_TRUE(s.ok()) << s.to_string();
  ASSERT_EQ(reps.size(), sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "TP" << sizes[i]);
    std::cout << "TP" << sizes[i] << " (" << (sparse ? "sparse" : "dense") << ", "
              << (fused ? "fused" : "unfused") << ", " << g.to_string() << "):\n"
              << reps[i].to_text();
    ASSERT_EQ(reps[i].steps.size(), 3u);
    for (const TpComparison& c : reps[i].steps) {
      EXPECT_TRUE(c.pass()) << c.to_text();
      EXPECT_EQ(c.tp_size, sizes[i]);
      if (sizes[i] == 1) {
        EXPECT_EQ(c.identical, c.elements) << "TP1 through the rank path must be bit-identical";
        EXPECT_EQ(c.core_differ, 0);
      }
    }
  }
}

TEST(TpSimGpuTest, RankPartialsSumToTp1M3SparseFused) {
  M3_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  check_simulated(MsaGeometry::m3(), /*sparse=*/true, /*fused=*/true, {1, 2, 4, 8}, seed);
}

TEST(TpSimGpuTest, RankPartialsSumToTp1SmallUnfusedAndDense) {
  M3_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  M3_SEED_TRACE(seed);
  MsaGeometry g;
  g.hidden = 1024;
  g.n_q = 8;
  g.n_kv = 2;
  check_simulated(g, /*sparse=*/true, /*fused=*/false, {2, 4}, seed);
  check_simulated(g, /*sparse=*/false, /*fused=*/false, {2, 8}, seed + 1);
}

TEST(TpSimGpuTest, RejectsBadSizes) {
  M3_REQUIRE_GPU();
  TpCheckOptions o;
  o.geometry = MsaGeometry::m3();
  std::vector<TpCheckReport> reps;
  EXPECT_EQ(run_tp_check_simulated(o, {}, 0, &reps).code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(run_tp_check_simulated(o, {3}, 0, &reps).ok()) << "64 heads do not split 3 ways";
  EXPECT_FALSE(run_tp_check_simulated(o, {0}, 0, &reps).ok());
  EXPECT_TRUE(reps.empty());
}

}  // namespace
}  // namespace m3attn
