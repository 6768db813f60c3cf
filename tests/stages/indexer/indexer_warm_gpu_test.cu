// GPU tests of IndexerCudaOptions::warm_select (the clustered single pass: the first warp of each
// selecting CTA to finish its blocks runs the final selection once on a scratch row, and every
// row is then ranked by the same out-of-line code): the ids must equal those of the two-kernel
// path (itself checked against the twin) for clusters of 2, 4 and 8 CTAs, at one token per
// request (rank 0's warps select) and four (every CTA's warps select, rows shared), with NaN
// keys, requests whose rows are trivial (<= 16 visible blocks) and CTAs without blocks. The same
// for IndexerCudaOptions::single_pass_ring 4 (4-tile rings per warp), with and without it.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "indexer_gpu_test_util.h"

namespace m3attn::indexer_gpu_test {
namespace {

TEST(IndexerGpu, ClusterOptionsSameIds) {
  M3_REQUIRE_GPU();
  const uint64_t seed = mt::fresh_seed();
  M3_SEED_TRACE(seed);
  Rng rng(seed);
  for (int tokens : {1, 4}) {
    std::vector<RequestSpec> reqs;
    for (int ctx : {8192, 8000, 5000, 4097, 2049, 1000, 129})
      reqs.push_back({ctx - tokens, tokens});
    Inputs in = make_inputs(reqs, 4, rng, /*integer=*/true, 0, /*extra_cols=*/0);
    ASSERT_FALSE(::testing::Test::HasFailure());
    in.hb.index_row(0, 31 * 128 + 7)[9] = 0x7f;  // NaN keys in request 0's blocks 31 and 62
    in.hb.index_row(0, 62 * 128 + 100)[40] = 0x7f;
    DeviceSet d;
    upload(in, d);
    IndexerCudaOptions two;
    two.unfused_decode = true;
    const std::string label = std::to_string(tokens) + " token(s) per request";
    const GpuResult g = run_gpu(d, two);
    compare(in, reference(in), g, /*exact_scores=*/true, label + " [two-kernel]");
    for (int ctas : {2, 4, 8}) {
      for (int ring : {0, 4}) {
        for (bool warm : {false, true}) {
          if (ring == 0 && !warm) continue;  // the default: every other indexer test
          IndexerCudaOptions o;
          o.single_pass = true;
          o.single_pass_ctas = ctas;
          o.single_pass_ring = ring;
          o.warm_select = warm;
          expect_same_ids(in, run_gpu(d, o), g,
                          label + " [cluster " + std::to_string(ctas) + ", ring " +
                              std::to_string(ring) + (warm ? ", warm_select]" : "]"));
        }
      }
    }
  }
}

}  // namespace
}  // namespace m3attn::indexer_gpu_test
